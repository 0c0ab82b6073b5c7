"""The switch's shard count (--cores N | auto) and its poll loop's burst bookkeeping with real sockets."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sw_harness import PY, ROOT, SwitchProc, client_threads  # noqa: E402

from ina import burst as B  # noqa: E402
from ina.wire import MsgType, PayloadType, max_packet_size, pack, unpack  # noqa: E402
from switch_model.shards import auto_shards, available_cpus, parse_cores  # noqa: E402


@pytest.mark.parametrize("cpus, shards", [(1, 1), (2, 1), (3, 1), (4, 1), (7, 1), (8, 2), (12, 3), (16, 4),
                                          (64, 4)])
def test_auto_shards_follows_the_stated_rule(cpus, shards):
    """auto: one shard below 8 CPUs (measured on 2: a second shard costs CPU and saves no time),
    then one per 4 CPUs, at most 4."""
    assert auto_shards(cpus) == shards
    assert parse_cores("auto", cpus) == shards == parse_cores(" AUTO ", cpus)


@pytest.mark.parametrize("value, error", [("0", ">= 1"), ("-2", ">= 1"), ("two", "shard count or 'auto'")])
def test_bad_cores_values_are_refused_by_name(value, error):
    with pytest.raises(ValueError, match=error):
        parse_cores(value)
    r = subprocess.run([PY, "-m", "switch_model", "serve", "--port", "0", "--cores", value], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--cores" in r.stderr and error in r.stderr, r.stderr


def test_serve_defaults_to_the_auto_rule_of_this_machine(tmp_path):
    """Without --cores the service runs auto_shards(the CPUs it may use) shards, and logs the rule's choice."""
    want = auto_shards(available_cpus())
    sw = SwitchProc(log_path=tmp_path / "switch.log")
    try:
        st = sw.stats()
        assert st["config"].get("shards", 1) == want
        assert f"--cores auto: {want} shard(s) on {available_cpus()} available CPUs" in sw.log()
    finally:
        assert sw.terminate() == 0, sw.log()


