"""Codecs of issue 2: natural compression (C_nat, nc, nc-det), natural vs standard dithering, block
floating point; the registry; input types; bad input. Statistical properties are tested with fixed
seeds against the definitions and theorems of seed 004 (natural compression, Horvath et al.)."""
from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

import ina.compression as C
from ina.compression import kernels as K
from ina.compression.base import ScaleContext
from ina.compression.bfp import INT32_MAX, bfp_scale
from ina.compression.natural import exponent_window, window_low

sys.path.insert(0, os.path.dirname(__file__))
from rng_reference import lowbias32  # noqa: E402

ISSUE2_CODECS = ["nc", "nc-det", "bfp32", "nd", "rd"]
TRIALS = 400
Z = 4.0  # "within 4 standard errors"


# ------------------------------------------------------------------------------------------------
# Test tensors: Gaussian, heavy-tailed, and real gradients of a small model on sklearn's digits
# ------------------------------------------------------------------------------------------------
def _digits_gradient() -> np.ndarray:
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(30):  # a partly trained model: gradients are small and varied, not initial noise
        idx = slice(32 * step, 32 * step + 32)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(X[1000:1064]), y[1000:1064]).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    cauchy = np.clip(rng.standard_cauchy(6000), -1e6, 1e6)
    return {
        "gaussian": rng.standard_normal(6000).astype(np.float32),
        "student_t1.5": (rng.standard_t(1.5, 6000) * 1e-3).astype(np.float32),
        "cauchy_clipped": cauchy.astype(np.float32),
        "digits_gradient": _digits_gradient(),
    }


TENSORS = _tensors()


def _nat_bounds(x: np.ndarray):
    """The two powers of two around |x| (lo <= |x| < 2 lo), as float64, from frexp."""
    a = np.abs(x.astype(np.float64))
    m, e = np.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    lo = np.where(a > 0, np.ldexp(1.0, e - 1), 0.0)
    return a, lo, 2 * lo


def _assert_unbiased(x: np.ndarray, samples: np.ndarray, what: str):
    """samples: (trials, d) float64 outputs of an unbiased operator on x. Checks several error
    statistics, each within Z standard errors of 0: the mean relative error overall, per sign and per
    position in the binade (bias that depends on the mantissa), and the error of the sum."""
    x64 = x.astype(np.float64)
    nz = x64 != 0
    rel = (samples[:, nz] - x64[nz]) / np.abs(x64[nz])
    a, lo, _ = _nat_bounds(x[nz])
    frac = a / lo - 1
    groups = {"all": np.ones(nz.sum(), bool), "positive": x64[nz] > 0, "negative": x64[nz] < 0}
    for b in range(4):
        groups[f"mantissa bin {b}"] = (frac >= b / 4) & (frac < (b + 1) / 4)
    for name, g in groups.items():
        r = rel[:, g].ravel()
        if r.size < 100:
            continue
        se = r.std() / math.sqrt(r.size)
        assert abs(r.mean()) <= Z * se + 1e-12, f"{what}: {name}: mean relative error {r.mean():.3g} > {Z} SE ({se:.3g})"
    err_sum = (samples - x64).sum(axis=1)  # the error of the aggregate, what an allreduce sees
    se = err_sum.std() / math.sqrt(err_sum.size)
    assert abs(err_sum.mean()) <= Z * se + 1e-300, f"{what}: error of the sum {err_sum.mean():.3g} > {Z} SE ({se:.3g})"


def _assert_second_moment(x: np.ndarray, samples: np.ndarray, what: str):
    """E||C(x)||^2 <= 9/8 ||x||^2 (seed 004, Theorem 1), and equal to its exact value for C_nat."""
    x64 = x.astype(np.float64)
    ratio = (samples**2).sum(axis=1) / (x64**2).sum()
    a, lo, hi = _nat_bounds(x)
    p_up = np.where(a > 0, (a - lo) / np.where(lo > 0, lo, 1.0), 0.0)
    exact = ((lo**2 * (1 - p_up) + hi**2 * p_up).sum()) / (x64**2).sum()
    se = ratio.std() / math.sqrt(ratio.size)
    assert exact <= 9 / 8 + 1e-12
    assert abs(ratio.mean() - exact) <= Z * se, f"{what}: second moment {ratio.mean():.6f} vs exact {exact:.6f} (SE {se:.2g})"
    assert ratio.mean() <= 9 / 8, f"{what}: second moment ratio {ratio.mean():.6f} above 9/8"


