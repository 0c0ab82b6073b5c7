"""The switch service: integer-only data plane, control plane, fuzzing, register overflow, shutdown.

The switch runs as a real ``python -m switch_model serve`` subprocess on a free port of 127.0.0.1;
packets are sent from plain UDP sockets, workers are real processes (tests/sw_worker.py).
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from numba import njit

sys.path.insert(0, os.path.dirname(__file__))
from sw_fuzz import PARSE_REASONS, PROTOCOL_REASONS, JobSpec, ProtocolModel, bad_packets, header  # noqa: E402
from sw_harness import (PY, ROOT, SwitchProc, Workers, bfp_reference, control, expected_inputs,  # noqa: E402
                        free_port, join_all, run_stages, wait_until)

from ina.burst import SOL_UDP, UDP_GRO  # noqa: E402
from ina.client import AllreduceError, Client  # noqa: E402
from switch_model.dataplane import source_key  # noqa: E402
from ina.wire import HEADER_DTYPE, HEADER_SIZE, Flag, MsgType, max_packet_size  # noqa: E402

INA_SWITCH = str(Path(PY).parent / "ina-switch")


@pytest.fixture(scope="module")
def switch(tmp_path_factory):
    sw = SwitchProc("--slots", "64", "--elements", "64", log_path=tmp_path_factory.mktemp("sw") / "switch.log")
    yield sw
    assert sw.terminate() == 0, sw.log()


_RESULT_DTYPE = {5: "i1"}      # INT8_NARROW results are int8; everything else here is read as int32


class ResultCollector:
    """RESULT packets of an INT32 job arriving on a fake worker's socket, by chunk id."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.got: dict[int, list] = {}
        self.exponent: dict[int, int] = {}
        self.n = 0

    def _recv(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        data, anc, _, _ = self.sock.recvmsg(65536, 64)
        # a Client's socket has UDP GRO on: a coalesced message carries its datagrams' size in a cmsg
        seg = next((int.from_bytes(d[:4], "little") for lvl, kind, d in anc if (lvl, kind) == (SOL_UDP, UDP_GRO)),
                   len(data))
        for at in range(0, len(data), seg):
            self._take(data[at:at + seg])

    def _take(self, pkt: bytes) -> None:
        h = hdr(pkt)
        assert h["msg_type"] == int(MsgType.RESULT), h
        v = np.frombuffer(pkt[HEADER_SIZE:], _RESULT_DTYPE.get(int(h["payload_type"]), ">i4")).astype(np.int64)
        self.got.setdefault(int(h["chunk"]), []).append((v, int(h["flags"]), int(h["job"])))
        self.exponent[int(h["chunk"])] = int(h["exponent"])
        self.n += 1

    def wait_for(self, chunk: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while chunk not in self.got:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no result for chunk {chunk} within {timeout:g} s")
            try:
                self._recv(left)
            except socket.timeout:
                pass

    def drain(self, total: int, timeout: float = 10.0) -> None:
        """Receive until ``total`` packets came in, then whatever else is queued (bounded)."""
        deadline = time.monotonic() + timeout
        try:
            while self.n < total and time.monotonic() < deadline:
                self._recv(max(0.01, deadline - time.monotonic()))
            while True:
                self._recv(0.05)
        except socket.timeout:
            pass


def hdr(pkt: bytes):
    return np.frombuffer(pkt[:HEADER_SIZE], HEADER_DTYPE)[0]


# ------------------------------------------------------------------------------------------------
# the aggregation stage is integer-only
# ------------------------------------------------------------------------------------------------
FLOAT_IR = re.compile(r"\b(fadd|fsub|fmul|fdiv|frem|fneg|fcmp|sitofp|uitofp|fptosi|fptoui|fpext|fptrunc|"
                      r"float|double|half|bfloat|fp128|x86_fp80|ppc_fp128)\b|\.f(16|32|64|80|128)\b")
STRING_CONST = re.compile(r'c"(?:[^"\\]|\\.)*"')     # exception messages etc. are data, not instructions


def float_instructions(ir: str) -> list[str]:
    """Lines of LLVM IR that use a floating-point instruction, type or intrinsic."""
    ir = STRING_CONST.sub('c""', ir)
    return [ln.strip() for ln in ir.splitlines() if FLOAT_IR.search(ln)]


IR_DUMP = r"""
import json, sys
from switch_model.pipeline import Switch, SwitchConfig
from switch_model import alu, dataplane as D, harvest
Switch(SwitchConfig(host="127.0.0.1", port=0, slots=4, elements=16))   # warm-up: compiles the kernels
print(json.dumps({k.__name__: {str(s): k.inspect_llvm(s) for s in k.signatures}
                  for k in (D.rx_account, D.parse, alu.aggregate, harvest.harvest)}))
"""


def test_dataplane_kernels_have_no_floating_point(tmp_path):
    # a fresh numba cache directory: kernels loaded from the cache cannot be inspected
    r = subprocess.run([PY, "-c", IR_DUMP], cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")})
    assert r.returncode == 0, r.stderr
    irs = json.loads(r.stdout)
    assert set(irs) == {"rx_account", "parse", "aggregate", "harvest"}
    for name, sigs in irs.items():
        assert sigs, f"{name} was not compiled by the warm-up"
        for sig, ir in sigs.items():
            assert "define " in ir and len(ir) > 5000, f"{name}{sig}: no IR (inspection of a cached kernel?)"
            bad = float_instructions(ir)
            assert not bad, f"{name}{sig} has floating-point IR:\n" + "\n".join(bad[:10])


def test_float_check_detects_floats():
    """The check above can fail: it flags a kernel with one float multiply, passes an integer one."""
    @njit
    def scaled_sum(a):
        s = 0
        for i in range(a.size):
            s += np.int64(a[i] * 1.5)
        return s

    @njit
    def true_division(a, b):
        return a // 3 + np.int64(a / b)

    @njit
    def integer_sum(a):
        s = 0
        for i in range(a.size):
            s += (a[i] << 1) ^ (a[i] >> 3)
        return s

    x = np.arange(10, dtype=np.int64)
    scaled_sum(x), true_division(7, 2), integer_sum(x)
    flagged = float_instructions(scaled_sum.inspect_llvm(scaled_sum.signatures[0]))
    assert any("fmul" in ln or "sitofp" in ln for ln in flagged)
    assert float_instructions(true_division.inspect_llvm(true_division.signatures[0]))
    assert not float_instructions(integer_sum.inspect_llvm(integer_sum.signatures[0]))


# ------------------------------------------------------------------------------------------------
# control plane
# ------------------------------------------------------------------------------------------------
def test_join_timeout_names_the_missing_ranks(switch):
    errs = {}

    def join(rank, timeout):
        try:
            Client(("127.0.0.1", switch.port), rank=rank, world_size=4, job=30, elements=16, slots=2, timeout=timeout)
        except AllreduceError as e:
            errs[rank] = (str(e), time.monotonic())

    t0 = time.monotonic()
    t = threading.Thread(target=join, args=(3, 10.0))
    t.start()
    join(0, 1.0)
    t.join(timeout=40)
    msg0, t_0 = errs[0]
    assert "timed out after 1 s waiting for ranks [1, 2] to join" in msg0, msg0
    assert t_0 - t0 < 8.0           # before rank 3's 10 s (it was 3 s: a loaded machine delayed rank 0's join past it)
    msg3, _ = errs[3]
    assert "waiting for ranks [0, 1, 2] to join" in msg3, msg3     # rank 0 gave up first
    assert "30" not in switch.stats()["jobs"]


def test_mismatched_job_parameters_are_refused(switch):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c0", Client(("127.0.0.1", switch.port), rank=0, world_size=2,
                                                                     job=31, elements=32, slots=4, timeout=20)))
    t.start()
    wait_until(lambda: "job 31: rank 0 joined" in switch.log(), 20, "rank 0 of job 31 to join (switch log)")
    # rank 1 asks for different elements per packet: refused at once, naming both specs
    with pytest.raises(AllreduceError) as ei:
        Client(("127.0.0.1", switch.port), rank=1, world_size=2, job=31, elements=16, slots=4, timeout=20)
    msg = str(ei.value)
    assert "job 31: rank 1 asks for" in msg and "'elements': 16" in msg and "'elements': 32" in msg, msg
    # the rendezvous is not poisoned: a matching rank 1 completes it
    c1 = Client(("127.0.0.1", switch.port), rank=1, world_size=2, job=31, elements=32, slots=4, timeout=20)
    t.join(timeout=20)
    c0 = box["c0"]
    try:
        x = [np.arange(100, dtype=np.float32) * (r + 1) for r in range(2)]
        ts = [threading.Thread(target=c.allreduce, args=(xi, "bfp32")) for c, xi in zip((c0, c1), x)]
        for th in ts:
            th.start()
        for th in ts:
            th.join(timeout=20)
        ref = bfp_reference([np.arange(100, dtype=np.float32) * (r + 1) for r in range(2)])
        assert np.array_equal(x[0], ref) and np.array_equal(x[1], ref)
        # a third client for a running job is refused
        with pytest.raises(AllreduceError, match="job 31 is already running"):
            Client(("127.0.0.1", switch.port), rank=0, world_size=2, job=31, elements=32, slots=4, timeout=5)
    finally:
        c0.close()
        c1.close()


