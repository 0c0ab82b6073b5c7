"""Training-step time through the framework integrations: a 56-tensor conv net, 2 ranks.

    python -m experiments.bench_frameworks --json                    # loopback
    python -m experiments.bench_frameworks --rate 100mbit --json     # each rank in its own emulated host
    python -m experiments.bench_frameworks --frameworks horovod --codecs nc@0,nc   # Horovod without/with overlap

Horovod (``hvd.DistributedOptimizer``, through ``horovodrun``) and DDP (two env:// processes, the INA
comm hook on the ``gloo`` backend), each with plain Gloo, then with INA ``nc`` and ``bfp32``, against one
switch. The model: 18 conv3x3+BatchNorm blocks (32/48/64 channels) and a linear head, 56 parameter
tensors, about 380k parameters, on a generated 3x16x16 batch of 16 per rank (about 40 ms of compute on one
core: the communication is a large share of the step, as in the issue's measurement). Reported: the median step
time (forward, backward, optimizer step with its allreduces) and its ratio to Gloo's in the same run.
With ``--rate`` every rank runs in its own network namespace (``ina.net.Topology``,
``gloo_patch.netns_rank``) behind a shaped link, the switch in host ``sw``: Gloo's traffic and the INA
traffic both cross those links (emulated with tbf/htb; loopback has no shaping).
``--interleave`` (DDP): the INA run alternates its steps with Gloo's allreduce (DDP's default, as a hook) in the
same processes, pair by pair, so that the ratio is paired step by step; on a shared machine the ratio of two
separate runs moves by tens of per cent with the load (docs/performance.md).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from switch_model.launch import free_port, start_switch

from . import thread_cpu

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


# ---- the workload ------------------------------------------------------------------------------------------
def make_net(seed: int = 0):
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    torch.manual_seed(seed)
    layers, c_in = [], 3
    for i, c in enumerate([32] * 6 + [48] * 6 + [64] * 6):
        stride = 2 if i in (6, 12) else 1
        layers += [nn.Conv2d(c_in, c, 3, stride, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        c_in = c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, 10)]
    return nn.Sequential(*layers)


def batch(rank: int, n: int = 16, side: int = 16):
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, 3, side, side, generator=g), torch.randint(0, 10, (n,), generator=g)


def timed_steps(model, opt, x, y, warmup: int, steps: int, windows: list | None = None,
                on_timed=None) -> list[float]:
    """Step times after ``warmup``; ``windows`` gets each timed step's (start, end), time.perf_counter();
    ``on_timed()`` is called once, before the first timed step."""
    import torch  # noqa: PLC0415

    times = []
    for i in range(warmup + steps):
        if i == warmup and on_timed is not None:
            on_timed()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            if windows is not None:
                windows.append((t0, t0 + times[-1]))
    return times


def interleaving_hook(ina_hook, mode: dict):
    """DDP's comm hook for ``--interleave``: ``ina_hook`` while ``mode["ina"]``, else Gloo's allreduce of the bucket
    (DDP's default, as a hook) on the default group; every rank switches at the same step."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: PLC0415

    group = dist.distributed_c10d._get_default_group()

    def hook(state, bucket):
        return ina_hook(state, bucket) if mode["ina"] else allreduce_hook(group, bucket)
    return hook


def interleaved_steps(model, opt, x, y, warmup: int, steps: int, mode: dict, windows: list, on_timed):
    """``steps`` pairs of steps, one through the INA hook and one through Gloo (``mode``: the hook's switch, see
    :func:`interleaving_hook`), their order alternating from pair to pair: (INA step times, Gloo step times),
    pair by pair; ``windows`` gets the INA steps' (start, end)."""
    ina, gloo = [], []
    for i in range(warmup + steps):
        if i == warmup:
            on_timed()
        for use_ina in (True, False) if i % 2 == 0 else (False, True):
            mode["ina"] = use_ina
            t = timed_steps(model, opt, x, y, 0, 1, windows if use_ina and i >= warmup else None)[0]
            if i >= warmup:
                (ina if use_ina else gloo).append(t)
    return ina, gloo


def interleaved_summary(ina: list[float], gloo: list[float]) -> dict:
    """The INA step over the Gloo step of the same pair: median and quartiles over the pairs."""
    r = sorted(a / b for a, b in zip(ina, gloo))
    q = statistics.quantiles(r, n=4) if len(r) > 1 else r * 3
    return {"pairs": len(r), "ina_median_s": statistics.median(ina), "gloo_median_s": statistics.median(gloo),
            "ratio_median": statistics.median(r), "ratio_q25": q[0], "ratio_q75": q[2]}


def overlap(timeline, windows) -> dict:
    """How much of the switch time ran during backward. Per step: the buckets submitted in the step; the
    last submission is when backward's last gradient was ready (the end of its compute); the switch time
    of each bucket before that point overlapped with backward, the rest is exposed (``backward_s_per_step``:
from the step's start to that point: forward and backward as they ran beside the streaming). Also the lane's CPU
    per step (agreement, encode, stream, decode) and the codec's share of it (encode + decode). The step's tail
    (DDP's lane, whose entries say when the agreement decided): the last bucket's agreement (submitted to
    decided: the round, waiting for the other ranks' same bucket), its allreduce (decided to finished) and the
    rest of the step after it (DDP's copy into the gradients, the optimizer)."""
    busy = inside = exposed = cpu = codec = backward = 0.0
    tail = [0.0, 0.0, 0.0]
    n = n_tail = 0
    for lo, hi in windows:
        mine = [e for e in timeline if lo <= e[0] <= hi]
        if not mine:
            continue
        end = max(mine, key=lambda e: e[0])          # the last bucket submitted: backward's compute ended
        last = end[0]
        if len(end) > 5:
            tail[0] += end[5] - end[0]
            tail[1] += end[2] - end[5]
            tail[2] += hi - end[2]
            n_tail += 1
        busy += sum(e[2] - e[1] for e in mine)
        inside += sum(max(0.0, min(e[2], last) - e[1]) for e in mine)
        exposed += max(e[2] for e in mine) - last
        backward += last - lo
        cpu += sum(e[3] for e in mine)
        codec += sum(e[4] for e in mine)
        n += 1
    n = max(n, 1)
    phases = _phases(timeline, windows)
    return {**({"per_bucket_ms": phases} if phases else {}),
            "buckets_per_step": len([e for e in timeline if windows[0][0] <= e[0] <= windows[-1][1]]) / n,
            "switch_s_per_step": busy / n, "overlapped_fraction": inside / busy if busy else 0.0,
            "exposed_s_per_step": exposed / n, "backward_s_per_step": backward / n,
            "lane_cpu_s_per_step": cpu / n, "codec_cpu_s_per_step": codec / n,
            **({"last_bucket_agreement_s": tail[0] / n_tail, "last_bucket_switch_s": tail[1] / n_tail,
                "after_last_bucket_s": tail[2] / n_tail} if n_tail else {})}


def _phases(timeline, windows) -> list:
    """Per bucket (in submission order within a step): the median of its submitted, started (the lane took it),
    decided (agreement done: the switch's part starts) and finished times, ms from the step's start; where the
    lane recorded them, also when the client's allreduce began and when its exponent negotiation was back."""
    rows: dict = {}
    names = ("submitted", "started", "decided", "finished", "client_began", "negotiated")
    for lo, hi in windows:
        mine = sorted((e for e in timeline if lo <= e[0] <= hi and len(e) > 5), key=lambda e: e[0])
        for i, e in enumerate(mine):
            rows.setdefault(i, []).append([(t - lo) * 1e3 for t in (e[0], e[1], e[5], e[2], *e[6:8])])
    return [{k: round(statistics.median(r[j] for r in rs), 2) for j, k in enumerate(names) if all(len(r) > j for r in rs)}
            for _, rs in sorted(rows.items())]


def worker(kind: str, out: str, warmup: int, steps: int) -> None:
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    model = make_net()
    # --interleave: DDP's steps alternate between the INA hook and Gloo's allreduce, pair by pair
    interleave, mode = kind == "ddp-ina" and os.environ.get("BENCH_INTERLEAVE") == "1", {"ina": True}
    if kind == "horovod":
        import horovod.torch as hvd  # noqa: PLC0415

        hvd.init()
        rank = hvd.rank()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters())
    else:
        import torch.distributed as dist  # noqa: PLC0415
        from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        cap = os.environ.get("INA_BUCKET_BYTES")     # codec@N: DDP buckets of N bytes (default: DDP's 25 MiB)
        model = DDP(model, **({"bucket_cap_mb": int(cap) / 2**20} if cap else {}))
        hook = None
        if kind == "ddp-ina":
            from gloo_patch.torch_backend import InaHookState, ina_allreduce_hook  # noqa: PLC0415
            hook = InaHookState()
            hook.lane.client.record_timeline = True      # the codec's encode/decode time per bucket
            model.register_comm_hook(hook, interleaving_hook(ina_allreduce_hook, mode) if interleave
                                     else ina_allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch(rank)
    windows: list = []
    before: dict = {}
    ina_hvd = kind == "horovod" and os.environ.get("INA_SWITCH")
    if ina_hvd:
        from gloo_patch import horovod as patch  # noqa: PLC0415
    switch_pid = os.environ.get("BENCH_SWITCH_PID") if rank == 0 else None

    def on_timed():      # the counters at the first timed step
        if ina_hvd:
            before.update(patch.stats())
        before["threads"] = thread_cpu.snapshot()
        if switch_pid:
            before["switch"] = thread_cpu.snapshot(int(switch_pid))
    if interleave:
        times, gloo_times = interleaved_steps(model, opt, x, y, warmup, steps, mode, windows, on_timed)
    else:
        times, gloo_times = timed_steps(model, opt, x, y, warmup, steps, windows, on_timed), None
    # where the CPU went during the timed steps, per thread of this rank (and of the switch): run and wait for a core
    run = 2 * steps if interleave else steps      # steps run (interleaved: both steps of each pair)
    threads = thread_cpu.per_step(thread_cpu.since(before["threads"]), run, 1e-4)
    Path(out).with_name(f"threads-r{rank}.json").write_text(json.dumps(threads))
    if rank == 0:
        n_tensors = sum(1 for _ in model.parameters())
        n_params = sum(p.numel() for p in model.parameters())
        res = {"median_s": statistics.median(times), "mean_s": statistics.mean(times), "steps": steps,
               "tensors": n_tensors, "params": n_params}
        if gloo_times is not None:
            res["interleaved"] = interleaved_summary(times, gloo_times)
        if kind == "ddp-ina":
            res["overlap"] = overlap(hook.timeline(), windows)
            res["client"] = hook.stats()["client"]
        if ina_hvd:
            st = patch.stats()       # the worker's seconds per timed step
            res["worker_s_per_step"] = {k: (v - before["seconds"][k]) / steps for k, v in st["seconds"].items()}
            res["agreement_rounds_per_step"] = (st["agreement_rounds"] - before["agreement_rounds"]) / steps
            if "timeline" in st:
                res["overlap"] = overlap(st["timeline"], windows)
        if switch_pid:
            res["switch_threads"] = thread_cpu.per_step(thread_cpu.since(before["switch"]), run, 1e-4)
        Path(out).write_text(json.dumps(res))
    if kind != "horovod":
        ddp_shutdown(hook)


def ddp_shutdown(hook=None) -> None:
    """End a DDP worker: every rank past its last collective, the hook's lane closed (it leaves the switch's
    job), the process group destroyed, then the process ends without interpreter finalization. A Gloo worker thread drops its reference to a finished
    allreduce (or barrier) after the caller's wait returned; the work's destructor needs the GIL, and if
    the main thread is finalizing the interpreter by then, the thread is ended inside that destructor and
    the process aborts ("terminate called without an active exception", SIGABRT) after its results were
    written. ``destroy_process_group`` does not join those threads while DDP's reducer still holds the
    group, which outlives the model here. Nothing is left to clean up after this: the results are written."""
    import torch.distributed as dist  # noqa: PLC0415

    dist.barrier()
    if hook is not None:
        hook.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def compute_only(warmup: int, steps: int) -> float:
    """The same step on one process without any allreduce: the compute floor."""
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    model = make_net()
    x, y = batch(0)
    return statistics.median(timed_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), x, y, warmup, steps))


