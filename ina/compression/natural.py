"""Natural compression (seed 004, Definition 1): rounding to a power of two, stochastic or nearest.

Wire codes are 8 bits: bit 7 the sign, bits 0-6 an exponent code k. k = 0 is zero; k in 1..W means
magnitude 2**(e_low + k - 1). The exponent window [e_low, e_low + W - 1] is placed so that its top
level 2**(e_max + 1) is the largest value any worker can round up to, where e_max is the max over
workers of floor(log2 max|x|) (negotiated through the switch).

W is set by the switch's registers: the switch adds 2**(k-1) per worker, so W - 1 + ceil(log2 n)
must stay below the register's sign bit: W = min(127, register_bits - 1 - ceil(log2 n)).
For 64-bit registers and 8 workers that is 60 binades; for 32-bit registers and 8 workers, 28.

Values below the window are NOT flushed to zero (GRACE does, which biases the operator): a value
a < 2**e_low becomes 2**e_low with probability a / 2**e_low and 0 otherwise, which is unbiased.
Its variance is a (2**e_low - a) <= 4**e_low / 4, against C_nat's a**2 / 8: a value far below the
window pays more variance relative to itself, but in absolute terms at most 4**e_low / 4, which is
4**-(W-1) / 4 times the square of the top level. Deterministic mode rounds those values to the
nearer of 0 and 2**e_low instead.
"""
from __future__ import annotations

import math

import numpy as np

from ina.wire import PayloadType

from . import kernels as K
from .base import Codec, Encoded, ScaleContext, check_finite, from_numpy_like, max_exponent, to_numpy_f32


def exponent_window(n_workers: int, register_bits: int) -> int:
    """Number of exponent levels W that n workers can sum in registers of the given width."""
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    if register_bits not in (32, 64):
        raise ValueError(f"register_bits must be 32 or 64, got {register_bits}")
    return min(127, register_bits - 1 - math.ceil(math.log2(n_workers)))


def window_low(exponent: int, window: int) -> int:
    """e_low for a negotiated max exponent: the top code W stands for 2**(exponent + 1)."""
    return exponent + 2 - window


