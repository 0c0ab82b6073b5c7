"""Is time dilation consistent? The same target measured at two dilation factors, and a target that
also runs in real time, measured both ways (ina-sweep runs in one process each, back to back).

    python -m experiments.bench_dilation --json out.json            # needs root (emulated links)
    python -m experiments.bench_dilation --k 100 --workers 8 --target 10gbit --sizes 1.7M
    python -m experiments.bench_dilation --k gloo=100,ina:bfp32=400,ina:nc=800 --sizes alexnet --reps 1

Checks (median allreduce times, per method; ratios between runs of this bench):

* ``k_vs_2k``: the target (default 8 workers at 10 Gbit/s, ResNet-110's 1.7 M elements) at K and 2K:
  time(2K) / time(K) should be 1 within 5%;
* ``dilated_vs_real``: a real-time-capable target (default 4 workers at 100 Mbit/s) in real time and
  dilated x``--real-k``: time(dilated) / time(real) should be 1 within 5%.

``--k`` is one factor for every method, or one per method (``method=K,...``): each method's check
compares its own K and 2K. Short runs (3 timed repetitions): the machine is shared; the ratios are
the result, not the times; each run records the load average before it.

Per-allreduce fixed costs (negotiation, the workers' start skew, the first send, Gloo's per-step
latency) are the hosts' real time: dilation divides them by K in the reported time, like every other
CPU cost. Each sweep therefore also times a ``--fixed-size`` allreduce (256 elements: one packet, no
link time to speak of) at the same setting, and each check reports, beside the ratio of the times,
the ratio of the times above it (``marginal_ratio``: (time - fixed) in run b / the same in run a:
the part the links set). ``within`` is decided on the marginal ratio when it is measured; the raw
ratio and both fixed costs are in the output, so what was subtracted is visible.

A run is a reference only while its links set its pace: each check also reports each run's time above
its fixed cost over the time of the bytes its links counted at the target rate (``links_ratio_a/b``).
A check outside the tolerance whose run is more than the tolerance above its links' time says so
(``verdict``: "not link-bound: real time at 1.098 of its links' time") instead of "OUTSIDE": on a
loaded machine a real-time run's per-chunk wake-ups, not its links, set its pace, and that is the
hosts' cost which dilation divides by K.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_factors(text: str, methods: list[str]) -> dict[str, float]:
    """--k: 'K' for every method, or 'method=K,...' (every method of --methods named once)."""
    if "=" not in text:
        return {m: float(text) for m in methods}
    ks = {m.strip(): float(k) for m, k in (p.split("=", 1) for p in text.split(","))}
    if set(ks) != set(methods):
        raise SystemExit(f"--k {text}: name a factor for each of --methods {','.join(methods)}")
    return ks


def sweeps(out: Path, ks: dict[str, float], scale: float, *argv: str, fixed: int | None = None) -> dict:
    """One ina-sweep per distinct factor (K x ``scale``) of ``ks``: {method: record}."""
    recs = {}
    for k in sorted(set(ks.values())):
        ms = ",".join(m for m in ks if ks[m] == k)
        recs |= sweep(out / f"x{k * scale:g}", *argv, "--methods", ms, "--dilation", f"{k * scale:g}", fixed=fixed)
    return recs


def with_sizes(argv: tuple, fixed: int | None) -> list[str]:
    """``argv`` with the fixed-cost size appended to its --sizes."""
    argv = list(argv)
    if fixed:
        i = argv.index("--sizes") + 1
        argv[i] = f"{argv[i]},{fixed}"
    return argv


def attach_fixed(recs: list[dict], fixed: int | None, load: list) -> dict:
    """{method: record} of the allreduce records of the measured size, each with the load average
    before the run and, when ``fixed`` was timed too, that allreduce's median time (``fixed_time``)."""
    ar = [r for r in recs if r["workload"] == "allreduce"]
    small = {r["method"]: r["time_median"] for r in ar if fixed and r["elements"] == fixed}
    return {r["method"]: r | {"loadavg_before": load, "fixed_time": small.get(r["method"])}
            for r in ar if not (fixed and r["elements"] == fixed)}