def _natural_compression_samples(x):
    return np.stack([C.natural_compression(x, seed=1000 + t).astype(np.float64) for t in range(TRIALS)])


def _nc_codec_samples(x):
    codec = C.get("nc", seed=77)  # its generator draws a new seed per call
    return np.stack([codec.roundtrip(x).astype(np.float64) for _ in range(TRIALS)])


def _nc_switch_samples(x):
    codec = C.get("nc")
    e = codec.scale_exponent(x)
    out = []
    for t in range(TRIALS):
        ctx = ScaleContext(e, n_workers=8, register_bits=64, seed=5000 + t)
        out.append(codec.decode_sum(codec.encode_shared(x, ctx), ctx, raw=False).astype(np.float64))
    return np.stack(out)


OPERATORS = {"natural_compression": _natural_compression_samples, "nc codec": _nc_codec_samples,
             "nc switch path (64-bit, 8 workers)": _nc_switch_samples}


@pytest.mark.parametrize("op", list(OPERATORS))
@pytest.mark.parametrize("tensor", list(TENSORS))
def test_c_nat_unbiased_with_second_moment_at_most_nine_eighths(op, tensor):
    x = TENSORS[tensor]
    samples = OPERATORS[op](x)
    what = f"{op} on {tensor}"
    # every output is 0 or a power of two of the input's sign, one of the two around |x|
    a, lo, hi = _nat_bounds(x)
    out_abs = np.abs(samples)
    assert np.all((out_abs == lo) | (out_abs == hi) | ((a == 0) & (out_abs == 0))), what
    assert np.all(np.sign(samples) == np.sign(x)), what
    _assert_unbiased(x, samples, what)
    _assert_second_moment(x, samples, what)


def test_second_moment_bound_is_tight_at_mantissa_one_third():
    # (1 + 3t) / (1 + t)**2 is maximal, 9/8, at t = 1/3: the operator must reach it, not exceed it
    x = (np.float32(4 / 3) * np.float32(2.0) ** np.arange(-20, 20)).astype(np.float32).repeat(200)
    samples = _natural_compression_samples(x)
    ratio = (samples**2).sum(axis=1) / (x.astype(np.float64) ** 2).sum()
    se = ratio.std() / math.sqrt(ratio.size)
    assert abs(ratio.mean() - 9 / 8) <= Z * se + 1e-6


def test_unbiased_on_denormals_and_windows_below_float32_normal_range():
    # a tensor whose largest value is small puts the exponent window below 2**-126: denormal inputs
    # must still round between their own neighbouring powers of two
    rng = np.random.default_rng(9)
    # max 2**-20: W = 127 levels from e_low = -20 + 2 - 127 = -145, all of these are inside the window
    x = np.concatenate([[2.0**-20], rng.uniform(1, 2, 3000) * 2.0**-133, rng.uniform(1, 2, 3000) * 2.0**-144]).astype(np.float32)
    assert np.count_nonzero(np.abs(x) < np.finfo(np.float32).tiny) == 6000
    for op in ("natural_compression", "nc codec"):
        samples = OPERATORS[op](x)
        a, lo, hi = _nat_bounds(x)
        assert np.all((np.abs(samples) == lo) | (np.abs(samples) == hi)), op
        _assert_unbiased(x, samples, op)


# ------------------------------------------------------------------------------------------------
# Deterministic rounding: nearest power of two
# ------------------------------------------------------------------------------------------------
def _nearest_power_of_two(x: np.ndarray) -> np.ndarray:
    a, lo, hi = _nat_bounds(x)
    r = np.where(a - lo >= hi - a, hi, lo)  # ties (|x| = 1.5 lo) go up
    return np.where(a == 0, 0.0, np.sign(x) * r)


