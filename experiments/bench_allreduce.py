"""Allreduce time and goodput through the switch on loopback, next to torch.distributed Gloo.

    python -m experiments.bench_allreduce                 # table; 2, 4, 8 workers; 1, 16, 64 MB
    python -m experiments.bench_allreduce --json
    python -m experiments.bench_allreduce --sizes-mb 1 4 16 64 256 --workers 4

Every configuration is measured in the same run against Gloo's allreduce of the same fp32 tensor
(the ring that Horovod and torch.distributed use today), so the figures that matter are ratios.
"Payload into the switch" is the codes all workers send per second (the issue's 2 Gbit/s goal is
for natural compression with 4 workers): it says whether the emulator, not the links, sets the pace.
Progress goes to stderr. Per method, ``<method>_worker_cpu_ms``: the CPU time of one worker
process per allreduce (median, mean over the workers; the primary figure on a shared machine).
``INA_GSO=0`` in the environment turns UDP GSO off in workers and switch (to measure against it);
``--cores N|auto`` is the switch's shard count (default auto, the switch's own rule). Per codec, rank 0's timeline of its last allreduce (``<codec>_timeline``:
negotiation, first send, window sent, first/last result, done; encode/decode CPU) and the switch's
stage clock per allreduce (``<codec>_switch``: ms per stage, busy and waiting; mean burst) say where
the time goes (docs/performance.md). ``<codec>_negotiation`` splits rank 0's negotiation mark into
the wait for the last worker's call (the barrier's exit skew) and the round trip after it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

from ina.control import request
from switch_model.launch import free_port, start_switch

CODE_BYTES = {"nc": 1, "nc-det": 1, "bfp32": 4, "nd": 1, "rd": 1}


def log(msg: str) -> None:
    print(f"[bench_allreduce] {msg}", file=sys.stderr, flush=True)


def switch_timing(port: int) -> dict:
    return request("127.0.0.1", port, {"op": "stats"})["stats"]["timing"]


def timing_per_allreduce(a: dict, b: dict, count: int) -> dict:
    """The switch's stage clock between two readings, in ms per allreduce (stages, busy, busy_cpu, wait)."""
    d = {name: (b["stage_ns"][name] - a["stage_ns"][name]) / count / 1e6 for name in b["stage_ns"]}
    d.update({key[:-3]: (b[key] - a[key]) / count / 1e6 for key in ("busy_ns", "busy_cpu_ns", "tx_cpu_ns", "wait_ns")})
    return {k: round(v, 3) for k, v in d.items()}


def negotiation_split(starts, negotiated, last_start) -> dict:
    """Rank 0's negotiation mark (s after its call) split into the wait for the last worker to call
    (start skew after the barrier) and the round trip after that call; medians over the reps, ms."""
    return {"rank0_mark_ms": round(float(np.median(negotiated)) * 1e3, 3),
            "start_skew_ms": round(float(np.median(last_start - starts)) * 1e3, 3),
            "after_last_start_ms": round(float(np.median(starts + negotiated - last_start)) * 1e3, 3)}


def _worker(rank, n, sw_port, gloo_port, sizes, codecs, reps, elements, slots, q):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from ina import Client
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=n)
    cl = Client(("127.0.0.1", sw_port), rank=rank, world_size=n, job=100 + n, timeout=60, elements=elements,
                slots=slots, timeline=rank == 0)
    rng = np.random.default_rng(rank)
    for nbytes in sizes:
        N = nbytes // 4
        x = torch.from_numpy(rng.standard_normal(N).astype(np.float32))
        row = {"workers": n, "bytes": nbytes, "elements": N}
        for method in ["gloo"] + codecs:
            times, cpu, starts, negs = [], [], [], []
            t0 = switch_timing(sw_port) if rank == 0 and method != "gloo" else None
            for r in range(reps + 1):
                y = x.clone()
                dist.barrier()
                t, c = time.perf_counter(), time.process_time()
                if method == "gloo":
                    dist.all_reduce(y)
                else:
                    cl.allreduce(y, codec=method)
                dt, dc = time.perf_counter() - t, time.process_time() - c
                if r:                       # the first one warms caches up
                    times.append(dt)
                    cpu.append(dc)
                    starts.append(t)        # perf_counter is CLOCK_MONOTONIC: one clock for every process
                    negs.append((cl.last_timeline or {}).get("negotiated", np.nan) if method != "gloo" else np.nan)
            tt = torch.tensor([float(np.median(times))])
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)      # the slowest worker's time
            row[method] = float(tt)
            cc = torch.tensor([float(np.median(cpu))])
            dist.all_reduce(cc)                            # CPU of all workers (process: Gloo's threads too)
            row[f"{method}_worker_cpu_ms"] = round(float(cc) / n * 1e3, 3)   # per worker
            last_start = torch.tensor(starts, dtype=torch.float64)
            dist.all_reduce(last_start, op=dist.ReduceOp.MAX)   # when the last worker called allreduce
            if t0 is not None:
                row[f"{method}_negotiation"] = negotiation_split(np.array(starts), np.array(negs),
                                                                 last_start.numpy())
                row[f"{method}_switch"] = timing_per_allreduce(t0, switch_timing(sw_port), reps + 1)
                row[f"{method}_timeline"] = cl.last_timeline
        if rank == 0:
            q.put(row)
    cl.close()
    dist.destroy_process_group()


