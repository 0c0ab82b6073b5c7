"""The demo: a switch and four workers on loopback; one allreduce with each switch-summable codec.

    python -m experiments.demo [--workers 4] [--elements 1000000]

For every codec it prints the time of the allreduce, the bytes each worker sent, and the error of
the result against the exact sum (computed in float64 from the same inputs).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import numpy as np

from switch_model.launch import SwitchStartError, start_switch

from .explain import demo_notes


def _worker(rank, n, port, N, codecs, q):
    from ina import Client
    rng = np.random.default_rng(1000 + rank)
    x = (rng.standard_normal(N) * 1e-3).astype(np.float32)     # gradient-like magnitudes
    with Client(("127.0.0.1", port), rank=rank, world_size=n, job=42, timeout=60, elements=8192, slots=32) as cl:
        for codec in codecs:
            y = x.copy()
            cl.allreduce(y, codec=codec)                           # warm-up (kernel caches)
            sent0 = cl.stats.bytes_sent
            y = x.copy()
            t = time.perf_counter()
            cl.allreduce(y, codec=codec)
            dt = time.perf_counter() - t
            if rank == 0:
                q.put((codec, dt, cl.stats.bytes_sent - sent0, y))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--elements", type=int, default=1_000_000)
    a = ap.parse_args(argv)
    import ina.compression as C
    codecs = [c for c in ["bfp32", "nc", "nc-det", "nd", "rd"] + [c for c in C.available()
              if c not in ("bfp32", "nc", "nc-det", "nd", "rd")] if C.get(c).switch_summable]
    print(f"[demo] starting ina-switch, then {a.workers} workers; {a.elements} float32 elements per worker",
          flush=True)
    try:
        sw = start_switch(None, "--elements", "8192", "--sram-mb", "256", "--log-level", "WARNING")
    except SwitchStartError as e:
        print(f"[demo] {e}", file=sys.stderr)
        return 1
    port = sw.port
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        ps = [ctx.Process(target=_worker, args=(r, a.workers, port, a.elements, codecs, q)) for r in range(a.workers)]
        for p in ps:
            p.start()
        exact = sum((np.random.default_rng(1000 + r).standard_normal(a.elements) * 1e-3).astype(np.float32)
                    .astype(np.float64) for r in range(a.workers))
        fp32_bytes = 4 * a.elements
        print(f"{'codec':<10} {'time ms':>9} {'bytes sent/worker':>18} {'vs fp32':>8} {'rel. error':>11}")
        errors = {}
        for _ in codecs:
            codec, dt, sent, y = q.get(timeout=600)
            errors[codec] = err = float(np.linalg.norm(y - exact) / np.linalg.norm(exact))
            print(f"{codec:<10} {dt * 1e3:>9.1f} {sent:>18,d} {sent / fp32_bytes:>8.3f} {err:>11.2e}", flush=True)
        print("\n".join(demo_notes(errors, a.elements)), flush=True)
        for p in ps:
            p.join(60)
        c = sw.stats()["counters"]
        print(f"[demo] switch counters: rx {c['rx_packets']} packets, tx {c['tx_packets']} packets, "
              f"{c['harvested']} slots harvested")
    finally:
        sw.stop(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
