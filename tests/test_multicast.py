"""IP multicast of results (switch_model/multicast.py, ina/multicast.py): correctness, not speed.

Real switch and real clients in the emulated hosts of ina.net.Topology (namespaces, a Linux bridge with
IGMP snooping, shaped links): with multicast the sums stay exact, a worker that misses multicast results
gets them by unicast replay, two concurrent jobs' groups reach only their own workers, and on loopback
the switch falls back to a unicast copy per worker.
"""
from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import time
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


def _switch(topo, tmp_path, *options, host=None, port: int = PORT, log: str = "switch.log"):
    host = host or topo.switch
    return start_switch(port, "--stats-interval", "0", "--elements", "2048", "--slots", "256", *options,
                        popen=functools.partial(topo.popen, host), host="0.0.0.0",
                        control_host=host.ip, log_path=tmp_path / log, timeout=60.0)


def _start_workers(topo, tmp_path, hosts, job: int, op: dict, rank_extra=None, switch=None, **extra) -> list:
    """mc_worker.py of each rank in its host; ``rank_extra(rank)``: further spec entries of that rank;
    ``switch``: (ip, port) of the switch (default: the topology's switch host, PORT)."""
    ip, port = switch or (topo.switch.ip, PORT)
    procs = []
    for r, h in enumerate(hosts):
        spec = {"ip": ip, "port": port, "rank": r, "world": len(hosts), "job": job, "codec": "bfp32",
                "op": op, "client": {"elements": 2048, "slots": 64}, **extra, **(rank_extra(r) if rank_extra else {})}
        out = str(tmp_path / f"job{job}-{ip}-{port}-rank{r}")
        procs.append((topo.popen(h, [PY, str(WORKER), json.dumps(spec), out], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, stdin=subprocess.PIPE, text=True), out))
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


def _step(procs, word: str, timeout: float = 120.0) -> None:
    """Wait until every worker (started with ``hold``) said ``word``, then let them all go on. Reads the pipe's
    descriptor itself (a buffered readline could take the word's line into Python's buffer while ``select``
    waits on an empty pipe); what follows the word stays for the next step."""
    deadline = time.monotonic() + timeout
    for p, out in procs:
        fd, got = p.stdout.fileno(), getattr(p, "unread", b"")
        while True:
            lines = got.split(b"\n")
            said = [line.strip() for line in lines[:-1]]
            if word.encode() in said:
                p.unread = b"\n".join(lines[said.index(word.encode()) + 1:])
                break
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            more = os.read(fd, 1 << 16) if ready else b""
            if not more:
                raise AssertionError(f"worker {out} did not say {word!r} within {timeout:g} s:\n"
                                     f"{got.decode(errors='replace')[-3000:]}")
            got += more
    for p, _ in procs:
        p.stdin.write("\n")
        p.stdin.flush()


