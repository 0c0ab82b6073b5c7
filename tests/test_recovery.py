"""Loss recovery: fast retransmission where the stream shows a loss, a short timeout for the tail.

The rules are unit-tested on :class:`ina.recovery.LossDetector` (no sockets); the end-to-end tests
run a real switch with user-space impairments in one direction at a time and read the clients'
counters: a lost data packet (worker -> switch) and a lost result (switch -> worker) are both
recovered by fast retransmission while the timeout is set far above the test's duration, and the
results stay bit-identical to the numpy reference (a resend never adds twice).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading

import numpy as np
import pytest

from ina.client import ClientStats
from ina.coalescing import ArrivalSpacing, pause_length
from ina.recovery import DUPTHRESH, LossDetector

sys.path.insert(0, os.path.dirname(__file__))
from sw_harness import SwitchProc, Workers, bfp_reference, expected_inputs  # noqa: E402


# ------------------------------------------------------------------------------------------------
# the rules, without sockets
# ------------------------------------------------------------------------------------------------
def test_duplicate_threshold_marks_the_gap_lost_and_nothing_else():
    ld = LossDetector(10)
    ld.sent(np.arange(10), now=0.0)
    pending = np.arange(10)
    arrived = np.array([1, 2])                 # chunk 0's result is missing, two later ones arrived
    ld.delivered(arrived, np.setdiff1d(pending, arrived), now=1e-4)
    pending = np.setdiff1d(pending, arrived)
    fast, _, late = ld.lost(pending, now=1e-4, srtt=None, rto=1.0, max_rto=1.0)
    assert fast.size == 0 and late.size == 0   # below the threshold: could be reordering
    ld.delivered(np.array([3]), np.setdiff1d(pending, [3]), now=1e-4)
    pending = np.setdiff1d(pending, [3])
    fast, _, late = ld.lost(pending, now=1e-4, srtt=None, rto=1.0, max_rto=1.0)
    assert fast.tolist() == [0] and late.size == 0
    assert ld.later[0] == DUPTHRESH
    ld.resent(fast, now=2e-4)                  # a resend starts the count again
    assert ld.later[0] == 0 and ld.tries[0] == 1
    fast, _, late = ld.lost(pending, now=3e-4, srtt=None, rto=1.0, max_rto=1.0)
    assert fast.size == 0 and late.size == 0


def test_the_loss_rules_are_loaded_with_the_first_stream_not_at_the_first_loss():
    """The compiled rules run only on evidence of a loss: loaded at the first stream, the first loss of a
    process finds them ready (it used to pay numba's cache load, or a compile that stalled every rank)."""
    import subprocess
    code = """
import numpy as np
from ina import recovery_kernels as RK
from ina.recovery import LossDetector
assert not RK.find_lost.signatures
ld = LossDetector(10)
loaded = list(RK.find_lost.signatures)
ld.sent(np.arange(10), now=0.0)
ld.delivered(np.array([1, 2, 3]), np.array([0, 4, 5, 6, 7, 8, 9]), now=1e-4)
for srtt, pto in ((None, None), (1e-4, 2e-4)):
    fast, _, _ = ld.lost(np.array([0, 4, 5, 6, 7, 8, 9]), now=1e-4, srtt=srtt, rto=float("inf"), max_rto=1.0, pto=pto,
                         rttvar=0.0)
    assert fast.tolist() == [0], fast
assert loaded and RK.find_lost.signatures == loaded, (loaded, RK.find_lost.signatures)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_sharded_switchs_interleaved_results_are_no_evidence_across_shards():
    """Two switch shards (chunk c served by shard c % 2) answer in order each, but one process may run
    ahead of the other: results of the other shard's later chunks say nothing of a chunk's loss; results
    of its own shard's do."""
    ld = LossDetector(12, lanes=np.arange(12) % 2)
    ld.sent(np.arange(12), now=0.0)
    pending = np.array([1, 3, 5, 7, 9, 11])
    ld.delivered(np.array([0, 2, 4, 6, 8, 10]), pending, now=1e-4)     # shard 0 ran ahead
    assert ld.later[pending].tolist() == [0] * 6
    fast, _, _ = ld.lost(pending, now=0.05, srtt=1e-3, rto=1.0, max_rto=1.0)
    assert fast.size == 0
    ld.delivered(np.array([5, 7, 9]), np.array([1, 3, 11]), now=2e-4)  # shard 1's later chunks: 1 and 3 were lost
    assert ld.later[[1, 3, 11]].tolist() == [3, 3, 0]
    fast, _, _ = ld.lost(np.array([1, 3, 11]), now=2e-4, srtt=1e-3, rto=1.0, max_rto=1.0)
    assert fast.tolist() == [1, 3]


def test_early_retransmit_counts_the_outstanding_chunks_of_the_lost_chunks_shard():
    """At a stream's end with two shards (chunk c served by shard c % 2): shard 0 has chunk 0 pending and
    chunk 2's result back, 2 outstanding, so one later result of its own shard marks chunk 0 lost, whatever
    shard 1 still has out; in one shard the same results are 4 outstanding, below the threshold."""
    for lanes, lost in ((np.arange(4) % 2, [0]), (None, [])):
        ld = LossDetector(4, lanes=lanes)
        ld.sent(np.arange(4), now=0.0)
        ld.delivered(np.array([2]), np.array([0, 1, 3]), now=1e-4)
        fast, _, _ = ld.lost(np.array([0, 1, 3]), now=1e-4, srtt=None, rto=1.0, max_rto=1.0)
        assert fast.tolist() == lost, lanes


def test_a_chunk_resent_later_is_not_counted_against_by_older_results():
    ld = LossDetector(6)
    ld.sent(np.arange(6), now=0.0)
    ld.resent(np.array([0]), now=0.01)         # chunk 0 went out again after chunks 1..5
    ld.delivered(np.array([1, 2, 3, 4, 5]), np.array([0]), now=0.02)
    assert ld.later[0] == 0                    # their sends are older than chunk 0's resend


def test_the_quiet_turns_shortcut_answers_as_the_rules_do():
    """LossDetector.quiet_deadline (the client's every turn) gives a deadline only where lost() finds
    nothing, and then next_deadline()'s; random streams (fixed seed): sends, results in and out of
    order, resends, timers of every kind, a probe awaiting its answer."""
    import copy
    rng = np.random.default_rng(14)
    quiet = loud = 0
    for _ in range(400):
        n = int(rng.integers(1, 40))
        ld = LossDetector(n, rng.integers(0, 2, n) if rng.random() < 0.3 else None)
        ld.sent(np.arange(n), now=0.0)
        done = np.zeros(n, bool)
        for _ in range(int(rng.integers(0, 4))):           # bursts of results, now and then out of order
            k = int(rng.integers(1, n + 1))
            got = np.sort(rng.choice(n, size=min(k, n), replace=False)) if rng.random() < 0.3 else np.arange(k)
            got = got[~done[got]]
            done[got] = True
            ld.delivered(got, ld.pending(0, n - 1, done), now=float(rng.uniform(0.0, 0.01)))
        pending = ld.pending(0, n - 1, done)
        if pending.size and rng.random() < 0.2:
            ld.resent(pending[:1], now=0.005, probed=True, rules=(pending[:0], pending[:1], pending[:0]))
        now = float(rng.uniform(0.0, 0.05))
        srtt = None if rng.random() < 0.2 else float(rng.uniform(1e-4, 0.01))
        rto = float(rng.choice([0.02, 0.003, np.inf]))
        args = (pending, now, srtt, rto, 1.0, None if rng.random() < 0.2 else float(rng.uniform(1e-3, 0.02)),
                float(rng.uniform(0, 1e-3)), float(rng.uniform(0, 1e-4)))
        q = copy.deepcopy(ld).quiet_deadline(*args)
        if q is None:
            loud += 1
            continue
        quiet += 1
        ref = copy.deepcopy(ld)
        assert all(a.size == 0 for a in ref.lost(*args))
        assert q == ref.next_deadline(pending, args[2], args[6], args[5], args[4], args[7])
    assert quiet > 50 and loud > 50, (quiet, loud)


def test_reordering_window_needs_a_later_result_and_an_age_above_srtt():
    ld = LossDetector(4)
    ld.sent(np.arange(4), now=0.0)
    ld.delivered(np.array([3]), np.array([0, 1, 2]), now=0.002)
    pending = np.array([0, 1, 2])
    srtt = 0.010
    fast, _, _ = ld.lost(pending, now=0.005, srtt=srtt, rto=1.0, max_rto=1.0)
    assert fast.size == 0                      # younger than 1.25 srtt: may still be reordered
    fast, _, late = ld.lost(pending, now=0.020, srtt=srtt, rto=1.0, max_rto=1.0)
    assert fast.tolist() == [0, 1, 2] and late.size == 0


def test_the_timeout_probes_the_oldest_chunk_of_each_lane_and_backs_off():
    """Rule 4 after a silence of the RTO resends one chunk per switch shard (lane), the least resent,
    oldest first: a probe of the silence, not the window; the next one after twice the RTO, at most
    max_rto, and of the same chunk once more while it is unanswered (the switch may drop a rank's first resend
    of a round as crossing the result, never its second); after a second unanswered send, of the least resent
    chunk again (a round waiting for a peer's packet drops every resend)."""
    ld = LossDetector(8, lanes=np.arange(8) % 2)
    ld.sent(np.arange(8), now=0.0)
    pending = np.arange(8)
    _, _, late = ld.lost(pending, now=0.009, srtt=0.001, rto=0.01, max_rto=1.0)
    assert late.size == 0
    _, _, late = ld.lost(pending, now=0.011, srtt=0.001, rto=0.01, max_rto=1.0)
    assert late.tolist() == [0, 1] and ld.went_back == 0
    ld.resent(late, now=0.011, rules=(late[:0], late[:0], late))
    _, _, late = ld.lost(pending, now=0.030, srtt=0.001, rto=0.01, max_rto=1.0)
    assert late.size == 0                      # the silence's timer doubled: 0.011 + 0.02
    _, _, late = ld.lost(pending, now=0.032, srtt=0.001, rto=0.01, max_rto=1.0)
    assert late.tolist() == [0, 1] and ld.went_back == 0     # unanswered: the same probes again
    ld.resent(late, now=0.032, rules=(late[:0], late[:0], late))
    _, _, late = ld.lost(pending, now=0.032 + 0.013, srtt=0.001, rto=0.01, max_rto=0.012)
    assert late.tolist() == [2, 3]             # the backoff never exceeds max_rto; sent twice: the next chunks
    ld.resent(late, now=0.045, rules=(late[:0], late[:0], late))
    ld.answered(np.array([2]), np.array([True]))     # lane 0's probe replayed: its lane goes back
    ld.delivered(np.array([2]), np.array([0, 1, 3, 4, 5, 6, 7]), now=0.046)
    _, _, late = ld.lost(np.array([0, 1, 3, 4, 5, 6, 7]), now=0.046, srtt=0.001, rto=0.01, max_rto=1.0)
    assert late.tolist() == [0, 4, 6] and ld.went_back == 3


def _timed_out_window(n=6, lanes=None, pause=0.0):
    ld = LossDetector(n, lanes=lanes, pause=pause)
    ld.sent(np.arange(n), now=0.0)
    _, _, late = ld.lost(np.arange(n), now=0.011, srtt=0.001, rto=0.01, max_rto=1.0)
    assert late.tolist() == [0]
    ld.resent(late, now=0.011, rules=(late[:0], late[:0], late))
    return ld


def test_a_replayed_timeout_probe_sends_the_rest_of_the_timed_out_chunks_at_once():
    """The probe's result came back as a replay: its round had completed and the result was lost on
    the way back, so the chunks timed out with it were lost alike: all of them go out at once (go-back),
    one round trip after the probe, not one timeout each."""
    ld = _timed_out_window()
    ld.answered(np.array([0]), np.array([True]))
    ld.arrived(0.012)
    _, _, late = ld.lost(np.arange(1, 6), now=0.012, srtt=0.001, rto=0.01, max_rto=1.0)
    assert late.tolist() == [1, 2, 3, 4, 5] and ld.went_back == 5
    ld.resent(late, now=0.012, rules=(late[:0], late[:0], late))
    _, _, late = ld.lost(np.arange(1, 6), now=0.0125, srtt=0.001, rto=0.01, max_rto=1.0)
    assert late.size == 0                      # once


def test_a_timeout_probe_answered_by_a_result_goes_back_only_after_a_quiet_window():
    """The probe's result came back fresh: either the resend completed the round (this rank's data
    packets were lost: the others will not come) or a late peer did (the others follow at once). The
    rest goes out once no result came for the reordering window; results flowing keep them waiting."""
    ld = _timed_out_window()
    ld.answered(np.array([0]), np.array([False]))
    ld.arrived(0.012)
    window = LossDetector.reordering_window(0.001, 0.0)
    _, _, late = ld.lost(np.arange(1, 6), now=0.012 + window * 0.9, srtt=0.001, rto=0.01, max_rto=1.0)
    assert late.size == 0
    _, _, late = ld.lost(np.arange(1, 6), now=0.012 + window * 1.1, srtt=0.001, rto=0.01, max_rto=1.0)
    assert late.tolist() == [1, 2, 3, 4, 5] and ld.went_back == 5
    ld = _timed_out_window()                   # a late peer: the others' results follow the probe's
    ld.answered(np.array([0]), np.array([False]))
    for k in range(1, 6):
        now = 0.012 + k * window * 0.5
        ld.delivered(np.array([k]), np.arange(k + 1, 6), now=now)
        _, _, late = ld.lost(np.arange(k + 1, 6), now=now + window * 0.4, srtt=0.001, rto=0.01, max_rto=1.0)
        assert late.size == 0, k


def test_the_quiet_window_is_padded_by_the_machines_wait_for_a_core():
    """On a loaded machine (the client measured a 5 ms wait for a core) a late peer's or the switch's next
    result may come that much later: the fresh answer's quiet window is the reordering window plus that
    wait, both in the rule and in the receive's deadline; a result within it disarms the go-back."""
    pause, window = 0.005, LossDetector.reordering_window(0.001, 0.0)
    ld = _timed_out_window(pause=pause)
    ld.answered(np.array([0]), np.array([False]))
    ld.arrived(0.012)
    assert ld.next_deadline(np.arange(1, 6), 0.001, 0.0, None, 1.0) == pytest.approx(0.012 + window + pause)
    _, _, late = ld.lost(np.arange(1, 6), now=0.012 + window + 0.9 * pause, srtt=0.001, rto=0.01, max_rto=1.0)
    assert late.size == 0                      # beyond the reordering window, within the wait for a core
    _, _, late = ld.lost(np.arange(1, 6), now=0.012 + window + 1.1 * pause, srtt=0.001, rto=0.01, max_rto=1.0)
    assert late.tolist() == [1, 2, 3, 4, 5] and ld.went_back == 5
    ld = _timed_out_window(pause=pause)        # a late peer's next result after a wait for a core: no go-back
    ld.answered(np.array([0]), np.array([False]))
    ld.arrived(0.012)
    now = 0.012 + window + 0.9 * pause
    ld.answered(np.array([1]), np.array([False]))
    ld.delivered(np.array([1]), np.arange(2, 6), now=now)
    fast, probe, late = ld.lost(np.arange(2, 6), now=now + window + 1.1 * pause, srtt=0.001, rto=0.01, max_rto=1.0)
    assert fast.size + probe.size + late.size == 0 and ld.went_back == 0


def test_a_quiet_go_back_is_disarmed_by_a_later_result_of_its_lane_and_has_its_own_deadline():
    """The probe's result came back fresh, then results of the lane followed (a late peer sending): a
    later pause of the peer longer than the reordering window sends nothing back. Until a result follows,
    the receive waits no longer than the quiet window (next_deadline)."""
    ld = _timed_out_window()
    ld.answered(np.array([0]), np.array([False]))
    ld.arrived(0.012)
    window = LossDetector.reordering_window(0.001, 0.0)
    assert ld.next_deadline(np.arange(1, 6), 0.001, 0.0, None, 1.0) == pytest.approx(0.012 + window)
    now = 0.012
    for k in (1, 2):
        now += 0.5 * window
        ld.answered(np.array([k]), np.array([False]))
        ld.delivered(np.array([k]), np.arange(k + 1, 6), now=now)
    assert not ld.rto_probing
    fast, probe, late = ld.lost(np.arange(3, 6), now=now + 1.1 * window, srtt=0.001, rto=0.01, max_rto=1.0)
    assert fast.size + probe.size + late.size == 0 and ld.went_back == 0


def _tail_probed(n, young=()):
    """``n`` chunks out at 0 (``young`` of them resent at 9 ms), probed by rule 3 at 9.5 ms: the probe's chunk."""
    ld = LossDetector(n)
    ld.sent(np.arange(n), now=0.0)
    if len(young):
        ld.sent(np.asarray(young), now=0.009)
    fast, probe, late = ld.lost(np.arange(n), now=0.0095, srtt=0.001, rto=1.0, max_rto=1.0, pto=0.002)
    assert probe.tolist() == [0] and fast.size + late.size == 0
    ld.resent(probe, now=0.0095, probed=True, rules=(probe[:0], probe, probe[:0]))
    return ld


def test_a_replayed_tail_probe_with_chunks_left_sends_those_out_longer_than_the_stall_time_at_once():
    """Rule 3's probe of a silence with more than 3 chunks out comes back as a replay (the results were
    lost on the way back): the chunks out longer than srtt + 4 rttvar go out at once (go-back), not one
    probe's silence each; the ones sent since wait. A fresh answer, or 2 chunks left, sends nothing."""
    ld = _tail_probed(8, young=[6, 7])
    assert ld.rto_probing
    ld.answered(np.array([0]), np.array([True]))
    ld.arrived(0.0098)
    fast, probe, late = ld.lost(np.arange(1, 8), now=0.0099, srtt=0.001, rto=1.0, max_rto=1.0, pto=0.002)
    assert late.tolist() == [1, 2, 3, 4, 5] and ld.went_back == 5 and fast.size + probe.size == 0
    ld.resent(late, now=0.0099, rules=(late[:0], late[:0], late))
    _, _, late = ld.lost(np.arange(1, 8), now=0.0101, srtt=0.001, rto=1.0, max_rto=1.0, pto=0.002)
    assert late.size == 0                      # once
    for n, replayed in ((8, False), (3, True)):
        ld = _tail_probed(n)
        ld.answered(np.array([0]), np.array([replayed]))
        ld.arrived(0.0098)
        fast, probe, late = ld.lost(np.arange(1, n), now=0.0099, srtt=0.001, rto=1.0, max_rto=1.0, pto=0.002)
        assert fast.size + probe.size + late.size == 0, (n, replayed)


def test_the_timers_spacing_skips_a_gap_a_probes_answer_ends_once_it_has_an_estimate():
    """A gap that a probe fired in, ended by a resent chunk's result (``probed_after``), is the loss's
    recovery when the timers already have a spacing (the probe timeout came from it): skipped. Without
    one it is taken, at most as long as the wait before the probe. The next stream starts from at most
    this one's time per result."""
    sp, now = ArrivalSpacing(), 0.0
    for _ in range(6):
        now += 2e-5
        sp.sample(1, now)
    for _ in range(6):
        now += 5e-3
        sp.sample(1, now, recovered=True, probed_after=4e-3)
    assert sp.for_timers() == pytest.approx(2e-5)
    sp, now = ArrivalSpacing(), 0.0
    sp.sample(1, now)
    for _ in range(4):
        now += 5e-3
        sp.sample(1, now, recovered=True, probed_after=1e-3)
    assert sp.for_timers() == pytest.approx(1e-3)
    sp = ArrivalSpacing(prior=0.5)             # a stream of 12 results in 1.2 ms: the prior ages out
    sp.sample(12, 1.2e-3)
    assert sp.next_prior(started=0.0) == pytest.approx(1e-4)


def test_replays_are_counted_by_the_rule_of_the_chunks_last_resend():
    """A replay answers a resend whose round had completed (a result lost on the way back): counted
    under the rule that resent the chunk last; a result the switch did not replay counts nowhere."""
    ld = LossDetector(6)
    ld.sent(np.arange(6), now=0.0)
    none = np.array([], np.int64)
    ld.resent(np.array([0, 1, 2]), now=0.01, rules=(np.array([0, 1]), none, np.array([2])))
    ld.resent(np.array([1]), now=0.02, probed=True, rules=(none, np.array([1]), none))
    stats = ClientStats()
    ld.count_replayed(np.array([0, 1, 2, 3]), stats)      # chunk 3 was never resent
    assert (stats.fast_replayed, stats.probe_replayed, stats.timeout_replayed) == (1, 1, 1)


# ------------------------------------------------------------------------------------------------
# end to end: one direction impaired at a time, the timeout far above the test's duration
# ------------------------------------------------------------------------------------------------
OPS = [{"codec": "bfp32", "shape": [64 * 60 + 17 * i], "seed": 900 + i} for i in range(12)]
N = 4
# the safety-net timeout at 0.3 s, a hundred loopback round trips: a fast retransmission comes long
# before it. Only tail losses (the negotiation packet, the last chunks of a stream: about 3 of the 62
# packets a rank sends per allreduce) need the tail probe, and ranks waiting for the rank that
# recovers one send a few backed-off probes; so probes and timeouts stay a small share of the resends.
# The probe's floor is 20 ms here (its default is 1 ms): a rank that waits for
# a peer the loaded machine did not schedule sees the same silence as a tail loss, and these tests
# count how losses in the stream are recovered, not the scheduler's pauses
SLOW_TIMEOUT = {"elements": 64, "slots": 16, "timeout": 60.0, "rto": 0.3, "min_rto": 0.02, "max_rto": 0.6}


def _check_exact(out, ops, n):
    for i, op in enumerate(ops):
        ref = bfp_reference(expected_inputs(op, n))
        for r in range(n):
            assert np.array_equal(out[r]["results"][i].view(np.uint32), ref.view(np.uint32)), (i, r)


@pytest.mark.parametrize("direction", ["ingress", "egress"])
def test_lost_packets_are_recovered_by_fast_retransmission(tmp_path, direction):
    """2% loss worker -> switch (lost data packets) or switch -> worker (lost results): losses are
    recovered by fast retransmission, the timeout only sees the tail, and every result is exact."""
    seed = {"ingress": 3, "egress": 8}[direction]
    sw = SwitchProc("--slots", "64", "--elements", "64", f"--{direction}-loss", "0.02", "--seed", str(seed),
                    log_path=tmp_path / "switch.log")
    try:
        # the first allreduce is a warm-up (code loading, numba caches): ranks wait for each other then
        out = Workers(tmp_path, sw.port, N, job=3, ops=OPS, client=SLOW_TIMEOUT, warmup_ops=1).wait(timeout=100)
        dropped = sw.stats()["impairments"][direction]["dropped"]
    finally:
        sw.terminate()
    assert dropped >= 5, f"the impairment dropped only {dropped} packets: the test shows nothing"
    def after_warmup(key):
        return sum(m["stats"][key] - m["stats_after_warmup"][key] for m in out.values())
    fast = after_warmup("fast_retransmissions")
    timeouts = after_warmup("probe_retransmissions") + after_warmup("timeout_retransmissions")
    assert fast >= dropped                      # every loss was seen by at least the rank that lost it
    stats = {r: m["stats"] for r, m in out.items()}
    if direction == "ingress":
        # a lost data packet stalls its round for every rank alike: each resends (none can tell whose it was)
        assert timeouts < fast / 3, (timeouts, fast, stats)
    else:
        # a lost result stalls only the rank that lost it; its resend is answered by a replay (the round
        # had completed). Its peers soon wait for its next packet and, at the tail (the last chunk it sends,
        # the next allreduce's negotiation), see the same silence and probe: those probes recover no loss
        # and are not counted here. The results lost on the way back are recovered by fast retransmission
        # but for the tail ones
        fast_recovered = after_warmup("fast_replayed")
        late_recovered = after_warmup("probe_replayed") + after_warmup("timeout_replayed")
        assert late_recovered < fast_recovered / 3, (late_recovered, fast_recovered, stats)
    _check_exact(out, OPS, N)


def test_tail_loss_is_recovered_by_the_probe_not_the_timeout(tmp_path):
    """Allreduces of one chunk each (nothing is sent after it, so the stream cannot show its loss)
    under 10% loss: they complete and are exact, and after the first allreduce every loss was
    recovered by the tail probe (a few loopback round trips), none by the 1 s safety-net timeout."""
    sw = SwitchProc("--slots", "64", "--elements", "64", "--loss", "0.1", "--seed", "5",
                    log_path=tmp_path / "switch.log")
    try:
        ops = [{"codec": "bfp32", "shape": [50], "seed": 40 + i} for i in range(60)]
        client = {"elements": 64, "slots": 4, "timeout": 60.0, "rto": 1.0, "min_rto": 0.002, "max_rto": 2.0}
        out = Workers(tmp_path, sw.port, N, job=4, ops=ops, client=client, warmup_ops=1).wait(timeout=120)
        dropped = sum(sw.stats()["impairments"][d]["dropped"] for d in ("ingress", "egress"))
    finally:
        sw.terminate()
    assert dropped >= 10, f"the impairment dropped only {dropped} packets: the test shows nothing"

    def after_warmup(key):
        return sum(m["stats"][key] - m["stats_after_warmup"][key] for m in out.values())
    assert after_warmup("probe_retransmissions") > 0
    assert after_warmup("timeout_retransmissions") == 0
    for m in out.values():
        assert m["probe_timeout_s"] < 0.25, m["probe_timeout_s"]   # measured, far below the safety net
    _check_exact(out, ops, N)


def test_a_tail_loss_of_more_than_three_results_is_recovered_by_probes_not_the_timeout(tmp_path):
    """One rank (no peer's wait mixes in), streams of 12 chunks all out at once (16 slots), the last k of
    a stream's results lost on the way back, chosen, not drawn (``LostResults``: k = 4, 6, 11, after a
    warm-up that measured the round trips), as when a socket buffer overflows while its process waits
    for a core: nothing that arrives shows their loss. A silence with more than 3 chunks out is probed
    after the round trip plus their serialisation (recovery.probe_timeout), one chunk; its replay (the
    round had completed) sends the chunks out longer than the round trip at once (go-back: 3 or more
    left in the lane), and those left, if any, are probed after the plain probe timeout: no lost result
    waits for the 2 s safety-net timeout (no timeout probe), each stream well within it, and every
    result is exact. The first probe waited the longer silence (``stall_probes``: more than 3 out)."""
    from sw_harness import LostResults
    ops = [{"codec": "bfp32", "shape": [64 * 12], "seed": 300 + i} for i in range(4)]
    inputs = [expected_inputs(op, 1) for op in ops]
    lose = [0, 4, 6, 11]                         # results lost at the end of each stream (the first: warm-up)

    def body(rank, cl):
        lost, out = LostResults(cl), []
        for xs, k in zip(inputs, lose):
            if k:
                lost.arm(keep=12 - k)
            out.append((*_timed_allreduce(cl, xs[rank]), lost.dropped))
            lost.disarm()
            lost.dropped = 0
        return out
    per_stream = _one_rank_streams(tmp_path, 12, body)
    for (y, d, secs, dropped), k, xs in zip(per_stream, lose, inputs):
        assert np.array_equal(y.view(np.uint32), bfp_reference(xs).view(np.uint32)), k
        assert dropped == k, (k, dropped)
        assert d["timeout_retransmissions"] == d["timeout_go_back"], (k, d)        # no timeout probe
        if not k:
            continue                              # the warm-up
        assert d["probe_replayed"] >= 1 and d["probe_retransmissions"] + d["timeout_go_back"] >= k, (k, d)
        assert d["probe_retransmissions"] < k, (k, d)    # fewer silences than lost results: the go-back
        assert d["stall_probes"] >= 1, (k, d)
        assert secs < 1.0, (k, secs, d)


def test_a_tail_of_lost_data_packets_does_not_grow_the_probe_timeout_stream_after_stream(tmp_path):
    """One rank, streams of 12 chunks all out at once; in streams 1 to 3 the first sends of this rank's
    last 6 data packets are dropped at the client (worker -> switch, chosen, not drawn): each probe
    completes a round and its answer is a fresh result, not a replay. The timers' spacing must not take
    the probes' waits (the probe timeout counts the pending chunks' spacing: it grew 6-fold a stream, to
    10 s for the third), and a clean stream after them starts from a spacing its own results set."""
    from ina.wire import Flag, PayloadType, header_view
    ops = [{"codec": "bfp32", "shape": [64 * 12], "seed": 300 + i} for i in range(6)]
    inputs = [expected_inputs(op, 1) for op in ops]
    k, lossy = 6, (1, 2, 3)

    def body(rank, cl):
        send, stream, st = cl.send_packets, cl._stream, {"c0": None, "armed": False}

        def filtered(pkts, rows, pkt_len):      # drop the first send of the stream's last k data chunks
            if st["armed"] and st["c0"] is not None:
                h, rows = header_view(pkts), np.asarray(rows)
                off = (h["chunk"][rows].astype(np.int64) - st["c0"]) % cl.chunk_modulus
                first = (h["flags"][rows] & int(Flag.RETRANSMIT)) == 0
                drop = first & (h["payload_type"][rows] != PayloadType.NONE) & (off >= 12 - k) & (off < 12)
                if drop.any():
                    keep = ~drop
                    rows, pkt_len = rows[keep], (np.asarray(pkt_len)[keep] if np.ndim(pkt_len) else pkt_len)
                    if not rows.size:
                        return None
            return send(pkts, rows, pkt_len)

        def hooked(n, ptype, *a, **kw):
            if ptype != PayloadType.NONE:
                st["c0"] = cl._next_chunk
            return stream(n, ptype, *a, **kw)
        cl.send_packets, cl._stream = filtered, hooked
        out = []
        for i, xs in enumerate(inputs):
            st["armed"], st["c0"] = i in lossy, None
            out.append((*_timed_allreduce(cl, xs[rank]), max(cl.link_spacing.values(), default=0.0)))
        return out
    per_stream = _one_rank_streams(tmp_path, 13, body)
    for i, ((y, d, secs, spacing), xs) in enumerate(zip(per_stream, inputs)):
        assert np.array_equal(y.view(np.uint32), bfp_reference(xs).view(np.uint32)), i
        if i in lossy:
            assert d["probe_retransmissions"] >= 1 and d["timeout_retransmissions"] == 0, (i, d)
            assert secs < 2.0, (i, secs, d)      # within the safety net (unloaded: 0.3 s; main's third: 10 s)
    spacings = [spacing for _, _, _, spacing in per_stream]
    assert spacings[3] <= spacings[1] * 1.5, spacings          # no growth from lossy stream to lossy stream
    assert spacings[5] < 2e-3, spacings                         # the clean streams' own pace (loopback)


def test_a_whole_window_of_results_lost_on_the_way_back_is_recovered_by_one_probe_and_a_go_back(tmp_path):
    """As below, with the client's default timers (rto 20 ms, min_rto 1 ms): rule 3's probe of the
    silence (16 chunks out) comes back as a replay, and the chunks out longer than the round trip go back
    at once: a probe or two per rank (not one per lost result: 16), results exact, within a second (6-31 ms
    unloaded; the probe waits srtt + 4 rttvar + 16 spacings, 0.2-0.35 s at load 10)."""
    from sw_harness import LostResults
    lost = {}

    def lose_the_window(r, cl):
        lost[r] = LostResults(cl)
        lost[r].arm(keep=0)
    per_rank = _one_window(tmp_path, 14, lose_the_window, rto=0.02, min_rto=0.001, max_rto=1.0)
    for r, (d, secs) in enumerate(per_rank):
        assert lost[r].dropped == 17, (r, lost[r].dropped)
        assert d["probe_retransmissions"] + d["timeout_retransmissions"] - d["timeout_go_back"] <= 3, (r, d)
        assert d["timeout_go_back"] >= 12, (r, d)
        assert secs < 1.0, (r, secs, d)


def _timed_allreduce(cl, x) -> tuple:
    """(the result, the counters it grew, its seconds) of one bfp32 allreduce of ``x`` by ``cl``."""
    import time
    before, t0 = dataclasses.replace(cl.stats), time.monotonic()
    y = cl.allreduce(x.copy(), codec="bfp32")
    return y, _counters_since(before, cl.stats), time.monotonic() - t0


def _one_rank_streams(tmp_path, job, body) -> list:
    """``body(0, client)``'s result: one rank at a real switch, streams of up to 16 chunks all out at once,
    the timeout (2 s) far above the probes'."""
    from sw_harness import client_threads
    sw = SwitchProc("--slots", "64", "--elements", "64", log_path=tmp_path / "switch.log")
    try:
        per_stream, = client_threads(sw.port, 1, job, body, join_timeout=60, elements=64, slots=16, timeout=30.0,
                                     rto=2.0, min_rto=0.002, max_rto=4.0)
    finally:
        sw.terminate()
    return per_stream


def _counters_since(before: ClientStats, after: ClientStats) -> dict:
    """The client's counters grown since ``before`` (a copy taken earlier)."""
    b, a = dataclasses.asdict(before), dataclasses.asdict(after)
    return {k: a[k] - b[k] for k in a if isinstance(a[k], (int, float))}


WINDOW_RUN = {"elements": 64, "slots": 16, "timeout": 30.0, "rto": 0.5, "min_rto": 0.02, "max_rto": 1.0}
WINDOW_OP = {"codec": "bfp32", "shape": [64 * 16], "seed": 77}     # one window: 16 chunks, all out at once


def _one_window(tmp_path, job, before_second, **run):
    """N ranks (threads) at a real switch, two allreduces of one window each; ``before_second(rank, cl)``
    runs in each rank just before its second. Returns each rank's (counters of the second allreduce, its
    seconds from that rank's hook on); the results are checked exact."""
    import time

    from sw_harness import client_threads, make_input
    sw = SwitchProc("--slots", "64", "--elements", "64", log_path=tmp_path / "switch.log")

    def body(r, cl):
        x = make_input(WINDOW_OP, r)
        cl.allreduce(x.copy(), codec="bfp32")                       # warm-up: round trips measured
        before_second(r, cl)
        before, t0 = dataclasses.replace(cl.stats), time.monotonic()
        y = cl.allreduce(x.copy(), codec="bfp32")
        return _counters_since(before, cl.stats), time.monotonic() - t0, y
    try:
        out = client_threads(sw.port, N, job, body, **{**WINDOW_RUN, **run})
    finally:
        sw.terminate()
    ref = bfp_reference(expected_inputs(WINDOW_OP, N))
    for r, (_, _, y) in enumerate(out):
        assert np.array_equal(y.view(np.uint32), ref.view(np.uint32)), r
    return [(d, secs) for d, secs, _ in out]


def test_a_peer_late_beyond_the_rto_costs_one_resend_per_lane_and_backoff_step_not_the_window(tmp_path):
    """Rank 3 sends its data window 1.2 s late (it computes; rto 0.5 s): its peers, their 16 chunks out,
    each probe the silence once at 0.5 s (the next step would be at 1.5 s), not the window; the probe's
    answer (when rank 3's packets arrive) is followed by the others' results: nothing goes back. (Rule 3's
    probes of the silence, backed off from a few ms on, come before; the switch only reads them.)"""
    from ina.wire import PayloadType
    late = threading.Event()

    def rank_3_computes(r, cl):
        if r != 3:
            return
        stream = cl._stream

        def hooked(n, ptype, *a, **k):
            if ptype != PayloadType.NONE and not late.is_set():
                late.wait(1.2)                  # the late peer's work, emulated (then its data goes out)
                late.set()
            return stream(n, ptype, *a, **k)
        cl._stream = hooked
    per_rank = _one_window(tmp_path, 11, rank_3_computes)
    for r, (d, secs) in enumerate(per_rank[:3]):
        assert 1 <= d["timeout_retransmissions"] <= 2, (r, d)      # (2: a loaded machine's late turn)
        assert d["timeout_go_back"] == 0 and d["fast_retransmissions"] == 0, (r, d)


def test_a_whole_window_of_results_lost_on_the_way_back_costs_one_rto_and_a_round_trip(tmp_path):
    """Every first result of a window is lost on the way back at every rank (``LostResults``, keep 0), the
    tail probe held back beyond the RTO (min_rto 0.6 s, rto 0.5 s) so that the timeout is what finds the
    silence: each rank's timeout probe comes back as a replay, and the other 15 chunks go out at once
    (go-back), recovered one RTO and a round trip after the window went out (not one timeout per chunk),
    results exact."""
    from sw_harness import LostResults
    lost = {}

    def lose_the_window(r, cl):
        lost[r] = LostResults(cl)
        lost[r].arm(keep=0)
    per_rank = _one_window(tmp_path, 12, lose_the_window, min_rto=0.6)
    for r, (d, secs) in enumerate(per_rank):
        assert lost[r].dropped == 17, (r, lost[r].dropped)          # 16 results, the last one's twice (TAIL)
        assert d["timeout_retransmissions"] == 16 and d["timeout_go_back"] == 15, (r, d)
        assert d["timeout_replayed"] == 16 and d["probe_retransmissions"] == 0, (r, d)
        assert secs < 0.5 + 0.3, (r, secs, d)       # one RTO, then a round trip (a loaded machine's margin)


def _probed(ld, probe, now):
    """``probe`` (rule 3's, from :meth:`LossDetector.lost`) goes out at ``now``, as the client resends it."""
    ld.resent(probe, now=now, probed=True, rules=(probe[:0], probe, probe[:0]))


def test_tail_probe_resends_the_oldest_chunk_after_a_silence():
    """Rule 3 after a silence of the probe timeout resends one chunk, the oldest; the next probe of the same
    silence after twice the timeout, of the same chunk while it is unanswered (as TCP's RTO resends the same
    segment: the switch may drop a rank's first resend of a round as crossing the result, never its second);
    once it is answered, the least resent chunk, oldest first."""
    ld = LossDetector(5)
    ld.sent(np.arange(5), now=0.0)
    ld.delivered(np.array([0, 1]), np.array([2, 3, 4]), now=0.001)
    pending = np.array([2, 3, 4])
    pto = 0.002
    _, late, _ = ld.lost(pending, now=0.0025, srtt=0.05, rto=1.0, max_rto=1.0, pto=pto)
    assert late.size == 0                      # silent for 1.5 ms only
    assert ld.next_deadline(pending, srtt=0.05, rttvar=0.0, pto=pto, max_rto=1.0) == pytest.approx(0.003)
    _, late, _ = ld.lost(pending, now=0.0035, srtt=0.05, rto=1.0, max_rto=1.0, pto=pto)
    assert late.tolist() == [2]                # one probe: the oldest chunk
    _probed(ld, late, now=0.0035)
    _, late, _ = ld.lost(pending, now=0.0070, srtt=0.05, rto=1.0, max_rto=1.0, pto=pto)
    assert late.size == 0                      # the same silence: the probe timer doubled (2 x pto)
    assert ld.next_deadline(pending, srtt=0.05, rttvar=0.0, pto=pto, max_rto=1.0) == pytest.approx(0.0075)
    _, late, _ = ld.lost(pending, now=0.0076, srtt=0.05, rto=1.0, max_rto=1.0, pto=pto)
    assert late.tolist() == [2]                # unanswered: the same chunk again, not a new one
    _probed(ld, late, now=0.0076)
    ld.resent(np.array([3]), now=0.0077, rules=(np.array([3]), pending[:0], pending[:0]))   # 3: resent (fast)
    ld.answered(np.array([2]), np.array([True]))
    ld.delivered(np.array([2]), np.array([3, 4]), now=0.008)   # its answer restarts the probe timer
    _, late, _ = ld.lost(np.array([3, 4]), now=0.0101, srtt=0.05, rto=1.0, max_rto=1.0, pto=pto)
    assert late.tolist() == [4]                # answered: the chunk resent least often, oldest first


def _probes_in_a_silence(window: int, silence: float = 0.2, pto: float = 0.001, srtt: float | None = 0.001,
                         rttvar: float = 0.0, spacing: float = 0.0) -> tuple[int, int, float]:
    """(probes, timeouts, the first probe's time) of a rank whose ``window`` chunks are all out and that
    hears nothing for ``silence`` seconds (the rules run whenever next_deadline says, or every 0.1 ms)."""
    ld = LossDetector(window)
    ld.sent(np.arange(window), now=0.0)
    pending, probes, timeouts, now, first = np.arange(window), 0, 0, 0.0, np.inf
    while True:
        _, probe, late = ld.lost(pending, now=now, srtt=srtt, rto=1.0, max_rto=1.0, pto=pto, rttvar=rttvar,
                                 spacing=spacing)
        ld.resent(np.concatenate([probe, late]), now=now, probed=probe.size > 0)
        probes, timeouts = probes + probe.size, timeouts + late.size
        if probe.size:
            first = min(first, now)
        if now >= silence:
            return probes, timeouts, first
        now = max(now + 1e-4, min(silence, ld.next_deadline(pending, srtt=srtt, rttvar=rttvar, pto=pto, max_rto=1.0,
                                                            spacing=spacing)))


def test_a_long_silence_of_a_few_chunks_costs_a_handful_of_probes_not_one_per_chunk():
    """A rank with the last 3 chunks of its stream out that hears nothing for 200 ms (a slow peer, or
    all three lost), with a 1 ms probe timeout: the probes back off over the silence (1, 2, 4, ... ms),
    so about log2(200) of them in all, and the 1 s timeout does not fire."""
    probes, timeouts, first = _probes_in_a_silence(3)
    assert 5 <= probes <= 9 and timeouts == 0, (probes, timeouts)
    assert first == pytest.approx(0.001, abs=2e-4)


def test_a_silence_with_more_chunks_out_than_three_is_probed_after_the_round_trip_and_their_serialisation():
    """A window of 4, 20 or 64 chunks out and no result: most often a stall (a peer that has not sent
    yet, the switch not scheduled), which a probe at the 1 ms probe timeout would not shorten (at
    100 Mbit/s such probes were most of the spurious resends, the probe timeout far below the chunks'
    round trip through the link's queue); but it can be a loss of them all (losses come together). So
    the silence is probed after srtt + 4 rttvar + the pending chunks' serialisation (here 2 + 4 x 0.5 ms
    + n x 0.1 ms), not at 1 ms and not at the 1 s timeout; then backed off as any probe (a handful in
    200 ms), and the timeout does not fire. Without an srtt: the probe timeout plus the serialisation.
    A probe timeout above all that (the run-queue floor of a loaded machine) still holds."""
    from ina.recovery import SHORT_PROBE_MAX_PENDING, probe_timeout
    assert SHORT_PROBE_MAX_PENDING == 3
    for window in (4, 20, 64):
        due = 0.002 + 4 * 0.0005 + window * 1e-4
        probes, timeouts, first = _probes_in_a_silence(window, srtt=0.002, rttvar=0.0005, spacing=1e-4)
        assert first == pytest.approx(due, abs=2e-4), (window, first, due)
        assert 3 <= probes <= 8 and timeouts == 0, (window, probes, timeouts)
        ld = LossDetector(window)
        ld.sent(np.arange(window), now=0.0)
        assert ld.next_deadline(np.arange(window), srtt=0.002, rttvar=0.0005, pto=0.001, max_rto=1.0,
                                spacing=1e-4) == pytest.approx(due)
        no_srtt = _probes_in_a_silence(window, srtt=None, spacing=1e-4)[2]
        assert no_srtt == pytest.approx(0.001 + window * 1e-4, abs=2e-4), (window, no_srtt)
        assert probe_timeout(0.05, window, 0.002, 0.0005, 1e-4) == 0.05          # the floor holds
    assert probe_timeout(0.001, 3, 0.002, 0.0005, 1e-4) == 0.001               # 3 or fewer: the probe timeout
    assert probe_timeout(None, 20, 0.002, 0.0005, 1e-4) is None                # no round trip measured: none
    probes, timeouts, _ = _probes_in_a_silence(20, silence=1.5, srtt=0.002, rttvar=0.0005, spacing=1e-4)
    assert timeouts == 1, (probes, timeouts)   # the 1 s safety net probes the silence once (next at 3 s), not the window


def test_a_resent_chunks_result_is_no_evidence_against_others():
    ld = LossDetector(4)
    ld.sent(np.arange(4), now=0.0)
    ld.resent(np.array([0]), now=0.001)        # a probe; then chunk 0's (first) result arrives
    ld.delivered(np.array([0]), np.array([1, 2, 3]), now=0.002)
    assert ld.later[1:].tolist() == [0, 0, 0]


# ------------------------------------------------------------------------------------------------
# spurious retransmissions: with reordering off, a resend answers a loss
# ------------------------------------------------------------------------------------------------
def test_a_chunk_sent_after_a_replay_is_no_evidence_against_chunks_sent_before_it():
    """This rank lost chunk 0's result and got it as a replay: chunk 4 (freed by it) went out here
    after chunks 1..3 but at the peers long before, so its result comes back first without a loss."""
    ld = LossDetector(8)
    ld.sent(np.arange(4), now=0.0)
    ld.sent(np.array([4]), now=0.001, witness=np.array([False]))
    ld.delivered(np.array([4]), np.array([1, 2, 3]), now=0.002)
    assert ld.later[1:4].tolist() == [0, 0, 0]
    fast, _, _ = ld.lost(np.array([1, 2, 3]), now=0.05, srtt=0.001, rto=1.0, max_rto=1.0)
    assert fast.size == 0
    ld.sent(np.array([5]), now=0.003)                  # a witness: its result shows 1..3 are late
    ld.delivered(np.array([5]), np.array([1, 2, 3]), now=0.004)
    assert ld.later[1:4].tolist() == [1, 1, 1]


def test_a_resent_chunk_is_not_resent_again_within_the_reordering_window():
    """Every rank sees a peer's lost data packet as a missing result and resends; until the peer's
    own resend arrives, results of later chunks keep coming: no second resend before the window."""
    ld = LossDetector(20)
    ld.sent(np.arange(10), now=0.0)
    ld.delivered(np.arange(1, 4), np.array([0]), now=0.001)
    srtt = 0.002
    fast, _, _ = ld.lost(np.array([0]), now=0.001, srtt=srtt, rto=1.0, max_rto=1.0)
    assert fast.tolist() == [0]
    ld.resent(fast, now=0.001)
    ld.sent(np.arange(10, 16), now=0.0011)
    ld.delivered(np.arange(10, 16), np.array([0]), now=0.002)
    assert ld.later[0] == 6
    fast, _, _ = ld.lost(np.array([0]), now=0.002, srtt=srtt, rto=1.0, max_rto=1.0)
    assert fast.size == 0                              # 1 ms after the resend: within 1.25 srtt + floor
    fast, _, _ = ld.lost(np.array([0]), now=0.001 + 1.25 * srtt + 0.0006, srtt=srtt, rto=1.0, max_rto=1.0)
    assert fast.tolist() == [0]                        # the resend itself may be lost: after the window


def test_spurious_retransmissions_stay_rare_without_reordering(tmp_path):
    """1% loss in both directions, no reordering: every fast retransmission answers a loss. A lost data
    packet stalls its round for all ranks (each resends once: they cannot tell whose packet it was);
    a lost result stalls its rank and, until it resends, the chunk it frees at the peers (up to one
    resend each). So fast retransmissions <= ranks x (packets dropped), by the switch's counters."""
    sw = SwitchProc("--slots", "64", "--elements", "64", "--loss", "0.01", "--seed", "21",
                    log_path=tmp_path / "switch.log")
    try:
        ops = [{"codec": "bfp32", "shape": [64 * 150 + 5 * i], "seed": 70 + i} for i in range(10)]
        out = Workers(tmp_path, sw.port, N, job=6, ops=ops, client=SLOW_TIMEOUT).wait(timeout=120)
        imp = sw.stats()["impairments"]
        dropped = imp["ingress"]["dropped"] + imp["egress"]["dropped"]
    finally:
        sw.terminate()
    assert dropped >= 30, f"the impairment dropped only {dropped} packets: the test shows nothing"
    fast = sum(m["stats"]["fast_retransmissions"] for m in out.values())
    assert fast <= N * dropped, (fast, imp)
    _check_exact(out, ops, N)


def test_the_stream_ends_duplicate_threshold_is_the_per_lane_rule_for_every_pending_chunk():
    """Rule 1's count at a stream's end, computed for all pending chunks in one pass per lane, is the
    rule applied chunk by chunk: min(DUPTHRESH, the lane's outstanding chunks + the results after its
    oldest - 1), at least 1; DUPTHRESH while chunks are unsent (random streams, seeded)."""
    from ina import recovery_kernels as RK

    def by_chunk(p, pending, later, seq, lane):
        mine = [c for c in pending if lane[c] == lane[p]]
        oldest = min(mine, key=lambda c: seq[c])
        return max(1, min(DUPTHRESH, len(mine) + later[oldest] - 1))

    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        lane = rng.integers(0, int(rng.integers(1, 4)), n).astype(np.int64)
        seq = (rng.permutation(n) + 1).astype(np.int64)
        later = rng.integers(0, 3, n).astype(np.int64)
        pending = np.sort(rng.choice(n, int(rng.integers(1, n + 1)), replace=False)).astype(np.int64)
        out = np.zeros(n, np.int64)
        RK.duplicate_thresholds(pending, later, seq, lane, 0, out)
        assert out[:pending.size].tolist() == [by_chunk(p, pending, later, seq, lane) for p in pending]
        RK.duplicate_thresholds(pending, later, seq, lane, 2, out)
        assert (out[:pending.size] == DUPTHRESH).all()


def test_early_retransmit_near_the_end_of_the_stream():
    """With every chunk sent and fewer than 4 outstanding, the threshold is one less than the
    outstanding count (RFC 5827); with more outstanding it stays DUPTHRESH."""
    ld = LossDetector(5)
    ld.sent(np.arange(5), now=0.0)
    ld.delivered(np.array([0, 1, 2]), np.array([3, 4]), now=1e-4)
    ld.delivered(np.array([4]), np.array([3]), now=2e-4)
    fast, _, _ = ld.lost(np.array([3]), now=2e-4, srtt=None, rto=1.0, max_rto=1.0)
    assert fast.tolist() == [3]                # 2 outstanding (3 and 4), chunk 4's result came
    ld = LossDetector(5)
    ld.sent(np.arange(5), now=0.0)
    ld.delivered(np.array([0, 1, 4]), np.array([2, 3]), now=1e-4)
    fast, _, _ = ld.lost(np.array([2, 3]), now=1e-4, srtt=None, rto=1.0, max_rto=1.0)
    assert fast.size == 0                      # 3 outstanding, one result after them: below 2
    ld = LossDetector(8)
    ld.sent(np.arange(6), now=0.0)             # chunks 6, 7 not sent yet: no early retransmit
    ld.delivered(np.array([0, 1, 2, 3, 5]), np.array([4]), now=1e-4)
    fast, _, _ = ld.lost(np.array([4]), now=1e-4, srtt=None, rto=1.0, max_rto=1.0)
    assert fast.size == 0


def test_a_loss_does_not_make_a_fast_link_pause_for_receive_coalescing(tmp_path):
    """Receive coalescing pauses (for up to 16 result spacings) only where results trickle in slower than a loop turn.
    On loopback they come faster; a loss's recovery gap (or a peer's, which stalls the job's lockstep
    stream alike) is no sign of a slow link: under 1% loss in both directions the clients pause for
    coalescing for less than a tenth of one maximal pause per packet lost (each loss cost every rank
    a pause of up to 4 ms while the spacing estimate took such gaps in)."""
    sw = SwitchProc("--slots", "64", "--elements", "1024", "--loss", "0.01", "--seed", "23",
                    log_path=tmp_path / "switch.log")
    try:
        ops = [{"codec": "bfp32", "shape": [1024 * 300 + 7 * i], "seed": 90 + i} for i in range(6)]
        client = {**SLOW_TIMEOUT, "elements": 1024, "slots": 64}
        out = Workers(tmp_path, sw.port, N, job=7, ops=ops, client=client, warmup_ops=1).wait(timeout=120)
        imp = sw.stats()["impairments"]
        dropped = imp["ingress"]["dropped"] + imp["egress"]["dropped"]
    finally:
        sw.terminate()
    assert dropped >= 30, f"the impairment dropped only {dropped} packets: the test shows nothing"
    paused = sum(m["stats"]["coalesce_pause_s"] - m["stats_after_warmup"]["coalesce_pause_s"] for m in out.values())
    assert paused < 0.1 * dropped * 0.004, (paused, dropped)
    _check_exact(out, ops, N)


def test_a_first_gap_that_was_the_process_pausing_does_not_make_a_fast_link_pause():
    """The spacing estimate starts as the least of its first samples: a stream whose first gap was the
    process not being scheduled (10 ms, then 40 results: 0.25 ms each) still sees a fast link's
    20 us spacing and never pauses; a link whose results do trickle (0.5 ms apart) gets its pauses."""
    fast, slow = ArrivalSpacing(), ArrivalSpacing()
    now = 0.0
    fast.sample(8, now)
    now += 0.010
    fast.sample(40, now)
    for _ in range(10):
        now += 8 * 2e-5
        fast.sample(8, now)
        assert pause_length(fast.for_coalescing(), 64, False, math.inf) == 0.0
    for i in range(6):
        slow.sample(2, i * 1e-3)
    assert slow.per_pkt == pytest.approx(5e-4)
    assert pause_length(slow.for_coalescing(), 64, False, math.inf) > 0


# ------------------------------------------------------------------------------------------------
# a slow shaped link: a deep queue, results several ms apart
# ------------------------------------------------------------------------------------------------
SPACING = 6.6e-3          # an 8 kB packet's serialisation at 10 Mbit/s


def _slow_link_stream(prior: float, n: int = 208, window: int = 64, lose_first_send_of: tuple = ()):
    """One stream of ``n`` chunks over a 10 Mbit/s link as the client's loop meets it (ina.transfer's turn,
    without sockets): every packet (first send or resend) joins the link's queue, and its result arrives
    SPACING after the previous one's, 0.2 ms after leaving the queue; each fresh result frees chunk
    c + ``window``; a receive waits at most 2 ms (RX_WAIT), or until a rule's deadline. The fastest round
    trip the client knows is a negotiation packet's, 40 us (the token bucket passes a small packet at
    once). ``prior``: the spacing a previous stream settled on. Returns (probes, the time of the last
    result, the stream's settled spacing)."""
    from types import SimpleNamespace

    from ina.client import Client
    from ina.scheduling import RunQueueDelay
    cl = SimpleNamespace(min_rto=1e-3, rtt_min=4e-5, run_queue=RunQueueDelay(on=False))
    ld, spacing, done = LossDetector(n), ArrivalSpacing(prior), np.zeros(n, bool)
    queue_end, arrivals = 0.0, []              # when the link's queue empties; (time, chunk) of results on their way

    def send(chunks, now, first=True):
        nonlocal queue_end
        for c in chunks:
            queue_end = max(queue_end, now) + SPACING
            if not (first and c in lose_first_send_of):
                arrivals.append((queue_end + 2e-4, int(c)))
        (ld.sent if first else lambda ch, t: ld.resent(ch, t, probed=True))(np.asarray(chunks, np.int64), now)

    now, probes, last = 0.0, 0, 0.0
    send(np.arange(window), now)
    while not done.all():
        pending = ld.pending(0, n - 1, done)
        pto = Client.probe_timeout(cl, spacing.for_timers())
        wait = min(2e-3, max(5e-5, ld.next_deadline(pending, None, 0.0, pto, 1.0, spacing.for_timers()) - now))
        arrivals.sort()
        if arrivals and arrivals[0][0] <= now + wait:
            now = arrivals[0][0]
            got = [c for t, c in arrivals if t <= now]
            arrivals = [(t, c) for t, c in arrivals if t > now]
            fresh = sorted({c for c in got if not done[c]})
            spacing.sample(len(got), now, bool(ld.tries[fresh].any()))
            if fresh:
                done[fresh] = True
                last = now
                ld.delivered(np.array(fresh), ld.pending(0, n - 1, done), now)
                send([c + window for c in fresh if c + window < n], now)
        else:
            now += wait
            spacing.idle()
        pending = ld.pending(0, n - 1, done)
        _, probe, late = ld.lost(pending, now, None, 1.0, 1.0, Client.probe_timeout(cl, spacing.for_timers()),
                                 spacing=spacing.for_timers())
        assert late.size == 0
        if probe.size:
            probes += probe.size
            send(probe, now, first=False)
    return probes, last, spacing.settled()


def test_a_slow_links_steady_results_fire_no_probe_and_a_tail_loss_is_still_probed_soon():
    """On a 10 Mbit/s link the window waits in the link's queue and results come a spacing (6.6 ms) apart,
    far above the probe timeout's 1 ms floor and the fastest round trip the client knows (a negotiation
    packet's). The spacing estimate covers it once it has a sample: a client's first stream may probe in
    its first two silences (before the first result, and before the second: 2 probes each with the
    backoff), none after, and the next stream starts from the spacing the first settled on (no probe).
    Without that, the probe fired in every gap, resent the chunk whose result ended it, and the estimate
    never got a sample (200 to 540 spurious resends per sweep run; 784 probes in this model). A lost tail (the last chunk: nothing after it shows the loss)
    is still recovered by one probe, within a few spacings of when its result was due."""
    probes, last, settled = _slow_link_stream(prior=0.0)
    assert probes <= 4, probes
    assert settled == pytest.approx(SPACING, rel=0.05)
    probes, healthy_last, _ = _slow_link_stream(prior=settled)
    assert probes == 0
    probes, last, _ = _slow_link_stream(prior=settled, lose_first_send_of=(207,))
    assert probes == 1
    assert last - healthy_last < 6 * SPACING, (last - healthy_last) / SPACING


def test_a_stall_at_a_streams_end_does_not_carry_into_the_next_streams_timers():
    """The timers' estimate restarts at the gaps of FIRST_SAMPLES slow bursts in a row; when those were the
    process not being scheduled at a fast stream's end (2 ms each, after 200 bursts 20 us apart), the
    spacing the next stream starts from is still the link's, not the stall's: a small stream (a few
    results, never settled) would otherwise probe only after 4 x 2 ms of silence."""
    from ina.coalescing import FIRST_SAMPLES
    sp, now = ArrivalSpacing(), 0.0
    for _ in range(200):
        now += 2e-5
        sp.sample(1, now)
    for _ in range(FIRST_SAMPLES):
        now += 2e-3
        sp.sample(1, now)
    assert sp.for_timers() >= 2e-3                     # the stream itself takes the stall as its pace ...
    assert sp.settled() < 1e-4, sp.settled()           # ... but does not hand it on
    slow, now = ArrivalSpacing(), 0.0
    for _ in range(20):
        now += SPACING
        slow.sample(1, now)
    assert slow.settled() == pytest.approx(SPACING)    # a slow link's spacing is handed on as it is


def test_gaps_that_ended_with_a_replay_are_no_sample_of_the_timers_spacing():
    """A tail of results lost on the way back is recovered one probe per silence, each ended by the probe's
    replay: those gaps are the recovery, not the link's pace. Taken, FIRST_SAMPLES of them in a row
    restarted the timers' estimate at the silence's length, the next stream's probe timeout grew fourfold
    (stream after stream: 2 ms, 51 ms, 0.32 s, 3.5 s, end to end); skipped, the estimate stays the link's."""
    sp, now = ArrivalSpacing(), 0.0
    for _ in range(20):
        now += 2e-5
        sp.sample(1, now)
    for _ in range(6):
        now += 5e-3                                     # a probe's silence, then its replay
        sp.sample(1, now, recovered=True, replayed=True)
    assert sp.for_timers() == pytest.approx(2e-5) and sp.settled() <= 2e-5 * 1.01
    for _ in range(6):
        now += 5e-3                                     # a stall's gaps (the link's or a pause: results as usual)
        sp.sample(1, now)
    assert sp.for_timers() == pytest.approx(5e-3)        # ... still restart it


# ------------------------------------------------------------------------------------------------
# tail copies: the last chunk of a stream (a negotiation packet is one) goes out twice, its result too
# ------------------------------------------------------------------------------------------------
def test_tail_copies_flag_the_last_chunk_and_count_the_copy():
    from ina.recovery import tail_copies
    from ina.wire import Flag, header_view
    hv = header_view(np.zeros((8, 24), np.uint8))
    stats = ClientStats()
    rows = tail_copies(np.arange(4), np.arange(4), 6, hv, stats)      # chunks 0..3 of 6: no tail yet
    assert rows.tolist() == [0, 1, 2, 3] and stats.tail_copies == 0 and not hv["flags"].any()
    rows = tail_copies(np.array([4, 5]), np.array([5, 4]), 6, hv, stats)   # chunk 5 (row 4) is the last
    assert rows.tolist() == [4, 5, 4] and stats.tail_copies == 1
    assert hv["flags"][4] == int(Flag.TAIL) and not hv["flags"][5]

    from ina.recovery import tail_copy_wanted
    assert not tail_copy_wanted(False, True, 6, 16)          # a short data stream: no copy
    assert tail_copy_wanted(False, True, 16, 16) and tail_copy_wanted(False, False, 1, 16)   # long; a negotiation
    assert not tail_copy_wanted(True, True, 100, 16)         # a sparse stream's rounds come in any order


def _data_sender(sw, socks, vals, slots):
    """``send(r, c, flags=0)``: rank r's data packet of chunk c (its row of ``vals``, job 9) to the in-process
    switch ``sw`` (:func:`_in_process_switch`), which polls it at once."""
    from ina.wire import MsgType, PayloadType, pack
    E = vals.shape[1]

    def send(r, c, flags=0):
        socks[r].sendto(pack(msg_type=MsgType.DATA, job=9, rank=r, pool_index=c % slots, shadow=(c // slots) & 1,
                             payload_type=PayloadType.INT32, count=E, chunk=c, exponent=0, payload=vals[r],
                             elements=E, flags=flags), ("127.0.0.1", sw.port))
        assert sw.poll_once() == 1
    return send


def _in_process_switch(workers, slots, E):
    from ina import burst as B
    from switch_model.pipeline import Switch, SwitchConfig
    sw = Switch(SwitchConfig(host="127.0.0.1", port=0, slots=slots, elements=E, burst=64))
    socks = [B.udp_socket("127.0.0.1", 0) for _ in range(workers)]
    for s in socks:
        s.settimeout(5)
    sw.install_job(9, workers, slots, E, True, [s.getsockname() for s in socks])
    return sw, socks


def _nothing_more(socks, E):
    """No further packet reaches any of ``socks`` (within 50 ms)."""
    from ina.wire import max_packet_size
    for s in socks:
        s.settimeout(0.05)
        with pytest.raises(OSError):
            s.recv(max_packet_size(E))


def _close_switch(sw, socks):
    sw.sock.close()
    for s in socks:
        s.close()


@pytest.mark.parametrize("ptype", ["NONE", "INT32"])
def test_both_copies_of_a_tail_chunk_count_once_and_its_result_comes_twice(ptype):
    """Every worker sends its TAIL packet twice (a negotiation packet: no payload, or a data stream's
    last chunk): the switch adds each worker once (the exponent max and the sums as from one copy
    each), drops a second copy that arrives while the round waits and one that arrives after it
    completed (not replayed: no RETRANSMIT flag, and the result comes twice anyway), and multicasts
    the result twice to every worker; a resend (RETRANSMIT) of a tail chunk is still replayed."""
    from ina.wire import Flag, MsgType, PayloadType, max_packet_size, pack, unpack
    workers, slots, E, c = 3, 4, 16, 2
    pt = PayloadType[ptype]
    vals = np.arange(workers * E, dtype=np.int32).reshape(workers, E) - 20
    sw, socks = _in_process_switch(workers, slots, E)
    try:
        def tail_packet(r, flags=Flag.TAIL):
            return pack(msg_type=MsgType.DATA, job=9, rank=r, pool_index=c % slots, shadow=(c // slots) & 1,
                        payload_type=pt, count=E if ptype == "INT32" else 0, chunk=c, exponent=r - 5,
                        payload=vals[r] if ptype == "INT32" else None, elements=E, flags=flags)
        for r in range(workers):
            for _ in range(2):
                socks[r].sendto(tail_packet(r), ("127.0.0.1", sw.port))
        got = 0
        while got < 2 * workers:
            k = sw.poll_once()
            assert k, f"the switch received {got} of {2 * workers} packets"
            got += k
        st = sw.stats()
        assert st["counters"]["harvested"] == 1 and st["counters"]["tail_repeats"] == workers
        assert st["drops"]["retransmit_pending"] == workers - 1
        assert st["counters"]["replays"] == 0 and st["counters"]["tail_duplicates"] == 1
        socks[0].sendto(tail_packet(0, Flag.TAIL | Flag.RETRANSMIT), ("127.0.0.1", sw.port))   # rank 0 lost both results
        assert sw.poll_once() == 1 and sw.stats()["counters"]["replays"] == 1
        for r, s in enumerate(socks):
            res = [unpack(s.recv(max_packet_size(E))) for _ in range(3 if r == 0 else 2)]
            assert [bool(p.flags & Flag.REPLAY) for p in res] == [False, False] + [True] * (r == 0)
            for p in res:
                assert p.msg_type == MsgType.RESULT and p.chunk == c and p.exponent == workers - 1 - 5
                if ptype == "INT32":
                    assert np.array_equal(np.asarray(p.payload, np.int64)[:E], vals.astype(np.int64).sum(axis=0))
            s.settimeout(0.05)
            with pytest.raises(OSError):      # nothing more: each worker's copies were added once
                s.recv(max_packet_size(E))
    finally:
        sw.sock.close()
        for s in socks:
            s.close()


def test_resends_that_crossed_the_result_of_a_recovered_round_are_not_replayed():
    """Rank 2's data packet is lost: every rank resends. Rank 0's resend arrives first (the round still
    waits: read, dropped), rank 2's completes the round (multicast to all), rank 1's crossed that
    multicast: dropped as retransmit_crossed, not replayed; the same for a round completed by a LATE
    first send (a rank that waited for a replay before sending the chunk). A rank that resends again (it
    did lose the multicast) is replayed, and so is every rank of a round completed by first sends.
    Every result carries the exact sum; nobody gets more than it asked for."""
    from ina.wire import Flag, MsgType, max_packet_size, unpack
    workers, slots, E = 3, 4, 16
    vals = np.arange(workers * E, dtype=np.int32).reshape(workers, E) - 20
    sw, socks = _in_process_switch(workers, slots, E)
    send = _data_sender(sw, socks, vals, slots)

    def results(r, k):
        got = [unpack(socks[r].recv(max_packet_size(E))) for _ in range(k)]
        for p in got:
            assert p.msg_type == MsgType.RESULT
            assert np.array_equal(np.asarray(p.payload, np.int64)[:E], vals.astype(np.int64).sum(axis=0))
        return [(p.chunk, bool(p.flags & Flag.REPLAY)) for p in got]

    def counts():
        st = sw.stats()
        return st["counters"]["replays"], st["drops"]["retransmit_pending"], st["drops"]["retransmit_crossed"]
    try:
        send(0, 0)
        send(1, 0)                                   # rank 2's packet of chunk 0 was lost
        send(0, 0, Flag.RETRANSMIT)                  # read while the round waits
        send(2, 0, Flag.RETRANSMIT)                  # completes the round: multicast
        send(1, 0, Flag.RETRANSMIT)                  # crossed the multicast: no replay
        assert counts() == (0, 1, 1)
        send(0, 0, Flag.RETRANSMIT)                  # rank 0 resends again: its earlier resend was read
        send(1, 0, Flag.RETRANSMIT)                  # rank 1 resends again: it lost the multicast
        assert counts() == (2, 1, 1)
        for r in range(workers):                     # a round completed by first sends: any resend is replayed
            send(r, 1)
        send(2, 1, Flag.RETRANSMIT)
        assert counts() == (3, 1, 1)
        send(0, 2)                                   # rank 2 sends chunk 2 late (it waited for a replay)
        send(1, 2)
        send(0, 2, Flag.RETRANSMIT)                  # its peers saw the result missing: read while it waits
        send(2, 2, Flag.LATE)                        # completes the round: multicast
        send(1, 2, Flag.RETRANSMIT)                  # crossed it: no replay
        send(0, 2, Flag.RETRANSMIT)                  # rank 0's second resend: replayed
        assert counts() == (4, 2, 2)
        assert results(0, 5) == [(0, False), (0, True), (1, False), (2, False), (2, True)]
        assert results(1, 4) == [(0, False), (0, True), (1, False), (2, False)]
        assert results(2, 4) == [(0, False), (1, False), (1, True), (2, False)]
        _nothing_more(socks, E)
    finally:
        _close_switch(sw, socks)


def test_a_tail_probe_that_crossed_the_result_is_sent_again_and_answered():
    """The last 3 chunks of rank 0's stream: rank 1's data packets of them were lost, rank 1's resends
    completed the rounds, and rank 0 lost those results on the way back. Rank 0's tail probes (rule 3,
    driven by its LossDetector against an in-process switch) meet the switch's drop of a rank's first resend
    of a round another rank's resend completed (RETRANSMIT_CROSSED); the unanswered probe goes out again
    and its second send is replayed: each chunk costs one silence (a probe timeout, then twice it), not a
    dropped probe per chunk with the timer doubling over them all (1, 2, 4, 8 timeouts before the first
    answer). The results are exact."""
    from ina.wire import Flag, max_packet_size, unpack
    workers, slots, E, n, pto = 2, 4, 16, 3, 0.002
    vals = np.arange(workers * E, dtype=np.int32).reshape(workers, E) - 20
    sw, socks = _in_process_switch(workers, slots, E)
    send = _data_sender(sw, socks, vals, slots)

    def result(r):
        p = unpack(socks[r].recv(max_packet_size(E)))
        assert np.array_equal(np.asarray(p.payload, np.int64)[:E], vals.astype(np.int64).sum(axis=0))
        return p

    def counts():
        st = sw.stats()
        return st["counters"]["replays"], st["drops"]["retransmit_crossed"]
    try:
        ld = LossDetector(n)
        ld.sent(np.arange(n), now=0.0)
        for c in range(n):
            send(0, c)                               # rank 1's first send of c is lost
            send(1, c, Flag.RETRANSMIT)              # its resend completes the round
            result(1)
            result(0)                                # ... and rank 0 loses the result on the way back
        assert counts() == (0, 0)
        ld.delivered(np.array([], np.int64), np.arange(n), now=0.0)   # the silence starts
        now, answered_at, probes, times = 0.0, [], [], []
        while len(answered_at) < n and now < 1.0:
            pending = np.setdiff1d(np.arange(n), answered_at)
            fast, probe, late = ld.lost(pending, now=now, srtt=0.001, rto=1.0, max_rto=1.0, pto=pto)
            assert fast.size + late.size == 0 and probe.size <= 1, (now, fast, probe, late)
            if probe.size:
                _probed(ld, probe, now)
                probes.append(int(probe[0]))
                replays, _ = counts()
                send(0, int(probe[0]), Flag.RETRANSMIT)
                if counts()[0] > replays:            # answered: a replay
                    p = result(0)
                    assert p.flags & Flag.REPLAY and p.chunk == probe[0]
                    ld.answered(probe, np.array([True]))
                    ld.delivered(probe, np.setdiff1d(pending, probe), now=now)
                    answered_at.append(int(probe[0]))
                    times.append(now)
            now = max(now + 1e-5, ld.next_deadline(pending, srtt=0.001, rttvar=0.0, pto=pto, max_rto=1.0))
        assert probes == [0, 0, 1, 1, 2, 2], probes  # each chunk's first resend crossed, its second answered
        assert counts() == (n, n)
        assert np.diff(times, prepend=0.0) == pytest.approx([3 * pto] * n, abs=1e-4)   # a timeout, then twice it
        socks[0].settimeout(0.05)
        with pytest.raises(OSError):                 # nothing more
            socks[0].recv(max_packet_size(E))
    finally:
        sw.sock.close()
        for s in socks:
            s.close()


def test_two_ranks_whose_tail_probes_wait_for_each_other_move_on_after_a_second_send():
    """Crossed upstream losses at a stream's end: rank 0's data packet of chunk 1 and rank 1's of chunk 0
    were lost, and so was rank 1's fast resend of chunk 0. Each rank's LossDetector drives its tail probes
    (rule 3) against an in-process switch. Rank 0 probes chunk 0 (the oldest), rank 1 chunk 1 (the least
    resent): each round waits for the other rank's packet, so the switch drops both probes as
    retransmit_pending, and so their second sends (the switch may drop a first resend that crossed a result,
    never a second). The third probe of each rank goes to the least resent chunk, the one whose round waits
    for its own packet: both rounds complete by probes within 8 probe timeouts, with no timeout (rule 4, here
    25 probe timeouts; re-sending the unanswered probe at every probe stalled both ranks until it: 4 dropped
    probes each, then rule 4). The results are exact."""
    from ina.wire import Flag, max_packet_size, unpack
    workers, slots, E, n, pto, rto = 2, 4, 16, 2, 0.002, 0.05
    vals = np.arange(workers * E, dtype=np.int32).reshape(workers, E) - 20
    sw, socks = _in_process_switch(workers, slots, E)
    send = _data_sender(sw, socks, vals, slots)

    def counts():
        st = sw.stats()
        return st["counters"]["harvested"], st["counters"]["replays"], st["drops"]["retransmit_pending"]
    try:
        lds = [LossDetector(n) for _ in range(workers)]
        for ld in lds:
            ld.sent(np.arange(n), now=0.0)
        send(0, 0)                                   # rank 0's packet of chunk 1 is lost
        send(1, 1)                                   # rank 1's packet of chunk 0 is lost, and its fast resend of it
        lds[1].resent(np.array([0]), now=0.0, rules=(np.array([0]), np.arange(0), np.arange(0)))
        done = [[] for _ in range(workers)]
        probes = [[] for _ in range(workers)]
        timeouts, now = [0] * workers, 0.0
        while min(map(len, done)) < n and now < 1.0:
            for r, ld in enumerate(lds):
                pending = np.setdiff1d(np.arange(n), done[r])
                if not pending.size:
                    continue
                fast, probe, late = ld.lost(pending, now=now, srtt=0.001, rto=rto, max_rto=1.0, pto=pto)
                assert fast.size == 0 and probe.size <= 1, (r, now, fast, probe, late)
                if not probe.size + late.size:
                    continue
                ld.resent(np.concatenate([probe, late]), now=now, probed=probe.size > 0, rules=(fast, probe, late))
                probes[r] += probe.tolist()
                timeouts[r] += late.size
                for c in np.concatenate([probe, late]).tolist():
                    harvested, replays, _ = counts()
                    send(r, c, Flag.RETRANSMIT)
                    got = [q for q in range(workers) if counts()[0] > harvested or q == r and counts()[1] > replays]
                    for q in got:                    # a completed round goes to both, a replay to the sender
                        p = unpack(socks[q].recv(max_packet_size(E)))
                        assert p.chunk == c
                        assert np.array_equal(np.asarray(p.payload, np.int64)[:E], vals.astype(np.int64).sum(axis=0))
                        lds[q].answered(np.array([c]), np.array([bool(p.flags & Flag.REPLAY)]))
                        done[q].append(c)
                        lds[q].delivered(np.array([c]), np.setdiff1d(np.arange(n), done[q]), now=now)
            deadlines = [lds[r].next_deadline(np.setdiff1d(np.arange(n), done[r]), srtt=0.001, rttvar=0.0, pto=pto,
                                              max_rto=1.0) for r in range(workers)]
            now = max(now + 1e-5, min(deadlines + [now + 2e-4]))     # rule 4's timer: every 0.2 ms at most
        assert sorted(done[0]) == sorted(done[1]) == [0, 1], (done, probes, timeouts, counts())
        assert timeouts == [0, 0], (timeouts, probes, now, counts())
        assert probes[0][:3] == [0, 0, 1] and probes[1] == [1, 1, 0], probes
        harvested, replays, waiting = counts()      # both rounds completed by probes, after 2 x 2 drops (and
        assert (harvested, replays) == (2, 0) and 4 <= waiting <= 5, (probes, counts())   # rank 0's next probe)
        assert now < 0.5 * rto, now                  # the third probe: 1 + 2 + 4 probe timeouts of silence, then 1
        _nothing_more(socks, E)
    finally:
        _close_switch(sw, socks)


@pytest.mark.parametrize("direction", ["ingress", "egress"])
def test_a_lost_tail_packet_is_recovered_by_its_copy_not_a_probe(tmp_path, direction):
    """Allreduces of one data chunk (each is a negotiation round and one data round, both tails: nothing
    sent after them shows their loss; the data chunk copied too, ``tail_copy_from=1``, where by default
    only streams of 16 chunks or more copy their last) under 10% loss in one direction. Every tail packet goes out twice
    and its result comes back twice, so a round stalls only when both copies are lost (1%), not at each
    loss (10%): the stalls the ranks recover by resending (probes or timeouts, by the clients' counters)
    stay far below the packets the switch dropped. (Without the copies each dropped packet stalls its
    round: its rank, and for a lost data packet every rank, must resend.) Results exact."""
    sw = SwitchProc("--slots", "64", "--elements", "64", f"--{direction}-loss", "0.1", "--seed", "7",
                    log_path=tmp_path / "switch.log")
    try:
        ops = [{"codec": "bfp32", "shape": [50], "seed": 140 + i} for i in range(60)]
        client = {**SLOW_TIMEOUT, "tail_copy_from": 1}      # a one-chunk data stream's chunk is copied too
        out = Workers(tmp_path, sw.port, N, job=8, ops=ops, client=client, warmup_ops=1).wait(timeout=150)
        st = sw.stats()
    finally:
        sw.terminate()
    dropped = st["impairments"][direction]["dropped"]
    assert dropped >= 40, f"the impairment dropped only {dropped} packets: the test shows nothing"

    def after_warmup(key):
        return sum(m["stats"][key] - m["stats_after_warmup"][key] for m in out.values())
    assert after_warmup("tail_copies") == N * 2 * (len(ops) - 1)       # two tail rounds per allreduce
    assert st["counters"]["tail_repeats"] >= N * 2 * len(ops)
    if direction == "ingress":      # a stalled round: every rank resends (none can tell whose copies were lost)
        stalls = after_warmup("probe_retransmissions") + after_warmup("timeout_retransmissions")
        assert stalls < N * dropped / 4, (stalls, dropped)
    else:                           # a stalled rank: its resend is answered by a replay
        stalls = after_warmup("probe_replayed") + after_warmup("timeout_replayed")
        assert stalls < dropped / 4, (stalls, dropped)
    _check_exact(out, ops, N)


def test_a_short_receive_wait_is_not_rounded_up_to_a_kernel_tick():
    """The client's receive waits until the next loss-recovery deadline (a 1 ms tail probe). A socket
    timeout counts in kernel ticks (4 ms with HZ=250: a 1 ms SO_RCVTIMEO waited 4 to 12 ms), so the
    receive waits by select instead. Over 40 receives told to wait 1 ms on a silent socket, every one
    returns nothing and the quickest quarter take under 3 ms each (tick-rounded waits: none under 4 ms;
    a loaded machine's late wake-ups delay some turns, not the quickest quarter)."""
    import time
    from types import SimpleNamespace

    from ina import burst as B
    from ina.client import RX_WAIT, Client
    sock = B.udp_socket("127.0.0.1", 0)
    try:
        B.set_recv_timeout(sock, RX_WAIT)
        cl = SimpleNamespace(sock=sock, rx=B.RxRing(sock, burst=8, stride=2048), _rx_wait=RX_WAIT)
        took, got = [], 0
        for _ in range(40):
            now = time.monotonic()
            Client.wait_until(cl, now + 0.001, now)
            got += Client.receive(cl)
            took.append(time.monotonic() - now)
    finally:
        sock.close()
    assert got == 0
    quartile = sorted(took)[len(took) // 4]
    assert quartile < 0.003, f"a quarter of the 1 ms receives took {quartile * 1e3:.1f} ms or more: rounded up"


def test_a_new_clients_first_data_stream_has_a_tail_probe(tmp_path, monkeypatch):
    """A new client's first allreduce: its negotiation ran the first window's encoding while it waited
    (``Transfer.run(meanwhile)``), so that round trip is no exact sample, but it bounds the fastest one:
    the data stream that follows already has a tail probe, not only the retransmission timeout."""
    from ina import Client
    from ina.transfer import Transfer
    at_start = []
    run = Transfer.run

    def recording(self, meanwhile=None):
        at_start.append((meanwhile is not None, self.cl.probe_timeout(0.0)))
        return run(self, meanwhile)
    monkeypatch.setattr(Transfer, "run", recording)
    sw = SwitchProc("--slots", "64", "--elements", "64", log_path=tmp_path / "switch.log")
    try:
        with Client(("127.0.0.1", sw.port), rank=0, world_size=1, job=211, elements=64, slots=8, timeout=20) as c:
            c.allreduce(np.ones(3000, np.float32), codec="bfp32")
    finally:
        assert sw.terminate() == 0, sw.log()
    assert [m for m, _ in at_start] == [True, False], at_start     # the negotiation (encoding meanwhile), the data
    assert at_start[0][1] is None and at_start[1][1] is not None, at_start
