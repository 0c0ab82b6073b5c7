"""Fused numba loops for the codecs' hot paths.

Each loop is branch-free over elements (selects, not jumps) so that LLVM vectorises it. Random
numbers for stochastic rounding come from a counter-based hash (``lowbias32`` of seed and index):
no state is carried between elements, so the loop stays vectorisable and a fixed seed gives the
same codes on any machine.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_U32 = np.uint32(0xFFFFFFFF)


@njit(inline="always")
def _hash32(x):
    # lowbias32 (Chris Wellons): a well-mixed 32-bit integer hash, used as a counter-based RNG.
    x = np.uint32(x)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


@njit(cache=True)
def random_u32(n, seed):
    """The hash stream itself (exposed for statistical tests of the generator)."""
    out = np.empty(n, np.uint32)
    s = np.uint32(seed)
    for i in range(n):
        out[i] = _hash32(np.uint32(i) * np.uint32(0x9E3779B9) + s)
    return out


@njit(cache=True)
def nc_encode(x, bits, e_low, window, seed, deterministic, out):
    """Natural compression of float32 ``x`` (``bits`` is the same memory viewed as uint32) to 8-bit codes.

    code = sign << 7 | k, k in 1..window means magnitude 2**(e_low + k - 1); k = 0 means zero.
    In-window values round to one of their two neighbouring powers of two with the unbiased
    probabilities of C_nat (or to the nearer one when ``deterministic``). Values below the window
    round to 0 or 2**e_low, unbiased (probability |x| / 2**e_low), instead of being flushed to zero.
    Returns (number of non-finite inputs, number of values above the window).
    """
    n = bits.size
    s = np.uint32(seed)
    scale_low = 2.0 ** (-e_low)            # float64, exact
    bad = 0
    above = 0
    for i in range(n):
        b = bits[i]
        sign = (b >> np.uint32(31)) & np.uint32(1)
        ef = np.int64((b >> np.uint32(23)) & np.uint32(0xFF))
        m = b & np.uint32(0x7FFFFF)
        r = _hash32(np.uint32(i) * np.uint32(0x9E3779B9) + s)
        if deterministic:
            up = np.int64(m >= np.uint32(0x400000))          # nearer power of two (ties up)
            sub_u = 0.5
        else:
            up = np.int64((r & np.uint32(0x7FFFFF)) < m)     # P(up) = m / 2**23, exactly
            sub_u = np.float64(r) * 2.3283064365386963e-10  # r / 2**32
        k = ef - 127 - e_low + 1 + up                       # in-window exponent code
        # below the window (including zero and denormals): 0 or 2**e_low, unbiased
        p = abs(np.float64(x[i])) * scale_low
        k_sub = np.int64(sub_u < p)
        inwin = (ef - 127) >= e_low
        kk = k if inwin else k_sub
        bad += np.int64(ef == 255)
        above += np.int64(kk > window)
        kk = min(kk, window)
        out[i] = np.uint8((sign << np.uint32(7)) | np.uint32(kk)) if kk > 0 else np.uint8(0)
    return bad, above


@njit(cache=True)
def nc_decode(codes, e_low, out):
    """8-bit natural-compression codes to float32 (sign * 2**(e_low + k - 1); k = 0 is zero)."""
    n = codes.size
    fast = (e_low + 127 >= 1) and (e_low + 127 + 126 <= 254)
    if fast:
        base = np.uint32(e_low + 127 - 1)
        ob = out.view(np.uint32)
        for i in range(n):
            c = np.uint32(codes[i])
            k = c & np.uint32(0x7F)
            v = ((c & np.uint32(0x80)) << np.uint32(24)) | ((k + base) << np.uint32(23))
            ob[i] = v if k != 0 else np.uint32(0)
    else:
        for i in range(n):
            c = np.int64(codes[i])
            k = c & 0x7F
            mag = np.float32(2.0 ** (e_low + k - 1)) if k != 0 else np.float32(0.0)
            out[i] = -mag if (c & 0x80) else mag


@njit(cache=True)
def nc_operator(bits, seed, deterministic, out_bits):
    """C_nat itself on float32 bits, no exponent window: mantissa dropped, exponent +1 when rounding up.

    Returns (non-finite count, overflow count, denormal count); denormals are left to the caller.
    """
    n = bits.size
    s = np.uint32(seed)
    bad = 0
    over = 0
    den = 0
    for i in range(n):
        b = bits[i]
        ef = (b >> np.uint32(23)) & np.uint32(0xFF)
        m = b & np.uint32(0x7FFFFF)
        r = _hash32(np.uint32(i) * np.uint32(0x9E3779B9) + s)
        if deterministic:
            up = np.uint32(m >= np.uint32(0x400000))
        else:
            up = np.uint32((r & np.uint32(0x7FFFFF)) < m)
        bad += np.int64(ef == np.uint32(255))
        over += np.int64((ef == np.uint32(254)) & (up == np.uint32(1)))
        den += np.int64((ef == np.uint32(0)) & (m != np.uint32(0)))
        out_bits[i] = (b & np.uint32(0xFF800000)) + (up << np.uint32(23))
    return bad, over, den


@njit(cache=True)
def max_abs_exponent(bits):
    """(largest biased exponent field of finite values, count of non-finite values) of float32 bits."""
    mx = np.uint32(0)
    bad = 0
    for i in range(bits.size):
        ef = (bits[i] >> np.uint32(23)) & np.uint32(0xFF)
        bad += np.int64(ef == np.uint32(255))
        if ef != np.uint32(255) and ef > mx:
            mx = ef
    return np.int64(mx), bad


@njit(cache=True)
def bfp_encode(x, scale, out):
    """Block floating point: int32 codes = rint(x * scale) in float64 (round half to even)."""
    for i in range(x.size):
        out[i] = np.int32(np.rint(np.float64(x[i]) * scale))


@njit(cache=True)
def int_sum_decode(codes, inv_scale, out):
    for i in range(codes.size):
        out[i] = np.float32(np.float64(codes[i]) * inv_scale)


@njit(cache=True)
def dither_encode(x, inv_norm, levels, natural, seed, out):
    """General dithering (seed 004, Definition 3) of ``x`` to signed level indices.

    y = |x| * inv_norm in [0, 1]. Natural dithering uses levels 2**-(s-1), ..., 1/2, 1 (and 0);
    standard dithering uses 0, 1/s, ..., 1. ``out[i]`` = sign * level index (0..s); unbiased.
    """
    s = np.uint32(seed)
    smax = levels
    for i in range(x.size):
        v = np.float64(x[i])
        y = min(abs(v) * inv_norm, 1.0)
        u = np.float64(_hash32(np.uint32(i) * np.uint32(0x9E3779B9) + s)) * 2.3283064365386963e-10
        if natural:
            # level j (1..s) has value 2**(j - s); level 0 is 0
            if y <= 0.0:
                j = 0
            else:
                e = np.floor(np.log2(y))             # y in [2**e, 2**(e+1))
                lo_j = np.int64(e) + smax            # level index of 2**e
                if lo_j >= smax:                     # y == 1
                    j = smax
                elif lo_j >= 1:
                    lo = 2.0 ** e
                    j = lo_j + np.int64(u < (y - lo) / lo)
                else:                                # below the smallest level: 0 or 2**(1-s)
                    j = np.int64(u < y / 2.0 ** (1 - smax))
        else:
            t = y * smax
            fl = np.floor(t)
            j = np.int64(fl) + np.int64(u < (t - fl))
            if j > smax:
                j = smax
        out[i] = np.int8(-j if v < 0 else j)


@njit(cache=True)
def dither_decode(codes, norm, levels, natural, out):
    for i in range(codes.size):
        j = np.int64(codes[i])
        a = abs(j)
        if natural:
            mag = 0.0 if a == 0 else 2.0 ** (a - levels)
        else:
            mag = a / levels
        out[i] = np.float32(norm * mag if j >= 0 else -norm * mag)