def test_deterministic_rounding_lands_on_the_nearest_power_of_two():
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.standard_normal(5000), rng.standard_cauchy(5000), [1.5, -1.5, 3.0, 0.75, 1.0, -2.0, 0.0],
                        rng.uniform(1, 2, 200) * 2.0**-140]).astype(np.float32)
    want = _nearest_power_of_two(x)
    got = C.natural_compression(x, deterministic=True)
    np.testing.assert_array_equal(got.astype(np.float64), want)
    assert np.array_equal(C.natural_compression(x, deterministic=True), got), "deterministic means deterministic"
    codec = C.get("nc-det")
    normal = np.abs(x) >= np.finfo(np.float32).tiny  # the codec's window covers the normal range here
    np.testing.assert_array_equal(codec.roundtrip(x)[normal].astype(np.float64), want[normal])
    assert not codec.unbiased and C.get("nc").unbiased


def test_deterministic_rounding_below_the_window_goes_to_the_nearer_of_zero_and_the_smallest_level():
    codec = C.get("nc-det")
    ctx = ScaleContext(0, n_workers=8, register_bits=32)  # W = 28, e_low = -26
    e_low = window_low(0, exponent_window(8, 32))
    assert e_low == -26
    lvl = 2.0**e_low
    x = np.array([1.0, 0.6 * lvl, 0.4 * lvl, -0.6 * lvl, -0.4 * lvl, 0.0], np.float32)
    out = codec.decode_sum(codec.encode_shared(x, ctx), ctx, raw=False)
    np.testing.assert_array_equal(out, np.array([1.0, lvl, 0.0, -lvl, 0.0, 0.0], np.float32))


# ------------------------------------------------------------------------------------------------
# The 8-bit codes
# ------------------------------------------------------------------------------------------------
def test_nc8_codes_follow_the_documented_layout():
    # max exponent 0 -> W = 127, e_low = 0 + 2 - 127 = -125; code k means 2**(e_low + k - 1)
    enc = C.get("nc").compress(np.array([1.0, -0.5, 0.25, 0.0, -(2.0**-124), 1.5 * 0 + 2.0**-125], np.float32))
    assert enc.meta["e_low"] == -125
    assert enc.codes.dtype == np.uint8
    assert enc.codes.tolist() == [126, 0x80 | 125, 124, 0, 0x80 | 2, 1]
    # the switch path with 8 workers on 32-bit registers: W = 28, e_low = -26
    ctx = ScaleContext(3, n_workers=8, register_bits=32)
    codes = C.get("nc").encode_shared(np.array([8.0, -(2.0**-23), 15.9999990], np.float32), ctx)
    assert exponent_window(8, 32) == 28 and window_low(3, 28) == -23
    assert codes[0] == 3 - (-23) + 1 and codes[1] == 0x80 | 1
    assert codes[2] in (27, 28)  # just below 2**4: 2**3 or the window's top 2**4


@pytest.mark.parametrize("name", ["nc", "nc-det"])
def test_codes_round_trip(name):
    codec = C.get(name)
    rng = np.random.default_rng(12)
    # every code decodes to a power of two that encodes back to the same code, in both modes
    for n, bits, e_max in [(1, 64, 0), (8, 32, 3), (64, 32, -40), (5, 64, 60)]:
        ctx = ScaleContext(e_max, n_workers=n, register_bits=bits)
        w = exponent_window(n, bits)
        codes = rng.integers(0, 256, 4000).astype(np.uint8)
        codes = codes[((codes & 0x7F) <= w) & (codes != 0x80)]  # valid codes (0x80 would be a negative zero)
        values = codec.decode_sum(codes, ctx, raw=False)
        e_low = window_low(e_max, w)
        k = (codes & 0x7F).astype(int)
        want = np.where(k > 0, np.where(codes & 0x80, -1.0, 1.0) * 2.0 ** (e_low + k - 1), 0.0)
        np.testing.assert_array_equal(values.astype(np.float64), want)
        np.testing.assert_array_equal(codec.encode_shared(values, ctx), codes)
    # compress/decompress is the identity on powers of two
    x = (np.sign(rng.standard_normal(500)) * 2.0 ** rng.integers(-60, 60, 500)).astype(np.float32)
    np.testing.assert_array_equal(codec.roundtrip(x), x)


