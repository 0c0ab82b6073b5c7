"""Shared pieces of the seed-paper codecs (3LC, thresholded transfer, entropy-adaptive Huffman,
MQGrad, TernGrad, QSGD): the log-scale exponent they negotiate on the switch, bit packing and small
big-endian byte helpers for their messages, and the sparse position coding of wgt/bgt/qgt and topk.

Shared scale on the switch
--------------------------
SwitchML-style codecs (bfp32, nc, nd, rd) negotiate a power of two 2**E by max. The linear codecs
here (3-value quantization, TernGrad, uniform K-bit) lose up to a factor of two of resolution with a
power of two (their code step is scale / levels), so they put a finer number in the same signed
16-bit exponent field: ``E = ceil(256 * log2(scale))``, a Q8.8 fixed-point log2. The max over
workers is still the max of the scales (log2 is monotone), so the switch negotiates it exactly like
the exponent; the shared scale ``2**(E / 256)`` is at most 0.27 % above the largest worker's scale.
The range is 2**-128 .. 2**127.99, the whole float32 range; an all-zero tensor proposes E = -32768.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

LOG2_FRAC = 256                 # Q8.8: 1/256 binade resolution
EXP_MIN = -(2**15)              # int16 range of the header's exponent field
EXP_MAX = 2**15 - 1


# ----------------------------------------------------------------------------- shared log scale
def log_scale_exponent(scale: float) -> int:
    """The smallest Q8.8 exponent E with 2**(E/256) >= scale (scale <= 0 gives the minimum, -32768)."""
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale {scale} is not finite; refusing to encode (nothing was sent)")
    if scale <= 0.0:
        return EXP_MIN
    e = math.ceil(math.log2(scale) * LOG2_FRAC)
    while 2.0 ** (e / LOG2_FRAC) < scale:     # guard against log2 rounding down
        e += 1
    if e > EXP_MAX:
        raise OverflowError(f"scale {scale:g} beyond the exponent field's 2**{EXP_MAX / LOG2_FRAC:.2f}")
    return max(e, EXP_MIN)


def log_scale(exponent: int) -> float:
    """The shared scale 2**(E/256) for a negotiated Q8.8 exponent (0.0 for the minimum: all zero)."""
    e = int(exponent)
    if not EXP_MIN <= e <= EXP_MAX:
        raise ValueError(f"exponent {e} outside the int16 exponent field")
    return 0.0 if e == EXP_MIN else 2.0 ** (e / LOG2_FRAC)


def finite_max_abs(x32: np.ndarray, what: str = "tensor") -> float:
    """max |x| (0.0 for an empty array); raises ValueError naming the count of NaN/Inf values."""
    if x32.size == 0:
        return 0.0
    m = float(np.max(np.abs(x32)))
    if not math.isfinite(m):
        bad = int(np.count_nonzero(~np.isfinite(x32)))
        raise ValueError(f"{what} contains {bad} NaN or Inf value(s); refusing to encode (nothing was sent)")
    return m


# ----------------------------------------------------------------------------- bit packing
@njit(cache=True, inline="always")
def push_bits(acc, nacc, pos, value, width, out):
    """Append the ``width`` low bits of ``value`` (most significant first) to the bit stream whose
    pending bits are ``acc``/``nacc`` and whose next byte is ``out[pos]``; whole bytes go to ``out``.
    Returns the new (acc, nacc, pos). The one bit writer of the fixed- and variable-width packers."""
    w = np.uint64(width)
    acc = (acc << w) | (np.uint64(value) & ((np.uint64(1) << w) - np.uint64(1)))
    nacc += width
    while nacc >= 8:
        nacc -= 8
        out[pos] = np.uint8((acc >> np.uint64(nacc)) & np.uint64(0xFF))
        pos += 1
    return acc, nacc, pos


@njit(cache=True, inline="always")
def flush_bits(acc, nacc, pos, out):
    """Write the pending bits of a stream (zero-padded to a byte); returns the bytes written in all."""
    if nacc > 0:
        out[pos] = np.uint8((acc << np.uint64(8 - nacc)) & np.uint64(0xFF))
        pos += 1
    return pos


@njit(cache=True)
def _pack_bits(vals, width, out):
    acc, nacc, pos = np.uint64(0), 0, 0
    for i in range(vals.size):
        acc, nacc, pos = push_bits(acc, nacc, pos, vals[i], width, out)
    return flush_bits(acc, nacc, pos, out)


@njit(cache=True)
def _unpack_bits(buf, width, n, out):
    acc = np.uint64(0)
    nacc = 0
    pos = 0
    w = np.uint64(width)
    mask = (np.uint64(1) << w) - np.uint64(1)
    for i in range(n):
        while nacc < width:
            acc = (acc << np.uint64(8)) | np.uint64(buf[pos])
            pos += 1
            nacc += 8
        nacc -= width
        out[i] = np.uint16((acc >> np.uint64(nacc)) & mask)


def packed_size(n: int, width: int) -> int:
    return (n * width + 7) // 8


def pack_bits(vals: np.ndarray, width: int) -> np.ndarray:
    """Pack unsigned integers of ``width`` bits (1..16) MSB-first into bytes (last byte zero-padded)."""
    if not 1 <= width <= 16:
        raise ValueError(f"bit width must be 1..16, got {width}")
    v = np.ascontiguousarray(vals, dtype=np.uint16)
    out = np.empty(packed_size(v.size, width), np.uint8)
    _pack_bits(v, width, out)
    return out


def unpack_bits(buf: np.ndarray, width: int, n: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``n`` unsigned ``width``-bit integers (uint16) from ``buf``."""
    need = packed_size(n, width)
    if buf.size < need:
        raise ValueError(f"truncated message: {n} codes of {width} bits need {need} bytes, got {buf.size}")
    out = np.empty(n, np.uint16)
    _unpack_bits(np.ascontiguousarray(buf, dtype=np.uint8), width, n, out)
    return out


