"""THC (Tensor Homomorphic Compression, Li et al., NSDI 2024): integers an integer-only switch sums.

Per allreduce, with h the Hadamard block (a power of two, default 256) and per tensor x (plus the
key's residual when error feedback is on):

1. **norm agreement**: every worker proposes M_w = the largest L2 norm of its h-element blocks;
   the switch's max register returns M = max over workers, carried as a Q8.8 log2 exponent
   (E = ceil(256 log2 M), see ina.compression.encoding: max-ordered like the value, <= 0.27 % above it); g, T, the
   rotation seed and the block (as -log2 h, so the smallest wins) are negotiated alike. With one
   block this is THC's "largest norm"; with several it is the largest block norm, so every block's
   coordinates get THC's scale or a finer one.
2. **randomized Hadamard transform** per block: y = H D x / sqrt(h), D a diagonal of random signs
   from the shared ``rotation_seed`` (negotiated too, so ranks cannot disagree), H the Walsh-
   Hadamard matrix applied by the O(h log h) butterfly (numba, no matrix); the tail block is
   zero-padded to h. The transform is orthonormal, so norms and squared errors are preserved.
3. **scale and clip**: y * sqrt(h) / M makes the coordinates about N(0, (||x_b|| / M)^2), at most
   standard normal; they are clipped to +-T, T = the (1 - overflow/2) normal quantile (default
   overflow 1/32: T = 2.154, as THC's public code).
4. **quantize**: stochastic rounding onto a fine grid of ``FINE * g`` steps over [-T, T], then the
   *sender table*: each fine point maps, by a second random draw, to one of its two neighbours in
   the lookup table, 2**bits integers in [0, g] that include 0 and g (chosen here by dynamic
   programming to minimise the expected variance of a clipped standard normal; THC solves the same
   problem). Both draws are unbiased, so E[table value] = (y' + T) g / (2T) for the clipped y'.
5. **switch**: THC's switch maps a b-bit table index to its integer; ours sends the integer itself,
   centred: code = value - g/2 in [-g/2, g/2] (int8). The sum of n workers' codes lies in
   [-n g/2, n g/2] *by construction* (the table's values are in [0, g]); ``max_abs_code`` = g/2, so
   when n g/2 <= 127 the codes go as INT8_NARROW and the switch returns int8 sums (1 byte per element
   each way), otherwise int32 sums (exact for any n a job can have).
6. **receiver**: sum / n - g/2 in THC's uncentred terms = (sum of centred codes) / n; times 2T/g,
   times M / sqrt(h), inverse transform D H / sqrt(h). ``decode_sum`` returns the sum over workers
   (n times that average), like every codec here.

Bits: our wire carries 8 bits up (int8) and 8 (INT8_NARROW) or 32 down; THC's own switch carries
``bits`` (default 4) up and its result type down. ``compress`` packs the table indices: ``bits``
per value plus a 9-byte header (the table is rebuilt from g, bits and T).

Bias and variance: for the clipped transform y' the estimate is unbiased; clipping (a fraction
about ``overflow`` of the coordinates when x's norm is the largest, fewer otherwise) is THC's only
bias, and error feedback returns it later. Per coordinate the variance is (v - a)(b - v) (grid
units, v between table neighbours a <= v <= b), at most ((b - a) * 2T/g)^2 / 4 in scaled units;
the inverse transform keeps the sum of squares, so per block E||x_hat - x'||^2 <= (G 2T/g)^2 M^2 / 4
with G the table's largest gap. :func:`expected_variance` gives the mean per coordinate for standard
normal coordinates (the regime the transform produces).

Chunk alignment on the switch path: ``decode_sum`` sees whole packets in any order, so a Hadamard
block must not straddle two packets: the codec uses h_eff = min(h, the largest power of two dividing
the elements per packet) (``ScaleContext.elements``; a warning is logged when that is smaller than
h). Smaller blocks lie inside the h-blocks the norm was agreed on, so the scale stays safe.

Error feedback (``error_feedback=True``, the default, as THC's code): residual = acc - this worker's
own decoded contribution, per ``key``; without a key the call is stateless. Counters:
``codec.coordinates`` and ``codec.clipped`` (coordinates encoded and clipped so far).
"""
from __future__ import annotations

