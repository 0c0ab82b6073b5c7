"""What the Horovod patch and the torch.distributed backend share: configuration from the
environment, the offload rules, the job id agreement and the fallback log.

Environment (read when a job starts; the Horovod wrapper and the docs set them):

=================  ===========================================================================
``INA_SWITCH``     ``host:port`` of a running ``ina-switch``. Turns the Horovod patch on.
``INA_CODEC``      codec: ``nc`` (default), ``nc-det``, ``bfp32``, ``nd``, ``rd`` or a seed codec;
                   variable-length ones (``3lc``, ``eaq``, ``wgt``) run through the service's
                   host aggregator and are logged as NOT switch-feasible.
``INA_TIMEOUT``    seconds any one wait may take (join, allreduce) before a clear error (30).
``INA_JOB``        job id (1..65535) at the switch; by default rank 0 draws one and the ranks
                   agree on it through the framework's own rendezvous.
``INA_SLOTS``      the job's share of the switch's slot pool (window of chunks in flight; 64).
``INA_ELEMENTS``   elements per packet (1024).
``INA_SEED``       seed of the stochastic codecs (each rank derives its own stream); random if unset.
``INA_SPARSE``     ``1``: sparse block streaming (only chunks with a non-zero code travel); ``0`` (default).
``INA_LOG``        ``info`` (default): offload / fallback lines; ``warning``: fallbacks only.
=================  ===========================================================================
"""
from __future__ import annotations

import functools
import logging
import os
import secrets
import sys
import threading
from dataclasses import dataclass, field

log = logging.getLogger("ina.gloo_patch")

OFFLOADED_DTYPES = ("float32", "float16", "bfloat16")
JOB_MIN, JOB_MAX = 1, 65535


class InaConfigError(ValueError):
    """A setting of the INA backend is wrong; the message names the variable and the value."""


def _setup_logging() -> None:
    if log.handlers:
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(h)
    log.propagate = False
    level = os.environ.get("INA_LOG", "info").upper()
    log.setLevel(getattr(logging, level, logging.INFO))


_setup_logging()


def parse_switch(value: str, what: str = "INA_SWITCH") -> tuple[str, int]:
    """``host:port`` -> (host, port), with an error naming the variable when malformed."""
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InaConfigError(f"{what}={value!r}: expected host:port, e.g. 127.0.0.1:9999")
    return host.strip("[]"), int(port)


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        f = float(v)
    except ValueError:
        raise InaConfigError(f"{name}={v!r}: expected a number of seconds") from None
    if f <= 0:
        raise InaConfigError(f"{name}={v!r}: must be > 0")
    return f


def _env_int(name: str, default: int | None, lo: int, hi: int) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        i = int(v)
    except ValueError:
        raise InaConfigError(f"{name}={v!r}: expected an integer") from None
    if not lo <= i <= hi:
        raise InaConfigError(f"{name}={v!r}: must be in {lo}..{hi}")
    return i


def check_codec(name: str, what: str = "INA_CODEC") -> str:
    from ina import compression as C

    if name not in C.available():
        raise InaConfigError(f"{what}={name!r}: unknown codec; available: {', '.join(C.available())}")
    if not C.get(name).switch_summable:
        log.warning(
            "%s=%s: the switch cannot sum this codec's codes; allreduces go to the switch service's host "
            "aggregator (NOT switch-feasible)", what, name)
    return name


