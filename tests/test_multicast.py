"""IP multicast of results (switch_model/multicast.py, ina/multicast.py): correctness, not speed.

Real switch and real clients in the emulated hosts of ina.net.Topology (namespaces, a Linux bridge with
IGMP snooping, shaped links): with multicast the sums stay exact, a worker that misses multicast results
gets them by unicast replay, two concurrent jobs' groups reach only their own workers, and on loopback
the switch falls back to a unicast copy per worker.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sw_harness import SwitchProc, bfp_reference, client_threads, make_input, stats  # noqa: E402

from switch_model.launch import start_switch  # noqa: E402

PY = sys.executable
WORKER = Path(__file__).resolve().parent / "mc_worker.py"
PORT = 9999


def _topology(workers: int):
    from ina.net import Topology, missing_caps
    if missing_caps():
        pytest.skip(f"building network namespaces needs {missing_caps()}")
    return Topology(workers=workers, rate="1gbit", mtu=9000)


def _switch(topo, tmp_path, *options):
    return start_switch(PORT, "--stats-interval", "0", "--elements", "2048", "--slots", "256", *options,
                        popen=functools.partial(topo.popen, topo.switch), host="0.0.0.0",
                        control_host=topo.switch.ip, log_path=tmp_path / "switch.log", timeout=60.0)


def _start_workers(topo, tmp_path, hosts, job: int, op: dict, rank_extra=None, **extra) -> list:
    """mc_worker.py of each rank in its host; ``rank_extra(rank)``: further spec entries of that rank."""
    procs = []
    for r, h in enumerate(hosts):
        spec = {"ip": topo.switch.ip, "port": PORT, "rank": r, "world": len(hosts), "job": job, "codec": "bfp32",
                "op": op, "client": {"elements": 2048, "slots": 64}, **extra, **(rank_extra(r) if rank_extra else {})}
        out = str(tmp_path / f"job{job}-rank{r}")
        procs.append((topo.popen(h, [PY, str(WORKER), json.dumps(spec), out], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True), out))
    return procs


def _finish(procs, timeout: float = 180.0) -> list:
    res = []
    for p, out in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            text = p.communicate()[0]
            raise AssertionError(f"worker {out} did not finish within {timeout:g} s:\n{text[-3000:]}") from None
        assert p.returncode == 0, f"worker {out} failed:\n{text[-3000:]}"
        res.append((np.load(out + ".npz")["result"], json.loads(Path(out + ".json").read_text())))
    return res


def _switch_stats(topo) -> dict:
    from ina.control import request
    return request(topo.switch.ip, PORT, {"op": "stats"}, timeout=10.0)["stats"]


def _exact(results, op, n: int) -> None:
    ref = bfp_reference([make_input(op, r) for r in range(n)])
    for r, (y, _) in enumerate(results):
        np.testing.assert_array_equal(y, ref, err_msg=f"rank {r}")


def test_results_are_exact_with_multicast_to_8_namespaced_workers(tmp_path):
    """8 workers in 8 emulated hosts, bfp32, results multicast: every rank gets the exact sums; each
    worker's download (its bridge port's shaping queue) carried every result it received; a ninth host
    outside the job carried none of them."""
    op = {"shape": [300_000], "seed": 11}
    with _topology(9) as topo:
        sw = _switch(topo, tmp_path)
        try:
            before = topo.counters()
            results = _finish(_start_workers(topo, tmp_path, topo.workers[:8], 3, op))
            after = topo.counters()
            st = _switch_stats(topo)
        finally:
            sw.stop(timeout=10)
    _exact(results, op, 8)
    assert all(meta["multicast"] for _, meta in results)
    c = st["counters"]
    assert c["multicast_results"] == c["harvested"] > 0, c       # every round's result sent once
    assert c["multicast_as_copies"] == 0, c                        # ... as one multicast, not copies
    for r, (_, meta) in enumerate(results):
        got = meta["stats"]["bytes_received"]
        down = after[f"w{r}"].down_bytes - before[f"w{r}"].down_bytes
        assert down >= got > 300_000, f"w{r}: its download carried {down} B, the client received {got} B"
    outsider = after["w8"].down_bytes - before["w8"].down_bytes
    assert outsider < 20_000, f"a host outside the job carried {outsider} B of downloads"


def test_a_worker_that_misses_multicast_results_gets_them_by_unicast_replay(tmp_path):
    """Rank 2 leaves the job's group after the join: its host drops the results multicast to it (lost on
    the way down); it resends, the switch replays each result to it alone, and every rank's sums are
    exact."""
    op = {"shape": [40_000], "seed": 12}
    with _topology(4) as topo:
        sw = _switch(topo, tmp_path)
        try:
            results = _finish(_start_workers(topo, tmp_path, topo.workers, 4, op,
                                             rank_extra=lambda r: {"leave_group": r == 2}))
            st = _switch_stats(topo)
        finally:
            sw.stop(timeout=10)
    _exact(results, op, 4)
    assert all(meta["multicast"] for _, meta in results)
    s2 = results[2][1]["stats"]
    assert s2["fast_replayed"] + s2["probe_replayed"] + s2["timeout_replayed"] > 0, s2
    assert st["counters"]["replays"] > 0 and st["counters"]["multicast_results"] > 0, st["counters"]


def test_with_egress_loss_each_worker_loses_its_own_copies(tmp_path):
    """Egress impairments on a multicasting job: each result goes out as a unicast copy per worker, each
    copy dropped on its own (as on its own link); lost copies come back by replay and the sums are exact."""
    op = {"shape": [100_000], "seed": 16}
    with _topology(4) as topo:
        sw = _switch(topo, tmp_path, "--egress-loss", "0.03", "--seed", "5")
        try:
            results = _finish(_start_workers(topo, tmp_path, topo.workers, 8, op))
            st = _switch_stats(topo)
        finally:
            sw.stop(timeout=10)
    _exact(results, op, 4)
    assert all(meta["multicast"] for _, meta in results)
    c, egress = st["counters"], st["impairments"]["egress"]
    assert c["multicast_results"] == c["harvested"] > 0 and c["replays"] > 0, c
    assert c["multicast_as_copies"] >= c["multicast_results"], c     # every group send made copies (tail repeats too)
    assert egress["dropped"] > 0, egress
    assert c["tx_packets"] >= 4 * c["harvested"] - egress["dropped"], (c, egress)     # a copy per worker


def test_two_concurrent_jobs_get_only_their_own_results(tmp_path):
    """Jobs 5 and 6, 4 workers each, at once: both multicast, both exact, and each worker's download
    carried about its own job's results only (the other job's group is not forwarded to its port)."""
    ops = {5: {"shape": [200_000], "seed": 13}, 6: {"shape": [200_000], "seed": 14}}
    with _topology(8) as topo:
        sw = _switch(topo, tmp_path)
        try:
            before = topo.counters()
            procs = {5: _start_workers(topo, tmp_path, topo.workers[:4], 5, ops[5], repeat=3),
                     6: _start_workers(topo, tmp_path, topo.workers[4:], 6, ops[6], repeat=3)}
            results = {j: _finish(p) for j, p in procs.items()}
            after = topo.counters()
        finally:
            sw.stop(timeout=10)
    for j, hosts in ((5, topo.workers[:4]), (6, topo.workers[4:])):
        _exact(results[j], ops[j], 4)
        for h, (_, meta) in zip(hosts, results[j]):
            assert meta["multicast"]
            got = meta["stats"]["bytes_received"]
            down = after[h.name].down_bytes - before[h.name].down_bytes
            assert got <= down < 1.3 * got, f"{h.name} (job {j}): download {down} B, its client received {got} B"


def test_a_worker_on_the_switchs_own_host_gets_unicast(tmp_path):
    """A worker in the switch's own emulated host, joined over the host's (non-loopback) address: its
    group is joined, but a multicast would not come back to the sending host, so the switch sends unicast
    copies; the sums are exact."""
    op = {"shape": [30_000], "seed": 17}
    with _topology(1) as topo:
        sw = _switch(topo, tmp_path)
        try:
            results = _finish(_start_workers(topo, tmp_path, [topo.switch, topo.workers[0]], 9, op))
            st = _switch_stats(topo)
        finally:
            sw.stop(timeout=10)
    _exact(results, op, 2)
    assert not any(meta["multicast"] for _, meta in results)
    assert st["counters"]["multicast_results"] == 0 < st["counters"]["harvested"]
    assert "unicast: a worker is on the switch's host" in (tmp_path / "switch.log").read_text()


def test_on_loopback_the_switch_sends_unicast_copies(tmp_path):
    """Workers reached over loopback join no group: the switch falls back to a unicast copy per worker
    (stats say so) and the sums are exact."""
    op = {"shape": [50_000], "seed": 15}
    sw = SwitchProc(log_path=tmp_path / "switch.log")
    try:
        def body(r, cl):
            x = make_input(op, r)
            cl.allreduce(x, codec="bfp32")
            return x, cl.multicast
        out = client_threads(sw.port, 3, 7, body, multicast=True)
        st = stats(sw.port)
    finally:
        sw.terminate()
    ref = bfp_reference([make_input(op, r) for r in range(3)])
    for x, mc in out:
        np.testing.assert_array_equal(x, ref)
        assert mc is False
    assert st["counters"]["multicast_results"] == 0 and st["counters"]["harvested"] > 0
    assert "unicast: rank(s) [0, 1, 2] did not join" in Path(tmp_path / "switch.log").read_text()


def test_a_group_that_never_reaches_the_workers_falls_back_to_unicast(tmp_path):
    """Every rank leaves the job's group after the join: the switch multicasts, but no result gets through
    (as on a fabric that does not forward the group). Each result then comes only as the replay of a
    resend; the switch sees that, says so, counts it and sends the job's results as unicast copies from
    then on: the last allreduce gets its results without resends, and every sum is exact."""
    op = {"shape": [300_000], "seed": 18}
    with _topology(4) as topo:
        sw = _switch(topo, tmp_path)
        try:
            results = _finish(_start_workers(topo, tmp_path, topo.workers, 10, op, repeat=4,
                                             rank_extra=lambda r: {"leave_group": True}))
            st = _switch_stats(topo)
        finally:
            sw.stop(timeout=10)
    _exact(results, op, 4)
    c, (fb,) = st["counters"], st["multicast_fallbacks"]
    assert c["multicast_fallbacks"] == 1, c
    assert 0 < c["multicast_results"] < c["harvested"], c
    assert fb["job"] == 10 and fb["ranks"] and "needed a replay of" in fb["why"], fb
    chunks = 300_000 // 2048 + 1
    for r, (_, meta) in enumerate(results):
        assert meta["replayed"][0] > chunks // 2, (r, meta["replayed"])     # multicast on, nothing arrives
        assert meta["replayed"][-1] < chunks // 10, (r, meta["replayed"])   # unicast copies arrive
    log = (tmp_path / "switch.log").read_text()
    assert "job 10: its multicast group does not reach" in log and "unicast copy per worker from now on" in log


def test_a_multicast_job_without_losses_keeps_its_group(tmp_path):
    """The fallback's rule does not fire on a healthy group: 4 workers, many results, no fallback."""
    op = {"shape": [300_000], "seed": 19}
    with _topology(4) as topo:
        sw = _switch(topo, tmp_path)
        try:
            results = _finish(_start_workers(topo, tmp_path, topo.workers, 11, op, repeat=4))
            st = _switch_stats(topo)
        finally:
            sw.stop(timeout=10)
    _exact(results, op, 4)
    c = st["counters"]
    assert c["multicast_fallbacks"] == 0 and c["multicast_results"] == c["harvested"] > 0, c
    assert st["multicast_fallbacks"] == []