class NaturalCompression(Codec):
    name = "nc"
    wire_id = 1
    payload_type = PayloadType.NC8
    switch_summable = True
    encodes_rows = True
    unbiased = True
    stochastic = True
    deterministic = False
    description = "natural compression, stochastic rounding to a power of two (8-bit sign+exponent codes)"

    def _encode(self, x32: np.ndarray, e_low: int, window: int, seed: int) -> np.ndarray:
        out = np.empty(x32.size, np.uint8)
        max_field, max_code = K.nc_encode(x32, e_low, window, seed, self.deterministic, out)
        self._check(x32, max_field, max_code, e_low, window)
        return out

    @staticmethod
    def _check(x32: np.ndarray, max_field: int, max_code: int, e_low: int, window: int) -> None:
        """Raise for what nc_encode reported: a NaN/Inf, or a value above the window."""
        if max_field == 255:
            check_finite(int(np.count_nonzero(~np.isfinite(x32))))
        if max_code > window:
            top = e_low + window - 1
            n_top = int(np.count_nonzero(np.abs(x32) >= np.float32(2.0 ** top))) if top < 128 else 0
            raise ValueError(f"value(s) exceed the exponent window's top 2**{top} ({n_top} at or above it): "
                             "the negotiated exponent is smaller than this tensor's")

    @staticmethod
    def _decode(codes: np.ndarray, e_low: int) -> np.ndarray:
        out = np.empty(codes.size, np.float32)
        K.nc_decode(np.ascontiguousarray(codes, dtype=np.uint8), e_low, out)
        return out

    # operator on one tensor
    def compress(self, x) -> Encoded:
        x32 = to_numpy_f32(x)
        e_max = max_exponent(x32)
        e_low = window_low(e_max, 127)
        codes = self._encode(x32, e_low, 127, self.next_seed())
        if e_low + 127 - 1 > 127 and np.any((codes & 0x7F) == 127):
            raise OverflowError("value(s) >= 2**127 rounded up to 2**128, beyond float32")
        return Encoded(self.name, codes, tuple(np.shape(x)), {"e_low": e_low}, like=x)

    def decompress(self, enc: Encoded):
        return from_numpy_like(self._decode(enc.codes, enc.meta["e_low"]), enc.like, enc.shape)

    # switch path
    def scale_exponent(self, x32: np.ndarray) -> int:
        return max_exponent(x32)

    def encode_shared(self, x32: np.ndarray, ctx: ScaleContext) -> np.ndarray:
        w = exponent_window(ctx.n_workers, ctx.register_bits)
        return self._encode(x32, window_low(ctx.exponent, w), w, ctx.seed)

    def encode_rows(self, x32, ctx, dst, rows, chunks, at, elements) -> None:
        w = exponent_window(ctx.n_workers, ctx.register_bits)
        e_low = window_low(ctx.exponent, w)
        max_field, max_code = K.nc_encode_rows(x32, e_low, w, ctx.seed, self.deterministic, dst.reshape(-1),
                                               dst.shape[1], rows, chunks, at, elements)
        self._check(x32, max_field, max_code, e_low, w)

    def decode_sum(self, payload: np.ndarray, ctx: ScaleContext, raw: bool) -> np.ndarray:
        e_low = window_low(ctx.exponent, exponent_window(ctx.n_workers, ctx.register_bits))
        if raw:  # integer sums of 2**(k-1) per worker
            return (payload.astype(np.float64) * 2.0 ** e_low).astype(np.float32)
        return self._decode(payload, e_low)

    def decode_sum_into(self, payload, ctx, raw, out, rows, which=None) -> None:
        if raw or payload.dtype != np.uint8:
            return super().decode_sum_into(payload, ctx, raw, out, rows, which)
        e_low = window_low(ctx.exponent, exponent_window(ctx.n_workers, ctx.register_bits))
        which = np.arange(len(rows)) if which is None else which
        K.nc_decode_rows(payload, which, e_low, out, rows)


class NaturalCompressionDeterministic(NaturalCompression):
    name = "nc-det"
    wire_id = 2
    unbiased = False
    stochastic = False
    deterministic = True
    description = "natural compression, deterministic rounding to the nearest power of two (biased)"


def natural_compression(t, deterministic: bool = False, seed: int | None = None):
    """The operator C_nat on a tensor or array (no exponent window): each finite entry is rounded to
    one of its two neighbouring powers of two, unbiased (or to the nearer one if ``deterministic``).
    Returns a tensor of the input's type, shape, dtype and device.
    """
    x32 = to_numpy_f32(t)
    if seed is None:
        seed = int(np.random.default_rng().integers(0, 2**32))
    out = np.empty_like(x32)
    max_field, max_rounded, max_den = K.nc_operator(x32.view(np.uint32), seed, deterministic, out.view(np.uint32))
    if max_field == 255:
        check_finite(int(np.count_nonzero(~np.isfinite(x32))))
    if max_rounded == 255:
        raise OverflowError("value(s) >= 2**127 would round up to 2**128, beyond float32")
    if max_den:  # denormals: round between powers of two below 2**-126 in float64
        idx = np.nonzero((x32 != 0) & (np.abs(x32) < np.finfo(np.float32).tiny))[0]
        a = np.abs(x32[idx]).astype(np.float64)
        lo = 2.0 ** np.floor(np.log2(a))
        p = (a - lo) / lo
        up = (p >= 0.5) if deterministic else (np.random.default_rng(seed).random(a.size) < p)
        out[idx] = (np.sign(x32[idx]) * lo * np.where(up, 2.0, 1.0)).astype(np.float32)
    return from_numpy_like(out, t)
