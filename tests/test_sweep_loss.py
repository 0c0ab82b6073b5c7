"""ina-sweep --loss: packet loss as a sweep dimension (experiments/sweep_loss.py), end to end on a real
emulated topology, and its argument checks."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.sweep_loss import parse_losses, plan_at

ROOT = Path(__file__).resolve().parent.parent


def test_loss_levels_always_include_the_lossless_reference_and_bad_ones_are_named():
    ap = argparse.ArgumentParser()
    assert parse_losses(ap, "0.01,0.001") == [0.0, 0.001, 0.01]
    for bad in ("1.5", "-0.1", "lots"):
        with pytest.raises(SystemExit):
            parse_losses(ap, bad)
    p = subprocess.run([sys.executable, "-m", "experiments.sweep", "--out", "/nonexistent/x", "--loss", "0,1.5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--loss 1.5" in p.stderr


def test_bench_loss_names_a_malformed_baseline_environment_before_starting_anything(capsys):
    """bench_loss --baseline-env takes NAME=VALUE pairs (the baseline's workers' environment, to pair a
    tree against itself with a switch such as INA_TIMER_FLOOR=0); anything else is refused by name."""
    from experiments.bench_loss import main as bench_loss
    with pytest.raises(SystemExit) as e:
        bench_loss(["--baseline-env", "INA_TIMER_FLOOR=0", "FLOOR"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "NAME=VALUE" in err and "['FLOOR']" in err, err


def test_bench_loss_median_interval_covers_the_median_as_often_as_it_says():
    """bench_loss's confidence interval of the median per-round ratio: the textbook order statistics
    (n = 20: the 6th and 15th smallest), and, over many samples of a skewed distribution (seeded),
    it contains the true median at least as often as its stated coverage."""
    import numpy as np
    from experiments.bench_loss import median_interval
    lo, hi, cov = median_interval(np.arange(20.0)[::-1])
    assert (lo, hi) == (5.0, 14.0) and 0.95 <= cov < 0.96
    assert median_interval([3.0, 1.0, 2.0])[:2] == (1.0, 3.0)      # too few rounds: the whole range
    rng = np.random.default_rng(7)
    true_median = np.exp(0.0)                                       # of a lognormal(0, 1)
    hits = [lo <= true_median <= hi for lo, hi, _ in (median_interval(rng.lognormal(0, 1, 15)) for _ in range(2000))]
    assert np.mean(hits) >= median_interval(np.zeros(15))[2] - 0.015


def test_bench_loss_writes_an_undefined_value_as_null_and_refuses_zero_rounds(capsys):
    """resend_cost is undefined (NaN) where no block has allreduces both with and without a resend: the
    JSON says null (a bare NaN is not JSON); --rounds 0 is refused with a message naming it."""
    import json as js

    from experiments.bench_loss import finite_or_null, main as bench_loss, resend_cost
    cost = resend_cost([{"times": [1.0, 2.0], "resent": [True, True]}])
    text = js.dumps(finite_or_null({"results": [cost], "inf": float("inf")}), allow_nan=False)
    back = js.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert back["results"][0]["expected_vs_clean"] is None and back["inf"] is None
    assert back["results"][0]["share_with_resend"] == 1.0
    with pytest.raises(SystemExit):
        bench_loss(["--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err


def test_bench_loss_draws_each_rounds_drops_from_a_seed_of_its_own_the_same_for_every_setting_and_tree(monkeypatch):
    """Each round's impairment seed is derived from --seed and the round (fixed: the same run draws the same
    patterns), distinct from round to round, and shared by every setting and both trees of the round (so a
    paired tree gets the same draws; which packets they drop depends on what it sends); the warm-up keeps
    the base seed."""
    import experiments.bench_loss as bl

    class Row(dict):
        def __missing__(self, key):
            return 0

    class FakeSide:
        def __init__(self, label):
            self.label, self.seeds = label, []

        def block(self, elements, reps, seed, imp):
            self.seeds.append((len(self.seeds), seed, tuple(imp.items())))
            return {"time": 1.0, "worker_cpu": 1.0}
    monkeypatch.setattr(bl, "summarise", lambda *a, **k: Row(exact=True))
    sides = [FakeSide("this"), FakeSide("baseline")]
    settings = {"lossless": {}, "loss 1%": {"loss": 0.01}}
    bl._run_all(sides, 4, [1000], {1000: 2}, 3, 7, settings)
    for side in sides:
        warm, *blocks = side.seeds
        assert warm[1] == 7
        assert [b[1] for b in blocks] == [bl.round_seed(7, i) for i in range(3) for _ in settings]
    assert sides[0].seeds == sides[1].seeds
    seeds = [bl.round_seed(7, i) for i in range(20)]
    assert len(set(seeds)) == 20 and all(0 <= x < 2**32 for x in seeds)
    # no range to keep: a seed of any size (the egress's + 1, a shard's offset) seeds the switch's impairments
    from switch_model.impair import Impairment, ImpairmentConfig
    from switch_model.shards import shard_seed
    Impairment(ImpairmentConfig(loss=0.5, seed=shard_seed(2**32 + 1, 3)))
    assert seeds == [bl.round_seed(7, i) for i in range(20)] and seeds[:3] != [bl.round_seed(8, i) for i in range(3)]


def test_bench_loss_counts_the_switchs_processes_cpu_as_the_sweeps_cpu_floor_does(monkeypatch):
    """bench_loss's switch CPU per allreduce is every process of the switch (its shards' processes, control
    plane included, and its host aggregator's: ``sweep_cpu.switch_process_cpu_ns``), or its data planes'
    busy CPU where that is larger (a switch that does not report its processes), and says which."""
    import experiments.bench_loss as bl

    def stats(busy_ms, shards_ms, host_agg_ms=None):
        st = {"impairments": {d: {"dropped": 0, "duplicated": 0, "reordered": 0} for d in ("ingress", "egress")},
              "counters": {"replays": 0}, "drops": {"retransmit_pending": 0},
              "timing": {"busy_cpu_ns": busy_ms * 10**6, "tx_cpu_ns": 0, "bursts": 0, "stage_ns": {}}}
        if shards_ms is not None:
            st["timing"]["process_cpu_ns"] = shards_ms * 10**6
        if host_agg_ms is not None:
            st["host_aggregator"] = {"process_cpu_ns": host_agg_ms * 10**6}
        return st

    def row(before, after, reps=2):
        snaps = iter([before, after])
        monkeypatch.setattr(bl, "request", lambda *a, **k: {"stats": next(snaps)})
        sw0, sw1 = bl.switch_counts("h", 1), bl.switch_counts("h", 1)
        block = {"time": 1.0, "times": [1.0] * reps, "resent": [False] * reps, "tail": 0.0, "digest": "d",
                 "worker_cpu": 0.0, "turns": 0.0, "idle_turns": 0.0, "encode": 0.0, "decode": 0.0,
                 "counters": dict.fromkeys(bl.COUNTERS, 0), "switch": {k: sw1[k] - sw0[k] for k in sw1}}
        r = bl.summarise(4, 1000, "lossless", {}, [block], [block], reps)
        return r["switch_cpu_per_allreduce_s"], r["switch_cpu_source"]
    # 2 allreduces: the data planes were busy 10 ms, the shards' processes ran 30 ms, the host aggregator 4 ms
    assert row(stats(100, 500, 50), stats(110, 530, 54)) == (pytest.approx(17e-3), "processes")
    assert row(stats(100, 500), stats(110, 530)) == (pytest.approx(15e-3), "processes")
    assert row(stats(100, None), stats(110, None)) == (pytest.approx(5e-3), "data plane")


def test_only_switch_traffic_runs_at_a_loss():
    plan = [("allreduce", 2, "100mbit", 1000, "gloo"), ("allreduce", 2, "100mbit", 1000, "ina:bfp32"),
            ("throughput", 2, "100mbit", 1000, "ina:bfp32"), ("allreduce", 2, "100mbit", 1000, "ina:3lc"),
            ("accuracy", 2, "100mbit", 0, "ina:bfp32")]
    assert plan_at(plan, 0.0) == plan
    assert plan_at(plan, 0.01) == [plan[1], plan[2]]     # Gloo (TCP), host-aggregated 3lc, accuracy: lossless only


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")
@pytest.mark.timeout(300)
def test_tiny_sweep_with_loss_labels_every_record_and_plots_time_against_loss(tmp_path):
    out = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "experiments.sweep", "--out", str(out), "--rates", "100mbit",
                        "--workers", "2", "--sizes", "60000", "--methods", "gloo,ina:bfp32", "--reps", "2",
                        "--acc-steps", "0", "--tp-sizes", "60000", "--tp-steps", "2", "--timeout", "30",
                        "--loss", "0,0.01"], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "6 configuration(s) run" in p.stderr      # lossless: 2 methods x 2 workloads; at 1%: bfp32's two
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["losses"] == [0.0, 0.01]
    recs = {(r["workload"], r["method"], r["loss"]): r for r in data["records"]}
    assert set(recs) == {(w, m, 0.0) for w in ("allreduce", "throughput") for m in ("gloo", "ina:bfp32")} | {
        ("allreduce", "ina:bfp32", 0.01), ("throughput", "ina:bfp32", 0.01)}
    assert "lossless reference" in recs["allreduce", "gloo", 0.0]["impairment"]
    lossy = recs["allreduce", "ina:bfp32", 0.01]
    assert "loss 0.01 in each direction" in lossy["impairment"]
    assert lossy["client_retransmissions"] > 0                      # the switch did drop packets
    assert lossy["rel_error"] <= 2 * recs["allreduce", "ina:bfp32", 0.0]["rel_error"] + 1e-7   # still exact sums
    csv = (out / "results.csv").read_text().splitlines()
    assert csv[0].endswith(",loss,impairment") and len(csv) == 1 + len(data["records"])
    report = (out / "report.md").read_text()
    assert "## Packet loss" in report and "gloo (lossless reference, not impaired)" in report
    for name in ("loss-allreduce-n2-100mbit-60000.png", "loss-throughput-n2-100mbit-60000.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in report
    # the lossless tables above it are the lossless runs only: one row per method
    assert "Speedup over Gloo ring fp32" in report.split("## Packet loss")[0]
