"""INA backend for Horovod (PyTorch): gradient allreduces go through the switch, the rest stays on Gloo.

Turned on by ``INA_SWITCH=host:port`` in the environment of the ranks; a normal Horovod script needs
no edits. The patch is applied when ``horovod.torch`` finishes importing (by the import hook that
``gloo_patch.autopatch`` installs: a ``.pth`` line in the venv, see ``make install``, or the
``sitecustomize`` the wrapper ``python -m gloo_patch.horovodrun`` puts on ``PYTHONPATH``), or by
calling :func:`install` yourself.

What is patched (see docs/frameworks.md):

* ``horovod.torch.mpi_ops._allreduce_async`` and ``_grouped_allreduce_async``: every public allreduce
  (``hvd.allreduce``, ``allreduce_``, ``allreduce_async``, ``allreduce_async_``, the grouped
  variants, ``hvd.DistributedOptimizer``'s hooks, ``SyncBatchNorm``) reaches Horovod's C++ library
  through these two module globals, so they are the single point where an allreduce is either taken
  over (an :class:`InaHandle` is returned) or handed to the original (Gloo);
* ``synchronize`` and ``poll``, wherever Horovod bound them: ``horovod.torch``, ``mpi_ops``,
  ``horovod.torch.optimizer`` (which imported ``synchronize`` into its own globals), ``functions``,
  ``sync_batch_norm``; an :class:`InaHandle` is completed by us, any other handle by Horovod;
* ``init``/``shutdown``: join the switch after ``hvd.init()`` (the ranks agree on a job id through a
  Horovod broadcast from rank 0), leave it on ``hvd.shutdown()``.

Taken over: op Sum or Average, the global process set, float32/float16/bfloat16 dense tensors,
with prescale/postscale factors applied locally. Everything else (Adasum, Min, Max, Product, other
process sets, other dtypes) stays on Gloo with one log line per distinct reason; broadcast,
allgather, alltoall, reducescatter and sparse allreduce are not touched.

Ordering: Horovod matches collectives across ranks by name. INA allreduces are queued when issued and
run when a rank first waits for one (``synchronize``/``poll``), in name order, so ranks whose hooks
fired in different orders still feed the switch the same sequence of tensors.
"""
from __future__ import annotations

import atexit
import itertools
import sys
import threading

from .common import FallbackLog, InaConfig, log, new_job_id, tensors_not_offloadable

_PATCHED_MODULES = ("horovod.torch", "horovod.torch.mpi_ops", "horovod.torch.optimizer", "horovod.torch.functions",
                    "horovod.torch.sync_batch_norm")


class InaHandle:
    """Handle of an allreduce taken over by the INA backend (Horovod's own handles are ints)."""

    __slots__ = ("name", "tensors", "outputs", "average", "prescale", "postscale", "grouped", "done", "error", "seq")

    def __init__(self, name, tensors, outputs, average, prescale, postscale, grouped, seq):
        self.name, self.tensors, self.outputs = name, tensors, outputs
        self.average, self.prescale, self.postscale = average, prescale, postscale
        self.grouped, self.done, self.error, self.seq = grouped, False, None, seq

    def result(self):
        return tuple(self.outputs) if self.grouped else self.outputs[0]

    def __repr__(self) -> str:
        return f"<InaHandle {self.name!r} {len(self.tensors)} tensor(s) {'done' if self.done else 'pending'}>"


