"""Top-k sparsification with error feedback: the sparsification reference (NOT switch-feasible).

Per tensor, with A = x + residual (the key's error-feedback buffer): send the k entries of largest
|A| (k = ``k``, or ceil(``ratio`` * n), at most n; zeros among them are not sent) with their
positions, keep the rest: residual = A - sent. Deterministic; biased per step, and error feedback
delivers every entry later (Stich et al., "Sparsified SGD with memory", 2018), so for every key
sum(inputs) = sum(decoded) + residual.

Message of ``compress`` (network byte order): u4 count | u1 position mode | positions (LEB128 gaps
or a bitmap, the smaller, as wgt) | count float32 values. The positions differ between workers and
the length varies, so an integer switch cannot sum it: it goes through the service's host
aggregator, which decodes every rank's message, sums, and re-encodes the sum with top-k (its own
residual per job and key), as for ``wgt``/``3lc``/``eaq``.
"""
from __future__ import annotations

import math

import numpy as np

from .base import HOST_AGGREGATED, Codec, Encoded, HostAggregated, from_numpy_like, to_numpy_f32
from .encoding import Reader, be_bytes, decode_positions, element_count, encode_positions, finite_max_abs
from .feedback import ErrorFeedbackMixin


class TopK(HostAggregated, ErrorFeedbackMixin, Codec):
    name = "topk"
    wire_id = 21
    unbiased = False
    stochastic = False
    description = ("top-k sparsification with error feedback: the k largest |x + residual| with their "
                   "positions, float32 [" + HOST_AGGREGATED + "]")

    def __init__(self, ratio: float = 0.01, k: int | None = None, error_feedback: bool = True,
                 seed: int | None = 0):
        super().__init__(seed)
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be a fraction in (0, 1], got {ratio}")
        if k is not None and (int(k) != k or k < 1):
            raise ValueError(f"k must be a positive integer (or None to use ratio), got {k}")
        self.ratio = float(ratio)
        self.k = None if k is None else int(k)
        self._init_feedback(error_feedback)

    @property
    def bits_per_element(self) -> float:
        return 32.0    # per sent value; positions extra

    def count(self, n: int) -> int:
        """How many entries a tensor of n elements sends (before dropping zeros)."""
        return min(n, self.k if self.k is not None else math.ceil(self.ratio * n))

    def compress(self, x, key=None) -> Encoded:
        acc = self._accumulate(to_numpy_f32(x), key)
        finite_max_abs(acc)
        n = acc.size
        k = self.count(n)
        idx = np.argpartition(np.abs(acc), n - k)[n - k:] if 0 < k < n else np.arange(k)
        idx = np.sort(idx[acc[idx] != 0])
        if self.error_feedback and key is not None:
            residual = acc.copy()
            residual[idx] = 0.0
            self._keep(key, residual)
        mode, pos = encode_positions(idx, n)
        values = np.frombuffer(acc[idx].astype(">f4").tobytes(), np.uint8)
        msg = np.concatenate([be_bytes("u4", idx.size), be_bytes("u1", mode), pos, values])
        return Encoded(self.name, msg, tuple(np.shape(x)), {}, like=x)

    def decompress(self, enc: Encoded):
        n = element_count(enc.shape)
        rd = Reader(enc.codes, self.name)
        k = int(rd.scalar("u4", "count"))
        if k > n:
            raise ValueError(f"{self.name} message claims {k} sent values for a tensor of {n}")
        mode = int(rd.scalar("u1", "position mode"))
        idx = decode_positions(rd, mode, k, n)
        out = np.zeros(n, np.float32)
        out[idx] = np.frombuffer(rd.take(4 * k, "values").tobytes(), ">f4")
        rd.done()
        return from_numpy_like(out, enc.like, enc.shape)


__all__ = ["TopK"]
