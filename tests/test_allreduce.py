"""End-to-end allreduce through the software switch: real worker processes, real UDP on loopback.

The switch runs as ``python -m switch_model serve`` (a subprocess on a free port); each worker is
its own process (tests/sw_worker.py) with an ``ina.Client``. Block floating point must be
bit-identical to an independent numpy reference of the same integer arithmetic
(sw_harness.bfp_reference); natural compression must be an unbiased estimate of the true sum.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sw_harness import (PY, ROOT, SwitchProc, Workers, bfp_reference, cast_like, expected_inputs,  # noqa: E402
                        wait_until)

CLIENT = {"elements": 128, "slots": 8, "timeout": 20.0}


@pytest.fixture(scope="module")
def switch(tmp_path_factory):
    sw = SwitchProc("--slots", "128", "--elements", "256", log_path=tmp_path_factory.mktemp("sw") / "switch.log")
    yield sw
    rc = sw.terminate()
    assert rc == 0, sw.log()


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def check_bfp(ops, out, n):
    """Every rank's result of every op is bit-identical to the numpy reference."""
    for r, meta in out.items():
        assert len(meta["results"]) == len(ops), f"rank {r}: {len(meta['results'])} results for {len(ops)} ops"
        for i, op in enumerate(ops):
            ref = cast_like(bfp_reference(expected_inputs(op, n), bool(op.get("average"))), op.get("dtype", "float32"))
            got = meta["results"][i]
            assert got.shape == ref.shape, f"op {i} {op}: shape {got.shape} != {ref.shape}"
            diff = np.count_nonzero(bits(got) != bits(ref))
            assert diff == 0, (f"rank {r} op {i} {op}: {diff} of {ref.size} elements differ from the numpy reference; "
                               f"max abs diff {np.max(np.abs(got.astype(np.float64) - ref)):.3g}")


# chunk = 128 elements, window = 8 slots: sizes below, at and above one chunk and one window
BROAD_OPS = [
    {"shape": [1000], "seed": 1},                                            # 7 chunks + 104
    {"shape": [37, 53], "seed": 2, "kind": "torch"},                         # 1961: 16 chunks, wraps the window
    {"shape": [3, 5, 7], "seed": 3, "kind": "torch", "dtype": "float64"},
    {"shape": [], "seed": 4},                                                # 0-d array
    {"shape": [1], "seed": 5, "kind": "torch"},
    {"shape": [384], "seed": 6},                                             # exactly 3 chunks
    {"shape": [2, 1, 129], "seed": 7, "dtype": "float64"},
    {"shape": [500], "seed": 8, "average": True, "kind": "torch"},
    {"shape": [300], "seed": 9, "dist": "zero"},
    {"shape": [64, 10], "seed": 10, "kind": "torch", "dtype": "float16"},
    {"shape": [257], "seed": 11, "kind": "torch", "dtype": "bfloat16", "average": True},
    {"shape": [33, 31], "seed": 12, "kind": "torch", "transpose": True},     # non-contiguous tensor
    {"shape": [700], "seed": 13, "dist": "big", "average": True},
    {"shape": [700], "seed": 14, "dist": "tiny"},
    {"shape": [5000], "seed": 15},                                           # 40 chunks: 5 windows, both shadow sets
]
SMALL_OPS = [
    {"shape": [1000], "seed": 21},
    {"shape": [17, 19], "seed": 22, "kind": "torch", "average": True},
    {"shape": [4096], "seed": 23, "kind": "torch", "dtype": "float64"},
]


@pytest.mark.parametrize("n,ops", [(2, BROAD_OPS), (4, SMALL_OPS + BROAD_OPS[:4]), (8, SMALL_OPS)],
                         ids=["2workers", "4workers", "8workers"])