class _HorovodIna:
    def __init__(self, config: InaConfig):
        import horovod.torch.mpi_ops as M  # noqa: PLC0415

        self.M = M
        self.config = config
        self.orig = {"_allreduce_async": M._allreduce_async, "_grouped_allreduce_async": M._grouped_allreduce_async,
                     "synchronize": M.synchronize, "poll": M.poll, "init": M.init, "shutdown": M.shutdown}
        self.client = None
        self.job: int | None = None
        self.rank = -1
        self.pending: list[InaHandle] = []
        self.seq = itertools.count()
        self.lock = threading.RLock()
        self.broken: BaseException | None = None
        self.fallbacks = FallbackLog("[ina horovod rank ?]")

    # -- switch connection ---------------------------------------------------------------------------
    def connect(self) -> None:
        if self.client is not None:
            return
        from ina import Client  # noqa: PLC0415
        import torch  # noqa: PLC0415

        M = self.M
        self.rank, size = M.rank(), M.size()
        self.fallbacks.prefix = f"[ina horovod rank {self.rank}]"
        self.fallbacks.announce = self.rank == 0
        job = self.config.job
        if job is None:   # rank 0 draws, everyone gets it through Horovod's (Gloo) broadcast
            t = torch.tensor([new_job_id() if self.rank == 0 else 0], dtype=torch.int64)
            job = int(M.broadcast(t, root_rank=0, name="ina.job_id").item())
        self.job = job
        self.client = Client(switch=self.config.switch, rank=self.rank, world_size=size, job=job,
                             **self.config.client_kwargs())
        if self.rank == 0:
            log.info("[ina horovod rank 0] INA backend on: %d ranks, job %d, %s. Through the switch: allreduce "
                     "(Sum/Average, global process set, float32/float16/bfloat16). On Gloo: everything else "
                     "(broadcast, allgather, alltoall, reducescatter, sparse allreduce, other ops/dtypes/process "
                     "sets)", size, job, self.config.describe())

    def disconnect(self) -> None:
        c, self.client = self.client, None
        if c is not None:
            try:
                c.close()
            except Exception as e:  # noqa: BLE001 - leaving is best effort at shutdown
                log.warning("[ina horovod rank %d] leaving job %s: %s", self.rank, self.job, e)

    # -- decisions ---------------------------------------------------------------------------------------
    def why_not(self, tensors, op, process_set) -> str | None:
        M = self.M
        if op not in (M.Sum, M.Average):
            names = {M.Adasum: "Adasum", M.Min: "Min", M.Max: "Max", M.Product: "Product"}
            return f"op {names.get(op, op)} (the switch only adds)"
        if process_set is not M.global_process_set and getattr(process_set, "process_set_id", 0) != 0:
            return f"process set {process_set.process_set_id} (only the global process set is offloaded)"
        return tensors_not_offloadable(tensors)

    # -- the patched functions -------------------------------------------------------------------------
    def allreduce_async(self, tensor, output, name, op, prescale_factor, postscale_factor, process_set):
        why = self.why_not([tensor], op, process_set)
        if why is not None:
            self.fallbacks.fallback("allreduce", why, name or f"{tensor.dtype} {tuple(tensor.shape)}")
            return self.orig["_allreduce_async"](tensor, output, name, op, prescale_factor, postscale_factor,
                                                 process_set)
        return self._queue(name, [tensor], [output], op, prescale_factor, postscale_factor, grouped=False)

    def grouped_allreduce_async(self, tensors, outputs, name, op, prescale_factor, postscale_factor, process_set):
        why = self.why_not(tensors, op, process_set)
        if why is not None:
            self.fallbacks.fallback("grouped_allreduce", why, name or f"{len(tensors)} tensors")
            return self.orig["_grouped_allreduce_async"](tensors, outputs, name, op, prescale_factor,
                                                         postscale_factor, process_set)
        return self._queue(name, list(tensors), list(outputs), op, prescale_factor, postscale_factor, grouped=True)

    def _queue(self, name, tensors, outputs, op, prescale, postscale, grouped) -> InaHandle:
        if not self.M.is_initialized():
            raise ValueError("Horovod has not been initialized; use hvd.init().")
        with self.lock:
            seq = next(self.seq)
            h = InaHandle(name if name is not None else f"ina.noname.{seq:012d}", tensors, outputs,
                          op == self.M.Average, float(prescale), float(postscale), grouped, seq)
            self.pending.append(h)
        return h

    def flush(self) -> None:
        """Run every queued allreduce through the switch, in name order."""
        import torch  # noqa: PLC0415

        with self.lock:
            batch, self.pending = sorted(self.pending, key=lambda h: (h.name, h.seq)), []
            if not batch:
                return
            try:
                if self.broken is not None:
                    raise self.broken
                self.connect()
                with torch.no_grad():
                    for h in batch:
                        n = 0
                        # a named tensor keeps its error-feedback residual across steps; Horovod's
                        # generated names (no name given) change every call, so those go stateless
                        named = not h.name.startswith("ina.noname.")
                        for i, (t, out) in enumerate(zip(h.tensors, h.outputs)):
                            if out is not t:
                                out.copy_(t)
                            if h.prescale != 1.0:
                                out.mul_(h.prescale)
                            self.client.allreduce(out, codec=self.config.codec, average=h.average,
                                                  key=(h.name, i) if named else None)
                            if h.postscale != 1.0:
                                out.mul_(h.postscale)
                            n += t.numel()
                        h.done = True
                        self.fallbacks.offloaded(len(h.tensors), n)
            except Exception as e:
                if self.broken is None:
                    log.error("[ina horovod rank %d] allreduce through switch %s:%d (job %s) failed: %s", self.rank,
                              *self.config.switch, self.job, e)
                self.broken = e
                for h in batch:
                    if not h.done:
                        h.error = e
                raise

    def synchronize(self, handle):
        if isinstance(handle, InaHandle):
            if not handle.done and handle.error is None:
                self.flush()
            if handle.error is not None:
                raise handle.error
            return handle.result()
        return self.orig["synchronize"](handle)

    def poll(self, handle) -> bool:
        if isinstance(handle, InaHandle):
            if not handle.done and handle.error is None:
                self.flush()     # nothing runs in the background: polling completes the queue
            return True
        return self.orig["poll"](handle)

    def init(self, *args, **kwargs):
        out = self.orig["init"](*args, **kwargs)
        self.connect()
        return out

    def shutdown(self, *args, **kwargs):
        self.disconnect()
        return self.orig["shutdown"](*args, **kwargs)

    def stats(self) -> dict:
        d = self.fallbacks.counters.as_dict()
        d["job"] = self.job
        d["client"] = self.client.stats.as_dict() if self.client is not None else None
        return d


