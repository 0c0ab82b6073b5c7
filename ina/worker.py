"""What the two clients of a job share: :class:`~ina.client.Client` (the switch path) and
:class:`~ina.host_client.HostAggClient` (the host-aggregator path).

* the worker's identity (rank, world size, job) and its checks;
* its codec objects, one per codec name, seeded per rank (:func:`rank_seed`): ranks must never
  share a stochastic codec's random stream;
* the broken latch: after a failed allreduce the job is aborted (or in an unknown state) at the
  switch or aggregator, so every later allreduce of that client raises at once;
* the tail of every allreduce: average, count, write the result back into the caller's tensor;
* the counters both report (:class:`WorkerStats`).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from . import compression, staging
from .errors import AllreduceError


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s codec objects under the worker seed ``seed`` (distinct per rank)."""
    return seed * 1_000_003 + rank


def random_seed() -> int:
    """A worker seed when none is given (fresh per process)."""
    return int(np.random.default_rng().integers(0, 2**31))


@dataclass
class WorkerStats:
    allreduces: int = 0           # allreduces completed
    elements: int = 0
    bytes_sent: int = 0           # every byte this worker put on the wire (headers included)
    bytes_received: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Worker:
    """Base of both clients; subclasses call :meth:`_init_worker` first in their ``__init__``."""

    kind = "client"               # how the latch's message names this client

    def _init_worker(self, rank: int, world_size: int, job: int, seed: int | None,
                     codec_options: dict | None, stats: WorkerStats) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.rank, self.world_size, self.job = int(rank), int(world_size), int(job)
        self.stats = stats
        self._codecs: dict[str, compression.Codec] = {}
        self._codec_options = codec_options or {}
        self._seed = seed if seed is not None else random_seed()
        self._broken: str | None = None

    def codec(self, name: str, **options) -> compression.Codec:
        """This worker's codec object for ``name`` (built once; seed distinct per rank). ``options``
        (and the constructor's ``codec_options[name]``) go to the codec's constructor on first use."""
        c = self._codecs.get(name)
        if c is None:
            opts = {**self._codec_options.get(name, {}), **options}
            opts.setdefault("seed", rank_seed(self._seed, self.rank))
            c = self._codecs[name] = compression.get(name, **opts)
        return c

    # -- the broken latch ---------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._broken:
            raise AllreduceError(f"{self.kind} of job {self.job} rank {self.rank} is unusable after an earlier "
                                 f"failure: {self._broken}")

    def _break(self, why: str) -> None:
        self._broken = why

    @contextmanager
    def _latching(self):
        """An :class:`AllreduceError` inside breaks this client for good (and propagates)."""
        try:
            yield
        except AllreduceError as e:
            self._break(str(e))
            raise

    # -- the tail of every allreduce --------------------------------------------------------------
    def _deliver(self, tensor, out: np.ndarray, average: bool):
        """Average (if asked), count, and write the flat float32 result ``out`` back into ``tensor``."""
        if average:              # in place: the result array is the client's (or the tensor's own memory)
            out = np.divide(out, np.float32(self.world_size), out=out if out.flags.writeable else None)
        self.stats.allreduces += 1
        self.stats.elements += out.size
        staging.write_back(tensor, out)      # CUDA tensors: on their device and current stream
        return tensor
