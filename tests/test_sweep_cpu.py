"""The CPU floor of a sweep row (experiments/sweep_cpu.py): its arithmetic from a record's measured
figures, the CPU-bound rule, and the flag in every output (results.json, results.csv, report.md,
the terminal's headline, the plots)."""
from __future__ import annotations

import csv
import json

import pytest

from experiments.sweep_cpu import CPU_BOUND_ABOVE_IDEAL, CPU_BOUND_SHARE, cpu_bound, cpu_floor, min_dilation, verdict


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
    # at K = 100 the same CPU is 0.81x the ideal, 0.65 of a time 1.25x the ideal: CPU-bound, K >= 162 needed
    f = cpu_floor(_rec(rate="10gbit", dilation=100.0, ideal=1.36e-3, time=1.7e-3, worker_cpu=40e-3, switch_cpu=60e-3))
    assert f["cpu_bound"] is True and f["cpu_bound_min_dilation"] == min_dilation(f["cpu_floor_ratio"], 100) == 162
    assert 0.11 / 162 / 1.36e-3 < CPU_BOUND_SHARE <= 0.11 / 161 / 1.36e-3


def test_the_rule_share_of_the_time_or_the_ideal():
    assert cpu_bound({"cpu_floor_share": 0.49, "cpu_floor_ratio": 0.6, "bound_ratio": 1.22}) is False
    assert cpu_bound({"cpu_floor_share": 0.5, "cpu_floor_ratio": 0.6, "bound_ratio": 1.2}) is True
    # without bound_ratio, time/ideal is the floor's ratio over its share
    assert verdict({"cpu_floor_share": 0.5, "cpu_floor_ratio": 0.6}) == "bound"
    assert verdict({"cpu_floor_share": 0.5, "cpu_floor_ratio": 0.52}) == "tight"
    # a loaded machine stretches the time (a small share), but a floor above the ideal is out of the link's pace
    assert cpu_bound({"cpu_floor_share": 0.2, "cpu_floor_ratio": 1.0}) is True
    # unshaped: no ideal, the share decides
    assert cpu_bound({"cpu_floor_share": 0.7, "cpu_floor_ratio": None}) is True
    assert cpu_bound({}) is None
    # a lightly loaded row: 2 workers at 100 Mbit/s
    assert cpu_floor(_rec(n=2, rate="100mbit", ideal=0.136, time=0.14))["cpu_bound"] is False
    # records without the figures (throughput, or before the cores were recorded) get no floor at all
    assert cpu_floor({**_rec(), "cpu_cores": None}) == {} and cpu_floor({**_rec(), "workload": "throughput"}) == {}


def test_a_row_at_its_ideal_with_a_high_share_is_cpu_tight_not_cpu_bound():
    """A row within CPU_BOUND_ABOVE_IDEAL of its ideal kept the link's pace, however busy its cores were:
    its time/ideal measures the link, so it is CPU-tight (no K, no mark), not CPU-bound. Figures of a
    stored CI sweep on 2 cores (425k elements, 1 Gbit/s, 2 workers): bfp32 at 1.02x its ideal with its
    floor 0.72 of the time, nc at 1.09x with 0.85; and Gloo's ring, 8 workers at 1 Gbit/s with 12 ms of
    CPU each, at exactly its ideal: 0.504 of the time."""
    bfp = cpu_floor(_rec(method="ina:bfp32", n=2, worker_cpu=7.29e-3, switch_cpu=5.3e-3, ideal=13.6e-3, time=13.81e-3))
    assert bfp["cpu_floor_share"] > 0.7 and bfp["cpu_bound"] is False and bfp["cpu_tight"] is True
    assert bfp["cpu_bound_min_dilation"] is None
    nc = cpu_floor(_rec(n=2, worker_cpu=2.09e-3, switch_cpu=2.17e-3, ideal=3.4e-3, time=3.72e-3))
    assert nc["cpu_floor_share"] > 0.8 and nc["cpu_floor_ratio"] < 1 and nc["cpu_tight"] and not nc["cpu_bound"]
    ideal = 2 * 7 / 8 * 4 * 1.7e6 * 8 / 1e9
    g = cpu_floor(_rec(method="gloo", n=8, switch_cpu=0, worker_cpu=12e-3, ideal=ideal, time=ideal))
    assert g["cpu_floor_share"] == pytest.approx(0.504, abs=1e-3) and g["cpu_bound"] is False and g["cpu_tight"]
    # the same share, measurably above the ideal: CPU-bound; a floor at the ideal is CPU-bound wherever the time is
    assert cpu_floor(_rec(n=2, worker_cpu=2.09e-3, switch_cpu=2.17e-3, ideal=3.4e-3,
                          time=3.4e-3 * CPU_BOUND_ABOVE_IDEAL * 1.01))["cpu_bound"] is True
    assert verdict({"cpu_floor_share": 0.98, "cpu_floor_ratio": 1.0, "bound_ratio": 1.02}) == "bound"
    # a low share is neither
    assert cpu_floor(_rec(n=2, rate="100mbit", ideal=0.136, time=0.14))["cpu_tight"] is False


