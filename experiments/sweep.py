"""ina-sweep: the papers' evaluation on emulated links (bandwidth sweep of Gloo ring vs INA codecs).

    ina-sweep --quick                       # < 3 minutes: ResNet-110 size / 4, 2 and 4 workers, core methods
    ina-sweep                               # the full sweep (long: hours at 10 Mbit/s with VGG-16 sizes)
    ina-sweep --out results/x --rates 100mbit --workers 4 --methods gloo,ina:nc --sizes 1.7M
    ina-sweep --methods baselines,ina:thc ...  # Gloo fp32 and fp16 rings, PyTorch's PowerSGD hook, THC

One emulated topology (``ina.net.Topology``, MTU 9000) with a switch host running ``ina-switch``
(unshaped switch link: one port per worker) and up to 8 worker hosts, each with its own shaped
link. For every worker count, long-lived worker processes (``experiments.sweep_worker``) are
started inside the worker hosts; for every link rate (changed live with ``set_rate``), tensor
size and method they do warm-up allreduces, then timed repetitions. The launcher reads the links'
kernel counters (``topo.counters()``) right before and after the timed part: bytes on the wire are
measured, not estimated.

Workloads:

* ``allreduce``: gradient-sized tensors (ResNet-110 1.7M, AlexNet 61M, VGG-16 138M parameters;
  ``--quick`` uses only ResNet-110's count divided by ``--scale``, default 4: 425,000 elements);
* ``throughput``: data-parallel training with synthetic data (random batches of 32 per worker) of a
  ResNet with that parameter count and a real conv net's per-tensor layout (``sweep_worker.layout_model``):
  forward+backward, the gradients allreduced bucket by bucket as the integrations fuse them, SGD step;
  measured end to end: samples/s = workers * batch * steps / wall time of the slowest rank
  (``--tp-sizes``, default ResNet-110's count: the large models' runs take minutes per step at 10 Mbit/s);
* ``accuracy``: data-parallel SGD on scikit-learn's digits for a fixed number of steps, Gloo vs
  every INA codec; test accuracy against steps and wall time.

Methods: ``gloo`` (Gloo's ring, fp32), the strongest non-INA baselines a user can switch on
(``gloo-fp16``: Horovod's Compression.fp16; ``powersgd``: PyTorch's PowerSGD DDP hook; see
``experiments.baselines``) and ``ina:<codec>`` (through the switch, or its host aggregator for the
variable-length codecs, labelled NOT switch-feasible).

Outputs in ``--out`` (default ``results/sweep-<timestamp>``): ``results.json`` + ``results.csv``
(raw, one record per configuration), ``*.png`` plots and ``report.md``. A re-run with the same
``--out`` skips configurations already in ``results.json``. Every allreduce row carries its CPU floor
(the processes' measured CPU per allreduce over the cores, against the ideal and the measured time)
and is flagged CPU-bound (or CPU-tight: at its ideal with little CPU to spare) by the rule of
``experiments/sweep_cpu.py``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import sys
import time
from pathlib import Path

from .baselines import BASELINES, is_baseline
from .sweep_group import SWITCH_PORT, CtrlC, WorkerGroup
from .sweep_methods import CORE_METHODS, all_methods, host_methods, is_host_method, seed_methods
from .sweep_results import derive, load_results, save_results

log = logging.getLogger("ina.sweep")

MODELS = {"resnet110": 1_700_000, "alexnet": 61_000_000, "vgg16": 138_000_000}
RATES = ["10mbit", "100mbit", "1gbit", "unlimited"]
SWITCH_SLOTS, SWITCH_ELEMENTS = 256, 8192
BATCH = 32


def parse_size(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1e3, "m": 1e6, "g": 1e9}.get(s[-1:], 1)
    v = float(s[:-1] if s[-1:] in "kmg" else s) * mult
    if v < 1 or v != int(v):
        raise argparse.ArgumentTypeError(f"size {s!r}: expected a positive element count such as 1.7M or 4096")
    return int(v)


def rate_bps(rate: str) -> float | None:
    from ina.net import parse_rate
    return parse_rate(rate, tbf_limit=False)      # a dilated target may exceed tbf's cap; links check theirs


def key_of(rec: dict) -> str:
    from .dilation import config_key
    return config_key(rec["workload"], rec["method"], rec["workers"], rec["rate"], rec["elements"],
                      rec.get("dilation", 1), rec.get("profile"))


# ------------------------------------------------------------------------------------------------
# link-bound ideal
def payload_widths(method: str, n: int = 4) -> tuple[int, int]:
    """Bytes per element (upload, download) of a method's payload on the wire with n workers (None:
    variable length). NC8 sums come back re-encoded (1 byte); int8 codes whose sum over n workers
    fits int8 come back as int8 (INT8_NARROW); other integer sums as int32."""
    if method == "gloo":
        return 4, 4
    if is_host_method(method):
        return None
    from ina import compression
    from ina.wire import PAYLOAD_WIDTH
    c = compression.get(method[4:])
    return PAYLOAD_WIDTH[c.payload_type], c.result_width(n)


def ideal_time(method: str, n: int, elements: int, rate: str) -> float | None:
    """Link-bound time: ring 2(n-1)/n*S/rate; INA max(S_up, S_down)/rate (both directions concurrent)."""
    bps = rate_bps(rate)
    if is_baseline(method):
        from . import baselines
        return baselines.ideal_time(method, n, elements, bps)
    if bps is None or is_host_method(method):      # host-aggregated: from the measured bytes (run_bench)
        return None
    up, down = payload_widths(method, n)
    if method == "gloo":
        return 2 * (n - 1) / n * elements * 4 * 8 / bps
    return max(up, down) * elements * 8 / bps


# ------------------------------------------------------------------------------------------------
def _link_bytes(topo, n: int, rate: str) -> dict:
    c = topo.counters(*[w.name for w in topo.workers[:n]], topo.switch.name)
    shaped = rate_bps(rate) is not None
    up = sum((v.up_bytes if shaped else v.tx_bytes) for k, v in c.items() if k != topo.switch.name)
    down = sum((v.down_bytes if shaped else v.rx_bytes) for k, v in c.items() if k != topo.switch.name)
    drops = sum(v.up_drops + v.down_drops for k, v in c.items() if k != topo.switch.name)
    return {"up": up, "down": down, "drops": drops,
            "sw_tx": c[topo.switch.name].tx_bytes, "sw_rx": c[topo.switch.name].rx_bytes}


def _switch_counters(topo) -> dict:
    """The switch service's packet counters and drop counters by reason (its control plane's stats)."""
    from ina.control import ControlError, request

    from .sweep_cpu import switch_process_cpu_ns
    try:
        st = request(topo.switch.ip, SWITCH_PORT, {"op": "stats"}, timeout=5.0)["stats"]
    except ControlError as e:
        log.warning("switch stats unavailable: %s", e)
        return {}
    tm = st.get("timing", {})         # the stage clock: where the switch's time went (docs/performance.md)
    procs = switch_process_cpu_ns(st)      # every process of the switch (shards, host aggregator): sweep_cpu
    procs = {} if procs is None else {"process_cpu_ns": procs}
    return {**st.get("counters", {}), **{f"drop_{k}": v for k, v in st.get("drops", {}).items()},
            **{f"ns_{k}": v for k, v in tm.get("stage_ns", {}).items()}, **procs,
            **{k: tm[k] for k in ("busy_ns", "busy_cpu_ns", "tx_cpu_ns", "wait_ns", "bursts") if k in tm},
            "multicast_fallback_jobs": {f["job"]: f["why"] for f in st.get("multicast_fallbacks", [])}}


def ina_rto(method: str, rate: str, slots: int, mtu: int, n: int = 4, base: float = 0.02,
            max_elements: int = 8192) -> float | None:
    """Retransmission timeout above the queueing delay of a full window on the shaped link: a window of
    ``slots`` packets waits up to window/rate in the upload queue (and as much in the download queue);
    a 20 ms RTO at 100 Mbit/s with 64 x 8 kB in flight (42 ms) retransmits spuriously. ``base``: the
    floor (20 ms; stretched by a dilation factor)."""
    bps = rate_bps(rate)
    if not method.startswith("ina:") or bps is None or is_host_method(method):
        return None
    from .sweep_worker import ina_elements
    up, down = payload_widths(method, n)
    e = min(ina_elements(method[4:], mtu, n), max_elements)
    window = slots * e * max(up, down) * 8 / bps
    return base + 3 * window


def wait_estimate(method: str, n: int, elements: int, rate: str, slack: float = 2.0) -> float:
    """Seconds one allreduce may take, for the launcher's bounds: 3x its link-bound time plus ``slack``
    (2 s; stretched by a dilation factor) (host-aggregated codecs: 3x the time of 4 bytes per value each way)."""
    it = ideal_time(method, n, elements, rate)
    if it is None and is_baseline(method):
        from . import baselines
        it = baselines.wait_bound(method, n, elements, rate_bps(rate))
    if it is None and is_host_method(method) and rate_bps(rate):
        it = 4 * elements * 8 / rate_bps(rate)
    return (it or 0.01) * 3 + slack


def run_bench(group: WorkerGroup, topo, method: str, n: int, rate: str, elements: int, args, job: int, cid: int,
              dil=None, target: str | None = None, extra: dict | None = None) -> dict:
    """One allreduce configuration on links shaped at ``rate``; with a dilation ``dil``, reported in
    the time of ``target`` (rate x K): see experiments/dilation.py. ``extra``: further fields of the
    worker's bench command, kept in the record (experiments/bench_sparse.py: sparse, block_sparsity)."""
    from .dilation import Dilation, codec_time
    from .sweep_cpu import add_cpu_floor, cpu_cores
    dil = dil or Dilation()
    reps = args.reps
    bps = rate_bps(rate)
    est = wait_estimate(method, n, elements, rate, slack=dil.stretch(2.0))
    cmd = {"op": "bench", "id": cid, "method": method, "elements": elements, "warmup": args.warmup, "reps": reps,
           "job": job, "rto": ina_rto(method, rate, args.slots, topo.mtu, n, base=dil.stretch(0.02),
                                      max_elements=args.max_elements), "max_rto": dil.stretch(1.0), "stretch": dil.factor,
           **(extra or {})}
    t0 = time.monotonic()
    group.send(cmd)
    group.expect_all("ready", f"warm-up of {method} n={n} {rate} {elements} elements", args.timeout + est * args.warmup)
    c0, s0 = _link_bytes(topo, n, rate), _switch_counters(topo)
    group.send("go")
    res = group.expect_all("done", f"timed {method} n={n} {rate} {elements} elements", args.timeout + est * reps)
    c1, s1 = _link_bytes(topo, n, rate), _switch_counters(topo)
    times = [max(r["times"][i] for r in res) for i in range(reps)]    # a rep ends when the slowest rank has it
    med = sorted(times)[len(times) // 2]
    rec = {"workload": "allreduce", "method": method, "workers": n, "rate": rate, "rate_bps": bps,
           "elements": elements, "reps": reps, "warmup": args.warmup, "times": times, "time_median": med,
           "time_mean": sum(times) / reps, "time_min": min(times),
           "ideal_time": ideal_time(method, n, elements, rate),
           "wire_up_bytes_per_worker": (c1["up"] - c0["up"]) / (n * reps),
           "wire_down_bytes_per_worker": (c1["down"] - c0["down"]) / (n * reps),
           "wire_drops": c1["drops"] - c0["drops"],
           "switch_link_tx_bytes": (c1["sw_tx"] - c0["sw_tx"]) / reps,
           "rel_error": max(r["rel_error"] for r in res), "wall": time.monotonic() - t0,
           "worker_cpu_per_allreduce": sum(sum(r["cpu_times"]) for r in res) / (n * reps), "cpu_cores": cpu_cores(),
           "switch_counters": {k: s1[k] - s0.get(k, 0) for k in s1 if isinstance(s1[k], int) and s1[k] - s0.get(k, 0)}}
    if s1.get("multicast_fallback_jobs", {}).get(job):       # the group did not reach a worker (warm-up included)
        rec["multicast_fallback"] = s1["multicast_fallback_jobs"][job]
        log.warning("%s n=%d %s: the switch sent job %d's results as unicast copies after its multicast group "
                    "failed: %s", method, n, rate, job, rec["multicast_fallback"])
    if "client" in res[0]:
        rec["client_bytes_sent_per_worker"] = sum(r["client"]["bytes_sent"] for r in res) / (n * reps)
        rec["client_retransmissions"] = sum(r["client"]["retransmissions"] for r in res)
        rec["client_probe_retransmissions"] = sum(r["client"]["probe_retransmissions"] for r in res)
        rec["client_stall_probes"] = sum(r["client"]["stall_probes"] for r in res)   # rule 3's longer wait's probes
        rec["timelines_all"] = [r.get("timelines") for r in res]   # [rank][rep]: skew and start phase per rep
        rec["timeline_rank0"] = next((r["timeline"] for r in res if r.get("timeline")), None)   # its last timed one
    if (is_host_method(method) or method == "powersgd") and bps:
        # variable-length messages: the link-bound time of the bytes actually sent (TCP/IP headers included)
        rec["ideal_time"] = max(rec["wire_up_bytes_per_worker"], rec["wire_down_bytes_per_worker"]) * 8 / bps
        rec["ideal_from_measured_bytes"] = True
    if is_host_method(method):
        rec["aggregation"] = "host (NOT switch-feasible)"
    rec["bound_ratio"] = med / rec["ideal_time"] if rec["ideal_time"] else None
    rec.update(profile=args.profile, rto=cmd["rto"], max_rto=cmd["max_rto"], worker_timeout=args.worker_timeout,
               **(extra or {}))
    target = target or rate
    return add_cpu_floor(dil.apply(rec, target, ideal_time(method, n, elements, target),
                                   codec_time(method, n, elements, args.codec_gbps)))


def run_train(group: WorkerGroup, method: str, n: int, rate: str, args, job: int, cid: int) -> dict:
    cmd = {"op": "train", "id": cid, "method": method, "steps": args.acc_steps, "eval_every": max(1, args.acc_steps // 10),
           "job": job, "seed": 0, "lr": 0.05, "batch": BATCH}
    t0 = time.monotonic()
    group.send(cmd)
    res = group.expect_all("done", f"training with {method} n={n} {rate}", args.timeout + 600)
    curve = res[0]["curve"]
    return {"workload": "accuracy", "method": method, "workers": n, "rate": rate, "rate_bps": rate_bps(rate),
            "elements": res[0]["params"], "steps": args.acc_steps, "curve": curve,
            "final_accuracy": curve[-1]["accuracy"], "train_time": curve[-1]["time"],
            "comm_time": curve[-1]["comm_time"], "wall": time.monotonic() - t0}


def run_throughput(group: WorkerGroup, topo, method: str, n: int, rate: str, elements: int, args, job: int,
                   cid: int) -> dict:
    est = wait_estimate(method, n, elements, rate) + elements * 2e-7
    steps = args.tp_steps
    cmd = {"op": "throughput", "id": cid, "method": method, "elements": elements, "steps": steps, "warmup": 1,
           "job": job, "batch": BATCH, "rto": ina_rto(method, rate, args.slots, topo.mtu, n)}
    t0 = time.monotonic()
    c0 = _link_bytes(topo, n, rate)
    group.send(cmd)
    res = group.expect_all("done", f"training throughput of {method} n={n} {rate} {elements:,} parameters",
                           args.timeout + est * (steps + 1))
    c1 = _link_bytes(topo, n, rate)
    total = max(r["total"] for r in res)
    step_times = [max(r["step_times"][i] for r in res) for i in range(steps)]
    compute = sorted(x for r in res for x in r["compute_times"])
    return {"workload": "throughput", "method": method, "workers": n, "rate": rate, "rate_bps": rate_bps(rate),
            "elements": elements, "params": res[0]["params"], "tensors": res[0].get("tensors"),
            "buckets": res[0].get("buckets"), "bucket_bytes": res[0].get("bucket_bytes"), "steps": steps, "batch": BATCH,
            "step_times": step_times, "time_median": sorted(step_times)[steps // 2],
            "compute_time": compute[len(compute) // 2], "samples_per_s": n * BATCH * steps / total,
            "ideal_time": ideal_time(method, n, elements, rate),
            "wire_up_bytes_per_worker": (c1["up"] - c0["up"]) / (n * (steps + 1)),
            "wire_down_bytes_per_worker": (c1["down"] - c0["down"]) / (n * (steps + 1)),
            "wall": time.monotonic() - t0,
            **({"aggregation": "host (NOT switch-feasible)"} if is_host_method(method) else {})}


# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ina-sweep", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sweep for the demo (< 3 minutes)")
    ap.add_argument("--out", type=Path, help="results folder (default results/sweep-<timestamp>); re-run resumes")
    ap.add_argument("--rates", help=f"comma-separated link rates (default {','.join(RATES)})")
    ap.add_argument("--workers", help="comma-separated worker counts (default 2,4,8; quick 2,4)")
    ap.add_argument("--methods", help="comma-separated: gloo, ina:<codec>, " + ", ".join(BASELINES) + ", 'core', "
                                      "'seed', 'baselines', 'all' (default all; quick: core)")
    ap.add_argument("--sizes", help="comma-separated element counts or model names (default the three models)")
    ap.add_argument("--scale", type=float, help="divide model sizes by this (quick default 4)")
    ap.add_argument("--reps", type=int, help="timed repetitions per configuration (default 5; quick 3)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up allreduces per configuration")
    ap.add_argument("--acc-steps", type=int, help="SGD steps of the accuracy workload (default 300; quick 100; 0: skip)")
    ap.add_argument("--acc-rate", default="100mbit", help="link rate of the accuracy runs")
    ap.add_argument("--acc-workers", type=int, help="workers of the accuracy runs (default 4; quick 2)")
    ap.add_argument("--tp-sizes", help="comma-separated sizes (model names or counts) of the training-throughput "
                                       "workload (default resnet110, divided by --scale; 'none': skip)")
    ap.add_argument("--tp-steps", type=int, help="timed SGD steps per throughput configuration (default 10; quick 3)")
    ap.add_argument("--max-ring-time", type=float, default=120.0,
                    help="skip a configuration whose link-bound time exceeds this many seconds per allreduce "
                         "(each one skipped is named on stderr and in the report)")
    ap.add_argument("--mtu", type=int, default=9000)
    ap.add_argument("--slots", type=int, default=64, help="INA window (slots per job)")
    ap.add_argument("--switch-cores", default="auto", help="the switch's --cores: shards (N, or auto: its rule)")
    ap.add_argument("--no-multicast", action="store_true", help="the switch sends each worker a unicast copy of "
                    "every result (default: one IP multicast per result, replicated by the fabric's bridge)")
    ap.add_argument("--timeout", type=float, default=60.0, help="bound of every wait (seconds)")
    from .dilation import add_arguments
    add_arguments(ap)
    from .sweep_loss import add_arguments as add_loss_arguments
    add_loss_arguments(ap)
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def _methods(ap, spec: str) -> list[str]:
    methods: list[str] = []
    for m in spec.split(","):
        methods += {"core": CORE_METHODS, "seed": seed_methods() + host_methods(), "host": host_methods(),
                    "baselines": ["gloo", *BASELINES], "all": all_methods()}.get(m, [m])
    from ina import compression
    for m in methods:
        if m != "gloo" and not is_baseline(m):
            if not m.startswith("ina:") or m[4:] not in compression.available():
                ap.error(f"method {m!r}: expected gloo, {', '.join(BASELINES)} or ina:<codec> with codec one of "
                         f"{compression.available()}")
    return list(dict.fromkeys(methods))


def _settings(ap, args) -> dict:
    """The sweep's axes from the arguments and the --quick defaults (fills in args' defaults too)."""
    from .dilation import feasible_methods, resolve
    resolve(ap, args)
    q = args.quick
    rates = (args.rates or ",".join(RATES)).split(",")
    for r in rates:
        rate_bps(r)     # validates (RateError names the bad spelling)
    workers = [int(x) for x in (args.workers or ("2,4" if q else "2,4,8")).split(",")]
    methods, skipped = feasible_methods(_methods(ap, args.methods or ("core" if q else "all")), args.profile)
    for m, why in skipped.items():
        print(f"ina-sweep: skipping {m}: not feasible under switch profile {args.profile!r} ({why})", file=sys.stderr)
    scale = args.scale or (4.0 if q else 1.0)
    sizes: dict[str, int] = {}
    for s in (args.sizes or ("resnet110" if q else ",".join(MODELS))).split(","):
        if s in MODELS:
            sizes[s] = max(1, int(MODELS[s] / scale))
        else:
            sizes[s] = parse_size(s)
    tp_sizes: dict[str, int] = {}
    if (args.tp_sizes or "resnet110") != "none":
        for s_ in (args.tp_sizes or "resnet110").split(","):
            tp_sizes[s_] = max(1, int(MODELS[s_] / scale)) if s_ in MODELS else parse_size(s_)
    names = {**sizes, **{k: v for k, v in tp_sizes.items() if k in MODELS}}    # model names of the report
    if args.tp_steps is not None and args.tp_steps < 1:
        ap.error(f"--tp-steps {args.tp_steps}: need at least 1 timed step")
    args.tp_steps = args.tp_steps or (3 if q else 10)
    args.reps = args.reps or (3 if q else 5)
    args.acc_steps = args.acc_steps if args.acc_steps is not None else (100 if q else 300)
    acc_workers = args.acc_workers or (2 if q else 4)
    from .sweep_loss import parse_losses
    return {"rates": rates, "workers": workers, "methods": methods, "scale": scale, "sizes": sizes,
            "tp_sizes": tp_sizes, "names": names, "acc_workers": acc_workers, "skipped": skipped,
            "losses": parse_losses(ap, args.loss)}


def _delivery_label(args, st: dict) -> str:
    """How the switch sends INA results to the workers, as the sweep's outputs state it."""
    if args.no_multicast:
        return "unicast copy per worker (--no-multicast)"
    label = "IP multicast to the job's group, replicated by the fabric's bridge"
    if any(st["losses"]) or args.switch_delay_ms:
        label += ("; while the switch's egress impairments are on (loss, emulated delay) each worker's copy is "
                  "impaired on its own: under loss alone a result that lost a copy goes as its surviving unicast "
                  "copies, under delay or duplication every result (each record's switch_counters: multicast_as_copies)")
    return label


def _meta(args, argv, out: Path, st: dict) -> dict:
    prev_meta = json.loads((out / "results.json").read_text())["meta"] if (out / "results.json").exists() else {}
    meta = {"command": "ina-sweep " + " ".join(argv if argv is not None else sys.argv[1:]), "quick": args.quick,
            "scale": st["scale"], "sizes": st["sizes"], "rates": st["rates"], "workers": st["workers"],
            "methods": st["methods"], "reps": args.reps, "warmup": args.warmup, "mtu": args.mtu, "slots": args.slots,
            "acc_steps": args.acc_steps, "acc_rate": args.acc_rate, "acc_workers": st["acc_workers"], "batch": BATCH,
            "started": _dt.datetime.now().isoformat(timespec="seconds"), "tp_sizes": st["tp_sizes"],
            "tp_steps": args.tp_steps, "dilation": args.dilation or 1, "profile": args.profile,
            "switch_cores": args.switch_cores, "results_delivery": _delivery_label(args, st),
            "profile_skipped": st["skipped"], "codec_device": "this CPU" if args.codec_gbps is None else
            f"{args.codec_gbps:g} GB/s", "switch_delay_ms": args.switch_delay_ms, "losses": st["losses"],
            "impairment": "switch user-space packet loss, each direction, for switch-summable INA methods only"}
    if prev_meta.get("runs"):
        meta["runs"] = prev_meta["runs"] + [meta["command"]]
    else:
        meta["runs"] = [meta["command"]]
    return meta


def _plan(args, st: dict, done: set, too_slow: dict | None = None) -> list[tuple]:
    """(workload, workers, rate, elements, method) of every configuration still to run. ``too_slow``
    gets each one left out because its link-bound time exceeds ``--max-ring-time`` (its description: that time)."""
    from .dilation import is_done
    plan = []
    methods = st["methods"]

    def add(wl, n, rate, el, m):
        if is_done(done, args, wl, m, n, rate, el):
            return
        it = ideal_time(m, n, el, rate)
        if it is not None and it > args.max_ring_time:
            if too_slow is not None:
                too_slow[f"{wl} {m} n={n} {rate} {el:,} elements"] = it
            return
        plan.append((wl, n, rate, el, m))

    for n in st["workers"]:
        for rate in st["rates"]:
            for el in st["sizes"].values():
                for m in methods:
                    add("allreduce", n, rate, el, m)
            for el in st["tp_sizes"].values():
                for m in methods:
                    add("throughput", n, rate, el, m)
        if args.acc_steps and n == st["acc_workers"]:
            for m in methods:
                if not any(d.startswith(f"accuracy|{m}|{n}|{args.acc_rate}|") for d in done):
                    plan.append(("accuracy", n, args.acc_rate, 0, m))
    return plan


def switch_args(args) -> list[str]:
    """ina-switch serve's arguments of the sweep: its profile, which sets the registers per slot (else
    SWITCH_ELEMENTS). Its emulated delay is set per dilation factor (dilation.set_switch_delay)."""
    from ina.profiles import get_profile
    a = ["--slots", str(SWITCH_SLOTS), "--profile", args.profile, "--cores", getattr(args, "switch_cores", "auto")]
    if get_profile(args.profile).elements is None:
        a += ["--elements", str(SWITCH_ELEMENTS)]
    if getattr(args, "no_multicast", False):
        a += ["--no-multicast"]
    return a


def _start_switch(topo, out: Path, args):
    """ina-switch in the topology's switch host, ready (its control plane answers)."""
    import functools

    from switch_model.launch import start_switch
    return start_switch(SWITCH_PORT, *switch_args(args), "--stats-interval", "0", "--log-level", "WARNING",
                        popen=functools.partial(topo.popen, topo.switch), control_host=topo.switch.ip,
                        host="0.0.0.0", log_path=out / "switch.log",
                        timeout=30.0)


def _run_plan(plans: dict, args, st: dict, out: Path, records: list, meta: dict, t_start: float) -> None:
    """Every configuration of the plans (one per loss rate, experiments/sweep_loss.py), in one topology,
    one worker group per worker count; the results are saved after each one. Dilated: links shaped at
    target/K (K fixed, or per target rate and size from the auto probe, see experiments/dilation.py),
    times reported in the target's."""
    from tqdm import tqdm

    from ina.net import Topology

    from .dilation import Dilation, probe_factors, set_switch_delay, set_tcp_rto_min, tcp_congestion_control
    from .sweep_loss import set_loss, stamp
    plan = [p for pl in plans.values() for p in pl]
    fixed = args.dilation if isinstance(args.dilation, float) else 1.0
    first = Dilation(fixed).shaped_rate(st["rates"][0]) if args.dilation != "auto" else "1gbit"   # (then probed)
    with Topology(workers=max(p[1] for p in plan), rate=first, mtu=args.mtu) as topo:
        meta["tcp_cc"] = tcp_congestion_control(topo, len(topo.workers), args.tcp_cc)
        sw = _start_switch(topo, out, args)
        meta["switch_shards"] = sw.stats()["config"].get("shards", 1)     # what --switch-cores resolved to
        bar = tqdm(total=len(plan), desc="ina-sweep", unit="cfg", dynamic_ncols=True, file=sys.stderr)
        job = int(time.time()) % 1000 * 10
        cid = 0
        try:
            for n in st["workers"]:
                mine = [p for p in plan if p[1] == n]
                if not mine:
                    continue
                ks = probe_factors(topo, n, mine, args, out, meta, bar) if args.dilation == "auto" else {}
                args.worker_timeout = args.timeout * max(ks.values(), default=fixed)
                meta["tcp_rto_min_s"] = set_tcp_rto_min(topo, Dilation(max(ks.values(), default=fixed)))
                bar.set_postfix_str(f"starting {n} workers")
                group = WorkerGroup(topo, n, out, args)
                cur = None
                try:
                    for loss, (wl, _, rate, el, m) in [(x, p) for x, pl in plans.items() for p in pl if p[1] == n]:
                        set_loss(topo.switch.ip, SWITCH_PORT, loss)
                        dil = Dilation(ks.get((rate, el), fixed))
                        shaped = dil.shaped_rate(rate)
                        if (shaped, dil) != cur:
                            topo.set_rate("workers", shaped)
                            set_switch_delay(topo.switch.ip, SWITCH_PORT, args, dil)
                            cur = (shaped, dil)
                        bar.set_postfix_str(f"{wl} {m} n={n} {rate} {el:,} {dil.label} loss {loss:g}")
                        job += 1
                        cid += 1
                        if wl == "allreduce":
                            rec = run_bench(group, topo, m, n, shaped, el, args, job, cid, dil, rate)
                        elif wl == "throughput":
                            rec = run_throughput(group, topo, m, n, rate, el, args, job, cid)
                        else:
                            rec = run_train(group, m, n, rate, args, job, cid)
                        records.append(stamp(rec, loss))
                        meta["elapsed"] = time.monotonic() - t_start
                        save_results(out, meta, derive(records, st["names"]))
                        bar.update(1)
                finally:
                    group.close()
        finally:
            bar.close()
            sw.stop(timeout=10)


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:       # cleaned up by now: end by the signal taken (143 for SIGTERM, 130 for Ctrl-C)
        CtrlC.exit_by_signal()
        raise


def _main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    CtrlC.install()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    st = _settings(ap, args)
    names = st["names"]
    out = args.out or Path("results") / f"sweep-{_dt.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    records = [r for r in load_results(out) if r["workload"] != "throughput" or "step_times" in r]
    meta = _meta(args, argv, out, st)
    from .sweep_loss import done_at, lossless, plan_at, write_section
    too_slow: dict[str, float] = {}
    plans = {p: plan_at(_plan(args, st, done_at(records, p, key_of), too_slow), p) for p in st["losses"]}
    plan = [c for pl in plans.values() for c in pl]
    if too_slow:
        meta["too_slow"] = {"max_ring_time": args.max_ring_time, "skipped": too_slow}
        print(f"ina-sweep: skipping {len(too_slow)} configuration(s) whose link-bound time exceeds --max-ring-time "
              f"{args.max_ring_time:g} s per allreduce: " + "; ".join(f"{k} ({v:.0f} s)" for k, v in too_slow.items()),
              file=sys.stderr)
    t_start = time.monotonic()
    if plan:
        _run_plan(plans, args, st, out, records, meta, t_start)
    elif too_slow and not records:
        print("ina-sweep: nothing to run: every configuration is over --max-ring-time (raise it to run them)",
              file=sys.stderr)
        return 2
    else:
        print(f"ina-sweep: every configuration is already in {out / 'results.json'}; regenerating the report",
              file=sys.stderr)
    meta["elapsed"] = time.monotonic() - t_start
    final = derive(records, names)
    save_results(out, meta, final)
    from .sweep_report import print_headline, write_report
    write_report(out, meta, lossless(final), plots=not args.no_plots)
    write_section(out, final, plots=not args.no_plots)
    print(f"ina-sweep: {len(plan)} configuration(s) run in {meta['elapsed']:.0f}s; results in {out}/ "
          f"(results.json, results.csv, report.md{', *.png' if not args.no_plots else ''})", file=sys.stderr)
    print_headline(out, meta, lossless(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
