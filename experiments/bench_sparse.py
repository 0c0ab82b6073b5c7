"""Sparse block streaming against dense INA and Gloo's ring, on emulated links (root: namespaces, tbf).

    python -m experiments.bench_sparse                       # 4 workers, 10/100/1000 Mbit/s, 90% and 99%
    python -m experiments.bench_sparse --json --out results/bench-sparse
    python -m experiments.bench_sparse --rates 100mbit --sparsity 0.99 --elements 1048576

The workload: every worker's tensor (``--elements`` float32, normal times 0.01) is cut into blocks
of ``--block`` elements, each zero with probability ``--sparsity``, drawn independently per worker
(the non-zero blocks differ across workers: with 4 workers at 90%, about 34% of the blocks are non-zero
somewhere). Each configuration runs the sweep's allreduce benchmark (experiments/sweep.py run_bench: the
same worker processes, links, switch and byte counters as ``ina-sweep``) for these methods on the same
inputs: ``gloo`` (torch.distributed's Gloo ring, fp32), dense ``ina:nc`` and ``ina:bfp32``, and
``ina:nc+sparse``, ``ina:bfp32+sparse`` (Client.allreduce(sparse=True)). Times and link bytes are
reported as ratios to Gloo's ring and to the dense INA codec, all measured in the same invocation. The
block is a multiple of both codecs' elements per packet (2048 and 8192 at a 9000-byte MTU), so a zero
block is whole zero chunks for either. Real-time links, no dilation: at 1000 Mbit/s the Python
client and switch, not the links, bound the INA times.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

METHODS = ("gloo", "ina:nc", "ina:nc+sparse", "ina:bfp32", "ina:bfp32+sparse")


def log(msg: str) -> None:
    print(f"bench_sparse: {msg}", file=sys.stderr, flush=True)


def _sweep_args(a):
    from .sweep import build_parser
    ap = build_parser()
    args = ap.parse_args(["--reps", str(a.reps), "--warmup", "1", "--workers", str(a.workers), "--rates", a.rates,
                          "--timeout", str(a.timeout)])
    from .dilation import resolve
    resolve(ap, args)
    return args


def run(a) -> list[dict]:
    from ina.net import Topology
    from switch_model.launch import start_switch

    from .sweep import run_bench, switch_args
    from .sweep_group import SWITCH_PORT, WorkerGroup
    args = _sweep_args(a)
    out = Path(a.out or f"results/bench-sparse-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    rates = a.rates.split(",")
    records = []
    with Topology(workers=a.workers, rate=rates[0], mtu=args.mtu) as topo:
        sw = start_switch(SWITCH_PORT, *switch_args(args), "--stats-interval", "0", "--log-level", "WARNING",
                          popen=functools.partial(topo.popen, topo.switch), control_host=topo.switch.ip,
                          host="0.0.0.0", log_path=out / "switch.log", timeout=30.0)
        group = WorkerGroup(topo, a.workers, out, args)
        job = int(time.time()) % 1000 * 10
        try:
            for rate in rates:
                topo.set_rate("workers", rate)
                for f in a.sparsity:
                    for m in METHODS:
                        job += 1
                        base, sparse = m.split("+")[0], m.endswith("+sparse")
                        extra = {"block_sparsity": f, "sparse_block": a.block, "sparse": sparse}
                        log(f"{m} {rate} {f:.0%} zero blocks")
                        rec = run_bench(group, topo, base, a.workers, rate, a.elements, args, job, job, extra=extra)
                        rec["method"] = m
                        records.append(rec)
                        (out / "records.json").write_text(json.dumps(records, indent=1))
        finally:
            group.close()
            sw.stop(timeout=10)
    return records


def ratios(records: list[dict]) -> list[dict]:
    """Per (rate, sparsity, method): median time and link bytes per worker (up, down), and their
    ratios to the Gloo ring and to the dense INA codec of the same (rate, sparsity)."""
    by = {(r["rate"], r["block_sparsity"], r["method"]): r for r in records}
    rows = []
    for (rate, f, m), r in by.items():
        ring = by.get((rate, f, "gloo"))
        dense = by.get((rate, f, m.split("+")[0]))
        row = {"rate": rate, "block_sparsity": f, "method": m, "time_median_s": r["time_median"],
               "up_bytes_per_worker": r["wire_up_bytes_per_worker"],
               "down_bytes_per_worker": r["wire_down_bytes_per_worker"], "rel_error": r["rel_error"],
               "retransmissions": r.get("client_retransmissions")}
        if ring:
            row["time_vs_ring"] = r["time_median"] / ring["time_median"]
            row["up_bytes_vs_ring"] = r["wire_up_bytes_per_worker"] / ring["wire_up_bytes_per_worker"]
        if dense and m != "gloo":
            row["time_vs_dense"] = r["time_median"] / dense["time_median"]
            row["up_bytes_vs_dense"] = r["wire_up_bytes_per_worker"] / dense["wire_up_bytes_per_worker"]
            row["down_bytes_vs_dense"] = r["wire_down_bytes_per_worker"] / dense["wire_down_bytes_per_worker"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rates", default="10mbit,100mbit,1gbit")
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.9, 0.99], help="probability of a zero block")
    ap.add_argument("--elements", type=int, default=1 << 21)
    ap.add_argument("--block", type=int, default=8192, help="elements per zero/non-zero block")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", help="folder for the logs and records.json")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if not all(0 <= f < 1 for f in a.sparsity):
        ap.error(f"--sparsity {a.sparsity}: probabilities in [0, 1)")
    rows = ratios(run(a))
    if a.json:
        print(json.dumps({"benchmark": "sparse_block_streaming", "workers": a.workers, "elements": a.elements,
                          "block": a.block, "links": "emulated, tbf per worker link, real time (no dilation)",
                          "reference": "Gloo ring fp32 and the dense INA codec, same inputs, same invocation",
                          "results": rows}, indent=2))
        return 0
    print(f"{'rate':>8} {'zero':>5} {'method':<18} {'ms':>9} {'x ring':>7} {'x dense':>8} {'up x dense':>10} "
          f"{'down x dense':>12} {'rel err':>8}")
    for r in rows:
        print(f"{r['rate']:>8} {r['block_sparsity']:>5.0%} {r['method']:<18} {r['time_median_s'] * 1e3:>9.1f} "
              f"{r.get('time_vs_ring', float('nan')):>7.2f} {r.get('time_vs_dense', float('nan')):>8.2f} "
              f"{r.get('up_bytes_vs_dense', float('nan')):>10.3f} {r.get('down_bytes_vs_dense', float('nan')):>12.3f} "
              f"{r['rel_error']:>8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
