"""Codec throughput on one core, as a ratio to memcpy measured in the same run.

    python -m experiments.bench_codecs            # table
    python -m experiments.bench_codecs --json     # one JSON document on stdout

For every registered codec: GB/s of float32 input for

* ``encode``: ``codec.compress(x)`` (the exponent/norm scan plus the encoding loop),
* ``decode``: ``codec.decompress(enc)``,
* ``encode_shared`` / ``decode_sum``: the switch path the allreduce client uses (shared scale,
  no scan), for switch-summable codecs,

plus ``natural_compression`` (the operator C_nat, float in, float out). The reference is
``np.copyto`` of a float32 array of the same size (memcpy), timed interleaved with the codecs so that
machine noise hits both alike; every figure is reported as a ratio to it. Numba and torch run single
threaded and the process is pinned to one CPU. Progress goes to stderr.
"""
from __future__ import annotations

import os

# single-threaded numba (must be set before numba is imported)
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

GOALS = {("nc", "encode"): 0.3, ("nc", "decode"): 0.5}


def log(msg: str) -> None:
    print(f"[bench_codecs] {msg}", file=sys.stderr, flush=True)


def _pin_one_core() -> int | None:
    try:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[-1]})
        return cpus[-1]
    except (AttributeError, OSError):
        return None


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _operations(names, x: np.ndarray, seed: int) -> list[tuple[str, str, object]]:
    """The timed operations, as (codec, op, callable); encoders leave their output for the decoders."""
    import ina.compression as C
    from ina.compression.base import ScaleContext
    ops: list[tuple[str, str, object]] = []
    state: dict = {}
    for name in names:
        codec = C.get(name, seed=seed)
        ops.append((name, "encode", lambda c=codec, k=name: state.__setitem__(k, c.compress(x))))
        ops.append((name, "decode", lambda c=codec, k=name: c.decompress(state[k])))
        if codec.switch_summable:
            ctx = ScaleContext(codec.scale_exponent(x), n_workers=8, register_bits=64, seed=seed)
            key = name + "/shared"
            ops.append((name, "encode_shared", lambda c=codec, k=key, ctx=ctx: state.__setitem__(k, c.encode_shared(x, ctx))))
            ops.append((name, "decode_sum", lambda c=codec, k=key, ctx=ctx: c.decode_sum(state[k], ctx, False)))
    ops.append(("C_nat", "operator", lambda: C.natural_compression(x, seed=seed)))
    ops.append(("C_nat-det", "operator", lambda: C.natural_compression(x, deterministic=True, seed=seed)))
    return ops


def _print_table(doc: dict) -> None:
    nbytes = doc["input"]["bytes"]
    print(f"memcpy (np.copyto, {nbytes / 2**20:.0f} MiB): {doc['memcpy']['gb_per_s']:.2f} GB/s")
    print(f"{'codec':<11} {'op':<14} {'GB/s':>7} {'x memcpy':>9}  goal")
    for row in doc["results"]:
        goal = ""
        if "goal_ratio" in row:
            goal = f">= {row['goal_ratio']}x {'ok' if row['meets_goal'] else 'MISSED'}"
        print(f"{row['codec']:<11} {row['op']:<14} {row['gb_per_s']:>7.2f} {row['ratio_to_memcpy']:>9.3f}  {goal}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    ap.add_argument("--mb", type=float, default=32.0, help="size of the float32 input in MB (default 32)")
    ap.add_argument("--repeat", type=int, default=7, help="timed repetitions per operation (median is reported)")
    ap.add_argument("--codecs", default="", help="comma-separated codec names (default: all registered)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.mb <= 0:
        ap.error("--repeat must be >= 1 and --mb > 0")

    cpu = _pin_one_core()
    import torch
    torch.set_num_threads(1)
    import numba
    numba.set_num_threads(1)
    import ina.compression as C

    names = [n for n in args.codecs.split(",") if n] or C.available()
    for n in names:
        C.get(n)  # unknown names fail here, with the list of available ones

    n_elem = int(args.mb * 2**20) // 4
    rng = np.random.default_rng(args.seed)
    log(f"input: {n_elem} float32 ({n_elem * 4 / 2**20:.0f} MiB, Gaussian), {args.repeat} repetitions, "
        f"pinned to CPU {cpu}")
    x = rng.standard_normal(n_elem, dtype=np.float32)
    dst = np.empty_like(x)
    nbytes = x.nbytes

    ops = _operations(names, x, args.seed)

    log("warming up (JIT compilation on first use, cached afterwards)")
    np.copyto(dst, x)
    for _, _, fn in ops:
        fn()

    memcpy_t: list[float] = []
    times: dict[tuple[str, str], list[float]] = {(c, o): [] for c, o, _ in ops}
    for r in range(args.repeat):
        for c, o, fn in ops:
            memcpy_t.append(_time(lambda: np.copyto(dst, x)))
            times[(c, o)].append(_time(fn))
        log(f"repetition {r + 1}/{args.repeat} done (memcpy {nbytes / statistics.median(memcpy_t) / 1e9:.2f} GB/s so far)")

    memcpy = statistics.median(memcpy_t)
    results = []
    for (c, o), ts in times.items():
        t = statistics.median(ts)
        row = {"codec": c, "op": o, "seconds": t, "gb_per_s": nbytes / t / 1e9, "ratio_to_memcpy": memcpy / t}
        goal = GOALS.get((c, o))
        if goal is not None:
            row["goal_ratio"] = goal
            row["meets_goal"] = row["ratio_to_memcpy"] >= goal
        results.append(row)

    doc = {
        "bench": "codecs",
        "input": {"elements": n_elem, "bytes": nbytes, "dtype": "float32", "distribution": "standard normal"},
        "repeat": args.repeat,
        "statistic": "median",
        "threads": {"numba": 1, "torch": 1, "cpu": cpu},
        "machine": {"processor": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "numpy": np.__version__, "numba": numba.__version__},
        "memcpy": {"seconds": memcpy, "gb_per_s": nbytes / memcpy / 1e9},
        "results": results,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_table(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