def test_raw_register_sums_decode_to_the_sum_and_never_overflow_the_register():
    """The switch adds sign * 2**(k - 1) per worker: with W = min(127, bits - 1 - ceil(log2 n)) the sum
    of n workers all at the window's top fits in the register, and decode_sum(raw) is the sum."""
    codec = C.get("nc")
    rng = np.random.default_rng(13)
    for bits in (32, 64):
        for n in (1, 2, 3, 8, 33, 64):
            w = exponent_window(n, bits)
            e_max = 3
            ctx = ScaleContext(e_max, n_workers=n, register_bits=bits, seed=1)
            worst = np.float32(np.nextafter(np.float32(2.0 ** (e_max + 1)), np.float32(0)))  # rounds up to the top
            for sign in (1, -1):
                x = np.full(64, sign * worst, np.float32)
                total = 0
                for worker in range(n):
                    codes = codec.encode_shared(x, ScaleContext(e_max, n, bits, seed=worker))
                    k = (codes & 0x7F).astype(np.int64)
                    total = total + np.where(codes & 0x80, -1, 1) * np.where(k > 0, 2 ** np.maximum(k - 1, 0), 0)
                assert np.abs(total).max() <= 2 ** (bits - 1) - 1, (bits, n, w)
            # random tensors: decode of the raw sum equals the sum of the decoded codes
            xs = [rng.standard_normal(256).astype(np.float32) for _ in range(min(n, 8))]
            e = max(codec.scale_exponent(v) for v in xs)
            per = []
            raw = 0
            for i, v in enumerate(xs):
                c = ScaleContext(e, n, bits, seed=i)
                codes = codec.encode_shared(v, c)
                per.append(codec.decode_sum(codes, c, raw=False).astype(np.float64))
                k = (codes & 0x7F).astype(np.int64)
                raw = raw + np.where(codes & 0x80, -1, 1) * np.where(k > 0, 2 ** np.maximum(k - 1, 0), 0)
            np.testing.assert_allclose(codec.decode_sum(raw, ScaleContext(e, n, bits), raw=True), np.sum(per, axis=0),
                                       rtol=1e-6, atol=0)


def test_values_below_the_window_are_rounded_unbiased_not_flushed():
    codec = C.get("nc")
    e_low = window_low(0, exponent_window(8, 32))  # -26
    rng = np.random.default_rng(14)
    parts = {f"2**{e}": rng.uniform(1, 2, 4000) * 2.0**e for e in (-28, -33, -38)}
    x = np.concatenate([[1.0]] + list(parts.values())).astype(np.float32)
    samples = []
    for t in range(TRIALS):
        ctx = ScaleContext(0, n_workers=8, register_bits=32, seed=t)
        samples.append(codec.decode_sum(codec.encode_shared(x, ctx), ctx, raw=False).astype(np.float64))
    samples = np.stack(samples)
    assert set(np.unique(np.abs(samples[:, 1:]))) <= {0.0, 2.0**e_low}
    start = 1
    for name, part in parts.items():
        sl = slice(start, start + part.size)
        start += part.size
        s = samples[:, sl]
        assert np.count_nonzero(s) > 0, f"values around {name} were flushed to zero"
        total = s.sum(axis=1)  # unbiased: the sum of the outputs estimates the sum of the inputs
        se = total.std() / math.sqrt(total.size)
        assert abs(total.mean() - x[sl].astype(np.float64).sum()) <= Z * se, name


