"""3LC (seed 003): 3-value quantization with sparsity multiplication, quartic encoding, zero-run encoding.

3-value quantization (Section 3.1), with the error accumulation buffer of the tensor's key:
    A = T_in + residual;  M = max|A| * s  (1 <= s < 2);  q = round(A / M) in {-1, 0, 1};
    T_out = M * q;  residual = A - T_out.
``round`` is round-half-to-even (numpy/TensorFlow ``round``), so |A| <= M/2 becomes 0; a larger s
zeroes more values. The error |A - T_out| <= M/2 < max|A| per element, and with the buffer nothing is
lost: the sum of what was sent plus the residual equals the sum of the inputs.

Quartic encoding (Section 3.2, lossless, fixed length): q + 1 in {0, 1, 2}; the flat array, padded to
a multiple of 5, is cut into five contiguous partitions p0..p4 of L = ceil(n / 5) entries, and byte i
is p0[i]*81 + p1[i]*27 + p2[i]*9 + p3[i]*3 + p4[i] (0..242): 8 bits per 5 values = 1.6 bits/value.
The paper pads with uint8 zeros (3-value -1); we pad with 1 (3-value 0), so an all-zero tensor is all
121 bytes; the pad is dropped on decoding either way.

Zero-run encoding (Section 3.3, lossless, variable length): byte 121 is five zeros; a run of k bytes
of 121 (2 <= k <= 14) becomes the single byte 243 + (k - 2); longer runs are cut into runs of 14.
An all-zero float32 tensor therefore costs 1 byte per 70 values: 32 * 70 / 8 = 280x (the paper's
figure), plus the 4-byte M.

Message of ``compress`` (self-contained byte string, network byte order):
    float32 M | zero-run-encoded quartic bytes      (``ThreeLC``, name "3lc")
    float32 M | quartic bytes                       (``ThreeLCQuartic``, name "3lc-3v", 1.6 bits/value)

Switch path (``3lc-3v`` only, zero-run encoding cannot be summed): the workers share
M = max over workers of (max|A| * s), negotiated as a Q8.8 log2 exponent (see encoding.py); each sends
q in {-1, 0, 1} as int8 and the switch adds them; the sum decodes as M * sum(q). The error buffer is
updated with the shared M, so error feedback works the same on both paths.

State: one error accumulation buffer per ``key`` (float32, the tensor's size) when
``error_feedback=True`` (the default, as in the paper); ``residual(key)`` / ``reset(key)`` inspect and
clear it. Pass a ``key`` naming the tensor (e.g. the parameter name) to every call: without one the
call is stateless (plain 3-value quantization). Pass the same ``key`` to ``scale_exponent`` and
``encode_shared`` on the switch path.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ina.wire import PayloadType

from .base import HOST_AGGREGATED, Codec, Encoded, HostAggregated, ScaleContext, from_numpy_like, to_numpy_f32
from .encoding import Reader, be_bytes, element_count, finite_max_abs, log_scale, log_scale_exponent
from .feedback import ErrorFeedbackMixin

ZERO_BYTE = 121          # five 3-value zeros: 1*81 + 1*27 + 1*9 + 1*3 + 1
QUARTIC_MAX = 242        # 2*81 + 2*27 + 2*9 + 2*3 + 2
RUN_BASE = 243           # byte 243 + (k - 2) stands for k bytes of 121
RUN_MIN, RUN_MAX = 2, 14


# ----------------------------------------------------------------------------- kernels
@njit(cache=True)
def _quantize_quartic(acc, m, codes, decoded):
    """Fused 3-value quantization (q = round(acc / m)) and quartic encoding over 5 partitions.

    ``decoded`` receives float32(m * q), exactly what the receiver reconstructs.
    """
    n = acc.size
    L = codes.size
    inv = 1.0 / np.float64(m) if m > 0 else 0.0
    m32 = np.float32(m)
    for i in range(L):
        code = 0
        for j in range(5):
            idx = i + j * L
            t = 1
            if idx < n:
                q = np.rint(np.float64(acc[idx]) * inv)
                q = min(max(q, -1.0), 1.0)
                decoded[idx] = m32 * np.float32(q)
                t = np.int64(q) + 1
            code = code * 3 + t
        codes[i] = np.uint8(code)


@njit(cache=True)
def _quartic_decode(codes, n, m, out):
    """Quartic bytes to float32 m * q; returns the index of the first byte > 242 (or -1)."""
    L = codes.size
    m32 = np.float32(m)
    for i in range(L):
        c = np.int64(codes[i])
        if c > QUARTIC_MAX:
            return i
        for j in range(4, -1, -1):
            idx = i + j * L
            if idx < n:
                out[idx] = m32 * np.float32((c % 3) - 1)
            c //= 3
    return -1


@njit(cache=True)
def _zre_encode(src, out):
    n = src.size
    pos = 0
    i = 0
    while i < n:
        b = src[i]
        if b == ZERO_BYTE:
            k = 1
            while i + k < n and k < RUN_MAX and src[i + k] == ZERO_BYTE:
                k += 1
            if k >= RUN_MIN:
                out[pos] = np.uint8(RUN_BASE + k - RUN_MIN)
            else:
                out[pos] = np.uint8(ZERO_BYTE)
            pos += 1
            i += k
        else:
            out[pos] = b
            pos += 1
            i += 1
    return pos


@njit(cache=True)
def _zre_decoded_size(src):
    total = 0
    for i in range(src.size):
        b = np.int64(src[i])
        total += (b - RUN_BASE + RUN_MIN) if b >= RUN_BASE else 1
    return total


@njit(cache=True)
def _zre_decode(src, out):
    pos = 0
    for i in range(src.size):
        b = np.int64(src[i])
        if b >= RUN_BASE:
            for _ in range(b - RUN_BASE + RUN_MIN):
                out[pos] = np.uint8(ZERO_BYTE)
                pos += 1
        else:
            out[pos] = np.uint8(b)
            pos += 1
    return pos


@njit(cache=True)
def _three_value_shared(acc, m, codes, decoded):
    inv = 1.0 / np.float64(m) if m > 0 else 0.0
    m32 = np.float32(m)
    for i in range(acc.size):
        q = np.rint(np.float64(acc[i]) * inv)
        q = min(max(q, -1.0), 1.0)
        codes[i] = np.int8(q)
        decoded[i] = m32 * np.float32(q)


# ----------------------------------------------------------------------------- lossless stages
def quartic_length(n: int) -> int:
    """Bytes of the quartic encoding of n 3-values: ceil(n / 5)."""
    return (n + 4) // 5


def quartic_encode(q: np.ndarray) -> np.ndarray:
    """Quartic encoding of a 3-value array (values -1, 0, 1) to ceil(n/5) bytes of 0..242."""
    q = np.asarray(q).reshape(-1)
    if q.size and (q.min() < -1 or q.max() > 1):
        raise ValueError("quartic encoding takes 3-values -1, 0, 1 only")
    codes = np.empty(quartic_length(q.size), np.uint8)
    dec = np.empty(q.size, np.float32)
    _quantize_quartic(np.ascontiguousarray(q, dtype=np.float32), 1.0, codes, dec)
    return codes


def quartic_decode(codes: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`quartic_encode`: n 3-values (int8)."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    if codes.size != quartic_length(n):
        raise ValueError(f"quartic message has {codes.size} bytes; {n} values need {quartic_length(n)}")
    out = np.empty(n, np.float32)
    bad = _quartic_decode(codes, n, 1.0, out)
    if bad >= 0:
        raise ValueError(f"byte {bad} of the quartic message is {codes[bad]}, not a quartic code (0..242)")
    return out.astype(np.int8)


def zero_run_encode(codes: np.ndarray) -> np.ndarray:
    """Zero-run encoding of quartic bytes (0..242): runs of 2..14 bytes of 121 become 243..255."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    if codes.size and int(codes.max()) > QUARTIC_MAX:
        raise ValueError(f"zero-run encoding takes quartic bytes 0..242, got {int(codes.max())}")
    out = np.empty(codes.size, np.uint8)
    return out[:_zre_encode(codes, out)].copy()


