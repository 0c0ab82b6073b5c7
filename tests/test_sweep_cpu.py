"""The CPU floor of a sweep row (experiments/sweep_cpu.py): its arithmetic from a record's measured
figures, the CPU-bound rule, and the flag in every output (results.json, results.csv, report.md,
the terminal's headline, the plots)."""
from __future__ import annotations

import csv
import json

import pytest

from experiments.sweep_cpu import CPU_BOUND_SHARE, cpu_bound, cpu_floor, min_dilation


def _rec(method="ina:nc", n=4, rate="1gbit", worker_cpu=6.1e-3, switch_cpu=8.2e-3, reps=5, cores=2,
         ideal=13.6e-3, time=29.6e-3, dilation=1.0, **kw):
    """An allreduce record as run_bench writes it (times in the target's time, CPU in real seconds)."""
    return {"workload": "allreduce", "method": method, "workers": n, "rate": rate, "elements": 1_700_000,
            "reps": reps, "time_median": time, "ideal_time": ideal, "bound_ratio": time / ideal if ideal else None,
            "worker_cpu_per_allreduce": worker_cpu, "cpu_cores": cores, "dilation": dilation,
            "switch_counters": {"busy_cpu_ns": round(switch_cpu * reps * 1e9), "harvested": 10},
            "wire_up_bytes_per_worker": 1.7e6, "wire_down_bytes_per_worker": 1.7e6, "wire_drops": 0,
            "rel_error": 0.01, **kw}


def test_the_floor_is_the_jobs_measured_cpu_over_the_cores():
    """4 workers at 6.1 ms of CPU each + the switch's 8.2 ms of busy CPU per allreduce = 32.6 ms on 2 cores:
    16.3 ms, 1.20x the 13.6 ms ideal (docs/performance.md's 4-worker, 1 Gbit/s figures), 0.55 of a
    29.6 ms allreduce: CPU-bound, and it would take a dilation of 3 to put that floor under half the ideal."""
    f = cpu_floor(_rec())
    assert f["job_cpu_per_allreduce"] == pytest.approx(4 * 6.1e-3 + 8.2e-3)
    assert f["cpu_floor"] == pytest.approx(32.6e-3 / 2)
    assert f["cpu_floor_ratio"] == pytest.approx(16.3 / 13.6)
    assert f["cpu_floor_share"] == pytest.approx(16.3 / 29.6)
    assert f["cpu_bound"] is True and f["cpu_bound_min_dilation"] == 3
    assert 1.2 / 3 < CPU_BOUND_SHARE <= 1.2 / 2        # K = 2 would leave the floor at 0.6 of the ideal
    # the cores count: the same CPU on 8 cores is a quarter of the floor
    assert cpu_floor(_rec(cores=8))["cpu_floor"] == pytest.approx(32.6e-3 / 8)
    # a Gloo row: no switch CPU, the workers' process CPU (Gloo's threads included) alone
    g = cpu_floor(_rec(method="gloo", switch_cpu=0, worker_cpu=4e-3, ideal=40.8e-3, time=45e-3))
    assert g["cpu_floor"] == pytest.approx(8e-3) and g["cpu_bound"] is False and g["cpu_bound_min_dilation"] is None


def test_dilated_cpu_seconds_are_real_so_the_floor_is_divided_by_k():
    """Under dilation xK the CPU seconds are real and the times are the target's (/ K): the floor is / K."""
    f = cpu_floor(_rec(rate="10gbit", dilation=800.0, ideal=1.36e-3, time=1.45e-3, worker_cpu=40e-3, switch_cpu=60e-3))
    assert f["cpu_floor"] == pytest.approx((4 * 40e-3 + 60e-3) / 2 / 800)
    assert f["cpu_floor_share"] == pytest.approx(0.22 / 2 / 800 / 1.45e-3) and f["cpu_bound"] is False
    # at K = 100 the same CPU is 0.81x the ideal and 0.76 of the time: CPU-bound, K >= 162 needed
    f = cpu_floor(_rec(rate="10gbit", dilation=100.0, ideal=1.36e-3, time=1.45e-3, worker_cpu=40e-3, switch_cpu=60e-3))
    assert f["cpu_bound"] is True and f["cpu_bound_min_dilation"] == min_dilation(f["cpu_floor_ratio"], 100) == 162
    assert 0.11 / 162 / 1.36e-3 < CPU_BOUND_SHARE <= 0.11 / 161 / 1.36e-3


def test_the_rule_share_of_the_time_or_the_ideal():
    assert cpu_bound({"cpu_floor_share": 0.49, "cpu_floor_ratio": 0.55}) is False
    assert cpu_bound({"cpu_floor_share": 0.5, "cpu_floor_ratio": 0.55}) is True
    # a loaded machine stretches the time (a small share), but a floor above the ideal is out of the link's pace
    assert cpu_bound({"cpu_floor_share": 0.2, "cpu_floor_ratio": 1.0}) is True
    # unshaped: no ideal, the share decides
    assert cpu_bound({"cpu_floor_share": 0.7, "cpu_floor_ratio": None}) is True
    assert cpu_bound({}) is None
    # a lightly loaded row: 2 workers at 100 Mbit/s
    assert cpu_floor(_rec(n=2, rate="100mbit", ideal=0.136, time=0.14))["cpu_bound"] is False
    # records without the figures (throughput, or before the cores were recorded) get no floor at all
    assert cpu_floor({**_rec(), "cpu_cores": None}) == {} and cpu_floor({**_rec(), "workload": "throughput"}) == {}


