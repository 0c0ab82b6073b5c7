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
  Horovod broadcast from rank 0), leave it on ``hvd.shutdown()`` (a later ``hvd.init()`` joins afresh).

Horovod's contract. Every allreduce of the global process set is queued, whatever its op and dtype,
after Horovod's own argument checks (``_check_function``: supported tensor type, contiguity; a name
already in flight raises Horovod's duplicate-name ``ValueError``). Queued allreduces form buckets: a bucket
is sealed when ``INA_BUCKET_BYTES`` (default 512 KiB) are queued, so streaming starts while backward still
runs, and whatever is queued when a rank waits for one (``synchronize``/``poll``). Every rank of the same
model queues the same gradients in the same order, so every rank seals the same buckets. A worker thread
reads each bucket's agreement round (``gloo_patch.agreement``: a small sum over the ranks of a digest of names,
shapes, dtypes, ops, prescale/postscale, and flags, on rank 0's TCPStore, started when the bucket is
sealed, so it runs while the buckets before it stream), in sealing order; names the ranks did not all have
in the bucket are queued again.
If all ranks agree, the offloadable allreduces (op Sum/Average, float32/float16/bfloat16, no NaN/Inf on
any rank) go through the switch, fused into buffers of at most ``HOROVOD_FUSION_THRESHOLD`` bytes in
name order; the others go to Horovod's own allreduce. If the ranks disagree, each name queued on every
rank goes to Horovod's own allreduce, which raises Horovod's own error on every rank for a mismatch
(shape, dtype, op, prescale/postscale), so nothing can hang at the switch. If a rank has joined
(``hvd.join()``), the batch goes to Horovod, where joined ranks contribute zeros (``join`` is patched too:
the joined rank takes part in the others' rounds as absent until every rank has joined).

Other process sets go straight to Horovod; broadcast, allgather, alltoall, reducescatter and sparse
allreduce are not touched.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import os
import sys
import threading
import time

from ina import AllreduceError

from . import agreement, fusion
from .horovod_native import HorovodNative, quieter_background_cycle
from .common import FallbackLog, InaConfig, log, new_job_id, tensors_not_offloadable

_PATCHED_MODULES = ("horovod.torch", "horovod.torch.mpi_ops", "horovod.torch.optimizer", "horovod.torch.functions",
                    "horovod.torch.sync_batch_norm")
DUPLICATE_NAME = ("Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor that "
                  "is currently being processed.  If you want to request another tensor, use a different tensor name.")
DEFAULT_BUCKET_BYTES = 512 * 1024


def bucket_bytes() -> int:
    """INA_BUCKET_BYTES: queued allreduces start (one agreement round, then the switch) as soon as this many
    bytes are queued, while backward goes on; the rest start at synchronize."""
    v = os.environ.get("INA_BUCKET_BYTES", "")
    try:
        n = int(v) if v else DEFAULT_BUCKET_BYTES
    except ValueError:
        raise ValueError(f"INA_BUCKET_BYTES={v!r}: expected a number of bytes") from None
    if n <= 0:
        raise ValueError(f"INA_BUCKET_BYTES={v!r}: expected a positive number of bytes")
    return n


class InaHandle:
    """Handle of an allreduce queued by the INA backend (Horovod's own handles are ints)."""

    __slots__ = ("name", "tensors", "outputs", "op", "prescale", "postscale", "grouped", "done", "error", "seq",
                 "consumed", "desc", "sealed", "missing", "nbytes")

    def __init__(self, name, tensors, outputs, op, prescale, postscale, grouped, seq, desc):
        self.name, self.tensors, self.outputs, self.op = name, tensors, outputs, op
        self.prescale, self.postscale, self.grouped, self.seq = prescale, postscale, grouped, seq
        self.done, self.error, self.consumed, self.desc, self.sealed = False, None, False, desc, 0.0
        self.missing: list[int] = []     # the ranks that had not queued it, as the last reconciliation saw
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def result(self):
        return tuple(self.outputs) if self.grouped else self.outputs[0]

    def __repr__(self) -> str:
        return f"<InaHandle {self.name!r} {len(self.tensors)} tensor(s) {'done' if self.done else 'pending'}>"


class _HorovodIna(HorovodNative):
    def __init__(self, config: InaConfig):
        import horovod.torch.mpi_ops as M  # noqa: PLC0415

        self.M = M
        self.config = config
        self.orig = {"_allreduce_async": M._allreduce_async, "_grouped_allreduce_async": M._grouped_allreduce_async,
                     "synchronize": M.synchronize, "poll": M.poll, "init": M.init, "shutdown": M.shutdown,
                     "join": M.join}
        self.op_names = {M.Sum: "Sum", M.Average: "Average", M.Adasum: "Adasum", M.Min: "Min", M.Max: "Max",
                         M.Product: "Product"}
        self.client = None
        self.job: int | None = None
        self.rank = -1
        self.active: dict[str, InaHandle] = {}   # queued and not finished, by name
        self.open: list[InaHandle] = []           # queued, not yet in a bucket
        self.open_bytes = 0
        self.buckets: list[tuple] = []            # sealed (handles, their agreement round), for the worker
        self.channel: agreement.Rounds | None = None   # the agreement rounds, on rank 0's store
        self.bucket_bytes = bucket_bytes()
        self.seq = itertools.count()
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.worker: threading.Thread | None = None
        self.waiting = 0           # threads waiting in synchronize/join for the worker
        self.stopping = False
        self.stale = None          # a reconciliation collective that timed out, completed before the next one
        self.fallbacks = FallbackLog("[ina horovod rank ?]")
        self.rounds = 0
        # where the worker's time goes (seconds, since init): waiting for agreement rounds, the switch
        # allreduces (fuse, stream, unfuse), Horovod's own allreduces; and the worker thread's CPU
        # worker_cpu: the worker thread's CPU; of it, reading the rounds (agreement_cpu) and inside the switch
        # client's calls (client_cpu): the rest is the integration's own (fuse, unfuse, decisions, hand-offs)
        self.seconds = {"agreement_wait": 0.0, "switch": 0.0, "native": 0.0, "worker_cpu": 0.0, "agreement_cpu": 0.0,
                        "client_cpu": 0.0}
        self.switch_failed = False   # an allreduce through the switch failed: the client is latched broken
        # (sealed, started, finished, worker CPU s, 0) per bucket, time.perf_counter(): as the DDP lane's timeline
        self.timeline: collections.deque = collections.deque(maxlen=4096)

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
        # rank 0 draws the job id (unless INA_JOB) and serves the agreement rounds' store; everyone gets both
        # through Horovod's (Gloo) broadcast
        def broadcast(values: list[int]) -> list[int]:
            return M.broadcast(torch.tensor(values, dtype=torch.int64), root_rank=0, name="ina.job_id").tolist()
        job, self.channel = agreement.open_rounds(self.rank, size, self.config.timeout, self.config.switch[0],
                                                  self.config.job or new_job_id(), broadcast)
        self.job = job
        self.client = Client(switch=self.config.switch, rank=self.rank, world_size=size, job=job,
                             **self.config.client_kwargs())
        if self.rank == 0:
            log.info("[ina horovod rank 0] INA backend on: %d ranks, job %d, %s. Through the switch: allreduce "
                     "(Sum/Average, global process set, float32/float16/bfloat16, fused up to %d bytes). On Gloo: "
                     "everything else (broadcast, allgather, alltoall, reducescatter, sparse allreduce, other "
                     "ops/dtypes/process sets, NaN/Inf)", size, job, self.config.describe(), fusion.fusion_threshold())

    def disconnect(self) -> None:
        c, self.client, self.switch_failed = self.client, None, False
        channel, self.channel = self.channel, None
        with self.lock:
            self.stopping = True
            self.cond.notify_all()
            w, self.worker = self.worker, None
        if w is not None and w is not threading.current_thread():
            w.join(self.config.timeout + 5)
        with self.lock:
            for h in self.active.values():
                h.error = RuntimeError(f"allreduce {h.name!r} was still queued when Horovod was shut down")
            self.active, self.open, self.open_bytes, self.buckets, self.stale = {}, [], 0, [], None
            self.stopping = False
            self.cond.notify_all()
        if channel is not None:
            channel.close()
        if c is not None:
            try:
                c.close()
            except Exception as e:  # noqa: BLE001 - leaving is best effort at shutdown
                log.warning("[ina horovod rank %d] leaving job %s: %s", self.rank, self.job, e)

    def client_unusable(self) -> bool:
        return self.client is None or self.switch_failed

    # -- decisions ---------------------------------------------------------------------------------------
    def why_not(self, h: InaHandle) -> str | None:
        """Why this (agreed) allreduce cannot go through the switch; None if it can."""
        if h.op not in (self.M.Sum, self.M.Average):
            return f"op {self.op_names.get(h.op, h.op)} (the switch only adds)"
        return tensors_not_offloadable(h.tensors)

    # -- the patched functions -------------------------------------------------------------------------
    def allreduce_async(self, tensor, output, name, op, prescale_factor, postscale_factor, process_set):
        if not self.global_set(process_set):
            return self._other_set("allreduce", process_set, name or f"{tensor.dtype} {tuple(tensor.shape)}",
                                   self.orig["_allreduce_async"], tensor, output, name, op, prescale_factor,
                                   postscale_factor, process_set)
        self.M._check_function(self.M._allreduce_function_factory, tensor)   # Horovod's own argument checks
        return self._queue(name, [tensor], [output], op, prescale_factor, postscale_factor, grouped=False)

    def grouped_allreduce_async(self, tensors, outputs, name, op, prescale_factor, postscale_factor, process_set):
        if not self.global_set(process_set):
            return self._other_set("grouped_allreduce", process_set, name or f"{len(tensors)} tensors",
                                   self.orig["_grouped_allreduce_async"], tensors, outputs, name, op,
                                   prescale_factor, postscale_factor, process_set)
        for t in tensors:
            self.M._check_function(self.M._grouped_allreduce_function_factory, t)
        return self._queue(name, list(tensors), list(outputs), op, prescale_factor, postscale_factor, grouped=True)

    def global_set(self, process_set) -> bool:
        return process_set is self.M.global_process_set or getattr(process_set, "process_set_id", 0) == 0

    def _other_set(self, what, process_set, example, fn, *args):
        self.fallbacks.fallback(what, f"process set {process_set.process_set_id} (only the global process set is "
                                      "offloaded)", example)
        return fn(*args)

    def _queue(self, name, tensors, outputs, op, prescale, postscale, grouped) -> InaHandle:
        if not self.M.is_initialized():
            raise ValueError("Horovod has not been initialized; use hvd.init().")
        with self.lock:
            if name is not None and name in self.active:
                raise ValueError(DUPLICATE_NAME)
            seq = next(self.seq)
            name = name if name is not None else f"{fusion.NONAME}{seq:012d}"
            desc = (f"op={self.op_names.get(op, op)}|pre={float(prescale)!r}|post={float(postscale)!r}|"
                    f"{'grouped' if grouped else 'single'}|{agreement.describe_tensors(tensors)}")
            h = InaHandle(name, tensors, outputs, op, float(prescale), float(postscale), grouped, seq, desc)
            self.active[name] = h
            self.open.append(h)
            self.open_bytes += h.nbytes
            if self.open_bytes >= self.bucket_bytes:    # a full bucket starts now, while backward goes on
                self._seal()
        return h

    # -- running the queue: buckets, one agreement round each, in a worker thread ------------------------
    def _seal(self) -> None:
        """The open handles become a bucket for the worker (lock held). Every rank queues the same tensors
        in the same order (the same model's backward), so every rank seals the same buckets."""
        if self.open:
            now = time.monotonic()
            for h in self.open:
                h.sealed = h.sealed or now       # a handle carried over from a round keeps its first time
            # the bucket's agreement round starts now, in sealing order (the order rounds pair up across ranks);
            # the worker reads it when it reaches the bucket: meanwhile the buckets before it stream
            self.buckets.append((self.open, self._start_round(self.open), time.perf_counter()))
            self.open, self.open_bytes = [], 0
            if self.worker is None or not self.worker.is_alive():
                self.worker = threading.Thread(target=self._work, name="ina-horovod", daemon=True)
                self.worker.start()
            self.cond.notify_all()

    def complete(self, target: InaHandle) -> None:
        """Seal what is queued and wait until the worker has run ``target`` (bounded). Everything queued is
        sealed, not only up to ``target``: a caller that waits has finished queueing (the optimizer's step after
        backward), and Horovod's optimizer waits for its handles in backward's order, the first bucket's first,
        so the last bucket would otherwise wait, unsealed and without its agreement round, until every bucket
        before it had streamed. Every rank makes the same calls in the same order, so every rank seals the same
        buckets."""
        def finished() -> bool:
            if target.done or target.error is not None:
                return True
            if self.active.get(target.name) is not target:
                raise RuntimeError(f"allreduce {target.name!r} is not queued (Horovod was shut down?)")
            return False

        with self.lock:
            self._wait_until(finished, lambda: f"INA backend: allreduce {target.name!r} did not complete within "
                                               f"{2 * self.config.timeout:g} s (2 x INA_TIMEOUT); names differ across "
                                               "ranks?")

    def _wait_until(self, finished, failure) -> None:
        """(Lock held.) Seal what is queued (or carried over from a round) and wait until ``finished()``, as a
        thread waiting for the worker (:meth:`stuck`); after 2 x INA_TIMEOUT a HorovodInternalError(``failure()``)."""
        deadline = time.monotonic() + 2 * self.config.timeout
        self.waiting += 1
        try:
            while not finished():
                if self.open:
                    self._seal()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.M.HorovodInternalError(failure())
                self.cond.wait(min(left, 1.0))
        finally:
            self.waiting -= 1

    def stuck(self) -> bool:
        """A thread waits for the worker and nothing is queued beyond the batch the worker holds: this rank
        cannot queue anything more until that batch's allreduces complete (a program that queues from one thread)."""
        with self.lock:
            return self.waiting > 0 and not self.open and not self.buckets

    def open_names(self) -> set:
        return {h.name for h in self.open}

    def _work(self) -> None:
        """The worker: the buckets in sealing order, each decided by its agreement round (started when the
        bucket was sealed); names a round leaves undecided (the ranks' buckets differ) are queued again."""
        while True:
            with self.lock:
                while not self.buckets and not self.stopping:
                    self.cond.wait(1.0)
                if self.stopping:
                    return
                batch, started, sealed_at = self.buckets.pop(0)
            cpu, t0 = time.thread_time(), time.perf_counter()
            try:
                ready, native, ag = self._decide(batch, started)
                self._run_round(ready, native, ag)
                done = ready
            except Exception as e:  # noqa: BLE001 - each handle raises it from its synchronize
                for h in batch:
                    h.error = h.error or e
                done = batch
            cpu = time.thread_time() - cpu
            self.seconds["worker_cpu"] += cpu
            self.timeline.append((sealed_at, t0, time.perf_counter(), cpu, 0.0))
            self._settle(batch, done)

    def _settle(self, batch, done) -> None:
        """After a round: finished handles leave the queue; the others are queued again (sealed with the next
        bucket, or by the synchronize that waits for them), unless the other ranks never queued them."""
        with self.lock:
            finished, now = {id(h) for h in done}, time.monotonic()
            carry = []
            for h in batch:
                if id(h) in finished:
                    continue
                if now - h.sealed > self.config.timeout:   # the other ranks never queued this name
                    lacking = f" (not on rank(s) {', '.join(map(str, h.missing))})" if h.missing else ""
                    h.error = self.M.HorovodInternalError(
                        f"INA backend: allreduce {h.name!r} was not queued on every rank within "
                        f"{self.config.timeout:g} s (INA_TIMEOUT){lacking}; names differ across ranks?")
                    done.append(h)
                else:
                    carry.append(h)
            self.open[:0] = carry
            self.open_bytes += sum(h.nbytes for h in carry)
            for h in done:
                if self.active.get(h.name) is h:
                    del self.active[h.name]
            self.cond.notify_all()

    def _start_round(self, batch):
        """This rank's agreement vector for ``batch`` into the next round (not waited for; lock held)."""
        if self.channel is None:
            raise RuntimeError("the INA backend is not connected (hvd.init() not called, or Horovod shut down)")
        batch = sorted(batch, key=lambda h: (h.name, h.seq))
        flags = agreement.nonfinite_flags([h.tensors for h in batch])
        entries = [(h.name, h.desc, bad) for h, bad in zip(batch, flags)]
        return self.channel.start(agreement.local_vector(entries, self.client_unusable()), [h.name for h in batch])

    def _round_result(self, started, what: str = "the agreement round"):
        return self._round_result_within(started, self.config.timeout, what)

    def _round_result_within(self, started, seconds: float, what: str = "the agreement round"):
        try:
            return agreement.Rounds.wait(started, seconds)
        except agreement.RoundError as e:     # names the round, its allreduces, the ranks missing
            raise self.M.HorovodInternalError(f"{e} (waiting for {what}, up to {seconds:g} s)") from None

    def _decide(self, batch, started):
        """Wait for the batch's agreement round (``started``: its handle): (the handles decided now, {name: why
        it goes to Horovod's allreduce}, the agreement)."""
        t0, cpu = time.perf_counter(), time.thread_time()
        total = self._round_result(started, "the agreement round")
        self.seconds["agreement_wait"] += time.perf_counter() - t0
        self.seconds["agreement_cpu"] += time.thread_time() - cpu
        ag = agreement.read(total)
        self.rounds += 1
        batch = sorted(batch, key=lambda h: (h.name, h.seq))
        if ag.present < self.M.size():     # a rank has joined: Horovod's allreduce, joined ranks add zeros
            return batch, {h.name: "a rank has joined (hvd.join)" for h in batch}, ag
        if ag.agree:
            return batch, {}, ag
        return (*self._reconcile(batch), ag)

    def _run_round(self, ready, native, ag) -> None:
        """The decided handles: through Horovod's allreduce (``native`` and what the switch cannot take), the
        rest through the switch."""
        if ag.unusable:
            native.update({h.name: "a rank's switch client failed earlier" for h in ready if h.name not in native})
        for h in ready:
            why = native.get(h.name) or self.why_not(h)
            if why is None and ag.has_nonfinite(h.name):    # False at once when no rank flagged any
                why = "NaN/Inf on some rank (Gloo propagates them)"
            if why is not None:
                native[h.name] = why
        t1 = time.perf_counter()
        self._run_native([h for h in ready if h.name in native], native)
        t2 = time.perf_counter()
        self._run_switch([h for h in ready if h.name not in native])
        self.seconds["native"] += t2 - t1
        self.seconds["switch"] += time.perf_counter() - t2

    def _run_switch(self, handles) -> None:
        """Offloadable allreduces through the switch, fused in name order into buffers of one dtype/op/scale."""
        import torch  # noqa: PLC0415

        if not handles:
            return
        groups = fusion.buffers(handles, fusion.fusion_threshold())
        try:
            self.connect()
            with torch.no_grad():
                for g in groups:
                    self._fused_allreduce(g)
        except Exception as e:
            self.switch_failed = self.switch_failed or isinstance(e, AllreduceError)
            log.error("[ina horovod rank %d] allreduce through switch %s:%d (job %s) failed: %s", self.rank,
                      *self.config.switch, self.job, e)
            for h in handles:      # each raises from its synchronize; the next rounds go through Gloo
                if not h.done:
                    h.error = e

    def _fused_allreduce(self, group) -> None:
        self.seconds["client_cpu"] += fusion.allreduce_buffer(self.client, self.config.codec, group,
                                                              average=group[0].op == self.M.Average)
        for h in group:
            h.done = True
        self.fallbacks.offloaded(sum(len(h.tensors) for h in group),
                                 sum(t.numel() for h in group for t in h.tensors), calls=len(group))

    def synchronize(self, handle):
        if isinstance(handle, InaHandle):
            if handle.consumed:        # Horovod: a handle already synchronized returns None
                return None
            if not handle.done and handle.error is None:
                self.complete(handle)
            handle.consumed = True
            if handle.error is not None:
                e = handle.error
                raise e if isinstance(e, (ValueError, NotImplementedError, self.M.HorovodInternalError)) \
                    else self.M.HorovodInternalError(e)
            return handle.result()
        try:        # a Horovod handle (broadcast, allgather, ...): wait by polling, not in Horovod's yield loop
            self.wait_user_op(handle)
        except (RuntimeError, ValueError, TypeError):   # not a live Horovod handle: its synchronize answers
            pass
        return self.orig["synchronize"](handle)

    def poll(self, handle) -> bool:
        """The allreduce runs in the background: a poll starts it if it was not in a bucket yet (Horovod's
        next cycle) and says whether it has finished."""
        if isinstance(handle, InaHandle):
            with self.lock:
                if handle.name in self.open_names() and self.active.get(handle.name) is handle:
                    self._seal()
            return handle.done or handle.error is not None or handle.consumed
        return self.orig["poll"](handle)

    def join(self, device=-1) -> int:
        """``hvd.join()``: this rank's allreduces finish first; then Horovod's join runs (in a thread: the other
        ranks' allreduces get zeros from this rank there) while this rank takes part in the other ranks'
        agreement rounds as absent (their batches then go to Horovod's allreduce), until a round shows every
        rank absent: all have joined."""
        if self.channel is None:
            return self.orig["join"](device)
        self.drain()
        out: dict = {}

        def native():
            try:
                out["last"] = self.orig["join"](device)
            except BaseException as e:  # noqa: BLE001 - raised below, on the caller's thread
                out["error"] = e
        t = threading.Thread(target=native, name="ina-horovod-join", daemon=True)
        t.start()
        while True:
            with self.lock:
                started = self.channel.start(agreement.joined_vector())
            # a round waits for the other ranks' next bucket: up to a step of theirs, within Gloo's bound
            if agreement.read(self._round_result_within(started, 3 * self.config.timeout)).present == 0:
                break
        t.join(self.config.timeout)
        if t.is_alive():
            raise self.M.HorovodInternalError(f"INA backend: Horovod's join did not return within "
                                              f"{self.config.timeout:g} s (INA_TIMEOUT) after every rank joined")
        if "error" in out:
            raise out["error"]
        return out["last"]

    def drain(self) -> None:
        """Seal what is queued and wait until the worker has run all of it (bounded)."""
        with self.lock:
            self._wait_until(lambda: not self.active, lambda: (
                f"INA backend: join: the allreduces queued here did not complete within {2 * self.config.timeout:g} s "
                "(2 x INA_TIMEOUT): " + ", ".join(list(self.active)[:10])))

    def init(self, *args, **kwargs):
        quieter_background_cycle()
        out = self.orig["init"](*args, **kwargs)
        self.connect()
        return out

    def shutdown(self, *args, **kwargs):
        # Horovod's own shutdown first: ranks leave a barrier together and shut Gloo down at once; a delay
        # on one rank before it (leaving the switch) lets the other re-init and read a stale address
        out = self.orig["shutdown"](*args, **kwargs)
        self.disconnect()
        return out

    def stats(self) -> dict:
        d = self.fallbacks.counters.as_dict()
        d["job"] = self.job
        d["agreement_rounds"] = self.rounds
        d["agreement_rounds_given_up"] = self.channel.given_up if self.channel is not None else None
        # connections to rank 0's store opened again after a network error
        d["agreement_connections_reopened"] = self.channel.reopened if self.channel is not None else None
        d["seconds"] = dict(self.seconds)
        d["timeline"] = list(self.timeline)
        d["client"] = self.client.stats.as_dict() if self.client is not None else None
        # the keys holding an error-feedback residual (codecs that keep one: a fused tensor's name and position)
        d["residual_keys"] = [str(k) for k in self.client.codec(self.config.codec).residual_keys()] \
            if self.client is not None else []
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
               "init": (st.orig["init"], st.init), "shutdown": (st.orig["shutdown"], st.shutdown),
               "join": (st.orig["join"], st.join)}
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
