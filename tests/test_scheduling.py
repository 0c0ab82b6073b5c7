"""The loss timers' floor: the longest wait for a core of one client loop turn (ina.scheduling).

A worker or the switch that waits on the run queue keeps the job silent; a tail probe or
retransmission timeout shorter than that wait resends chunks that are not lost. The waits are read
from the thread's schedstat (the kernel's run-queue wait counter)."""
from __future__ import annotations

import os
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from ina.client import Client
from ina.scheduling import MIN_SPAN, TIMEOUT_FLOOR_WAITS, RunQueueDelay

sys.path.insert(0, os.path.dirname(__file__))
from test_allreduce import switch  # noqa: E402,F401  (the module's switch fixture)


def _schedstat(path, waited_ns: int, slices: int) -> None:
    path.write_text(f"123456 {waited_ns} {slices}\n")


def test_the_floor_follows_the_longest_wait_of_a_turn_and_halves_without_one(tmp_path):
    stat = tmp_path / "schedstat"
    _schedstat(stat, 0, 1)
    rq = RunQueueDelay(str(stat))
    rq.sample()
    rq.turn(1 * 1e-3)                           # the first turn of an allreduce: where counting starts
    _schedstat(stat, 1_000_000, 2)
    rq.turn(2 * 1e-3)                           # 1 ms off the core in this turn
    _schedstat(stat, 6_000_000, 3)
    rq.turn(3 * 1e-3)                           # 5 ms in this one: the longest
    _schedstat(stat, 6_500_000, 4)
    rq.turn(4 * 1e-3)
    assert rq.sample() == pytest.approx(0.005)
    _schedstat(stat, 60_000_000, 5)             # waited between allreduces: not a silence of the job
    rq.turn(5 * 1e-3)
    _schedstat(stat, 60_100_000, 6)
    rq.turn(6 * 1e-3)
    assert rq.sample() == pytest.approx(0.0025)     # no wait near 5 ms: the estimate halves
    rq.close()


def test_a_turn_soon_after_a_reading_is_not_read(tmp_path):
    """Turns closer together than MIN_SPAN cost a comparison; their wait counts at the next reading."""
    stat = tmp_path / "schedstat"
    _schedstat(stat, 0, 1)
    rq = RunQueueDelay(str(stat))
    rq.turn(1.0)
    _schedstat(stat, 3_000_000, 2)
    rq.turn(1.0 + MIN_SPAN / 2)
    assert rq.longest == 0.0
    rq.turn(1.0 + 2 * MIN_SPAN)
    assert rq.longest == pytest.approx(0.003)


def test_without_schedstat_or_turned_off_the_floor_is_zero(tmp_path):
    """No schedstat (another kernel), or INA_TIMER_FLOOR=0 (``on=False``): the timers are as without it."""
    stat = tmp_path / "schedstat"
    for rq in (RunQueueDelay(str(tmp_path / "missing")), RunQueueDelay(str(stat), on=False)):
        _schedstat(stat, 0, 1)
        rq.turn(7 * 1e-3)
        _schedstat(stat, 9_000_000, 2)
        rq.turn(8 * 1e-3)
        assert rq.sample() == 0.0


def test_this_kernels_schedstat_is_read_per_thread():
    rq = RunQueueDelay()
    assert rq._waited() is not None, "no /proc/thread-self/schedstat on this kernel"
    seen = []
    t = threading.Thread(target=lambda: seen.append(rq._waited()))
    t.start()
    t.join()
    assert seen[0] is not None and len(rq._fds) == 2        # the thread's own counter, its own file
    rq.close()


def test_the_probe_and_the_timeout_wait_at_least_the_floor():
    """The tail probe waits at least one such wait, the retransmission timeout (which resends every late
    chunk) TIMEOUT_FLOOR_WAITS of them; with no wait measured, both are as before."""
    rq = RunQueueDelay(on=False)
    cl = SimpleNamespace(min_rto=0.001, rtt_min=0.0002, rto=0.02, max_rto=1.0, srtt=0.001, rttvar=0.0005,
                         world_size=8, run_queue=rq)
    assert Client.probe_timeout(cl, 0.0) == pytest.approx(0.001)
    assert Client.current_rto(cl) == pytest.approx(0.02)
    rq.delay = 0.004
    assert Client.probe_timeout(cl, 0.0) == pytest.approx(0.004)
    assert Client.current_rto(cl) == pytest.approx(0.004 * TIMEOUT_FLOOR_WAITS)


def test_a_later_smaller_allreduce_gives_the_bits_of_a_fresh_client(switch):  # noqa: F811
    """A client's packet ring is reused from allreduce to allreduce: what a larger allreduce left in it
    (payloads, flags of resends and tail copies) must not reach a later one's packets."""
    rng = np.random.default_rng(5)
    big = rng.standard_normal(128 * 20).astype(np.float32)
    small = rng.standard_normal(128 * 3 + 17).astype(np.float32)
    with Client(("127.0.0.1", switch.port), rank=0, world_size=1, job=230, elements=128, slots=8, timeout=20,
                seed=9) as used:
        used.allreduce(big.copy(), codec="nc-det")
        used.allreduce(big.copy(), codec="bfp32")
        got = used.allreduce(small.copy(), codec="nc-det")
    with Client(("127.0.0.1", switch.port), rank=0, world_size=1, job=231, elements=128, slots=8, timeout=20,
                seed=9) as fresh:
        want = fresh.allreduce(small.copy(), codec="nc-det")
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
