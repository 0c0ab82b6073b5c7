"""Time-dilated emulation: the bookkeeping of ina-sweep --target-rates/--dilation, and a dilated sweep
under the Tofino profile on a real emulated topology (labels, the target's ideal, stretched timeouts,
the profile's packet sizes in the links' byte counters)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.dilation import (Dilation, DilationError, auto_factor, codec_time, probe_factors_for, resolve,
                                  switch_delay)
from experiments.sweep import build_parser, ideal_time, ina_rto, switch_args, wait_estimate
from ina.net import parse_rate
from ina.wire import HEADER_SIZE

ROOT = Path(__file__).resolve().parent.parent


def test_shaped_rate_and_times_follow_the_factor():
    d = Dilation(100)
    assert parse_rate(d.shaped_rate("10gbit")) == pytest.approx(1e8)
    assert parse_rate(d.shaped_rate("25gbit")) == pytest.approx(2.5e8)
    assert parse_rate(Dilation(32000).shaped_rate("100gbit")) == pytest.approx(3.125e6)   # beyond tbf's cap: a target
    assert parse_rate(Dilation(10).shaped_rate("10gbit")) == pytest.approx(1e9)
    assert d.stretch(0.02) == pytest.approx(2.0) and d.report(3.0) == pytest.approx(0.03)
    assert d.label == "dilated x100" and Dilation().label == "real time"
    assert Dilation().shaped_rate("unlimited") == "unlimited"
    with pytest.raises(DilationError, match="unshaped link cannot be dilated"):
        d.shaped_rate("unlimited")
    with pytest.raises(DilationError, match="below tbf's 8000 bit/s"):
        Dilation(1e6).shaped_rate("1gbit")
    with pytest.raises(DilationError, match="expected a number >= 1"):
        Dilation(0.5)


def test_record_reports_the_targets_time_and_ideal():
    d, n, el = Dilation(40), 8, 1_700_000
    shaped = d.shaped_rate("10gbit")
    measured = ideal_time("ina:nc", n, el, shaped) * 1.1          # a run 10% above its link bound, at 250 Mbit/s
    rec = {"method": "ina:nc", "rate": shaped, "rate_bps": parse_rate(shaped), "times": [measured, measured * 2],
           "time_median": measured, "time_min": measured, "time_mean": measured * 1.5,
           "ideal_time": ideal_time("ina:nc", n, el, shaped)}
    codec = codec_time("ina:nc", n, 4096)
    d.apply(rec, "10gbit", ideal_time("ina:nc", n, el, "10gbit"), codec)
    assert rec["ideal_time"] == ideal_time("ina:nc", n, el, "10gbit")     # the target's ideal, not the shaped one
    assert rec["time_median"] == pytest.approx(measured / 40) and rec["times"][1] == pytest.approx(measured / 20)
    assert rec["bound_ratio"] == pytest.approx(1.1)                        # dilation keeps time/ideal
    assert rec["rate"] == "10gbit" and rec["rate_bps"] == 1e10 and rec["shaped_rate_bps"] == pytest.approx(2.5e8)
    assert rec["dilation"] == 40 and rec["dilation_label"] == "dilated x40"
    assert rec["real_seconds_fields"] == []           # none of the instruments' real-second fields in this record
    # the codec's real-speed time is put back: end to end = time/K - codec/K + codec (this CPU)
    assert codec["codec_time_cpu"] > 0 and codec["codec_device"] == "this CPU"
    assert rec["time_end_to_end"] == pytest.approx(rec["time_median"] + codec["codec_time_cpu"] * (1 - 1 / 40))
    fast = codec_time("ina:nc", n, 4096, device_gbps=16.384)                # 2 passes x 16 kB at 16.4 GB/s
    assert fast["codec_time_device"] == pytest.approx(2e-6) and fast["codec_device"] == "16.384 GB/s"


def test_delays_and_timeouts_scale_with_the_factor():
    k, target = 50, "10gbit"
    shaped = Dilation(k).shaped_rate(target)
    # the RTO at the shaped rate is K times the target's (its floor and the window's queueing delay)
    assert ina_rto("ina:nc", shaped, 64, 9000, 8, base=Dilation(k).stretch(0.02)) == pytest.approx(
        k * ina_rto("ina:nc", target, 64, 9000, 8))
    assert wait_estimate("ina:bfp32", 8, 10**6, shaped, slack=Dilation(k).stretch(2.0)) == pytest.approx(
        k * wait_estimate("ina:bfp32", 8, 10**6, target))
    ap = build_parser()
    args = ap.parse_args(["--target-rates", "10gbit,25gbit", "--dilation", "50", "--timeout", "30",
                          "--switch-delay-ms", "0.2"])
    resolve(ap, args)
    assert args.rates == "10gbit,25gbit" and args.dilation == 50 and args.worker_timeout == pytest.approx(1500)
    assert args.tp_sizes == "none" and args.acc_steps == 0        # real-speed workloads are off under dilation
    assert args.tcp_cc == "reno"                                  # BBR's real-time clocks do not dilate
    msg = switch_delay(args, Dilation(50))
    assert msg["ingress"]["delay_ms"] == pytest.approx(10) and msg["egress"]["delay_ms"] == pytest.approx(10)
    assert switch_delay(ap.parse_args([]), Dilation(50)) is None


@pytest.mark.parametrize("argv,error", [
    (["--target-rates", "10gbit"], "--target-rates needs --dilation K or --dilation auto"),
    (["--target-rates", "10gbit", "--dilation", "0.5"], "dilation factor 0.5: expected a number >= 1"),
    (["--target-rates", "10gbit", "--dilation", "fast"], "--dilation 'fast': expected a factor >= 1 or 'auto'"),
    (["--rates", "unlimited", "--dilation", "10"], "--dilation needs shaped rates"),
    (["--target-rates", "10gbit", "--dilation", "10", "--tp-sizes", "resnet110"], "cannot be dilated"),
    (["--profile", "asic9"], "unknown switch profile 'asic9'"),
    (["--codec-gbps", "0"], "--codec-gbps 0.0: expected a positive speed"),
    (["--rates", "100gbit"], "above tbf's 32-bit limit of 34.360gbit (about 34 gbit); a faster target needs "
                             "--target-rates with --dilation"),
])
def test_bad_dilation_settings_are_named(argv, error, capsys):
    ap = build_parser()
    with pytest.raises(SystemExit):
        resolve(ap, ap.parse_args(argv))
    assert error in capsys.readouterr().err


def test_auto_factor_rule():
    """The smallest K (K0 = target / 1 Gbit/s, then doubling) whose run agrees with the run at 2K within
    5% (time / ideal), and is itself within 25% of its ideal, is the factor."""
    by_k = {10: 6.0, 20: 3.1, 40: 1.6, 80: 1.12, 160: 1.08, 320: 1.07}
    asked = []

    def probe(rate, k):
        asked.append((rate, k))
        return by_k[k]
    k, steps = auto_factor("10gbit", probe)
    assert k == pytest.approx(80)
    assert [parse_rate(r) for r, _ in asked] == pytest.approx([1e9, 5e8, 2.5e8, 1.25e8, 6.25e7])
    assert [s[2] for s in steps] == [10, 20, 40, 80, 160] and steps[-1][1] == 1.08
    # two runs that agree but both far from their ideal (a stalled emulator) do not pass
    with pytest.raises(DilationError, match="no two successive factors .* agreed within 5%"):
        auto_factor("10gbit", lambda r, k: 2.0)
    # a run that halves its time/ideal from K to 2K is held back by per-packet costs: no pass
    with pytest.raises(DilationError, match="give --dilation K"):
        auto_factor("10gbit", lambda r, k: 1000 / k, factors=[10, 20, 40])
    assert probe_factors_for("10gbit")[:3] == [10, 20, 40]
    assert probe_factors_for("300mbit")[:2] == [1, 2]                 # never shaped above the target
    assert all(1e5 / k >= 8e3 for k in probe_factors_for("100kbit"))   # never below tbf's minimum
    assert auto_factor("300mbit", lambda r, k: 1.0)[0] == 1


def test_auto_factor_refuses_a_factor_whose_run_is_cpu_bound():
    """The probe's runs carry the CPU floor (experiments/sweep_cpu.py): a K whose run agrees with 2K and
    is within 25% of its ideal still fails while the processes' CPU floor is half its time or more and
    the run 1.1x its ideal or more (the report's CPU-bound rule), so auto never picks a K the report would
    flag; a CPU-tight run (that share, within 1.1x its ideal) passes, as the report does not flag it."""
    from experiments.sweep_cpu import cpu_bound

    def rec(ratio, share):
        r = {"bound_ratio": ratio, "cpu_floor_share": share, "cpu_floor_ratio": share * ratio}
        return dict(r, cpu_bound=cpu_bound(r))
    by_k = {10: rec(1.2, 0.8), 20: rec(1.18, 0.42), 40: rec(1.17, 0.21), 80: rec(1.16, 0.1)}
    k, steps = auto_factor("10gbit", lambda r, k: by_k[k])
    assert k == 20 and [s[3] for s in steps] == [0.8, 0.42, 0.21]      # 10 agreed with 20 but was CPU-bound
    assert auto_factor("10gbit", lambda r, k: by_k[k]["bound_ratio"])[0] == 10     # ratios alone: the old rule
    with pytest.raises(DilationError, match="not CPU-bound"):
        auto_factor("10gbit", lambda r, k: rec(1.2, 0.6), factors=[10, 20, 40])
    assert auto_factor("10gbit", lambda r, k: rec(1.05, 0.6), factors=[10, 20, 40])[0] == 10


def test_codec_time_counts_cpu_time_not_waiting():
    """The codec's encode + decode is timed in the thread's CPU time: time the thread spends not
    computing (descheduled on a loaded machine; here: asleep) is not counted, computing is."""
    import time

    from experiments.dilation import best_cpu_time
    calls = []
    assert best_cpu_time(lambda: calls.append(time.sleep(0.05)), reps=2) < 0.02 and len(calls) == 3

    def spin():
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.02:
            pass
    assert best_cpu_time(spin, reps=2) >= 0.02


def test_probe_job_ids_fit_the_switchs_job_field():
    """The auto probe's job ids stay in the switch's 16-bit job field for every worker count the switch
    takes (it refused job 66006 with 16 workers before), apart from the sweep's own ids, and differ
    from one probe run to the next."""
    from experiments.dilation import probe_job
    from switch_model.control import MAX_WORKERS
    for n in range(1, MAX_WORKERS + 1):
        ids = [probe_job(n, i) for i in range(1, 2000)]
        assert all(40_000 <= j <= 0xFFFF for j in ids)
        assert all(a != b for a, b in zip(ids, ids[1:]))


def test_dilation_keeps_the_links_queues_in_bytes():
    """tbf's bucket and queues are sized from the shaped rate: for the slow rates dilation shapes at
    (target/K at or below about 72 Mbit/s with MTU 9000) they are the same number of bytes at K and
    2K, so a dilated link queues and drops the same bytes whatever the factor (in the target's time
    its buffer is then bytes / target rate, as a switch port's)."""
    from ina.net.shaping import DOWN_QUEUE_FRAMES, UP_QUEUE_FRAMES, tbf_params
    for k in (200, 400, 800, 3200):
        for frames in (UP_QUEUE_FRAMES, DOWN_QUEUE_FRAMES):
            a = tbf_params(Dilation(k).shaped_rate("10gbit"), 9000, queue_frames=frames)
            b = tbf_params(Dilation(2 * k).shaped_rate("10gbit"), 9000, queue_frames=frames)
            assert (a.burst, a.limit) == (b.burst, b.limit) == (2 * 9014, 2 * 9014 + frames * 9014)
            assert a.rate_bps == pytest.approx(2 * b.rate_bps, rel=1e-5)


def test_consistency_check_separates_the_fixed_cost():
    """bench_dilation: a real-time run carries its per-allreduce fixed cost (the hosts' real time) in
    full, a dilated one 1/K of it; the check is decided on the time above each run's own fixed cost
    (a 256-element allreduce timed in the same sweep), and reports the raw ratio beside it."""
    from experiments.bench_dilation import attach_fixed, compare, line

    def rec(m, el, t, k=1):
        return {"workload": "allreduce", "method": m, "elements": el, "time_median": t, "dilation": k,
                "dilation_label": Dilation(k).label, "bound_ratio": t / 0.136, "wire_up_bytes_per_worker": 1.0}
    # real time: 136 ms of link time + 7 ms fixed; dilated x4: the same link time + 7/4 ms
    real = attach_fixed([rec("ina:nc", 1_700_000, 0.143), rec("ina:nc", 256, 0.0071)], 256, ["1.0"])
    dil = attach_fixed([rec("ina:nc", 1_700_000, 0.13775, 4), rec("ina:nc", 256, 0.0018, 4)], 256, ["1.0"])
    assert set(real) == {"ina:nc"} and real["ina:nc"]["fixed_time"] == 0.0071
    c = compare(real, dil, 0.05)["ina:nc"]
    assert c["ratio"] == pytest.approx(0.963, abs=1e-3) and c["marginal_ratio"] == pytest.approx(1.0, abs=2e-3)
    assert c["within"] and c["fixed_a"] == 0.0071 and c["fixed_b"] == 0.0018
    assert "above the fixed cost (7.10 vs 1.80 ms): 1.000" in line("dilated_vs_real", "ina:nc", c, 0.05)
    # the bytes' time disagreeing is outside, however the raw ratio looks
    slow = attach_fixed([rec("ina:nc", 1_700_000, 0.16, 4), rec("ina:nc", 256, 0.0018, 4)], 256, ["1.0"])
    assert not compare(real, slow, 0.05)["ina:nc"]["within"]
    # without the fixed-cost runs the raw ratio decides
    bare = compare(attach_fixed([rec("gloo", 10, 1.0)], None, []), attach_fixed([rec("gloo", 10, 1.04)], None, []), 0.05)
    assert bare["gloo"]["marginal_ratio"] is None and bare["gloo"]["within"]


def test_consistency_check_names_a_reference_that_is_not_link_bound():
    """A run whose time above its fixed cost is more than the tolerance above the time of the bytes its
    links counted (at the target rate) is no reference: the check says which run and by how much,
    rather than blaming dilation; a link-bound pair that disagrees is still OUTSIDE."""
    from experiments.bench_dilation import attach_fixed, compare, line

    def run(t, k, fixed):       # 4 workers at 100 Mbit/s: 1.7 MB up per worker = 136 ms of link time
        recs = [{"workload": "allreduce", "method": "ina:nc", "elements": el, "time_median": tt, "dilation": k,
                 "dilation_label": Dilation(k).label, "bound_ratio": tt / 0.136, "rate_bps": 100_000_000,
                 "wire_up_bytes_per_worker": 1_700_000.0} for el, tt in ((1_700_000, t), (256, fixed))]
        return attach_fixed(recs, 256, ["20.0"])
    dil = run(0.1390, 4, 0.0015)                                       # 1.011 of its links' time
    loaded = compare(run(0.1560, 1, 0.0060), dil, 0.05)["ina:nc"]      # real time: 1.103 above its fixed cost
    assert not loaded["within"] and loaded["links_ratio_a"] == pytest.approx(1.1029, abs=1e-3)
    assert loaded["links_ratio_b"] == pytest.approx(1.0110, abs=1e-3)
    assert loaded["verdict"] == "not link-bound: real time at 1.103 of its links' time"
    assert "not link-bound: real time at 1.103" in line("dilated_vs_real", "ina:nc", loaded, 0.05)
    quiet = compare(run(0.1440, 1, 0.0035), dil, 0.05)["ina:nc"]
    assert quiet["within"] and quiet["verdict"] == "ok"
    both_bound = compare(run(0.1400, 1, 0.0035), run(0.1250, 4, 0.0015), 0.05)["ina:nc"]
    assert not both_bound["within"] and both_bound["verdict"] == "OUTSIDE"


def test_profile_sets_the_sweeps_switch():
    ap = build_parser()
    assert "--profile" in switch_args(ap.parse_args(["--profile", "tofino"]))
    assert "--elements" not in switch_args(ap.parse_args(["--profile", "tofino"]))      # the profile's 64
    assert switch_args(ap.parse_args([]))[switch_args(ap.parse_args([])).index("--elements") + 1] == "8192"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")
@pytest.mark.timeout(120)
def test_tcp_retransmission_floor_is_stretched_in_the_workers_namespaces():
    """TCP's 200 ms RTO floor is real time: dilated, the workers' namespaces have it x K (at most
    TCP's 120 s; the sweep sets it before its workers open their connections); real time: 200 ms."""
    from experiments.dilation import set_tcp_rto_min, tcp_congestion_control
    from ina.net import Topology
    with Topology(workers=2, rate="10mbit") as topo:
        def floors():
            return [topo.run(w, ["sysctl", "-n", "net.ipv4.tcp_rto_min_us"]).stdout.strip() for w in topo.workers]
        assert set_tcp_rto_min(topo, Dilation(50)) == pytest.approx(10.0) and floors() == ["10000000"] * 2
        assert set_tcp_rto_min(topo, Dilation(6400)) == pytest.approx(120.0) and floors() == ["120000000"] * 2
        assert set_tcp_rto_min(topo, Dilation()) == pytest.approx(0.2) and floors() == ["200000"] * 2
        assert tcp_congestion_control(topo, 2, "reno") == "reno"
        with pytest.raises(DilationError, match="--tcp-cc no-such-cc: sysctl in w0 failed"):
            tcp_congestion_control(topo, 2, "no-such-cc")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")
@pytest.mark.timeout(300)
def test_dilated_sweep_under_the_tofino_profile(tmp_path):
    out = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "experiments.sweep", "--out", str(out), "--target-rates", "1gbit",
                        "--dilation", "10", "--profile", "tofino", "--workers", "2", "--sizes", "60000",
                        "--methods", "gloo,ina:nc,ina:bfp32", "--reps", "2", "--timeout", "30", "--tcp-cc", "reno"],
                       cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "skipping ina:nc: not feasible under switch profile 'tofino'" in p.stderr
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["profile"] == "tofino" and data["meta"]["dilation"] == 10
    assert data["meta"]["tcp_cc"] == "reno"          # the workers' TCP (Gloo's ring), set in their namespaces
    assert data["meta"]["tcp_rto_min_s"] == pytest.approx(2.0)          # TCP's 200 ms floor x K
    recs = {r["method"]: r for r in data["records"]}
    assert set(recs) == {"gloo", "ina:bfp32"}
    for m, r in recs.items():
        assert r["rate"] == "1gbit" and r["shaped_rate_bps"] == pytest.approx(1e8)
        assert r["dilation_label"] == "dilated x10" and r["profile"] == "tofino"
        assert r["ideal_time"] == pytest.approx(ideal_time(m, 2, 60000, "1gbit"))
        assert r["worker_timeout"] == pytest.approx(300)
        assert r["time_end_to_end"] >= r["time_median"]
        assert {"wall", "worker_timeout", "rto", "switch_counters"} <= set(r["real_seconds_fields"])   # real seconds
    # the switch's stage clock over the timed repetitions: its stages partition its busy time
    sc = recs["ina:bfp32"]["switch_counters"]
    stages = {k: v for k, v in sc.items() if k.startswith("ns_")}
    assert {"ns_rx", "ns_aggregate", "ns_tx"} <= set(stages) and sum(stages.values()) == sc["busy_ns"], sc
    assert recs["ina:bfp32"]["rto"] == pytest.approx(10 * ina_rto("ina:bfp32", "1gbit", 64, 9000, 2, max_elements=64))
    # 64 int32 values (256 bytes) per packet: the headers show in the links' byte counters
    per_packet = 256 + HEADER_SIZE + 28 + 14
    up = recs["ina:bfp32"]["wire_up_bytes_per_worker"]
    assert 0.97 * 60000 / 64 * per_packet < up < 1.15 * 60000 / 64 * per_packet, up
    report = (out / "report.md").read_text()
    assert "Switch profile: tofino" in report and "1 Gbit/s, dilated x10" in report and "**Time-dilated**" in report
    assert "Workers' TCP (Gloo): reno." in report
    assert "dilated x10" in (out / "results.csv").read_text()