import functools
import logging
import math
from statistics import NormalDist

import numpy as np
from numba import njit

from ina.wire import PayloadType

from .base import Codec, Encoded, ScaleContext, from_numpy_like, native, to_numpy_f32
from .encoding import (EXP_MIN, Reader, be_bytes, element_count, finite_max_abs, log_scale, log_scale_exponent,
                       pack_bits, packed_size, unpack_bits)
from .feedback import ErrorFeedbackMixin
from .kernels import random_u32, uniform01

log = logging.getLogger("ina.compression.thc")

FINE = 64                      # fine-grid steps per unit of g (the table's points lie on the fine grid)
TABLE_STREAM = 0x5BD1E995      # the table draw uses the stream seed + this (the fine rounding: seed)
ROTATION_STREAM = 0x27D4EB2F   # the signs of D: stream rotation_seed + this
MAX_BLOCK_LOG2 = 16


# ----------------------------------------------------------------------------- kernels
LANES = 8       # blocks transformed at once: the butterfly runs across them, one vector op per step


@njit(cache=True, inline="always")
def _fwht_lanes(buf, h):
    """In-place unnormalised Walsh-Hadamard transform of every column of buf (h x LANES, one block a
    column): the radix-2 butterfly, each block's additions in the same order as one block alone."""
    span = 1
    while span < h:
        for i in range(0, h, 2 * span):
            for j in range(i, i + span):
                for lane in range(LANES):
                    a = buf[j, lane]
                    b = buf[j + span, lane]
                    buf[j, lane] = a + b
                    buf[j + span, lane] = a - b
        span *= 2


@njit(cache=True, inline="always")
def _load_lanes(x, scale, signs, first_block, buf):
    """buf[:, lane] = x's block first_block + lane times scale * signs (float64; zero past x's end)."""
    h = signs.size
    for lane in range(LANES):
        base = (first_block + lane) * h
        if base + h <= x.size:
            for k in range(h):
                buf[k, lane] = np.float64(x[base + k]) * scale * signs[k]
        else:
            for k in range(h):
                buf[k, lane] = np.float64(x[base + k]) * scale * signs[k] if base + k < x.size else 0.0


@njit(cache=True)
def _block_norms(x, h, out):
    for b in range(out.size):
        acc = 0.0
        for i in range(b * h, min((b + 1) * h, x.size)):
            v = np.float64(x[i])
            acc += v * v
        out[b] = math.sqrt(acc)


@njit(cache=True)
def _rotate(x, signs, out):
    """out = H D x / sqrt(h) per block (float64; x zero-padded to out.size)."""
    h = signs.size
    inv = 1.0 / math.sqrt(h)
    buf = np.empty((h, LANES), np.float64)
    blocks = out.size // h
    for b0 in range(0, blocks, LANES):
        _load_lanes(x, 1.0, signs, b0, buf)
        _fwht_lanes(buf, h)
        for lane in range(min(LANES, blocks - b0)):
            for k in range(h):
                out[(b0 + lane) * h + k] = buf[k, lane] * inv


@njit(cache=True)
def _inverse_blocks(codes, step, signs, out):
    """out = D H (codes * step) / sqrt(h) per block: the inverse transform of the dequantized sum
    (out float32 or float64; the products are float64, rounded once on the store)."""
    h = signs.size
    inv = 1.0 / math.sqrt(h)
    ones = np.ones(h, np.float64)
    buf = np.empty((h, LANES), np.float64)
    blocks = out.size // h
    for b0 in range(0, blocks, LANES):
        _load_lanes(codes, step, ones, b0, buf)
        _fwht_lanes(buf, h)
        for lane in range(min(LANES, blocks - b0)):
            for k in range(h):
                out[(b0 + lane) * h + k] = buf[k, lane] * (inv * signs[k])