def test_bfp32_bit_identical_to_numpy_reference(switch, tmp_path, n, ops):
    ops = [{"codec": "bfp32", **op} for op in ops]
    out = Workers(tmp_path, switch.port, n, job=100 + n, ops=ops, client=CLIENT).wait(timeout=90)
    check_bfp(ops, out, n)
    # nothing imported between a rank's join and its first result (no module loaded by the first
    # allreduce, no import of the worker's): a rank busy importing keeps its peers' first round waiting.
    # numba's own submodules are the exception: it loads them when it first compiles a codec kernel (in a
    # fresh checkout its on-disk cache is empty until the first call)
    late = {r: sorted({name.split(".")[0] for name in m["imported_after_join"]} - {"numba"}) for r, m in out.items()}
    assert not any(late.values()), f"packages imported between the join and the first result, by rank: {late}"
    # every rank read back the same multicast results
    for i in range(len(ops)):
        assert all(np.array_equal(bits(out[0]["results"][i]), bits(out[r]["results"][i])) for r in out)


def test_reference_detects_a_wrong_result():
    """The comparison above can fail: one code step off in one element is a bit difference."""
    op = {"shape": [1000], "seed": 1}
    xs = expected_inputs(op, 2)
    ref = bfp_reference(xs)
    wrong = ref.copy()
    wrong[17] = np.nextafter(wrong[17], np.float32(np.inf))
    assert np.count_nonzero(bits(wrong) != bits(ref)) == 1
    # and the reference is not trivially the float sum: it carries block floating point's rounding
    exact = xs[0].astype(np.float64) + xs[1]
    assert not np.array_equal(bits(ref), bits(exact.astype(np.float32)))
    step = 2 * 2.0 ** max(np.frexp(np.abs(x).max())[1] for x in xs) / (2**31 - 1)    # one code step
    assert np.all(np.abs(ref - exact) <= 2 * step / 2 + np.spacing(np.abs(ref)))


# ------------------------------------------------------------------------------------------------
# natural compression: unbiased estimates of the sum
# ------------------------------------------------------------------------------------------------
def mean_error_in_standard_errors(results, exact) -> tuple[float, float]:
    """Mean relative error of the results over all elements and repetitions, in standard errors."""
    z = np.concatenate([(r.astype(np.float64).reshape(-1) - exact) / np.abs(exact) for r in results])
    se = z.std(ddof=1) / np.sqrt(z.size)
    return float(z.mean() / se) if se > 0 else float("inf") * np.sign(z.mean()), float(z.mean())


@pytest.mark.parametrize("n,raw,reps", [(4, False, 8), (2, True, 8), (8, False, 3)],
                         ids=["4workers-reencoded-sums", "2workers-raw-sums", "8workers-reencoded-sums"])
def test_natural_compression_is_unbiased(switch, tmp_path, n, raw, reps):
    """nc: mean relative error over repetitions x 20,000 elements within 4 standard errors of 0.
    nc-det (deterministic rounding) on a constant 0.7 is biased and the same statistic flags it.
    Fixed seeds (workers' codecs, the switch's re-encoding): the test is deterministic."""
    ops = [{"codec": "nc", "shape": [20000], "seed": 31, "dist": "uniform"},
           {"codec": "nc", "shape": [5000], "seed": 32, "dist": "const07"},
           {"codec": "nc-det", "shape": [5000], "seed": 32, "dist": "const07"}]
    out = Workers(tmp_path, switch.port, n, job=200 + n, ops=ops, client={**CLIENT, "raw": raw, "seed": 7},
                  loop=reps).wait(timeout=90)
    res = out[0]["results"]
    assert len(res) == reps * len(ops)
    for r in out:   # the switch multicast one result per chunk: every rank decoded the same sums
        assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(res, out[r]["results"]))
    for k, op in enumerate(ops):
        exact = np.sum([x.astype(np.float64).reshape(-1) for x in expected_inputs(op, n)], axis=0)
        runs = res[k::len(ops)]
        t, mean = mean_error_in_standard_errors(runs, exact)
        if op["codec"] == "nc":
            assert abs(t) < 4, f"{op}: mean relative error {mean:.2e} is {t:.1f} standard errors from 0"
            # an estimate, not the exact sum: the stochastic rounding is really there
            assert not np.array_equal(runs[0].astype(np.float64), exact)
            assert not np.array_equal(bits(runs[0]), bits(runs[1]))
        else:
            assert abs(t) > 4, f"{op}: the statistic should flag deterministic rounding as biased (t={t:.1f})"