_state: _HorovodIna | None = None


def installed() -> bool:
    return _state is not None


def stats() -> dict:
    """Counters of this rank: allreduces offloaded, fallbacks by reason, the client's packet counters."""
    if _state is None:
        raise RuntimeError("the INA Horovod backend is not installed in this process")
    return _state.stats()


def install(config: InaConfig | None = None) -> bool:
    """Patch ``horovod.torch`` so allreduces go through the switch (idempotent). Returns True if patched now."""
    global _state
    if _state is not None:
        return False
    import horovod.torch  # noqa: F401,PLC0415 - also imports optimizer, functions, sync_batch_norm

    st = _HorovodIna(config or InaConfig.from_env())
    M = st.M
    M._allreduce_async = st.allreduce_async
    M._grouped_allreduce_async = st.grouped_allreduce_async
    replace = {"synchronize": (st.orig["synchronize"], st.synchronize), "poll": (st.orig["poll"], st.poll),
               "init": (st.orig["init"], st.init), "shutdown": (st.orig["shutdown"], st.shutdown)}
    for modname in _PATCHED_MODULES:
        mod = sys.modules.get(modname)
        if mod is None:
            continue
        for attr, (orig, new) in replace.items():
            if getattr(mod, attr, None) is orig:
                setattr(mod, attr, new)
    _state = st
    atexit.register(st.disconnect)
    if M.is_initialized():   # installed after hvd.init(): join now
        st.connect()
    return True


__all__ = ["install", "installed", "stats", "InaHandle"]
