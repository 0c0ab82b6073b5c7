"""Error feedback of the stateful codecs (3LC, thresholded transfer, entropy-adaptive Huffman).

:class:`ResidualStore` keeps one float32 residual ("error accumulation buffer", 3LC; "residual",
thresholded transfer) per key. A stateful codec adds the residual of ``key`` to its input, encodes
the sum, and keeps ``sum - decoded`` for the next step, where ``decoded`` is bit for bit what the
receiver reconstructs. So for every key, after any number of steps,
``sum(inputs) == sum(decoded) + residual`` (up to float32 rounding of the additions).
A call without a key (``key=None``) is stateless: no buffer is read or written.
"""
from __future__ import annotations

import threading
from typing import Hashable

import numpy as np


class ResidualStore:
    """Per-key float32 residuals (error accumulation buffers) of a stateful codec.

    ``key`` names a tensor (e.g. a parameter name, or ``(name, chunk)`` on a chunked path); its
    residual has that tensor's number of elements. Feeding a key a tensor of another size raises
    instead of mixing two tensors' errors.
    """

    def __init__(self):
        self._buf: dict[Hashable, np.ndarray] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, n: int) -> np.ndarray | None:
        with self._lock:
            r = self._buf.get(key)
        if r is not None and r.size != n:
            raise ValueError(f"error-feedback key {key!r} holds a residual of {r.size} elements but this "
                             f"tensor has {n}; use one key per tensor (or reset({key!r}))")
        return r

    def put(self, key: Hashable, r: np.ndarray) -> None:
        with self._lock:
            self._buf[key] = r

    def residual(self, key: Hashable = None) -> np.ndarray | None:
        """A copy of the residual of ``key`` (None if the key has not been used)."""
        with self._lock:
            r = self._buf.get(key)
        return None if r is None else r.copy()

    def reset(self, key: Hashable = ...) -> None:
        """Forget the residual of ``key``, or of every key when called without one."""
        with self._lock:
            if key is ...:
                self._buf.clear()
            else:
                self._buf.pop(key, None)

    def keys(self) -> list:
        with self._lock:
            return list(self._buf)

    def __len__(self) -> int:
        return len(self._buf)


class ErrorFeedbackMixin:
    """Gives a codec ``keeps_residuals = True`` (:class:`~ina.compression.base.Codec` declares it),
    ``error_feedback`` (bool), ``residual(key)``, ``residual_keys()`` and ``reset(key)``.

    Error feedback needs a ``key`` naming the tensor: a call with ``key=None`` is stateless (no
    residual added or kept), so that two tensors can never share a buffer by accident. Subclasses
    call :meth:`_accumulate` to get ``x + residual`` and :meth:`_keep` with ``acc - decoded``.
    """

    keeps_residuals = True
    error_feedback: bool = False

    def _init_feedback(self, error_feedback: bool) -> None:
        self.error_feedback = bool(error_feedback)
        self._residuals = ResidualStore()

    def _accumulate(self, x32: np.ndarray, key) -> np.ndarray:
        if not self.error_feedback or key is None:
            return x32
        r = self._residuals.get(key, x32.size)
        return x32 if r is None else x32 + r

    def _keep(self, key, residual: np.ndarray) -> None:
        if self.error_feedback and key is not None:
            self._residuals.put(key, np.ascontiguousarray(residual, dtype=np.float32))

    def residual(self, key=None) -> np.ndarray | None:
        """The error-accumulation buffer of ``key`` (a copy; None before the key's first use)."""
        return self._residuals.residual(key)

    def residual_keys(self) -> list:
        """The keys that hold a residual."""
        return self._residuals.keys()

    def reset(self, key=...) -> None:
        """Drop the residual of ``key`` (all keys when called without one)."""
        self._residuals.reset(key)