# ---- the launcher ---------------------------------------------------------------------------------------------
def run_config(kind: str, codec: str | None, switch: str | None, topo, a, switch_pid: int | None = None) -> dict:
    prefix = topo.prefix if topo else None
    out = Path(tempfile.mkdtemp(prefix="bench_fw_")) / "r0.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INA_") or k == "INA_TOKEN"}  # the switch's token
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    if switch_pid is not None and codec is not None:     # rank 0 reads the switch's CPU over the timed steps
        env["BENCH_SWITCH_PID"] = str(switch_pid)
    if getattr(a, "interleave", False) and kind == "ddp-ina":
        env["BENCH_INTERLEAVE"] = "1"
    if codec is not None:   # "nc" or "nc@<bucket bytes>" (Horovod's INA_BUCKET_BYTES; 0: no overlap); "gloo@N": DDP, no INA
        codec, _, bucket = codec.partition("@")
        if codec != "gloo":
            env.update(INA_SWITCH=switch, INA_CODEC=codec, INA_SEED="7", INA_TIMEOUT="30")
        if bucket:      # Horovod: INA_BUCKET_BYTES; DDP: bucket_cap_mb (0: one bucket, no overlap)
            env["INA_BUCKET_BYTES"] = bucket if int(bucket) > 0 else str(1 << 40)
    me = [PY, "-m", "experiments.bench_frameworks", "--worker", kind, "--out", str(out), "--warmup", str(a.warmup),
          "--steps", str(a.steps)]
    shim = [PY, "-m", "gloo_patch.netns_rank", "--prefix", prefix, "--"] if prefix else []
    t0 = time.monotonic()
    if kind == "horovod":
        cmd = [PY, "-m", "gloo_patch.rendezvous_fix", "-np", "2", "-H", "localhost:2", "--gloo", *shim, *me]
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
        codes, err = [p.returncode], p.stdout[-2000:] + p.stderr[-2000:]
    else:
        port, procs = free_port(), []
        for r in range(2):
            e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR=topo.host("w0").ip if topo else "127.0.0.1", MASTER_PORT=str(port))  # rank 0 serves
            procs.append(subprocess.Popen([*shim, *me], env=e, cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=a.timeout)[0] for p in procs]
        codes, err = [p.returncode for p in procs], "".join(o[-2000:] for o in outs)
    if any(codes) or not out.exists():
        raise RuntimeError(f"{kind} {codec or 'gloo'} failed ({codes}):\n{err}")
    res = json.loads(out.read_text())
    res["wall_s"] = time.monotonic() - t0
    res["threads"] = {f"rank{r}": json.loads(f.read_text()) for r in range(2)
                      if (f := out.with_name(f"threads-r{r}.json")).exists()}
    return res


