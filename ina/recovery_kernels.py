"""Compiled per-burst work of :class:`ina.recovery.LossDetector`: the bookkeeping (the send order, the
pending list, the count of later results) and the rules' evaluation (``find_lost``, ``next_deadline``),
each one pass over the chunk arrays instead of a dozen numpy operations and temporaries per loop turn.
A turn with evidence of a loss ran the rules in numpy at about 40 us (1.7 M elements, 1% loss: 60
such turns per allreduce and rank, profiled); the pass costs a few. :mod:`ina.recovery` describes the
rules; this module is where they are applied (one place)."""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def mark_sent(chunks, now, witness, one_witness, next_seq, sent_at, seq, later, wit):
    """``chunks`` went out at ``now`` in this order, send numbers from ``next_seq``: their send time,
    send number, later-count (0) and witness flag (``witness[q]``, or ``witness[0]`` for all when
    ``one_witness``). Returns how many of them were never sent before."""
    first = 0
    for q in range(chunks.size):
        c = chunks[q]
        first += seq[c] == 0
        wit[c] = witness[0] if one_witness else witness[q]
        sent_at[c] = now
        seq[c] = next_seq + q
        later[c] = 0
    return first


@njit(cache=True)
def pending_chunks(low, high, done, seq):
    """Chunks in ``low..high`` that were sent (``seq > 0``) and are not ``done``, in order."""
    out = np.empty(max(0, high - low + 1), np.int64)
    m = 0
    for c in range(low, high + 1):
        if not done[c] and seq[c] > 0:
            out[m] = c
            m += 1
    return out[:m]


LANE_SPAN = 1 << 40    # send numbers stay below it: (lane, send number) as one sortable key


@njit(cache=True)
def count_later(chunks, pending, seq, tries, wit, lane, later):
    """Results of ``chunks`` arrived: each ``pending`` chunk's ``later`` grows by how many of them
    were sent after it in its own ``lane`` (the switch shard that serves the chunk: each shard
    answers in order, but two shards' results interleave however their processes run), counting
    only first sends (``tries == 0``, Karn) of witnesses (``wit``)."""
    arrived = np.empty(chunks.size, np.int64)
    m = 0
    for q in range(chunks.size):
        c = chunks[q]
        if tries[c] == 0 and wit[c]:
            arrived[m] = lane[c] * LANE_SPAN + seq[c]
            m += 1
    if m == 0 or pending.size == 0:
        return
    arrived = np.sort(arrived[:m])
    for q in range(pending.size):
        p = pending[q]
        later[p] += _count_below(arrived, (lane[p] + 1) * LANE_SPAN) - _count_below(arrived, lane[p] * LANE_SPAN
                                                                                      + seq[p] + 1)


@njit(cache=True, inline="always")
def _count_below(sorted_keys, key):
    """How many of ``sorted_keys`` are below ``key`` (searchsorted, side="left")."""
    lo, hi = 0, sorted_keys.size
    while lo < hi:
        mid = (lo + hi) // 2
        if sorted_keys[mid] < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


# the rules' constants (ina.recovery describes the rules; these kernels apply them)
DUPTHRESH = 3          # later results that mark a chunk lost (TCP's three duplicate ACKs)
REO_FLOOR = 5e-4       # seconds a chunk may trail a later one before it counts as lost (reordering)
NONE, FAST, PROBE, TIMEOUT = 0, 1, 2, 3     # what a pending chunk is found: not lost, or lost by rule 1-2, 3, 4
GO_BACK = 4            # found by rule 4's go-back: timed out before the lane's timeout probe, which was answered
ARMED, QUIET, NOW = 0, 1, 2     # a lane's timeout probe: unanswered; answered (go back after a quiet window); replayed
AGED = 3               # a lane's tail probe (rule 3) replayed: go back for the chunks out longer than the stall time
SHORT_PROBE_MAX_PENDING = 3   # rule 3 probes a silence with more chunks pending than this only later (probe_timeout)
PROBE_SENDS = 2        # an unanswered probe's chunk goes out this many times in a row, then the next is picked


@njit(cache=True)
def reordering_window(srtt, rttvar):
    """How long a chunk may trail one sent after it before it counts as lost (rule 2)."""
    return 1.25 * srtt + 2 * rttvar + REO_FLOOR


