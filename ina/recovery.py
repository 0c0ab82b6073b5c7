"""Loss detection for the streaming client: which chunks to resend, and why.

A chunk's result comes back once every worker's packet of it reached the switch. Results come back
in a self-clocked window, so a chunk whose result is missing while results of chunks sent *after*
it keep arriving was lost on the way (a worker's packet to the switch, or the result on the way
back); it is resent at once, as TCP's fast retransmit does, instead of waiting for a timeout. The
switch makes a resend safe in either case: a worker whose bit is already set only reads (a replay
of the stored result if the round completed, a drop if it did not; no replay for a rank's first
resend of a round another rank's resend completed: it crossed the result, switch_model/alu.py).

**Tail copies** come first (:func:`tail_copies`): the last chunk of a dense stream is sent twice,
flagged TAIL, and the switch multicasts the result of a round completed by a TAIL packet twice
(switch_model/tail.py). Nothing sent after that chunk could show its loss, and an exponent negotiation
round is one such chunk per worker; a loss there used to cost a probe timeout (rule 3), and the peers,
waiting for the rank that recovered it, probed too (at 20,000 elements, 4 workers, 1% loss: 76 of 142
probes were for the negotiation packet, 34 for chunk 0 of the stream after it). With the copies the
round stalls only when both copies are lost (p^2). A negotiation packet is 24 bytes and always
copied; a data stream's last chunk is copied when the stream has at least ``TAIL_COPY_FROM`` (16)
chunks (``Client(tail_copy_from=...)``), so the copy adds at most 1/16 of its bytes: a stream of one
or a few chunks, on a slow link, would pay more time for its copy than for the rare probe it saves. The switch adds a worker's packet once (a second
copy meets the worker's bit set: dropped, and not replayed, since it lacks the RETRANSMIT flag), so a
copy never adds twice. Counted: ``ClientStats.tail_copies``,
the switch's ``tail_repeats``. Chosen over a tighter probe timeout (the probe fires after a silence,
which on a loaded machine is the scheduler's, several ms, whatever the timeout) and over the switch
telling a resending rank which contributions a round misses (every rank already resends at the same
moment; it would save packets, not time).

Four rules, in the order a lost chunk meets them ("chunks sent after it" are always chunks the same
switch shard serves: each shard answers in order, two shards' results interleave however their
processes run):

1. **duplicate threshold**: results of ``DUPTHRESH`` (3) chunks sent after it arrived; at the
   stream's end, with every chunk sent and fewer than 4 outstanding in the chunk's switch shard, one
   less than that count (early retransmit, RFC 5827: a loss among the last chunks needs no probe);
2. **reordering window** (RACK-style): results of at least one chunk sent after it arrived, and it
   has been out for longer than ``1.25 x srtt + 2 x rttvar + REO_FLOOR``: a late chunk, not a
   reordered one.
   A chunk resent before meets rules 1 and 2 only once it has been out for that window times
   ``2 ** (resends - 1)``: every rank sees a peer's lost data packet as a missing result and resends,
   and results of later chunks keep arriving until the peer's own resend gets there.
   "Sent after it" counts only *witnesses*: not a resent chunk (Karn's ambiguity), nor a chunk whose
   send waited for a replay of a result this rank lost (the peers sent it long before, so its result
   comes back at once, ahead of chunks sent here earlier that wait for the peers);
3. **tail probe** (nothing sent after it arrived, or everything after it was lost too): no result
   at all arrived for a probe timeout ``PTO = 2 x rtt_min + 4 x spacing`` (at least ``min_rto``),
   where ``rtt_min`` is the fastest round trip a chunk took (no queue ahead of it) and ``spacing``
   the time between results while they flow (``ina.coalescing.ArrivalSpacing``; until a stream's own
   estimate settles, the one the client's previous stream of the same packet sizes settled on): a
   silence that long means the results are not coming. On a slow link ``spacing`` is what counts:
   ``rtt_min`` can be a negotiation packet's (40 us at 10 Mbit/s, where the token bucket passes a small
   packet at once) while an 8 kB result comes every 6.6 ms; the estimate takes every gap between
   results by its length (an idle one is longer than twice it), whatever the client did in the gap,
   since a probe that fired in a gap resent the very chunk whose result ended it (while the estimate
   skipped such gaps, every result of a stream was probed for first: docs/performance.md, "Spurious
   resends on slow links and with a sharded switch"). One chunk is resent per probe, the one resent least often so far, oldest first (as TCP's
   tail loss probe: its result restarts the flow, and any further lost chunk then meets rule 2 or
   another probe); a probe still unanswered at the next probe is sent again once, for rule 4's reason (the
   switch drops a rank's first resend that crossed the result, ``RETRANSMIT_CROSSED``: three such chunks
   cost 1 + 2 + 4 + 8 + 1 + 1 probe timeouts with a new chunk per probe, 3 x (1 + 2) this way), and after
   two unanswered sends the probe picks again (least resent, oldest): the switch drops every resend of a
   round still waiting for a peer's packet (``RETRANSMIT_PENDING``), and two ranks that lost each other's
   chunks, each probing the round that waits for the other, re-sent them at every probe until rule 4.
   The probe timer is the silence's, not a chunk's: it restarts with every result
   and doubles with every probe of the same silence (at most ``max_rto``), so a long wait for a
   slow peer costs a handful of probes in all, not one per chunk and silence.
   A silence with more than ``SHORT_PROBE_MAX_PENDING`` (3) chunks pending is probed later
   (:func:`probe_timeout`, the one place of the rule): after ``srtt + 4 x rttvar + pending x
   spacing``, and at least the probe timeout (so the run-queue floor holds too); before the first
   data round trip (no srtt), after the probe timeout plus ``pending x spacing``. So many results
   missing at once is most often a stall, a peer that has not sent yet or a switch not scheduled,
   which no probe shortens (the switch only reads the resend): at 100 Mbit/s, 20,000 elements, the
   plain probe timeout (two of a negotiation packet's round trips plus four result spacings) fired
   after 1-2 ms of silence, far below the chunks' own round trip through the link's queue, and most
   probes were these. But it can be a loss of all of them: a result is lost if any of the W
   workers' packets or the result itself is dropped (about (W+1) x p per chunk), and losses come
   together (a socket buffer that overflowed while its process waited for a core, a shaping queue
   that overflowed where the way back is slower than the way out, a switch shard with one chunk
   in flight that never has results of later chunks to show a loss). The longer silence, the
   measured round trip and the time the pending results take through the link, lets such a loss
   go unprobed no longer than the stall it is told from, and before the timeout (rule 4, at least
   20 ms) on a quiet machine (round trips that vary lengthen both). Each probe resends one chunk. A
   fresh answer sends no other; a replay (the round had completed: the result was lost on the way
   back, and likely its neighbours') with ``SHORT_PROBE_MAX_PENDING`` or more chunks left in the
   probe's lane sends those of them out longer than ``srtt + 4 x rttvar`` at once (rule 4's go-back,
   counted as it is; the ones sent since are left to the rules): else a replay, ending the silence,
   restarted both timers, and k results lost together cost k silences (a whole window lost on the way
   back: 64 probes, 0.66 s at 4 ranks). The tail-loss tests: k = 4, 6, 11 recovered by a probe and a
   go-back, no timeout;
4. **timeout**, the safety net: out for longer than srtt + 4 rttvar (the client's RTO, at least its
   ``rto``, 20 ms by default, and at least the fastest round trip plus twice the serialisation time
   of the chunks in flight), doubled per resend, at most ``max_rto``, and no result at all arrived
   for as long (TCP restarts its retransmission timer with every acknowledgement). As TCP's timeout,
   it resends one chunk per switch shard (lane), the least resent, oldest first: a *timeout probe*
   of the silence; the timer doubles with every probe of the same silence (at most ``max_rto``) and
   restarts with the next result. A probe still unanswered at the next timeout is sent again once (then
   the lane's pick again, as rule 3's: ``recovery_kernels.PROBE_SENDS``), as TCP resends the same
   segment: the switch drops a rank's first resend of a round another rank's resend or
   LATE packet completed (``RETRANSMIT_CROSSED``), never its second, so where every result is lost on
   the way back (a multicast group that does not reach the workers) a new chunk per timeout met that
   drop each time and no probe was ever answered (64 timeouts of up to ``max_rto`` per window).
   A silence that long is most often a peer that has not sent yet (a rank computing its gradients
   late, in DDP): resending the whole window (up to 64 chunks, 5.5 ms of a 100 Mbit/s uplink, and 64
   reads at the switch) every step bought nothing, each resend only read.
   The rest of the lane's timed-out chunks (those sent before the probe) go out at once (*go-back*)
   only on evidence that they were lost: the probe's result comes back as a replay (the round had
   completed; its result, and so likely its neighbours', was lost on the way back), or comes back
   fresh and no other result follows for the reordering window plus the machine's measured wait for a
   core (the probe completed the round: this rank's data packets were lost; had a late peer completed
   it, the other results would follow, though on a loaded machine a peer or the switch may first wait
   that long for a core). So a
   window lost whole costs one silence and a round trip (rule 3's probe's replay, or, with rule 3
   held back, rule 4's), not one timeout per chunk. A later result of the lane while it waits for
   its quiet window disarms it (results follow: a late peer), and the receive waits no longer than
   that window (:meth:`LossDetector.next_deadline`). The follow-up is explicit, not left to rule 2:
   the probe's result is no witness for chunks sent before it (Karn).
   Rule 3's probes of the same silence come first (its timeouts are below the RTO), and any result,
   a probe's replay too, restarts the RTO's silence: the timeout fires when a silence outlasts it with
   rule 3's probes unanswered (a late peer: the switch only reads them; or the probes lost too).

The client counts rules 1 and 2 (*fast* retransmissions), 3 (*probes*, of which ``stall_probes`` probed
a silence with more than 3 chunks out, after the longer wait) and 4 (*timeouts*, of which
``timeout_go_back`` went back after a probe) apart,
and per rule the resends the switch answered with a replay (``LossDetector.rule`` keeps the rule of a
chunk's last resend): the round had completed, so the resend recovered a result lost on the way back.
The other resends waited for a packet that had not reached the switch: this rank's own lost data
packet, or a peer's packet not sent yet. A waiting peer looks like a loss to rules 1 to 3: a rank
that lost a result sends the chunk it frees late, and the last chunk of its stream (or its next
negotiation packet) later still, after its own tail probe, so its peers see the same silence and
probe too; the switch only reads such a resend, and the backoff keeps them to a handful per silence.
:meth:`LossDetector.next_deadline` says when the next rule could fire, so that the client's receive
waits no longer than that (a probe timeout below the receive's usual wait would otherwise wait for it).
That wait is a select (``Client.receive``), not the socket's timeout: SO_RCVTIMEO counts in kernel
ticks (4 ms here, HZ=250; a 1 ms timeout waited 4 to 12 ms, measured), so every probe fired after 5 to 8
ms of silence instead of its 1 ms, and a rank waiting for a slow peer's probe waited as long again
(at 20,000 elements with 2% loss, duplication and reordering the tail took 2.6 ms of a 4.4 ms
allreduce). Precise waits make probes fire when the rule says: on a loaded machine, where the
scheduler's pauses exceed 1 ms, more of them are spurious (the switch only reads such a resend).
"""
from __future__ import annotations