def test_the_flag_and_its_explanation_are_in_the_json_csv_report_and_headline(tmp_path):
    from experiments.sweep_report import headline, report_md
    from experiments.sweep_results import derive, save_results
    recs = derive([_rec(method="gloo", switch_cpu=0, worker_cpu=5e-3, ideal=40.8e-3, time=42e-3),
                   _rec(), _rec(n=2, rate="100mbit", ideal=0.136, time=0.14),
                   _rec(n=2, rate="100mbit", method="gloo", switch_cpu=0, worker_cpu=5e-3, ideal=0.136, time=0.15)],
                  {"resnet110": 1_700_000})
    save_results(tmp_path, {"command": "test"}, recs)
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["cpu_bound"] for r in data["records"]] == [False, True, False, False]
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [r["cpu_bound"] for r in rows] == ["False", "True", "False", "False"]
    assert float(rows[1]["cpu_floor_ratio"]) == pytest.approx(16.3 / 13.6) and rows[1]["cpu_bound_min_dilation"] == "3"
    md = report_md({"command": "test"}, recs, [])
    table = md[md.index("## All allreduce measurements"):]
    assert "| CPU floor/ideal | CPU-bound (floor/time) |" in table
    nc_1g = next(ln for ln in table.splitlines() if "| 1 Gbit/s |" in ln and "INA nc" in ln)
    assert nc_1g.endswith("| 1.20 | **yes** 0.55 (K >= 3) |")
    assert next(ln for ln in table.splitlines() if "| 100 Mbit/s |" in ln and "INA nc" in ln).endswith(" | no 0.07 |")
    assert "CPU-bound rows: 1 of 4" in table and "INA nc, 4 workers, 1 Gbit/s" in table
    assert "`--dilation auto`" in table and "not the emulated link" in table
    assert "derived from measured CPU, not measured time" in table
    # the speed-up table marks the CPU-bound cell
    speed = md[md.index("## Speedup over Gloo ring fp32 (4 workers"):md.index("## All allreduce")]
    assert "†" in next(ln for ln in speed.splitlines() if ln.startswith("| INA nc")) and "†: CPU-bound row" in speed
    # the terminal's headline: the cell marked and the mark explained
    head = "\n".join(headline({}, recs))
    assert f"({recs[1]['bound_ratio']:.2f})*" in head and "*: CPU-bound" in head


def test_plots_mark_cpu_bound_points(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from experiments import sweep_report
    from experiments.sweep_results import derive
    seen = {}

    def keep(fig, path):
        seen[path.name] = fig
    monkeypatch.setattr(sweep_report, "_save", keep)
    recs = derive([_rec(method="gloo", switch_cpu=0, worker_cpu=5e-3, ideal=40.8e-3, time=42e-3), _rec(),
                   _rec(method="gloo", rate="100mbit", switch_cpu=0, worker_cpu=5e-3, ideal=0.408, time=0.42),
                   _rec(rate="100mbit", ideal=0.136, time=0.14)], {})
    sweep_report.plots(tmp_path, recs)
    fig = seen["speedup_vs_bandwidth.png"]
    marks = [t for ax in fig.axes for t in ax.texts if t.get_text() == sweep_report.CPU_MARK]
    assert len(marks) == 1                                 # the 1 Gbit/s nc point only
    assert any("CPU-bound" in t.get_text() for t in fig.legends[0].get_texts())


def test_the_switch_cpu_is_its_processes_when_larger_and_the_record_says_which():
    """An INA row counts the larger of the switch's processes' CPU (control plane, host aggregator, every
    shard) and its data planes' busy CPU, and says which (``switch_cpu_source``); a Gloo row, which the
    switch idles through, its data planes' busy CPU alone; a record without the processes' CPU the busy CPU."""
    def with_procs(procs_ms, **kw):
        r = _rec(**kw)
        r["switch_counters"]["process_cpu_ns"] = round(procs_ms * 1e-3 * r["reps"] * 1e9)
        return r
    f = cpu_floor(with_procs(11.0))
    assert f["switch_cpu_per_allreduce"] == pytest.approx(11e-3) and f["switch_cpu_source"] == "processes"
    assert f["job_cpu_per_allreduce"] == pytest.approx(4 * 6.1e-3 + 11e-3)
    f = cpu_floor(with_procs(5.0))           # below the busy CPU (a clock's rounding): the busy CPU
    assert f["switch_cpu_per_allreduce"] == pytest.approx(8.2e-3) and f["switch_cpu_source"] == "data plane"
    g = cpu_floor(with_procs(3.0, method="gloo", switch_cpu=0, worker_cpu=4e-3, ideal=40.8e-3, time=45e-3))
    assert g["switch_cpu_per_allreduce"] == 0 and g["switch_cpu_source"] == "data plane"
    assert cpu_floor(_rec())["switch_cpu_source"] == "data plane"
