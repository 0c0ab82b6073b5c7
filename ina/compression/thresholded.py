"""Thresholded gradient transfer (seed 001): whole (WGT), binarized (BGT) and quantized (QGT).

With G = gradient + residual (per tensor, kept locally: "they delay updates rather than avoid them")
and a fixed threshold T, for every element with |G_i| >= T:
  * WGT sends G_i itself and keeps 0;
  * BGT sends sign(G_i) * T and keeps G_i - sign(G_i) * T (Amazon's/Strom's scheme);
  * QGT sends sign(G_i) * m * T with m = min(floor(|G_i| / T), 255) ("the greatest multiple of T less
    than the gradient magnitude", at most 255 so it fits a byte) and keeps G_i - sign(G_i) * m * T.
Elements with |G_i| < T send nothing and keep G_i.

The paper counts 32 bits (WGT), 1 bit (BGT) or 8 bits (QGT) per *sent* value and nothing for the
positions ("these numbers exclude the matrix formatting data"). Our ``compress`` message is complete
and self-contained, so it also carries the positions and the signs (network byte order):
    u1 variant (0 WGT, 1 BGT, 2 QGT) | f4 T | u1 position mode | u4 k (sent values) | positions | values
position mode 0: a bitmap of n bits; mode 1: LEB128 varints of the gaps between sent indices
(the smaller of the two is chosen). Values: WGT k float32; BGT k sign bits; QGT k sign bits then k
bytes m (1..255). :func:`paper_bits` gives the paper's accounting for comparison with its tables.
The message is variable length, so ``compress`` output needs the host-aggregator mode.

Switch path (BGT and QGT; the codes are integers once the workers share T): the workers negotiate T
as a Q8.8 log2 exponent (max over workers; equal to every worker's own when they are configured
alike, which the paper assumes: "T is fixed for the duration of a training run, every node knows
its value"). Each sends its signed multiples of T densely (BGT: -1/0/1; QGT: -m..m) and the switch
adds them; the sum decodes as T * sum. QGT multiples up to 127 go as int8; the paper's cap of 255
needs 9 bits with the sign, so ``max_multiple > 127`` sends int32 (an int16 payload type would halve
that; see docs/codecs.md). WGT is not switch-summable (the values are arbitrary floats at positions
that differ between workers).

State: one residual per ``key`` (float32) when ``error_feedback=True`` (the default; the method is
defined with it). ``residual(key)`` / ``reset(key)``. Pass a ``key`` naming the tensor to every call
(and the same one to ``scale_exponent`` and ``encode_shared``): without one the call is stateless
and what stays below T is dropped.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ina.wire import PayloadType

from .base import HOST_AGGREGATED, Codec, Encoded, HostAggregated, ScaleContext, from_numpy_like, to_numpy_f32
from .encoding import (Reader, be_bytes, decode_positions, element_count, encode_positions, finite_max_abs, log_scale,
                       log_scale_exponent, pack_bits, packed_size, unpack_bits)
from .feedback import ErrorFeedbackMixin

WGT, BGT, QGT = 0, 1, 2
VARIANT_NAMES = {WGT: "wgt", BGT: "bgt", QGT: "qgt"}
PAPER_VALUE_BITS = {WGT: 32, BGT: 1, QGT: 8}


# ----------------------------------------------------------------------------- kernels
@njit(cache=True)
def _threshold(acc, t, variant, max_multiple, mult, residual):
    """Per element: mult[i] = signed multiple of T sent (WGT: +-1 marks a sent value), residual[i]
    = what is kept. Returns the number of sent values."""
    k = 0
    t32 = np.float32(t)
    for i in range(acc.size):
        g = acc[i]
        a = abs(g)
        m = 0
        if a >= t32 and t32 > 0:
            if variant == 0:
                m = 1
                residual[i] = np.float32(0.0)
            elif variant == 1:
                m = 1
            else:
                m = min(np.int64(np.floor(np.float64(a) / np.float64(t32))), max_multiple)
                if m < 1:   # float rounding of a / t just below 1
                    m = 1
            if g < 0:
                m = -m
            if variant != 0:
                residual[i] = g - np.float32(m) * t32
            k += 1
        else:
            residual[i] = g
        mult[i] = m
    return k


# ----------------------------------------------------------------------------- codecs
class ThresholdedTransfer(ErrorFeedbackMixin, Codec):
    variant: int
    unbiased = False     # deterministic thresholding; the residual delivers the rest later
    stochastic = False
    variable_length = True   # of compress(); the switch path (BGT, QGT) is fixed width

    def __init__(self, threshold: float = 1e-3, error_feedback: bool = True, seed: int | None = 0):
        super().__init__(seed)
        threshold = float(threshold)
        if not (threshold > 0 and np.isfinite(threshold)):
            raise ValueError(f"threshold T must be a positive finite number, got {threshold}")
        self.threshold = float(np.float32(threshold))
        self.max_multiple = 1
        self._init_feedback(error_feedback)

    def _apply(self, acc: np.ndarray, t: float):
        mult = np.empty(acc.size, np.int32)
        residual = np.empty(acc.size, np.float32)
        k = _threshold(acc, t, self.variant, self.max_multiple, mult, residual)
        return mult, residual, int(k)

    # operator on one tensor: the sparse message
    def compress(self, x, key=None) -> Encoded:
        x32 = to_numpy_f32(x)
        acc = self._accumulate(x32, key)
        finite_max_abs(acc)
        mult, residual, k = self._apply(acc, self.threshold)
        self._keep(key, residual)
        idx = np.flatnonzero(mult)
        mode, pos = encode_positions(idx, acc.size)
        sent = mult[idx]
        if self.variant == WGT:
            values = np.frombuffer(acc[idx].astype(">f4").tobytes(), np.uint8)
        else:
            values = pack_bits((sent < 0).astype(np.uint16), 1)
            if self.variant == QGT:
                values = np.concatenate([values, np.abs(sent).astype(np.uint8)])
        msg = np.concatenate([be_bytes("u1", self.variant), be_bytes("f4", self.threshold),
                              be_bytes("u1", mode), be_bytes("u4", k), pos, values])
        return Encoded(self.name, msg, tuple(np.shape(x)), {}, like=x)

    def decompress(self, enc: Encoded):
        n = element_count(enc.shape)
        rd = Reader(enc.codes, self.name)
        variant = int(rd.scalar("u1", "variant"))
        if variant != self.variant:
            raise ValueError(f"message is {VARIANT_NAMES.get(variant, variant)!r}, this codec decodes "
                             f"{VARIANT_NAMES[self.variant]!r}")
        t = np.float32(rd.scalar("f4", "threshold"))
        mode = int(rd.scalar("u1", "position mode"))
        k = int(rd.scalar("u4", "count"))
        if k > n:
            raise ValueError(f"{self.name} message claims {k} sent values for a tensor of {n}")
        idx = decode_positions(rd, mode, k, n)
        out = np.zeros(n, np.float32)
        if variant == WGT:
            out[idx] = np.frombuffer(rd.take(4 * k, "values").tobytes(), ">f4")
        else:
            neg = unpack_bits(rd.take(packed_size(k, 1), "signs"), 1, k).astype(bool)
            m = np.ones(k, np.float32) if variant == BGT else rd.take(k, "multiples").astype(np.float32)
            if variant == QGT and k and m.min() < 1:
                raise ValueError(f"{self.name} message carries a multiple of 0 for a sent value")
            out[idx] = np.where(neg, -m, m) * t
        rd.done()
        return from_numpy_like(out, enc.like, enc.shape)


class WholeGradientTransfer(HostAggregated, ThresholdedTransfer):
    name = "wgt"
    wire_id = 12
    variant = WGT
    description = ("thresholded whole-gradient transfer (WGT): values with |g| >= T sent as float32, "
                   "rest accumulated [" + HOST_AGGREGATED + "]")

    @property
    def bits_per_element(self) -> float:
        return 32.0    # per sent value, positions extra; see paper_bits


class BinarizedGradientTransfer(ThresholdedTransfer):
    name = "bgt"
    wire_id = 13
    variant = BGT
    payload_type = PayloadType.INT8
    switch_summable = True
    aggregation = "switch"
    label = "switch-feasible: signed multiples of a shared T summed as integers (compress(): sparse, host)"
    description = "binarized gradient transfer (BGT): +-T where |g| >= T, residual accumulated"

    def __init__(self, threshold: float = 1e-3, error_feedback: bool = True, seed: int | None = 0):
        super().__init__(threshold, error_feedback, seed)
        # T on the Q8.8 log grid (at most 0.27 % up), so that both paths use exactly the same T
        self.threshold_exponent = log_scale_exponent(self.threshold)
        self.threshold = float(np.float32(log_scale(self.threshold_exponent)))

    # switch path
    def max_abs_code(self, ctx: ScaleContext) -> int:
        return 1 if self.variant == BGT else self.max_multiple    # multiples of T

    def scale_exponent(self, x32: np.ndarray, key=None) -> int:
        return self.threshold_exponent

    def encode_shared(self, x32: np.ndarray, ctx: ScaleContext, key=None) -> np.ndarray:
        acc = self._accumulate(x32, key)
        finite_max_abs(acc)
        mult, residual, _ = self._apply(acc, float(np.float32(log_scale(ctx.exponent))))
        self._keep(key, residual)
        return mult.astype(np.int8 if self.payload_type == PayloadType.INT8 else np.int32)

    def decode_sum(self, payload: np.ndarray, ctx: ScaleContext, raw: bool = True) -> np.ndarray:
        t = float(np.float32(log_scale(ctx.exponent)))
        return (np.asarray(payload).astype(np.float64) * t).astype(np.float32)


class QuantizedGradientTransfer(BinarizedGradientTransfer):
    name = "qgt"
    wire_id = 14
    variant = QGT
    description = ("quantized gradient transfer (QGT): sign * min(floor(|g|/T), 255) * T where |g| >= T, "
                   "residual accumulated")

    def __init__(self, threshold: float = 1e-3, max_multiple: int = 255, error_feedback: bool = True,
                 seed: int | None = 0):
        super().__init__(threshold, error_feedback, seed)
        if not 1 <= int(max_multiple) <= 255:
            raise ValueError(f"max_multiple must be in 1..255 (one byte), got {max_multiple}")
        self.max_multiple = int(max_multiple)
        # per instance: int8 holds +-127 multiples, the paper's 255 needs a wider switch payload
        self.payload_type = PayloadType.INT8 if self.max_multiple <= 127 else PayloadType.INT32


def paper_bits(enc: Encoded) -> float:
    """Bits per element by the paper's accounting: 32/1/8 bits per sent value, positions free."""
    rd = Reader(enc.codes, "thresholded")
    variant = int(rd.scalar("u1", "variant"))
    rd.scalar("f4", "threshold")
    rd.scalar("u1", "position mode")
    k = int(rd.scalar("u4", "count"))
    return PAPER_VALUE_BITS[variant] * k / max(element_count(enc.shape), 1)


def sent_fraction(enc: Encoded) -> float:
    rd = Reader(enc.codes, "thresholded")
    for dt, f in (("u1", "variant"), ("f4", "threshold"), ("u1", "position mode")):
        rd.scalar(dt, f)
    return int(rd.scalar("u4", "count")) / max(element_count(enc.shape), 1)


__all__ = ["WholeGradientTransfer", "BinarizedGradientTransfer", "QuantizedGradientTransfer",
           "paper_bits", "sent_fraction"]
