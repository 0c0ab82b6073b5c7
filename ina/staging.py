"""Host staging of tensors for the allreduce client: any device in, the result back on that device.

The switch path encodes from a flat float32 host array and decodes into one. :func:`to_host` gives
that array for a numpy array or torch tensor on any device; :func:`write_back` puts the result
into the original tensor, keeping its device, dtype, shape and strides.

* numpy arrays and CPU float32 contiguous tensors: a view, no copy;
* other CPU tensors (float16, bfloat16, float64, strided): one conversion copy;
* CUDA tensors (any device that is not the CPU): copied device-to-host into a **pinned** host buffer
  (page-locked, so the copy is a DMA that can run asynchronously), after the work already queued on
  the tensor's current stream (a thread that stages another thread's tensors first waits for the
  events that thread recorded: :func:`record_ready`, :func:`wait_ready`);
  the result goes back host-to-device from the same pinned buffer on the tensor's current stream, so
  later kernels on that stream see it. One buffer per thread and device kind, grown on demand and
  reused: pinning memory is expensive. Before the buffer is refilled, the previous host-to-device copy
  out of it is waited for.

Low precision (float16/bfloat16) device tensors are converted to float32 on the device before the
copy. :func:`future_for` makes a ``torch.futures.Future`` that may carry CUDA tensors (a plain one
refuses them).
"""
from __future__ import annotations

import threading

import numpy as np


def _torch():
    import torch
    return torch


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def on_device(x) -> bool:
    """True for a torch tensor that lives outside host memory (CUDA, ...)."""
    return is_torch(x) and x.device.type != "cpu"


class HostStaging:
    """Flat float32 host arrays for tensors, through a reused (pinned, where CUDA exists) host buffer.

    ``stage_cpu=True`` sends CPU tensors through the buffer too (what a CUDA tensor gets, minus the
    pinning and the streams), so the staging logic can be exercised on a machine without a GPU.
    """

    def __init__(self, pin: bool | None = None, stage_cpu: bool = False):
        self.pin = pin
        self.stage_cpu = stage_cpu
        self._buf = None          # torch float32 CPU tensor (pinned when self.pin)
        self._pending = None      # event of the last host-to-device copy out of the buffer
        self.allocations = 0      # how often a buffer was (re)allocated: a counter for tests and stats
        self.staged = 0           # tensors that went through the buffer

    @property
    def capacity(self) -> int:
        """Elements the host buffer holds now (0 before the first staged tensor)."""
        return 0 if self._buf is None else self._buf.numel()

    @property
    def pinned(self) -> bool:
        return self._buf is not None and self._buf.is_pinned()

    def _staged(self, x) -> bool:
        return is_torch(x) and (x.device.type != "cpu" or self.stage_cpu)

    def _buffer(self, n: int):
        torch = _torch()
        self._wait_pending()
        if self._buf is None or self._buf.numel() < n:
            pin = self.pin if self.pin is not None else torch.cuda.is_available()
            cap = max(n, 2 * (self._buf.numel() if self._buf is not None else 0))
            self._buf = torch.empty(cap, dtype=torch.float32, pin_memory=bool(pin))
            self.allocations += 1
        return self._buf[:n]

    def _wait_pending(self) -> None:
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None

    def to_host(self, x) -> np.ndarray:
        """A flat float32 numpy array with the values of ``x`` (see the module's docstring)."""
        if not self._staged(x):
            from .compression.base import to_numpy_f32
            return to_numpy_f32(x)
        torch = _torch()
        src = x.detach().reshape(-1)
        if src.dtype != torch.float32:
            src = src.to(torch.float32)            # on the device: the copy moves 4 bytes per value
        buf = self._buffer(src.numel())
        if x.device.type == "cuda":
            stream = torch.cuda.current_stream(x.device)
            with torch.cuda.stream(stream):
                buf.copy_(src, non_blocking=True)
            stream.synchronize()                   # the host reads it next
        else:
            buf.copy_(src)
        self.staged += 1
        return buf.numpy()

    def write_back(self, x, out: np.ndarray) -> None:
        """Copy the flat float32 result ``out`` into ``x`` in place (its device, dtype, shape, strides)."""
        if not self._staged(x):
            from .compression.base import write_back
            write_back(x, out)
            return
        torch = _torch()
        buf = self._buffer(out.size)
        if buf.numpy().ctypes.data != out.ctypes.data:
            buf.numpy()[...] = out.reshape(-1)
        src = buf.view(x.shape)
        with torch.no_grad():
            if x.device.type == "cuda":
                stream = torch.cuda.current_stream(x.device)
                with torch.cuda.stream(stream):
                    x.copy_(src, non_blocking=True)      # converts to x's dtype on the device
                    ev = torch.cuda.Event()
                    ev.record(stream)
                self._pending = ev                       # the buffer is refilled only after this copy
            else:
                x.copy_(src)


_local = threading.local()


def staging() -> HostStaging:
    """This thread's staging (one pinned buffer per thread: concurrent clients do not share it)."""
    s = getattr(_local, "staging", None)
    if s is None:
        s = _local.staging = HostStaging()
    return s


def use(s: HostStaging) -> None:
    """Make ``s`` this thread's staging (e.g. ``HostStaging(stage_cpu=True)`` to exercise it without a GPU)."""
    _local.staging = s


def to_host(x) -> np.ndarray:
    return staging().to_host(x)


def write_back(x, out: np.ndarray) -> None:
    staging().write_back(x, out)


def record_ready(tensors) -> list:
    """In the thread that produced ``tensors``: events on its current CUDA streams, so that another
    thread's staging copies them only after the work queued so far (empty without CUDA tensors)."""
    devs = {t.device for t in tensors if is_torch(t) and t.device.type == "cuda"}
    if not devs:
        return []
    torch = _torch()
    evs = []
    for d in devs:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(d))
        evs.append(ev)
    return evs


def wait_ready(events) -> None:
    """Block until the work behind :func:`record_ready`'s events is done."""
    for ev in events:
        ev.synchronize()


def handoff(tensors):
    """For a thread that allreduces another thread's tensors: (the future to complete with them,
    the events to wait for before reading them)."""
    return future_for(tensors), record_ready(tensors)


def future_for(tensors):
    """A ``torch.futures.Future`` that may complete with these tensors (CUDA-aware for CUDA devices)."""
    torch = _torch()
    devs = sorted({str(t.device) for t in tensors if on_device(t)})
    return torch.futures.Future(devices=devs) if devs else torch.futures.Future()
