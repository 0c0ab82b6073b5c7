"""The errors of the worker side, in one module that both clients (and the aggregator) import.

* :class:`AllreduceError`: an allreduce could not complete (switch path or host-aggregator path);
  the message says what was missing. After it, the client that raised it is unusable.
* :class:`FrameError`: bytes that break the host-aggregator frame format (:mod:`ina.host_wire`);
  ``reason`` is the counter the aggregator counts it under.
* :class:`ConnectionGone`: the host-aggregator peer closed its TCP connection.
"""
from __future__ import annotations


class AllreduceError(RuntimeError):
    """An allreduce could not complete; the message says what was missing."""


class FrameError(ValueError):
    """A frame that breaks the host-aggregator format; ``reason`` is the counter it is counted under."""

    def __init__(self, reason: str, text: str):
        super().__init__(text)
        self.reason = reason


class ConnectionGone(ConnectionError):
    """The peer closed the connection (at a frame boundary, or ``partial`` bytes into a frame)."""

    def __init__(self, partial: int = 0, what: str = ""):
        super().__init__(what or "connection closed")
        self.partial = partial
