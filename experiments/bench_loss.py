"""Allreduce time under packet loss, duplication and reordering, as a ratio to the lossless time.

    python -m experiments.bench_loss                  # table; 4 workers, loopback, 20 000 and 1.7 M elements
    python -m experiments.bench_loss --json
    python -m experiments.bench_loss --rate 100mbit    # the same on emulated 100 Mbit/s links (root)

Every setting runs the same bfp32 allreduces of the same inputs. The workers are started once and
stay in one job; the settings take turns in ``--rounds`` rounds (each round runs a block of
``--reps`` allreduces per setting, the settings' order rotated from round to round), so that a
change of the machine's load during the run reaches every setting alike. A setting's time is the
median over the rounds of its block's time per allreduce (the slowest worker's mean over the
block); its ratio is the median over the rounds of its block's time over the lossless block's of
the same round (the spread of these ratios is reported too: a wide one means a noisy machine), with an
interval of that median (``vs_lossless_ci``, order statistics: no assumption about the noise; at least 95%
coverage from 6 rounds on, its actual coverage 1 - 2 F(k) in ``vs_lossless_ci_coverage`` and the table)
and the lossless blocks' own round-to-round spread. Each round draws its own drops: round i's impairment
seed is derived from ``--seed`` and i (:func:`round_seed`; fixed, so a run with the same ``--seed`` draws
the same patterns), and every setting and both trees of that round use it. So the interval covers the
spread between loss patterns as well as the machine's noise. A paired tree gets the same seed as this
one round by round, hence the same sequence of draws (one per packet, in the order the switch sees
them), not the same dropped packets: which packet meets which draw depends on what each tree sends, so
the two trees drop the same packets only until their traffic first differs (a resend, a packet more or
less, another order), and their patterns diverge after it. Many short rounds (20 by default, 10 allreduces of 20,000
elements or one of 1.7 M per block) pair every block with a lossless one run moments apart.
``expected_vs_clean`` is the overhead the allreduces that resent a chunk explain, measured inside each
block (their share times their median excess over the block's allreduces without a resend): set
against ``vs_lossless`` it tells a loss's cost from the machine's noise (null in the JSON, nan in the
table, where every allreduce resends, as at 1.7 M elements).
``vs_lossless_best`` is the ratio of the fastest blocks (each setting's least disturbed block over the
lossless setting's): on a loaded machine an estimate of what a quiet one would show, biased low, since
the fastest block is also the luckiest round's loss pattern.

Loss, duplication and reordering are the switch's user-space impairments (this kernel has no
netem), applied in both directions (worker -> switch and switch -> worker) with the given
probability each, seeded (each round its own seed: :func:`round_seed`). Every result is compared bit for bit with the lossless run's: a
mismatch fails the benchmark. The client counters say how each loss was recovered: fast
retransmissions (a later chunk's result arrived first), tail probes (of which ``stall_probes`` probed a
silence with more than 3 chunks out: rule 3's longer wait, ina.recovery.probe_timeout) or timeouts, and how many of them
resent a chunk resent before (``repeat_retransmissions``); ``needed_resends`` is what the switch's drop
counts make necessary (a lost data packet: one resend per worker, none
can tell whose packet it was; a lost result: one), so resends above it are spurious, or answer a
reordered packet (held back 1 ms, five loopback round trips: a resend overtakes it, as TCP's would). ``tail_s`` is
the mean time from a stream's last first-time send to its last result (where a tail loss shows).
The "impairment path on, no loss" setting runs the impairment stages without dropping anything:
what the emulator's impairment path costs by itself. The lossless reference runs with the path off,
so ``vs_lossless`` (the targets' ratio) includes that cost; ``vs_impairment_path`` is the ratio to the
path-on blocks of the same round (what the losses alone add). Both are reported. The switch's counts
include its CPU (the sCPU column, ``switch_cpu_per_allreduce_s``: every process of the switch, shards,
control plane and host aggregator, or its data plane's busy CPU if that is larger, as the sweep's CPU
floor counts it, experiments/sweep_cpu.py; ``switch_cpu_source`` says which), polls (``bursts``) and
stage times per setting, and ``tail_repeats`` (results
multicast twice: the last chunk of a stream, see ina.recovery) and ``retransmit_crossed`` (resends that
crossed the result of a round another rank's resend completed: not replayed). Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import select
import subprocess
import sys
import time

import numpy as np

from ina.control import request
from switch_model.launch import start_switch

PATH_ON = "impairment path on, no loss"
SETTINGS = {                      # name: impairment of each direction
    "lossless": {},
    # the impairment stages on, dropping nothing (a probability of 1e-9 drops none of the ~10^5
    # packets of a setting): what merely running the emulator's impairment path costs
    PATH_ON: {"loss": 1e-9},
    "loss 0.1%": {"loss": 0.001},
    "loss 1%": {"loss": 0.01},
    "loss 2% + dup 2% + reorder 2%": {"loss": 0.02, "duplicate": 0.02, "reorder": 0.02},
}
TARGETS = {"loss 0.1%": 1.1, "loss 1%": 1.5, "loss 2% + dup 2% + reorder 2%": 2.5}    # at most x lossless
COUNTERS = ("retransmissions", "fast_retransmissions", "probe_retransmissions", "stall_probes", "timeout_retransmissions",
            "repeat_retransmissions",
            "fast_replayed", "probe_replayed", "timeout_replayed", "timeout_go_back", "duplicate_results", "coalesce_pause_s",
            "tail_copies")


def switch_counts(host: str, port: int) -> dict:
    """The switch's counts of what was lost and what the resends met (cumulative)."""
    # (here, not at the top: a baseline's workers run this file with an older tree's experiments package)
    from experiments.sweep_cpu import switch_process_cpu_ns
    st = request(host, port, {"op": "stats"}, timeout=10)["stats"]
    imp = st["impairments"]
    return {"ingress_dropped": imp["ingress"]["dropped"], "egress_dropped": imp["egress"]["dropped"],
            "ingress_duplicated": imp["ingress"]["duplicated"], "egress_duplicated": imp["egress"]["duplicated"],
            "ingress_reordered": imp["ingress"]["reordered"], "egress_reordered": imp["egress"]["reordered"],
            "replays": st["counters"]["replays"], "retransmit_pending": st["drops"]["retransmit_pending"],
            # resends of a round another rank's resend completed that crossed its multicast (not replayed)
            "retransmit_crossed": st["drops"].get("retransmit_crossed", 0),
            # the data plane's busy CPU time (less disturbed by a loaded machine than wall time), and every process's
            # of the switch (shards, control plane, host aggregator; 0: not reported): the CPU column takes the
            # larger, as the sweep's CPU floor does (experiments/sweep_cpu.py)
            "cpu_ns": st["timing"]["busy_cpu_ns"], "process_cpu_ns": switch_process_cpu_ns(st) or 0,
            "tx_cpu_ns": st["timing"]["tx_cpu_ns"], "bursts": st["timing"]["bursts"],
            "tail_repeats": st["counters"].get("tail_repeats", 0),
            # what the send stage handed the kernel: packets, sendmmsg messages (a GSO run counts once),
            # and group sends sent as per-worker copies (a lost copy breaks the group send)
            **{k: st["counters"].get(k, 0) for k in ("rx_packets", "tx_packets", "tx_messages", "multicast_as_copies")},
            **{f"{k}_ns": v for k, v in st["timing"]["stage_ns"].items()}}


