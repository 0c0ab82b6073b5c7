"""``--cores N``: the slot pool sharded over N switch processes, one UDP port each.

As RSS spreads flows over a NIC's queues, a job's pool index p is served by shard p % N on UDP
port ``port + p % N``; each shard is a full :class:`~switch_model.pipeline.Switch` (its own
registers, job table and poll loop) in its own process. The control plane runs in shard 0's
process and drives every shard through :class:`ShardGroup`, which has the same data-plane methods
(``dp``) as a single switch, so the control plane does not know how many shards there are.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import threading
from dataclasses import fields, replace

from .clock import add_timing
from .impair import ImpairmentConfig
from .pipeline import Switch, SwitchConfig

log = logging.getLogger("ina.switch.shards")

MAX_AUTO_SHARDS = 4
CPUS_PER_SHARD = 4     # auto: one shard per this many CPUs the process may run on (docs/performance.md)


def available_cpus() -> int:
    """CPUs this process may be scheduled on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_shards(cpus: int) -> int:
    """``--cores auto``: how many shards on ``cpus`` CPUs.

    A shard is a poll loop that wants a CPU of its own, and the workers of the jobs it serves
    usually run on the same machine (the emulator's case): a second shard pays only when there
    are CPUs to spare beyond the workers and the first shard. Measured on 2 CPUs (4 and 8 workers,
    loopback and 1 Gbit/s links, docs/performance.md): a second shard adds switch CPU per
    allreduce and makes no allreduce faster, so below ``2 * CPUS_PER_SHARD`` CPUs auto is 1; above,
    one shard per ``CPUS_PER_SHARD`` CPUs, at most ``MAX_AUTO_SHARDS`` (not measured here: no
    such machine).
    """
    if cpus < 1:
        raise ValueError(f"a machine has at least one CPU, got {cpus}")
    return max(1, min(MAX_AUTO_SHARDS, cpus // CPUS_PER_SHARD))


def parse_cores(value: str, cpus: int | None = None) -> int:
    """``--cores`` as given: a shard count >= 1, or ``auto`` (:func:`auto_shards` of this machine)."""
    if str(value).strip().lower() == "auto":
        return auto_shards(available_cpus() if cpus is None else cpus)
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"--cores takes a shard count or 'auto', got {value!r}") from None
    if n < 1:
        raise ValueError(f"--cores must be >= 1 (or 'auto'), got {n}")
    return n


def _shard_main(cfg: SwitchConfig, shard: int, conn, log_level: str) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s ina.switch[shard {shard}] %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        sw = Switch(cfg)
    except (ValueError, OSError) as e:
        conn.send(("err", str(e)))
        return
    sw.start_thread()
    conn.send(("ok", sw.port))
    while True:
        try:
            msg = conn.recv()
        except EOFError:           # the parent is gone
            break
        if msg is None:
            break
        name, args, kwargs = msg
        try:
            conn.send(("ok", sw.dp(name, *args, **kwargs)))
        except Exception as e:  # noqa: BLE001 - reported to the control plane, which names it
            conn.send(("err", f"shard {shard}: {e}"))
    sw.stop()


SHARD_SEED_STEP = 1_000_003     # between the shards' impairment seeds (the ingress and egress seeds differ by 1)


def shard_seed(seed: int, k: int) -> int:
    """Shard k's impairment seed, drawn from ``seed`` (the one rule: at start-up and at run time)."""
    return seed + SHARD_SEED_STEP * k


def shard_config(cfg: SwitchConfig, port: int, k: int) -> SwitchConfig:
    """Shard k's configuration: port ``port + k``, and impairments drawn from seeds of its own (the same
    seed in every shard would drop, copy and hold each shard's n-th packet alike). The re-encoding seed
    stays the same in every shard: its draws are keyed by (seed, job, chunk id, element), a round's
    chunk id is served by one shard, and so the shards round as one switch would, bit for bit."""
    return replace(cfg, port=port + k, ingress=replace(cfg.ingress, seed=shard_seed(cfg.ingress.seed, k)),
                   egress=replace(cfg.egress, seed=shard_seed(cfg.egress.seed, k)))


def merged_impairments(per_shard: list) -> dict:
    """The shards' impairments (each shard's ``{"ingress": ..., "egress": ...}``, settings and maybe
    counters, shard 0 first) as one switch's, as the start-up line gives them: each direction's settings
    with shard 0's seed, every shard's seed (``shard_seeds``: seed + SHARD_SEED_STEP x shard, at start-up
    and after a run-time seed alike) and the counters summed. A setting the shards do not share (the
    control plane changes them all alike: a shard that failed to) is given shard by shard (``per_shard``)."""
    settings = [f.name for f in fields(ImpairmentConfig)]
    out = {}
    for d in ("ingress", "egress"):
        each = [s[d] for s in per_shard]
        merged = {**each[0], **{k: sum(e[k] for e in each) for k in each[0] if k not in settings},
                  "shard_seeds": [e["seed"] for e in each]}
        if any(e[k] != each[0][k] for e in each for k in settings if k != "seed"):
            merged["per_shard"] = [{k: e[k] for k in settings} for e in each]
        out[d] = merged
    return out


def _shard_seeded(changes, k: int):
    """Impairment changes as shard k applies them: a seed they set is offset as ``shard_config`` does."""
    if isinstance(changes, dict) and isinstance(changes.get("seed"), int):
        return {**changes, "seed": shard_seed(changes["seed"], k)}
    return changes


class ShardGroup:
    """Shard 0 (in this process) plus N-1 shard processes, behind the single-switch interface."""

    def __init__(self, cfg: SwitchConfig, cores: int, log_level: str = "INFO", timeout: float = 120.0):
        if cores < 1:
            raise ValueError(f"--cores must be >= 1, got {cores}")
        self.local = Switch(cfg)
        self.cfg = cfg
        self.port = self.local.port
        self.n = cores
        self.timeout = timeout
        self._conns = []
        self._procs = []
        self._lock = threading.RLock()
        ctx = mp.get_context("spawn")
        for k in range(1, cores):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_shard_main, args=(shard_config(cfg, self.port, k), k, child, log_level),
                            name=f"ina-switch-shard{k}", daemon=True)
            p.start()
            self._conns.append(parent)
            self._procs.append(p)
        for k, c in enumerate(self._conns, 1):
            if not c.poll(timeout):
                self.close()
                raise RuntimeError(f"switch shard {k} did not start within {timeout:g} s")
            status, val = c.recv()
            if status != "ok":
                self.close()
                raise ValueError(f"switch shard {k} on port {self.port + k}: {val}")
        log.info("%d shards on udp ports %s", cores, self.ports)

    @property
    def ports(self) -> list:
        return [self.port + k for k in range(self.n)]

    @property
    def job_info(self):
        return self.local.job_info

    def _remote(self, name, *args, **kwargs) -> list:
        for c in self._conns:
            c.send((name, args, kwargs))
        return self._answers(name)

    def _answers(self, name) -> list:
        out = []
        for k, c in enumerate(self._conns, 1):
            if not c.poll(self.timeout):
                raise TimeoutError(f"switch shard {k} did not answer {name!r} within {self.timeout:g} s")
            status, val = c.recv()
            if status != "ok":
                raise ValueError(val)
            out.append(val)
        return out

    def dp(self, name: str, *args, **kwargs):
        with self._lock:                 # one exchange on the pipes at a time (control threads are many)
            return self._dp(name, *args, **kwargs)

    def _dp(self, name: str, *args, **kwargs):
        if name == "install_job":
            info = self.local.dp(name, *args, shards=self.n, shard=0, **kwargs)
            try:
                for k, c in enumerate(self._conns, 1):
                    c.send((name, args, {**kwargs, "shards": self.n, "shard": k, "created": info.created}))
                for k, c in enumerate(self._conns, 1):
                    if not c.poll(self.timeout):
                        raise TimeoutError(f"switch shard {k} did not install job {args[0]} in {self.timeout:g} s")
                    status, val = c.recv()
                    if status != "ok":
                        raise ValueError(val)
            except (ValueError, TimeoutError):
                self.local.dp("remove_job", args[0], "a shard refused it")
                self._remote("remove_job", args[0], "a shard refused it")
                raise
            return info
        if name == "set_impairments":       # a seed set at run time is offset per shard, as at start-up
            out = self.local.dp(name, *args, **kwargs)     # checks the request: the shards would refuse it alike
            for k, c in enumerate(self._conns, 1):
                c.send((name, tuple(_shard_seeded(d, k) for d in args),
                        {key: _shard_seeded(d, k) for key, d in kwargs.items()}))
            return merged_impairments([out] + self._answers(name))
        if name == "remove_job":            # only shard 0 sends the ABORT packets
            remote_kw = {k: v for k, v in kwargs.items() if k != "notify_rank"}
            ok = self.local.dp(name, *args, **kwargs)
            self._remote(name, *args, **remote_kw)
            return ok
        if name == "job_status":
            st = self.local.dp(name, *args, **kwargs)
            for other in self._remote(name, *args, **kwargs):
                if st.get("active") and other.get("active"):
                    st["incomplete_slots"] += other["incomplete_slots"]
                    st["waiting"] += other["waiting"]
            return st
        if name == "stats":
            st = self.local.dp("stats")
            others = self._remote("stats")
            st["per_shard"] = [{"port": p, "harvested": s_["counters"]["harvested"],
                                "rx_packets": s_["counters"]["rx_packets"], "busy_ns": s_["timing"]["busy_ns"],
                                "wait_ns": s_["timing"]["wait_ns"], "process_cpu_ns": s_["timing"]["process_cpu_ns"],
                                "impairments": s_["impairments"]}
                               for p, s_ in zip(self.ports, [dict(st, counters=dict(st["counters"]))] + others)]
            st["impairments"] = merged_impairments([st["impairments"]] + [o["impairments"] for o in others])
            for other in others:
                for group in ("counters", "drops", "rates"):
                    for key, v in other[group].items():
                        st[group][key] = st[group].get(key, 0) + v
                st["occupancy"]["sets_aggregating"] += other["occupancy"]["sets_aggregating"]
                st["multicast_fallbacks"] += other["multicast_fallbacks"]
                add_timing(st["timing"], other["timing"])
            st["config"]["shards"] = self.n
            st["config"]["ports"] = self.ports
            return st
        out = self.local.dp(name, *args, **kwargs)
        self._remote(name, *args, **kwargs)
        return out

    # the service loop runs shard 0 in the calling thread
    def serve_forever(self) -> None:
        self.local.serve_forever()

    def stop(self) -> None:
        self.local.stop()

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