@njit(cache=True)
def duplicate_thresholds(pending, later, seq, lane, unsent, out):
    """Rule 1's count for each of the ``pending`` chunks, into ``out``: DUPTHRESH, or less at the
    stream's end (early retransmit, RFC 5827): once every chunk went out (``unsent`` 0) and fewer than
    DUPTHRESH + 1 of its lane are outstanding (the lane's pending chunks and the results that came after
    its oldest), one less than that many. Per lane, as ``later`` counts (count_later): another shard's
    chunks are no evidence. One pass to count each lane, one to apply (linear in the pending chunks)."""
    if unsent or pending.size == 0:
        out[:pending.size] = DUPTHRESH
        return
    lanes = 0
    for q in range(pending.size):
        lanes = max(lanes, lane[pending[q]] + 1)
    outstanding = np.zeros(lanes, np.int64)
    oldest = np.full(lanes, -1, np.int64)
    for q in range(pending.size):
        c = pending[q]
        m = lane[c]
        outstanding[m] += 1
        if oldest[m] < 0 or seq[c] < seq[oldest[m]]:
            oldest[m] = c
    for q in range(pending.size):
        m = lane[pending[q]]
        out[q] = max(1, min(DUPTHRESH, outstanding[m] + later[oldest[m]] - 1))


@njit(cache=True, inline="always")
def _first_pick(tries_p, seq_p, tries_b, seq_b, have_b):
    """Whether a chunk (``tries_p`` resends, sent as ``seq_p``) goes before the pick so far (``have_b``):
    the least resent, oldest send first (rule 3's probe, rule 4's per lane)."""
    return not have_b or tries_p < tries_b or (tries_p == tries_b and seq_p < seq_b)


@njit(cache=True, inline="always")
def _unanswered_first(again, sends, pick, kind):
    """The pending index to probe (rule 3's probe, rule 4's per lane): ``again``, the last probe's chunk while
    it is unanswered and found by no other rule (``kind`` NONE; -1: none), if it went out fewer than
    PROBE_SENDS times in a row (``sends``), else ``pick`` (the least resent, oldest). The switch drops a
    rank's first resend of a round another rank's resend or LATE packet completed (RETRANSMIT_CROSSED,
    switch_model/alu.py) but replays its second, so a second send gets the probe its answer, where a new
    chunk per probe met that drop every time. It drops every resend of a round still waiting for a peer's
    packet (RETRANSMIT_PENDING): two ranks that lost each other's chunks and probe the other's re-sent
    them at every probe, until rule 4, so after the second send the probe moves on."""
    return again if again >= 0 and sends < PROBE_SENDS and kind[again] == NONE else pick


@njit(cache=True, inline="always")
def _before_probe(p, m, seq, rto_probe):
    """Whether chunk ``p`` was sent before lane ``m``'s probe (the one a go-back is for)."""
    return rto_probe[m] >= 0 and seq[p] < seq[rto_probe[m]]


