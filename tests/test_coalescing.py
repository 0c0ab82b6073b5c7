"""Receive coalescing's pause rule (ina.coalescing.pause_length): given the results' spacing, the chunks in
flight, whether the stream is in its tail and when a loss rule could fire, how long the client pauses.
No sockets, no timing: the rule is a function of its inputs, and the loss timers' bound is checked against
the rules themselves (:class:`ina.recovery.LossDetector` finds nothing before the pause ends, and does
right after the bound)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ina.coalescing import COALESCE_SPACING, COALESCE_TARGET, PAUSE_MIN, ArrivalSpacing, pause_length
from ina.recovery import LossDetector

INF = math.inf


def test_a_fast_link_never_pauses():
    """Results closer than COALESCE_SPACING batch by themselves; an unsettled estimate (0) never pauses."""
    assert pause_length(COALESCE_SPACING, 64, False, INF) == 0.0
    assert pause_length(COALESCE_SPACING, 64, True, INF) == 0.0
    assert pause_length(0.0, 64, False, INF) == 0.0
    sp = ArrivalSpacing()
    for i in range(4):                          # three gaps: not settled yet
        sp.sample(1, i * 4e-3)
    assert sp.per_pkt > COALESCE_SPACING and sp.for_coalescing() == 0.0
    sp.sample(1, 4 * 4e-3)
    assert sp.for_coalescing() == pytest.approx(4e-3)


def test_the_window_pause_is_the_target_in_spacings_without_an_absolute_cap():
    """While chunks are still to be sent: COALESCE_TARGET spacings, at most a quarter of the window's, less the
    turn's own processing. At 16 Mbit/s (3.7 ms a result) that is 59 ms, where the old 4 ms cap held one result."""
    assert pause_length(3.7e-3, 64, False, INF) == pytest.approx(COALESCE_TARGET * 3.7e-3)
    assert pause_length(6e-4, 64, False, INF) == pytest.approx(COALESCE_TARGET * 6e-4)      # 100 Mbit/s
    assert pause_length(1e-3, 40, False, INF) == pytest.approx(10e-3)     # a quarter of 40 in flight
    assert pause_length(1e-3, 8, False, INF) == pytest.approx(2e-3)       # a small window: 3/4 stays queued
    assert pause_length(1e-3, 64, False, INF, elapsed=3e-3) == pytest.approx(13e-3)
    assert pause_length(1e-3, 64, False, INF, elapsed=16e-3) == 0.0       # the processing took that long


def test_the_tail_pauses_and_never_holds_the_last_result():
    """Once every chunk is sent no send waits for a result: the tail pauses for the spacing of all but one of
    the results left (at most COALESCE_TARGET), so the last result wakes its own turn."""
    per = 2e-3
    assert pause_length(per, 64, True, INF) == pytest.approx(COALESCE_TARGET * per)   # no quarter-window bound
    assert pause_length(per, 20, True, INF) == pytest.approx(COALESCE_TARGET * per)
    assert pause_length(per, 5, True, INF) == pytest.approx(4 * per)
    assert pause_length(per, 2, True, INF) == pytest.approx(per)
    assert pause_length(per, 1, True, INF) == 0.0
    assert pause_length(per, 0, True, INF) == 0.0
    # the old rule never paused with 32 or fewer in flight; a tail of 20 at one 1 ms result each took ~20 turns
    left, turns = 20, 0
    while left:
        got = max(1, round(pause_length(1e-3, left, True, INF) / 1e-3))   # a pause of n spacings takes n results
        left, turns = left - min(got, left), turns + 1
    assert turns == 3                          # 16, 3, then the last one alone


def test_the_users_cap_and_the_loss_timers_bound_every_pause():
    per = 3.7e-3
    assert pause_length(per, 64, False, INF, longest=0.0) == 0.0            # Client(coalesce=0): off
    assert pause_length(per, 64, False, INF, longest=4e-3) == pytest.approx(4e-3)
    assert pause_length(per, 64, False, 5e-3) == pytest.approx(5e-3)
    assert pause_length(per, 64, True, 5e-3) == pytest.approx(5e-3)
    assert pause_length(per, 64, False, PAUSE_MIN / 2) == 0.0                # a rule is about to fire
    assert pause_length(per, 64, False, -1e-3) == 0.0                         # one is due already


def _tail(n=8, done=5, arrived_at=0.010):
    """A stream of ``n`` chunks all sent at 0, the first ``done`` results arrived at ``arrived_at``."""
    ld = LossDetector(n)
    ld.sent(np.arange(n), now=0.0)
    pending = np.arange(done, n)
    ld.delivered(np.arange(done), pending, now=arrived_at)
    return ld, pending


def _until(ld, pending, now, srtt, rttvar, pto, rto, max_rto, spacing):
    """The pause's bound as the client computes it (ina.transfer: next_deadline and rule 4's timer)."""
    return min(ld.next_deadline(pending, srtt, rttvar, pto, max_rto, spacing), ld.rto_at(rto, max_rto)) - now


