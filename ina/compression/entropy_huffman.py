"""Entropy-adaptive quantization with Huffman coding (seed 000, Øland & Raj, Algorithms 1 and 2).

Per tensor (one layer):
1. w_min, w_max of the tensor;
2. H = entropy (bits) of a random sample of F |W| values (F = 3 %) quantized to M = 4 bits over
   [w_min, w_max] (a 2**M-bin histogram);
3. N = ceil(H + c) bits (c = 6 by default, the paper's best-accuracy setting; c = 5 is its
   "sweet spot"), at most ``max_bits``;
4. uniform quantization to 2**N bins: i = floor(2**N (w - w_min) / (w_max - w_min)), w_max put in
   the top bin;
5. a Huffman code of the bins' histogram; the codes of all values form the bitstream;
6. decoding restores bin centres: w_min + (w_max - w_min)(i + 0.5) / 2**N.

Two details differ from the paper's listing, on purpose:
* Algorithm 1's QUANTIZE writes floor(2**N (w_max - w) / (w_max - w_min)) but Algorithm 2 decodes
  with w_min + ...: the two are inconsistent (values would come back mirrored); we index from w_min.
* The package carries the Huffman code *lengths* (a canonical Huffman code) instead of the
  probabilities P: the receiver needs only the code, and the lengths take 4 bits per bin of the used range,
  or 3 bytes per used bin when few are used, against 4 bytes per bin for float probabilities.
* The sample has at least min(n, 64) values, so that tiny tensors (biases) get a usable estimate.

Message (self-contained bytes, network byte order):
    u1 N | f4 w_min | f4 w_max | u1 codebook mode | codebook | bitstream (MSB first, zero-padded)
codebook mode 0: u2 count, then count x (u2 bin, u1 length) of the used bins;
codebook mode 1: u1 width (4 or 8), u2 first and u2 last used bin, then the code length of every
bin in between in ``width`` bits (0 = unused). The smaller of the two is sent.
A tensor whose values all fall in one bin has one code of length 0 and an empty bitstream.

The message is variable length: it needs the host-aggregator mode (a switch cannot decode Huffman
codes at line rate). Bias: deterministic bin-centre rounding, error at most half a bin,
(w_max - w_min) / 2**(N+1); it is biased unless ``error_feedback=True`` is used for gradients (the
paper transmits weights, without feedback, so the default is off).
"""
from __future__ import annotations

import heapq
import math

import numpy as np
from numba import njit

from .base import HOST_AGGREGATED, Codec, Encoded, HostAggregated, from_numpy_like, to_numpy_f32
from .encoding import (Reader, be_bytes, element_count, finite_max_abs, flush_bits, pack_bits, packed_size, push_bits,
                       unpack_bits)
from .feedback import ErrorFeedbackMixin

MAX_CODE_LEN = 56
CODEBOOK_SPARSE, CODEBOOK_RANGE = 0, 1


# ----------------------------------------------------------------------------- kernels
@njit(cache=True)
def _quantize(x, wmin, step, top, out):
    # divide by the bin width (rng / 2**N, exact) rather than multiply by its rounded reciprocal, so
    # that a value on a bin edge lands in the bin _dequantize's centre describes
    for i in range(x.size):
        q = np.int64(np.floor((np.float64(x[i]) - wmin) / step)) if step > 0 else np.int64(0)
        out[i] = min(max(q, 0), top)


@njit(cache=True)
def _dequantize(idx, wmin, step, out):
    for i in range(idx.size):
        out[i] = np.float32(wmin + step * (np.float64(idx[i]) + 0.5))


@njit(cache=True)
def _huffman_encode(sym, codes, lengths, out):
    acc, nacc, pos = np.uint64(0), 0, 0
    for i in range(sym.size):
        s = sym[i]
        if lengths[s]:
            acc, nacc, pos = push_bits(acc, nacc, pos, codes[s], lengths[s], out)
    return flush_bits(acc, nacc, pos, out)


