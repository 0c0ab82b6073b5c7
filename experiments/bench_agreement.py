"""Latency of one Horovod agreement round: through Horovod's own allreduce (its background cycle: negotiation,
then the op) against the agreement's own rounds on a TCPStore (``gloo_patch.agreement.Rounds``), 2 ranks, paired.

    python -m experiments.bench_agreement --json

Both carry the same 70-element int64 vector (``agreement.LENGTH``); the two kinds alternate round by round
in one ``horovodrun -np 2`` (no switch: only the rounds are timed), so both see the same load. Also timed:
5 rounds started together and then read (a step's buckets at 256 KiB on the 56-tensor model), as the worker
now does, against 5 Horovod rounds one after the other, as the worker did (it started a round early only
when the next bucket was already sealed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(out: str, reps: int) -> None:
    import torch  # noqa: PLC0415
    import horovod.torch as hvd  # noqa: PLC0415

    from gloo_patch import agreement  # noqa: PLC0415

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    _, rounds = agreement.open_rounds(rank, size, 30, "127.0.0.1", 0, lambda values: hvd.broadcast(
        torch.tensor(values, dtype=torch.int64), 0, name="addr").tolist())
    v = agreement.local_vector([("w", "float32[3]", False)])
    times: dict[str, list] = {"horovod_1": [], "own_group_1": [], "horovod_5_sequential": [], "own_group_5_started_together": []}
    for i in range(reps):
        t0 = time.perf_counter()
        hvd.allreduce(v, name="ina.agree", op=hvd.Sum)
        t1 = time.perf_counter()
        agreement.Rounds.wait(rounds.start(v.clone()), 30)
        t2 = time.perf_counter()
        for k in range(5):
            hvd.allreduce(v, name="ina.agree", op=hvd.Sum)
        t3 = time.perf_counter()
        started = [rounds.start(v.clone()) for _ in range(5)]
        for s in started:
            agreement.Rounds.wait(s, 30)
        t4 = time.perf_counter()
        if i >= 5:       # warm-up
            for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[key].append(dt)
    if rank == 0:
        Path(out).write_text(json.dumps({k: {"median_ms": statistics.median(x) * 1e3, "mean_ms": statistics.mean(x) * 1e3}
                                         for k, x in times.items()}))
    rounds.close()
    hvd.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.reps <= 5:
        ap.error(f"--reps {a.reps}: must be above 5 (the first 5 repetitions are warm-up, not timed)")
    if a.worker:
        worker(a.worker, a.reps)
        return 0
    out = Path(tempfile.mkdtemp(prefix="bench_agree_")) / "r0.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INA_")}       # no switch: the patch stays off
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    load0 = os.getloadavg()[0]
    p = subprocess.run([sys.executable, "-m", "gloo_patch.rendezvous_fix", "-np", "2", "-H", "localhost:2", "--gloo",
                        sys.executable, "-m", "experiments.bench_agreement", "--worker", str(out), "--reps", str(a.reps)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if p.returncode or not out.exists():
        raise RuntimeError(f"horovodrun failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    res = {"emulated": "2 ranks on loopback, Horovod 0.28.1 with Gloo", "reps": a.reps,
           "load_average_start": load0, "load_average_end": os.getloadavg()[0], "rounds": json.loads(out.read_text())}
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res["rounds"].items():
            print(f"{k:30s} median {v['median_ms']:7.2f} ms  mean {v['mean_ms']:7.2f} ms")
        print(f"load average {res['load_average_start']:.1f} -> {res['load_average_end']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
