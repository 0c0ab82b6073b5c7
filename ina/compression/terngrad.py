"""TernGrad (Wen et al., NeurIPS 2017): stochastic ternarization with a per-tensor scaler.

    s = max |g|;  b_i ~ Bernoulli(|g_i| / s);  sent: sign(g_i) * b_i in {-1, 0, 1};  decoded: s * code.

Unbiased (E[s * code] = g) with per-element variance |g_i| (s - |g_i|) <= s**2 / 4. TernGrad's
optional gradient clipping (``clip=c``: |g| clipped to c standard deviations of the tensor first; the
paper uses c = 2.5) shrinks s and the variance but makes the operator biased; it is off by default.

Message of ``compress``: f4 s | 2-bit codes, MSB first (0 = 0, 1 = +1, 2 = -1): 2 bits per value as
in the paper (3LC's quartic encoding would need 1.6).

Switch path ("scaler sharing", the paper's Section 3.2): the workers share s = max over workers of
their max |g|, negotiated as a Q8.8 log2 exponent (<= 0.27 % above the true max, see encoding.py); each
ternarizes against the shared s (still unbiased) and sends int8 codes that the switch adds; the sum
decodes as s * sum(codes).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ina.wire import PayloadType

from .base import Codec, Encoded, ScaleContext, from_numpy_like, to_numpy_f32
from .encoding import (Reader, be_bytes, element_count, finite_max_abs, log_scale, log_scale_exponent, pack_bits,
                       packed_size, unpack_bits)
from .kernels import uniform01


@njit(cache=True)
def _ternarize(x, s, seed, out):
    inv = 1.0 / s if s > 0 else 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        b = 1 if uniform01(i, seed) < abs(v) * inv else 0
        out[i] = np.int8(-b if v < 0 else b)


class TernGrad(Codec):
    name = "terngrad"
    wire_id = 18
    payload_type = PayloadType.INT8
    switch_summable = True
    variable_length = False
    aggregation = "switch"
    label = "switch-feasible: ternary codes with a shared scaler summed as int8"
    unbiased = True
    stochastic = True
    description = "TernGrad: stochastic ternary {-1, 0, 1} times the tensor's max |g| (2 bits/value; shared max on the switch)"

    def __init__(self, clip: float | None = None, seed: int | None = 0):
        super().__init__(seed)
        if clip is not None and not clip > 0:
            raise ValueError(f"clip must be a positive number of standard deviations (or None), got {clip}")
        self.clip = None if clip is None else float(clip)
        self.unbiased = clip is None

    @property
    def bits_per_element(self) -> float:
        return 8.0   # int8 on the switch wire; compress() packs 2 bits per value

    def _clipped(self, x32: np.ndarray) -> np.ndarray:
        finite_max_abs(x32)
        if self.clip is None or x32.size == 0:
            return x32
        c = self.clip * float(np.std(x32, dtype=np.float64))
        return np.clip(x32, -c, c).astype(np.float32)

    def compress(self, x) -> Encoded:
        g = self._clipped(to_numpy_f32(x))
        s = np.float32(finite_max_abs(g))
        codes = np.empty(g.size, np.int8)
        _ternarize(g, float(s), self.next_seed(), codes)
        two_bit = np.where(codes < 0, 2, codes).astype(np.uint16)
        msg = np.concatenate([be_bytes("f4", s), pack_bits(two_bit, 2)])
        return Encoded(self.name, msg, tuple(np.shape(x)), {}, like=x)

    def decompress(self, enc: Encoded):
        n = element_count(enc.shape)
        rd = Reader(enc.codes, self.name)
        s = np.float32(rd.scalar("f4", "scaler"))
        c = unpack_bits(rd.take(packed_size(n, 2), "codes"), 2, n)
        rd.done()
        if n and c.max() > 2:
            raise ValueError(f"{self.name} message holds the 2-bit code 3 (valid: 0, 1 = +1, 2 = -1)")
        out = np.where(c == 2, -s, np.where(c == 1, s, np.float32(0))).astype(np.float32)
        return from_numpy_like(out, enc.like, enc.shape)

    # switch path: scaler sharing
    def scale_exponent(self, x32: np.ndarray) -> int:
        return log_scale_exponent(finite_max_abs(self._clipped(x32)))

    def max_abs_code(self, ctx: ScaleContext) -> int:
        return 1                               # ternary

    def encode_shared(self, x32: np.ndarray, ctx: ScaleContext) -> np.ndarray:
        g = self._clipped(x32)
        s = log_scale(ctx.exponent)
        m = finite_max_abs(g)
        if m > s:
            raise ValueError(f"max |g| = {m:g} exceeds the shared scaler {s:g}: the negotiated exponent is "
                             "smaller than this tensor's")
        out = np.empty(g.size, np.int8)
        _ternarize(g, s, ctx.seed, out)
        return out

    def decode_sum(self, payload: np.ndarray, ctx: ScaleContext, raw: bool = True) -> np.ndarray:
        return (np.asarray(payload).astype(np.float64) * log_scale(ctx.exponent)).astype(np.float32)


__all__ = ["TernGrad"]
