"""Fused numba loops for the codecs' hot paths.

Each loop is branch-free over elements (selects, not jumps) and works on the float's bits with
32-bit integer operations, so that LLVM vectorises it (``experiments/bench_codecs.py`` measures
them). Random numbers for stochastic rounding come from a counter-based hash (``lowbias32`` of
seed and index): no state is carried between elements, so the loop stays vectorisable and a fixed
seed gives the same codes on any machine.

Numba widens arithmetic on 32-bit integers to 64 bits, which halves the vector lanes (and once
made the "32-bit" hash a 64-bit one, with random numbers far outside [0, 2**32)). So the hash is
written directly in LLVM IR on i32 (``_rand``), the exponent arithmetic and variable shifts use the
small 32-bit intrinsics ``iadd``/``isub``/``uadd``/``usub``/``ushl``/``ushr``, bit operations are
truncated with ``np.uint32(...)``, and error conditions are max-reductions (one vector op) instead
of counters; the callers count offending inputs with numpy only when there is an error.

Probabilities: in-window natural-compression rounding is exact (23 random bits against the 23-bit
mantissa). Where a probability has more bits than that (values below the exponent window,
dithering), it is rounded up to a multiple of 2**-32: the deviation is below 2**-32 of one level
step, and a nonzero value never has probability 0 of surviving.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# -- scalar bit casts (the float's bits, without going through memory) ----------------------------
def _bitcast(src, dst):
    @intrinsic
    def cast(typingctx, x):
        if x != src:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(dst))

        return dst(src), codegen

    return cast


f32_bits = _bitcast(types.float32, types.uint32)
bits_f32 = _bitcast(types.uint32, types.float32)
f64_bits = _bitcast(types.float64, types.uint64)


# -- 32-bit integer arithmetic (numba would widen it to 64 bits and halve the vector lanes) --------
def _binop32(opname, result):
    @intrinsic
    def op(typingctx, a, b):
        if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            vals = []
            for v, t in zip(args, (a, b)):
                if t.bitwidth > 32:
                    v = builder.trunc(v, i32)
                elif t.bitwidth < 32:
                    v = (builder.sext if t.signed else builder.zext)(v, i32)
                vals.append(v)
            return getattr(builder, opname)(*vals)

        return result(a, b), codegen

    return op


iadd = _binop32("add", types.int32)     # wrapping int32 a + b
isub = _binop32("sub", types.int32)     # wrapping int32 a - b
uadd = _binop32("add", types.uint32)    # wrapping uint32 a + b
usub = _binop32("sub", types.uint32)    # wrapping uint32 a - b
ushl = _binop32("shl", types.uint32)    # uint32 a << b (b must be < 32)
ushr = _binop32("lshr", types.uint32)   # uint32 a >> b (b must be < 32)


def _lowbias32_ir(builder, x):
    """lowbias32 (Chris Wellons) on an LLVM i32: a well-mixed 32-bit hash, our counter-based RNG."""
    i32 = ir.IntType(32)
    x = builder.xor(x, builder.lshr(x, ir.Constant(i32, 16)))
    x = builder.mul(x, ir.Constant(i32, 0x7FEB352D))
    x = builder.xor(x, builder.lshr(x, ir.Constant(i32, 15)))
    x = builder.mul(x, ir.Constant(i32, 0x846CA68B))
    return builder.xor(x, builder.lshr(x, ir.Constant(i32, 16)))


# -- the counter-based random stream (the only one of the codecs) ---------------------------------
STREAM_STEP = 0x9E3779B9     # element i of stream s is lowbias32(i * STREAM_STEP + s), in 32 bits


@njit(cache=True)
def stream_seed(seed, first):
    """The stream under which element 0 draws what element ``first`` of stream ``seed`` draws.

    Encoding elements ``first ..`` of a tensor under ``stream_seed(seed, first)`` draws exactly the
    random numbers a whole-tensor encode under ``seed`` draws for them (how the allreduce client
    encodes a tensor block by block, or chunk by chunk, and still matches a whole-tensor encode).
    Compiled, for the kernels that encode chunk by chunk; from Python it returns an int.
    """
    return (np.uint64(seed) + np.uint64(STREAM_STEP) * np.uint64(first)) & np.uint64(0xFFFFFFFF)


@intrinsic
def _rand(typingctx, i, s):
    """The i-th 32-bit random number of stream s: lowbias32(i * STREAM_STEP + s) in 32-bit arithmetic.

    Written as LLVM IR because numba would widen the multiplications to 64 bits, which halves the
    vector lanes (and needs the slow 64-bit vector multiply).
    """
    if not isinstance(i, types.Integer) or not isinstance(s, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        x = builder.trunc(args[0], i32) if i.bitwidth > 32 else builder.zext(args[0], i32) if i.bitwidth < 32 else args[0]
        seed = builder.trunc(args[1], i32) if s.bitwidth > 32 else builder.zext(args[1], i32) if s.bitwidth < 32 else args[1]
        x = builder.add(builder.mul(x, ir.Constant(i32, STREAM_STEP)), seed)
        return _lowbias32_ir(builder, x)

    return types.uint32(i, s), codegen


@njit(inline="always")
def uniform01(i, seed):
    """A uniform number in [0, 1) for element ``i`` of the stream ``seed`` (2**-32 resolution)."""
    return np.float64(_rand(i, seed)) * 2.3283064365386963e-10


@njit(cache=True)
def random_u32(n, seed):
    """The hash stream itself (exposed for statistical tests of the generator)."""
    out = np.empty(n, np.uint32)
    s = np.uint32(seed)
    for i in range(n):
        out[i] = _rand(i, s)
    return out


@njit(cache=True)
def nc_encode(x, e_low, window, seed, deterministic, out):
    """Natural compression of float32 ``x`` to 8-bit codes in ``out``.

    code = sign << 7 | k, k in 1..window means magnitude 2**(e_low + k - 1); k = 0 means zero.
    In-window values round to one of their two neighbouring powers of two with the unbiased
    probabilities of C_nat (or to the nearer one when ``deterministic``, ties up). Values below the
    window round to 0 or 2**e_low, unbiased (probability |x| / 2**e_low), instead of being flushed
    to zero (deterministic: to the nearer of the two, ties to 0). Denormal inputs are exact too.

    Returns (largest exponent field seen, largest code k before clipping to the window): the first
    is 255 if there was a NaN or Inf, the second exceeds ``window`` if a value rounded above the
    window's top (the caller raises in both cases; the codes are then meaningless).
    """
    n = x.size
    s = np.uint32(seed)
    c_k = np.int32(126 + e_low)      # k = e - c_k + up for exponent field e
    c_in = np.int32(127 + e_low)     # in the window: exponent field >= c_in
    c_sh = np.int32(118 + e_low)     # below it: |x| / 2**e_low * 2**32 = M << (e - c_sh)
    win = np.int32(window)
    zero = np.int32(0)
    mx_ef = np.int32(0)
    mx_k = np.int32(0)
    for i in range(n):
        b = f32_bits(x[i])
        ef = np.int32(ushr(b, 23) & np.uint32(0xFF))
        m = np.uint32(b & np.uint32(0x7FFFFF))
        r = _rand(i, s)
        normal = ef != zero
        # a denormal m * 2**-149 is 2**(e2 - 276) * (1 + m2 / 2**23) where e2, m2 are float32(m)'s fields
        fb = f32_bits(np.float32(m))
        e_eff = ef if normal else isub(np.int32(ushr(fb, 23)), np.int32(149))
        m_eff = m if normal else np.uint32(fb & np.uint32(0x7FFFFF))
        # in the window: exponent code, one step up with probability m / 2**23 (exact)
        ui = np.uint32(0x3FFFFF) if deterministic else np.uint32(r & np.uint32(0x7FFFFF))
        k = isub(iadd(e_eff, np.int32(ui < m_eff)), c_k)
        # below the window: |x| = M * 2**(max(e, 1) - 150); code 1 with probability t / 2**32,
        # t = ceil(|x| / 2**e_low * 2**32) computed exactly with shifts
        big_m = np.uint32(m | (np.uint32(0x800000) if normal else np.uint32(0)))
        sh = isub(max(ef, np.int32(1)), c_sh)
        ls = min(max(sh, zero), np.int32(31))
        rs = min(max(isub(zero, sh), zero), np.int32(31))
        t = ushr(uadd(ushl(big_m, ls), usub(ushl(np.uint32(1), rs), 1)), rs)
        us = np.uint32(0x80000000) if deterministic else r
        kk = k if e_eff >= c_in else np.int32(us < t)
        mx_ef = max(mx_ef, ef)
        mx_k = max(mx_k, kk)
        kk = min(kk, win)
        out[i] = np.uint8(np.uint32(ushr(b, 24) & np.uint32(0x80)) | np.uint32(kk)) if kk > zero else np.uint8(0)
    return mx_ef, mx_k


@njit(cache=True)
def nc_decode(codes, e_low, out):
    """8-bit natural-compression codes to float32 (sign * 2**(e_low + k - 1); k = 0 is zero)."""
    n = codes.size
    if (e_low + 127 >= 1) and (e_low + 127 + 126 <= 254):
        # every level is a normal float32: build its bits directly
        base = np.uint32(e_low + 127 - 1)
        for i in range(n):
            c = np.uint32(codes[i])
            k = np.uint32(c & np.uint32(0x7F))
            v = np.uint32(np.uint32((c & np.uint32(0x80)) << np.uint32(24)) | np.uint32((k + base) << np.uint32(23)))
            out[i] = bits_f32(v if k != 0 else np.uint32(0))
    else:
        # levels beyond float32's normal range (denormal, zero or inf): a table of all 256 codes
        lut = _nc_table(e_low)
        for i in range(n):
            out[i] = lut[np.int64(codes[i])]


@njit(cache=True)
def nc_decode_rows(payload, which, e_low, out, rows):
    """nc_decode of ``payload[which[i]]`` (rows of codes, e.g. in the receive ring) into ``out[rows[i]]``."""
    for i in range(rows.size):
        nc_decode(payload[which[i]], e_low, out[rows[i]])


@njit(cache=True)
def _nc_table(e_low):
    lut = np.zeros(256, np.float32)
    for c in range(256):
        k = c & 0x7F
        if k:
            mag = np.float32(2.0 ** (e_low + k - 1))
            lut[c] = -mag if c & 0x80 else mag
    return lut


@njit(cache=True)
def nc_operator(bits, seed, deterministic, out_bits):
    """C_nat itself on float32 bits, no exponent window: mantissa dropped, exponent +1 when rounding up.

    Returns (largest exponent field, largest exponent field after rounding up, largest mantissa of
    a denormal): 255 in the first means NaN/Inf, 255 in the second an overflow to Inf, nonzero in
    the third that denormals are present (they are left to the caller).
    """
    n = bits.size
    s = np.uint32(seed)
    mx_ef = np.uint32(0)
    mx_up = np.uint32(0)
    mx_den = np.uint32(0)
    for i in range(n):
        b = bits[i]
        ef = np.uint32(ushr(b, 23) & np.uint32(0xFF))
        m = np.uint32(b & np.uint32(0x7FFFFF))
        ui = np.uint32(0x3FFFFF) if deterministic else np.uint32(_rand(i, s) & np.uint32(0x7FFFFF))
        up = np.uint32(1) if ui < m else np.uint32(0)
        mx_ef = max(mx_ef, ef)
        mx_up = max(mx_up, uadd(ef, up))
        mx_den = max(mx_den, m if ef == np.uint32(0) else np.uint32(0))
        out_bits[i] = uadd(b & np.uint32(0xFF800000), ushl(up, 23))
    return mx_ef, mx_up, mx_den


@njit(cache=True)
def max_abs_exponent(bits):
    """(largest biased exponent field of finite values, count of non-finite values) of float32 bits."""
    mx = np.uint32(0)
    bad = 0
    for i in range(bits.size):
        ef = np.uint32((bits[i] >> np.uint32(23)) & np.uint32(0xFF))
        finite = ef != np.uint32(255)
        bad += np.int64(not finite)
        mx = max(mx, ef if finite else np.uint32(0))
    return np.int64(mx), bad


@njit(cache=True)
def bfp_encode(x, scale, out):
    """Block floating point: int32 codes = rint(x * scale) in float64 (round half to even).

    Returns the number of values whose code would not fit in an int32 (they are saturated; the
    caller raises, since it means the shared exponent was smaller than this tensor's).
    """
    lim = 2147483647.0
    above = 0
    for i in range(x.size):
        v = np.rint(np.float64(x[i]) * scale)
        above += np.int64(abs(v) > lim)
        out[i] = np.int32(min(max(v, -lim), lim))
    return above


@njit(cache=True)
def nc_encode_rows(x, e_low, window, seed, deterministic, dst, stride, rows, chunks, at, elements):
    """nc_encode of chunks straight into packet rows: the codes of elements ``chunks[q] * elements ..``
    of ``x`` go to ``dst[rows[q] * stride + at ..]`` (``dst``: the packet ring's bytes, flat), zero
    past the end of ``x``. Each chunk draws what a whole-tensor encode under ``seed`` draws for its
    elements (stream_seed). Returns nc_encode's (largest exponent field, largest code k) over them."""
    n = x.size
    mx_ef, mx_k = np.int32(0), np.int32(0)
    for q in range(rows.size):
        lo = chunks[q] * elements
        hi = min(n, lo + elements)
        o = rows[q] * stride + at
        ef, k = nc_encode(x[lo:hi], e_low, window, stream_seed(seed, lo), deterministic, dst[o:o + hi - lo])
        mx_ef, mx_k = max(mx_ef, ef), max(mx_k, k)
        dst[o + hi - lo:o + elements] = 0
    return mx_ef, mx_k


@njit(cache=True)
def int_sum_decode(codes, inv_scale, out):
    for i in range(codes.size):
        out[i] = np.float32(np.float64(codes[i]) * inv_scale)


@njit(cache=True)
def int32_be_decode_rows(payload, which, inv_scale, out, rows):
    """int_sum_decode of big-endian int32 sums (``payload``: rows of bytes, e.g. the receive ring's
    payloads) of row ``which[i]`` into ``out[rows[i]]``."""
    for i in range(rows.size):
        src, dst = payload[which[i]], out[rows[i]]
        for e in range(dst.size):
            b = 4 * e
            v = (np.int64(src[b]) << 24) | (np.int64(src[b + 1]) << 16) | (np.int64(src[b + 2]) << 8) | np.int64(src[b + 3])
            v = v - (np.int64(1) << 32) if v >= (np.int64(1) << 31) else v
            dst[e] = np.float32(np.float64(v) * inv_scale)


@njit(cache=True)
def dither_encode(x, inv_norm, levels, natural, seed, out, sign_magnitude=False):
    """General dithering (seed 004, Definition 3) of ``x`` to signed level indices.

    y = |x| * inv_norm in [0, 1]. Natural dithering uses levels 2**-(s-1), ..., 1/2, 1 (and 0);
    standard dithering uses 0, 1/s, ..., 1. ``out[i]`` = sign * level index (0..s); unbiased.
    With ``sign_magnitude`` the code is instead sign << 7 | level index (an NC8 code; zero is 0).
    """
    s = np.uint32(seed)
    sm = np.int64(levels)
    fs = np.float64(levels)
    below_scale = 2.0 ** (levels + 31)       # y / 2**(1-s) * 2**32
    two32 = 4294967296.0
    for i in range(x.size):
        v = np.float64(x[i])
        y = min(abs(v) * inv_norm, 1.0)
        r = np.uint64(_rand(i, s))
        if natural:
            # y in [2**e, 2**(e+1)): level e + s, one step up with probability y / 2**e - 1
            yb = f64_bits(y)
            lo_j = np.int64(yb >> np.uint64(52)) - 1023 + sm
            t_in = (yb & np.uint64(0xFFFFFFFFFFFFF)) + np.uint64(0xFFFFF)
            j_in = lo_j + np.int64(r < (t_in >> np.uint64(20)))
            # below the smallest level 2**(1-s): 0 or level 1, with probability y / 2**(1-s)
            t_below = np.uint64(np.ceil(min(y * below_scale, two32)))
            j = j_in if lo_j >= 1 else np.int64(r < t_below)
        else:
            t = y * fs
            fl = np.floor(t)
            j = min(np.int64(fl) + np.int64(r < np.uint64(np.ceil((t - fl) * two32))), sm)
        if sign_magnitude:
            out[i] = np.uint8(j | 0x80) if (v < 0) & (j > 0) else np.uint8(j)
        else:
            out[i] = np.int8(-j if v < 0 else j)


@njit(cache=True)
def dither_decode(codes, norm, levels, natural, out):
    lut = np.empty(256, np.float32)
    for c in range(256):
        j = c if c < 128 else c - 256
        a = abs(j)
        if natural:
            mag = 0.0 if a == 0 else 2.0 ** (a - levels)
        else:
            mag = a / levels
        lut[c] = np.float32(norm * mag if j >= 0 else -norm * mag)
    for i in range(codes.size):
        out[i] = lut[np.uint8(codes[i])]


@njit(cache=True, fastmath={"reassoc"})
def sum_abs(x):
    """sum |x| in float64 (the 1-norm); reassociated so that it vectorises."""
    acc = 0.0
    for i in range(x.size):
        acc += abs(np.float64(x[i]))
    return acc


@njit(cache=True, fastmath={"reassoc"})
def sum_squares(x):
    """sum x**2 in float64 (the squared 2-norm); reassociated so that it vectorises."""
    acc = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        acc += v * v
    return acc