def breakdown(r: dict) -> str:
    """Where a step's time went. DDP: the lane's timeline over the timed steps; Horovod: the INA worker
    thread's seconds per timed step (the agreement wait: the worker waiting for a bucket's round, i.e. for the
    other rank to seal the same bucket; it overlaps backward and the switch time of the buckets before)."""
    ov, w = r.get("overlap"), r.get("worker_s_per_step")
    out = ""
    if ov:
        out = (f"  {ov['buckets_per_step']:.1f} buckets/step, forward+backward {ov['backward_s_per_step'] * 1e3:.1f} "
                f"ms, switch {ov['switch_s_per_step'] * 1e3:.1f} ms/step, {100 * ov['overlapped_fraction']:.0f}% of it "
                f"during backward, exposed {ov['exposed_s_per_step'] * 1e3:.1f} ms; lane CPU "
                f"{ov['lane_cpu_s_per_step'] * 1e3:.1f} ms/step (codec {ov['codec_cpu_s_per_step'] * 1e3:.1f})")
        if "last_bucket_agreement_s" in ov:
            out += (f"\n    tail: last bucket's agreement {ov['last_bucket_agreement_s'] * 1e3:.2f} ms, its allreduce "
                    f"{ov['last_bucket_switch_s'] * 1e3:.2f} ms, then {ov['after_last_bucket_s'] * 1e3:.2f} ms to the "
                    "step's end")
    if w:
        out += (f"\n    {r['agreement_rounds_per_step']:.1f} rounds/step; worker per step: agreement wait "
                f"{w['agreement_wait'] * 1e3:.1f} ms, switch {w['switch'] * 1e3:.1f} ms, Gloo {w['native'] * 1e3:.1f} "
                f"ms, CPU {w['worker_cpu'] * 1e3:.1f} ms"
                + (f" (reading rounds {w['agreement_cpu'] * 1e3:.1f}" if "agreement_cpu" in w else "")
                + (f", in the switch client {w['client_cpu'] * 1e3:.1f}" if "client_cpu" in w else "")
                + (")" if "agreement_cpu" in w else ""))
    return out