@njit(cache=True)
def _encode_blocks(x, signs, scale, t, g, lower, p_up, table, seed, idx, out):
    """Per h-block of x (zero-padded), fused and in cache: rotate (H D x / sqrt(h)), scale, clip to
    +-t, round stochastically onto the fine grid, then to a table neighbour by a second draw;
    out = centred code table[k] - g/2, idx = k (when idx has out's size). Returns the clipped count."""
    h = signs.size
    inv = 1.0 / math.sqrt(h)
    fine_steps = lower.size - 1
    half = g // 2
    to_fine = fine_steps / (2.0 * t)
    seed2 = seed + TABLE_STREAM
    keep_idx = idx.size == out.size
    buf = np.empty((h, LANES), np.float64)
    blocks = out.size // h
    clipped = 0
    for b0 in range(0, blocks, LANES):
        _load_lanes(x, 1.0, signs, b0, buf)
        _fwht_lanes(buf, h)
        for lane in range(min(LANES, blocks - b0)):
            for k in range(h):         # branch-free: the random draws are unpredictable branches
                i = (b0 + lane) * h + k
                v = buf[k, lane] * inv * scale
                clipped += (v > t) | (v < -t)
                v = min(max(v, -t), t)
                f = (v + t) * to_fine
                j = int(f)             # f >= 0: the floor
                j = min(j + np.int64(uniform01(i, seed) < f - j), fine_steps)
                q = lower[j] + np.int64(uniform01(i, seed2) < p_up[j])
                out[i] = np.int8(table[q] - half)
                if keep_idx:
                    idx[i] = q
    return clipped


# ----------------------------------------------------------------------------- the lookup table
def clip_threshold(overflow: float) -> float:
    """T such that a standard normal coordinate exceeds +-T with probability ``overflow``."""
    if not 0 < overflow < 1:
        raise ValueError(f"overflow must be a probability in (0, 1), got {overflow}")
    return NormalDist().inv_cdf(1.0 - overflow / 2.0)


def _segment_costs(g: int, clip: float) -> np.ndarray:
    """cost[a, b] = E[(v - a)(b - v); a <= v < b] in grid units for v = (clip(Z, +-T) + T) g / 2T."""
    m = 256                                             # integration points per grid unit
    u = (np.arange(g * m) + 0.5) / m                    # midpoints over [0, g]
    z = u * (2.0 * clip / g) - clip
    w = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) * (2.0 * clip / g) / m
    prefix = [np.concatenate([[0.0], np.cumsum(w * u**p)]) for p in range(3)]
    at = np.arange(g + 1) * m
    m0, m1, m2 = (p[at] for p in prefix)
    d0, d1, d2 = (mk[None, :] - mk[:, None] for mk in (m0, m1, m2))     # integrals over [a, b)
    a = np.arange(g + 1)[:, None].astype(np.float64)
    b = np.arange(g + 1)[None, :].astype(np.float64)
    cost = -d2 + (a + b) * d1 - a * b * d0
    cost[np.arange(g + 1)[:, None] >= np.arange(g + 1)[None, :]] = np.inf
    return cost


@functools.lru_cache(maxsize=64)
def lookup_table(g: int, bits: int, clip: float) -> tuple[int, ...]:
    """The 2**bits (at most g + 1) integers in [0, g], including 0 and g, that minimise the expected
    variance of unbiased rounding of a clipped standard normal mapped onto [0, g] (dynamic programming
    over the grid points)."""
    levels = min(1 << bits, g + 1)
    if levels == g + 1:
        return tuple(range(g + 1))
    cost = _segment_costs(g, clip)
    best = np.full(g + 1, np.inf)
    best[0] = 0.0
    back = []
    for _ in range(levels - 1):                          # each step adds one table point
        total = best[:, None] + cost
        arg = np.argmin(total, axis=0)
        back.append(arg)
        best = total[arg, np.arange(g + 1)]
    points, b = [g], g
    for arg in reversed(back):
        b = int(arg[b])
        points.append(b)
    assert points[-1] == 0
    return tuple(reversed(points))


