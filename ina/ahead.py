"""The next allreduce's exponent negotiation, sent while the current allreduce streams.

Every allreduce of :class:`ina.client.Client` starts with an exponent negotiation: one payload-less packet
per value, whose results are the switch's maxima, on the next chunk ids of the job's sequence. Those ids
may go out as soon as the slot protocol lets them (chunk c once the result of chunk c - slots is back:
the rule a data stream follows for its own chunks, so the switch holds no round of theirs that a peer
may still need replayed, ina.wire.slot_of_chunk), which is up to a window before the current stream
ends. A caller that names its next allreduce (``Client.allreduce(..., following=...)``) has that
allreduce's negotiation sent from inside the current data stream as soon as its ids may go, and its
results taken by the same receive loop (:meth:`ina.transfer.Transfer.take`); the next allreduce then
starts with its maxima back, or waits only for the rest of their round trip (which also covers the
other ranks' start: their negotiation packets complete the rounds, whenever they send them).

The ranks need not agree on whether a negotiation went ahead: the switch sees the same packets on the
same chunk ids either way, only earlier. What they must agree on is the sequence of allreduces, as
without it: ``following`` may name only an allreduce that every rank will make next (the framework
lanes name one only after its agreement round said it goes through the switch,
gloo_patch.torch_backend), and the client checks that the allreduce made next is the one named (another
one would pair its negotiation with the peers' next: it raises and the client is unusable). Losses are
recovered as in any stream (the negotiation is a :class:`~ina.transfer.Transfer` of its own, with its
own loss detector), and its wait is bounded by the client's timeout like every other. A data stream
that fails leaves the client unusable (:meth:`ina.client.Client.allreduce`), a negotiation sent ahead
included.
"""
from __future__ import annotations

import numpy as np

from . import staging
from .transfer import Transfer
from .wire import PayloadType


class Ahead:
    """A negotiation sent ahead: for which allreduce (``tensor``, ``codec`` name), the values proposed and
    its :class:`~ina.transfer.Transfer` (results may still be out)."""

    def __init__(self, tensor, codec: str, proposals: np.ndarray, transfer: Transfer):
        self.tensor, self.codec, self.proposals, self.transfer = tensor, codec, proposals, transfer

    def done(self) -> bool:
        return self.transfer.n_done == self.transfer.n_chunks

    def finish(self, meanwhile=None) -> np.ndarray:
        """The maxima: run ``meanwhile()`` first if results are still out, then wait for them (bounded by the
        client's timeout, as every stream)."""
        if not self.done() and meanwhile is not None:
            meanwhile()
        return self.transfer.loop()


class Rider:
    """While a data stream of ``n_chunks`` runs (:meth:`ina.transfer.Transfer.loop`'s ``rider``): once the
    next id may go, ask ``following()`` for the next allreduce ((tensor, codec name) or None while unknown),
    send its negotiation once all its ids may go, then take its results from the stream's bursts and resend
    what is lost."""

    def __init__(self, cl, following, n_chunks: int):
        self.cl, self.following, self.n_chunks = cl, following, n_chunks
        self.named = None           # (tensor, codec, its proposals): following() named it, not sent yet
        self.asked = False          # following() named an allreduce: asked no more
        self.sent: Ahead | None = None

    def turn(self, stream: Transfer, k: int, now: float) -> None:
        cl = self.cl
        if self.sent is None:
            free = stream.low - self.n_chunks + cl.slots       # ids from the stream's end on that may go
            if not self.asked and free >= 1:
                self._name()
            if self.named is not None and free >= self.named[2].size:
                self._send(*self.named)
            return
        t = self.sent.transfer
        if t.n_done == t.n_chunks:
            return
        wait = cl._rx_wait            # the stream's own next deadline stays the receive's bound
        t.drained = stream.drained    # (a full burst: results may still wait in the socket)
        if k:
            t.take(k, now)
        if t.n_done < t.n_chunks and not t.checked:
            t.retransmit_lost(now)
        t.checked = False
        cl._rx_wait = min(wait, cl._rx_wait)

    def _name(self) -> None:
        nxt = self.following()
        if nxt is None:
            return
        self.asked = True
        tensor, codec = nxt
        c = self.cl.codec(codec)
        if not self.cl.negotiates(c, tensor) or staging.on_device(tensor):
            return                  # (a CUDA tensor: the caller's streams may still write it)
        try:
            self.named = tensor, codec, self.cl.proposals(c, staging.to_host(tensor))
        except ValueError:          # NaN/Inf: the allreduce raises (or the caller skips it) as without ahead
            return

    def _send(self, tensor, codec: str, proposals: np.ndarray) -> None:
        cl = self.cl
        t = Transfer(cl, cl.take_ids(proposals.size), proposals.size, PayloadType.NONE, cl.codec(codec).wire_id,
                     proposals, PayloadType.NONE, 0, None, None)
        t.send_new(np.arange(proposals.size))
        cl.stats.negotiations_ahead += 1
        self.sent = cl.ahead = Ahead(tensor, codec, proposals, t)