def cpu_breakdown(r: dict) -> str:
    """Per rank: the main thread's (forward, backward, step) time on a core and waiting for one, and the other
    threads' CPU; the switch's CPU; per timed step."""
    parts = []
    for rank, th in sorted(r.get("threads", {}).items()):
        main = th.get("MainThread", {"run_s": 0.0, "wait_s": 0.0})
        others = sum(v["run_s"] for k, v in th.items() if k != "MainThread")
        parts.append(f"{rank} main {main['run_s'] * 1e3:.1f} ms CPU + {main['wait_s'] * 1e3:.1f} ms waiting for a "
                     f"core, other threads {others * 1e3:.1f} ms CPU")
    switch = sum(v["run_s"] for v in r.get("switch_threads", {}).values())
    if switch:
        parts.append(f"switch {switch * 1e3:.1f} ms CPU")
    if parts:     # what competes with the main threads for the cores: the number INA's integrations try to cut
        parts.append(f"beside the main threads {(beside_main_s(r) + switch) * 1e3:.1f} ms CPU in all")
    return ("\n    per step: " + "; ".join(parts)) if parts else ""


def beside_main_s(r: dict) -> float:
    """CPU seconds per step of every thread of every rank but the main threads (the switch not included)."""
    return sum(v["run_s"] for th in r.get("threads", {}).values() for k, v in th.items() if k != "MainThread")


