"""Time-to-accuracy through horovodrun and torchrun: real models, locally generated data, emulated links.

    python -m experiments.bench_tta --rates 100mbit --seeds 0,1,2 --json out.json --plot docs/img/tta.png
    python -m experiments.bench_tta --workloads embedding --frameworks ddp --methods gloo,nc --rates 100mbit

For every workload (``experiments.tta_workloads``: ``resnet``, a ResNet-style conv net on 3x32x32 colour
digits; ``embedding``, an EmbeddingBag text classifier on a synthetic topic corpus), framework
(``horovod``: ``hvd.DistributedOptimizer`` through ``horovodrun``; ``ddp``: DDP through ``torchrun``,
backend ``gloo`` for the baseline and ``ina`` for the INA methods, except that codecs with error feedback,
3lc-3v, bgt, qgt, go through DDP's comm hook on a Gloo group: only the hook keys their residuals), link rate and method (``gloo``, or an
INA codec: ``nc``, ``bfp32``, ``nd``, ``3lc-3v``, ``terngrad``, ...) and seed (``--seeds``: the model's
initialisation, every rank's batches, the stochastic codecs' draws), ``--ranks`` (2) ranks train the same number
of steps, each in its own network namespace behind a shaped link (``ina.net.Topology``, tbf/htb;
``gloo_patch.netns_rank``), the switch in host ``sw``; Gloo's ring traffic crosses the same links. Rate
``loopback``: no namespaces, no shaping.

Rank 0 records the wall-clock time since the first step at every checkpoint (``--eval-every``) and keeps
a copy of the model; after training it evaluates the copies on the held-out test set, so evaluation
costs no training time. Reported per run (against the Gloo run of the same workload, framework, rate and
seed): the accuracy curve, the final accuracy, the time to reach Gloo's final accuracy minus
``--target-margin`` points, and the training time as a ratio to Gloo's; over the seeds
(``experiments.tta_report``): the mean and spread of the paired accuracy differences to Gloo, a 95 %
confidence interval, whether the method is within the margin of Gloo (a non-inferiority test) and within
seed-to-seed noise.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.tta_report import key, plot, run_table, seed_statistics, seed_table, summarise
from switch_model.launch import free_port, start_switch

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
LR = {"resnet": 0.1, "embedding": 1.0}          # SGD, momentum 0.9, linear decay to 0 over the run
HOOK = "gloo+ina-hook"     # DDP on a Gloo group with gloo_patch.torch_backend.ina_allreduce_hook


def ddp_path(codec: str) -> str:
    """How DDP reaches the switch: backend 'ina', except for codecs with error feedback, whose residuals
    only the comm hook keys (per bucket; backend 'ina' runs them without: gloo_patch.torch_backend)."""
    from ina import compression  # noqa: PLC0415
    return HOOK if compression.get(codec).keeps_residuals else "ina"


# ---- the ranks ----------------------------------------------------------------------------------------------
def setup(framework: str, backend: str, model):
    """Initialise the framework; returns (rank, model to call, optimizer over its parameters)."""
    import torch  # noqa: PLC0415

    if framework == "horovod":
        import horovod.torch as hvd  # noqa: PLC0415   (INA_SWITCH in the environment: the autopatch hook)

        hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
        return hvd.rank(), model, hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    import torch._dynamo  # noqa: F401, PLC0415 - before init_process_group: see finish()
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    import gloo_patch.torch_backend as tb  # noqa: PLC0415 - registers backend 'ina'

    dist.init_process_group("gloo" if backend == HOOK else backend)
    ddp = DDP(model)
    if backend == HOOK:     # Gloo group, buckets through the switch by the comm hook (keyed: error feedback)
        ddp.ina_hook_state = tb.InaHookState()
        ddp.register_comm_hook(ddp.ina_hook_state, tb.ina_allreduce_hook)
    return dist.get_rank(), ddp, torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)


def finish(framework: str) -> None:
    """The end of a rank; DDP: the caller has dropped its model first. destroy_process_group joins Gloo's
    worker threads only when it drops the last reference to the group; one left running can drop a finished
    collective while the interpreter finalizes, and the process aborts (SIGABRT). The DDP model (its reducer,
    the hook's state) holds the group, and torch.distributed modules imported after init_process_group bind it
    as an argument default: DDP's constructor imports many through torch._dynamo, so setup() imports it first."""
    if framework == "horovod":
        import horovod.torch as hvd  # noqa: PLC0415
        hvd.shutdown()
        return
    import gc  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415
    dist.barrier()      # no rank closes its Gloo pairs while another still talks to it
    gc.collect()        # the dropped model's reference cycles
    dist.destroy_process_group()


def ina_stats(framework: str, backend: str, model, windows) -> dict | None:
    """Rank 0's INA counters (what went through the switch, what fell back to Gloo; DDP: the overlap of
    the switch with backward over the steps' ``windows``), None without INA."""
    if backend == "gloo":
        return None
    if framework == "horovod":
        import gloo_patch.horovod  # noqa: PLC0415
        return gloo_patch.horovod.stats()
    import torch.distributed as dist  # noqa: PLC0415

    from experiments.bench_frameworks import overlap  # noqa: PLC0415
    src = model.ina_hook_state if backend == HOOK else dist.distributed_c10d._get_default_group()
    return {**src.stats(), "overlap": overlap(src.timeline(), windows), "ddp_path": backend}


def worker(a) -> None:
    import torch  # noqa: PLC0415

    from experiments.tta_workloads import accuracy, make  # noqa: PLC0415

    torch.set_num_threads(1)
    rank_env = int(os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0")))
    module, train, test = make(a.workload, a.seed, rank_env)
    rank, model, opt = setup(a.framework, a.backend, module)
    lr0 = float(a.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr0 * (1 - s / a.steps))
    checkpoints, step_times, windows = [], [], []
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        x, y = train.sample(a.batch)
        ts = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        step_times.append(time.perf_counter() - ts)
        windows.append((ts, ts + step_times[-1]))
        if rank == 0 and (step % a.eval_every == 0 or step == a.steps):
            checkpoints.append((step, time.perf_counter() - t0, copy.deepcopy(module.state_dict())))
            print(f"[bench_tta] step {step}/{a.steps} {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    train_s = time.perf_counter() - t0
    checksum = float(sum(float(p.detach().double().sum()) for p in module.parameters()))
    ina = ina_stats(a.framework, a.backend, model, windows[len(windows) // 5:])
    del model, opt, sched           # the DDP model holds the process group (see finish)
    finish(a.framework)
    if rank != 0:
        return
    curve = []
    for step, secs, state in checkpoints:
        module.load_state_dict(state)
        curve.append({"step": step, "seconds": secs, "accuracy": accuracy(module, test)})
    Path(a.out).write_text(json.dumps({
        "curve": curve, "final_accuracy": curve[-1]["accuracy"], "train_s": train_s, "steps": a.steps,
        "median_step_s": statistics.median(step_times), "checksum_rank0": checksum, "ina": ina,
        "params": sum(p.numel() for p in module.parameters()), "tensors": sum(1 for _ in module.parameters())}))


# ---- the launcher -------------------------------------------------------------------------------------------
def run_one(workload: str, framework: str, method: str, seed: int, switch: str | None, topo, a) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench_tta_")) / "r0.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INA_") or k == "INA_TOKEN"}  # the switch's token
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    backend = "gloo"
    if method != "gloo":
        env.update(INA_SWITCH=switch, INA_CODEC=method, INA_SEED=str(7 + seed), INA_TIMEOUT="60", INA_LOG="warning")
        backend = ddp_path(method) if framework == "ddp" else "ina"
    me = [PY, "-m", "experiments.bench_tta", "--worker", "--workload", workload, "--framework", framework,
          "--backend", backend, "--steps", str(a.steps[workload]), "--batch", str(a.batch),
          "--eval-every", str(a.eval_every), "--seed", str(seed), "--lr", str(a.lr[workload]), "--out", str(out)]
    shim = [PY, "-m", "gloo_patch.netns_rank", "--prefix", topo.prefix, "--"] if topo else []
    if framework == "horovod":
        cmd = [PY, "-m", "gloo_patch.rendezvous_fix", "-np", str(a.ranks), "-H", f"localhost:{a.ranks}", "--gloo",
               *shim, *me]
    else:
        cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node", str(a.ranks), "--master-port", str(free_port()),
               "--no-python", *shim, *me]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"{workload} {framework} {method} failed ({p.returncode}):\n"
                           f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "launch_s": time.monotonic() - t0, "lr": a.lr[workload]}


def switch_for(topo):
    if topo is None:
        return start_switch(None, "--stats-interval", "0")
    return start_switch(9999, "--stats-interval", "0", popen=functools.partial(topo.popen, "sw"),
                        host="0.0.0.0", control_host=topo.host("sw").ip, timeout=30)


def run_config(config: dict, addr: str, topo, a, results: dict, save) -> None:
    """One run of ``config`` (workload, framework, method, rate, ranks, seed) unless --resume has it already."""
    fields = tuple(config)
    if any(key(r, *fields) == tuple(config.values()) for r in results["runs"]):
        return
    r = run_one(config["workload"], config["framework"], config["method"], config["seed"], addr, topo, a)
    r.update(config)
    results["runs"].append(r)
    summarise(results["runs"], a.target_margin)
    print(f"[bench_tta] {config['rate']:8s} {config['workload']:9s} {config['framework']:7s} {config['method']:8s} "
          f"seed {config['seed']}  acc {100 * r['final_accuracy']:5.2f}% ({r.get('accuracy_vs_gloo_points', 0):+.2f} "
          f"pts vs Gloo)  train {r['train_s']:6.1f}s ({r.get('speedup_vs_gloo', 1):.2f}x Gloo's speed)  "
          f"{1e3 * r['median_step_s']:.0f} ms/step", file=sys.stderr, flush=True)
    save()


def run_rate(rate: str, a, results: dict, save) -> None:
    from ina.net import Topology  # noqa: PLC0415

    topo = None if rate == "loopback" else Topology(workers=a.ranks, rate=rate).__enter__()
    try:
        sw = switch_for(topo)
        addr = f"{topo.host('sw').ip if topo else '127.0.0.1'}:{sw.port}"
        try:
            for seed in a.seeds:          # seeds outermost: a run cut short still has every method of its seeds
                for workload in a.workloads:
                    for framework in a.frameworks:
                        for method in a.methods:
                            run_config(dict(workload=workload, framework=framework, method=method, rate=rate,
                                            ranks=a.ranks, seed=seed), addr, topo, a, results, save)
        finally:
            sw.stop(timeout=10)
    finally:
        if topo is not None:
            topo.__exit__(None, None, None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="resnet,embedding")
    ap.add_argument("--frameworks", default="horovod,ddp")
    ap.add_argument("--methods", default="gloo,bfp32,nc",
                    help="gloo and INA codecs (nc, bfp32, nd, 3lc-3v, terngrad, ...)")
    ap.add_argument("--rates", default="100mbit,1gbit", help="link rates; 'loopback': no namespaces, no shaping")
    ap.add_argument("--steps", default="resnet=400,embedding=400", help="steps per workload (same for every method)")
    ap.add_argument("--lr", default=",".join(f"{k}={v:g}" for k, v in LR.items()),
                    help="initial learning rate per workload (every method of a run the same)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="per-rank batch")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seeds", default="0,1,2",
                    help="seeds (model initialisation, batches, stochastic codecs): every method trains from each")
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--target-margin", type=float, default=0.5, help="points below Gloo's final accuracy")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--json", help="write the results (after every run) to this file")
    ap.add_argument("--plot", help="accuracy against wall-clock time, one panel per workload/framework/rate")
    ap.add_argument("--resume", action="store_true", help="keep the runs already in --json and skip them")
    ap.add_argument("--report-only", action="store_true", help="only print the table (and --plot) of --json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for k in ("workload", "framework", "backend", "out"):
        ap.add_argument(f"--{k}", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.steps = int(a.steps)
        worker(a)
        return 0
    from experiments.tta_workloads import WORKLOADS  # noqa: PLC0415

    a.workloads, a.frameworks, a.methods = (s.split(",") for s in (a.workloads, a.frameworks, a.methods))
    if bad := [w for w in a.workloads if w not in WORKLOADS]:
        ap.error(f"unknown workload {bad[0]!r} (expected {', '.join(WORKLOADS)})")
    if bad := [f for f in a.frameworks if f not in ("horovod", "ddp")]:
        ap.error(f"unknown framework {bad[0]!r} (expected horovod, ddp)")
    a.steps = {k: int(v) for k, v in (kv.split("=") for kv in a.steps.split(","))}
    a.lr = {**LR, **{k: float(v) for k, v in (kv.split("=") for kv in a.lr.split(","))}}
    a.seeds = [int(x) for x in a.seeds.split(",")]
    results = {"emulated": f"{a.ranks} ranks, each in its own network namespace behind a shaped link (tbf/htb), switch "
                           "in host sw; Gloo's ring crosses the same links", "args": sys.argv[1:], "runs": []}

    if (a.resume or a.report_only) and a.json and Path(a.json).exists():
        results["runs"] = json.loads(Path(a.json).read_text())["runs"]

    def save():
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))

    for rate in [] if a.report_only else a.rates.split(","):
        run_rate(rate, a, results, save)
    summarise(results["runs"], a.target_margin)
    stats = seed_statistics(results["runs"], a.target_margin)
    results["seed_statistics"] = stats
    if not a.report_only:
        save()
    print(run_table(results["runs"]))
    print()
    print(seed_table(stats, a.target_margin))
    if a.plot:
        plot(results["runs"], Path(a.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