# ------------------------------------------------------------------------------------------------
# Natural vs standard dithering (seed 004, Theorem 5 and Appendix B.2, Fig 9)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1.0, 2.0])
def test_natural_dithering_has_far_smaller_variance_than_standard_dithering(p):
    """Gaussian vectors (zero mean, unit variance), the norm not compressed, the same s = 8 levels for
    both; normalized empirical variance ||C(x) - x||^2 / ||x||^2 per vector, averaged over 10 vectors.
    Theorem 5: natural dithering's variance is O(2**(s-1) / s) = 16 times smaller. (The theorem is
    about the worst case, reached in high dimension where |x_i| / ||x||_p falls below the smallest
    level, as here for p = 1, 2; with p = inf on Gaussian vectors standard dithering's finer top
    levels win, about 0.05 against 0.08.)"""
    s = 8
    rng = np.random.default_rng(15)
    nd, rd = C.get("nd", levels=s, p=p, seed=1), C.get("rd", levels=s, p=p, seed=2)
    omega = {"nd": [], "rd": []}
    for _ in range(10):
        x = rng.standard_normal(100_000).astype(np.float32)
        x64 = x.astype(np.float64)
        for name, codec in (("nd", nd), ("rd", rd)):
            y = codec.roundtrip(x).astype(np.float64)
            omega[name].append(((y - x64) ** 2).sum() / (x64**2).sum())
    nd_mean, rd_mean = np.mean(omega["nd"]), np.mean(omega["rd"])
    assert nd_mean * 8 < rd_mean, f"p={p}: natural {nd_mean:.4g} vs standard {rd_mean:.4g}"


@pytest.mark.parametrize("name", ["nd", "rd"])
def test_dithering_is_unbiased_and_uses_its_levels(name):
    s = 4
    rng = np.random.default_rng(16)
    x = rng.standard_normal(2000).astype(np.float32)
    codec = C.get(name, levels=s, p=math.inf, seed=3)
    enc = codec.compress(x)
    norm = enc.meta["norm"]
    assert norm == np.abs(x).max()
    assert np.abs(enc.codes.astype(int)).max() <= s
    levels = np.array([0] + [2.0 ** (j - s) for j in range(1, s + 1)] if name == "nd" else [j / s for j in range(s + 1)])
    y = np.abs(codec.decompress(enc).astype(np.float64))
    assert np.isclose(y[:, None], levels[None, :] * norm, rtol=1e-6, atol=0).any(axis=1).all()
    samples = np.stack([codec.roundtrip(x).astype(np.float64) for _ in range(TRIALS)])
    err = (samples - x.astype(np.float64)).sum(axis=1)
    se = err.std() / math.sqrt(err.size)
    assert abs(err.mean()) <= Z * se
    ctx = ScaleContext(codec.scale_exponent(x), n_workers=1, seed=4)
    assert 2.0**ctx.exponent > math.sqrt(float((x.astype(np.float64) ** 2).sum())) or codec.p != 2
    shared = np.stack([codec.decode_sum(codec.encode_shared(x, ScaleContext(ctx.exponent, 1, seed=t)), ctx, raw=name == "rd")
                       .astype(np.float64) for t in range(TRIALS)])
    err = (shared - x.astype(np.float64)).sum(axis=1)
    se = err.std() / math.sqrt(err.size)
    assert abs(err.mean()) <= Z * se


# ------------------------------------------------------------------------------------------------
# Block floating point: the sum of n workers never overflows int32
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exponent", [-30, 0, 7, 100])
def test_bfp_sums_of_n_workers_never_overflow_int32_at_worst_case_inputs(exponent):
    codec = C.get("bfp32")
    # the largest magnitudes a tensor with this shared exponent can hold, both signs
    top = np.float32(np.nextafter(np.float32(2.0**exponent), np.float32(0)))
    worst = np.array([top, -top, top, -top, np.float32(2.0 ** (exponent - 1)), 0.0], np.float32)
    assert codec.scale_exponent(worst) == exponent
    for n in range(1, 65):
        ctx = ScaleContext(exponent, n_workers=n)
        codes = np.stack([codec.encode_shared(worst, ctx) for _ in range(n)])
        assert codes.dtype == np.int32
        total = codes.astype(np.int64).sum(axis=0)
        assert np.all(np.abs(total) <= INT32_MAX), n
        np.testing.assert_array_equal(codes.sum(axis=0, dtype=np.int32), total)  # an int32 switch would agree
        # and the sum decodes to the sum of the inputs within n half-steps
        back = codec.decode_sum(total, ctx).astype(np.float64)
        want = n * worst.astype(np.float64)
        assert np.all(np.abs(back - want) <= n * 0.5 / bfp_scale(exponent, n) + np.abs(want) * 2.0**-24), n


