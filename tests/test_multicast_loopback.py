"""IP multicast of results over loopback (ina/multicast.py, switch_model/multicast.py): correctness, not speed.

Real switch, real clients on 127.0.0.1: every worker's data socket binds the job's group port and joins
the group on lo, and a group of its own that takes its replays and unicast copies. Results reach every
worker exactly once and the sums are exact; a rank that misses the group gets its results as replays
sent to it alone, and the switch's judge moves the job to per-rank copies; where a datagram to the
worker's own group does not come back on lo (a scratch network namespace whose lo drops multicast)
the worker joins nothing, says why, and the switch sends unicast copies.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sw_harness import SwitchProc, bfp_reference, client_threads, make_input, stats  # noqa: E402

from ina.wire import multicast_group  # noqa: E402


def _run(port: int, world: int, job: int, op: dict, repeat: int = 1, before=None, **options) -> list:
    """``repeat`` bfp32 allreduces of ``op`` in ``world`` client threads; per rank (last result, whether
    results were multicast, the client's stats). ``before(rank, client)`` runs after the join."""
    def body(r, cl):
        if before:
            before(r, cl)
        for _ in range(repeat):
            x = make_input(op, r)
            cl.allreduce(x, codec="bfp32")
        return x, cl.multicast, cl.stats
    return client_threads(port, world, job, body, **options)


def test_results_reach_every_worker_once_by_the_group_on_loopback(tmp_path):
    """4 workers on loopback: each result is one multicast (the switch's multicast_results equals its
    harvested rounds), every worker received each once, a replay reached one worker, and the sums are
    bit-exact."""
    op = {"shape": [200_000], "seed": 21}
    sw = SwitchProc("--elements", "2048", log_path=tmp_path / "switch.log")
    try:
        out = _run(sw.port, 4, 11, op, repeat=2, multicast=True, elements=2048, slots=32)
        st = stats(sw.port)
    finally:
        sw.terminate()
    ref = bfp_reference([make_input(op, r) for r in range(4)])
    for x, mc, _ in out:
        np.testing.assert_array_equal(x, ref)
        assert mc is True
    c = st["counters"]
    assert c["multicast_results"] == c["harvested"] > 0
    assert c["multicast_as_copies"] == 0 and c["multicast_fallbacks"] == 0
    # every worker took each multicast once (each result and the second copy of each stream's last result,
    # tail_repeats), and each replay (a resend on a loaded machine: rare) reached one worker
    got = [s.packets_received for _, _, s in out]
    assert c["tail_repeats"] > 0 and sum(got) == 4 * (c["harvested"] + c["tail_repeats"]) + c["replays"], \
        (c["harvested"], c["tail_repeats"], c["replays"], got)
    log = (tmp_path / "switch.log").read_text()
    assert "multicast: group 239." in log and "from 127.0.0.1 on lo" in log


def _leave_group(rank: int):
    """A ``before`` hook: rank ``rank`` leaves the job's group after the join (lo then drops the results
    multicast to it; its own group still takes its replays)."""
    def before(r, cl):
        if r == rank:
            assert cl.multicast
            group = multicast_group(cl.job, cl.ctl.sock.getpeername()[:2])[0]
            cl.sock.setsockopt(socket.IPPROTO_IP, socket.IP_DROP_MEMBERSHIP,
                               socket.inet_aton(group) + socket.inet_aton("127.0.0.1"))
    return before


def test_a_rank_that_misses_the_group_is_replayed_alone_then_sent_copies(tmp_path):
    """Rank 2 leaves the job's group after the join: each result reaches it only as the replay of its
    resend, sent to its own group, which its peers did not join (they see no duplicate); after a window
    the switch's judge moves the job to a copy per rank, each to that rank's own group; every sum exact."""
    op = {"shape": [400_000], "seed": 22}
    sw = SwitchProc("--elements", "2048", log_path=tmp_path / "switch.log")
    try:
        out = _run(sw.port, 3, 12, op, repeat=3, before=_leave_group(2), multicast=True, elements=2048, slots=16,
                   rto=0.005)
        st = stats(sw.port)
    finally:
        sw.terminate()
    ref = bfp_reference([make_input(op, r) for r in range(3)])
    for x, _, _ in out:
        np.testing.assert_array_equal(x, ref)
    s2 = out[2][2]
    assert s2.fast_replayed + s2.probe_replayed + s2.timeout_replayed > 0
    c = st["counters"]
    for _, _, s in out[:2]:          # hundreds of replays to rank 2; a peer's duplicates are its own (tail copies)
        assert s.duplicate_results <= c["tail_repeats"] + s.fast_replayed + s.probe_replayed + s.timeout_replayed
    assert s2.fast_replayed + s2.probe_replayed + s2.timeout_replayed > 50
    assert c["replays"] > 0 and c["multicast_fallbacks"] == 1
    assert st["multicast_fallbacks"][0]["ranks"] == [2], st["multicast_fallbacks"]


def test_impaired_results_on_loopback_stay_exact(tmp_path):
    """Egress loss on loopback: a result that lost a worker's copy goes as its surviving copies, each to
    its worker's own group; replays go to the loser only. The sums are bit-exact (a duplicate never
    counts twice)."""
    from sw_harness import control
    op = {"shape": [300_000], "seed": 23}
    sw = SwitchProc("--elements", "2048", log_path=tmp_path / "switch.log")
    try:
        control(sw.port, {"op": "impair", "egress": {"loss": 0.03, "seed": 5}})
        out = _run(sw.port, 4, 13, op, repeat=2, multicast=True, elements=2048, slots=32, rto=0.005)
        st = stats(sw.port)
    finally:
        sw.terminate()
    ref = bfp_reference([make_input(op, r) for r in range(4)])
    for x, mc, _ in out:
        np.testing.assert_array_equal(x, ref)
        assert mc is True
    c = st["counters"]
    assert c["multicast_results"] > 0 and c["multicast_as_copies"] > 0 and c["replays"] > 0


NETNS_SCRIPT = textwrap.dedent("""
    import logging, sys
    sys.path.insert(0, {tests!r})
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
    import numpy as np
    from sw_harness import SwitchProc, bfp_reference, client_threads, make_input, stats
    from pathlib import Path
    op = {{"shape": [50_000], "seed": 24}}
    sw = SwitchProc(log_path=Path({log!r}))
    try:
        def body(r, cl):
            x = make_input(op, r)
            cl.allreduce(x, codec="bfp32")
            return x, cl.multicast
        out = client_threads(sw.port, 3, 14, body, multicast=True)
        st = stats(sw.port)
    finally:
        sw.terminate()
    ref = bfp_reference([make_input(op, r) for r in range(3)])
    for x, mc in out:
        np.testing.assert_array_equal(x, ref)
        assert mc is False
    assert st["counters"]["multicast_results"] == 0 < st["counters"]["harvested"]
    print("EXACT")
""")


def _in_scratch_netns(setup: str, script: str) -> subprocess.CompletedProcess:
    """Run ``setup`` (shell) then ``script`` (Python) in a network namespace of its own (gone with it)."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("tc"):
        pytest.skip("needs root, unshare and tc for a scratch network namespace")
    cmd = f"ip link set lo up && {setup} && exec {sys.executable} -c \"$0\""
    return subprocess.run(["unshare", "-n", "sh", "-c", cmd, script], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_where_lo_drops_multicast_results_come_as_unicast_and_the_log_says_why(tmp_path):
    """In a scratch network namespace whose lo lacks the MULTICAST flag and drops multicast (tc: a queue
    of no room for 224.0.0.0/4):
    the workers' datagram to their own group does not come back, so they join nothing and log why (the
    flag named); the switch sends unicast copies and the sums are exact."""
    drop = ("tc qdisc add dev lo root handle 1: htb default 10 && "       # lo: unicast as is, multicast into
            "tc class add dev lo parent 1: classid 1:10 htb rate 100gbit && "    # a queue of no room
            "tc class add dev lo parent 1: classid 1:20 htb rate 100gbit && "
            "tc qdisc add dev lo parent 1:20 handle 20: pfifo limit 0 && "
            "tc filter add dev lo parent 1: protocol ip prio 1 u32 match ip dst 224.0.0.0/4 flowid 1:20")
    script = NETNS_SCRIPT.format(tests=str(Path(__file__).resolve().parent), log=str(tmp_path / "switch.log"))
    p = _in_scratch_netns(drop, script)
    assert p.returncode == 0 and "EXACT" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    assert "results as unicast: a datagram to group 239." in p.stdout, p.stdout[-3000:]
    assert "did not come back on lo" in p.stdout and "lacks the MULTICAST flag" in p.stdout
    assert "unicast: rank(s) [0, 1, 2] did not join" in (tmp_path / "switch.log").read_text()