@pytest.mark.parametrize("case", ["probe", "timeout", "reordering"])
def test_a_pause_ends_before_any_loss_rule_could_fire(case):
    """The tail's pause would be 2 spacings (4 ms); each rule here fires sooner (the tail probe after 1 ms,
    the timeout after 2 ms, rule 2's window after 1.5 ms): the pause ends by then, the rule finds nothing
    at its end and fires just after."""
    now, per, max_rto = 0.010, 2e-3, 1.0
    srtt, pto, rto = None, None, 1.0
    if case == "probe":
        ld, pending = _tail()
        pto = 1e-3
    elif case == "timeout":               # no round trip measured yet: no probe, rule 4 only
        ld, pending = _tail()
        rto = 2e-3
    else:                                 # chunk 5 missing, 6 arrived: a gap, and rule 2's window runs
        ld = LossDetector(9)
        ld.sent(np.arange(9), now=0.009)
        ld.delivered(np.array([0, 1, 2, 3, 4, 6]), np.array([5, 7, 8]), now=now)
        pending = np.array([5, 7, 8])
        srtt = (2.5e-3 - 5e-4) / 1.25     # window 2.5 ms after the send at 9 ms: 1.5 ms from now
    until = _until(ld, pending, now, srtt, 0.0, pto, rto, max_rto, per)
    full = pause_length(per, pending.size, True, INF)
    pause = pause_length(per, pending.size, True, until)
    assert full == pytest.approx(2 * per) and 0 < pause < full
    assert pause == pytest.approx({"probe": 1e-3, "timeout": 2e-3, "reordering": 1.5e-3}[case])
    found = ld.lost(pending, now + pause - 1e-9, srtt, rto, max_rto, pto, 0.0, per)    # (to rounding)
    assert sum(f.size for f in found) == 0, found
    found = ld.lost(pending, now + pause + 1e-6, srtt, rto, max_rto, pto, 0.0, per)
    assert sum(f.size for f in found) == 1, found


def test_without_a_pending_rule_only_the_timeout_bounds_the_pause():
    """With a window in flight and no evidence of a loss, rule 3's longer probe (srtt + pending x spacing)
    and rule 4's timer lie beyond the pause: it is the full one."""
    ld, pending = _tail(n=80, done=16)
    now, per = 0.010, 3.7e-3
    until = _until(ld, pending, now, 0.24, 0.01, 1e-3, 0.5, 1.0, per)
    assert until > 0.2
    assert pause_length(per, pending.size, False, until) == pytest.approx(COALESCE_TARGET * per)


def test_a_bunched_first_sample_does_not_hold_the_spacing_low_for_the_stream():
    """``per_pkt`` starts as the least of its first samples and takes no gap above twice it: two results
    received together at first (0.26 ms a result, where they come 0.66 ms apart) held it there, and every
    pause took 6 results instead of 16. Coalescing's spacing is the timers' estimate or the stream's mean
    then, whichever is less."""
    sp, now = ArrivalSpacing(), 0.0
    sp.sample(1, now)
    now += 0.52e-3
    sp.sample(2, now)                          # a bunched pair: 0.26 ms a result
    for _ in range(30):
        now += 0.66e-3
        sp.sample(1, now)
    assert sp.per_pkt == pytest.approx(0.26e-3)
    assert sp.for_coalescing() == pytest.approx(0.66e-3, rel=0.05)
    assert pause_length(sp.for_coalescing(), 64, False, INF) == pytest.approx(16 * 0.66e-3, rel=0.05)


def test_a_fast_links_loss_recoveries_do_not_make_it_pause():
    """On loopback (20 us a result) a loss's recovery gap (5 ms, ended by the resent chunk's result) every
    20 results lifts the stream's mean above COALESCE_SPACING, but not the timers' estimate: no pause."""
    sp, now = ArrivalSpacing(), 0.0
    for i in range(1, 401):
        gap, recovered = (5e-3, True) if i % 20 == 0 else (2e-5, False)
        now += gap
        sp.sample(1, now, recovered=recovered, probed_after=INF)
    assert sp.pace.mean() > COALESCE_SPACING
    assert sp.for_coalescing() < COALESCE_SPACING
    assert pause_length(sp.for_coalescing(), 64, False, INF) == 0.0


def test_a_fast_link_whose_processes_wait_for_a_core_does_not_pause():
    """A 1 Gbit/s stream (50 us a result) whose processes then wait for a core (results 0.3 ms apart): the
    timers' estimate restarts at the slower gaps and the mean follows, but the pace estimate, which errs
    short, says the link is fast, and the others stay below twice COALESCE_SPACING: no pause (pausing
    there delays sends the switch is waiting for). A pace estimate stuck as low where the others agree
    on a slow link (0.66 ms, 100 Mbit/s) pauses for their spacing."""
    def stream(slow):
        sp, now = ArrivalSpacing(), 0.0
        for _ in range(6):
            now += 4 * 5e-5
            sp.sample(4, now)
        for _ in range(200):
            now += slow
            sp.sample(1, now)
        return sp
    sp = stream(3e-4)
    assert sp.timer.per_pkt > COALESCE_SPACING and sp.pace.mean() > COALESCE_SPACING
    assert sp.per_pkt <= COALESCE_SPACING
    assert sp.for_coalescing() == 0.0
    sp = stream(6.6e-4)
    assert sp.per_pkt <= COALESCE_SPACING
    assert sp.for_coalescing() == pytest.approx(6.6e-4, rel=0.1)     # (the mean counts the fast start)