@dataclass
class InaConfig:
    switch: tuple[str, int]
    codec: str = "nc"
    timeout: float = 30.0
    job: int | None = None
    slots: int = 64
    elements: int = 1024
    seed: int | None = None
    sparse: bool = False

    @classmethod
    def from_env(cls, switch: str | tuple | None = None, codec: str | None = None,
                 timeout: float | None = None) -> "InaConfig":
        if switch is None:
            env = os.environ.get("INA_SWITCH", "")
            if not env:
                raise InaConfigError("INA_SWITCH is not set: give the switch as host:port "
                                     "(start one with `ina-switch serve --port 9999`)")
            switch = parse_switch(env)
        elif isinstance(switch, str):
            switch = parse_switch(switch, "switch")
        return cls(
            switch=(str(switch[0]), int(switch[1])),
            codec=check_codec(codec or os.environ.get("INA_CODEC") or "nc"),
            timeout=float(timeout) if timeout is not None else _env_float("INA_TIMEOUT", 30.0),
            job=_env_int("INA_JOB", None, JOB_MIN, JOB_MAX),
            slots=_env_int("INA_SLOTS", 64, 1, 65535),
            elements=_env_int("INA_ELEMENTS", 1024, 1, 65535),
            seed=_env_int("INA_SEED", None, 0, 2**31 - 1),
            sparse=bool(_env_int("INA_SPARSE", 0, 0, 1)),
        )

    def client_kwargs(self) -> dict:
        return {"timeout": self.timeout, "slots": self.slots, "elements": self.elements, "seed": self.seed,
                "sparse": self.sparse}

    def describe(self) -> str:
        return f"switch {self.switch[0]}:{self.switch[1]}, codec {self.codec}, timeout {self.timeout:g}s"


def new_job_id() -> int:
    return JOB_MIN + secrets.randbelow(JOB_MAX - JOB_MIN + 1)


@functools.lru_cache(maxsize=None)
def per_parameter(codec: str) -> bool:
    """True if ``codec`` keeps a residual per key (error feedback): the DDP comm hook and Horovod's fusion
    then send each parameter (tensor) as its own keyed allreduce, with its own residual and scale. Asked per
    bucket, answered once per codec (``compression.get`` makes a codec object, with its random generator)."""
    from ina import compression  # noqa: PLC0415

    return compression.get(codec).keeps_residuals


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def offloadable_dtype(dtype) -> bool:
    return dtype_name(dtype) in OFFLOADED_DTYPES


def tensors_not_offloadable(tensors) -> str | None:
    """Why these tensors cannot go through the switch (None if they can): the reason both
    integrations log when they fall back to Gloo."""
    for t in tensors:
        if t.is_sparse:
            return "sparse tensor"
        if not offloadable_dtype(t.dtype):
            return f"dtype {dtype_name(t.dtype)} (offloaded: float32, float16, bfloat16)"
    return None


@dataclass
class Counters:
    """What went where: exposed by ``gloo_patch.horovod.stats()`` and ``InaProcessGroup.stats()``."""
    offloaded_calls: int = 0
    offloaded_tensors: int = 0
    offloaded_elements: int = 0
    fallback_calls: int = 0
    fallback_reasons: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"offloaded_calls": self.offloaded_calls, "offloaded_tensors": self.offloaded_tensors,
                "offloaded_elements": self.offloaded_elements, "fallback_calls": self.fallback_calls,
                "fallback_reasons": dict(self.fallback_reasons)}


class FallbackLog:
    """Logs one line per distinct (operation, reason) that stays on Gloo, and counts every call."""

    def __init__(self, prefix: str, announce: bool = True):
        self.prefix = prefix
        self.announce = announce     # only rank 0 logs, every rank counts
        self.counters = Counters()
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def fallback(self, op: str, why: str, example: str = "") -> None:
        with self._lock:
            self.counters.fallback_calls += 1
            key = f"{op}: {why}"
            self.counters.fallback_reasons[key] = self.counters.fallback_reasons.get(key, 0) + 1
            if (op, why) in self._seen or not self.announce:
                return
            self._seen.add((op, why))
        ex = f" (first: {example})" if example else ""
        log.warning("%s %s falls back to Gloo: %s%s", self.prefix, op, why, ex)

    def offloaded(self, n_tensors: int, n_elements: int, calls: int = 1) -> None:
        with self._lock:
            self.counters.offloaded_calls += calls
            self.counters.offloaded_tensors += n_tensors
            self.counters.offloaded_elements += n_elements