def test_poll_loop_groups_each_workers_results_and_counts_the_burst():
    """One poll of a burst from three real worker sockets (chunks interleaved by rank): every
    packet is accepted (the source addresses the rx stage derives match the joined ones), the rx
    counters count it, and each worker receives every result in chunk order with the exact sums,
    as one GSO message per worker where the kernel has UDP GSO."""
    from switch_model.pipeline import Switch, SwitchConfig
    workers, slots, E, chunks = 3, 8, 64, 5
    sw = Switch(SwitchConfig(host="127.0.0.1", port=0, slots=slots, elements=E, burst=64))
    socks = [B.udp_socket("127.0.0.1", 0) for _ in range(workers)]
    try:
        sw.install_job(5, workers, slots, E, True, [s.getsockname() for s in socks])
        rng = np.random.default_rng(3)
        vals = rng.integers(-2**20, 2**20, (chunks, workers, E)).astype(np.int32)
        sent = 0
        for c in range(chunks):
            for r in range(workers):
                p = pack(msg_type=MsgType.DATA, job=5, rank=r, pool_index=c % slots, shadow=(c // slots) & 1,
                         payload_type=PayloadType.INT32, count=E, chunk=c, payload=vals[c, r], elements=E)
                socks[r].sendto(p, ("127.0.0.1", sw.port))
                sent += len(p)
        n = 0
        while n < chunks * workers:
            k = sw.poll_once()
            assert k, f"the switch received {n} of {chunks * workers} packets"
            n += k
        st = sw.stats()
        assert st["counters"]["parsed_ok"] == st["counters"]["rx_packets"] == chunks * workers, st["drops"]
        assert st["counters"]["rx_bytes"] == sent and st["counters"]["harvested"] == chunks
        if sw.txq.gso:
            assert st["counters"]["tx_messages"] == workers          # one message per worker
        want = vals.astype(np.int64).sum(axis=1)
        for r, s in enumerate(socks):
            s.settimeout(5)
            got = [unpack(s.recv(max_packet_size(E))) for _ in range(chunks)]
            assert [g.chunk for g in got] == list(range(chunks))
            for g in got:
                assert g.msg_type == MsgType.RESULT and g.job == 5
                assert (g.pool_index, g.shadow) == (g.chunk % slots, (g.chunk // slots) & 1)
                assert np.array_equal(np.asarray(g.payload, np.int64)[:E], want[g.chunk]), (r, g.chunk)
    finally:
        sw.sock.close()
        for s in socks:
            s.close()



def test_replays_carry_the_replay_flag_and_leave_the_stored_result_unflagged():
    """A retransmission to a completed slot is answered with the stored result flagged REPLAY, in
    the same burst as another slot's multicast (which is not flagged); the stored row stays
    unflagged, so a later replay and the next round's result are right too."""
    from ina.wire import OFFSET, Flag
    from switch_model.pipeline import Switch, SwitchConfig
    workers, slots, E = 2, 4, 32
    sw = Switch(SwitchConfig(host="127.0.0.1", port=0, slots=slots, elements=E, burst=64))
    socks = [B.udp_socket("127.0.0.1", 0) for _ in range(workers)]
    vals = np.arange(2 * workers * E, dtype=np.int32).reshape(2, workers, E) - 40

    def send(r, c, flags=0):
        socks[r].sendto(pack(msg_type=MsgType.DATA, job=6, rank=r, pool_index=c % slots, shadow=(c // slots) & 1,
                             payload_type=PayloadType.INT32, count=E, chunk=c, payload=vals[c, r], elements=E,
                             flags=flags), ("127.0.0.1", sw.port))

    def poll(n):
        got = 0
        while got < n:
            k = sw.poll_once()
            assert k, f"the switch received {got} of {n} packets"
            got += k

    def recv(r):
        socks[r].settimeout(5)
        return unpack(socks[r].recv(max_packet_size(E)))

    try:
        sw.install_job(6, workers, slots, E, True, [s.getsockname() for s in socks])
        send(0, 0)
        send(1, 0)
        poll(2)
        first = [recv(r) for r in range(workers)]
        assert all(not p.flags & Flag.REPLAY for p in first)
        send(0, 0, Flag.RETRANSMIT)           # a replay and the next chunk's completion in one burst
        send(0, 1)
        send(1, 1)
        poll(3)
        got0 = sorted((recv(0) for _ in range(2)), key=lambda p: p.chunk)
        got1 = recv(1)
        assert [p.chunk for p in got0] == [0, 1] and got1.chunk == 1
        assert got0[0].flags & Flag.REPLAY and not got0[1].flags & Flag.REPLAY and not got1.flags & Flag.REPLAY
        want = vals.astype(np.int64).sum(axis=1)
        assert np.array_equal(np.asarray(got0[0].payload, np.int64)[:E], want[0])
        assert np.array_equal(np.asarray(got1.payload, np.int64)[:E], want[1])
        send(1, 0, Flag.RETRANSMIT)           # the stored row was left unflagged: flagged again only for this send
        poll(1)
        again = recv(1)
        assert again.chunk == 0 and again.flags & Flag.REPLAY
        assert np.array_equal(np.asarray(again.payload, np.int64)[:E], want[0])
        stored = sw.state.results[:, OFFSET["flags"]: OFFSET["flags"] + 2].view(">u2")[:, 0]
        assert not (stored & int(Flag.REPLAY)).any()
        assert sw.stats()["counters"]["replays"] == 2
    finally:
        sw.sock.close()
        for s in socks:
            s.close()


def test_nc_and_bfp32_results_are_bit_identical_with_one_and_two_shards(tmp_path):
    """The same allreduces (nc's stochastic re-encoding included: its random numbers depend on the
    job, the chunk and the switch's seed, not on the shard) give the same bits through a switch of
    one shard and one of two."""
    rng = np.random.default_rng(11)
    world, n = 3, 256 * 13 + 7                     # 14 chunks: both shards serve several
    inputs = rng.standard_normal((world, n)).astype(np.float32)

    def body(r, cl):
        out = []
        for codec in ("nc", "bfp32", "nc"):
            x = inputs[r].copy()
            cl.allreduce(x, codec=codec)
            out.append(x)
        return out

    got = {}
    for cores in ("1", "2"):
        sw = SwitchProc("--slots", "32", "--elements", "256", "--cores", cores, log_path=tmp_path / f"sw{cores}.log")
        try:
            got[cores] = client_threads(sw.port, world, 41, body, elements=256, slots=8, timeout=60,
                                        rank_options=lambda r: {"seed": 100 + r})   # the codecs' random numbers
            assert sw.stats()["config"].get("shards", 1) == int(cores)
        finally:
            assert sw.terminate() == 0, sw.log()
    for r in range(world):
        for a, b in zip(got["1"][r], got["2"][r]):
            assert a.tobytes() == b.tobytes(), r
    assert not np.array_equal(got["1"][0][0], inputs[0])       # something was summed


def test_stats_and_a_run_time_impair_report_every_shards_impairments(tmp_path):
    """--cores 2 with impairments: the stats give each direction's settings once, every shard's seed
    (seed + SHARD_SEED_STEP x shard, as the start-up line says) and the drops of both shards summed; an
    impair at run time that sets a seed changes every shard (each its own seed, as at start-up), and its
    reply and the stats say so, shard by shard too."""
    from sw_harness import control
    from switch_model.shards import SHARD_SEED_STEP
    sw = SwitchProc("--slots", "64", "--elements", "128", "--cores", "2", "--seed", "5", "--egress-loss", "0.01",
                    log_path=tmp_path / "switch.log")
    try:
        assert f"egress loss 0.01 (seeds 6 + {SHARD_SEED_STEP} x shard, shards 0..1)" in sw.log()   # start-up line
        imp = sw.stats()["impairments"]
        assert imp["ingress"]["shard_seeds"] == [5, 5 + SHARD_SEED_STEP] and imp["ingress"]["loss"] == 0
        assert imp["egress"]["shard_seeds"] == [6, 6 + SHARD_SEED_STEP] and imp["egress"]["loss"] == 0.01
        reply = control(sw.port, {"op": "impair", "ingress": {"loss": 0.1, "seed": 9}, "egress": {"loss": 0.02}})
        assert reply["impairments"]["ingress"]["shard_seeds"] == [9, 9 + SHARD_SEED_STEP]
        assert reply["impairments"]["egress"]["shard_seeds"] == [6, 6 + SHARD_SEED_STEP]     # no seed: kept
        rng = np.random.default_rng(3)
        xs = [rng.standard_normal(128 * 120).astype(np.float32) for _ in range(2)]     # 120 chunks: both shards

        def body(r, cl):
            y = xs[r].copy()
            cl.allreduce(y, codec="bfp32")
            return y
        client_threads(sw.port, 2, 79, body, elements=128, slots=16, timeout=60.0)
        st = sw.stats()
        for d, loss, seed in (("ingress", 0.1, 9), ("egress", 0.02, 6)):
            merged, each = st["impairments"][d], [sh["impairments"][d] for sh in st["per_shard"]]
            assert merged["loss"] == loss and "per_shard" not in merged, merged    # the shards agree
            assert [e["loss"] for e in each] == [loss, loss]
            assert merged["shard_seeds"] == [e["seed"] for e in each] == [seed, seed + SHARD_SEED_STEP]
            assert merged["dropped"] == sum(e["dropped"] for e in each), (d, merged, each)
        assert all(e["impairments"]["ingress"]["dropped"] > 0 for e in st["per_shard"]), st["per_shard"]
    finally:
        assert sw.terminate() == 0, sw.log()


def test_the_stats_give_the_cpu_of_every_process_of_the_switch(tmp_path):
    """The switch's stats give the CPU of its processes, every thread (control plane included), summed over
    the shards (``timing.process_cpu_ns``, each shard's in ``per_shard``) and the host aggregator's apart:
    over an allreduce they grow by at least the data planes' busy CPU (the sweep's CPU floor takes the
    larger: experiments/sweep_cpu.py)."""
    sw = SwitchProc("--slots", "64", "--elements", "128", "--cores", "2", log_path=tmp_path / "switch.log")
    try:
        st0 = sw.stats()
        xs = [np.full(128 * 60, r + 1, np.float32) for r in range(2)]     # 60 chunks: both shards

        def body(r, cl):
            for _ in range(3):
                cl.allreduce(xs[r].copy(), codec="bfp32")
        client_threads(sw.port, 2, 80, body, elements=128, slots=16, timeout=60.0)
        st1 = sw.stats()
        for st in (st0, st1):
            each = [sh["process_cpu_ns"] for sh in st["per_shard"]]
            assert st["timing"]["process_cpu_ns"] == sum(each) and all(c > 0 for c in each), (st["timing"], each)
            assert st["host_aggregator"]["process_cpu_ns"] > 0
        procs, busy = (st1["timing"][k] - st0["timing"][k] for k in ("process_cpu_ns", "busy_cpu_ns"))
        assert procs >= busy > 0, (procs, busy)
    finally:
        assert sw.terminate() == 0, sw.log()