def test_single_worker_natural_compression_uses_the_top_code(switch):
    """One worker: the exponent window is 63 binades on 64-bit registers, so values just below
    2**(e+1) round up to code 63 = 2**62 register units, which the switch must add as +2**62."""
    from ina import Client
    with Client(("127.0.0.1", switch.port), rank=0, world_size=1, job=210, elements=128, slots=8, timeout=20,
                seed=3) as c:
        runs = []
        for _ in range(4):
            x = np.full(4000, 0.99, np.float32)
            c.allreduce(x, codec="nc")
            runs.append(x.copy())
    vals = np.concatenate(runs)
    assert set(np.unique(vals)) <= {np.float32(0.5), np.float32(1.0)}, np.unique(vals)   # never negative
    t, mean = mean_error_in_standard_errors(runs, np.full(4000, np.float64(np.float32(0.99))))
    assert abs(t) < 4 and np.count_nonzero(vals == 1.0) > 0.9 * vals.size, (t, mean)


# ------------------------------------------------------------------------------------------------
# two jobs on one switch at once
# ------------------------------------------------------------------------------------------------
def test_two_concurrent_jobs_use_disjoint_slots(switch, tmp_path):
    """Job A streams allreduces for as long as job B runs; both are exact, their slots disjoint."""
    ops_a = [{"codec": "bfp32", "shape": [3000], "seed": 40 + i} for i in range(10)]
    ops_b = [{"codec": "bfp32", "shape": [29, 71], "seed": 60 + i, "kind": "torch"} for i in range(10)]
    go, stop_a = str(tmp_path / "go"), tmp_path / "stop-A"
    a = Workers(tmp_path, switch.port, 2, job=300, ops=ops_a, client=CLIENT, loop=0, name="A", start_file=go,
                stop_file=str(stop_a))
    b = Workers(tmp_path, switch.port, 3, job=301, ops=ops_b, client={**CLIENT, "slots": 5}, loop=3, name="B",
                start_file=go)
    try:
        wait_until(lambda: a.joined() and b.joined(), 60, "both jobs' workers to join")
    finally:
        open(go, "w").close()
    try:
        out_b = b.wait(timeout=90)
    finally:
        stop_a.touch()
    out_a = a.wait(timeout=90)
    ja, jb = out_a[0]["job_info"], out_b[0]["job_info"]
    ra = set(range(ja["slot_lo"], ja["slot_lo"] + ja["slots"]))
    rb = set(range(jb["slot_lo"], jb["slot_lo"] + jb["slots"]))
    assert len(ra) == 8 and len(rb) == 5 and not ra & rb, (ja, jb)
    # they ran at the same time: A completed allreduces while B was between its first and last
    ta = [float(ln.split()[1]) for ln in (tmp_path / "A-rank0.progress").read_text().splitlines()]
    tb = [float(ln.split()[1]) for ln in (tmp_path / "B-rank0.progress").read_text().splitlines()]
    assert sum(tb[0] < t < tb[-1] for t in ta) >= 3, "the two jobs did not overlap in time"
    # both are exact
    n_a = len(out_a[0]["results"])
    check_bfp([ops_a[i % len(ops_a)] for i in range(n_a)], out_a, 2)
    check_bfp(ops_b * 3, out_b, 3)
    st = switch.stats()
    assert "300" not in st["jobs"] and "301" not in st["jobs"]     # both left: slots freed