def test_bfp_codes_are_round_to_nearest_of_the_documented_scale():
    codec = C.get("bfp32")
    x = np.random.default_rng(17).standard_normal(5000).astype(np.float32)
    e = codec.scale_exponent(x)
    assert 2.0 ** (e - 1) <= np.abs(x).max() < 2.0**e
    ctx = ScaleContext(e, n_workers=5)
    scale = (2**31 - 1) / (5 * 2.0**e)
    np.testing.assert_array_equal(codec.encode_shared(x, ctx), np.rint(x.astype(np.float64) * scale).astype(np.int32))
    # decoding a big-endian payload (as it arrives on the wire) works too
    codes = codec.encode_shared(x, ctx)
    np.testing.assert_array_equal(codec.decode_sum(codes.astype(">i4"), ctx), codec.decode_sum(codes, ctx))
    with pytest.raises(ValueError, match=r"magnitude >= 2\*\*%d .*negotiated exponent %d is smaller" % (e - 1, e - 1)):
        codec.encode_shared(x, ScaleContext(e - 1, n_workers=5))


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", ISSUE2_CODECS)
def test_nan_and_inf_raise_a_value_error_naming_the_problem(name, bad):
    codec = C.get(name)
    x = np.ones(100, np.float32)
    x[37] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.compress(x)
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.compress(torch.from_numpy(x))
    if codec.switch_summable:
        with pytest.raises(ValueError, match="NaN or Inf"):
            codec.encode_shared(x, ScaleContext(1, n_workers=2))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_natural_compression_rejects_nan_and_inf(bad):
    x = np.ones(10, np.float32)
    x[3] = bad
    with pytest.raises(ValueError, match="1 NaN or Inf"):
        C.natural_compression(x)
    with pytest.raises(OverflowError, match="2\\*\\*128"):
        C.natural_compression(np.array([3e38], np.float32), seed=0, deterministic=True)


def test_nc_rejects_values_above_the_negotiated_window():
    with pytest.raises(ValueError, match="exceed the exponent window's top 2\\*\\*1"):
        C.get("nc").encode_shared(np.array([0.5, 4.0], np.float32), ScaleContext(0, n_workers=8, register_bits=32))