import functools

import numpy as np

from . import recovery_kernels as RK
from . import stream_kernels as SK
from .wire import Flag

# rule 3 probes a silence with more chunks pending than this only later (probe_timeout)
SHORT_PROBE_MAX_PENDING = RK.SHORT_PROBE_MAX_PENDING
STALL_RTTVARS = 4             # ... after srtt + this x rttvar + the pending chunks' serialisation
TAIL_COPY_FROM = 16    # data streams of at least this many chunks send their last chunk twice (negotiation: always)
DUPTHRESH, REO_FLOOR = RK.DUPTHRESH, RK.REO_FLOOR   # rule 1's count of later results, rule 2's floor (seconds)
FAST, PROBE, TIMEOUT = RK.FAST, RK.PROBE, RK.TIMEOUT  # the rule of a chunk's last resend (LossDetector.rule; 0: never)


def tail_copy_wanted(sparse: bool, payload: bool, n_chunks: int, tail_copy_from: int) -> bool:
    """Whether a stream sends its last chunk twice (:func:`tail_copies`): a dense stream's, if it is a
    negotiation (no ``payload``) or has at least ``tail_copy_from`` chunks."""
    return not sparse and (not payload or n_chunks >= tail_copy_from)


def tail_copies(rows: np.ndarray, chunks: np.ndarray, n_chunks: int, headers: np.ndarray, stats,
                top: int | None = None) -> np.ndarray:
    """The ring ``rows`` of ``chunks`` (first sends of a dense stream of ``n_chunks`` that
    :func:`tail_copy_wanted`), with a second copy of the stream's last chunk, flagged TAIL in ``headers``
    (ina.wire.header_view of the ring), counted in ``stats.tail_copies``. Nothing sent after the last
    chunk can show its loss (a negotiation round is one chunk): a copy makes its loss on the way to the switch take both (p^2), and the TAIL
    flag makes the switch multicast its result twice for the way back. The switch absorbs one copy (the
    other meets the worker's bit set and is dropped: switch_model/tail.py). ``top``: the largest of ``chunks``
    when the caller knows it."""
    if (chunks.max() if top is None else top) < n_chunks - 1:
        return rows
    last = chunks == n_chunks - 1
    tail = rows[last]
    headers["flags"][tail] |= int(Flag.TAIL)
    stats.tail_copies += tail.size
    return np.concatenate([rows, tail])


