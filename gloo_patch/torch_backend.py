"""An INA process group for ``torch.distributed``, and a DDP communication hook.

Backend ``ina`` (registered on import)::

    import gloo_patch.torch_backend            # registers the backend
    dist.init_process_group("ina")             # INA_SWITCH=host:port in the environment

:class:`InaProcessGroup` is a Python ``dist.ProcessGroup``. Its ``allreduce`` (and
``allreduce_coalesced``) of float32/float16/bfloat16 tensors with SUM or AVG goes through the switch
(``ina.Client``); every other collective goes to an inner ``ProcessGroupGloo`` made on the same store:
the inner group is registered as this group's CPU backend, so broadcast, allgather, reduce, gather,
scatter, all-to-all, reduce-scatter, barrier and send/recv reach Gloo through PyTorch's own dispatch
(the Python counterpart of the patched ProcessGroupGloo SwitchML shipped for PyTorch 1.7; no rebuild).
An allreduce that cannot be offloaded (MIN/MAX/PRODUCT/bitwise/PREMUL_SUM, integer or float64 tensors,
sparse tensors) goes to the inner Gloo group, with one log line per distinct reason. Codecs with error
feedback (3lc-3v, bgt, qgt) run without it here (no key; see ``warn_if_error_feedback_off``): use the hook.

DDP communication hook, for users who keep the ``gloo`` backend::

    from gloo_patch.torch_backend import InaHookState, ina_allreduce_hook
    model = DDP(model)
    model.register_comm_hook(InaHookState(), ina_allreduce_hook)   # all ranks, before the first backward

Switch allreduces run on one worker thread per client, in the order they were issued (which is the
same on every rank: DDP issues its buckets in order), so backward keeps computing while a bucket is in
flight. Every wait is bounded by ``INA_TIMEOUT``: a dead switch raises ``ina.AllreduceError`` on
every rank instead of hanging.
"""

import collections
import datetime
import queue
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from ina import compression, staging

from . import agreement
from .common import FallbackLog, InaConfig, log, new_job_id, per_parameter, tensors_not_offloadable

BACKEND_NAME = "ina"
_BT = dist.ProcessGroup.BackendType
_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
_OP_NAMES = {getattr(dist.ReduceOp, n): n for n in _OPS}
_AVG = _OPS.index("AVG")
NONFINITE = "NaN/Inf on some rank (Gloo propagates them)"
CLIENT_FAILED = "a rank's switch client failed earlier"


class _InaWork(dist.Work):
    """A Work whose ``wait()`` raises the switch's error (a future-wrapping Work would swallow it)."""

    def __init__(self, fut: torch.futures.Future):
        super().__init__()
        self._fut = fut

    def wait(self, timeout=None) -> bool:
        self._fut.wait()    # raises AllreduceError's message as RuntimeError if the allreduce failed
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and not self._failed()

    def _failed(self) -> bool:
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001
            return True
        return False


def _op_name(op) -> str:
    for k, name in _OP_NAMES.items():
        try:
            if op == k:
                return name
        except TypeError:
            pass
    return str(op)


def agree(gather, tensors, op_name: str, unusable: bool, what: str) -> str | None:
    """One all_gather of a row per rank (``gloo_patch.agreement``) before an allreduce: raises RuntimeError
    on every rank if the ranks disagree (shapes, dtypes, op); else why every rank must take Gloo for this
    one (NaN/Inf on some rank, a failed client somewhere), or None. ``gather(out, mine)`` all-gathers."""
    return judged(gather(agreement.row(tensors, _OPS.index(op_name) if op_name in _OPS else len(_OPS), unusable)),
                  what)


def judged(rows, what: str) -> str | None:
    """What :func:`agree` decides from every rank's row."""
    err, nonfinite, failed = agreement.judge(rows, dict(enumerate(_OPS)))
    if err is not None:
        raise RuntimeError(f"{what}: {err}")
    return NONFINITE if nonfinite else CLIENT_FAILED if failed else None


