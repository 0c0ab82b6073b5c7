"""How long this machine keeps a runnable worker waiting for a core: the floor of the loss timers.

On a machine with fewer cores than busy processes (8 workers and a switch on 2 cores), a worker or the
switch waits on the run queue for milliseconds at a time. While it waits, every other worker of the
job hears nothing, and a tail probe or retransmission timeout shorter than that wait resends chunks
that are not lost (measured: 8 workers at 1 Gbit/s, every resend spurious, none answered a loss).
Linux counts, per thread, the nanoseconds it spent runnable but not running
(``/proc/thread-self/schedstat``, as ``experiments/thread_cpu.py`` reads it). The client reads its
own count at the end of a loop turn (:meth:`RunQueueDelay.turn`, a ``pread`` of an open file: a few
microseconds, taken when half a millisecond or more passed since the last reading); the longest
wait of one turn in an allreduce is what a peer or the switch, sharing the run queue, may keep the
job silent for. :attr:`RunQueueDelay.delay` follows the longest such wait per allreduce (a new one
as large replaces it; else it halves), and the client floors its tail probe (one wait) and
retransmission timeout (TIMEOUT_FLOOR_WAITS waits) at it (:meth:`RunQueueDelay.probe_floor`,
:meth:`RunQueueDelay.timeout_floor`). On an idle machine the
waits are microseconds and the floor has no effect; ``INA_TIMER_FLOOR=0`` turns it off (to measure
against it).
"""
from __future__ import annotations

import os
import threading
import weakref

SCHEDSTAT = "/proc/thread-self/schedstat"
DECAY = 0.5               # an allreduce without a wait this long lowers the estimate by this factor
MIN_SPAN = 5e-4           # seconds between two readings at least (a shorter wait does not matter)
TIMEOUT_FLOOR_WAITS = 16  # the retransmission timeout's floor in waits: after the probe's first four (1+2+4+8)


class RunQueueDelay:
    """``delay``: seconds, the longest wait for a core within one client loop turn, followed from
    allreduce to allreduce (0 where the kernel keeps no schedstat)."""

    def __init__(self, path: str = SCHEDSTAT, on: bool | None = None):
        if on is None:                            # INA_TIMER_FLOOR=0 turns it off (to measure against it)
            on = os.environ.get("INA_TIMER_FLOOR", "1") != "0"
        self.path = path if on else ""            # off: no reading, delay stays 0
        self.delay = 0.0
        self.longest = 0.0                        # the longest wait of one turn since the last sample()
        self._fds: dict[int, int | None] = {}     # per thread: its schedstat, open (closed with the object)
        self._closer = weakref.finalize(self, _close_all, self._fds)
        self._last = 0                            # ns waited by the thread of the last turn, at its end
        self._tid = -1
        self._read_at = 0.0                       # when the counter was last read (monotonic)

    def _waited(self) -> int | None:
        """Nanoseconds the calling thread has waited on the run queue, None where unavailable."""
        tid = threading.get_native_id()
        fd = self._fds.get(tid, -1)
        if fd == -1:
            try:
                fd = os.open(self.path, os.O_RDONLY) if self.path else None
            except OSError:
                fd = None
            self._fds[tid] = fd
        if fd is None:
            return None
        try:
            return int(os.pread(fd, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return None

    def turn(self, now: float) -> None:
        """A client loop turn ends at ``now`` (monotonic seconds): the calling thread's wait for a core since
        the last reading counts. Read only once MIN_SPAN passed since then (a shorter span cannot hold a
        wait that matters: the probe timeout is at least a millisecond), so most turns cost a comparison."""
        if now - self._read_at < MIN_SPAN and self._tid >= 0:
            return
        w = self._waited()
        if w is None:
            return
        tid = threading.get_native_id()
        if tid == self._tid:
            self.longest = max(self.longest, (w - self._last) / 1e9)
        self._tid, self._last, self._read_at = tid, w, now

    def sample(self) -> float:
        """An allreduce begins: the longest wait of the previous one updates ``delay``; returns it."""
        self.delay = max(self.longest, DECAY * self.delay)
        self.longest = 0.0
        self._tid = -1                            # the wait between allreduces is not the job's silence
        return self.delay

    def probe_floor(self) -> float:
        """The tail probe's floor: one wait (a peer or the switch waiting that long keeps the job silent)."""
        return self.delay

    def timeout_floor(self) -> float:
        """The retransmission timeout's floor: TIMEOUT_FLOOR_WAITS waits, so
        that it comes after the probe's first four (at 1, 3, 7 and 15 waits with its backoff), as a 20 ms
        timeout leaves a 1 ms probe."""
        return TIMEOUT_FLOOR_WAITS * self.delay

    def close(self) -> None:
        self._closer()


def _close_all(fds: dict) -> None:
    for fd in fds.values():
        if fd is not None:
            os.close(fd)
    fds.clear()
