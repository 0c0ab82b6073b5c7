"""Independent numpy model of the codecs' counter-based random stream (``ina.compression.kernels``):
element i of stream s is lowbias32(i * 0x9E3779B9 + s) in 32-bit arithmetic. Tests compare the numba
kernels with it."""
from __future__ import annotations

import numpy as np


def lowbias32(x: np.ndarray) -> np.ndarray:
    """Chris Wellons' lowbias32 hash of 32-bit values (uint64 arithmetic, masked)."""
    x = x.astype(np.uint64) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def random_u32(n: int, seed: int) -> np.ndarray:
    """The first n numbers of stream ``seed`` (any integer seed; taken modulo 2**32)."""
    i = np.arange(n, dtype=np.uint64)
    return lowbias32((i * np.uint64(0x9E3779B9) + np.uint64(int(seed) & 0xFFFFFFFF)) & np.uint64(0xFFFFFFFF))


def uniform(n: int, seed: int) -> np.ndarray:
    """The stream as uniform numbers in [0, 1)."""
    return random_u32(n, seed).astype(np.float64) * 2.0**-32