@pytest.mark.parametrize("msg,error", [
    ({"op": "join", "job": 32, "rank": 5, "world_size": 2, "udp_port": 1}, "rank 5 out of range for world_size 2"),
    ({"op": "join", "job": 32, "rank": 0, "world_size": 2, "udp_port": 1, "elements": 65},
     "elements per packet 65 exceeds the switch's 64 registers per slot"),
    ({"op": "join", "job": 32, "rank": 0, "world_size": 2, "udp_port": 1, "elements": 8, "slots": 65},
     "job 32 asks for 65 slots; the switch's pool has 1..64"),
    ({"op": "join", "job": 32, "rank": 0, "world_size": 65, "udp_port": 1}, "a job has 1..64 workers"),
    ({"op": "join", "job": 32, "rank": 0, "world_size": 2, "udp_port": 1, "elements": 0}, "elements per packet"),
    ({"op": "join", "rank": 0, "world_size": 1, "udp_port": 1}, "missing field 'job'"),
    ({"op": "join", "job": 70000, "rank": 0, "world_size": 2, "udp_port": 1}, "job id 70000 out of range 0..65535"),
    ({"op": "frobnicate"}, "unknown op 'frobnicate' (join, leave, status, stats, impair)"),
    ({"op": "join", "job": 32, "rank": 0, "world_size": 2, "udp_port": 1, "timeout": float("nan")},
     "join timeout must be a number of seconds >= 0, got nan"),
    ({"op": "join", "job": 32, "rank": 0, "world_size": 2, "udp_port": 1, "timeout": -1},
     "join timeout must be a number of seconds >= 0, got -1"),
    ({"op": "leave"}, "leave without join"),
    ({"op": "impair", "ingress": {"loss": 1.5}}, "impairment loss=1.5 is not a probability"),
    ({"op": "impair", "ingress": 5}, "ingress: expected an object of impairment fields (loss, duplicate, reorder, "
                                     "delay_ms, reorder_ms, seed), got int 5"),
    ({"op": "impair", "egress": {"los": 0.1}}, "egress: unknown impairment field(s) 'los' (fields: loss, "),
    ({"op": "impair", "ingress": {"loss": "0.1"}}, "ingress: impairment loss='0.1': expected a finite number"),
    ({"op": "impair", "egress": {"delay_ms": float("nan")}}, "egress: impairment delay_ms=nan: expected a finite number"),
    ({"op": "impair", "ingress": {"seed": -1}}, "ingress: impairment seed=-1: expected an integer >= 0"),
])
def test_control_plane_refuses_bad_requests_with_clear_errors(switch, msg, error):
    """Refused at once (no rendezvous wait), with a message naming what was wrong."""
    from ina.control import ControlError
    t0 = time.monotonic()
    with pytest.raises(ControlError) as ei:
        control(switch.port, msg, timeout=10)
    assert error in str(ei.value), str(ei.value)
    assert time.monotonic() - t0 < 15         # not the rendezvous wait of 30 s (room for a loaded machine)
    assert "32" not in switch.stats()["jobs"]