@njit(cache=True)
def find_lost(pending, now, sent_at, seq, later, tries, lane, unsent, srtt, rttvar, rto, max_rto, pto, probe_due,
              last_arrival, rto_due, rto_probe, answer, kind, stall, tail_probe, quiet_after, rto_sends, tail_sends):
    """Rules 1 to 4 of ina.recovery over the ``pending`` chunks in one pass: ``kind[q]`` of
    ``pending[q]`` becomes NONE, FAST, PROBE, TIMEOUT (rule 4's probe, at most one per lane) or GO_BACK.
    ``srtt``, ``pto``: NaN when unknown; ``probe_due``: the probe timer fired; ``rto_due``: rule 4's
    timer fired. ``rto_probe[m]``: the chunk of lane m's last probe awaiting its evidence (-1: none),
    ``answer[m]`` what became of it (ARMED, QUIET: go back once the silence lasts ``quiet_after``, NaN:
    ``rto``; NOW; AGED: a tail probe replayed, whose go-back takes
    only chunks out longer than ``stall`` and only with at least SHORT_PROBE_MAX_PENDING of the lane left);
    a lane that goes back, or has nothing to go back for, is reset here (-1, ARMED), and a lane probed gets
    the probe's chunk (the caller resends what is found), ``rto_sends[m]`` how many times in a row it went
    out. ``tail_probe``: rule 3's last probe, its chunk, while unanswered (-1: none), sent ``tail_sends``
    times in a row; a probe goes to its last chunk again once (rule 4's per lane too), else to the least
    resent chunk, oldest first (_unanswered_first). Returns whether any chunk was found lost."""
    window = reordering_window(srtt, rttvar) if srtt == srtt else np.nan
    silence = now - last_arrival
    quiet = silence > (quiet_after if quiet_after == quiet_after else rto)
    found = False
    probe, probe_tries, probe_seq, probe_again = -1, 0, 0, -1
    lanes = rto_probe.size
    left = np.zeros(lanes, np.int64)        # each lane's pending chunks (for an AGED go-back)
    for q in range(pending.size):
        left[lane[pending[q]]] += 1
    back = np.zeros(lanes, np.bool_)        # lanes whose timed-out chunks go back now
    for m in range(lanes):
        back[m] = rto_probe[m] >= 0 and (answer[m] == NOW or (answer[m] == QUIET and quiet)
                                         or (answer[m] == AGED and left[m] >= SHORT_PROBE_MAX_PENDING))
    best = np.full(lanes, -1, np.int64)     # each lane's timeout probe
    again = np.full(lanes, -1, np.int64)    # ... unless its last one is unanswered and still pending: that one
    older = np.zeros(lanes, np.bool_)       # a chunk sent before the lane's timeout probe is pending
    for q in range(pending.size):       # rule 1's counts (into kind, scratch until overwritten below): only
        if later[pending[q]] > 0:       # where some chunk has a later result (the common turn has none)
            duplicate_thresholds(pending, later, seq, lane, unsent, kind)
            break
    for q in range(pending.size):
        p = pending[q]
        m = lane[p]
        age = now - sent_at[p]
        backoff = 2.0 ** tries[p]
        fast = later[p] > 0 and later[p] >= kind[q]
        if window == window:
            fast = fast or (later[p] > 0 and age > window)
            # a resent chunk's result may be late because a peer has yet to resend its own packet (every
            # rank sees a lost data packet as missing): resent again only after the reordering window,
            # doubled per resend, not whenever results of chunks sent after it arrive
            fast = fast and age > (window * backoff / 2 if tries[p] > 0 else 0.0)
        # as TCP's retransmission timer, restarted by every result
        limit = min(rto * backoff, max_rto)
        kind[q] = NONE
        before = _before_probe(p, m, seq, rto_probe)
        older[m] = older[m] or before
        if p == rto_probe[m] and answer[m] == ARMED:
            again[m] = q
        if fast:
            kind[q] = FAST
        elif back[m]:
            if before and (answer[m] != AGED or age > stall):
                kind[q] = GO_BACK
        elif rto_due and age > limit and silence > limit:
            b = best[m]
            if _first_pick(tries[p], seq[p], tries[pending[b]], seq[pending[b]], b >= 0):
                best[m] = q
        elif probe_due and age > pto:
            if p == tail_probe:
                probe_again = q
            if _first_pick(tries[p], seq[p], probe_tries, probe_seq, probe >= 0):
                probe, probe_tries, probe_seq = q, tries[p], seq[p]
        found = found or kind[q] != NONE
    for m in range(lanes):
        if back[m] or (answer[m] != ARMED and (answer[m] == AGED or not older[m])):
            rto_probe[m], answer[m] = -1, ARMED     # gone back, or nothing (more) to go back for
        elif best[m] >= 0:
            q = _unanswered_first(again[m], rto_sends[m], best[m], kind)
            kind[q] = TIMEOUT
            rto_sends[m] = rto_sends[m] + 1 if q == again[m] else 1
            rto_probe[m], answer[m] = pending[q], ARMED
            found = True
    if probe >= 0:
        kind[_unanswered_first(probe_again, tail_sends, probe, kind)] = PROBE
        found = True
    return found


@njit(cache=True)
def next_deadline(pending, sent_at, later, tries, srtt, rttvar, pto, probe_at):
    """The earliest time rule 2 or 3 could find one of the ``pending`` chunks lost if no result arrives
    before (inf: none could). ``probe_at``: when the probe timer fires; ``srtt``, ``pto``: NaN when unknown."""
    t = np.inf
    if pending.size == 0:
        return t
    if pto == pto:           # the probe timer, and a chunk out for longer than pto
        oldest = np.inf
        for q in range(pending.size):
            oldest = min(oldest, sent_at[pending[q]])
        t = max(probe_at, oldest + pto)
    if srtt == srtt:         # rule 2's window (backed off for a resent chunk)
        window = reordering_window(srtt, rttvar)
        for q in range(pending.size):
            p = pending[q]
            if later[p] > 0:
                t = min(t, sent_at[p] + window * 2.0 ** max(tries[p] - 1, 0))
    return t
