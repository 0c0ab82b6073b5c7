"""Allreduce time under packet loss, duplication and reordering, as a ratio to the lossless time.

    python -m experiments.bench_loss                  # table; 4 workers, loopback, 20 000 and 1.7 M elements
    python -m experiments.bench_loss --json
    python -m experiments.bench_loss --rate 100mbit    # the same on emulated 100 Mbit/s links (root)

Every setting runs the same bfp32 allreduces of the same inputs; the lossless setting runs first in
the same invocation and is the reference of every ratio. Loss, duplication and reordering are the
switch's user-space impairments (this kernel has no netem), applied in both directions (worker ->
switch and switch -> worker) with the given probability each. Every result is compared bit for bit
with the lossless run's: a mismatch fails the benchmark. The client counters say how each loss was
recovered: fast retransmissions (a later chunk's result arrived first), tail probes or timeouts;
``needed_resends`` is what the switch's drop counts make necessary (a lost data packet: one resend
per worker, none can tell whose packet it was; a lost result: one), so resends above it are
spurious. The "impairment path on, no loss" setting runs the impairment stages without dropping
anything: what the emulator's impairment path costs by itself. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import functools
import hashlib
import subprocess
import sys
import time

import numpy as np

from ina.control import request
from switch_model.launch import start_switch

SETTINGS = {                      # name: impairment of each direction
    "lossless": {},
    # the impairment stages on, dropping nothing (a probability of 1e-9 drops none of the ~10^5
    # packets of a setting): what merely running the emulator's impairment path costs
    "impairment path on, no loss": {"loss": 1e-9},
    "loss 0.1%": {"loss": 0.001},
    "loss 1%": {"loss": 0.01},
    "loss 2% + dup 2% + reorder 2%": {"loss": 0.02, "duplicate": 0.02, "reorder": 0.02},
}
TARGETS = {"loss 0.1%": 1.1, "loss 1%": 1.5, "loss 2% + dup 2% + reorder 2%": 2.5}    # at most x lossless
COUNTERS = ("retransmissions", "fast_retransmissions", "probe_retransmissions", "timeout_retransmissions",
            "duplicate_results")


def switch_counts(host: str, port: int) -> dict:
    """The switch's counts of what was lost and what the resends met (cumulative)."""
    st = request(host, port, {"op": "stats"}, timeout=10)["stats"]
    imp = st["impairments"]
    return {"ingress_dropped": imp["ingress"]["dropped"], "egress_dropped": imp["egress"]["dropped"],
            "ingress_duplicated": imp["ingress"]["duplicated"], "egress_duplicated": imp["egress"]["duplicated"],
            "replays": st["counters"]["replays"], "retransmit_pending": st["drops"]["retransmit_pending"]}


def needed_resends(sw: dict, workers: int) -> int:
    """Resends a loss makes necessary: a lost data packet stalls its round for every worker (each
    resends once; the ranks that did not lose it cannot tell), a lost result only the worker it was for."""
    return workers * sw["ingress_dropped"] + sw["egress_dropped"]


def log(msg: str) -> None:
    print(f"[bench_loss] {msg}", file=sys.stderr, flush=True)


def worker_main(spec: dict) -> dict:
    """One rank: ``reps`` bfp32 allreduces of its input after a warm-up; returns its time per
    allreduce, its recovery counters and a digest of every result (to compare with the lossless run)."""
    from ina import Client
    rng = np.random.default_rng([spec["seed"], spec["rank"]])
    x = rng.standard_normal(spec["elements"]).astype(np.float32)
    h = hashlib.sha256()
    with Client((spec["host"], spec["port"]), rank=spec["rank"], world_size=spec["workers"], job=spec["job"],
                timeout=60) as cl:
        y = x.copy()
        cl.allreduce(y, codec="bfp32")                   # warm-up: caches, the first RTT samples
        t0 = time.perf_counter()
        for _ in range(spec["reps"]):
            y[:] = x
            cl.allreduce(y, codec="bfp32")
            h.update(y.tobytes())
        dt = time.perf_counter() - t0
        st = cl.stats.as_dict()
    return {"rank": spec["rank"], "time_per_allreduce_s": dt / spec["reps"], "digest": h.hexdigest(),
            **{k: st.get(k, 0) for k in COUNTERS}}


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

    def popen(self, rank, argv, **kw) -> subprocess.Popen:
        """Start ``argv`` where worker ``rank`` runs (None: the switch)."""
        if self.topo is None:
            return subprocess.Popen(argv, **kw)
        host = self.topo.switch if rank is None else self.topo.workers[rank]
        return self.topo.popen(host, argv, **kw)

    def start_switch(self):
        return start_switch(None if self.topo is None else 9999, "--slots", "512", "--log-level", "WARNING",
                            "--stats-interval", "0", host=self.switch_ip, control_host=self.switch_ip,
                            popen=functools.partial(self.popen, None))

    def close(self) -> None:
        if self.topo is not None:
            self.topo.down()