def test_the_flag_and_its_explanation_are_in_the_json_csv_report_and_headline(tmp_path):
    from experiments.sweep_report import headline, report_md
    from experiments.sweep_results import derive, save_results
    recs = derive([_rec(method="gloo", switch_cpu=0, worker_cpu=5e-3, ideal=40.8e-3, time=42e-3),
                   _rec(), _rec(n=2, rate="100mbit", ideal=0.136, time=0.14),
                   _rec(n=2, rate="100mbit", method="gloo", switch_cpu=0, worker_cpu=5e-3, ideal=0.136, time=0.15),
                   # at its ideal (1.03x) with its floor 0.79 of the time: CPU-tight, not CPU-bound
                   _rec(rate="100mbit", ideal=0.136, time=0.14, worker_cpu=40e-3, switch_cpu=60e-3),
                   _rec(rate="100mbit", method="gloo", switch_cpu=0, worker_cpu=5e-3, ideal=0.408, time=0.42),
                   _rec(rate="unlimited", ideal=None, time=20e-3)],          # unshaped: no link paces it
                  {"resnet110": 1_700_000})
    save_results(tmp_path, {"command": "test"}, recs)
    data = json.loads((tmp_path / "results.json").read_text())
    assert [(r["cpu_bound"], r["cpu_tight"]) for r in data["records"]] == [
        (False, False), (True, False), (False, False), (False, False), (False, True), (False, False), (True, False)]
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [r["cpu_bound"] for r in rows] == ["False", "True", "False", "False", "False", "False", "True"]
    assert rows[4]["cpu_tight"] == "True" and rows[4]["cpu_bound_min_dilation"] == ""
    assert float(rows[1]["cpu_floor_ratio"]) == pytest.approx(16.3 / 13.6) and rows[1]["cpu_bound_min_dilation"] == "3"
    md = report_md({"command": "test"}, recs, [])
    table = md[md.index("## All allreduce measurements"):]
    assert "| CPU floor/ideal | CPU-bound (floor/time) |" in table
    lines = table.splitlines()
    assert next(ln for ln in lines if ln.startswith("| 4 | 1 Gbit/s |") and "INA nc" in ln).endswith(
        "| 1.20 | **yes** 0.55 (K >= 3) |")
    assert next(ln for ln in lines if ln.startswith("| 2 | 100 Mbit/s |") and "INA nc" in ln).endswith(" | no 0.07 |")
    assert next(ln for ln in lines if ln.startswith("| 4 | 100 Mbit/s |") and "INA nc" in ln).endswith(
        " | 0.81 | tight 0.79 |")
    # under the table: the unshaped rows in a phrase, the shaped CPU-bound and CPU-tight rows in a small table
    assert "**CPU-bound rows: 2 of 7**, 1 of them unshaped (no link sets their pace" in table
    assert "**CPU-tight rows: 1** (within 1.1x their ideal: they measure the link" in table
    assert "| 4 | 1 Gbit/s | INA nc | CPU-bound | 2.18 | 1.20 | 0.55 | 3 |" in lines
    assert "| 4 | 100 Mbit/s | INA nc | CPU-tight | 1.03 | 0.81 | 0.79 | – |" in lines
    assert not any(ln.startswith("| 4 | unshaped |") and "CPU-bound |" in ln for ln in lines)   # the phrase only
    assert "`--dilation auto`" in table and "not the emulated link" in table
    assert "derived from measured CPU, not measured time" in table
    # the speed-up table marks the CPU-bound cell, not the CPU-tight one
    speed = md[md.index("## Speedup over Gloo ring fp32 (4 workers"):md.index("## All allreduce")]
    nc_speed = next(ln for ln in speed.splitlines() if ln.startswith("| INA nc"))
    assert nc_speed.count("†") == 2 and "†: CPU-bound row" in speed       # 1 Gbit/s and unshaped
    # the terminal's headline: the cell marked and the mark explained; the CPU-tight cell unmarked
    head = "\n".join(headline({}, recs))
    assert f"({recs[1]['bound_ratio']:.2f})*" in head and "*: CPU-bound" in head
    assert f"({recs[4]['bound_ratio']:.2f})" in head and f"({recs[4]['bound_ratio']:.2f})*" not in head


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
