"""Receive coalescing for the streaming client (:mod:`ina.client`).

On a slow link results trickle in one by one and each loop turn of the client costs ~140 us of
CPU whatever it holds; the client lets more results arrive before it turns again (on a fast link
they arrive faster than a loop turn and batch by themselves). How long: :func:`pause_length`, the
one rule. The pace is read from the results' arrival spacing; the loss timers use an estimate of
it too (the tail probe's timeout, and the serialisation time of the chunks in flight for the
retransmission timeout), kept apart: coalescing's errs short, the timers' must not
(:class:`ArrivalSpacing`).
"""
from __future__ import annotations

import math
import time

COALESCE_TARGET = 16      # results per receive burst that receive coalescing aims at
COALESCE_SPACING = 2e-4   # ... when results arrive further apart than this (a 8 kB packet at 330 Mbit/s)
FIRST_SAMPLES = 4         # the estimate starts as the least of this many samples (no pause before)
PAUSE_MIN = 5e-5          # a shorter pause is not taken (a sleep's own cost and timer slack)


def pause_length(per_pkt: float, in_flight: int, tail: bool, until: float, elapsed: float = 0.0,
                 longest: float = math.inf) -> float:
    """How long the client pauses after a loop turn that took fresh results, so that its next receive
    takes about COALESCE_TARGET of them at once (0: no pause). ``per_pkt``: the results' spacing
    (seconds per result: :meth:`ArrivalSpacing.for_coalescing`, 0 before it has samples enough);
    ``in_flight``: chunks sent without a result; ``tail``: every chunk of the stream is sent (no send
    waits for a result any more); ``until``: seconds until the earliest time a loss rule could fire
    (``LossDetector.next_deadline``, rule 4's timer); ``elapsed``: seconds since the turn's receive
    returned (its processing: results arrived meanwhile too); ``longest``: the user's cap
    (``Client(coalesce=...)``, seconds; 0: off; default none).

    Only where results come further apart than COALESCE_SPACING (faster, they batch by themselves), it
    is the spacing of
      * ``min(COALESCE_TARGET, in_flight / 4)`` results while chunks are still to be sent: a result frees
        the next chunk's send, and a pause that long leaves at least 3/4 of the window queued, so the
        uplink never idles;
      * ``min(COALESCE_TARGET, in_flight - 1)`` results in the stream's tail: nothing waits to be sent,
        and the last result is never held by a pause (it wakes its own turn);
    less ``elapsed``, and never past ``until``: a pause never delays a loss rule's resend (rule 1's
    evidence, results of later chunks, arrives with the results and is read in the next turn, at most
    one pause later). Sized in spacings, the pause scales with the link (and with a time-dilated
    run's stretch); it was capped at 4 ms, which at 16 Mbit/s (3.7 ms a result) held one result, and
    the tail never paused: 196 turns per 208-chunk allreduce against 18 at 1 Gbit/s
    (docs/performance.md, "Receive coalescing at slow link rates")."""
    if per_pkt <= COALESCE_SPACING or longest <= 0:
        return 0.0
    n = min(COALESCE_TARGET, in_flight - 1) if tail else min(COALESCE_TARGET, in_flight / 4)
    pause = min(n * per_pkt - elapsed, until, longest)
    return pause if pause > PAUSE_MIN else 0.0