def sweep(out: Path, *argv: str, fixed: int | None = None) -> dict:
    """One ina-sweep run; {method: record} of its allreduce records (:func:`attach_fixed`)."""
    load = Path("/proc/loadavg").read_text().split()[:3]
    cmd = [sys.executable, "-m", "experiments.sweep", "--out", str(out), "--no-plots", *with_sizes(argv, fixed)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    return attach_fixed(json.loads((out / "results.json").read_text())["records"], fixed, load)


def marginal_ratio(a: dict, b: dict) -> float | None:
    """(time - fixed_time) of record b over the same of record a; None without both fixed times."""
    if a.get("fixed_time") is None or b.get("fixed_time") is None:
        return None
    return (b["time_median"] - b["fixed_time"]) / (a["time_median"] - a["fixed_time"])


def links_ratio(r: dict) -> float | None:
    """(time - fixed_time) of record ``r`` over the time of the bytes its links counted at its (target)
    rate: 1 when the links set the pace. None without the rate or the counters."""
    if not r.get("rate_bps") or not r.get("wire_up_bytes_per_worker"):
        return None
    return (r["time_median"] - (r.get("fixed_time") or 0.0)) / (r["wire_up_bytes_per_worker"] * 8 / r["rate_bps"])


def verdict(c: dict, tol: float) -> str:
    """'ok', or why not: a run above its links' time by more than ``tol`` is no reference (its hosts,
    not its links, set its pace: e.g. a real-time run on a loaded machine), else 'OUTSIDE'."""
    if c["within"]:
        return "ok"
    slow = [s for s in "ab" if c[f"links_ratio_{s}"] is not None and c[f"links_ratio_{s}"] > 1 + tol]
    if slow:
        return "not link-bound: " + ", ".join(f"{c[f'label_{s}']} at {c[f'links_ratio_{s}']:.3f} of its links' time"
                                              for s in slow)
    return "OUTSIDE"


def compare(a: dict, b: dict, tol: float) -> dict:
    out = {}
    for m in a:
        if m in b:
            ratio = b[m]["time_median"] / a[m]["time_median"]
            marginal = marginal_ratio(a[m], b[m])
            decided = ratio if marginal is None else marginal
            out[m] = {"ratio": ratio, "marginal_ratio": marginal, "within": abs(decided - 1) <= tol,
                      "links_ratio_a": links_ratio(a[m]), "links_ratio_b": links_ratio(b[m]),
                      "fixed_a": a[m].get("fixed_time"), "fixed_b": b[m].get("fixed_time"),
                      "time_a": a[m]["time_median"],
                      "time_b": b[m]["time_median"], "label_a": a[m].get("dilation_label"),
                      "label_b": b[m].get("dilation_label"), "bound_ratio_a": a[m].get("bound_ratio"),
                      "bound_ratio_b": b[m].get("bound_ratio"), "wire_up_a": a[m]["wire_up_bytes_per_worker"],
                      "wire_up_b": b[m]["wire_up_bytes_per_worker"], "k_a": a[m].get("dilation", 1),
                      "k_b": b[m].get("dilation", 1), "loadavg_a": a[m]["loadavg_before"],
                      "loadavg_b": b[m]["loadavg_before"], "retransmissions_a": a[m].get("client_retransmissions"),
                      "retransmissions_b": b[m].get("client_retransmissions")}
            out[m]["verdict"] = verdict(out[m], tol)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="10gbit")
    ap.add_argument("--workers", default="8")
    ap.add_argument("--k", default="800", help="the first factor (the second is twice it), or method=K,...")
    ap.add_argument("--sizes", default="resnet110")
    ap.add_argument("--methods", default="gloo,ina:bfp32,ina:nc")
    ap.add_argument("--real-rate", default="100mbit")
    ap.add_argument("--real-workers", default="4")
    ap.add_argument("--real-k", type=float, default=4.0)
    ap.add_argument("--reps", default="3")
    ap.add_argument("--warmup", default="1")
    ap.add_argument("--profile", default="software", help="switch profile of the k_vs_2k runs")
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--fixed-size", type=int, default=256,
                    help="elements of the allreduce that measures the per-allreduce fixed cost in each run "
                         "(0: not measured; the check is then decided on the raw ratio)")
    ap.add_argument("--real-sizes", help="sizes of the dilated_vs_real check (default --sizes)")
    ap.add_argument("--tcp-cc", default="reno", help="TCP congestion control of the workers in every run, real "
                                                     "time too (ina-sweep --tcp-cc; the dilated default)")
    ap.add_argument("--skip", choices=("k_vs_2k", "dilated_vs_real"), action="append", default=[])
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    methods = a.methods.split(",")
    common = ["--reps", a.reps, "--warmup", a.warmup, "--timeout", "60", *(["--tcp-cc", a.tcp_cc] if a.tcp_cc else [])]
    fixed = a.fixed_size or None
    res = {"settings": vars(a) | {"json": str(a.json)}, "tolerance": a.tol}
    t = Path(tempfile.mkdtemp(prefix="bench-dilation-"))      # kept: the sweeps' reports and worker logs
    res["folder"] = str(t)
    if "k_vs_2k" not in a.skip:
        ks = parse_factors(a.k, methods)
        dil = ["--target-rates", a.target, "--workers", a.workers, "--profile", a.profile, "--sizes", a.sizes, *common]
        res["k_vs_2k"] = compare(sweeps(t / "k", ks, 1, *dil, fixed=fixed), sweeps(t / "2k", ks, 2, *dil, fixed=fixed),
                                 a.tol)
    if "dilated_vs_real" not in a.skip:
        both = ["--workers", a.real_workers, "--methods", a.methods, "--sizes", a.real_sizes or a.sizes, *common]
        real = sweep(t / "real", "--rates", a.real_rate, "--acc-steps", "0", "--tp-sizes", "none", *both, fixed=fixed)
        dil = sweep(t / "dil", "--target-rates", a.real_rate, "--dilation", f"{a.real_k:g}", *both, fixed=fixed)
        res["dilated_vs_real"] = compare(real, dil, a.tol)
    for check in ("k_vs_2k", "dilated_vs_real"):
        for m, c in res.get(check, {}).items():
            print(line(check, m, c, a.tol))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


def line(check: str, m: str, c: dict, tol: float) -> str:
    """One check's result as text: the ratio, the marginal ratio (when the fixed costs were timed)."""
    fixed = "" if c["marginal_ratio"] is None else (
        f"; above the fixed cost ({c['fixed_a'] * 1e3:.2f} vs {c['fixed_b'] * 1e3:.2f} ms): {c['marginal_ratio']:.3f}")
    return (f"{check:16s} {m:12s} ratio {c['ratio']:.3f} ({c['label_a']} {c['time_a']:.4f} s vs "
            f"{c['label_b']} {c['time_b']:.4f} s; time/ideal {c['bound_ratio_a']:.3f} vs "
            f"{c['bound_ratio_b']:.3f}{fixed}) {c['verdict']} ({tol:.0%})")


if __name__ == "__main__":
    sys.exit(main())