# ------------------------------------------------------------------------------------------------
# loss, duplication, reordering
# ------------------------------------------------------------------------------------------------
def test_100_allreduces_under_loss_duplication_reordering_are_exact(tmp_path):
    """5% loss and 1% duplication in each direction plus reordering: 100 consecutive bfp32
    allreduces complete and equal, bit for bit, the same allreduces without impairments."""
    sw = SwitchProc("--slots", "32", "--elements", "64", "--loss", "0.05", "--duplicate", "0.01",
                    "--reorder", "0.05", "--seed", "11", log_path=tmp_path / "switch.log")
    try:
        imp = sw.stats()["impairments"]
        assert imp["ingress"]["loss"] == 0.05 and imp["egress"]["duplicate"] == 0.01
        ops = [{"codec": "bfp32", "shape": [150 + 7 * i], "seed": 500 + i} for i in range(100)]
        client = {"elements": 64, "slots": 4, "timeout": 20.0, "rto": 0.01, "max_rto": 0.1}
        lossy = Workers(tmp_path, sw.port, 3, job=7, ops=ops, client=client, name="lossy").wait(timeout=120)
        st = sw.stats()
        for d in ("ingress", "egress"):
            c = st["impairments"][d]
            assert c["dropped"] > 0 and c["reordered"] > 0, (d, c)
        assert st["impairments"]["ingress"]["duplicated"] + st["impairments"]["egress"]["duplicated"] > 0
        assert sum(m["stats"]["retransmissions"] for m in lossy.values()) > 0    # loss recovery ran
        # switch the impairments off at run time with the CLI, then the same allreduces loss-free
        r = subprocess.run([PY, "-m", "switch_model", "impair", "--port", str(sw.port), "--loss", "0",
                            "--duplicate", "0", "--reorder", "0"], cwd=ROOT, capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr
        now = json.loads(r.stdout)
        assert now["ingress"]["loss"] == 0 and now["egress"]["reorder"] == 0
        clean = Workers(tmp_path, sw.port, 3, job=8, ops=ops, client=client, name="clean").wait(timeout=120)
        after = sw.stats()["impairments"]
        for d in ("ingress", "egress"):   # nothing was dropped, duplicated or held back this time
            for k in ("dropped", "duplicated", "reordered"):
                assert after[d][k] == st["impairments"][d][k], (d, k)
        for i in range(len(ops)):
            for r in range(3):
                assert np.array_equal(bits(lossy[r]["results"][i]), bits(clean[r]["results"][i])), (i, r)
        check_bfp(ops, clean, 3)
    finally:
        sw.terminate()


# ------------------------------------------------------------------------------------------------
# a worker dies or hangs
# ------------------------------------------------------------------------------------------------
def _wait_progress(w: Workers, ranks, k: int, timeout: float = 60.0):
    wait_until(lambda: all(w.progress(r) >= k for r in ranks), timeout,
               f"ranks {list(ranks)} of {w.name} to complete {k} allreduces")


def test_killed_worker_others_raise_slots_freed_next_job_succeeds(switch, tmp_path):
    timeout = 15.0      # a no-progress timeout with room for a loaded machine: the kill is seen well before it
    base = switch.stats()["occupancy"]["slots_allocated"]
    ops = [{"codec": "nc", "shape": [20000], "seed": 70}]
    w = Workers(tmp_path, switch.port, 3, job=400, ops=ops, client={**CLIENT, "timeout": timeout}, loop=0,
                name="victims")
    try:
        _wait_progress(w, range(3), 3)
        assert switch.stats()["occupancy"]["slots_allocated"] == base + 8
        t_kill = time.time()
        w.procs[2].send_signal(signal.SIGKILL)
        out = w.wait(timeout=timeout + 10, check=False)
    finally:
        w.kill()
    assert out[2]["returncode"] == -signal.SIGKILL
    for r in (0, 1):
        m = out[r]
        assert m["error_type"] == "AllreduceError", m
        assert "rank 2" in m["error"], m["error"]
        assert "disconnected without leaving" in m["error"], m["error"]     # a crash, not a clean leave
        assert m["error_at"] - t_kill < timeout, f"rank {r} raised {m['error_at'] - t_kill:.1f} s after the kill"
    wait_until(lambda: switch.stats()["occupancy"]["slots_allocated"] == base, 10, "the switch to free job 400's slots")
    assert "400" not in switch.stats()["jobs"]
    # the next job on the same switch (same job id, too) succeeds
    ops2 = [{"codec": "bfp32", "shape": [2000], "seed": 71}]
    check_bfp(ops2, Workers(tmp_path, switch.port, 2, job=400, ops=ops2, client=CLIENT, name="next").wait(60), 2)


def test_hung_worker_others_raise_within_timeout_naming_it(switch, tmp_path):
    """A worker that stops sending but keeps its control connection (SIGSTOP): the others raise
    after the configured timeout, naming the rank the switch is waiting for."""
    timeout = 10.0      # 2 s timed out before the stop on a loaded machine (ranks not scheduled for 2 s)
    base = switch.stats()["occupancy"]["slots_allocated"]
    ops = [{"codec": "bfp32", "shape": [20000], "seed": 80}]
    w = Workers(tmp_path, switch.port, 3, job=401, ops=ops, client={**CLIENT, "timeout": timeout}, loop=0,
                name="stalled")
    try:
        _wait_progress(w, range(3), 2)
        t_stop = time.time()
        w.procs[1].send_signal(signal.SIGSTOP)
        for r in (0, 2):
            w.procs[r].wait(timeout=timeout + 15)
        out = {r: json.loads((tmp_path / f"stalled-rank{r}.json").read_text()) for r in (0, 2)}
    finally:
        w.procs[1].send_signal(signal.SIGCONT)
        w.kill()
    for r in (0, 2):
        m = out[r]
        assert m["error_type"] == "AllreduceError", m
        assert "waiting for rank(s) [1]" in m["error"], m["error"]
        # bounded: the timeout after the last progress, plus the status query
        assert m["error_at"] - t_stop < timeout + 4.0, m["error_at"] - t_stop
    wait_until(lambda: switch.stats()["occupancy"]["slots_allocated"] == base, 10, "the switch to free job 401's slots")


def test_sharded_switch_cores_2_is_bit_identical_and_uses_both_shards(tmp_path):
    """--cores 2: pool index p is served by the process on port + p % 2; results stay exact."""
    sw = SwitchProc("--slots", "64", "--elements", "256", "--cores", "2", log_path=tmp_path / "switch.log")
    try:
        ops = [{"codec": "bfp32", **op} for op in SMALL_OPS + [BROAD_OPS[-1]]]
        out = Workers(tmp_path, sw.port, 4, job=77, ops=ops, client=CLIENT).wait(timeout=90)
        check_bfp(ops, out, 4)
        st = sw.stats()
        assert st["config"]["shards"] == 2 and st["config"]["ports"] == [sw.port, sw.port + 1]
        per_shard = [sh["harvested"] for sh in st["per_shard"]]
        assert len(per_shard) == 2 and all(h > 0 for h in per_shard), per_shard   # both shards aggregated
        assert sum(per_shard) == st["counters"]["harvested"]
        tm = st["timing"]               # the shards' stage clocks add up, stage by stage and in total
        assert sum(tm["stage_ns"].values()) == tm["busy_ns"] == sum(sh["busy_ns"] for sh in st["per_shard"])
    finally:
        assert sw.terminate() == 0, sw.log()


def test_sharded_switch_rounds_nc_sums_as_one_switch_does(tmp_path):
    """The switch's stochastic re-encoding of nc sums draws from (--seed, job, chunk id, element):
    a round's chunk id is served by one shard only, so shards sharing --seed never share draws, and
    --cores 2 gives bit for bit the sums of --cores 1 (no per-shard seed, which would break that)."""
    from sw_harness import client_threads
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal(40 * 128 + 7).astype(np.float32) for _ in range(2)]   # 41 chunks, both shards

    def body(r, cl):
        y = xs[r].copy()
        cl.allreduce(y, codec="nc")
        return y

    out = {}
    for cores in ("1", "2"):
        sw = SwitchProc("--slots", "64", "--elements", "256", "--cores", cores, "--seed", "3",
                        log_path=tmp_path / f"switch{cores}.log")
        try:
            out[cores] = client_threads(sw.port, 2, 78, body, elements=128, slots=8, timeout=20.0, seed=4)
            assert all(sh["harvested"] > 0 for sh in sw.stats().get("per_shard", [{"harvested": 1}]))
        finally:
            assert sw.terminate() == 0, sw.log()
    for r in range(2):
        np.testing.assert_array_equal(bits(out["2"][r]), bits(out["1"][r]))
    exact = xs[0].astype(np.float64) + xs[1]
    assert np.linalg.norm(out["2"][0] - exact) / np.linalg.norm(exact) < 0.5      # an estimate of the sum