def zero_run_decode(data: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zero_run_encode` (every byte value is valid input)."""
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    out = np.empty(_zre_decoded_size(data), np.uint8)
    _zre_decode(data, out)
    return out


# ----------------------------------------------------------------------------- codecs
class _ThreeValue(ErrorFeedbackMixin, Codec):
    unbiased = False          # deterministic rounding; the error buffer corrects the bias over time
    stochastic = False
    zero_run = False

    def __init__(self, s: float = 1.0, error_feedback: bool = True, seed: int | None = 0):
        super().__init__(seed)
        s = float(s)
        if not 1.0 <= s < 2.0:
            raise ValueError(f"sparsity multiplier s must be in [1, 2), got {s}")
        self.s = s
        self._init_feedback(error_feedback)

    # operator on one tensor
    def compress(self, x, key=None) -> Encoded:
        x32 = to_numpy_f32(x)
        acc = self._accumulate(x32, key)
        m = np.float32(finite_max_abs(acc) * self.s)
        codes = np.empty(quartic_length(acc.size), np.uint8)
        decoded = np.empty(acc.size, np.float32)
        _quantize_quartic(acc, m, codes, decoded)
        self._keep(key, acc - decoded)
        body = zero_run_encode(codes) if self.zero_run else codes
        msg = np.concatenate([be_bytes("f4", m), body])
        return Encoded(self.name, msg, tuple(np.shape(x)), {}, like=x)

    def decompress(self, enc: Encoded):
        n = element_count(enc.shape)
        rd = Reader(enc.codes, self.name)
        m = float(rd.scalar("f4", "M"))
        body = rd.rest()
        codes = zero_run_decode(body) if self.zero_run else body
        if codes.size != quartic_length(n):
            raise ValueError(f"{self.name} message decodes to {codes.size} quartic bytes; a tensor of "
                             f"shape {enc.shape} needs {quartic_length(n)}")
        out = np.empty(n, np.float32)
        bad = _quartic_decode(np.ascontiguousarray(codes), n, m, out)
        if bad >= 0:
            raise ValueError(f"quartic byte {bad} of the {self.name} message is {codes[bad]} (valid: 0..242)")
        return from_numpy_like(out, enc.like, enc.shape)


class ThreeLC(HostAggregated, _ThreeValue):
    """Full 3LC: 3-value quantization + quartic encoding + zero-run encoding (variable length)."""
    name = "3lc"
    wire_id = 10
    zero_run = True
    description = ("3LC: 3-value quantization with sparsity multiplier s, error feedback, quartic + "
                   "zero-run encoding [" + HOST_AGGREGATED + "]")

    @property
    def bits_per_element(self) -> float:
        return 1.6   # upper bound before zero-run encoding; the message is usually smaller

    def __repr__(self) -> str:
        return f"<codec {self.name} id={self.wire_id} s={self.s} <=1.6 bits/elem, host aggregator only>"


class ThreeLCQuartic(_ThreeValue):
    """3LC without zero-run encoding: fixed 1.6 bits/value; on the switch, int8 3-values with a shared M."""
    name = "3lc-3v"
    wire_id = 11
    payload_type = PayloadType.INT8
    switch_summable = True
    variable_length = False
    aggregation = "switch"
    label = "switch-feasible: 3-values with a shared M summed as int8"
    zero_run = False
    description = ("3LC 3-value quantization with error feedback; quartic encoding (1.6 bits/value) as "
                   "an operator, int8 3-values with a shared max M on the switch")

    @property
    def bits_per_element(self) -> float:
        return 8.0   # int8 on the switch wire (information content log2(3); quartic: 1.6)

    def max_abs_code(self, ctx: ScaleContext) -> int:
        return 1                               # 3-values

    def scale_exponent(self, x32: np.ndarray, key=None) -> int:
        acc = self._accumulate(x32, key)
        return log_scale_exponent(finite_max_abs(acc) * self.s)

    def encode_shared(self, x32: np.ndarray, ctx: ScaleContext, key=None) -> np.ndarray:
        acc = self._accumulate(x32, key)
        finite_max_abs(acc)
        m = log_scale(ctx.exponent)
        codes = np.empty(acc.size, np.int8)
        decoded = np.empty(acc.size, np.float32)
        _three_value_shared(acc, m, codes, decoded)
        self._keep(key, acc - decoded)
        return codes

    def decode_sum(self, payload: np.ndarray, ctx: ScaleContext, raw: bool = True) -> np.ndarray:
        m = np.float32(log_scale(ctx.exponent))
        return (np.asarray(payload).astype(np.float32) * m).astype(np.float32)


def all_zero_ratio(n: int) -> float:
    """Compression ratio of full 3LC on an all-zero float32 tensor of n values (incl. the 4-byte M)."""
    L = quartic_length(n)
    zre = L // RUN_MAX + (0 if L % RUN_MAX == 0 else 1)
    return 4.0 * n / (4 + zre)


__all__ = ["ThreeLC", "ThreeLCQuartic", "quartic_encode", "quartic_decode", "zero_run_encode",
           "zero_run_decode", "quartic_length", "all_zero_ratio"]