# ------------------------------------------------------------------------------------------------
# Input types: torch tensors and numpy arrays come back as they went in
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(), (7,), (3, 4, 5), (2, 0, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ISSUE2_CODECS)
def test_torch_tensors_keep_type_shape_and_dtype(name, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    codec = C.get(name)
    y = codec.roundtrip(x)
    assert isinstance(y, torch.Tensor)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    if name in ("nc", "nc-det") and x.numel():
        a = x.float().abs()
        assert torch.all((y.float().abs() >= a / 2) & (y.float().abs() <= 2 * a)), "natural compression stays within a factor 2"
    z = C.natural_compression(x)
    assert isinstance(z, torch.Tensor) and z.shape == x.shape and z.dtype == x.dtype


def test_non_contiguous_tensors_and_numpy_arrays():
    x = torch.randn(6, 8).t()
    assert not x.is_contiguous()
    y = C.natural_compression(x, deterministic=True)
    np.testing.assert_array_equal(y.numpy(), _nearest_power_of_two(x.contiguous().numpy()).astype(np.float32))
    for dtype in (np.float32, np.float64, np.float16):
        a = np.random.default_rng(1).standard_normal((5, 3)).astype(dtype)
        for name in ISSUE2_CODECS:
            b = C.get(name).roundtrip(a)
            assert isinstance(b, np.ndarray) and b.shape == a.shape and b.dtype == a.dtype, (name, dtype)
        c = C.natural_compression(a)
        assert isinstance(c, np.ndarray) and c.shape == a.shape and c.dtype == a.dtype


# ------------------------------------------------------------------------------------------------
# Registry and generator
# ------------------------------------------------------------------------------------------------
def test_registry_lists_gets_and_rejects_unknown_names():
    names = C.available()
    assert set(ISSUE2_CODECS) <= set(names) and names == sorted(names)
    ids = set()
    for name in names:
        codec = C.get(name)
        assert isinstance(codec, C.Codec) and codec.name == name
        assert codec.wire_id not in ids
        ids.add(codec.wire_id)
        assert C.by_wire_id(codec.wire_id) is type(codec)
    assert C.get("nc").bits_per_element == 8 and C.get("bfp32").bits_per_element == 32
    assert C.get("nc").switch_summable and C.get("bfp32").switch_summable
    with pytest.raises(ValueError, match="unknown codec 'zip'; available: .*nc"):
        C.get("zip")
    with pytest.raises(ValueError, match="no codec has wire id 250"):
        C.by_wire_id(250)
    with pytest.raises(ValueError, match="levels must be in 1..127"):
        C.get("nd", levels=0)


def test_random_stream_is_lowbias32_and_uniform():
    n = 1 << 18
    i = np.arange(n, dtype=np.uint64)
    r = K.random_u32(n, 12345)
    np.testing.assert_array_equal(r, lowbias32((i * 0x9E3779B9 + 12345) & 0xFFFFFFFF))
    u = r / 2.0**32
    assert abs(u.mean() - 0.5) <= Z * math.sqrt(1 / 12 / n)
    for shift in (0, 15, 24):  # low bits (in-window rounding uses bits 0-22) and high bits
        counts = np.bincount((r >> shift) & 0xFF, minlength=256)
        chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum()
        assert chi2 < 255 + Z * math.sqrt(2 * 255), (shift, chi2)


@pytest.mark.parametrize("name", [n for n in C.available() if C.get(n).encodes_rows])
@pytest.mark.parametrize("n,elements", [(1000, 64), (3 * 256 + 5, 256), (17, 32), (4096, 4096)])
def test_encode_rows_writes_the_whole_tensor_encode_cut_into_chunks(name, n, elements):
    """Chunks encoded one by one straight into packet rows, in any order, carry exactly the codes of a
    whole-tensor encode_shared (random stream positioned by element), the last chunk zero-padded;
    the headers, trailers and rows not named stay untouched."""
    from ina.wire import HEADER_SIZE
    c = C.get(name)
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    x[::97] = 0
    x[5] = 1e-42                                     # a denormal
    ctx = ScaleContext(c.scale_exponent(x), 4, 64, seed=12345, elements=elements)
    n_chunks = -(-n // elements)
    whole = np.zeros(n_chunks * elements, np.uint8)
    whole[:n] = c.encode_shared(x, ctx)
    whole = whole.reshape(n_chunks, elements)
    pkts = np.full((n_chunks + 3, HEADER_SIZE + elements + 4), 0xAB, np.uint8)
    order = rng.permutation(n_chunks).astype(np.int64)
    rows = order + 2
    c.encode_rows(x, ctx, pkts, rows, order, HEADER_SIZE, elements)
    assert np.array_equal(pkts[rows, HEADER_SIZE:HEADER_SIZE + elements], whole[order])
    assert (pkts[:, :HEADER_SIZE] == 0xAB).all() and (pkts[:, -4:] == 0xAB).all() and (pkts[:2] == 0xAB).all()
    y = x.copy()
    y[n // 2] = 2.0 ** (ctx.exponent + 2)            # above the negotiated window: refused, as encode_shared does
    for encode in (lambda: c.encode_shared(y, ctx), lambda: c.encode_rows(y, ctx, pkts, rows, order, HEADER_SIZE,
                                                                            elements)):
        with pytest.raises(ValueError, match="exponent window"):
            encode()