def run(workers, sizes_mb, codecs, reps, elements, slots, cores="auto"):
    sw = start_switch(None if cores == "1" else free_port(), "--slots", "512", "--elements", str(elements),
                      "--sram-mb", "512", "--log-level", "WARNING", "--cores", cores)
    port = sw.port
    try:
        rows = []
        ctx = mp.get_context("spawn")
        for n in workers:
            log(f"{n} workers, sizes {sizes_mb} MB, methods gloo + {codecs}")
            q = ctx.Queue()
            gp = free_port()
            ps = [ctx.Process(target=_worker, args=(r, n, port, gp, [int(m * 2**20) for m in sizes_mb], codecs, reps,
                                                    elements, slots, q)) for r in range(n)]
            for p in ps:
                p.start()
            for _ in sizes_mb:
                row = q.get(timeout=1800)
                for c in codecs:
                    row[f"{c}_speedup_vs_gloo"] = row["gloo"] / row[c]
                    row[f"{c}_goodput_gbit"] = 8 * row["bytes"] / row[c] / 1e9
                    row[f"{c}_payload_into_switch_gbit"] = 8 * n * row["elements"] * CODE_BYTES.get(c, 1) / row[c] / 1e9
                row["gloo_goodput_gbit"] = 8 * row["bytes"] / row["gloo"] / 1e9
                log(f"  {row['bytes'] / 2**20:.0f} MB: gloo {row['gloo'] * 1e3:.1f} ms; " + ", ".join(
                    f"{c} {row[c] * 1e3:.1f} ms ({row[f'{c}_speedup_vs_gloo']:.2f}x; CPU per worker "
                    f"{row[f'{c}_worker_cpu_ms']:.1f} ms, switch {row[f'{c}_switch']['busy_cpu']:.1f} ms)"
                    for c in codecs))
                rows.append(row)
            for p in ps:
                p.join(120)
                if p.exitcode != 0:
                    raise RuntimeError(f"a benchmark worker exited with code {p.exitcode}")
        return rows
    finally:
        sw.stop(timeout=30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    ap.add_argument("--codecs", nargs="+", default=["nc", "nc-det", "bfp32"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--elements", type=int, default=8192, help="elements per packet")
    ap.add_argument("--slots", type=int, default=32, help="window (the job's slots)")
    ap.add_argument("--cores", default="auto", help="the switch's --cores (N shards, or auto: its default)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = run(a.workers, a.sizes_mb, a.codecs, a.reps, a.elements, a.slots, a.cores)
    if a.json:
        print(json.dumps({"benchmark": "allreduce_loopback", "reference": "torch.distributed gloo allreduce (fp32)",
                          "elements_per_packet": a.elements, "window": a.slots, "switch_cores": a.cores, "results": rows}, indent=2))
    else:
        print(f"{'n':>2} {'MB':>6} {'gloo ms':>9} " + " ".join(f"{c + ' ms':>10} {'x gloo':>7} {'Gb/s in':>8}"
                                                           for c in a.codecs))
        for r in rows:
            print(f"{r['workers']:>2} {r['bytes'] / 2**20:>6.0f} {r['gloo'] * 1e3:>9.1f} " + " ".join(
                f"{r[c] * 1e3:>10.1f} {r[f'{c}_speedup_vs_gloo']:>7.2f} {r[f'{c}_payload_into_switch_gbit']:>8.2f}"
                for c in a.codecs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
