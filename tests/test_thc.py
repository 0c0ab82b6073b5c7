"""THC: the transform, the table, unbiasedness, variance, and sums through the real switch.

Statistical tests use fixed seeds and assert within 4 standard errors. The switch test runs a real
switch process and one ina.Client per rank (threads), and compares every rank's result with an
independent numpy model of THC's integer arithmetic (its own hash stream, butterfly and rounding).
"""
from __future__ import annotations

import itertools
import math
import os
import sys

import numpy as np
import pytest

import ina.compression as C
from ina.compression import ScaleContext
from ina.compression.encoding import log_scale, log_scale_exponent
from ina.compression.thc import (FINE, ROTATION_STREAM, TABLE_STREAM, block_norms, clip_threshold,
                                 expected_variance, inverse_rht, lookup_table, rht, rotation_signs)
from ina.wire import HEADER_SIZE

sys.path.insert(0, os.path.dirname(__file__))
from rng_reference import uniform  # noqa: E402
from sw_harness import SwitchProc, client_threads  # noqa: E402

Z = 4.0
TRIALS = 400


def sylvester(h: int) -> np.ndarray:
    m = np.ones((1, 1))
    while m.shape[0] < h:
        m = np.block([[m, m], [m, -m]])
    return m


# ----------------------------------------------------------------------------- transform and table
@pytest.mark.parametrize("h", [2, 64, 1024])
def test_transform_is_the_orthonormal_randomized_hadamard_and_round_trips(h):
    rng = np.random.default_rng(h)
    pad = h // 2
    x = rng.standard_normal(3 * h - pad).astype(np.float32)      # three blocks, the last zero-padded
    y = rht(x, h, rotation_seed=7)
    xp = np.concatenate([x, np.zeros(pad, np.float32)]).astype(np.float64).reshape(3, h)
    if h <= 64:                                                   # the dense definition, for small h
        signs = rotation_signs(h, 7)
        assert set(np.unique(signs)) <= {-1.0, 1.0}
        dense = sylvester(h) @ (signs[None, :] * xp).T / math.sqrt(h)
        np.testing.assert_allclose(y.reshape(3, h), dense.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(y.reshape(3, h), axis=1), np.linalg.norm(xp, axis=1), rtol=1e-12)
    back = inverse_rht(y, h, 7)[:x.size].astype(np.float32)
    np.testing.assert_allclose(back, x, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(x).max())
    if h > 2:                                                     # another seed, another rotation
        assert not np.allclose(rht(x, h, 8), y)


def _table_cost(table, g, t):
    """Expected rounding variance of a clipped N(0, 1) over a table (numerical integration, grid units)."""
    u = (np.arange(g * 2000) + 0.5) / 2000
    z = u * 2 * t / g - t
    w = np.exp(-z * z / 2) / math.sqrt(2 * math.pi) * (2 * t / g) / 2000
    tab = np.array(table)
    k = np.minimum(np.searchsorted(tab, u, side="right") - 1, tab.size - 2)
    a, b = tab[k], tab[k + 1]
    return float((w * (u - a) * (b - u)).sum())


def test_lookup_table_is_the_optimal_choice_of_grid_points():
    t = clip_threshold(1 / 32)
    g, bits = 10, 2                                              # 4 of 11 points: brute force over C(9, 2)
    best = min(((0, *mid, g) for mid in itertools.combinations(range(1, g), 2)), key=lambda tb: _table_cost(tb, g, t))
    table = lookup_table(g, bits, t)
    assert table[0] == 0 and table[-1] == g and len(table) == 4 and list(table) == sorted(table)
    assert _table_cost(table, g, t) == pytest.approx(_table_cost(best, g, t), rel=1e-6)
    assert lookup_table(16, 5, t) == tuple(range(17))             # 32 entries >= 17 points: the whole grid
    assert len(set(lookup_table(30, 4, t))) == 16
    assert t == pytest.approx(2.1538, abs=1e-4)                   # THC's public default: 1 in 32 clipped


# ----------------------------------------------------------------------------- statistics
def _samples(codec, x, trials=TRIALS, n_workers=1):
    e = codec.scale_exponent(x)
    out = []
    for s in range(trials):
        ctx = ScaleContext(e, n_workers, seed=1000 + s, agreed=codec.negotiated(), elements=max(1024, codec.block))
        out.append(codec.decode_sum(codec.encode_shared(x, ctx), ctx)[:x.size].astype(np.float64))
    return np.stack(out), log_scale(e)


def _assert_unbiased(samples, target, what):
    rng = np.random.default_rng(3)
    projections = [np.ones(target.size)] + [rng.choice([-1.0, 1.0], target.size) for _ in range(4)] + [target]
    for k, p in enumerate(projections):
        err = (samples - target) @ p
        se = err.std() / math.sqrt(err.size)
        assert abs(err.mean()) <= Z * se, f"{what}: projection {k}: mean error {err.mean():.3g}, 4 SE {Z * se:.3g}"