def worker_kind(framework: str, codec: str) -> str:
    """The worker of a row: DDP with the INA hook, or plain DDP for ``gloo@N`` (Gloo with DDP buckets of N bytes,
    to compare bucket layouts with Gloo's own in the same invocation)."""
    if codec.partition("@")[0] == "gloo":
        if framework != "ddp":
            raise SystemExit(f"--codecs {codec}: gloo@N (DDP's bucket_cap_mb for plain Gloo) is for --frameworks ddp")
        return "ddp"
    return "ddp-ina" if framework == "ddp" else framework


def target(rate: str | None) -> str:
    """The goal for INA's step time, as a ratio to Gloo's in the same run."""
    return "<= 1.05x Gloo's time (loopback)" if rate is None else ">= 2.5x faster than Gloo (0.40x its time)"


def meets(ratio: float, rate: str | None) -> bool:
    return ratio <= 1.05 if rate is None else ratio <= 1 / 2.5


def switch_for(topo):
    """The switch (switch_model.launch): on loopback, or in host ``sw`` of the topology."""
    if topo is None:
        return start_switch(None, "--stats-interval", "0")
    return start_switch(9999, "--stats-interval", "0", popen=functools.partial(topo.popen, "sw"),
                        host="0.0.0.0", control_host=topo.host("sw").ip, timeout=30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--rate", help="emulated link rate per host, e.g. 100mbit (default: loopback, no shaping)")
    ap.add_argument("--codecs", default="nc,bfp32",
                    help="codecs; codec@N runs Horovod with INA_BUCKET_BYTES=N, DDP with bucket_cap_mb N bytes (codec@0: no "
                         "overlap with backward); gloo@N: DDP on plain Gloo with N-byte buckets")
    ap.add_argument("--frameworks", default="horovod,ddp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--interleave", action="store_true",
                    help="DDP with INA: the steps alternate between the INA hook and Gloo's allreduce in one run "
                         "(pairs of steps, the order alternating; row 'interleaved': the per-pair ratio's median and "
                         "quartiles), a paired ratio on a loaded machine")
    ap.add_argument("--worker", choices=("horovod", "ddp", "ddp-ina"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, a.out, a.warmup, a.steps)
        return 0
    topo = None
    if a.rate:
        from ina.net import Topology  # noqa: PLC0415
        topo = Topology(workers=2, rate=a.rate).__enter__()
    results = {"target": target(a.rate),
               "emulated": f"2 ranks, each in its own network namespace behind a {a.rate} link (tbf/htb), "
                           "switch in host sw" if a.rate else "2 ranks on loopback (no shaping)",
               "load_average_start": os.getloadavg()[0], "compute_only_s": compute_only(a.warmup, a.steps), "runs": []}
    if not a.json:
        print(f"{results['emulated']}; compute only {results['compute_only_s'] * 1e3:.1f} ms/step", flush=True)
    try:
        sw = switch_for(topo)
        addr = f"{topo.host('sw').ip if topo else '127.0.0.1'}:{sw.port}"
        try:
            for fw in a.frameworks.split(","):
                base = run_config(fw, None, None, topo, a)
                results["runs"].append({"framework": fw, "codec": "gloo", **base, "ratio_to_gloo": 1.0})
                if not a.json:
                    print(f"{fw:8s} gloo   {base['median_s'] * 1e3:7.1f} ms/step" + cpu_breakdown(base), flush=True)
                for codec in a.codecs.split(","):
                    r = run_config(worker_kind(fw, codec), codec, addr, topo, a, sw.proc.pid)
                    ratio = r["median_s"] / base["median_s"]
                    results["runs"].append({"framework": fw, "codec": codec, **r, "ratio_to_gloo": ratio,
                                            "speedup_vs_gloo": 1 / ratio, "meets_target": meets(ratio, a.rate)})
                    if not a.json and "interleaved" in r:
                        iv = r["interleaved"]
                        print(f"{fw:8s} {codec:6s} interleaved with Gloo: {iv['ratio_median']:.3f}x Gloo's step "
                              f"(quartiles {iv['ratio_q25']:.3f}-{iv['ratio_q75']:.3f}, {iv['pairs']} pairs)", flush=True)
                    if not a.json:
                        print(f"{fw:8s} {codec:6s} {r['median_s'] * 1e3:7.1f} ms/step (load {os.getloadavg()[0]:.1f}) "
                              f"{ratio:.2f}x Gloo's time ({base['median_s'] * 1e3:.1f} ms; target {target(a.rate)}: "
                              f"{'met' if meets(ratio, a.rate) else 'not met'})" + breakdown(r) + cpu_breakdown(r), flush=True)
        finally:
            sw.stop(timeout=10)
    finally:
        if topo is not None:
            topo.__exit__(None, None, None)
    results["load_average_end"] = os.getloadavg()[0]     # the machine is shared: read the ratios with it
    if a.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