# ------------------------------------------------------------------------------------------------
# where the time goes: the switch's stage clock and the client's timeline
# ------------------------------------------------------------------------------------------------
def test_stage_times_add_up_to_the_busy_time_and_the_timeline_is_ordered(switch):
    """The switch's per-stage nanoseconds partition its busy time exactly; the burst-size histogram
    accounts for every burst and (within its buckets' bounds) every received packet; a recorded
    client timeline has every mark, in the order the allreduce passes them."""
    import threading

    from ina import Client
    from ina.timeline import MARKS
    before = switch.stats()["timing"]
    n, size = 2, 128 * 8 * 3 + 5                       # three windows and a partial chunk
    clients = [None] * n

    def one(r):
        clients[r] = Client(("127.0.0.1", switch.port), rank=r, world_size=n, job=230, elements=128, slots=8,
                            timeout=20, timeline=True)
        for _ in range(3):
            clients[r].allreduce(np.full(size, 0.5, np.float32), codec="bfp32")

    ts = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert all(c is not None and c.last_timeline for c in clients), "an allreduce did not finish"
    for c in clients:
        c.close()
    st = switch.stats()
    tm = st["timing"]
    assert sum(tm["stage_ns"].values()) == tm["busy_ns"]
    assert list(tm["stage_ns"]) == st["stages"]
    assert tm["busy_ns"] > before["busy_ns"] and tm["stage_ns"]["aggregate"] > before["stage_ns"]["aggregate"]
    assert sum(tm["burst_sizes"].values()) == tm["bursts"] > before["bursts"]
    lo = sum(int(k.split("-")[0]) * v for k, v in tm["burst_sizes"].items())
    hi = sum(int(k.split("-")[-1]) * v for k, v in tm["burst_sizes"].items())
    assert lo <= st["counters"]["rx_packets"] <= hi, (tm["burst_sizes"], st["counters"]["rx_packets"])
    assert (tm["busy_ns"] + tm["wait_ns"]) / 1e9 <= st["uptime_s"] + 0.1
    spent = tm["busy_ns"] - before["busy_ns"] + tm["wait_ns"] - before["wait_ns"]
    assert 0 < tm["busy_cpu_ns"] - before["busy_cpu_ns"] <= spent
    for c in clients:
        tl = c.last_timeline
        times = [tl[m] for m in MARKS]                  # every mark present
        assert times == sorted(times), tl
        assert tl["results"] == 25 and 1 <= tl["rx_bursts"] <= 25, tl    # 25 chunks of 128 elements
        assert 0 < tl["encode_s"] + tl["decode_s"] < tl["done"], tl


