"""Block floating point, SwitchML style: INA without compression.

The workers agree on e = max over workers of (floor(log2 max|x|) + 1), so every |x| < 2**e, and
scale by (2**31 - 1) / (n * 2**e): each int32 code is at most (2**31 - 1) / n in magnitude, so the
sum of n workers can never overflow an int32 register. Rounding is to nearest (half to even) in
float64, so a numpy reference of the same arithmetic is bit-identical.
"""
from __future__ import annotations

import numpy as np

from ina.wire import PayloadType

from . import kernels as K
from .base import Codec, Encoded, ScaleContext, from_numpy_like, max_exponent, native, to_numpy_f32

INT32_MAX = 2**31 - 1


def bfp_scale(exponent: int, n_workers: int) -> float:
    return INT32_MAX / (n_workers * 2.0 ** exponent)


class BlockFloatingPoint(Codec):
    name = "bfp32"
    wire_id = 3
    payload_type = PayloadType.INT32
    switch_summable = True
    unbiased = False   # round to nearest: error below half a code step, deterministic
    description = "block floating point, int32 codes with a shared exponent (INA without compression)"

    def scale_exponent(self, x32: np.ndarray) -> int:
        return max_exponent(x32) + 1

    def encode_shared(self, x32: np.ndarray, ctx: ScaleContext) -> np.ndarray:
        e = max_exponent(x32)  # raises on NaN/Inf
        if e + 1 > ctx.exponent:
            raise ValueError(f"value(s) of magnitude >= 2**{ctx.exponent} (the largest is >= 2**{e}): the negotiated "
                             f"exponent {ctx.exponent} is smaller than this tensor's, so the sum of {ctx.n_workers} "
                             "workers could overflow int32")
        out = np.empty(x32.size, np.int32)
        if K.bfp_encode(x32, bfp_scale(ctx.exponent, ctx.n_workers), out):
            raise AssertionError("bfp32: an int32 code saturated although |x| < 2**exponent")
        return out

    def decode_sum(self, payload: np.ndarray, ctx: ScaleContext, raw: bool = True) -> np.ndarray:
        out = np.empty(payload.size, np.float32)
        K.int_sum_decode(native(payload), 1.0 / bfp_scale(ctx.exponent, ctx.n_workers), out)
        return out

    def decode_sum_into(self, payload, ctx, raw, out, rows, which=None) -> None:
        if payload.dtype != np.dtype(">i4"):
            return super().decode_sum_into(payload, ctx, raw, out, rows, which)
        which = np.arange(len(rows)) if which is None else which
        K.int32_be_decode_rows(payload.view(np.uint8), which, 1.0 / bfp_scale(ctx.exponent, ctx.n_workers), out, rows)

    def compress(self, x) -> Encoded:
        x32 = to_numpy_f32(x)
        ctx = ScaleContext(self.scale_exponent(x32), 1)
        return Encoded(self.name, self.encode_shared(x32, ctx), tuple(np.shape(x)), {"exponent": ctx.exponent}, like=x)

    def decompress(self, enc: Encoded):
        out = self.decode_sum(enc.codes, ScaleContext(enc.meta["exponent"], 1))
        return from_numpy_like(out, enc.like, enc.shape)