def needed_resends(sw: dict, workers: int) -> int:
    """Resends a loss makes necessary: a lost data packet stalls its round for every worker (each
    resends once; the ranks that did not lose it cannot tell), a lost result only the worker it was for."""
    return workers * sw["ingress_dropped"] + sw["egress_dropped"]


def log(msg: str) -> None:
    print(f"[bench_loss] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# a worker: one Client for the whole run, one block of allreduces per line on stdin
# ------------------------------------------------------------------------------------------------
def worker_block(cl, x: np.ndarray, reps: int) -> dict:
    """``reps`` bfp32 allreduces of ``x``: time per allreduce, recovery counters, digest of every result."""
    h = hashlib.sha256()
    y = x.copy()
    st0 = cl.stats.as_dict()
    tails, turns, times, resent = [], 0, [], []
    idle, encode, decode = 0, 0.0, 0.0
    cpu0 = time.process_time()
    for _ in range(reps):
        y[:] = x
        r0 = cl.stats.retransmissions
        t0 = time.perf_counter()
        cl.allreduce(y, codec="bfp32")
        times.append(time.perf_counter() - t0)      # the allreduce's time (not the copies and the digest's)
        resent.append(cl.stats.retransmissions - r0)
        tl = cl.last_timeline or {}
        if "last_result" in tl and "last_send" in tl:
            tails.append(tl["last_result"] - tl["last_send"])
        turns += tl.get("rx_bursts", 0)
        idle += tl.get("idle_turns", 0)
        encode += tl.get("encode_s", 0.0)
        decode += tl.get("decode_s", 0.0)
        h.update(y.tobytes())
    st = cl.stats.as_dict()
    return {"time_per_allreduce_s": sum(times) / reps, "times_s": times, "resent": resent,
            "digest": h.hexdigest(), "tail_s": float(np.mean(tails or [0.0])),
            "cpu_per_allreduce_s": (time.process_time() - cpu0) / reps, "turns_per_allreduce": turns / reps,
            "idle_turns_per_allreduce": idle / reps, "encode_per_allreduce_s": encode / reps,
            "decode_per_allreduce_s": decode / reps,
            **{k: st.get(k, 0) - st0.get(k, 0) for k in COUNTERS}}


def worker_main(spec: dict) -> None:
    """One rank: joins the job, then runs a block per command line ({"elements", "reps"}) until EOF."""
    from ina import Client
    inputs = {}
    with Client((spec["host"], spec["port"]), rank=spec["rank"], world_size=spec["workers"], job=spec["job"],
                timeout=60, timeline=True) as cl:
        for line in sys.stdin:
            cmd = json.loads(line)
            e = cmd["elements"]
            if e not in inputs:
                rng = np.random.default_rng([spec["seed"], spec["rank"], e])
                inputs[e] = rng.standard_normal(e).astype(np.float32)
            print(json.dumps({"rank": spec["rank"], **worker_block(cl, inputs[e], cmd["reps"])}), flush=True)


class Links:
    """Where the switch and the workers run: loopback, or emulated hosts of an ina.net Topology."""

    def __init__(self, rate: str | None, workers: int):
        self.rate, self.topo = rate, None
        if rate:
            from ina.net import Topology
            self.topo = Topology(workers=workers, rate=rate).up()
            self.switch_ip = self.topo.switch.ip
        else:
            self.switch_ip = "127.0.0.1"

    def popen(self, rank, argv, tree: str | None = None, env: dict | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` where worker ``rank`` runs (None: the switch), with the code of ``tree`` if given
        and the variables ``env`` set."""
        host = None if self.topo is None else self.topo.switch if rank is None else self.topo.workers[rank]
        if tree or env:
            kw["env"] = {**os.environ, **(host.env() if host else {}), **({"PYTHONPATH": tree} if tree else {}),
                         **(env or {})}
        if tree:
            kw["cwd"] = tree
        if self.topo is None:
            return subprocess.Popen(argv, **kw)
        return self.topo.popen(host, argv, **kw)

    def start_switch(self, port: int | None, tree: str | None = None):
        return start_switch(port if self.topo else None, "--slots", "512", "--log-level", "WARNING",
                            "--stats-interval", "0", host=self.switch_ip, control_host=self.switch_ip,
                            popen=functools.partial(self.popen, None, tree=tree))

    def close(self) -> None:
        if self.topo is not None:
            self.topo.down()


class Ranks:
    """The worker processes of one job, driven a block at a time (with the code of ``tree`` if given:
    this file runs as a script there, importing that tree's ina)."""

    def __init__(self, links: Links, port: int, n: int, job: int, seed: int, tree: str | None = None,
                 env: dict | None = None):
        spec = {"host": links.switch_ip, "port": port, "workers": n, "job": job, "seed": seed}
        me = [os.path.abspath(__file__)] if tree else ["-m", "experiments.bench_loss"]
        self.ps = [links.popen(r, [sys.executable, *me, "--worker", json.dumps({**spec, "rank": r})], tree=tree,
                               env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(n)]

    def block(self, elements: int, reps: int, timeout: float) -> list[dict]:
        """Every rank runs ``reps`` allreduces of ``elements``; their reports, within ``timeout`` s."""
        for p in self.ps:
            p.stdin.write(json.dumps({"elements": elements, "reps": reps}) + "\n")
            p.stdin.flush()
        deadline = time.monotonic() + timeout
        got = []
        for r, p in enumerate(self.ps):
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = p.stdout.readline() if ready else ""
            if not line:
                why = f"exited with code {p.poll()}" if p.poll() is not None else f"did not finish within {timeout:g} s"
                raise RuntimeError(f"rank {r} {why} ({reps} allreduces of {elements} elements)")
            got.append(json.loads(line))
        return got

    def close(self) -> None:
        for p in self.ps:
            if p.stdin:
                p.stdin.close()
        for p in self.ps:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


# ------------------------------------------------------------------------------------------------
# the coordinator
# ------------------------------------------------------------------------------------------------
class Side:
    """A switch and its ranks running the code of one tree ("this": the importing one)."""

    def __init__(self, links: Links, label: str, tree: str | None, port: int, n: int, seed: int,
                 env: dict | None = None):
        self.links, self.label, self.tree = links, label, tree
        self.sw = links.start_switch(port, tree)
        try:
            self.ranks = Ranks(links, self.sw.port, n, job=2, seed=seed, tree=tree, env=env)
        except BaseException:
            self.sw.stop()
            raise

    def close(self) -> None:
        try:
            self.ranks.close()
        finally:
            self.sw.stop()

    def block(self, elements: int, reps: int, seed: int, imp: dict) -> dict:
        """One block of one setting: the impairments set, the ranks' block, the switch's counts."""
        ip, port = self.links.switch_ip, self.sw.port
        cfg = {"loss": 0.0, "duplicate": 0.0, "reorder": 0.0, "seed": seed, **imp}
        request(ip, port, {"op": "impair", "ingress": cfg, "egress": {**cfg, "seed": seed + 1}}, timeout=10)
        sw0 = switch_counts(ip, port)
        got = self.ranks.block(elements, reps, timeout=60 + 30 * reps)
        sw1 = switch_counts(ip, port)
        digests = {g["digest"] for g in got}
        if len(digests) != 1:
            raise RuntimeError(f"{self.label}: ranks disagree on the results ({len(digests)} different digests)")
        return {"time": max(g["time_per_allreduce_s"] for g in got),        # the slowest worker's
                # per allreduce: the slowest rank's time, and whether any rank resent a chunk in it
                "times": np.max([g["times_s"] for g in got], axis=0).tolist(),
                "resent": np.any([g["resent"] for g in got], axis=0).tolist(),
                "tail": float(np.mean([g["tail_s"] for g in got])), "digest": digests.pop(),
                "worker_cpu": float(np.mean([g["cpu_per_allreduce_s"] for g in got])),
                "turns": float(np.mean([g["turns_per_allreduce"] for g in got])),
                **{k: float(np.mean([g[f"{k}_per_allreduce{u}"] for g in got]))
                   for k, u in (("idle_turns", ""), ("encode", "_s"), ("decode", "_s"))},
                "counters": {k: sum(g[k] for g in got) for k in COUNTERS},
                "switch": {k: sw1[k] - sw0[k] for k in sw1}}


def round_seed(seed: int, i: int) -> int:
    """Round ``i``'s impairment seed, derived from the run's ``seed`` (numpy's SeedSequence: rounds and base
    seeds draw unrelated streams; a 32-bit value). Any integer >= 0 would do: the seed travels as a JSON
    integer and seeds ``np.random.default_rng``, as do the egress's (seed + 1) and the shards' offsets.
    Every setting and tree of the round uses it; round to round the loss pattern changes."""
    return int(np.random.SeedSequence([seed, i]).generate_state(1)[0])


def median_interval(x, confidence: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of the sample ``x`` (order statistics,
    the sign test's binomial): (low, high, its actual coverage, at least ``confidence`` when the sample
    allows; with fewer than 6 values the whole range, whose coverage is below 0.95)."""
    from math import comb
    v = np.sort(np.asarray(x, float))
    n = v.size
    cdf = np.cumsum([comb(n, i) for i in range(n + 1)]) / 2.0 ** n      # P(Binomial(n, 1/2) <= i)
    # [v[k], v[n-1-k]] misses the median when at most k values lie below it, or above: probability 2 * cdf[k]
    k = 0
    while k + 1 <= n - 2 - k and 1 - 2 * cdf[k + 1] >= confidence:
        k += 1
    return float(v[k]), float(v[n - 1 - k]), float(1 - 2 * cdf[k])


def finite_or_null(obj):
    """``obj`` (dicts, lists, numbers) with every NaN or infinity as None: JSON has no NaN (``json.dumps``
    would write a bare NaN, which JSON readers reject), so an undefined value is written as null."""
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def _vs_baseline(r: dict) -> str:
    """The table's this/baseline column: the median per-round ratio, its interval and coverage."""
    if "this_vs_baseline" not in r:
        return ""
    lo, hi = r["this_vs_baseline_ci"]
    return f"{r['this_vs_baseline']:.3f} ({lo:.3f}-{hi:.3f}, {r['this_vs_baseline_ci_coverage']:.0%})"


def resend_cost(blocks: list[dict]) -> dict:
    """What the allreduces that resent a chunk cost, measured inside each block (the same round's
    machine): the share of allreduces in which some rank resent, and the median over the blocks of
    their median time minus the median time of the block's allreduces without a resend. Their product
    over the clean allreduces' median time is the overhead the resends explain (``expected_vs_clean``):
    compared with ``vs_lossless`` it tells a loss's cost from the machine's noise. NaN where no block
    has both kinds (at 1.7 M elements and 0.1% loss every allreduce resends)."""
    extra, clean, n_resent, n = [], [], 0, 0
    for b in blocks:
        t, r = np.asarray(b["times"]), np.asarray(b["resent"], bool)
        n_resent, n = n_resent + int(r.sum()), n + r.size
        if (~r).any():
            clean.append(float(np.median(t[~r])))
            if r.any():
                extra.append(float(np.median(t[r])) - clean[-1])
    share = n_resent / max(n, 1)
    med_extra = float(np.median(extra)) if extra else float("nan")
    med_clean = float(np.median(clean)) if clean else float("nan")
    return {"share_with_resend": share, "extra_s_with_resend": med_extra,
            "expected_vs_clean": 1 + share * med_extra / med_clean if extra else float("nan")}


def summarise(n: int, elements: int, name: str, imp: dict, blocks: list[dict], ref: list[dict], reps: int,
              path_ref: list[dict] | None = None) -> dict:
    """A setting's row: medians over the rounds, summed counters. ``path_ref``: the blocks of the
    impairment path on without loss, the second reference (``vs_impairment_path``)."""
    times = np.array([b["time"] for b in blocks])
    ratios = times / np.array([b["time"] for b in ref])
    counters = {k: sum(b["counters"][k] for b in blocks) for k in COUNTERS}
    from experiments.sweep_cpu import switch_cpu_of
    switch = {k: sum(b["switch"][k] for b in blocks) for k in blocks[0]["switch"]}
    switch_cpu, switch_cpu_source = switch_cpu_of(switch["cpu_ns"], switch["process_cpu_ns"], reps * len(blocks))
    row = {"workers": n, "elements": elements, "setting": name, "impairment_each_direction": imp,
           "rounds": len(blocks), "allreduces": reps * len(blocks),
           "time_per_allreduce_s": float(np.median(times)), "mean_time_per_allreduce_s": float(times.mean()),
           "vs_lossless": float(np.median(ratios)), "vs_lossless_per_round": [round(float(r), 3) for r in ratios],
           # where the median per-round ratio lies (distribution-free, ``median_interval``)
           "vs_lossless_ci": list(median_interval(ratios)[:2]), "vs_lossless_ci_coverage": median_interval(ratios)[2],
           # the lossless blocks' own spread: each round's lossless block over the median one
           "lossless_spread_per_round": [round(float(b["time"]) / float(np.median([c["time"] for c in ref])), 3)
                                         for b in ref],
           # per round: (fast, probe, timeout) retransmissions, what the switch dropped (in, out)
           "resends_per_round": [[b["counters"][k] for k in ("fast_retransmissions", "probe_retransmissions",
                                                              "timeout_retransmissions")] for b in blocks],
           "dropped_per_round": [[b["switch"]["ingress_dropped"], b["switch"]["egress_dropped"]] for b in blocks],
           **resend_cost(blocks),
           # the least disturbed block of each (also the luckiest round's drops: each round draws its own)
           "best_time_per_allreduce_s": float(times.min()),
           "vs_lossless_best": float(times.min() / min(b["time"] for b in ref)),
           "tail_s": float(np.median([b["tail"] for b in blocks])),
           # its processes' CPU, or its data plane's busy CPU if that is larger (the sweep's rule: sweep_cpu)
           "switch_cpu_per_allreduce_s": switch_cpu, "switch_cpu_source": switch_cpu_source,
           # the median block's, per allreduce: a first block's one-off costs (a kernel's compile) left out
           "switch_median_per_allreduce": {k: float(np.median([b["switch"][k] for b in blocks])) / reps
                                           for k in blocks[0]["switch"]},
           "worker_cpu_per_allreduce_s": float(np.median([b["worker_cpu"] for b in blocks])),
           # a rank's loop turns that took results (the data stream's), per allreduce: a loss's CPU follows them
           "turns_per_allreduce": float(np.median([b["turns"] for b in blocks])),
           # turns whose receive took nothing, and the worker's encoding and decoding time (a rank's mean)
           "idle_turns_per_allreduce": float(np.median([b["idle_turns"] for b in blocks])),
           "worker_encode_per_allreduce_s": float(np.median([b["encode"] for b in blocks])),
           "worker_decode_per_allreduce_s": float(np.median([b["decode"] for b in blocks])),
           "exact": all(b["digest"] == ref[0]["digest"] for b in blocks),
           **counters, "switch": switch, "needed_resends": needed_resends(switch, n)}
    if path_ref:      # against the impairment path's own cost: what the losses alone add
        row["vs_impairment_path"] = float(np.median(times / np.array([b["time"] for b in path_ref])))
    if name in TARGETS:
        row["target_vs_lossless"] = TARGETS[name]
        row["meets_target"] = row["vs_lossless"] <= TARGETS[name]
    return row


def run(n: int, sizes: list[int], reps: dict, rounds: int, seed: int, settings: dict, rate: str | None = None,
        baseline: str | None = None, baseline_env: dict | None = None) -> list:
    links = Links(rate, n)
    sides = []
    try:
        sides.append(Side(links, "this", None, 9999, n, seed))
        if baseline or baseline_env:
            sides.append(Side(links, "baseline", os.path.abspath(baseline) if baseline else None, 9998, n, seed,
                              env=baseline_env))
        return _run_all(sides, n, sizes, reps, rounds, seed, settings)
    finally:
        for side in sides:
            side.close()
        links.close()


def _run_all(sides: list, n, sizes, reps, rounds, seed, settings) -> list:
    rows = []
    names = list(settings)
    for elements in sizes:
        r = reps[elements]
        for side in sides:
            side.block(elements, max(1, r // 4), seed, {})     # warm-up: caches, the first round trips
        blocks = {(side.label, name): [] for side in sides for name in names}
        for i in range(rounds):
            order = names[i % len(names):] + names[:i % len(names)]          # rotated: no setting always first
            for name in order:
                for side in (sides if i % 2 == 0 else sides[::-1]):
                    blocks[side.label, name].append(side.block(elements, r, round_seed(seed, i), settings[name]))
            log(f"{elements} elements, round {i + 1}/{rounds}: " + ", ".join(
                f"{label} {name} {b[-1]['time'] * 1e3:.2f} ms" for (label, name), b in blocks.items()))
        for side in sides:
            for name in names:
                row = summarise(n, elements, name, settings[name], blocks[side.label, name],
                                blocks[side.label, names[0]], r, blocks.get((side.label, PATH_ON)))
                row["code"] = side.label
                if side is not sides[0]:      # this tree's time (and worker CPU) over the baseline's, round by round
                    for key, what in (("this_vs_baseline", "time"), ("this_vs_baseline_worker_cpu", "worker_cpu")):
                        per_round = (np.array([b[what] for b in blocks[sides[0].label, name]])
                                     / np.array([b[what] for b in blocks[side.label, name]]))
                        row[key] = float(np.median(per_round))
                        lo, hi, coverage = median_interval(per_round)
                        row[key + "_ci"], row[key + "_ci_coverage"] = [lo, hi], coverage
                        row[key + "_per_round"] = [round(float(r), 3) for r in per_round]
                rows.append(row)
                log(f"{side.label}: {elements} elements, {name}: {row['time_per_allreduce_s'] * 1e3:.2f} ms per "
                    f"allreduce ({row['vs_lossless']:.2f}x lossless, per round {row['vs_lossless_per_round']}), "
                    f"{row.get('vs_impairment_path', 1.0):.2f}x the impairment path alone, "
                    f"fast {row['fast_retransmissions']}, probes {row['probe_retransmissions']} (stall {row['stall_probes']}), "
                    f"timeouts {row['timeout_retransmissions']}, needed ~{row['needed_resends']}, "
                    f"tail {row['tail_s'] * 1e3:.2f} ms, turns {row['turns_per_allreduce']:.1f}, worker CPU "
                    f"{row['worker_cpu_per_allreduce_s'] * 1e3:.2f} ms, switch CPU "
                    f"{row['switch_cpu_per_allreduce_s'] * 1e3:.2f} ms, switch {row['switch']}, exact {row['exact']}")
                if not row["exact"]:
                    raise RuntimeError(f"{side.label}, {name}: results differ from the lossless run")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20_000, 1_700_000], help="elements per allreduce")
    ap.add_argument("--reps", type=int, nargs="+", default=[10, 1],
                    help="allreduces per setting and round, one number per size")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of interleaved blocks (the medians' sample: "
                    "many short rounds pair each block with a lossless one run moments apart)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", default=None, help="emulated link rate per worker, e.g. 100mbit (root); "
                    "default: loopback")
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                    help="settings to run (the first is the reference of the ratios; default: all)")
    ap.add_argument("--baseline", metavar="DIR", help="also run every block with the code of DIR (a checkout "
                    "of another commit), interleaved with this tree's: a paired before/after comparison")
    ap.add_argument("--baseline-env", nargs="+", metavar="NAME=VALUE", default=[],
                    help="environment of the baseline's workers (e.g. INA_TIMER_FLOOR=0; without --baseline: this "
                    "tree's code with these variables, a paired comparison of a switch such as INA_TIMER_FLOOR)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(json.loads(a.worker))
        return 0
    if len(a.reps) != len(a.sizes):
        ap.error(f"--reps needs one count per size ({len(a.sizes)}), got {len(a.reps)}")
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {a.rounds}")
    bad = [v for v in a.baseline_env if "=" not in v]
    if bad:
        ap.error(f"--baseline-env takes NAME=VALUE, got {bad}")
    rows = run(a.workers, a.sizes, dict(zip(a.sizes, a.reps)), a.rounds, a.seed,
               {k: SETTINGS[k] for k in a.settings}, a.rate, a.baseline, dict(v.split("=", 1) for v in a.baseline_env))
    if a.json:
        print(json.dumps(finite_or_null({"benchmark": "allreduce_under_loss", "baseline": a.baseline, "baseline_env": a.baseline_env,
                          "links": f"emulated {a.rate} per worker (tbf)" if a.rate else "loopback",
                          "impairments": "switch user-space impairments, both directions",
                          "codec": "bfp32", "rounds": a.rounds, "seed": a.seed,
                          "round_seeds": [round_seed(a.seed, i) for i in range(a.rounds)],
                          "seeding": "each round its own impairment seed, derived from seed and the round "
                                     "(round_seed; the egress draws from it + 1), the same for every setting and "
                                     "tree of the round: the interval covers the loss patterns' spread too",
                          "reference": "the lossless blocks of the same size and round in the same invocation "
                                       "(median of the per-round ratios)",
                          "results": rows}), indent=2, allow_nan=False))
    else:
        print(f"each round draws its own drops (seeds derived from --seed {a.seed}, the same for every setting "
              f"and tree of a round): the intervals cover the loss patterns' spread too")
        print(f"{'code':<8} {'elements':>9} {'setting':<32} {'ms':>8} {'x lossless':>10} {'CI (coverage)':>17} {'spread':>11} "
              f"{'expect':>6} {'best':>5} {'fast':>6} "
              f"{'probes':>6} {'stall':>5} {'timeouts':>8} {'needed':>6} {'tail ms':>7} {'x path':>6} {'turns':>6} {'wCPU ms':>7} "
              f"{'sCPU ms':>7} exact  this/baseline")
        for r in rows:
            lo, hi = min(r["vs_lossless_per_round"]), max(r["vs_lossless_per_round"])
            print(f"{r['code']:<8} {r['elements']:>9} {r['setting']:<32} {r['time_per_allreduce_s'] * 1e3:>8.2f} "
                  f"{r['vs_lossless']:>10.2f} {r['vs_lossless_ci'][0]:>5.2f}-{r['vs_lossless_ci'][1]:<5.2f} "
                  f"({r['vs_lossless_ci_coverage']:>4.0%}) "
                  f"{lo:>5.2f}-{hi:<5.2f} {r['expected_vs_clean']:>6.2f} {r['vs_lossless_best']:>5.2f} {r['fast_retransmissions']:>6} "
                  f"{r['probe_retransmissions']:>6} {r.get('stall_probes', '-'):>5} {r['timeout_retransmissions']:>8} {r['needed_resends']:>6} "
                  f"{r['tail_s'] * 1e3:>7.2f} {r.get('vs_impairment_path', float('nan')):>6.2f} "
                  f"{r['turns_per_allreduce']:>6.1f} {r['worker_cpu_per_allreduce_s'] * 1e3:>7.2f} "
                  f"{r['switch_cpu_per_allreduce_s'] * 1e3:>7.2f} "
                  f"{'yes' if r['exact'] else 'NO':<5}  {_vs_baseline(r)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
