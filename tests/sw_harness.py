"""Test harness for the switch and the allreduce client: real processes, real UDP on loopback.

* :class:`SwitchProc` starts ``python -m switch_model serve`` on a free port through the project's
  launcher (switch_model.launch: ready once its control plane answers, bounded);
* :func:`run_workers` runs worker processes (``tests/sw_worker.py``) and collects their results;
* :func:`make_input` / :func:`bfp_reference` are the shared input generator and the independent
  numpy reference of block floating point's integer arithmetic.

Imported by the tests and by the worker script (which only needs :func:`make_input`).
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ina.client import Client
from switch_model.launch import SwitchService, free_port, start_switch  # noqa: F401 - free_port for the tests

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
WORKER = Path(__file__).resolve().parent / "sw_worker.py"
INT32_MAX = 2**31 - 1


# ------------------------------------------------------------------------------------------------
# inputs and the numpy reference
# ------------------------------------------------------------------------------------------------
def make_input(op: dict, rank: int) -> np.ndarray:
    """The float32 values rank ``rank`` feeds into allreduce ``op`` (exactly representable in op's dtype).

    dist "normal": standard normal times 2**(rank % 3 - 1) (so ranks have different exponents);
    "uniform": uniform in [0.1, 1) (positive, no powers of two: rounding bias would show);
    "const07": 0.7 everywhere;
    "zero": all zeros; "big": normal times 2**20; "tiny": normal times 2**-30.
    """
    shape = tuple(op.get("shape", (1000,)))
    rng = np.random.default_rng([int(op.get("seed", 0)), rank])
    dist = op.get("dist", "normal")
    size = int(np.prod(shape)) if shape else 1
    if dist == "normal":
        x = rng.standard_normal(size) * 2.0 ** (rank % 3 - 1)
    elif dist == "uniform":
        x = rng.uniform(0.1, 1.0, size)
    elif dist == "const07":
        x = np.full(size, 0.7)
    elif dist == "zero":
        x = np.zeros(size)
    elif dist == "big":
        x = rng.standard_normal(size) * 2.0**20
    elif dist == "tiny":
        x = rng.standard_normal(size) * 2.0**-30
    else:
        raise ValueError(f"unknown dist {dist!r}")
    x = x.astype(np.float32).reshape(shape)
    dtype = op.get("dtype", "float32")
    if dtype == "float16":
        x = x.astype(np.float16).astype(np.float32)
    elif dtype == "bfloat16":   # round to nearest even on the top 16 bits, as torch does
        u = x.view(np.uint32).astype(np.uint64)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        x = u.astype(np.uint32).view(np.float32).reshape(shape)
    return x


def frexp_exponent(x32: np.ndarray) -> int:
    """floor(log2 max|x|) + 1 by frexp (max|x| = m * 2**e with m in [0.5, 1)); -126 for zeros."""
    m = float(np.max(np.abs(x32.astype(np.float64)))) if x32.size else 0.0
    if m == 0.0:
        return -126
    return int(np.frexp(m)[1])


def bfp_reference(xs: list[np.ndarray], average: bool = False) -> np.ndarray:
    """Block floating point sum of the ranks' float32 tensors, the integer arithmetic in numpy.

    e = max over workers of floor(log2 max|x|) + 1; codes = rint(float64(x) * (2**31-1)/(n*2**e))
    as int32; the switch's int64 register sum; float32(sum * (n*2**e)/(2**31-1)).
    """
    n = len(xs)
    e = max(frexp_exponent(x) for x in xs)
    scale = INT32_MAX / (n * 2.0**e)
    codes = [np.rint(x.astype(np.float64).reshape(-1) * scale) for x in xs]
    for c in codes:
        assert np.all(np.abs(c) <= INT32_MAX // n)       # the reference's own invariant
    total = np.zeros(xs[0].size, np.int64)
    for c in codes:
        total += c.astype(np.int32).astype(np.int64)
    assert np.all(np.abs(total) <= INT32_MAX)             # fits the INT32 result payload
    out = (total.astype(np.float64) * (1.0 / scale)).astype(np.float32)
    if average:
        out = out / np.float32(n)
    return out.reshape(xs[0].shape)


def cast_like(ref32: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 result as it reads back from a tensor of ``dtype`` (as float32)."""
    if dtype in ("float32", "float64"):
        return ref32
    if dtype == "float16":
        return ref32.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        import torch
        return torch.from_numpy(np.ascontiguousarray(ref32)).to(torch.bfloat16).float().numpy()
    raise ValueError(dtype)


# ------------------------------------------------------------------------------------------------
# the switch as a subprocess
# ------------------------------------------------------------------------------------------------
def control(port: int, msg: dict, timeout: float = 10.0) -> dict:
    from ina.control import request
    return request("127.0.0.1", port, msg, timeout=timeout)


def stats(port: int) -> dict:
    return control(port, {"op": "stats"})["stats"]


def wait_until(pred, timeout: float, what: str, interval: float = 0.02):
    """Poll ``pred()`` until it returns a truthy value; raise naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    ev = threading.Event()
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        ev.wait(interval)     # a bounded poll interval, not a synchronisation sleep


class SwitchProc(SwitchService):
    """The switch of a test (switch_model.launch): a free port of 127.0.0.1, no rate log lines,
    its output in ``log_path``."""

    def __init__(self, *args: str, log_path: Path, ready_timeout: float = 60.0):
        sw = start_switch(None, "--stats-interval", "0", *args, host="127.0.0.1", log_path=log_path,
                          timeout=ready_timeout)
        super().__init__(sw.proc, sw.port, sw.control_host, sw.log_path, own_log=False)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM; its exit code. Fails the test if it had to be killed after ``timeout`` seconds."""
        rc = self.stop(timeout)
        if self.killed:
            raise AssertionError(f"switch did not exit within {timeout:g} s of SIGTERM:\n{self.log()}")
        return rc


def run_stages(sw, pkts) -> int:
    """``pkts`` (bytes or uint8 arrays) as one burst in the receive ring of an in-process switch
    (switch_model.pipeline.Switch), through its parse, aggregate and harvest stages, as its poll loop runs
    them: the number of transmissions planned (``sw.state.tx[:m]``)."""
    buf, lens, n = sw.rx.buf, sw.rx.lens, len(pkts)
    for i, p in enumerate(pkts):
        p = np.frombuffer(p, np.uint8) if isinstance(p, (bytes, bytearray)) else p
        buf[i, :p.size] = p
        lens[i] = p.size
    sw.stage_parse(buf, lens, n)
    sw.stage_aggregate(buf, n)
    return sw.stage_harvest(buf, n)


# ------------------------------------------------------------------------------------------------
# workers
# ------------------------------------------------------------------------------------------------
def client_threads(port: int, world: int, job: int, body, join_timeout: float = 60.0, rank_options=None,
                   **client_options) -> list:
    """Run ``body(rank, client)`` in ``world`` threads of this process, each with its own
    ``ina.Client`` of job ``job``; return their results by rank (raises naming the failed ranks).
    ``rank_options(rank)``, if given, returns further Client options of that rank."""
    out, errors = [None] * world, []

    def target(r):
        try:
            opts = {**client_options, **(rank_options(r) if rank_options else {})}
            with Client(("127.0.0.1", port), rank=r, world_size=world, job=job, **opts) as cl:
                out[r] = body(r, cl)
        except Exception as e:  # reported below, with the rank
            errors.append(f"rank {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    assert not [t for t in threads if t.is_alive()], f"ranks still running after {join_timeout} s"
    assert not errors, errors
    return out


def join_all(port: int, job: int, n: int, **kw) -> list:
    """n Clients of one job joined from threads of this process (the join is a rendezvous)."""
    out, errs = [None] * n, [None] * n

    def one(r):
        try:
            out[r] = Client(("127.0.0.1", port), rank=r, world_size=n, job=job, **kw)
        except Exception as e:  # noqa: BLE001
            errs[r] = e

    ts = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=kw.get("timeout", 30) + 10)
    assert not any(t.is_alive() for t in ts), "join did not return"
    if any(errs):
        for c in out:
            if c:
                c.close()
        raise next(e for e in errs if e)
    return out


START_BOUND = 180.0      # seconds for a job's worker processes to start (sw_worker.py waits 120 s for its peers)


class Workers:
    """``n`` worker processes of one job, each running ``tests/sw_worker.py`` on a spec file."""

    def __init__(self, tmp: Path, port: int, n: int, job: int, ops: list, client: dict | None = None,
                 ranks=None, loop: int = 1, name: str | None = None, stop_file: str | None = None,
                 start_file: str | None = None, warmup_ops: int | None = None):
        self.tmp = Path(tmp)
        self.n = n
        self.job = job
        self.name = name or f"job{job}"
        self.procs = {}
        self.files = {}
        launched = list(range(n) if ranks is None else ranks)
        # the ranks join together once all have started (imports take seconds on a loaded machine: a rank
        # started late must not use up the others' join timeout, which is also their allreduce timeout)
        up = [str(self.tmp / f"{self.name}-rank{r}.up") for r in launched]
        for r in launched:
            base = self.tmp / f"{self.name}-rank{r}"
            spec = {"port": port, "rank": r, "world_size": n, "job": job, "ops": ops,
                    "client": client or {}, "loop": loop, "stop_file": stop_file, "start_file": start_file, "warmup_ops": warmup_ops, "out": str(base) + ".npz",
                    "meta": str(base) + ".json", "progress": str(base) + ".progress", "up": up}
            Path(str(base) + ".spec.json").write_text(json.dumps(spec))
            log = open(str(base) + ".log", "wb")
            self.files[r] = base
            self.procs[r] = subprocess.Popen([PY, str(WORKER), str(base) + ".spec.json"], cwd=ROOT,
                                             stdout=log, stderr=subprocess.STDOUT)
            log.close()

    def progress(self, r: int) -> int:
        p = Path(str(self.files[r]) + ".progress")
        return len(p.read_text().splitlines()) if p.exists() else 0

    def joined(self) -> bool:
        """Every worker joined and waits at the start line (workers started with ``start_file``)."""
        return all(Path(str(self.files[r]) + ".json.joined").exists() for r in self.procs)

    def log(self, r: int) -> str:
        return Path(str(self.files[r]) + ".log").read_text(errors="replace")

    def started(self) -> bool:
        """Every worker has started (imported what it needs; its ``.up`` marker exists) or has exited."""
        return all(p.poll() is not None or Path(str(self.files[r]) + ".up").exists() for r, p in self.procs.items())

    def wait(self, timeout: float = 60.0, check: bool = True) -> dict:
        """Wait for every worker (bounded); return {rank: meta dict} with meta["results"] arrays.
        ``timeout`` bounds the job's work, counted once every rank has started: interpreter start-up
        (numpy, numba, torch: tens of seconds on a starved machine) has its own bound, START_BOUND."""
        try:
            wait_until(self.started, START_BOUND, f"{self.name}'s {len(self.procs)} ranks to start")
        except AssertionError:
            self.kill()
            raise
        deadline = time.monotonic() + timeout
        out = {}
        for r, p in self.procs.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"{self.name} rank {r} did not finish within {timeout:g} s:\n"
                                     f"{self.log(r)[-3000:]}")
        for r, p in self.procs.items():
            meta_path = Path(str(self.files[r]) + ".json")
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
            meta["returncode"] = p.returncode
            if check and (p.returncode != 0 or meta.get("error")):
                raise AssertionError(f"{self.name} rank {r} failed (exit {p.returncode}): {meta.get('error')}\n"
                                     f"{self.log(r)[-3000:]}")
            npz = Path(str(self.files[r]) + ".npz")
            if npz.exists():
                with np.load(npz) as z:
                    meta["results"] = [z[f"r{i}"] for i in range(len(z.files))]
            out[r] = meta
        return out

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def expected_inputs(op: dict, n: int) -> list[np.ndarray]:
    return [make_input(op, r) for r in range(n)]