def test_unbiased_when_nothing_is_clipped():
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 3e-3
    codec = C.get("thc", clip=6.0, seed=0, error_feedback=False)
    samples, _ = _samples(codec, x)
    assert codec.clipped == 0 and codec.coordinates == TRIALS * 1024
    _assert_unbiased(samples, x.astype(np.float64), "thc, T = 6")


def test_default_clipping_is_the_only_bias():
    """With T = 2.154 (1 in 32 clipped) the estimate is unbiased for the clipped transform."""
    x = np.random.default_rng(2).standard_t(3, 1024).astype(np.float32)
    codec = C.get("thc", seed=0)
    samples, norm = _samples(codec, x)
    assert 0 < codec.clipped < codec.coordinates / 8
    s = math.sqrt(256) / norm
    clipped = inverse_rht(np.clip(rht(x, 256) * s, -codec.clip, codec.clip) / s, 256)[:x.size]
    _assert_unbiased(samples, clipped, "thc vs clipped transform")
    bias = np.linalg.norm(samples.mean(axis=0) - x) / np.linalg.norm(x)
    assert bias > 0.01           # the clipping bias is real (and error feedback returns it, see below)


def test_variance_within_the_bound_and_as_predicted_for_gaussian_coordinates():
    """Per coordinate the rounding variance is (v - a)(b - v) <= (gap 2T/g)^2 / 4 in scaled units; the
    inverse transform keeps squared errors, so E||x_hat - x'||^2 <= (G 2T/g)^2 M^2 / 4 per block, and
    for standard normal coordinates it is expected_variance() M^2 / h per element."""
    h = 4096
    x = np.random.default_rng(4).standard_normal(h).astype(np.float32)
    codec = C.get("thc", clip=6.0, block=h, seed=0, error_feedback=False)
    samples, norm = _samples(codec, x, trials=100)
    assert codec.clipped == 0
    mse = ((samples - x) ** 2).sum(axis=1)
    table = lookup_table(codec.g, codec.bits, codec.clip)
    gap = max(b - a for a, b in zip(table, table[1:]))
    bound = (gap * 2 * codec.clip / codec.g) ** 2 * norm**2 / 4
    assert mse.max() <= bound
    # T = 6 leaves the table's rounding alone: predicted mean, coordinates ~ N(0, (||x|| / M)^2)
    predicted = expected_variance(codec.g, codec.bits, overflow=2 * (1 - _phi(6.0))) * norm**2
    se = mse.std() / math.sqrt(mse.size)
    assert abs(mse.mean() - predicted) <= Z * se + 0.03 * predicted, (mse.mean(), predicted)


def _phi(z):
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def test_error_feedback_keeps_the_long_run_sum():
    codec = C.get("thc", seed=3)
    rng = np.random.default_rng(5)
    total_in = np.zeros(3000)
    total_out = np.zeros(3000)
    for step in range(100):
        x = (rng.standard_t(3, 3000) * 1e-2).astype(np.float32)
        ctx = ScaleContext(codec.scale_exponent(x, key="w"), 1, seed=step, agreed=codec.negotiated(), elements=1024)
        out = codec.decode_sum(codec.encode_shared(x, ctx, key="w"), ctx)[:x.size]
        total_in += x
        total_out += out
    r = codec.residual("w")
    np.testing.assert_allclose(total_out + r, total_in, atol=1e-4)
    assert np.linalg.norm(r) < 0.2 * np.linalg.norm(total_in)


def test_compress_message_and_bad_input():
    x = np.random.default_rng(6).standard_normal((30, 40)).astype(np.float32)
    codec = C.get("thc", seed=1)
    enc = codec.compress(x)
    assert enc.codes.nbytes == 9 + math.ceil(1280 * 4 / 8)        # 1200 values padded to 5 blocks of 256
    y = codec.decompress(enc)
    assert y.shape == x.shape and np.linalg.norm(y - x) / np.linalg.norm(x) < 0.3
    assert np.array_equal(codec.decompress(codec.compress(np.zeros(10, np.float32))), np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="granularity g must be an even integer"):
        C.get("thc", g=15)
    with pytest.raises(ValueError, match="power of two"):
        C.get("thc", block=100)
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.scale_exponent(np.array([1.0, np.nan], np.float32))
    assert codec.max_abs_code(ScaleContext(0, 8)) == 8 and codec.int8_sums(ScaleContext(0, 15))
    assert not codec.int8_sums(ScaleContext(0, 16))


# ----------------------------------------------------------------------------- through the real switch
def _fwht(v, h):
    v = v.reshape(-1, h).copy()
    span = 1
    while span < h:
        w = v.reshape(v.shape[0], -1, 2, span)
        a, b = w[:, :, 0, :].copy(), w[:, :, 1, :].copy()
        w[:, :, 0, :], w[:, :, 1, :] = a + b, a - b
        span *= 2
    return v.reshape(-1)