@functools.lru_cache(maxsize=64)
def _sender_tables(g: int, bits: int, clip: float):
    table = np.array(lookup_table(g, bits, clip), np.int64)
    u = np.arange(FINE * g + 1) / FINE                   # fine points in grid units
    lower = np.minimum(np.searchsorted(table, u, side="right") - 1, table.size - 2)
    p_up = (u - table[lower]) / (table[lower + 1] - table[lower])
    return table, lower.astype(np.int64), p_up


def expected_variance(g: int = 16, bits: int = 4, overflow: float = 1 / 32) -> float:
    """Mean rounding variance per coordinate, in units of the scaled coordinate, for standard normal
    coordinates (clipping excluded): sum over table segments of E[(v - a)(b - v)] times (2T/g)^2."""
    clip = log_scale(log_scale_exponent(clip_threshold(overflow)))
    table = lookup_table(g, bits, clip)
    cost = _segment_costs(g, clip)
    return float(sum(cost[a, b] for a, b in zip(table, table[1:])) * (2.0 * clip / g) ** 2)


@functools.lru_cache(maxsize=64)
def rotation_signs(h: int, rotation_seed: int) -> np.ndarray:
    """The diagonal D of the transform: h random signs from the shared rotation seed."""
    u = random_u32(h, (int(rotation_seed) + ROTATION_STREAM) & 0xFFFFFFFF)
    return np.where(u < 2**31, -1.0, 1.0)        # a uniform number in [0, 1) below 0.5


def rht(x: np.ndarray, h: int, rotation_seed: int = 0) -> np.ndarray:
    """The randomized Hadamard transform H D x / sqrt(h) of every h-block of x (zero-padded), float64."""
    y = np.empty(x.size + (-x.size % h), np.float64)
    _rotate(np.ascontiguousarray(x).reshape(-1), rotation_signs(h, rotation_seed), y)
    return y


def inverse_rht(y: np.ndarray, h: int, rotation_seed: int = 0) -> np.ndarray:
    """D H y / sqrt(h) per h-block: the inverse of :func:`rht` (y's size a multiple of h), float64."""
    y = np.ascontiguousarray(y, np.float64).reshape(-1)
    if y.size % h:
        raise ValueError(f"{y.size} values are not whole Hadamard blocks of {h}")
    out = np.empty(y.size, np.float64)
    _inverse_blocks(y, 1.0, rotation_signs(h, rotation_seed), out)
    return out