def long_silence(n_pending: int) -> bool:
    """Whether rule 3 probes a silence with ``n_pending`` chunks out only later (:func:`probe_timeout`);
    the client counts such probes as ``stall_probes``."""
    return n_pending > SHORT_PROBE_MAX_PENDING


def stall_time(srtt: float | None, rttvar: float, otherwise: float) -> float:
    """How long a result may be out before its silence looks like a loss rather than a stall: ``srtt +
    STALL_RTTVARS x rttvar`` (``otherwise`` before any round trip was measured). Rule 3's longer probe
    timeout starts from it; a replayed tail probe's go-back takes only chunks out longer than it."""
    return otherwise if srtt is None else srtt + STALL_RTTVARS * rttvar


def probe_timeout(pto: float | None, n_pending: int, srtt: float | None, rttvar: float,
                  spacing: float) -> float | None:
    """Rule 3's probe timeout for a silence with ``n_pending`` chunks out: ``pto`` (the client's probe
    timeout, None before any round trip was measured) for at most SHORT_PROBE_MAX_PENDING of them; for
    more (most often a stall, not a loss of them all: see the module's rule 3), ``srtt + STALL_RTTVARS x
    rttvar`` plus their serialisation (``n_pending x spacing``, the time between results), at least ``pto``
    (which holds the run-queue floor); without an srtt, ``pto`` plus their serialisation."""
    if pto is None or not long_silence(n_pending):
        return pto
    return max(pto, stall_time(srtt, rttvar, pto) + n_pending * spacing)