def numpy_thc_sum(xs, seeds, g=16, bits=4, h=256, rot=0, overflow=1 / 32, norm_blocks=None):
    """Independent model: every rank's centred codes, their integer sum, and its decode (``norm_blocks``:
    the block each rank measures its norm on, default h)."""
    t = log_scale(log_scale_exponent(clip_threshold(overflow)))
    norm = log_scale(max(log_scale_exponent(float(np.sqrt((np.pad(x.astype(np.float64), (0, -x.size % b)) ** 2)
                                                           .reshape(-1, b).sum(1)).max()))
                         for x, b in zip(xs, norm_blocks or [h] * len(xs))))
    signs = np.where(uniform(h, rot + ROTATION_STREAM) < 0.5, -1.0, 1.0)
    table = np.array(lookup_table(g, bits, t))
    u = np.arange(FINE * g + 1) / FINE
    lower = np.minimum(np.searchsorted(table, u, side="right") - 1, table.size - 2)
    p_up = (u - table[lower]) / (table[lower + 1] - table[lower])
    total = 0
    for x, seed in zip(xs, seeds):
        m = x.size + (-x.size % h)
        y = _fwht(np.pad(x.astype(np.float64), (0, m - x.size)) * np.tile(signs, m // h), h) * (1.0 / math.sqrt(h))
        v = np.clip(y * (math.sqrt(h) / norm), -t, t)
        f = (v + t) * (FINE * g / (2.0 * t))
        j = np.minimum(np.floor(f).astype(np.int64), FINE * g)
        j = j + ((j < FINE * g) & (uniform(m, seed) < f - j))
        k = lower[j] + (uniform(m, seed + TABLE_STREAM) < p_up[j])
        total = total + (table[k] - g // 2)
    assert np.abs(total).max() <= len(xs) * g // 2
    out = _fwht(total * ((2.0 * t / g) * norm / math.sqrt(h)), h) * ((1.0 / math.sqrt(h)) * np.tile(signs, total.size // h))
    return out.astype(np.float32)[:xs[0].size]


@pytest.fixture(scope="module")
def switch(tmp_path_factory):
    sw = SwitchProc("--slots", "64", "--elements", "1024", log_path=tmp_path_factory.mktemp("sw") / "switch.log")
    yield sw
    assert sw.terminate() == 0, sw.log()


@pytest.mark.parametrize("n,g,down", [(2, 16, 1), (4, 16, 1), (8, 16, 1), (8, 32, 4)])
def test_thc_through_the_switch_equals_the_numpy_model(switch, n, g, down):
    """n workers' codes summed by the switch; n g/2 <= 127 comes back as int8 (1 byte per element)."""
    size = 5000
    xs = [(np.random.default_rng([n, r]).standard_t(3, size) * 1e-2 * (r + 1)).astype(np.float32) for r in range(n)]

    def rank(r, cl):
        x = xs[r].copy()
        b0, p0 = cl.stats.bytes_received, cl.stats.packets_received
        cl.allreduce(x, codec="thc")
        return x, cl.stats.bytes_received - b0, cl.stats.packets_received - p0

    out = client_threads(switch.port, n, 60 + n + g, rank, join_timeout=90, elements=1024, slots=8, timeout=30.0,
                         seed=77, codec_options={"thc": {"g": g}})
    seeds = [C.get("thc", seed=77 * 1_000_003 + r).next_seed() for r in range(n)]
    want = numpy_thc_sum(xs, seeds, g=g)
    for r in range(n):
        np.testing.assert_array_equal(out[r][0], want)
    got, nbytes, npkts = out[0]
    per_elem = (nbytes - HEADER_SIZE * npkts) / size
    assert per_elem == pytest.approx(down * 5120 / size, rel=0.01)
    rel = np.linalg.norm(got - sum(xs)) / np.linalg.norm(sum(xs))
    assert rel < 0.5, rel


def test_ranks_configured_differently_agree_through_the_switch(switch):
    """g, the rotation seed and the block are negotiated: rank 0 asks for g = 16, block 256, rotation 0,
    rank 1 for g = 20, block 128, rotation 5; both use g = 20, rotation 5 and block 128."""
    xs = [(np.random.default_rng([9, r]).standard_normal(3000) * 1e-2).astype(np.float32) for r in range(2)]
    opts = [{"g": 16, "block": 256, "rotation_seed": 0}, {"g": 20, "block": 128, "rotation_seed": 5}]

    def rank(r, cl):
        x = xs[r].copy()
        cl.allreduce(x, codec="thc")
        return x

    out = client_threads(switch.port, 2, 80, rank, elements=1024, slots=8, timeout=30.0, seed=77,
                         rank_options=lambda r: {"codec_options": {"thc": opts[r]}})
    seeds = [C.get("thc", seed=77 * 1_000_003 + r, **opts[r]).next_seed() for r in range(2)]
    want = numpy_thc_sum(xs, seeds, g=20, h=128, rot=5, norm_blocks=[256, 128])
    np.testing.assert_array_equal(out[0], want)
    np.testing.assert_array_equal(out[1], want)