@njit(cache=True)
def _huffman_decode(buf, n, first_code, count, first_index, sorted_syms, maxlen, out):
    """Canonical Huffman decoding of n symbols. Returns (0, bytes read), or error 1 (truncated) / 2 (invalid code)."""
    pos = 0
    bit = 8
    cur = np.uint64(0)
    for i in range(n):
        code = np.int64(0)
        L = 0
        while True:
            if bit == 8:
                if pos >= buf.size:
                    return 1, pos
                cur = np.uint64(buf[pos])
                pos += 1
                bit = 0
            b = np.int64((cur >> np.uint64(7 - bit)) & np.uint64(1))
            bit += 1
            code = (code << 1) | b
            L += 1
            if L > maxlen:
                return 2, pos
            off = code - first_code[L]
            if count[L] > 0 and off >= 0 and off < count[L]:
                out[i] = sorted_syms[first_index[L] + off]
                break
    return 0, pos


# ----------------------------------------------------------------------------- Huffman code
def huffman_lengths(counts: np.ndarray) -> np.ndarray:
    """Huffman code lengths for a histogram (0 for unused symbols; one used symbol gets length 0)."""
    counts = np.asarray(counts, dtype=np.int64)
    lengths = np.zeros(counts.size, np.int64)
    used = np.flatnonzero(counts)
    if used.size <= 1:
        return lengths
    heap = [(int(counts[s]), int(s), [int(s)]) for s in used]
    heapq.heapify(heap)
    while len(heap) > 1:
        c1, t1, s1 = heapq.heappop(heap)
        c2, t2, s2 = heapq.heappop(heap)
        merged = s1 + s2 if len(s1) >= len(s2) else s2 + s1
        lengths[merged] += 1
        heapq.heappush(heap, (c1 + c2, min(t1, t2), merged))
    if lengths.max() > MAX_CODE_LEN:
        raise ValueError(f"Huffman code longer than {MAX_CODE_LEN} bits (a pathological histogram)")
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical Huffman codes (uint64) for code lengths (symbols sorted by length, then index)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(lengths.size, np.uint64)
    order = sorted(np.flatnonzero(lengths).tolist(), key=lambda s: (lengths[s], s))
    code, prev = 0, 0
    for s in order:
        code <<= int(lengths[s]) - prev
        prev = int(lengths[s])
        codes[s] = code
        code += 1
    return codes


def _decoder_tables(lengths: np.ndarray):
    lengths = np.asarray(lengths, dtype=np.int64)
    maxlen = int(lengths.max()) if lengths.size else 0
    kraft = sum(2.0 ** -int(L) for L in lengths if L > 0)
    if kraft > 1.0 + 1e-12:
        raise ValueError(f"invalid Huffman code lengths in the message (Kraft sum {kraft:.4f} > 1)")
    order = np.array(sorted(np.flatnonzero(lengths).tolist(), key=lambda s: (lengths[s], s)), np.int64)
    count = np.zeros(maxlen + 2, np.int64)
    for L in lengths[lengths > 0]:
        count[L] += 1
    first_code = np.zeros(maxlen + 2, np.int64)
    first_index = np.zeros(maxlen + 2, np.int64)
    code, idx = 0, 0
    for L in range(1, maxlen + 1):
        code <<= 1
        first_code[L] = code
        first_index[L] = idx
        code += int(count[L])
        idx += int(count[L])
    return first_code, count, first_index, order, maxlen


def encode_codebook(lengths: np.ndarray, used: np.ndarray) -> np.ndarray:
    """The code lengths of the ``used`` bins as bytes: the smaller of a sparse list and a packed range
    (see the module doc). A single used bin has length 0 and is sent as a one-entry list."""
    sparse = np.empty((used.size, 3), np.uint8)
    sparse[:, 0] = used >> 8
    sparse[:, 1] = used & 0xFF
    sparse[:, 2] = lengths[used]
    best = np.concatenate([be_bytes("u1", CODEBOOK_SPARSE), be_bytes("u2", used.size), sparse.reshape(-1)])
    if used.size > 1:
        lo, hi = int(used[0]), int(used[-1])
        width = 4 if lengths.max() <= 15 else 8
        rng = np.concatenate([be_bytes("u1", CODEBOOK_RANGE), be_bytes("u1", width), be_bytes("u2", lo, hi),
                              pack_bits(lengths[lo:hi + 1], width)])
        if rng.size < best.size:
            best = rng
    return best


