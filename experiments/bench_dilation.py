"""Is time dilation consistent? The same target measured at two dilation factors, and a target that
also runs in real time, measured both ways (ina-sweep runs in one process each, back to back).

    python -m experiments.bench_dilation --json out.json            # needs root (emulated links)
    python -m experiments.bench_dilation --k 100 --workers 8 --target 10gbit --sizes 1.7M

Checks (median allreduce times, per method; ratios between runs of this bench):

* ``k_vs_2k``: the target (default 8 workers at 10 Gbit/s, ResNet-110's 1.7 M elements) at K and 2K:
  time(2K) / time(K) should be 1 within 5%;
* ``dilated_vs_real``: a real-time-capable target (default 4 workers at 100 Mbit/s) in real time and
  dilated x``--real-k``: time(dilated) / time(real) should be 1 within 5%.

Short runs (3 timed repetitions): the machine is shared; the ratios are the result, not the times.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sweep(out: Path, *argv: str) -> dict:
    """One ina-sweep run; {method: record} of its allreduce records."""
    cmd = [sys.executable, "-m", "experiments.sweep", "--out", str(out), "--no-plots", *argv]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    recs = json.loads((out / "results.json").read_text())["records"]
    return {r["method"]: r for r in recs if r["workload"] == "allreduce"}


def compare(a: dict, b: dict, tol: float) -> dict:
    out = {}
    for m in a:
        if m in b:
            ratio = b[m]["time_median"] / a[m]["time_median"]
            out[m] = {"ratio": ratio, "within": abs(ratio - 1) <= tol, "time_a": a[m]["time_median"],
                      "time_b": b[m]["time_median"], "label_a": a[m].get("dilation_label"),
                      "label_b": b[m].get("dilation_label"), "bound_ratio_a": a[m].get("bound_ratio"),
                      "bound_ratio_b": b[m].get("bound_ratio"), "wire_up_a": a[m]["wire_up_bytes_per_worker"],
                      "wire_up_b": b[m]["wire_up_bytes_per_worker"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="10gbit")
    ap.add_argument("--workers", default="8")
    ap.add_argument("--k", type=float, default=100.0, help="the first factor (the second is twice it)")
    ap.add_argument("--sizes", default="resnet110")
    ap.add_argument("--methods", default="gloo,ina:bfp32,ina:nc")
    ap.add_argument("--real-rate", default="100mbit")
    ap.add_argument("--real-workers", default="4")
    ap.add_argument("--real-k", type=float, default=4.0)
    ap.add_argument("--reps", default="3")
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--skip", choices=("k_vs_2k", "dilated_vs_real"), action="append", default=[])
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    common = ["--sizes", a.sizes, "--methods", a.methods, "--reps", a.reps, "--timeout", "60"]
    res = {"settings": vars(a) | {"json": str(a.json)}, "tolerance": a.tol}
    t = Path(tempfile.mkdtemp(prefix="bench-dilation-"))      # kept: the sweeps' reports and worker logs
    res["folder"] = str(t)
    if "k_vs_2k" not in a.skip:
        dil = ["--target-rates", a.target, "--workers", a.workers, *common]
        r1 = sweep(t / "k", *dil, "--dilation", f"{a.k:g}")
        r2 = sweep(t / "2k", *dil, "--dilation", f"{2 * a.k:g}")
        res["k_vs_2k"] = compare(r1, r2, a.tol)
    if "dilated_vs_real" not in a.skip:
        real = sweep(t / "real", "--rates", a.real_rate, "--workers", a.real_workers, "--acc-steps", "0",
                     "--tp-sizes", "none", *common)
        dil = sweep(t / "dil", "--target-rates", a.real_rate, "--workers", a.real_workers, "--dilation",
                    f"{a.real_k:g}", *common)
        res["dilated_vs_real"] = compare(real, dil, a.tol)
    for check in ("k_vs_2k", "dilated_vs_real"):
        for m, c in res.get(check, {}).items():
            print(f"{check:16s} {m:12s} ratio {c['ratio']:.3f} ({c['label_a']} {c['time_a']:.4f} s vs "
                  f"{c['label_b']} {c['time_b']:.4f} s) {'ok' if c['within'] else 'OUTSIDE'} {a.tol:.0%}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
