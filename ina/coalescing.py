"""Receive coalescing for the streaming client (:mod:`ina.client`).

On a slow link results trickle in one by one and each loop turn of the client costs ~100 us of
Python; with a full window still in flight, the client lets a few more results arrive before it
turns again (on a fast link they arrive faster than a loop turn and batch by themselves). The pace
is read from the results' arrival spacing; the loss timers use the same estimate (the tail probe's
timeout, and the serialisation time of the chunks in flight for the retransmission timeout).
"""
from __future__ import annotations

import time

COALESCE_TARGET = 16      # results per receive burst that receive coalescing aims at
COALESCE_SPACING = 2e-4   # ... when results arrive further apart than this (a 8 kB packet at 330 Mbit/s)
FIRST_SAMPLES = 4         # the estimate starts as the least of this many samples (no pause before)


class ArrivalSpacing:
    """``per_pkt``: the results' arrival spacing, an EWMA of seconds per packet (0 before any sample).
    ``prior``: the spacing the client's previous stream of the same packet sizes settled on (0: none),
    what the loss timers use until this stream's own estimate settles (:meth:`for_timers`)."""

    def __init__(self, prior: float = 0.0):
        self.last_rx: float | None = None
        self.per_pkt = 0.0
        self.samples = 0
        self.prior = float(prior)
        self.above = 0            # gaps in a row above twice the estimate (the last was one if > 0) ...
        self.above_min = 0.0      # ... and the least of them

    def sample(self, k: int, now: float) -> None:
        """A burst of ``k`` results arrived at ``now``. Only the link's spacing counts: not a gap more than
        twice the estimate (an idle gap: a loss's recovery, a peer recovering a loss of its own stalls
        the job's stream alike, or the process was not scheduled). Such gaps lifted the estimate above
        COALESCE_SPACING on loopback, and every rank then paused for receive coalescing after each loss,
        the job with it. Without an estimate there is nothing to tell such a gap by, so the estimate
        starts as the least of the first FIRST_SAMPLES samples (an idle time only ever lengthens a gap):
        a stream whose first gap was a pause of the process (10-40 ms on a loaded machine) paused for
        coalescing for up to 4 ms a turn, on loopback. A first sample can be short too (two results in
        one burst: 2 ms a result where they came 6.6 ms apart, at 10 Mbit/s), and every later gap then
        looked idle: FIRST_SAMPLES gaps in a row above twice the estimate replace it by the least of them.

        Gaps are told by their length alone, not by what the client did in them: a gap that ended with a
        resent chunk's result, or that a receive timed out in, counts like any other. Leaving those out
        starved the estimate on a slow link, where a result comes every few ms (an 8 kB result every 6.6 ms
        at 10 Mbit/s): the receive waits less (2 ms, or until the probe timer), and a probe that fired
        in the gap resent the chunk whose result ended it. The estimate stayed 0, the probe timeout at
        its 1 ms floor, and every result of a stream was probed for first (200-540 spurious resends per
        sweep run of 2 workers, 425,000 elements, 1.4-2.9x the link-bound time)."""
        if self.last_rx is not None:
            gap = (now - self.last_rx) / k
            if self.samples < FIRST_SAMPLES:
                self.per_pkt = min(self.per_pkt, gap) if self.samples else gap
                self.samples += 1
            elif gap <= 2 * self.per_pkt:
                self.per_pkt = 0.8 * self.per_pkt + 0.2 * gap
                self.above = 0
            else:
                self.above_min = min(self.above_min, gap) if self.above else gap
                self.above += 1
                if self.above == FIRST_SAMPLES:      # the estimate is too low, not the gaps idle: start over
                    self.per_pkt, self.above = self.above_min, 0
        self.last_rx = now

    def settled(self) -> float | None:
        """This stream's estimate once it has FIRST_SAMPLES samples (None before): the next stream's prior."""
        return self.per_pkt if self.samples >= FIRST_SAMPLES else None

    def for_timers(self) -> float:
        """The spacing the loss timers use (the tail probe's, and the serialisation of the chunks in flight
        for the retransmission timeout): this stream's estimate once settled, at least the prior before.
        A stream's first results would otherwise find no estimate (0), and the probe timer fired after
        1 ms between two results 6.6 ms apart on a 10 Mbit/s link."""
        return self.per_pkt if self.samples >= FIRST_SAMPLES else max(self.per_pkt, self.prior)

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