def decode_codebook(rd: Reader, nbits: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(code length per bin, used bins) from a message's codebook (inverse of encode_codebook)."""
    size = 1 << nbits
    lengths = np.zeros(size, np.int64)
    mode = int(rd.scalar("u1", "codebook mode"))
    if mode == CODEBOOK_SPARSE:
        k = int(rd.scalar("u2", "codebook size"))
        entries = rd.take(3 * k, "codebook").reshape(k, 3).astype(np.int64)
        used = entries[:, 0] << 8 | entries[:, 1]
        if k and used.max() >= size:
            raise ValueError(f"{what} codebook names bin {int(used.max())} of {size}")
        if np.unique(used).size != k:
            raise ValueError(f"{what} codebook lists a bin twice")
        lengths[used] = entries[:, 2]
    elif mode == CODEBOOK_RANGE:
        width = int(rd.scalar("u1", "codebook width"))
        if width not in (4, 8):
            raise ValueError(f"{what} codebook width {width} (valid: 4, 8)")
        lo, hi = int(rd.scalar("u2", "first bin")), int(rd.scalar("u2", "last bin"))
        if not lo <= hi < size:
            raise ValueError(f"{what} codebook range {lo}..{hi} outside the {size} bins")
        m = hi - lo + 1
        lengths[lo:hi + 1] = unpack_bits(rd.take(packed_size(m, width), "codebook"), width, m)
        used = np.flatnonzero(lengths)
    else:
        raise ValueError(f"unknown codebook mode {mode} in {what} message")
    return lengths, used


def huffman_encode(symbols: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The bitstream (bytes, MSB first, zero-padded) of ``symbols`` under the canonical code of
    ``lengths`` (from :func:`huffman_lengths`)."""
    sym = np.ascontiguousarray(symbols, dtype=np.int64).reshape(-1)
    lengths = np.asarray(lengths, dtype=np.int64)
    if sym.size and (sym.min() < 0 or sym.max() >= lengths.size):
        raise ValueError(f"symbols must lie in 0..{lengths.size - 1}")
    nbits = int(lengths[sym].sum()) if sym.size else 0
    out = np.empty((nbits + 7) // 8, np.uint8)
    _huffman_encode(sym, canonical_codes(lengths), lengths, out)
    return out


def huffman_decode(stream: np.ndarray, lengths: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`huffman_encode` for a code with at least two symbols: n symbols (int64)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    stream = np.ascontiguousarray(stream, dtype=np.uint8).reshape(-1)
    first_code, count, first_index, order, maxlen = _decoder_tables(lengths)
    q = np.empty(n, np.int64)
    err, used = _huffman_decode(stream, n, first_code, count, first_index, order, maxlen, q)
    if err == 1:
        raise ValueError(f"truncated Huffman bitstream: it ends before {n} symbols")
    if err == 2:
        raise ValueError("the Huffman bitstream holds a bit pattern that is not in the codebook")
    if used != stream.size:
        raise ValueError(f"Huffman bitstream has {stream.size - used} trailing byte(s)")
    return q


def entropy_bits(counts: np.ndarray) -> float:
    """Shannon entropy (bits) of a histogram."""
    c = np.asarray(counts, dtype=np.float64)
    tot = c.sum()
    if tot <= 0:
        return 0.0
    p = c[c > 0] / tot
    return float(-(p * np.log2(p)).sum())


# ----------------------------------------------------------------------------- codec
class EntropyAdaptiveHuffman(HostAggregated, ErrorFeedbackMixin, Codec):
    name = "eaq"
    wire_id = 15
    unbiased = False
    stochastic = True     # the entropy sample is random (the codes themselves are deterministic)
    description = ("entropy-adaptive uniform quantization (N = H + c bits per layer) with Huffman "
                   "coding, codebook in the message [" + HOST_AGGREGATED + "]")

    def __init__(self, F: float = 0.03, M: int = 4, c: float = 6.0, max_bits: int = 16,
                 min_sample: int = 64, error_feedback: bool = False, seed: int | None = 0):
        super().__init__(seed)
        if not 0 < F <= 1:
            raise ValueError(f"sample fraction F must be in (0, 1], got {F}")
        if not 1 <= int(M) <= 16:
            raise ValueError(f"preliminary bits M must be in 1..16, got {M}")
        if not 1 <= int(max_bits) <= 16:
            raise ValueError(f"max_bits must be in 1..16, got {max_bits}")
        if not c >= 0:
            raise ValueError(f"bit floor c must be >= 0, got {c}")
        self.F, self.M, self.c, self.max_bits = float(F), int(M), float(c), int(max_bits)
        self.min_sample = int(min_sample)
        self.last_bits: int | None = None      # N chosen for the last tensor
        self.last_entropy: float | None = None  # its entropy estimate H
        self._init_feedback(error_feedback)

    @property
    def bits_per_element(self) -> float:
        return float("nan")   # variable: see Encoded.bits_per_element

    def choose_bits(self, x32: np.ndarray, wmin: float, wmax: float) -> tuple[int, float]:
        """(N, H): the entropy estimate on a random F-sample quantized to M bits, N = ceil(H + c)."""
        n = x32.size
        ns = min(n, max(math.ceil(self.F * n), self.min_sample))
        sample = x32 if ns >= n else x32[self._rng.choice(n, ns, replace=False)]
        q = self._quantize(sample, wmin, wmax, self.M)
        h = entropy_bits(np.bincount(q, minlength=1 << self.M))
        nbits = int(min(self.max_bits, max(1, math.ceil(h + self.c - 1e-9))))
        return nbits, h

    @staticmethod
    def _quantize(x32, wmin, wmax, nbits):
        out = np.empty(x32.size, np.int64)
        _quantize(x32, float(wmin), EntropyAdaptiveHuffman._step(wmin, wmax, nbits), (1 << nbits) - 1, out)
        return out

    def compress(self, x, key=None) -> Encoded:
        x32 = to_numpy_f32(x)
        acc = self._accumulate(x32, key)
        finite_max_abs(acc)
        n = acc.size
        wmin = np.float32(acc.min()) if n else np.float32(0)
        wmax = np.float32(acc.max()) if n else np.float32(0)
        nbits, h = self.choose_bits(acc, wmin, wmax) if n else (1, 0.0)
        self.last_bits, self.last_entropy = nbits, h
        q = self._quantize(acc, wmin, wmax, nbits)
        counts = np.bincount(q, minlength=1 << nbits)
        lengths = huffman_lengths(counts)
        stream = huffman_encode(q, lengths)
        book = encode_codebook(lengths, np.flatnonzero(counts))
        msg = np.concatenate([be_bytes("u1", nbits), be_bytes("f4", wmin), be_bytes("f4", wmax), book, stream])
        if self.error_feedback:
            dec = np.empty(n, np.float32)
            _dequantize(q, float(wmin), self._step(wmin, wmax, nbits), dec)
            self._keep(key, acc - dec)
        return Encoded(self.name, msg, tuple(np.shape(x)), {}, like=x)

    @staticmethod
    def _step(wmin, wmax, nbits):
        return (float(wmax) - float(wmin)) / (1 << nbits)

    def decompress(self, enc: Encoded):
        n = element_count(enc.shape)
        rd = Reader(enc.codes, self.name)
        nbits, wmin, wmax = rd.bits_and_range("N", "w_min", "w_max")
        lengths, used = decode_codebook(rd, nbits, self.name)
        if lengths.max(initial=0) > MAX_CODE_LEN:
            raise ValueError(f"{self.name} codebook has a code of {int(lengths.max())} bits (max {MAX_CODE_LEN})")
        stream = rd.rest()
        if n == 0 or used.size == 1:      # one bin used: its code has length 0, no bitstream
            if n and lengths[used[0]] != 0:
                raise ValueError(f"{self.name} codebook has one bin with a code of positive length")
            if stream.size:
                raise ValueError(f"{self.name} message has {stream.size} trailing byte(s)")
            q = np.full(n, used[0] if n else 0, np.int64)
        else:
            if used.size == 0 or np.any(lengths[used] == 0):
                raise ValueError(f"{self.name} codebook lists {used.size} bins, some without a code, "
                                 f"for {n} values")
            try:
                q = huffman_decode(stream, lengths, n)
            except ValueError as e:
                raise ValueError(f"{self.name} message: {e}") from None
        out = np.empty(n, np.float32)
        _dequantize(q, wmin, self._step(wmin, wmax, nbits), out)
        return from_numpy_like(out, enc.like, enc.shape)


__all__ = ["EntropyAdaptiveHuffman", "huffman_lengths", "canonical_codes", "huffman_encode", "huffman_decode",
           "entropy_bits"]