# ------------------------------------------------------------------------------------------------
# the first window, encoded while the exponent negotiation is out
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec,cut", [("nc", None), ("nc", 1), ("bfp32", None)],
                         ids=["nc", "nc-maxima-back-after-one-piece", "bfp32"])
@pytest.mark.parametrize("held", [True, False], ids=["guess-held", "guess-wrong"])
def test_first_window_encoded_while_negotiating_gives_the_agreed_codes(codec, cut, held, monkeypatch):
    """A stream's packets carry the same bytes with a first window encoded under the worker's guess as
    without one: the guess (its own exponent) is used only if it is the agreed exponent, and then
    the window's codes are not encoded again; a wrong guess is encoded again under the agreed
    one. ``cut``: the maxima come back after that many pieces (the rest of the window is encoded
    when it is sent)."""
    from ina import compression
    from ina.chunk_encoding import BlockEncoder, FirstWindow, RowEncoder, encode_block_fn
    from ina.compression.base import ScaleContext
    from ina.wire import HEADER_SIZE, packet_size, payload_view
    c, E, S = compression.get(codec), 128, 4
    monkeypatch.setattr(FirstWindow, "PIECE_ELEMENTS", 2 * E)                         # pieces of 2 chunks
    x = np.random.default_rng(5).standard_normal(10 * E + 50).astype(np.float32)     # 11 chunks, window 4
    own = c.scale_exponent(x)
    guess = ScaleContext(own, 4, 64, seed=9, elements=E)
    agreed = ScaleContext(own if held else own + 2, 4, 64, seed=9, elements=E)
    ptype = c.uplink_type(agreed)
    loads = [np.arange(S), np.array([5, 4]), np.array([6, 7, 8, 9]), np.array([10])]   # as results free slots

    marked = 1            # bytes at the end of chunk 0's payload that the mark below flips

    def stream(with_first):
        nonlocal marked
        ring = np.zeros((2 * S, packet_size(ptype, E)), np.uint8)
        fw = FirstWindow(c, x, guess, E, S, ring[:S] if c.encodes_rows else None) if with_first else None
        use = False
        if fw:
            looks = []
            fw.encode(None if cut is None else lambda: looks.append(1) or len(looks) >= cut)
            assert fw.ready == (S if cut is None else 2 * cut) if c.encodes_rows else fw.ready == 0
            use = fw.take(agreed)
            assert use == held
            # a mark: the window's codes are sent as they are, not encoded again
            if use and c.encodes_rows:
                ring[0, -1] ^= 0xFF
            elif use:
                fw.codes[0, -1] = ~fw.codes[0, -1]
                marked = fw.codes.dtype.itemsize
        if c.encodes_rows:
            enc = RowEncoder(c, x, agreed, E, ready=fw.ready if use else 0)
        else:
            enc = BlockEncoder(encode_block_fn(c, x, agreed, {}, E, S), S, fw.codes if use else None)
        out = []
        for chunks in loads:
            rows = chunks % (2 * S)
            enc.load(ring, payload_view(ring, ptype, E), rows, chunks)
            out.append(ring[rows, HEADER_SIZE:].copy())
        return out

    want, got = stream(False), stream(True)
    if held:
        np.testing.assert_array_equal(got[0][0, -marked:], want[0][0, -marked:] ^ 0xFF)
        got[0][0, -marked:] ^= 0xFF
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)


