"""The sweep's results on disk: results.json (every record, resumable) and results.csv, and the
derived columns (speed-up over Gloo in the same setting, model names, the CPU floor and the
CPU-bound flag: experiments/sweep_cpu.py)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from .sweep_methods import aggregation


def load_results(out: Path) -> list[dict]:
    p = out / "results.json"
    if not p.exists():
        return []
    return json.loads(p.read_text())["records"]


def save_results(out: Path, meta: dict, records: list[dict]) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    tmp.replace(out / "results.json")
    cols = ["workload", "method", "aggregation", "workers", "rate", "rate_bps", "elements", "model", "reps", "time_median",
            "time_mean", "time_min", "ideal_time", "bound_ratio", "speedup_vs_gloo", "wire_up_bytes_per_worker",
            "wire_down_bytes_per_worker", "wire_drops", "client_bytes_sent_per_worker", "client_retransmissions",
            "client_probe_retransmissions", "client_stall_probes",
            "rel_error", "compute_time", "samples_per_s", "steps", "final_accuracy", "train_time", "comm_time",
            "dilation", "dilation_label", "shaped_rate_bps", "profile", "codec_time_cpu", "codec_time_device",
            "time_end_to_end", "worker_cpu_per_allreduce", "cpu_cores", "job_cpu_per_allreduce",
            "switch_cpu_per_allreduce", "switch_cpu_source", "cpu_floor", "cpu_floor_ratio", "cpu_floor_share",
            "cpu_bound", "cpu_tight", "cpu_bound_min_dilation", "loss", "impairment"]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow(r)


def derive(records: list[dict], sizes: dict[str, int]) -> list[dict]:
    """Speedups vs Gloo (same workload, workers, rate and size), the model names and the CPU floor
    (recomputed under the current rule: experiments/sweep_cpu.py)."""
    from .sweep_cpu import add_cpu_floor
    by = {(r["workload"], r["method"], r["workers"], r["rate"], r["elements"]): r for r in records}
    inv = {v: k for k, v in sizes.items()}
    for r in records:
        r["model"] = inv.get(r["elements"], r.get("model"))
        r["aggregation"] = aggregation(r["method"])
        g = by.get((r["workload"], "gloo", r["workers"], r["rate"], r["elements"]))
        if r["workload"] == "allreduce":
            r["speedup_vs_gloo"] = g["time_median"] / r["time_median"] if g else None
            add_cpu_floor(r)
        elif r["workload"] == "throughput":
            r["speedup_vs_gloo"] = r["samples_per_s"] / g["samples_per_s"] if g else None
    return records
