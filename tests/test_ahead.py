"""The next allreduce's exponent negotiation sent while the current one streams (ina.ahead).

Real switch, real UDP on loopback, worker processes (tests/sw_worker.py with ``ahead``: a rank names each
allreduce's successor as ``following``). The sums must be bit-identical to the numpy reference of the
same allreduces made one after the other without it, whether every rank, one rank or no rank sends its
negotiations ahead (the switch sees the same packets on the same chunk ids, only earlier), also when the
negotiation packets and their results are lost; and an allreduce other than the one named comes next
raises and leaves the client unusable instead of pairing with the peers' next allreduce.
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from ina import AllreduceError, Client

sys.path.insert(0, os.path.dirname(__file__))
from sw_harness import SwitchProc, Workers, bfp_reference, cast_like, expected_inputs  # noqa: E402

N = 2
CLIENT = {"elements": 64, "slots": 8, "timeout": 20.0}
# sizes below, at and above one chunk and one window (8 x 64): the negotiation goes ahead from the first result
# on (a stream shorter than the window) or only from the last window's results on
OPS = [{"shape": [5000], "seed": 1}, {"shape": [1], "seed": 2}, {"shape": [300], "seed": 3},
       {"shape": [512], "seed": 4, "average": True}, {"shape": [37, 53], "seed": 5, "kind": "torch"},
       {"shape": [700], "seed": 6, "dist": "big"}, {"shape": [64, 10], "seed": 7, "kind": "torch", "dtype": "float16"},
       {"shape": [3000], "seed": 8, "dist": "tiny"}]


def check_exact(out, ops):
    for r, meta in out.items():
        assert len(meta["results"]) == len(ops), (r, len(meta["results"]))
        for i, op in enumerate(ops):
            ref = np.asarray(cast_like(bfp_reference(expected_inputs(op, N), bool(op.get("average"))),
                                       op.get("dtype", "float32")), np.float32)
            got = np.asarray(meta["results"][i], np.float32)
            assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (r, i, op)


@pytest.mark.parametrize("ahead", [(0, 1), (0,)], ids=["every_rank", "one_rank"])
def test_negotiations_sent_ahead_give_the_sequential_sums(tmp_path, ahead):
    sw = SwitchProc("--slots", "64", "--elements", "64", log_path=tmp_path / "switch.log")
    try:
        ops = [{"codec": "bfp32", **op} for op in OPS]
        out = Workers(tmp_path, sw.port, N, job=4, ops=ops, client=CLIENT, loop=2, ahead=ahead).wait(timeout=100)
    finally:
        sw.terminate()
    check_exact({r: {"results": m["results"][:len(ops)]} for r, m in out.items()}, ops)
    check_exact({r: {"results": m["results"][len(ops):]} for r, m in out.items()}, ops)
    for r, m in out.items():
        # every op but a pass's last names its successor, which is then sent ahead
        want = 2 * (len(ops) - 1) if r in ahead else 0
        assert m["stats"]["negotiations_ahead"] == want, (r, m["stats"])


@pytest.mark.parametrize("direction", ["ingress", "egress"])
def test_lost_negotiation_packets_sent_ahead_are_recovered(tmp_path, direction):
    """10% loss one way: negotiation packets and their results sent ahead are lost too; every sum is exact."""
    sw = SwitchProc("--slots", "64", "--elements", "64", f"--{direction}-loss", "0.1", "--seed", "5",
                    log_path=tmp_path / "switch.log")
    try:
        ops = [{"codec": "bfp32", **op} for op in OPS[:4]] * 3
        out = Workers(tmp_path, sw.port, N, job=5, ops=ops, client=CLIENT, ahead=(0, 1)).wait(timeout=120)
        dropped = sw.stats()["impairments"][direction]["dropped"]
    finally:
        sw.terminate()
    assert dropped >= 5, f"the impairment dropped only {dropped} packets: the test shows nothing"
    check_exact(out, ops)
    assert all(m["stats"]["negotiations_ahead"] == len(ops) - 1 for m in out.values()), out


def test_an_allreduce_other_than_the_one_named_next_raises_and_breaks_the_client(tmp_path):
    """Its negotiation went ahead on the next chunk ids, which the peers' next allreduce will use: an
    allreduce of another tensor made next would pair with the wrong values, so it raises at once and the
    client stays unusable."""
    sw = SwitchProc("--slots", "64", "--elements", "64", log_path=tmp_path / "switch.log")
    errors: dict = {}

    def rank(r):
        with Client(("127.0.0.1", sw.port), rank=r, world_size=N, job=6, **CLIENT) as cl:
            x, named, other = (np.full(n, r + 1.0, np.float32) for n in (1000, 100, 100))
            cl.allreduce(x, codec="bfp32", following=lambda: (named, "bfp32"))
            assert cl.stats.negotiations_ahead == 1
            for attempt in ("other", "again"):
                try:
                    cl.allreduce(other if attempt == "other" else named, codec="bfp32")
                except AllreduceError as e:
                    errors[(r, attempt)] = str(e)
            errors[(r, "sum")] = float(x[0])

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    finally:
        sw.terminate()
    for r in range(N):
        assert errors[(r, "sum")] == 3.0
        assert "other than the one named as following" in errors[(r, "other")], errors
        assert "unusable after an earlier failure" in errors[(r, "again")], errors
