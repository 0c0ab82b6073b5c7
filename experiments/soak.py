"""Soak and chaos: many allreduces through one switch under loss, duplication and reordering.

``python -m experiments.soak --allreduces 10000 --workers 4 [--json]``

One switch (``ina-switch serve`` with the impairments) runs for the whole soak. Every ``--epoch``
allreduces a job ends the hard way: its workers (processes, ``--workers`` of them) finish their
allreduces, one of them is killed (SIGKILL: the switch tears the job down and sends ABORT to the
others), and a new job with a new id starts. Every allreduce is block floating point (bfp32) and is
checked, bit for bit, against the numpy reference of the same integer arithmetic
(tests/sw_harness.bfp_reference). Reported: allreduces done and exact, losses, duplicates and
reorderings the switch injected, the workers' retransmissions, the switch's resident memory after
the first epoch and at the end, slots allocated while each job runs and after its teardown, and at
the end (0: every job's slots came back), time.

Emulated: the impairments are the switch's user-space ingress/egress stages (docs/switch.md), on
loopback UDP; nothing here says how a real network behaves.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _ops(epoch: int, k: int, size: int) -> list:
    """The epoch's allreduces: small bfp32 tensors of varying length, each with its own inputs."""
    return [{"codec": "bfp32", "shape": [size - i % (size // 2)], "seed": epoch * 100003 + i} for i in range(k)]


def _run_epoch(sw, tmp: Path, epoch: int, args) -> dict:
    """One job of ``args.epoch`` allreduces; then one worker is killed. Its numbers."""
    from sw_harness import Workers, bfp_reference, expected_inputs, wait_until
    n, k = args.workers, args.epoch
    ops = _ops(epoch, k, args.size)
    client = {"elements": args.elements, "slots": args.slots, "timeout": 30.0, "rto": 0.01, "max_rto": 0.1}
    # the workers repeat the epoch's allreduces until an error: the kill below, mid-allreduce
    w = Workers(tmp, sw.port, n, job=100 + epoch, ops=ops, client=client, name=f"e{epoch}", loop=0)
    try:
        wait_until(lambda: all(w.progress(r) >= k for r in range(n)), args.timeout,
                   f"epoch {epoch}: {k} allreduces on every rank", interval=0.2)
        slots_live = sw.stats()["occupancy"]["slots_allocated"]   # the running job's, before the kill
        victim = epoch % n
        w.procs[victim].send_signal(signal.SIGKILL)              # the chaos: a worker dies
        w.procs[victim].wait(timeout=30)
        out = {r: m for r, m in w.wait(timeout=60, check=False).items() if r != victim}
    finally:
        w.kill()
    exact = 0
    for i, op in enumerate(ops):
        ref = bfp_reference(expected_inputs(op, n)).view(np.uint32)
        exact += all(len(m["results"]) > i and np.array_equal(m["results"][i].view(np.uint32), ref)
                     for m in out.values())
    aborted = sum("aborted by the switch" in (m.get("error") or "") for m in out.values())
    retx = sum(m["stats"]["retransmissions"] for m in out.values())
    return {"allreduces": k, "exact": exact, "retransmissions": retx, "killed_rank": victim,
            "survivors_told_by_abort": aborted, "slots_allocated_while_running": slots_live}


def run(args) -> dict:
    import tempfile

    from tqdm import tqdm

    from sw_harness import wait_until
    from switch_model.launch import start_switch
    tmp = Path(tempfile.mkdtemp(prefix="ina-soak-"))
    t0 = time.monotonic()
    sw = start_switch(None, "--slots", str(4 * args.slots), "--elements", str(args.elements), "--loss",
                      str(args.loss), "--duplicate", str(args.duplicate), "--reorder", str(args.reorder), "--seed",
                      str(args.seed), "--stats-interval", "0", "--host-agg-port", "-1", "--log-level", "WARNING",
                      host="127.0.0.1", log_path=tmp / "switch.log")
    epochs = []
    rss = []
    try:
        rss_start = _rss_mib(sw.proc.pid)
        for e in tqdm(range(max(1, args.allreduces // args.epoch)), desc="soak epochs", file=sys.stderr,
                      disable=not args.progress):
            epochs.append(_run_epoch(sw, tmp, e, args))
            wait_until(lambda: sw.stats()["occupancy"]["slots_allocated"] == 0, 30,
                       f"epoch {e}: the killed job's slots to come back")
            rss.append(round(_rss_mib(sw.proc.pid), 2))
            x = epochs[-1]
            x["slots_allocated_after"] = sw.stats()["occupancy"]["slots_allocated"]
            print(f"soak: epoch {e}: {x['exact']}/{x['allreduces']} exact, rank {x['killed_rank']} killed, "
                  f"{x['survivors_told_by_abort']} survivors told by ABORT, switch RSS {rss[-1]} MiB, "
                  f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        st = sw.stats()
    finally:
        rc = sw.stop()
    imp = st["impairments"]
    return {
        "emulated": "switch user-space impairments on loopback UDP (ina-switch --loss/--duplicate/--reorder)",
        "workers": args.workers, "epoch": args.epoch, "tensor_elements_max": args.size,
        "impairments": {"loss": args.loss, "duplicate": args.duplicate, "reorder": args.reorder},
        "allreduces": sum(x["allreduces"] for x in epochs), "exact": sum(x["exact"] for x in epochs),
        "losses_injected": imp["ingress"]["dropped"] + imp["egress"]["dropped"],
        "duplicates_injected": imp["ingress"]["duplicated"] + imp["egress"]["duplicated"],
        "reorderings_injected": imp["ingress"]["reordered"] + imp["egress"]["reordered"],
        "retransmissions": sum(x["retransmissions"] for x in epochs),
        "workers_killed": len(epochs), "jobs": len(epochs),
        "survivors_told_by_abort": sum(x["survivors_told_by_abort"] for x in epochs),
        "rss_mib_at_start": round(rss_start, 2), "rss_mib_after_first_epoch": rss[0], "rss_mib_at_end": rss[-1],
        "rss_mib_per_epoch": rss,
        "slots_allocated_per_epoch": {"while_running": [x["slots_allocated_while_running"] for x in epochs],
                                      "after_teardown": [x["slots_allocated_after"] for x in epochs]},
        "slots_allocated_at_end": st["occupancy"]["slots_allocated"],
        "switch_drops": {k: v for k, v in st["drops"].items() if v},
        "switch_exit_status": rc, "switch_log": str(tmp / "switch.log"), "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--allreduces", type=int, default=10000, help="allreduces in all (a multiple of --epoch)")
    ap.add_argument("--epoch", type=int, default=1000, help="allreduces per job; then a worker is killed")
    ap.add_argument("--workers", type=int, default=4, help="workers per job")
    ap.add_argument("--size", type=int, default=96, help="largest tensor (elements); sizes vary down to half")
    ap.add_argument("--elements", type=int, default=32, help="elements per packet")
    ap.add_argument("--slots", type=int, default=4, help="slots per job (the window)")
    ap.add_argument("--loss", type=float, default=0.02, help="loss probability, each direction")
    ap.add_argument("--duplicate", type=float, default=0.01, help="duplication probability, each direction")
    ap.add_argument("--reorder", type=float, default=0.02, help="reordering probability, each direction")
    ap.add_argument("--seed", type=int, default=1, help="the switch's impairment seed")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds an epoch may take at most")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    args = ap.parse_args(argv)
    if args.allreduces < args.epoch or args.epoch < 1:
        ap.error("--allreduces must be at least --epoch (>= 1)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rep = run(args)
    ok = (rep["exact"] == rep["allreduces"] and rep["slots_allocated_at_end"] == 0 and rep["switch_exit_status"] == 0)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        for k, v in rep.items():
            print(f"{k:28s} {v}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