@functools.cache
def _load_loss_rules() -> None:
    """Load (or compile) ``find_lost`` with the first stream, not at the first loss: it runs only on evidence
    of one, and its first call took tens of ms from numba's cache (a second without: every rank's window
    timed out waiting for the rank compiling it)."""
    one, none = np.zeros(1, np.int64), np.zeros(1)
    RK.find_lost(one, 0.0, none, one, one, one, one, 0, np.nan, 0.0, np.inf, 1.0, np.nan, False, 0.0, False,
                 np.full(1, -1, np.int64), one.copy(), one.copy(), np.inf, -1, np.nan, one.copy(), 0)


class LossDetector:
    """Per-chunk send bookkeeping of one stream of ``n`` chunks (``n`` at most a few thousand)."""

    def __init__(self, n: int, lanes: np.ndarray | None = None, pause: float = 0.0):
        # pause: the machine's measured wait for a core (the client's run_queue.probe_floor()), seconds
        # the switch shard serving each chunk (rules 1 and 2 compare chunks of one shard: see count_later)
        self.lane = np.zeros(n, np.int64) if lanes is None else np.asarray(lanes, np.int64)
        self.sent_at = np.zeros(n)                 # monotonic time of the chunk's last send (0: not yet)
        self.seq = np.zeros(n, np.int64)           # send order of the chunk's last send
        self.later = np.zeros(n, np.int64)         # results of chunks sent after it, since its last send
        self.tries = np.zeros(n, np.int64)         # resends so far (Karn: no RTT sample from these)
        self.witness = np.ones(n, bool)            # its result may count against chunks sent before it
        self.rule = np.zeros(n, np.int64)          # the rule of its last resend: FAST, PROBE, TIMEOUT (0: none)
        self._kind = np.zeros(n, np.int64)         # scratch: what find_lost found each pending chunk
        self._next_seq = 1
        self.unsent = n                            # chunks never sent yet
        self.last_arrival = 0.0                    # when the newest result arrived (or the stream began)
        self.probes = 0                            # tail probes since then (the probe timer's backoff)
        self.probe_base = 0.0                      # when the probe timer last started: an arrival or a probe
        self.timeouts = 0                          # rule 4's timeout probes since the last result (its backoff)
        self.rto_base = 0.0                        # when rule 4's timer last started: an arrival or a timeout probe
        lanes = int(self.lane.max()) + 1 if n else 1
        self.rto_probe = np.full(lanes, -1, np.int64)   # each lane's last timeout probe, its chunk (-1: none)
        self.answer = np.zeros(lanes, np.int64)    # what became of it: RK.ARMED (no result yet), QUIET, NOW, AGED
        self.rto_sends = np.zeros(lanes, np.int64)  # how many times in a row it went out (RK.PROBE_SENDS)
        self.tail_probe = -1                       # rule 3's last probe, its chunk, until its result arrives (-1: none)
        self.tail_sends = 0                        # how many times in a row it went out
        self.probed_at = 0.0                       # when this silence's first probe (rule 3 or 4) went out (0: none)
        self.went_back = 0                         # chunks the last lost() found by rule 4's go-back
        self.rto_probing = False                   # a probe awaits its evidence (answered() is called only then)
        self.pause = pause                         # pads rule 4's quiet window (quiet_window)
        _load_loss_rules()                         # once per process (cached)

    def sent(self, chunks: np.ndarray, now: float, witness: np.ndarray | bool = True) -> None:
        """``chunks`` went out (first time or again) at ``now``, in this order. ``witness`` False: the
        chunk went out here later than at the peers (its send waited for a replay of a result this rank
        lost), so its result may come back before those of chunks sent here earlier without a loss."""
        chunks = np.asarray(chunks, np.int64)
        if self._next_seq == 1:
            self.last_arrival = self.probe_base = self.rto_base = now
        w = np.asarray(witness, bool).reshape(-1)
        self.unsent -= RK.mark_sent(chunks, now, w, w.size == 1, self._next_seq, self.sent_at, self.seq, self.later,
                                    self.witness)
        self._next_seq += len(chunks)

    def pending(self, low: int, high: int, done: np.ndarray) -> np.ndarray:
        """Chunks in ``low..high`` that were sent and have no result yet. A chunk of the window can be
        unsent while a later one went out: chunk c + S is sent once c is done, in any order."""
        return RK.pending_chunks(low, high, done, self.seq)

    def delivered(self, chunks: np.ndarray, pending: np.ndarray, now: float) -> None:
        """Results of ``chunks`` arrived; count them against every still ``pending`` chunk sent before."""
        self.arrived(now)
        # a resent chunk's result may answer its first send: it says nothing of the order (Karn's ambiguity)
        RK.count_later(np.asarray(chunks, np.int64), np.asarray(pending, np.int64), self.seq, self.tries, self.witness,
                       self.lane, self.later)

    def arrived(self, now: float) -> None:
        """A result arrived: the tail probe's timer restarts and its backoff resets (the count of later
        results is :meth:`delivered`'s, or the client's compiled receive pass's)."""
        self.last_arrival = self.probe_base = self.rto_base = now
        self.probes = self.timeouts = 0
        self.probed_at = 0.0

    def probed_after(self) -> float:
        """How long into the silence its first probe went out (inf: none did): a result that ends the
        silence may be that probe's answer, not the link's pace (ina.coalescing.ArrivalSpacing.sample)."""
        return self.probed_at - self.last_arrival if self.probed_at else np.inf

    def answered(self, chunks: np.ndarray, replayed: np.ndarray) -> None:
        """Results of ``chunks`` arrived (``replayed``: with the REPLAY flag): a lane's timeout probe
        among them arms its go-back (rule 4), at once for a replay, after a quiet window for a result;
        a later result of a lane waiting for its quiet window disarms it (results follow: a late peer);
        the tail probe (rule 3) replayed arms its lane's go-back for the chunks out longer than the
        stall time (``RK.AGED``)."""
        for m in np.flatnonzero(self.rto_probe >= 0):
            hit = np.flatnonzero(chunks == self.rto_probe[m])
            if hit.size and self.answer[m] == RK.ARMED:
                self.answer[m] = RK.NOW if replayed[hit[0]] else RK.QUIET
            elif self.answer[m] == RK.QUIET and (self.lane[chunks] == m).any():
                self.rto_probe[m], self.answer[m] = -1, RK.ARMED
        if self.tail_probe >= 0:
            hit = np.flatnonzero(chunks == self.tail_probe)
            if hit.size:
                if replayed[hit[0]]:
                    m = self.lane[self.tail_probe]
                    self.rto_probe[m], self.answer[m] = self.tail_probe, RK.AGED
                self.tail_probe = -1
        self._update_probing()

    def _update_probing(self) -> None:
        self.rto_probing = self.tail_probe >= 0 or bool((self.rto_probe >= 0).any())

    def lost(self, pending: np.ndarray, now: float, srtt: float | None, rto: float, max_rto: float,
             pto: float | None = None, rttvar: float = 0.0,
             spacing: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(fast, probe, timed_out): the ``pending`` chunks (sent, no result) to resend now, by rule
        (1 and 2, 3, 4). ``pto``: the tail probe timeout (None before any round trip was measured).
        ``rttvar``: the round trips' mean deviation; the reordering window grows by twice it (round
        trips that vary, on a loaded machine, make a late chunk no sign of a loss). ``spacing``: the time
        between results (:func:`probe_timeout` adds the pending chunks' serialisation). The rules run in
        one compiled pass (``recovery_kernels.find_lost``)."""
        pending = np.asarray(pending, np.int64)
        none = pending[:0]
        if not len(pending):
            return none, none, none
        self.went_back = 0
        pto = probe_timeout(pto, pending.size, srtt, rttvar, spacing)
        probe_due = self._probe_due(now, pto, max_rto)
        rto_due = now > self.rto_at(rto, max_rto)
        if not probe_due and not rto_due and not self.later[pending].any() and not self.rto_probing:
            return none, none, none       # no evidence, no silence: the common turn (quiet_deadline's shortcut)
        kind = self._kind[:pending.size]
        found = RK.find_lost(pending, now, self.sent_at, self.seq, self.later, self.tries, self.lane, self.unsent,
                             np.nan if srtt is None else srtt, rttvar, rto, max_rto, np.nan if pto is None else pto,
                             probe_due, self.last_arrival, rto_due, self.rto_probe, self.answer, kind,
                             stall_time(srtt, rttvar, rto), self.tail_probe,
                             np.nan if srtt is None else self.quiet_window(srtt, rttvar), self.rto_sends,
                             self.tail_sends)
        self._update_probing()
        if not found:
            return none, none, none
        timed_out = (kind == RK.TIMEOUT) | (kind == RK.GO_BACK)
        self.went_back = int(np.count_nonzero(kind == RK.GO_BACK))
        if self.went_back < np.count_nonzero(timed_out):      # timeout probes went out: the timer backs off
            self.timeouts += 1
            self.rto_base = now
        return pending[kind == RK.FAST], pending[kind == RK.PROBE], pending[timed_out]

    def quiet_deadline(self, pending: np.ndarray, now: float, srtt: float | None, rto: float, max_rto: float,
                       pto: float | None = None, rttvar: float = 0.0, spacing: float = 0.0) -> float | None:
        """The common turn's shortcut of :meth:`lost` followed by :meth:`next_deadline` (same arguments):
        when :meth:`lost` would find nothing by its first test (no probe awaiting its evidence, neither
        timer due, no result of a later chunk), the deadline :meth:`next_deadline` gives, the test of the
        later results and the deadline in one compiled pass; None otherwise (call :meth:`lost`). A lossless
        stream's every turn takes it (the numpy temporaries and the second timeout computation cost ~20 us
        a turn of the client's loop on a busy machine)."""
        if not len(pending):
            return np.inf
        if self.rto_probing:
            return None
        pto = probe_timeout(pto, pending.size, srtt, rttvar, spacing)
        if self._probe_due(now, pto, max_rto) or now > self.rto_at(rto, max_rto):
            return None
        t = SK.quiet_deadline(pending, self.sent_at, self.later, self.tries, np.nan if srtt is None else srtt, rttvar,
                              np.nan if pto is None else pto, np.nan if pto is None else self._probe_at(pto, max_rto))
        if t != t:                        # NaN: a chunk has results of later ones (rules 1 and 2)
            return None
        self.went_back = 0
        return t

    def _probe_at(self, pto: float, max_rto: float) -> float:
        """When the probe timer fires: ``pto`` after it last started, doubled per probe of this silence."""
        return self.probe_base + min(pto * 2.0 ** self.probes, max_rto)

    def rto_at(self, rto: float, max_rto: float) -> float:
        """When rule 4's timer fires: ``rto`` after it last started (an arrival or a timeout probe), doubled
        per timeout probe of this silence, at most ``max_rto``."""
        return self.rto_base + min(rto * 2.0 ** self.timeouts, max_rto)

    def _probe_due(self, now: float, pto: float | None, max_rto: float) -> bool:
        return pto is not None and now > self._probe_at(pto, max_rto)

    reordering_window = staticmethod(RK.reordering_window)      # rule 2's window (srtt, rttvar) -> seconds

    def quiet_window(self, srtt: float, rttvar: float) -> float:
        """How long no result may follow a timeout probe's fresh answer before its lane goes back (rule 4):
        the reordering window plus the machine's wait for a core (``pause``), which a late peer's or the
        switch's next result may take on a loaded machine (a go-back then only resends what is coming)."""
        return self.reordering_window(srtt, rttvar) + self.pause

    def next_deadline(self, pending: np.ndarray, srtt: float | None, rttvar: float, pto: float | None,
                      max_rto: float, spacing: float = 0.0) -> float:
        """The earliest time rule 2 or 3, or rule 4's go-back after a quiet window, could find one of the
        ``pending`` chunks lost, if no result arrives before (inf: none could). Rule 4's timer is left to
        the receive's usual wait (at least the client's ``rto``, 20 ms by default, against that 2 ms wait)."""
        if not len(pending):
            return np.inf
        pto = probe_timeout(pto, len(pending), srtt, rttvar, spacing)
        t = RK.next_deadline(np.asarray(pending, np.int64), self.sent_at, self.later, self.tries,
                             np.nan if srtt is None else srtt, rttvar, np.nan if pto is None else pto,
                             np.nan if pto is None else self._probe_at(pto, max_rto))
        if srtt is not None and self.rto_probing and ((self.rto_probe >= 0) & (self.answer == RK.QUIET)).any():
            t = min(t, self.last_arrival + self.quiet_window(srtt, rttvar))
        return t

    def resent(self, chunks: np.ndarray, now: float, probed: bool = False, rules=None) -> None:
        """``chunks`` went out again at ``now``; ``probed``: one of them is a tail probe (rule 3).
        ``rules``: the (fast, probe, timed_out) chunks of :meth:`lost`, for :meth:`count_replayed`."""
        if probed:
            self.probes += 1
            self.probe_base = now
        for rule, which in enumerate(rules or (), start=FAST):
            self.rule[which] = rule
        if rules is not None and (rules[1].size or rules[2].size > self.went_back) and not self.probed_at:
            self.probed_at = now                   # the silence's first probe (rule 3's, or rule 4's)
        if probed and rules is not None and rules[1].size:
            probe = int(rules[1][0])
            self.tail_sends = self.tail_sends + 1 if probe == self.tail_probe else 1
            self.tail_probe = probe
            self._update_probing()
        self.tries[chunks] += 1
        self.sent(chunks, now, self.witness[chunks])

    def count_replayed(self, chunks: np.ndarray, stats) -> None:
        """Results of ``chunks`` came back as replays (the switch had completed their rounds): add the
        resent ones to ``stats``' fast_replayed, probe_replayed, timeout_replayed by the rule of their
        last resend (a first send's replay counts nowhere)."""
        by_rule = np.bincount(self.rule[chunks], minlength=TIMEOUT + 1)
        stats.fast_replayed += int(by_rule[FAST])
        stats.probe_replayed += int(by_rule[PROBE])
        stats.timeout_replayed += int(by_rule[TIMEOUT])