def test_an_impair_request_with_one_bad_direction_changes_neither(switch):
    """A request whose egress part is refused leaves the ingress as it was: all or nothing."""
    from ina.control import ControlError
    before = switch.stats()["impairments"]["ingress"]["reorder_ms"]
    with pytest.raises(ControlError, match="egress: impairment loss=2 is not a probability"):
        control(switch.port, {"op": "impair", "ingress": {"reorder_ms": before + 6}, "egress": {"loss": 2}}, timeout=10)
    assert switch.stats()["impairments"]["ingress"]["reorder_ms"] == before


def test_control_plane_rejects_malformed_json(switch):
    """Malformed JSON, or JSON that is not a request object, gets an error reply naming it, and the
    connection stays usable."""
    s = socket.create_connection(("127.0.0.1", switch.port), timeout=5)
    try:
        f = s.makefile("rb")
        s.sendall(b"{not json\n")
        reply = json.loads(f.readline())
        assert reply["ok"] is False and reply["error"]
        for line, kind in ((b'["stats"]', "list"), (b'"stats"', "str"), (b"7", "int")):
            s.sendall(line + b"\n")
            reply = json.loads(f.readline())
            assert reply["ok"] is False and f"JSON object with an \"op\" field, got a JSON {kind}" in reply["error"]
        s.sendall(b'{"op": "stats"}\n')
        assert json.loads(f.readline())["ok"] is True
    finally:
        s.close()