class _Lane:
    """One INA client and the worker thread that feeds it, in submission order."""

    def __init__(self, config: InaConfig, rank: int, size: int, job: int):
        from ina import Client  # noqa: PLC0415 - import cost only when used

        self.config, self.rank, self.size, self.job = config, rank, size, job
        self.client = Client(switch=config.switch, rank=rank, world_size=size, job=job, **config.client_kwargs())
        self._q: queue.SimpleQueue = queue.SimpleQueue()     # the hand-off to the lane: no Condition per item
        self._error: BaseException | None = None
        # (submitted, started, finished, lane CPU s, codec CPU s, decided) of the last allreduces,
        # time.perf_counter(): how much of the switch time ran while the caller still computed (DDP: backward), see
        # timeline(); the codec's encode+decode time only with ``client.record_timeline`` on, else 0; decided: when
        # the agreement had decided (the switch's part is decided..finished); with ``client.record_timeline`` also
        # when the client's first allreduce of the item began and when its exponent negotiation was back
        self.timeline: collections.deque = collections.deque(maxlen=4096)
        self._t = threading.Thread(target=self._run, name=f"ina-lane-r{rank}-j{job}", daemon=True)
        self._t.start()

    def submit(self, tensors: list[torch.Tensor], average: bool, result, key=None,
               decide: Callable[[], bool] | None = None) -> torch.futures.Future:
        """Queue an allreduce of ``tensors``; ``key`` names them for codecs with error feedback (a
        residual per (key, i)); without one such codecs are stateless. ``decide()``, if given, runs on the
        lane first (the agreement, off the caller's thread): True if it did the allreduce another way
        (Gloo), False to go through the switch; what it raises reaches the future, the lane stays usable."""
        fut, ready = staging.handoff(tensors)     # CUDA: a CUDA-aware future, events of the caller's streams
        self._q.put((tensors, average, result, fut, key, ready, time.perf_counter(), decide))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            self._one(*item)

    def _one(self, tensors, average, result, fut, key, ready, submitted, decide) -> None:
        """One queued allreduce: the agreement's decision, then the switch (or what ``decide`` did)."""
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            staging.wait_ready(ready)     # CUDA: the caller's streams wrote the tensors (Gloo or switch reads them)
            if decide is not None and decide():
                fut.set_result(result)
                return
        except BaseException as e:  # noqa: BLE001 - a disagreement or a Gloo error: this allreduce only
            # without its traceback: the future (which gc cannot look into) would keep its frames, whose hook
            # closures keep the process group (and Gloo's threads) alive; the message names what went wrong
            fut.set_exception(e.with_traceback(None))
            return
        decided = time.perf_counter()
        if self._error is not None:
            fut.set_exception(self._error)
            return
        try:
            codec_s, marks = 0.0, ()
            with torch.no_grad():
                for i, t in enumerate(tensors):
                    self.client.allreduce(t, codec=self.config.codec, average=average,
                                          key=None if key is None else (key, i))
                    tl = self.client.last_timeline if self.client.record_timeline else None
                    codec_s += tl["encode_s"] + tl["decode_s"] if tl else 0.0
                    if i == 0:      # the first allreduce's start and the end of its exponent negotiation
                        marks = (tl["t0"], tl["t0"] + tl.get("negotiated", 0.0)) if tl else ()
            self.timeline.append((submitted, started, time.perf_counter(), time.thread_time() - cpu, codec_s, decided,
                                  *marks))
            fut.set_result(result)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting rank
            self._error = e
            log.error("[ina rank %d] allreduce through switch %s:%d failed, job %d: %s", self.rank,
                      *self.config.switch, self.job, e)
            fut.set_exception(e.with_traceback(None))     # (without its frames: see above)

    def unusable(self) -> bool:
        return self._error is not None

    def close(self) -> None:
        self._q.put(None)
        self._t.join(timeout=self.config.timeout)
        try:
            self.client.close()
        except Exception as e:  # noqa: BLE001 - leaving is best effort at shutdown
            log.warning("[ina rank %d] leaving job %d: %s", self.rank, self.job, e)