def run_setting(links: Links, port, n, job, elements, reps, seed, imp: dict, timeout: float):
    cfg = {"loss": 0.0, "duplicate": 0.0, "reorder": 0.0, "seed": seed, **imp}
    request(links.switch_ip, port, {"op": "impair", "ingress": cfg, "egress": {**cfg, "seed": seed + 1}},
            timeout=10)
    base = {"host": links.switch_ip, "port": port, "workers": n, "job": job, "elements": elements, "reps": reps,
            "seed": seed}
    sw0 = switch_counts(links.switch_ip, port)
    ps = [links.popen(r, [sys.executable, "-m", "experiments.bench_loss", "--worker", json.dumps({**base, "rank": r})],
                      stdout=subprocess.PIPE, text=True) for r in range(n)]
    got = []
    for r, p in enumerate(ps):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in ps:
                q.kill()
            raise RuntimeError(f"rank {r} did not finish {reps} allreduces within {timeout:g} s") from None
        if p.returncode != 0:
            raise RuntimeError(f"rank {r} exited with code {p.returncode}")
        got.append(json.loads(out.strip().splitlines()[-1]))
    per = max(g["time_per_allreduce_s"] for g in got)          # the slowest worker's time per allreduce
    counters = {k: sum(g[k] for g in got) for k in COUNTERS}
    sw1 = switch_counts(links.switch_ip, port)                 # (these include the warm-up allreduce)
    counters["switch"] = {k: sw1[k] - sw0[k] for k in sw1}
    counters["needed_resends"] = needed_resends(counters["switch"], n)
    digests = {g["digest"] for g in got}
    if len(digests) != 1:
        raise RuntimeError(f"ranks disagree on the results ({len(digests)} different digests)")
    return per, counters, digests.pop()


def run(n: int, sizes: list[int], reps: dict, seed: int, settings: dict, rate: str | None = None):
    links = Links(rate, n)
    try:
        with links.start_switch() as sw:
            rows = _run_all(links, sw.port, n, sizes, reps, seed, settings)
    finally:
        links.close()
    return rows


def _run_all(links: Links, port: int, n: int, sizes: list[int], reps: dict, seed: int, settings: dict) -> list:
    rows = []
    job = 1
    for elements in sizes:
        ref_time, ref_digest = None, None
        for name, imp in settings.items():
            job += 1
            r = reps[elements]
            per, counters, digest = run_setting(links, port, n, job, elements, r, seed, imp, timeout=900)
            if ref_digest is None:
                ref_time, ref_digest = per, digest
            exact = digest == ref_digest
            row = {"workers": n, "elements": elements, "setting": name, "impairment_each_direction": imp,
                   "allreduces": r, "time_per_allreduce_s": per, "vs_lossless": per / ref_time,
                   "exact": exact, **counters}
            if name in TARGETS:
                row["target_vs_lossless"] = TARGETS[name]
                row["meets_target"] = per / ref_time <= TARGETS[name]
            rows.append(row)
            log(f"{elements} elements, {name}: {per * 1e3:.2f} ms per allreduce ({per / ref_time:.2f}x lossless),"
                f" fast {counters['fast_retransmissions']}, probes {counters['probe_retransmissions']},"
                f" timeouts {counters['timeout_retransmissions']}, needed ~{counters['needed_resends']}"
                f" (+warm-up), switch {counters['switch']},"
                f" exact {exact}")
            if not exact:
                raise RuntimeError(f"{name}: results differ from the lossless run")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20_000, 1_700_000], help="elements per allreduce")
    ap.add_argument("--reps", type=int, nargs="+", default=[200, 10],
                    help="allreduces per setting, one number per size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", default=None, help="emulated link rate per worker, e.g. 100mbit (root); "
                    "default: loopback")
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                    help="settings to run (the first is the reference of the ratios; default: all)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker_main(json.loads(a.worker))), flush=True)
        return 0
    if len(a.reps) != len(a.sizes):
        ap.error(f"--reps needs one count per size ({len(a.sizes)}), got {len(a.reps)}")
    rows = run(a.workers, a.sizes, dict(zip(a.sizes, a.reps)), a.seed, {k: SETTINGS[k] for k in a.settings}, a.rate)
    if a.json:
        print(json.dumps({"benchmark": "allreduce_under_loss", "links": f"emulated {a.rate} per worker (tbf)" if a.rate else "loopback",
                          "impairments": "switch user-space impairments, both directions",
                          "codec": "bfp32", "reference": "the lossless run of the same size in the same invocation",
                          "results": rows}, indent=2))
    else:
        print(f"{'elements':>9} {'setting':<32} {'ms':>8} {'x lossless':>10} {'fast':>6} {'probes':>6} {'timeouts':>8} exact")
        for r in rows:
            print(f"{r['elements']:>9} {r['setting']:<32} {r['time_per_allreduce_s'] * 1e3:>8.2f} "
                  f"{r['vs_lossless']:>10.2f} {r['fast_retransmissions']:>6} {r['probe_retransmissions']:>6} "
                  f"{r['timeout_retransmissions']:>8} "
                  f"{'yes' if r['exact'] else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