def block_norms(x: np.ndarray, h: int) -> np.ndarray:
    """L2 norm of every h-element block of x (the last block zero-padded), float64."""
    out = np.empty(-(-x.size // h), np.float64)
    _block_norms(np.ascontiguousarray(x).reshape(-1), h, out)
    return out


# ----------------------------------------------------------------------------- the codec
class THC(ErrorFeedbackMixin, Codec):
    name = "thc"
    wire_id = 20
    payload_type = PayloadType.INT8
    switch_summable = True
    variable_length = False
    aggregation = "switch"
    label = "switch-feasible: table integers in [-g/2, g/2] after a shared randomized Hadamard transform, summed"
    unbiased = False          # unbiased for the clipped transform; clipping (about `overflow`) is the bias
    stochastic = True
    description = ("THC: randomized Hadamard transform, shared max norm, clip, stochastic rounding through a "
                   "lookup table to integers in [0, g] that the switch sums (4-bit table, g = 16)")

    def __init__(self, g: int = 16, bits: int = 4, overflow: float = 1 / 32, clip: float | None = None,
                 block: int = 256, rotation_seed: int = 0, error_feedback: bool = True, seed: int | None = 0):
        super().__init__(seed)
        if int(g) != g or not 2 <= g <= 254 or g % 2:
            raise ValueError(f"granularity g must be an even integer in 2..254 (codes g/2 fit int8), got {g}")
        if int(bits) != bits or not 1 <= bits <= 8:
            raise ValueError(f"table bits must be an integer in 1..8, got {bits}")
        if int(block) != block or block < 2 or block & (block - 1) or block > 2**MAX_BLOCK_LOG2:
            raise ValueError(f"Hadamard block must be a power of two in 2..{2**MAX_BLOCK_LOG2}, got {block}")
        if int(rotation_seed) != rotation_seed or not 0 <= rotation_seed <= 32767:
            raise ValueError(f"rotation_seed must be an integer in 0..32767 (it is negotiated), got {rotation_seed}")
        t = clip_threshold(overflow) if clip is None else float(clip)
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(f"clip T must be a positive finite number, got {clip}")
        self.g, self.bits, self.block, self.rotation_seed = int(g), int(bits), int(block), int(rotation_seed)
        self._clip_exponent = log_scale_exponent(t)       # T on the Q8.8 grid, so it can be negotiated
        self.clip = log_scale(self._clip_exponent)
        self.coordinates = 0
        self.clipped = 0
        self._warned: set[int] = set()
        self._init_feedback(error_feedback)

    @property
    def bits_per_element(self) -> float:
        return 8.0     # int8 codes on our switch wire; compress() packs `bits` per value

    # -- shared parameters ----------------------------------------------------------------------
    def negotiated(self) -> tuple[int, ...]:
        # by max: g, T (Q8.8), the rotation seed, and -log2(block) (so the *smallest* block wins: smaller
        # blocks lie inside the larger ones every rank measured its norm on)
        return (self.g, self._clip_exponent, self.rotation_seed, -(self.block.bit_length() - 1))

    def _params(self, ctx: ScaleContext | None) -> tuple[int, float, int]:
        """(g, T, rotation seed): the negotiated maxima, or this codec's own outside the switch path."""
        if ctx is None or not ctx.agreed:
            return self.g, self.clip, self.rotation_seed
        g, t_exp, rot = (int(v) for v in ctx.agreed[:3])
        if not 2 <= g <= 254 or g % 2:
            raise ValueError(f"negotiated granularity g = {g} is not an even integer in 2..254")
        return g, log_scale(t_exp), rot

    def _block(self, ctx: ScaleContext | None) -> int:
        """The Hadamard block: the smallest any rank asked for, within one packet (elements per packet)."""
        block = self.block
        if ctx is not None and len(ctx.agreed) > 3:
            block = min(block, 1 << max(0, -int(ctx.agreed[3])))
        e = int(ctx.elements) if ctx is not None else 0
        if e <= 0:
            return block
        h = min(block, e & -e)
        if h < block and e not in self._warned:
            self._warned.add(e)
            log.warning("thc: %d elements per packet is not a multiple of the Hadamard block %d; using blocks "
                        "of %d (coarser quantization)", e, block, h)
        return h

    def max_abs_code(self, ctx: ScaleContext) -> int:
        return self._params(ctx)[0] // 2       # centred table values: |code| <= g/2

    # -- encoding and decoding ----------------------------------------------------------------------
    def _encode(self, acc, norm, g, t, rot, h, seed, with_idx=False):
        """(table indices, centred int8 codes) of acc, zero-padded to whole h-blocks (the indices, for
        compress(), only ``with_idx``)."""
        m = acc.size + (-acc.size % h)
        idx = np.zeros(m if with_idx else 0, np.uint8)     # bits <= 8: indices below 256
        codes = np.zeros(m, np.int8)
        if norm > 0 and m:
            table, lower, p_up = _sender_tables(g, self.bits, t)
            clipped = _encode_blocks(acc, rotation_signs(h, rot), math.sqrt(h) / norm, t, g, lower, p_up, table,
                                     seed, idx, codes)
            self.clipped += int(clipped)
            self.coordinates += m
        return idx, codes

    def _decode(self, codes, norm, g, t, rot, h) -> np.ndarray:
        codes = native(codes).reshape(-1)
        if codes.size % h:
            raise ValueError(f"thc: {codes.size} codes are not whole Hadamard blocks of {h}")
        out = np.zeros(codes.size, np.float32)
        if norm > 0:
            _inverse_blocks(codes, (2.0 * t / g) * norm / math.sqrt(h), rotation_signs(h, rot), out)
        return out

    def _norm(self, acc: np.ndarray) -> float:
        finite_max_abs(acc)
        return float(block_norms(acc, self.block).max()) if acc.size else 0.0

    def scale_exponent(self, x32: np.ndarray, key=None) -> int:
        return log_scale_exponent(self._norm(self._accumulate(x32, key)))

    def encode_shared(self, x32: np.ndarray, ctx: ScaleContext, key=None) -> np.ndarray:
        acc = self._accumulate(x32, key)
        g, t, rot = self._params(ctx)
        h = self._block(ctx)
        norm = log_scale(ctx.exponent)
        own = self._norm(acc)
        if own > norm:
            raise ValueError(f"block norm {own:g} exceeds the negotiated max norm {norm:g}: the negotiated exponent "
                             "is smaller than this tensor's")
        _, codes = self._encode(acc, norm, g, t, rot, h, ctx.seed)
        if self.error_feedback and key is not None:
            self._keep(key, acc - self._decode(codes, norm, g, t, rot, h)[:acc.size])
        return codes

    def decode_sum(self, payload: np.ndarray, ctx: ScaleContext, raw: bool = True) -> np.ndarray:
        g, t, rot = self._params(ctx)
        return self._decode(payload, log_scale(ctx.exponent), g, t, rot, self._block(ctx))

    # -- operator on one tensor: b-bit table indices ---------------------------------------------------
    def compress(self, x, key=None) -> Encoded:
        acc = self._accumulate(to_numpy_f32(x), key)
        exponent = log_scale_exponent(self._norm(acc))
        norm, h = log_scale(exponent), self.block
        idx, codes = self._encode(acc, norm, self.g, self.clip, self.rotation_seed, h, self.next_seed(),
                                  with_idx=True)
        if self.error_feedback and key is not None:
            self._keep(key, acc - self._decode(codes, norm, self.g, self.clip, self.rotation_seed, h)[:acc.size])
        msg = np.concatenate([be_bytes("i2", exponent), be_bytes("u1", self.g), be_bytes("u1", self.bits),
                              be_bytes("u1", h.bit_length() - 1), be_bytes("u2", self.rotation_seed),
                              be_bytes("i2", self._clip_exponent), pack_bits(idx, self.bits)])
        return Encoded(self.name, msg, tuple(np.shape(x)), {}, like=x)

    def decompress(self, enc: Encoded):
        n = element_count(enc.shape)
        rd = Reader(enc.codes, self.name)
        exponent = int(rd.scalar("i2", "norm exponent"))
        g, bits, hlog = (int(rd.scalar("u1", f)) for f in ("g", "table bits", "block"))
        rot = int(rd.scalar("u2", "rotation seed"))
        t_exp = int(rd.scalar("i2", "clip exponent"))
        t = log_scale(t_exp) if t_exp != EXP_MIN else 0.0
        if not 2 <= g <= 254 or g % 2 or not 1 <= bits <= 8 or not 1 <= hlog <= MAX_BLOCK_LOG2 or not t > 0:
            raise ValueError(f"{self.name} message header is invalid: g={g}, bits={bits}, block=2**{hlog}, T={t}")
        h = 1 << hlog
        m = n + (-n % h)
        idx = unpack_bits(rd.take(packed_size(m, bits), "table indices"), bits, m)
        rd.done()
        table = np.array(lookup_table(g, bits, t), np.int64)
        if m and idx.max() >= table.size:
            raise ValueError(f"{self.name} message holds table index {int(idx.max())} (table of {table.size})")
        norm = 0.0 if exponent == EXP_MIN else log_scale(exponent)
        out = self._decode(table[idx] - g // 2, norm, g, t, rot, h)[:n]
        return from_numpy_like(out, enc.like, enc.shape)


__all__ = ["THC", "lookup_table", "expected_variance", "clip_threshold", "rotation_signs", "rht", "inverse_rht",
           "block_norms"]