def test_startup_line_says_what_the_switch_does_to_packets(switch, tmp_path):
    """The service's startup line (printed whatever the log level) names its impairments, per direction,
    with their seeds, or says there are none."""
    assert "; no impairments" in switch.log()
    sw = SwitchProc("--slots", "8", "--elements", "64", "--seed", "5", "--ingress-loss", "0.01", "--egress-delay-ms",
                    "2", "--egress-duplicate", "0.5", "--log-level", "WARNING", log_path=tmp_path / "sw.log")
    try:
        assert "impairments: ingress loss 0.01 (seed 5); egress duplicate 0.5, delay 2 ms (seed 6)" in sw.log(), sw.log()
    finally:
        assert sw.terminate() == 0


def test_impairments_label_names_each_shards_seed_and_how_long_a_reordered_packet_is_held():
    """A sharded switch draws shard k's impairments from seed + SHARD_SEED_STEP x k: the label says so (not
    shard 0's seed alone), and a reordering names how long a packet is held back."""
    from switch_model.cli import impairments_label
    from switch_model.impair import ImpairmentConfig
    from switch_model.shards import SHARD_SEED_STEP
    from types import SimpleNamespace
    cfg = SimpleNamespace(ingress=ImpairmentConfig(reorder=0.02, reorder_ms=3.0, seed=5),
                          egress=ImpairmentConfig(seed=6))
    assert impairments_label(cfg) == "impairments: ingress reorder 0.02 (held 3 ms) (seed 5)"
    assert impairments_label(cfg, 4) == \
        f"impairments: ingress reorder 0.02 (held 3 ms) (seeds 5 + {SHARD_SEED_STEP} x shard, shards 0..3)"