def test_first_window_guess_held_and_wrong_end_to_end(switch):
    """Through the switch: ranks whose exponents agree use the window encoded while negotiating, a rank
    with a smaller exponent encodes it again; bfp32 stays bit-identical to the reference either way and
    every rank reads the same nc sums."""
    from sw_harness import client_threads
    rng = np.random.default_rng(8)
    base = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
    cases = {"agree": [base[0] * 0.9, base[1]], "rank0-smaller": [base[0] / 8, base[1]]}

    def body(r, cl):
        out = {}
        for name, xs in cases.items():
            for codec in ("bfp32", "nc", "thc"):
                c = cl.codec(codec)
                before = getattr(c, "coordinates", 0)
                y = xs[r].copy()
                cl.allreduce(y, codec=codec)
                out[name, codec] = (y, cl.last_timeline["guess_held"], getattr(c, "coordinates", 0) - before)
        return out

    res = client_threads(switch.port, 2, 240, body, elements=128, slots=8, timeout=20.0, timeline=True, seed=4)
    for name, xs in cases.items():
        assert max(np.frexp(np.abs(x).max())[1] for x in xs) == np.frexp(np.abs(xs[1]).max())[1]
        agree = np.frexp(np.abs(xs[0]).max())[1] == np.frexp(np.abs(xs[1]).max())[1]
        assert agree == (name == "agree")
        for codec in ("bfp32", "nc"):
            held = [res[r][name, codec][1] for r in range(2)]
            assert held == [agree, True], (name, codec, held)
            assert np.array_equal(bits(res[0][name, codec][0]), bits(res[1][name, codec][0]))
        np.testing.assert_array_equal(bits(res[0][name, "bfp32"][0]), bits(bfp_reference(xs)))
        exact = xs[0].astype(np.float64) + xs[1]
        rel = np.linalg.norm(res[0][name, "nc"][0] - exact) / np.linalg.norm(exact)
        assert rel < 0.5, (name, rel)      # an estimate of the sum, not noise
        # thc keeps residuals, so no window is encoded under a guess: its statistics count each
        # coordinate of the 24 chunks of 128 once, a rank with a smaller exponent included
        assert [res[r][name, "thc"][1:] for r in range(2)] == [(None, 24 * 128)] * 2, name


