"""General dithering (seed 004, Definition 3): natural dithering and standard random dithering.

y_i = |x_i| / ||x||_p lies in [0, 1] and is rounded, unbiased, to one of the two neighbouring levels:
* natural dithering ("nd"): levels 0, 2**(1-s), ..., 1/2, 1 (a binary geometric partition);
* standard random dithering ("rd", QSGD-like): levels 0, 1/s, 2/s, ..., 1.
A code is the signed level index (int8); the message also carries the norm (one float32).

On the switch path every worker must use the same scale, so the norm is replaced by a shared
power of two 2**E >= every worker's ||x||_p (E negotiated by max, like the exponent of natural
compression). The operator stays unbiased; its variance can only grow (the norm is larger).
Natural-dithering codes then are exactly natural-compression codes with an exponent window of s
levels, so the switch sums them with the same shift; standard-dithering codes are linear integers
that the switch adds as they are.
"""
from __future__ import annotations

import math

import numpy as np

from ina.wire import PayloadType

from . import kernels as K
from .base import Codec, Encoded, ScaleContext, from_numpy_like, max_exponent, native, to_numpy_f32


def p_norm(x32: np.ndarray, p: float) -> float:
    if math.isinf(p):
        return float(np.max(np.abs(x32))) if x32.size else 0.0
    if p == 1:
        return K.sum_abs(x32)
    if p == 2:
        return math.sqrt(K.sum_squares(x32))
    return float(np.linalg.norm(x32.astype(np.float64), ord=p))


class _Dithering(Codec):
    natural: bool
    stochastic = True
    unbiased = True

    def __init__(self, levels: int = 8, p: float = 2.0, seed: int | None = 0):
        super().__init__(seed)
        if not 1 <= levels <= 127:
            raise ValueError(f"levels must be in 1..127, got {levels}")
        if not (p >= 1):
            raise ValueError(f"p must be >= 1 (a norm), got {p}")
        self.levels = int(levels)
        self.p = float(p)

    @property
    def bits_per_element(self) -> float:
        return 8.0   # int8 codes on the wire (information content: 1 + log2(s + 1) bits)

    def max_abs_code(self, ctx: ScaleContext) -> int:
        return self.levels                     # int8 level indices -s..s (rd, qsgd)

    def _levels_encode(self, x32, inv_norm, seed):
        out = np.empty(x32.size, np.int8)
        K.dither_encode(x32, inv_norm, self.levels, self.natural, seed, out)
        return out

    def compress(self, x) -> Encoded:
        x32 = to_numpy_f32(x)
        max_exponent(x32)  # raises on NaN/Inf
        norm = np.float32(p_norm(x32, self.p))
        inv = 0.0 if norm == 0 else 1.0 / float(norm)
        codes = self._levels_encode(x32, inv, self.next_seed())
        return Encoded(self.name, codes, tuple(np.shape(x)), {"norm": float(norm)}, like=x)

    def decompress(self, enc: Encoded):
        out = np.empty(enc.codes.size, np.float32)
        K.dither_decode(enc.codes, enc.meta["norm"], self.levels, self.natural, out)
        return from_numpy_like(out, enc.like, enc.shape)

    # switch path: shared power-of-two norm bound 2**E
    def scale_exponent(self, x32: np.ndarray) -> int:
        max_exponent(x32)
        norm = p_norm(x32, self.p)
        return -126 if norm == 0 else math.frexp(norm)[1]   # 2**E > norm

    def encode_shared(self, x32, ctx: ScaleContext) -> np.ndarray:
        max_exponent(x32)
        return self._levels_encode(x32, 2.0 ** -ctx.exponent, ctx.seed)


class NaturalDithering(_Dithering):
    name = "nd"
    wire_id = 4
    payload_type = PayloadType.NC8
    switch_summable = True
    natural = True
    description = "natural dithering: levels 2**-j of a p-norm, sign + level index"

    def encode_shared(self, x32, ctx: ScaleContext) -> np.ndarray:
        max_exponent(x32)
        # level j (value 2**(j - s) * 2**E) is NC code k = j with e_low = E - s + 1
        out = np.empty(x32.size, np.uint8)
        K.dither_encode(x32, 2.0 ** -ctx.exponent, self.levels, True, ctx.seed, out, True)
        return out

    def decode_sum(self, payload, ctx: ScaleContext, raw: bool) -> np.ndarray:
        e_low = ctx.exponent - self.levels + 1
        if raw:
            return (payload.astype(np.float64) * 2.0 ** e_low).astype(np.float32)
        out = np.empty(payload.size, np.float32)
        K.nc_decode(np.ascontiguousarray(payload, dtype=np.uint8), e_low, out)
        return out


class RandomDithering(_Dithering):
    name = "rd"
    wire_id = 5
    payload_type = PayloadType.INT8
    switch_summable = True
    natural = False
    description = "standard random dithering (QSGD-like): uniform levels k/s of a p-norm"

    def decode_sum(self, payload, ctx: ScaleContext, raw: bool = True) -> np.ndarray:
        out = np.empty(np.size(payload), np.float32)
        K.int_sum_decode(native(payload).reshape(-1), 2.0 ** ctx.exponent / self.levels, out)
        return out