class _Gaps:
    """An EWMA of seconds per result over gaps between receive bursts (0 before any sample). It starts
    as the least of its first FIRST_SAMPLES samples and then takes only gaps up to twice it: an idle
    time (a loss's recovery, a peer recovering a loss of its own stalls the job's stream alike, the
    process not scheduled) only ever lengthens a gap. ``restart``: FIRST_SAMPLES gaps in a row above
    twice the estimate replace it by the least of them (the estimate was too low, not the gaps idle)."""

    def __init__(self, restart: bool):
        self.restart = restart
        self.last_rx: float | None = None
        self.per_pkt = 0.0
        self.samples = 0
        self.above = 0            # gaps in a row above twice the estimate ...
        self.above_min = 0.0      # ... and the least of them
        self.first_rx: float | None = None
        self.after_first = 0      # results since the first burst
        self.results = 0          # results in all

    def mean(self) -> float:
        """Seconds per result over every result since the first burst (stalls included, amortised)."""
        return (self.last_rx - self.first_rx) / self.after_first if self.after_first else 0.0

    def sample(self, k: int, now: float, skip: bool, cap: float = float("inf")) -> None:
        self.results += k
        if self.first_rx is None:
            self.first_rx = now
        else:
            self.after_first += k
        if self.last_rx is not None and not skip:
            gap = min(now - self.last_rx, cap) / k
            if self.samples < FIRST_SAMPLES:
                self.per_pkt = min(self.per_pkt, gap) if self.samples else gap
                self.samples += 1
            elif gap <= 2 * self.per_pkt:
                self.per_pkt = 0.8 * self.per_pkt + 0.2 * gap
                self.above = 0
            elif self.restart:
                self.above_min = min(self.above_min, gap) if self.above else gap
                self.above += 1
                if self.above == FIRST_SAMPLES:
                    self.per_pkt, self.above = self.above_min, 0
        self.last_rx = now


