"""Receive coalescing for the streaming client (:mod:`ina.client`).

On a slow link results trickle in one by one and each loop turn of the client costs ~100 us of
Python; with a full window still in flight, the client lets a few more results arrive before it
turns again (on a fast link they arrive faster than a loop turn and batch by themselves). The pace
is read from the results' arrival spacing; the retransmission timers use the same estimate for the
serialisation time of the chunks in flight.
"""
from __future__ import annotations

import time

COALESCE_TARGET = 16      # results per receive burst that receive coalescing aims at
COALESCE_SPACING = 2e-4   # ... when results arrive further apart than this (a 8 kB packet at 330 Mbit/s)
FIRST_SAMPLES = 4         # the estimate starts as the least of this many samples (no pause before)


class ArrivalSpacing:
    """``per_pkt``: the results' arrival spacing, an EWMA of seconds per packet (0 before any sample)."""

    def __init__(self):
        self.last_rx: float | None = None
        self.per_pkt = 0.0
        self.samples = 0

    def idle(self) -> None:
        """An idle gap (peers, a loss) follows: it says nothing about the link."""
        self.last_rx = None

    def sample(self, k: int, now: float, recovered: bool) -> None:
        """A burst of ``k`` results arrived at ``now``. Only the link's spacing counts: not a gap that ended
        with a resent chunk's result (``recovered``: the wait for a loss's recovery), nor one more than
        twice the estimate (an idle gap: a peer recovering a loss of its own stalls the job's stream alike,
        or the process was not scheduled). Such gaps lifted the estimate above COALESCE_SPACING on
        loopback, and every rank then paused for receive coalescing after each loss, the job with it.
        Without an estimate there is nothing to tell such a gap by, so the estimate starts as the least
        of the first FIRST_SAMPLES samples (an idle time only ever lengthens a gap): a stream whose first
        gap was a pause of the process (10-40 ms on a loaded machine) paused for coalescing for up to
        4 ms a turn, on loopback."""
        if self.last_rx is not None and not recovered:
            gap = (now - self.last_rx) / k
            if self.samples < FIRST_SAMPLES:
                self.per_pkt = min(self.per_pkt, gap) if self.samples else gap
                self.samples += 1
            elif gap <= 2 * self.per_pkt:
                self.per_pkt = 0.8 * self.per_pkt + 0.2 * gap
        self.last_rx = now

    def pause(self, k: int, in_flight: int, longest: float) -> float:
        """After a receive burst of ``k`` results with ``in_flight`` chunks out: sleep to let a few more
        arrive (at most ``longest`` seconds; 0: off) when the link trickles. Returns the pause."""
        per_pkt = self.per_pkt if self.samples >= FIRST_SAMPLES else 0.0
        if k < COALESCE_TARGET and in_flight > 2 * COALESCE_TARGET and per_pkt > COALESCE_SPACING:
            pause = min(longest, per_pkt * (COALESCE_TARGET - k), in_flight * per_pkt / 4)
            if pause > 5e-5:
                time.sleep(pause)
                return pause
        return 0.0