def _agree_job_via_store(store, rank: int, config: InaConfig) -> int:
    if config.job is not None:
        return config.job
    key = "ina/job"
    if rank == 0:
        job = new_job_id()
        store.set(key, str(job))
        return job
    return int(store.get(key).decode())   # bounded by the store's timeout


# Which allreduces of an error-feedback codec (``Codec.keeps_residuals``: 3lc-3v, bgt, qgt) share a residual.
# The rule, in one place:
# * DDP comm hook: one residual per parameter of a bucket, keyed by the bucket's index and its parameters'
#   shapes plus the parameter's position in the bucket (``ina_allreduce_hook``), so DDP's rebuild of its
#   buckets after the first iteration starts new residuals. Each parameter is its own allreduce with its own
#   negotiated scale (3LC's per-tensor compression context); codecs without residuals send the whole bucket.
# * Horovod: one residual per fused buffer, keyed by its tensors' names (``gloo_patch.horovod``).
# * Backend 'ina' (``InaProcessGroup.allreduce``): NO key, so no error feedback. A process group sees tensors,
#   not parameters: DDP's reducer hands it bucket buffers that it reallocates when it rebuilds the buckets,
#   a plain ``dist.all_reduce`` loop may hand it freshly allocated gradients every step (``zero_grad()``
#   sets them to None), tensors of one shape and dtype may carry different parameters, and nothing marks
#   where a step begins. A key made of (shape, dtype, position in the sequence of calls) or of the storage
#   address would then hand one tensor's residual to another (a biased sum) or grow without bound, silently;
#   so the group keys nothing, and says so once per codec.
_NO_FEEDBACK_WARNED: set[str] = set()


def warn_if_error_feedback_off(codec: str, rank: int) -> bool:
    """True if ``codec`` keeps error-feedback residuals, which backend 'ina' does not apply; then (rank 0,
    once per codec per process) a warning saying so and naming the path that does."""

    if not compression.get(codec).keeps_residuals:
        return False
    if rank == 0 and codec not in _NO_FEEDBACK_WARNED:
        _NO_FEEDBACK_WARNED.add(codec)
        log.warning("[ina rank 0] backend 'ina' with codec %s: error feedback is OFF. %s keeps a residual per "
                    "tensor, but a process group cannot tell which tensor (or DDP bucket) an allreduce carries, "
                    "so every allreduce is encoded without its residual (3lc-3v's sums then have a large "
                    "deterministic error). For error feedback keep backend 'gloo' and register the DDP comm hook "
                    "(model.register_comm_hook(InaHookState(), ina_allreduce_hook)), which keys each bucket",
                    codec, codec)
    return True


