"""QSGD (Alistarh et al., NeurIPS 2017): random dithering of |x| / ||x||_2 to s uniform levels, with
Elias coding of the levels.

The quantizer is exactly the project's standard random dithering ("rd") with p = 2: each
y_i = |x_i| / ||x||_2 is rounded, unbiased, to one of its neighbouring levels l/s (variance at most
min(n / s**2, sqrt(n) / s) ||x||_2**2 in total, QSGD's Lemma 3.1). So the switch path is rd's
(int8 level indices with a shared power-of-two norm bound, summed as integers) and this class only
adds QSGD's own message for ``compress``: the levels Elias-gamma coded, which is what makes QSGD
cheap when most levels are 0:
    f4 ||x||_2 | u1 s | per element: gamma(|l| + 1), then a sign bit if l != 0 (MSB first, zero-padded)
A zero level costs 1 bit, level 1 costs 4 bits. (QSGD's sparse variant also codes the gaps
between non-zeros; with the dense form here the cost is at most 1 + 2 floor(log2(s + 1)) + 1 bits.)
The message is variable length: ``compress`` output needs the host-aggregator mode, the switch path
does not.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .encoding import Reader, be_bytes, element_count
from .base import Encoded, max_exponent, to_numpy_f32
from .dithering import RandomDithering, p_norm


@njit(cache=True)
def _gamma_bits(levels):
    total = 0
    for i in range(levels.size):
        v = abs(np.int64(levels[i])) + 1
        nb = 0
        while (v >> nb) > 1:
            nb += 1
        total += 2 * nb + 1 + (1 if v > 1 else 0)
    return total


@njit(cache=True)
def _gamma_encode(levels, out):
    pos = 0       # bit position
    for i in range(levels.size):
        lv = np.int64(levels[i])
        v = abs(lv) + 1
        nb = 0
        while (v >> nb) > 1:
            nb += 1
        pos += nb                                   # nb zeros (out is zero-initialised)
        for b in range(nb, -1, -1):                 # v in nb + 1 bits
            if (v >> b) & 1:
                out[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
            pos += 1
        if v > 1:
            if lv < 0:
                out[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
            pos += 1
    return pos


@njit(cache=True)
def _gamma_decode(buf, n, smax, out):
    """Returns (error, bits read): error 1 truncated, 2 level above s."""
    nbits = buf.size * 8
    pos = 0
    for i in range(n):
        nb = 0
        while True:
            if pos >= nbits:
                return 1, pos
            if (buf[pos >> 3] >> (7 - (pos & 7))) & 1:
                break
            nb += 1
            pos += 1
            if nb > 16:
                return 2, pos
        v = 0
        for _ in range(nb + 1):
            if pos >= nbits:
                return 1, pos
            v = (v << 1) | ((buf[pos >> 3] >> (7 - (pos & 7))) & 1)
            pos += 1
        lv = v - 1
        if lv > smax:
            return 2, pos
        if lv > 0:
            if pos >= nbits:
                return 1, pos
            if (buf[pos >> 3] >> (7 - (pos & 7))) & 1:
                lv = -lv
            pos += 1
        out[i] = np.int8(lv)
    return 0, pos


class QSGD(RandomDithering):
    name = "qsgd"
    wire_id = 19
    variable_length = True     # of compress(); the switch path is rd's fixed int8
    aggregation = "switch"
    label = "switch-feasible (as rd: int8 levels, shared norm bound); compress(): Elias-coded, host"
    description = "QSGD: random dithering to s levels of ||x||_2, Elias-gamma coded levels (switch path: rd)"

    def __init__(self, levels: int = 8, seed: int | None = 0):
        super().__init__(levels=levels, p=2.0, seed=seed)

    def compress(self, x) -> Encoded:
        x32 = to_numpy_f32(x)
        max_exponent(x32)  # raises on NaN/Inf
        norm = np.float32(p_norm(x32, 2.0))
        inv = 0.0 if norm == 0 else 1.0 / float(norm)
        lv = self._levels_encode(x32, inv, self.next_seed())
        nbits = _gamma_bits(lv)
        stream = np.zeros((nbits + 7) // 8, np.uint8)
        _gamma_encode(lv, stream)
        msg = np.concatenate([be_bytes("f4", norm), be_bytes("u1", self.levels), stream])
        return Encoded(self.name, msg, tuple(np.shape(x)), {}, like=x)

    def decompress(self, enc: Encoded):
        n = element_count(enc.shape)
        rd = Reader(enc.codes, self.name)
        norm = float(np.float32(rd.scalar("f4", "norm")))
        s = int(rd.scalar("u1", "levels"))
        if s != self.levels:
            raise ValueError(f"{self.name} message has s = {s} levels, this codec uses {self.levels}")
        stream = rd.rest()
        lv = np.empty(n, np.int8)
        err, used = _gamma_decode(stream, n, s, lv)
        if err == 1:
            raise ValueError(f"truncated {self.name} message: the Elias stream ends before {n} values")
        if err == 2:
            raise ValueError(f"{self.name} message holds a level above s = {s}")
        if (used + 7) // 8 != stream.size:
            raise ValueError(f"{self.name} message has {stream.size - (used + 7) // 8} trailing byte(s)")
        # the levels decode exactly as rd's codes do
        return super().decompress(Encoded(self.name, lv, enc.shape, {"norm": norm}, like=enc.like))


__all__ = ["QSGD"]