class ArrivalSpacing:
    """The results' arrival spacing, two estimates of seconds per result (:class:`_Gaps`):

    * ``per_pkt``, receive coalescing's (:meth:`for_coalescing`): the link's pace, from gaps the client spent
      receiving, none that a receive timed out in (:meth:`idle`) or that ended with a resent chunk's
      result (``recovered``: the wait for a loss's recovery). A gap that was not the link's lifted it
      above COALESCE_SPACING on loopback, and every rank then paused after each loss, the job with it;
      it errs short. Its first sample could be a pause of the process (10-40 ms on a loaded machine):
      loopback streams paused up to 4 ms a turn until it started as the least of its first samples.
    * :meth:`for_timers`, the loss timers' (the tail probe's timeout, the serialisation of the chunks
      in flight for the retransmission timeout): every gap by its length alone, whatever the client did
      in it, and before it settles at least ``prior``, the one the client's previous stream of the same
      packet sizes settled on (:meth:`settled`). Coalescing's estimate starved the timers on a slow
      link, where a result comes every few ms (an 8 kB one every 6.6 ms at 10 Mbit/s): the receive
      waits less (2 ms, or until the probe timer), and a probe that fired in the gap resent the chunk
      whose result ended it; the estimate stayed 0, the probe timeout at its 1 ms floor, and every
      result of a stream was probed for first (docs/performance.md, "Spurious resends on slow links and
      with a sharded switch"). A first sample can be short too (two results in
      one burst: 2 ms a result where they came 6.6 ms apart), and every later gap then looked idle: this
      estimate restarts after FIRST_SAMPLES gaps in a row above twice it (coalescing's does not: on a
      loaded machine that lifted it at 1 Gbit/s, and the clients paused).
    """

    def __init__(self, prior: float = 0.0):
        self.pace, self.timer = _Gaps(restart=False), _Gaps(restart=True)
        self.prior = float(prior)
        self._idle = False

    @property
    def per_pkt(self) -> float:
        return self.pace.per_pkt

    @property
    def samples(self) -> int:
        return self.pace.samples

    def idle(self) -> None:
        """A receive timed out: the gap it is part of may be idle (peers, a loss), not the link's pace."""
        self._idle = True

    def sample(self, k: int, now: float, recovered: bool = False, replayed: bool = False,
               probed_after: float = float("inf")) -> None:
        """A burst of ``k`` results arrived at ``now``; ``recovered``: one was of a resent chunk;
        ``replayed``: every new result in it was a replay (the answer to a resend of a result lost on the
        way back): the gap it ends was the loss's recovery, not the link's pace, and the timers' estimate
        skips it too. Taken, a tail of 4 or more lost results, probed one silence at a time, restarted the
        estimate at the probe timeout's own length (4 such gaps in a row above twice it), so that the next
        stream's probe timeout was 4 times that: 2 ms, 51 ms, 0.32 s, 3.5 s over three such streams.
        ``probed_after``: a probe (rule 3 or 4) fired this long into the gap and the burst holds a resent
        chunk's result, maybe the probe's answer: the timers skip the gap once they have an estimate (one
        settled, or a prior), and take it at most that long before. Such a result is fresh when this rank's
        own data packets were lost (the probe completed the round); taken, a tail of them grew the estimate
        by the probes' waits, which count the pending chunks' spacing (recovery.probe_timeout), stream after
        stream (12 ms, 79 ms, 0.47 s over three such streams). Without an estimate, a slow link's probe fires
        in every gap (the probe timeout at its floor) and a gap's own result may end it: capped, the
        estimate still grows to where the probes stop."""
        self.pace.sample(k, now, self._idle or recovered)
        probed = probed_after != float("inf")
        known = self.timer.samples >= FIRST_SAMPLES or self.prior > 0
        self.timer.sample(k, now, replayed or (probed and known), probed_after)
        self._idle = False

    def next_prior(self, started: float) -> float | None:
        """The spacing the client's next stream of the same packet sizes starts from: :meth:`settled`, at
        most the time from ``started`` (the stream's first send) to its last result per result (the prior
        ages out: a spacing grown by a loss's recovery stayed the prior of every later stream too short to
        settle, all its results in a burst or two); None: no result."""
        t = self.timer
        if not t.results:
            return None
        bound = (t.last_rx - started) / t.results
        settled = self.settled()
        return min(bound, self.prior if settled is None else settled)

    def settled(self) -> float | None:
        """The timers' estimate once it has FIRST_SAMPLES samples (None before), at most the stream's mean
        spacing: the next stream's prior. (A stall across a stream's last bursts restarts the estimate at
        the stall's gaps; the mean over the whole stream amortises it, while on a slow link the two agree.)"""
        t = self.timer
        return min(t.per_pkt, t.mean()) if t.samples >= FIRST_SAMPLES else None

    def for_timers(self) -> float:
        """The spacing the loss timers use: the timers' estimate once settled, at least ``prior`` before
        (a stream's first results would otherwise find none, and the probe timer fired after 1 ms between
        two results 6.6 ms apart at 10 Mbit/s)."""
        t = self.timer
        return t.per_pkt if t.samples >= FIRST_SAMPLES else max(t.per_pkt, self.prior)

    def for_coalescing(self) -> float:
        """The spacing receive coalescing uses (:func:`pause_length`; 0 before ``per_pkt`` has FIRST_SAMPLES
        samples: no pause): ``per_pkt``, or where the lesser of the timers' estimate and the stream's mean
        spacing is above it, that lesser one, provided it is above twice COALESCE_SPACING or ``per_pkt`` is
        above COALESCE_SPACING. ``per_pkt`` starts as the least of its first samples and then takes no gap
        above twice it: a first sample of two results received together (0.26 ms a result where they came
        0.66 ms apart, 100 Mbit/s) held it there for the stream, whose pauses took 6 results instead of 16,
        and one at 0.07 ms never paused (179 turns instead of 20; 1 to 5 of 16 streams in a run). Both
        others must have risen: a loss's recovery or a peer's stall lifts the mean but not the timers'
        estimate (it takes such gaps only four in a row). Where ``per_pkt`` says the link is fast, the other
        two start pauses only from twice COALESCE_SPACING: the timers' estimate, shared with coalescing once,
        rose on a loaded machine at 1 Gbit/s and the clients paused (this class's notes), and a stream's mean
        rises wherever its processes wait for a core (measured at load 14-17, 1 Gbit/s: the timers' estimate
        at most 0.11 ms)."""
        p = self.pace
        if p.samples < FIRST_SAMPLES:
            return 0.0
        other = min(self.timer.per_pkt, p.mean())
        if p.per_pkt > COALESCE_SPACING or other > 2 * COALESCE_SPACING:
            return max(p.per_pkt, other)
        return 0.0

    def pause(self, in_flight: int, tail: bool, until: float, elapsed: float = 0.0,
              longest: float = math.inf) -> float:
        """Sleep for :func:`pause_length` at :meth:`for_coalescing`'s spacing; returns the pause (seconds)."""
        pause = pause_length(self.for_coalescing(), in_flight, tail, until, elapsed, longest)
        if pause:
            time.sleep(pause)
        return pause