class InaProcessGroup(dist.ProcessGroup):
    """``torch.distributed`` process group: allreduce through the INA switch, the rest through Gloo."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta | None = None,
                 config: InaConfig | None = None):
        super().__init__(rank, size)
        timeout = timeout or datetime.timedelta(minutes=30)
        self.config = config or InaConfig.from_env()
        # The inner Gloo group, registered as our CPU backend: every collective this class does not
        # override reaches it through PyTorch's dispatch. GLOO_SOCKET_IFNAME applies as usual.
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("ina-gloo/", store), rank, size, timeout)
        for dev in ("cpu", "cuda"):     # CUDA tensors: Gloo's CUDA paths; the switch stages them through host memory
            self._register_backend(torch.device(dev), _BT.GLOO, self.gloo)
        self._set_default_backend(_BT.GLOO)
        self.job = _agree_job_via_store(store, rank, self.config)
        self.fallbacks = FallbackLog(f"[ina rank {rank}] process group:", announce=rank == 0)
        self._lane = _Lane(self.config, rank, size, self.job)
        self.error_feedback = not warn_if_error_feedback_off(self.config.codec, rank)
        if rank == 0:
            log.info("[ina rank 0] torch.distributed backend 'ina': %d ranks, job %d, %s; allreduce of %s "
                     "with SUM/AVG goes through the switch, everything else through Gloo", size, self.job,
                     self.config.describe(), "/".join(("float32", "float16", "bfloat16")))

    # -- identity ---------------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - C++ virtual name
        return BACKEND_NAME

    def stats(self) -> dict:
        """Counters: what went through the switch, what fell back and why, the client's packet counters."""
        d = self.fallbacks.counters.as_dict()
        d["client"] = self._lane.client.stats.as_dict()
        d["job"] = self.job
        d["error_feedback"] = self.error_feedback
        return d

    def timeline(self) -> list[tuple]:
        """(submitted, started, finished, lane CPU s, codec CPU s, decided) of the last switch allreduces
        (``time.perf_counter()``)."""
        return list(self._lane.timeline)

    # -- allreduce --------------------------------------------------------------------------------
    def _why_not(self, tensors: list[torch.Tensor], op, what: str) -> str | None:
        """Agree with the other ranks on this allreduce (raises if they disagree), then: why it stays on
        Gloo, or None to offload it."""
        name = _op_name(op)
        shared = agree(self._gather, tensors, name, self._lane.unusable(), f"[ina rank {self.rank()}] {what}")
        if name not in ("SUM", "AVG"):
            return f"reduce op {name} (the switch only adds)"
        return tensors_not_offloadable(tensors) or shared

    def _gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.zeros_like(mine) for _ in range(self.size())]
        self.gloo.allgather([out], [mine]).wait()
        return out

    def _offload(self, tensors: list[torch.Tensor], op) -> dist.Work:
        self.fallbacks.offloaded(len(tensors), sum(t.numel() for t in tensors))
        fut = self._lane.submit(tensors, _op_name(op) == "AVG", tensors)
        return _InaWork(fut)

    def _gloo_allreduce(self, tensors: list[torch.Tensor], op, why: str, what: str) -> dist.Work:
        self.fallbacks.fallback(what, why, f"{len(tensors)} tensor(s), {tensors[0].dtype}, {tuple(tensors[0].shape)}"
                                if tensors else "")
        avg = _op_name(op) == "AVG"   # Gloo has no AVG: sum, then divide
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if avg else op
        work = self.gloo.allreduce(tensors, opts)
        if not avg:
            return work
        # Divide here, not in a .then() callback: a Python callback on a Gloo future runs (and is freed)
        # on Gloo's worker thread, which then needs the GIL while this group's C++ trampoline holds it
        # for the next collective's enqueue: a deadlock.
        work.wait()
        for t in tensors:
            t.div_(self.size())
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(tensors)
        return _InaWork(fut)

    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None:
            opts = dist.AllreduceOptions()
        elif not isinstance(opts, dist.AllreduceOptions):   # allreduce(tensors, op) overload
            op, opts = opts, dist.AllreduceOptions()
            opts.reduceOp = op
        why = self._why_not(tensors, opts.reduceOp, "allreduce")
        if why is None:
            return self._offload(list(tensors), opts.reduceOp)
        return self._gloo_allreduce(list(tensors), opts.reduceOp, why, "allreduce")

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        why = self._why_not(tensors, opts.reduceOp, "allreduce_coalesced")
        if why is None:
            return self._offload(list(tensors), opts.reduceOp)
        return self._gloo_allreduce(list(tensors), opts.reduceOp, why, "allreduce_coalesced")

    # -- lifetime ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        lane, self._lane = getattr(self, "_lane", None), None
        if lane is not None:
            lane.close()
        self._lane_closed = True

    def abort(self) -> None:
        self.shutdown()


# Every collective the switch does not serve is forwarded from Python straight to the inner Gloo group.
# Leaving them to PyTorch's dispatch through this Python class entered Gloo with the GIL held, and a
# Gloo worker thread that needed the GIL to finish the previous work then deadlocked the rank (seen in
# about 1 of 4 runs: both ranks stuck in barrier/all_to_all). The Gloo bindings release the GIL.
def _forward(name: str):
    def call(self, *args, **kwargs):
        return getattr(self.gloo, name)(*args, **kwargs)
    call.__name__ = name
    call.__doc__ = f"``{name}`` on the inner Gloo group."
    return call


