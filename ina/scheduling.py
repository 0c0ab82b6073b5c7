"""How long this machine keeps a runnable thread waiting for a core: the floor of the loss timers.

On a machine with fewer cores than busy processes (8 workers and a switch on 2 cores), a worker or the
switch waits on the run queue for milliseconds between its time slices. While it waits, every other
worker of the job hears nothing, and a tail probe or retransmission timeout shorter than that wait
resends chunks that are not lost (measured: 8 workers at 1 Gbit/s, every resend spurious, none
answered a loss). Linux counts, per thread, the nanoseconds it spent runnable but not running and
its time slices (``/proc/thread-self/schedstat``, as ``experiments/thread_cpu.py`` reads them); their
ratio is the mean wait for a core per slice. Peers and the switch share the run queue, so this
thread's wait is taken as theirs: :class:`RunQueueDelay` keeps it per thread, sampled once per
allreduce, and the client floors its tail probe and retransmission timeouts at it (``ina.client``).
On an idle machine the wait is microseconds and the floor has no effect.
"""
from __future__ import annotations

import threading

SCHEDSTAT = "/proc/thread-self/schedstat"
SMOOTHING = 0.5           # weight of the newest interval in the running estimate


class RunQueueDelay:
    """``delay``: seconds a runnable thread of this process waited for a core per time slice (an average
    over the intervals between :meth:`sample` calls of one thread, smoothed; 0 before two samples, or
    where the kernel keeps no schedstat)."""

    def __init__(self, path: str = SCHEDSTAT):
        self.path = path
        self.delay = 0.0
        self._last: dict[int, tuple[int, int]] = {}      # per thread: (waited ns, slices) at its last sample

    def read(self) -> tuple[int, int] | None:
        """(ns waited on the run queue, time slices) of the calling thread, None where unavailable."""
        try:
            with open(self.path, "rb") as f:
                fields = f.read().split()
            return int(fields[1]), int(fields[2])
        except (OSError, ValueError, IndexError):
            return None

    def sample(self) -> float:
        """Take the calling thread's counters; returns the updated ``delay``."""
        now = self.read()
        if now is None:
            return self.delay
        tid = threading.get_native_id()
        last = self._last.get(tid)
        self._last[tid] = now
        if last is not None and now[1] > last[1]:
            d = (now[0] - last[0]) / (now[1] - last[1]) / 1e9
            self.delay = d if self.delay == 0 else (1 - SMOOTHING) * self.delay + SMOOTHING * d
        return self.delay
