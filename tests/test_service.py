"""A switch service you can leave running: chunk ids that wrap, safe defaults, the specified hash.

The switch runs as a real ``python -m switch_model serve`` subprocess; workers are ``ina.Client``
objects in threads of this process (real UDP on loopback).
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sw_harness import SwitchProc, bfp_reference, join_all  # noqa: E402

from ina.wire import chunk_modulus, chunk_newer, slot_of_chunk  # noqa: E402


@pytest.fixture(scope="module")
def switch(tmp_path_factory):
    sw = SwitchProc("--slots", "64", "--elements", "64", log_path=tmp_path_factory.mktemp("sw") / "switch.log")
    yield sw
    assert sw.terminate() == 0, sw.log()


def allreduce_all(clients, xs, codec="bfp32"):
    """Every client's allreduce of its array, concurrently; the results (in place)."""
    errs = []

    def one(c, x):
        try:
            c.allreduce(x, codec)
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=one, args=(c, x)) for c, x in zip(clients, xs)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in ts), "an allreduce did not return"
    if errs:
        raise errs[0]
    return xs


# ------------------------------------------------------------------------------------------------
# chunk ids that wrap
# ------------------------------------------------------------------------------------------------
def test_chunk_id_rules():
    assert chunk_modulus(64) == 2**32                        # a power of two: the whole 32-bit space
    m = chunk_modulus(3)
    assert m % 6 == 0 and 2**32 - 6 < m < 2**32
    # across the wrap, chunk c + S uses c's pool index and the other shadow set
    for s in (3, 5, 64, 1000):
        m = chunk_modulus(s)
        for c in (m - 1, m - s, m - 2 * s - 1):
            a, b = slot_of_chunk(c, s), slot_of_chunk((c + s) % m, s)
            assert a & 0x7FFF == b & 0x7FFF and a >> 15 != b >> 15
    assert chunk_newer(0, 2**32 - 1, 2**32) and not chunk_newer(2**32 - 1, 0, 2**32)
    assert chunk_newer(5, m - 3, m) and not chunk_newer(m - 3, 5, m) and not chunk_newer(7, 7, m)


@pytest.mark.parametrize("slots", [4, 3])
def test_a_job_continues_across_the_chunk_id_wrap(switch, slots):
    n, elements = 3, 16
    first = chunk_modulus(slots) - 11                       # 11 chunks before the wrap
    clients = join_all(switch.port, 60 + slots, n, elements=elements, slots=slots, timeout=20, first_chunk=first)
    try:
        before = switch.stats()["drops"]
        for k in range(4):                                   # 4 x (1 negotiation + 7 data chunks): wraps once
            xs = [np.random.default_rng([k, r]).standard_normal(100).astype(np.float32) for r in range(n)]
            ref = bfp_reference([x.copy() for x in xs])
            allreduce_all(clients, xs)
            for r, x in enumerate(xs):
                assert np.array_equal(x.view(np.uint32), ref.view(np.uint32)), f"allreduce {k} rank {r} differs"
        assert clients[0]._next_chunk < first                # the ids did wrap
        after = switch.stats()["drops"]
        assert after["stale"] == before["stale"] and after["slot_chunk_mismatch"] == before["slot_chunk_mismatch"]
    finally:
        for c in clients:
            c.close()