def test_a_stale_result_of_a_chunk_not_yet_sent_is_not_taken(tmp_path):
    """A worker's data socket may bind a fixed port (the job's multicast group port), so packets of an
    earlier run of the same job can land on a new run's socket. A RESULT for a chunk this allreduce has
    not sent yet (position 30 of 40, window 4) cannot be its own: it is counted stale and both ranks get
    the same sums (taking it would mark chunk 30 done with garbage on rank 0 and drop its real result as a
    duplicate). The switch holds every packet 20 ms, so chunk 30 goes out about 140 ms after the data
    stream's first send, when the stale packet is put into rank 0's socket."""
    import socket
    import threading

    from sw_harness import client_threads

    from ina.wire import MsgType, PayloadType, pack
    sw = SwitchProc("--slots", "64", "--elements", "128", "--ingress-delay-ms", "20", "--host-agg-port", "-1",
                    log_path=tmp_path / "switch.log")
    xs = [np.random.default_rng([r, 31]).standard_normal(40 * 128).astype(np.float32) for r in range(2)]
    injected = []

    def inject(cl):
        wait_until(lambda: cl._timeline is not None and "first_send" in cl._timeline.marks, 20,
                   "rank 0's data stream to start", interval=0.001)
        chunk = (cl.next_chunk - 40 + 30) % cl.chunk_modulus      # next_chunk: already past this stream
        garbage = pack(msg_type=MsgType.RESULT, job=cl.job, rank=0, chunk=chunk, payload_type=PayloadType.NC8,
                       payload=np.full(128, 0x7F, np.uint8), elements=128)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(garbage, cl.sock.getsockname())
        injected.append(cl.stats.packets_sent)

    def body(r, cl):
        if r == 0:
            threading.Thread(target=inject, args=(cl,), daemon=True).start()
        y = xs[r].copy()
        cl.allreduce(y, codec="nc")
        return y, cl.stats.stale_results

    try:
        out = client_threads(sw.port, 2, 77, body, elements=128, slots=4, timeout=20.0, timeline=True)
    finally:
        rc = sw.terminate()
    assert rc == 0, sw.log()[-3000:]
    assert injected and injected[0] < 30, injected            # in the socket before chunk 30 was sent
    np.testing.assert_array_equal(out[0][0], out[1][0])
    assert out[0][1] >= 1
