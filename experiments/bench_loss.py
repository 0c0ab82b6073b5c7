"""Allreduce time under packet loss, duplication and reordering, as a ratio to the lossless time.

    python -m experiments.bench_loss                  # table; 4 workers, loopback, 20 000 and 1.7 M elements
    python -m experiments.bench_loss --json
    python -m experiments.bench_loss --rate 100mbit    # the same on emulated 100 Mbit/s links (root)

Every setting runs the same bfp32 allreduces of the same inputs; the lossless setting runs first in
the same invocation and is the reference of every ratio. Loss, duplication and reordering are the
switch's user-space impairments (this kernel has no netem), applied in both directions (worker ->
switch and switch -> worker) with the given probability each. Every result is compared bit for bit
with the lossless run's: a mismatch fails the benchmark. The client counters say how each loss was
recovered: fast retransmissions (a later chunk's result arrived first) or timeouts.
Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np

from ina.control import request
from switch_model.launch import free_port, start_switch

SETTINGS = {                      # name: impairment of each direction
    "lossless": {},
    "loss 0.1%": {"loss": 0.001},
    "loss 1%": {"loss": 0.01},
    "loss 2% + dup 2% + reorder 2%": {"loss": 0.02, "duplicate": 0.02, "reorder": 0.02},
}
COUNTERS = ("retransmissions", "fast_retransmissions", "timeout_retransmissions", "duplicate_results")


def log(msg: str) -> None:
    print(f"[bench_loss] {msg}", file=sys.stderr, flush=True)


def _worker(rank, n, host, port, job, elements, reps, seed, q):
    os.environ["OMP_NUM_THREADS"] = "1"
    from ina import Client
    rng = np.random.default_rng([seed, rank])
    x = rng.standard_normal(elements).astype(np.float32)
    with Client((host, port), rank=rank, world_size=n, job=job, timeout=60) as cl:
        y = x.copy()
        cl.allreduce(y, codec="bfp32")                   # warm-up: caches, the first RTT samples
        out = np.empty((reps, elements), np.float32)
        t0 = time.perf_counter()
        for i in range(reps):
            y[:] = x
            cl.allreduce(y, codec="bfp32")
            out[i] = y
        dt = time.perf_counter() - t0
        st = cl.stats.as_dict()
    q.put((rank, dt / reps, {k: st.get(k, 0) for k in COUNTERS}, out if rank == 0 else None))


def run_setting(host, port, n, job, elements, reps, seed, imp: dict, timeout: float):
    cfg = {"loss": 0.0, "duplicate": 0.0, "reorder": 0.0, "seed": seed, **imp}
    request(host, port, {"op": "impair", "ingress": cfg, "egress": {**cfg, "seed": seed + 1}}, timeout=10)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, n, host, port, job, elements, reps, seed, q)) for r in range(n)]
    for p in ps:
        p.start()
    got = [q.get(timeout=timeout) for _ in ps]
    for p in ps:
        p.join(30)
        if p.exitcode != 0:
            raise RuntimeError(f"a benchmark worker exited with code {p.exitcode}")
    per = max(g[1] for g in got)                     # the slowest worker's time per allreduce
    counters = {k: sum(g[2][k] for g in got) for k in COUNTERS}
    out = next(g[3] for g in got if g[3] is not None)
    return per, counters, out


def run(n: int, sizes: list[int], reps: dict, seed: int, settings: dict):
    port = free_port()
    sw = start_switch(port, "--host", "127.0.0.1", "--slots", "512", "--log-level", "WARNING",
                      "--stats-interval", "0", stderr=subprocess.DEVNULL)
    rows = []
    try:
        job = 1
        for elements in sizes:
            ref_time, ref_out = None, None
            for name, imp in settings.items():
                job += 1
                r = reps[elements]
                per, counters, out = run_setting("127.0.0.1", port, n, job, elements, r, seed, imp, timeout=600)
                if ref_out is None:
                    ref_time, ref_out = per, out
                exact = bool(np.array_equal(out.view(np.uint32), ref_out.view(np.uint32)))
                row = {"workers": n, "elements": elements, "setting": name, "impairment_each_direction": imp,
                       "allreduces": r, "time_per_allreduce_s": per, "vs_lossless": per / ref_time,
                       "exact": exact, **counters}
                rows.append(row)
                log(f"{elements} elements, {name}: {per * 1e3:.2f} ms per allreduce ({per / ref_time:.2f}x lossless),"
                    f" fast {counters['fast_retransmissions']}, timeouts {counters['timeout_retransmissions']},"
                    f" exact {exact}")
                if not exact:
                    raise RuntimeError(f"{name}: results differ from the lossless run")
    finally:
        sw.terminate()
        sw.wait(30)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20_000, 1_700_000], help="elements per allreduce")
    ap.add_argument("--reps", type=int, nargs="+", default=[200, 10],
                    help="allreduces per setting, one number per size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if len(a.reps) != len(a.sizes):
        ap.error(f"--reps needs one count per size ({len(a.sizes)}), got {len(a.reps)}")
    rows = run(a.workers, a.sizes, dict(zip(a.sizes, a.reps)), a.seed, SETTINGS)
    if a.json:
        print(json.dumps({"benchmark": "allreduce_under_loss", "links": "loopback",
                          "impairments": "switch user-space impairments, both directions",
                          "codec": "bfp32", "reference": "the lossless run of the same size in the same invocation",
                          "results": rows}, indent=2))
    else:
        print(f"{'elements':>9} {'setting':<32} {'ms':>8} {'x lossless':>10} {'fast':>6} {'timeouts':>8} exact")
        for r in rows:
            print(f"{r['elements']:>9} {r['setting']:<32} {r['time_per_allreduce_s'] * 1e3:>8.2f} "
                  f"{r['vs_lossless']:>10.2f} {r['fast_retransmissions']:>6} {r['timeout_retransmissions']:>8} "
                  f"{'yes' if r['exact'] else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