def _switch_stats(topo, switch=None) -> dict:
    from ina.control import request
    ip, port = switch or (topo.switch.ip, PORT)
    return request(ip, port, {"op": "stats"}, timeout=10.0)["stats"]


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
    """Egress loss on a multicasting job: each worker's copy of a result is dropped on its own (as on its own
    link); a result none of whose copies is lost goes out as one multicast, one that lost a copy as its
    surviving unicast copies; lost copies come back by replay and the sums are exact."""
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
    assert 0 < c["multicast_as_copies"] <= egress["dropped"], (c, egress)    # only group sends that lost a copy
    # the others went as one multicast each (a result and a tail repeat: at most two group sends a round)
    assert c["tx_packets"] < c["harvested"] + c["tail_repeats"] + c["replays"] + 3 * egress["dropped"], (c, egress)


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
            results = _finish(_start_workers(topo, tmp_path, topo.workers, 10, op, repeat=6,
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


def _two_switches_one_job_id(tmp_path, topo, switches: list, hosts: list) -> tuple[list, list]:
    """Job 12 at each of ``switches`` ((host, port)), 2 workers each (``hosts``: 4), different inputs, at
    once (every worker joins, then all start; all stay until all are done): (results per switch, stats per
    switch); every sum is exact."""
    ops = [{"shape": [400_000], "seed": 20 + k} for k in range(2)]
    procs, stats_ = [], []
    sws = [_switch(topo, tmp_path, host=h, port=p, log=f"switch{k}.log") for k, (h, p) in enumerate(switches)]
    try:
        for k, (h, p) in enumerate(switches):
            procs.append(_start_workers(topo, tmp_path, hosts[2 * k: 2 * k + 2], 12, ops[k], switch=(h.ip, p),
                                        repeat=3, hold=True))
        _step(procs[0] + procs[1], "joined")
        _step(procs[0] + procs[1], "done")
        results = [_finish(pr) for pr in procs]
        stats_ = [_switch_stats(topo, (h.ip, p)) for h, p in switches]
    finally:
        for p, _ in (x for pr in procs for x in pr):
            if p.poll() is None:      # a step failed: the workers would wait on their stdin
                p.kill()
                p.wait(timeout=10)
        for sw in sws:
            sw.stop(timeout=10)
    for k in range(2):
        _exact(results[k], ops[k], 2)
        assert all(meta["multicast"] for _, meta in results[k])
        assert stats_[k]["counters"]["multicast_results"] == stats_[k]["counters"]["harvested"] > 0
    return results, stats_


def test_two_switches_on_one_fabric_with_the_same_job_id_keep_their_results_apart(tmp_path):
    """Two switches in two hosts of one fabric, each with a job 12: their groups differ (the group follows
    from the switch's address), so each worker's download carries only its own switch's results and every
    sum is exact (with one group for both, a worker took the other switch's results for its own)."""
    with _topology(5) as topo:
        before = topo.counters()
        results, _ = _two_switches_one_job_id(tmp_path, topo, [(topo.switch, PORT), (topo.workers[4], PORT)],
                                              topo.workers[:4])
        after = topo.counters()
    groups = {line.split("multicast: group ")[1].split()[0] for k in range(2)
              for line in (tmp_path / f"switch{k}.log").read_text().splitlines() if "job 12 installed" in line}
    assert len(groups) == 2, groups
    for h, (_, meta) in zip(topo.workers[:4], results[0] + results[1]):
        got = meta["stats"]["bytes_received"]
        down = after[h.name].down_bytes - before[h.name].down_bytes
        assert got <= down < 1.3 * got, f"{h.name}: download {down} B, its client received {got} B"


def test_a_worker_takes_results_only_from_its_switch(tmp_path):
    """Two switches in one host, at ports 16384 apart, each with a job 12: their groups and group ports
    coincide (one address, the port counted modulo 16384), so every worker gets both switches' results;
    its data socket's filter drops the other switch's (counted in the socket's drops) and every sum is
    exact."""
    with _topology(4) as topo:
        results, _ = _two_switches_one_job_id(tmp_path, topo, [(topo.switch, PORT), (topo.switch, PORT + 16384)],
                                              topo.workers)
    groups = {line.split("multicast: group ")[1].split()[0] for k in range(2)
              for line in (tmp_path / f"switch{k}.log").read_text().splitlines() if "job 12 installed" in line}
    assert len(groups) == 1, groups
    for k in range(2):
        for r, (_, meta) in enumerate(results[k]):
            assert meta["socket_drops"] > 0, (k, r, meta)


def test_the_group_rule_keeps_switches_of_one_subnet_and_jobs_apart():
    """ina.wire.multicast_group: every host address of a /24 gets its own group for one job id, every job
    of one switch its own group, two switches on one host their own port; job ids beyond 16 bits are
    refused by name."""
    from ina.wire import multicast_group
    groups = {multicast_group(7, (f"10.213.6.{h}", 9999)) for h in range(1, 255)}
    assert len({g for g, _ in groups}) == 254
    assert len({multicast_group(j, ("10.213.6.1", 9999))[0] for j in range(0, 65536, 7)}) == len(range(0, 65536, 7))
    assert multicast_group(7, ("10.0.0.1", 9999))[1] != multicast_group(7, ("10.0.0.1", 10000))[1]
    assert all(16384 <= multicast_group(j, ("10.0.0.1", p))[1] < 32768 for j in (0, 65535) for p in (1, 65535))
    with pytest.raises(ValueError, match="job id 65536 out of range"):
        multicast_group(65536, ("10.0.0.1", 9999))