# ----------------------------------------------------------------------------- sparse positions
POS_BITMAP, POS_VARINT = 0, 1     # position modes of sparse messages (wgt/bgt/qgt, topk)


@njit(cache=True)
def _varint_gaps(idx, out):
    pos = 0
    prev = -1
    for j in range(idx.size):
        gap = np.uint64(idx[j] - prev - 1)
        prev = idx[j]
        while gap >= np.uint64(0x80):
            out[pos] = np.uint8((gap & np.uint64(0x7F)) | np.uint64(0x80))
            gap >>= np.uint64(7)
            pos += 1
        out[pos] = np.uint8(gap)
        pos += 1
    return pos


@njit(cache=True)
def _read_varint_gaps(buf, k, n, idx):
    """Decode k gaps; returns (bytes read, error code): 1 truncated, 2 index out of range."""
    pos = 0
    prev = -1
    for j in range(k):
        gap = np.uint64(0)
        shift = np.uint64(0)
        while True:
            if pos >= buf.size:
                return pos, 1
            b = np.uint64(buf[pos])
            pos += 1
            gap |= (b & np.uint64(0x7F)) << shift
            shift += np.uint64(7)
            if b < np.uint64(0x80):
                break
            if shift > np.uint64(56):
                return pos, 2
        cur = prev + 1 + np.int64(gap)
        if cur >= n:
            return pos, 2
        idx[j] = cur
        prev = cur
    return pos, 0


def encode_positions(idx: np.ndarray, n: int) -> tuple[int, np.ndarray]:
    """(mode, bytes) of sorted positions in a tensor of n elements: LEB128 varints of the gaps
    between positions (POS_VARINT) or a bitmap of n bits (POS_BITMAP), whichever is smaller."""
    gaps = np.empty(idx.size * 10, np.uint8)
    glen = _varint_gaps(np.asarray(idx, np.int64), gaps)
    if glen < packed_size(n, 1):
        return POS_VARINT, gaps[:glen]
    bitmap = np.zeros(n, np.uint8)
    bitmap[idx] = 1
    return POS_BITMAP, np.packbits(bitmap)


def decode_positions(rd: "Reader", mode: int, k: int, n: int) -> np.ndarray:
    """The k positions that :func:`encode_positions` wrote in ``mode``, read from ``rd``."""
    if mode == POS_BITMAP:
        bits = np.unpackbits(rd.take(packed_size(n, 1), "position bitmap"))[:n]
        idx = np.flatnonzero(bits)
        if idx.size != k:
            raise ValueError(f"{rd.what} bitmap marks {idx.size} positions, the header says {k}")
        return idx
    if mode == POS_VARINT:
        idx = np.empty(k, np.int64)
        used, err = _read_varint_gaps(rd.buf[rd.pos:], k, n, idx)
        if err == 1:
            raise ValueError(f"truncated {rd.what} message: position gaps end early")
        if err == 2:
            raise ValueError(f"{rd.what} message has a position beyond the tensor's {n} elements")
        rd.take(int(used), "position gaps")
        return idx
    raise ValueError(f"unknown position mode {mode} in {rd.what} message")


# ----------------------------------------------------------------------------- byte helpers
def be_bytes(dtype: str, *values) -> np.ndarray:
    """Big-endian (network order) bytes of scalars as a uint8 array."""
    return np.frombuffer(np.array(values, dtype=np.dtype(dtype).newbyteorder(">")).tobytes(), np.uint8)


class Reader:
    """Sequential reader over a message (uint8 array) that names what is missing when truncated."""

    def __init__(self, buf: np.ndarray, what: str):
        self.buf = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
        self.pos = 0
        self.what = what

    def take(self, nbytes: int, field: str) -> np.ndarray:
        if self.pos + nbytes > self.buf.size:
            raise ValueError(f"truncated {self.what} message: {field} needs {nbytes} byte(s) at offset "
                             f"{self.pos}, only {self.buf.size - self.pos} left")
        out = self.buf[self.pos:self.pos + nbytes]
        self.pos += nbytes
        return out

    def scalar(self, dtype: str, field: str):
        dt = np.dtype(dtype).newbyteorder(">")
        return np.frombuffer(self.take(dt.itemsize, field).tobytes(), dt)[0]

    def bits_and_range(self, bits_field: str, lo_field: str, hi_field: str, max_bits: int = 16):
        """A u1 bit width (1..max_bits, checked) followed by a float32 range: (bits, lo, hi)."""
        bits = int(self.scalar("u1", bits_field))
        if not 1 <= bits <= max_bits:
            raise ValueError(f"{self.what} message has {bits_field} = {bits} bits (valid: 1..{max_bits})")
        return bits, float(self.scalar("f4", lo_field)), float(self.scalar("f4", hi_field))

    def rest(self) -> np.ndarray:
        out = self.buf[self.pos:]
        self.pos = self.buf.size
        return out

    def done(self) -> None:
        if self.pos != self.buf.size:
            raise ValueError(f"{self.what} message has {self.buf.size - self.pos} trailing byte(s)")


def element_count(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1