def test_sram_budget_refused_at_startup(tmp_path):
    port = free_port()
    r = subprocess.run([PY, "-m", "switch_model", "serve", "--host", "127.0.0.1", "--port", str(port),
                        "--slots", "1024", "--elements", "1024", "--sram-mb", "12"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "16.0 MiB of register memory" in r.stderr, r.stderr
    assert "over the SRAM budget of 12 MiB (--sram-mb)" in r.stderr, r.stderr
    # the same pool in 32-bit registers fits: the service starts and says what it uses
    sw = SwitchProc("--slots", "1024", "--elements", "1024", "--sram-mb", "12", "--register-bits", "32",
                    log_path=tmp_path / "sw32.log")
    try:
        assert re.search(r"register memory 8\.0\d MiB of 12 MiB \(1024 slots x 2 sets x 1024 x 32-bit\)", sw.log())
        cfg = sw.stats()["config"]
        assert cfg["register_bits"] == 32 and cfg["sram_mb"] == 12
    finally:
        assert sw.terminate() == 0


def test_stats_cli(switch):
    r = subprocess.run([INA_SWITCH, "stats", "--port", str(switch.port)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["stages"] == ["rx", "ingress", "parse", "aggregate", "harvest", "tx"]
    assert set(PARSE_REASONS + PROTOCOL_REASONS) <= set(st["drops"])
    for k in ("rx_packets", "tx_packets", "harvested", "replays", "overflow", "parsed_ok"):
        assert k in st["counters"]
    assert st["occupancy"]["slots_total"] == 64 and set(st["rates"]) >= {"rx_pps", "rx_bps", "tx_bps"}
    # nothing listening: a clear error and a non-zero exit
    r = subprocess.run([INA_SWITCH, "stats", "--port", str(free_port())], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "cannot reach the switch's control plane" in r.stderr, r.stderr


def test_sigterm_shuts_down_cleanly(tmp_path):
    sw = SwitchProc("--slots", "8", "--elements", "16", log_path=tmp_path / "sw.log")
    # an idle job with an open connection and a 600 s timeout: the service does not wait for it (a stop
    # takes seconds on a loaded machine: the bound is far below the job's timeout, not a speed)
    (c,) = join_all(sw.port, 1, 1, elements=16, slots=2, timeout=600)
    try:
        x = np.ones(40, np.float32)
        c.allreduce(x, "bfp32")
        assert np.all(x == 1)
        t0 = time.monotonic()
        assert sw.terminate(timeout=60) == 0
        assert time.monotonic() - t0 < 60
    finally:
        c.sock.close()
        c.ctl.close()
        c.ctl = None
    log = sw.log()
    assert "signal 15: shutting down" in log and "switch stopped: rx" in log, log


# ------------------------------------------------------------------------------------------------
# fuzzing while a real allreduce runs
# ------------------------------------------------------------------------------------------------
def test_fuzz_bad_packets_counted_by_reason_while_allreduce_runs(switch, tmp_path):
    """Seeded (derandomized) bad packets: truncated, wrong versions and types, random bytes, bad
    fields, and well-formed packets claiming a rank of either running job from a foreign address.
    Each is counted under its documented drop reason; the switch stays up and both jobs stay exact."""
    port = switch.port
    stride = max_packet_size(64)
    # the real job: two worker processes streaming bfp32 allreduces until told to stop
    ops = [{"codec": "bfp32", "shape": [1500], "seed": 90}, {"codec": "bfp32", "shape": [3, 333], "seed": 91}]
    stop = tmp_path / "stop"
    real = Workers(tmp_path, port, 2, job=10, ops=ops, client={"elements": 64, "slots": 8, "timeout": 30.0,
                                                               "rto": 0.5, "max_rto": 1.0},
                   loop=0, name="real", stop_file=str(stop))
    fakes = join_all(port, 11, 2, elements=16, slots=4, timeout=30)   # a job whose slots the fuzzer drives
    try:
        wait_until(lambda: all(real.progress(r) >= 1 for r in range(2)), 60, "the real job's first allreduce")
        before = switch.stats()
        jobs = {10: JobSpec(10, 2, 8, 64), 11: JobSpec(11, 2, 4, 16)}
        model = ProtocolModel(jobs[11])
        sent = Counter()
        out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        dst = ("127.0.0.1", port)
        progress_at_start = real.progress(0)

        @settings(max_examples=220, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(bad=st_lists(bad_packets(jobs, stride)), scen=st_lists(model.strategy(), 1, 3))
        def throw(bad, scen):
            for reason, pkt in bad:
                out.sendto(pkt, dst)
                sent[reason] += 1
            for kind, pool, shadow, seed in scen:
                if (pool, shadow) in outstanding:     # self-clocking: the set's last result first
                    results.wait_for(outstanding[(pool, shadow)])
                for pkt in model.scenario(kind, pool, shadow, seed):     # from the rank's joined socket
                    fakes[int(hdr(pkt)["rank"])].sock.sendto(pkt, dst)
                outstanding[(pool, shadow)] = model.last

        outstanding = {}
        results = ResultCollector(fakes[0].sock)

        throw()
        # a marker behind everything (one socket: FIFO); once it is counted, all before it went through
        out.sendto(b"end", dst)
        sent["truncated"] += 1
        out.close()
        n_bad = sum(sent.values())
        assert n_bad >= 10000, sent
        assert set(sent) == set(PARSE_REASONS), sent        # every category was exercised
        for k in PROTOCOL_REASONS:
            assert model.expected[k] > 0, model.expected
        wait_until(lambda: sum(switch.stats()["drops"][k] - before["drops"][k] for k in PARSE_REASONS) >= n_bad,
                   30, "the switch to count every fuzz packet")
        for chunk in model.sums:
            results.wait_for(chunk)
        results.drain(model.harvested + model.replays)
        # the real job kept running during the fuzzing; it stops at the end of its current pass
        assert real.progress(0) > progress_at_start
        stop.touch()
        res = real.wait(timeout=60)
        after = switch.stats()
    finally:
        stop.touch()
        real.kill()
        for c in fakes:
            c.close()
    d = {k: after["drops"][k] - before["drops"][k] for k in after["drops"]}
    c = {k: after["counters"][k] - before["counters"][k] for k in after["counters"]}
    # the switch is alive, every bad packet is counted under its reason, every packet has one verdict
    for reason in PARSE_REASONS:
        assert d[reason] == sent[reason], (reason, d[reason], sent[reason])
    assert after["counters"]["rx_packets"] == after["counters"]["parsed_ok"] + sum(
        after["drops"][k] for k in PARSE_REASONS)
    assert c["parsed_ok"] >= model.ok
    assert c["harvested"] >= model.harvested
    # a retransmission of the real job, or the second copy of a stream's last chunk (ina.recovery's tail
    # copies), may add one drop or replay each
    retx = sum(m["stats"]["retransmissions"] + m["stats"]["tail_copies"] for m in res.values())
    for reason in PROTOCOL_REASONS:
        assert model.expected[reason] <= d[reason], (reason, d, model.expected)
    assert sum(d[r] - model.expected[r] for r in PROTOCOL_REASONS) <= retx
    assert model.replays <= c["replays"] <= model.replays + retx
    # the real job's allreduces, all of them, are exact
    n_runs = len(res[0]["results"])
    assert n_runs >= 3
    for r in range(2):
        for i, got in enumerate(res[r]["results"]):
            op = ops[i % 2]
            ref = bfp_reference(expected_inputs(op, 2))
            assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (r, i)
    # every result of the fuzzed job's slots is the exact sum of its two rounds' payloads
    got = results.got
    assert len(got) == model.harvested
    for chunk, res_list in got.items():
        assert len([1 for _, fl, _ in res_list if not fl & int(Flag.REPLAY)]) == 1, chunk   # one multicast
        for v, fl, job in res_list:
            assert job == 11 and np.array_equal(v, model.sums[chunk]) and not fl & int(Flag.OVERFLOW), chunk
    assert sum(1 for lst in got.values() for _, fl, _ in lst if fl & int(Flag.REPLAY)) == model.replays


def st_lists(strategy, min_size=45, max_size=60):
    from hypothesis import strategies as st
    return st.lists(strategy, min_size=min_size, max_size=max_size)



# ------------------------------------------------------------------------------------------------
# the slot protocol inside one burst
# ------------------------------------------------------------------------------------------------
def test_new_round_in_the_burst_that_completed_its_set_waits_for_the_harvest():
    """Aggregate runs over a whole burst before harvest: a packet that starts the next round of a
    set completed earlier in the same burst must not overwrite the registers before they are
    harvested (it is dropped as slot_busy and retransmitted, as a real worker would)."""
    from switch_model.pipeline import Switch, SwitchConfig
    sw = Switch(SwitchConfig(host="127.0.0.1", port=0, slots=8, elements=16))
    try:
        sw.install_job(11, 2, 4, 16, False, [("127.0.0.1", 9), ("127.0.0.1", 9)])
        sw.state.src[:] = source_key(0x7F000001, 9)                  # every packet from the joined address
        model = ProtocolModel(JobSpec(11, 2, 4, 16))
        first = model.scenario("complete", 0, 0, 1)
        c0 = model.last
        second = model.scenario("complete", 0, 0, 2)
        c1 = model.last

        def burst(pkts):
            m = run_stages(sw, pkts)
            res = sw.state.results
            return [(int(hdr(res[r].tobytes())["chunk"]), res[r, HEADER_SIZE: HEADER_SIZE + 64].view(">i4").astype(np.int64))
                    for r in sw.state.tx["set_id"][:m]]

        busy0 = int(sw.counters[13])
        out = burst(first + second)
        assert [c for c, _ in out] == [c0, c0]                       # multicast of the first round only
        assert all(np.array_equal(v, model.sums[c0]) for _, v in out)
        assert int(sw.counters[13]) - busy0 == 2                     # the second round's packets: slot_busy
        out = burst(second)                                           # retransmitted in the next burst
        assert [c for c, _ in out] == [c1, c1] and all(np.array_equal(v, model.sums[c1]) for _, v in out)
    finally:
        sw.sock.close()


def _multicast_job_switch():
    """An in-process switch with job 11 (2 workers, 8 slots of 16 elements) whose results go to a multicast
    group, and the protocol model of its packets."""
    from switch_model.pipeline import Switch, SwitchConfig
    sw = Switch(SwitchConfig(host="127.0.0.1", port=0, slots=8, elements=16))
    sw.multicast.enabled = True
    sw.multicast.interface = "127.0.0.1"           # as if the workers were reached through a multicast route
    sw.multicast.choose = lambda job, addrs, groups, port: ("239.255.0.1", "a group")
    try:
        info = sw.install_job(11, 2, 8, 16, False, [("127.0.0.1", 9), ("127.0.0.1", 9)])
        assert info.group_addr >= 0
        sw.state.src[:] = source_key(0x7F000001, 9)                  # every packet from the joined address
    except BaseException:
        sw.sock.close()
        raise
    return sw, info, ProtocolModel(JobSpec(11, 2, 8, 16))


def _with_flags(pkt: bytes, flags: int) -> bytes:
    out = bytearray(pkt)
    np.frombuffer(out, HEADER_DTYPE, count=1)["flags"] = flags
    return bytes(out)


@pytest.mark.parametrize("group_seen", [False, True])
def test_replays_count_against_a_multicast_group_only_without_group_seen(group_seen):
    """A rank's resend of a completed round is replayed either way. Without GROUP_SEEN, the replay says the
    job's multicast group may miss the rank: after a window of results that all needed one, the job falls
    back to unicast copies. With it (the rank gets results by the group: it resent a result still queued in
    its download), the replay does not count, and the job keeps its group."""
    from switch_model.dataplane import C_REPLAYS
    from switch_model.multicast import FALLBACK_MIN_RESULTS
    sw, _, model = _multicast_job_switch()
    try:
        flags = int(Flag.RETRANSMIT | (Flag.GROUP_SEEN if group_seen else 0))

        values = np.arange(4)
        rounds = FALLBACK_MIN_RESULTS + 8
        for c in range(rounds):
            grouped = sw.state.jobs[11]["group_addr"] >= 0
            sums = run_stages(sw, [model.pkt(0, c, values), model.pkt(1, c, values)])
            assert sums == (1 if grouped else 2)                                  # to the group, or a copy each
            assert run_stages(sw, [_with_flags(model.pkt(0, c, values), flags)]) == 1   # its replay
        replays = int(sw.counters[C_REPLAYS])
        assert replays == rounds
        if group_seen:
            assert not sw.fallbacks and sw.state.jobs[11]["group_addr"] >= 0
        else:
            (fb,) = sw.fallbacks
            assert fb["job"] == 11 and fb["ranks"] == [0], fb
            assert f"replay of {FALLBACK_MIN_RESULTS} of the last {FALLBACK_MIN_RESULTS} results" in fb["why"], fb
            assert sw.state.jobs[11]["group_addr"] == -1
    finally:
        sw.sock.close()


@pytest.mark.parametrize("flags", [Flag.TAIL, Flag.TAIL | Flag.GROUP_SEEN], ids=["tail", "tail-group-seen"])
def test_a_second_tail_copy_is_neither_replayed_nor_counted_against_the_group(flags):
    """A worker sends its stream's last chunk twice (TAIL, ina.recovery); a copy that arrives after the round
    completed is not replayed (tail.py takes back harvest's replay), and what harvest counted against the
    job's multicast group for it is taken back by the same rule, whatever flags the copy carries: the rank's
    count never goes below what its real replays made it."""
    sw, info, model = _multicast_job_switch()
    try:
        values = np.arange(4)
        addr = info.addr_base + 0
        before = int(sw.state.delivered[addr])
        tail = [_with_flags(model.pkt(r, 0, values), int(flags)) for r in range(2)]
        assert run_stages(sw, tail) == 2                            # the round completes: multicast twice ...
        assert run_stages(sw, [tail[0]]) == 0                       # ... rank 0's second copy: no replay
        assert int(sw.state.delivered[addr]) == before
    finally:
        sw.sock.close()


def test_the_group_is_judged_on_replays_left_after_the_tail_copies_rule():
    """A replay harvest plans for a second TAIL copy is taken back (tail.py), and so is its count against the
    group: the multicast judge must see the count after that, not before. Rank 0 is replayed 22 of the
    window's 32 results (below FALLBACK_SHARE); the burst completing the 32nd round by TAIL copies also holds
    rank 0's second copy, which would make it 23 (above) if the judge ran before the take-back."""
    from switch_model.multicast import FALLBACK_SHARE
    sw, info, model = _multicast_job_switch()
    try:
        values, window = np.arange(4), 32
        replayed = int(FALLBACK_SHARE * window)                 # 22: one below the share
        assert replayed < FALLBACK_SHARE * window <= replayed + 1
        for c in range(window - 1):
            assert run_stages(sw, [model.pkt(0, c, values), model.pkt(1, c, values)]) == 1
            if c < replayed:
                assert run_stages(sw, [_with_flags(model.pkt(0, c, values), int(Flag.RETRANSMIT))]) == 1
        tail = [_with_flags(model.pkt(r, window - 1, values), int(Flag.TAIL)) for r in (0, 1, 0)]
        assert run_stages(sw, tail) == 2                        # multicast twice; no replay of the copy
        assert int(sw.state.delivered[info.addr_base]) == replayed
        assert not sw.fallbacks and sw.state.jobs[11]["group_addr"] >= 0, sw.fallbacks
    finally:
        sw.sock.close()


# ------------------------------------------------------------------------------------------------
# register overflow: saturate and flag, never wrap
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def switch32(tmp_path_factory):
    sw = SwitchProc("--slots", "16", "--elements", "64", "--register-bits", "32",
                    log_path=tmp_path_factory.mktemp("sw32") / "switch.log")
    yield sw
    assert sw.terminate() == 0, sw.log()


def _data(job, rank, chunk, slots, ptype, values, elements, exponent=0) -> bytes:
    slot = (chunk % slots) | (((chunk // slots) & 1) << 15)
    if ptype == 0:
        return header(job=job, rank=rank, slot=slot, ptype=0, count=0, chunk=chunk, exponent=exponent)
    dt = {1: np.uint8, 2: ">i4", 3: ">i8", 4: "i1", 5: "i1"}[ptype]
    body = np.zeros(elements, dt)
    body[: len(values)] = values
    slot = (chunk % slots) | (((chunk // slots) & 1) << 15)
    return header(job=job, rank=rank, slot=slot, ptype=ptype, count=len(values), chunk=chunk) + body.tobytes()


@pytest.mark.parametrize("bits", [64, 32])
def test_register_overflow_saturates_and_is_flagged(switch, switch32, bits):
    sw = switch if bits == 64 else switch32
    I32, I32MIN = 2**31 - 1, -2**31
    hi, lo = 2 ** (bits - 1) - 1, -2 ** (bits - 1)
    fakes = join_all(sw.port, 40, 2, elements=8, slots=4, raw=True, timeout=20)
    try:
        ovf0 = sw.stats()["counters"]["overflow"]
        dst = ("127.0.0.1", sw.port)
        big = 2 ** (bits - 2)                     # big + big = 2**(bits-1): one past the register's max
        rounds = {   # chunk: (payload type, rank 0 values, rank 1 values, expected result, overflow?)
            0: (2, [I32, I32MIN, 5, I32, -I32, 0, 0, 0], [I32, -1, 7, 1, -2, 0, 0, 3],
                [I32, I32MIN, 12, I32, I32MIN, 0, 0, 3], True),
            1: (2, [1, -2, 3, 0, 0, 0, 0, 0], [10, 20, -30, 0, 0, 0, 0, 0], [11, 18, -27, 0, 0, 0, 0, 0], False),
            2: (3, [2**62, -2**62, 1], [2**62, -2**62 - 1, 1], [I32, I32MIN, 2], True),   # int64 inputs
            # natural-compression codes k (2**(k-1)); bit 7 is the sign
            3: (1, [bits - 1, 0x80 | (bits - 1), bits + 8, 3, bits - 1, 0x80 | (bits - 1)],
                [bits - 1, 0x80 | bits, 1, 0x80 | 2, 0, 0], [hi, lo, hi, 2, 2 ** (bits - 2), -2 ** (bits - 2)], True),
            # an exponent round right after the saturated ones: no payload, so nothing can overflow
            4: (0, [], [], [], False),
            # INT8_NARROW: the sum goes back as int8, saturating at -128/127 with the flag
            5: (5, [100, -100, 3, 127, -128, 0, 0, 0], [100, -100, -5, 0, 0, 0, 0, 1],
                [127, -128, -2, 127, -128, 0, 0, 1], True),
            6: (5, [1, -1, 0, 60], [1, 1, -1, 60], [2, 0, -1, 120], False),
            # INT8 (not narrow): the same codes come back as int32 sums
            7: (4, [100, -100, 3], [100, -100, -5], [200, -200, -2], False),
        }
        for chunk, (pt, a, b, _, _) in rounds.items():
            fakes[0].sock.sendto(_data(40, 0, chunk, 4, pt, a, 8, exponent=3), dst)    # from the joined sockets
            fakes[1].sock.sendto(_data(40, 1, chunk, 4, pt, b, 8, exponent=-2), dst)
        got = ResultCollector(fakes[0].sock)
        for chunk in rounds:
            got.wait_for(chunk)
        width = {32: ">i4", 64: ">i8"}
        for chunk, (pt, _, _, want, ovf) in rounds.items():
            ((v, flags, _),) = got.got[chunk]
            if pt == 1:     # raw natural-compression sums come back in register-wide integers
                pkt_vals = np.frombuffer(v.astype(">i4").tobytes(), width[bits]).astype(np.int64) \
                    if bits == 64 else v
            else:
                pkt_vals = v
            assert list(pkt_vals[: len(want)]) == want, (chunk, list(pkt_vals[: len(want)]), want)
            assert bool(flags & int(Flag.OVERFLOW)) == ovf, (chunk, flags)
            assert bool(flags & int(Flag.RAW_SUM)) == (pt != 0)
        assert got.exponent[4] == 3            # the max-exponent register
        assert sw.stats()["counters"]["overflow"] > ovf0
    finally:
        for c in fakes:
            c.close()


def test_client_raises_on_overflow(switch32, tmp_path):
    """A real client's allreduce whose slots overflow (a rogue rank 1 sends int32 maxima) raises
    AllreduceError; the rogue's copy of the results shows the saturated, flagged sums."""
    ops = [{"codec": "bfp32", "shape": [40], "seed": 1, "dist": "const07"}]
    w = Workers(tmp_path, switch32.port, 2, job=41, ops=ops, ranks=[0],
                client={"elements": 8, "slots": 8, "timeout": 10.0}, name="ovf")
    rogue = Client(("127.0.0.1", switch32.port), rank=1, world_size=2, job=41, elements=8, slots=8, timeout=30)
    try:
        s = rogue.sock                 # the rogue sends from the address it joined from
        dst = ("127.0.0.1", switch32.port)
        s.sendto(header(job=41, rank=1, slot=0, ptype=0, count=0, exponent=0, chunk=0), dst)   # exponent round
        for chunk in range(1, 6):     # 40 elements = 5 chunks of 8
            s.sendto(_data(41, 1, chunk, 8, 2, [2**31 - 1] * 8, 8), dst)
        out = w.wait(timeout=30, check=False)
        got = ResultCollector(rogue.sock)
        for chunk in range(6):
            got.wait_for(chunk)
    finally:
        w.kill()
        rogue.close()
    m = out[0]
    assert m["error_type"] == "AllreduceError" and "OVERFLOW" in m["error"], m
    for chunk in range(1, 6):
        ((v, flags, _),) = got.got[chunk]
        assert flags & int(Flag.OVERFLOW) and np.all(v == 2**31 - 1), (chunk, v, flags)