for _name in ("broadcast", "allgather", "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced",
              "reduce", "gather", "scatter", "reduce_scatter", "_reduce_scatter_base",
              "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "barrier", "send", "recv",
              "recv_anysource", "monitored_barrier"):
    if hasattr(dist.ProcessGroupGloo, _name):
        setattr(InaProcessGroup, _name, _forward(_name))


def _create(store, rank: int, size: int, timeout) -> InaProcessGroup:
    return InaProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register backend ``ina`` with torch.distributed (idempotent; done on import)."""
    if BACKEND_NAME.lower() not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])


register()


# ---- DDP communication hook, for users on the gloo backend -------------------------------------------
class InaHookState:
    """State of :func:`ina_allreduce_hook`: one INA client per DDP process group.

    Create it on every rank before the first backward (the ranks agree on a job id through the
    process group, then join the switch). ``switch``/``codec``/``timeout`` override ``INA_*``.
    """

    def __init__(self, process_group=None, switch=None, codec: str | None = None, timeout: float | None = None):
        self.process_group = process_group or dist.distributed_c10d._get_default_group()
        self.config = InaConfig.from_env(switch=switch, codec=codec, timeout=timeout)
        self.rank, self.size = rank, size = self.process_group.rank(), self.process_group.size()
        self.per_parameter = per_parameter(self.config.codec)
        # the agreement rounds run on a store of their own (``agreement.Rounds``, as Horovod's: a round that
        # cannot complete raises on the rank that waited, and the next rounds pair up again): the hook starts one
        # per bucket without waiting (backward goes on), the lane waits for it; Gloo fallbacks run on the lane,
        # on a group of their own (:func:`_fallback_group`). Rank 0 sends the job id and the store's address through the process group.
        job, self.rounds = agreement.open_rounds(rank, size, self.config.timeout, self.config.switch[0],
                                                 self.config.job or new_job_id(), self._broadcast)
        self.fallbacks = FallbackLog(f"[ina rank {rank}] DDP comm hook:", announce=rank == 0)
        self.fallback_group = _fallback_group(self.process_group, rank)
        self.lane = _Lane(self.config, rank, size, job)
        if rank == 0:
            log.info("[ina rank 0] DDP comm hook: %d ranks, job %d, %s", size, job, self.config.describe())

    def agree_later(self, tensors, what: str, last: bool = False) -> Callable[[], str | None]:
        """Start this rank's agreement row for an allreduce (Average) of ``tensors`` on the agreement group,
        without waiting; the returned function waits (bounded by INA_TIMEOUT) and returns what :func:`agree`
        returns, or raises the same RuntimeError on every rank if the ranks disagree. ``last``: the step's last
        bucket by index (DDP's ``is_last``; backward may still compute input gradients or parameters outside
        DDP's buckets): the round's slot is claimed on this thread, now, not by the
        rounds' writer thread."""
        mine = agreement.row(tensors, _AVG, self.lane.unusable())
        size, n = self.size, mine.numel()
        table = torch.zeros(size * n, dtype=torch.int64)   # a Sum of one row per rank: an all_gather
        table[self.rank * n:(self.rank + 1) * n] = mine
        handle = self.rounds.start(table, here=last)

        def decided() -> str | None:
            try:
                rows = agreement.Rounds.wait(handle, self.config.timeout)
            except agreement.RoundError as e:    # names the round and the ranks missing; the next round works
                raise RuntimeError(f"{what}: {e}") from None
            return judged(list(rows.reshape(size, -1)), what)
        return decided

    def _broadcast(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        self.process_group.broadcast(t, 0).wait()
        return t.tolist()

    def stats(self) -> dict:
        d = self.fallbacks.counters.as_dict()
        d["client"] = self.lane.client.stats.as_dict()
        d["job"] = self.lane.job
        d["agreement_rounds_given_up"] = self.rounds.given_up
        d["agreement_connections_reopened"] = self.rounds.reopened   # after a network error
        return d

    def timeline(self) -> list[tuple]:
        """(submitted, started, finished, lane CPU s, codec CPU s, decided) of the last switch allreduces
        (``time.perf_counter()``)."""
        return list(self.lane.timeline)

    def close(self) -> None:
        self.lane.close()
        self.rounds.close()
        if self.fallback_group is not self.process_group:     # its Gloo threads and connections
            dist.destroy_process_group(self.fallback_group)
        self.fallback_group = None

    # DDP pickles hook state when it checkpoints; this state holds sockets and threads
    def __getstate__(self):
        raise TypeError("InaHookState holds a live switch connection and cannot be pickled")


def _fallback_group(process_group, rank: int):
    """The Gloo group the hook's fallbacks run on. They run on the lane, while backward's thread may issue DDP's
    own collectives on ``process_group`` (with ``find_unused_parameters``, the used-parameter map's allreduce
    after the last bucket): Gloo pairs a group's collectives by the order each rank issued them, so two threads
    sharing one group could pair one rank's bucket with the other's map. A group of its own keeps the orders
    apart. It waits as long as ``process_group`` would; :meth:`InaHookState.close` destroys it. ``new_group`` is
    collective over every process of the job: when ``process_group`` spans fewer (each subgroup's ranks create
    their hook state on their own), the fallbacks share it, with a warning."""
    if process_group.size() == dist.get_world_size():
        try:      # the hook's process group's timeout (new_group's default is torch's 30 minutes)
            timeout = process_group._get_backend(torch.device("cpu")).options._timeout
        except (AttributeError, RuntimeError):
            timeout = None
        return dist.new_group(backend="gloo", timeout=timeout)
    if rank == 0:
        log.warning("[ina rank 0] DDP comm hook: the process group spans %d of %d processes; Gloo fallbacks share "
                    "it with DDP's own collectives (with find_unused_parameters they may interleave)",
                    process_group.size(), dist.get_world_size())
    return process_group


def ina_allreduce_hook(state: InaHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: average the bucket's gradients through the switch (Gloo for non-offloadable dtypes, NaN/Inf).
    Returns at once: the agreement round and the allreduce run on the lane while backward goes on."""
    buf, index = bucket.buffer(), bucket.index()
    what = f"[ina rank {state.rank}] DDP bucket {index}"
    pending = state.agree_later([buf], what, last=bucket.is_last())

    def decide() -> bool:
        why = pending() or tensors_not_offloadable([buf])
        if why is None:
            state.fallbacks.offloaded(1, buf.numel())
            return False
        state.fallbacks.fallback("DDP bucket", why, f"bucket {index}")
        dist.all_reduce(buf, group=state.fallback_group)   # on the lane, on a group of its own (_fallback_group)
        buf.div_(state.size)
        return True

    if not state.per_parameter:     # the whole bucket, one allreduce, no residual (the key names it, unused)
        return state.lane.submit([buf], True, buf, key=f"ddp-bucket-{index}", decide=decide)
    # the residual of an error-feedback codec belongs to the bucket's parameters: DDP rebuilds its buckets
    # after the first iteration, so the index alone may name other parameters (or another size) later;
    # the parameters' shapes name the layout the same way on every rank (the host aggregator checks).
    # One compression context per parameter (views of the bucket), as 3LC keeps one per tensor: a scale
    # shared by the whole bucket (3lc-3v's M = max |g|) would round the gradients of every parameter smaller
    # than the largest one to 0 until their residual catches up
    params = bucket.parameters()
    layout = ",".join("x".join(map(str, p.shape)) for p in params)
    parts = list(buf.split([p.numel() for p in params]))
    return state.lane.submit(parts, True, buf, key=f"ddp-bucket-{index}:{layout}", decide=decide)


HookFn = Callable[[InaHookState, dist.GradBucket], torch.futures.Future]
__all__ = ["InaProcessGroup", "InaHookState", "ina_allreduce_hook", "register", "BACKEND_NAME"]
