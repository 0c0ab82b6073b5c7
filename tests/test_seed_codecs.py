"""The seed papers' codecs: 3LC, thresholded transfer, entropy-adaptive Huffman, MQGrad, TernGrad, QSGD.

Lossless stages round-trip exactly (hypothesis); quartic encoding is exactly 1.6 bits per value; an
all-zero tensor compresses ~280x under full 3LC; error feedback keeps the long-run sum of what was
sent equal to the sum of the inputs; switch paths sum as integers; MQGrad's agent learns.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ina.compression as C
from ina.compression import ScaleContext
from ina.compression.encoding import LOG2_FRAC, log_scale, log_scale_exponent, pack_bits, unpack_bits
from ina.compression.entropy_huffman import (EntropyAdaptiveHuffman, entropy_bits, huffman_decode,
                                             huffman_encode, huffman_lengths)
from ina.compression.mqgrad import MQGradController
from ina.compression.qsgd import QSGD
from ina.compression.threelc import (ThreeLC, all_zero_ratio, quartic_decode, quartic_encode,
                                     zero_run_decode, zero_run_encode)
from ina.compression.thresholded import paper_bits, sent_fraction

ROOT = Path(__file__).resolve().parents[1]
SEED_CODECS = ["3lc", "3lc-3v", "wgt", "bgt", "qgt", "eaq", "uniform", "mqgrad", "terngrad", "qsgd"]
SWITCH_LINEAR = ["3lc-3v", "bgt", "qgt", "uniform", "mqgrad", "terngrad"]
FEEDBACK = ["3lc", "3lc-3v", "wgt", "bgt", "qgt"]

small = settings(max_examples=60, deadline=None)
float_arrays = hnp.arrays(np.float32, st.integers(0, 300),
                          elements=st.floats(-1e3, 1e3, width=32, allow_nan=False, allow_infinity=False))


def gradient_like(rng, n, scale=1e-2):
    """Heavy-tailed, slightly biased values, like a layer's gradient."""
    return (scale * (rng.standard_t(3, n) * 0.3 + 0.05)).astype(np.float32)


# ----------------------------------------------------------------------------- registry and labels
def test_registry_has_every_seed_codec_with_unique_wire_ids_above_9():
    names = C.available()
    for name in SEED_CODECS:
        assert name in names
        cls = type(C.get(name))
        assert cls.wire_id >= 10
        assert C.by_wire_id(cls.wire_id) is cls
    ids = [type(C.get(n)).wire_id for n in names]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("name", ["3lc", "eaq", "wgt", "topk"])
def test_variable_length_codecs_are_labelled_host_aggregator_only(name):
    codec = C.get(name)
    assert codec.switch_summable is False
    assert codec.variable_length is True and codec.aggregation == "host"
    assert "host-aggregator" in codec.label and "NOT switch-feasible" in codec.label
    assert "NOT switch-feasible" in codec.description
    with pytest.raises(NotImplementedError, match="not switch-summable"):
        codec.scale_exponent(np.ones(4, np.float32))


# ----------------------------------------------------------------------------- lossless stages
@small
@given(hnp.arrays(np.int8, st.integers(0, 400), elements=st.integers(-1, 1)))
def test_quartic_encoding_round_trips_exactly(q):
    codes = quartic_encode(q)
    assert codes.size == math.ceil(q.size / 5)
    assert codes.size == 0 or codes.max() <= 242
    np.testing.assert_array_equal(quartic_decode(codes, q.size), q)


@small
@given(st.lists(st.one_of(st.integers(0, 242), st.just(121), st.lists(st.just(121), min_size=1, max_size=40)),
                max_size=120))
def test_zero_run_encoding_round_trips_exactly(parts):
    flat = []
    for p in parts:
        flat.extend(p if isinstance(p, list) else [p])
    codes = np.array(flat, np.uint8)
    enc = zero_run_encode(codes)
    assert enc.size <= codes.size
    np.testing.assert_array_equal(zero_run_decode(enc), codes)


def test_zero_run_encoding_follows_the_paper():
    # k = 2..14 runs of 121 become one byte 243 + (k - 2); a single 121 stays; 15 = 14 + 1
    for k in range(2, 15):
        assert zero_run_encode(np.full(k, 121, np.uint8)).tolist() == [243 + k - 2]
    assert zero_run_encode(np.array([121], np.uint8)).tolist() == [121]
    assert zero_run_encode(np.full(15, 121, np.uint8)).tolist() == [255, 121]
    assert zero_run_encode(np.array([7, 121, 121, 8], np.uint8)).tolist() == [7, 243, 8]
    with pytest.raises(ValueError, match="0..242"):
        zero_run_encode(np.array([243], np.uint8))


def test_quartic_uses_five_partitions_and_121_is_five_zeros():
    assert quartic_encode(np.zeros(5, np.int8)).tolist() == [121]
    # element i of partition j (i + j * L) is digit j: [1, 0, 0, 0, 0] -> (2,1,1,1,1) = 2*81 + 40
    q = np.zeros(10, np.int8)
    q[0] = 1          # partition 0, byte 0
    q[9] = -1         # partition 4, byte 1 (L = 2)
    assert quartic_encode(q).tolist() == [2 * 81 + 27 + 9 + 3 + 1, 81 + 27 + 9 + 3 + 0]


@small
@given(st.integers(1, 16), st.data())
def test_bit_packing_round_trips_exactly(width, data):
    vals = data.draw(hnp.arrays(np.uint16, st.integers(0, 200), elements=st.integers(0, 2**width - 1)))
    packed = pack_bits(vals, width)
    assert packed.size == (vals.size * width + 7) // 8
    np.testing.assert_array_equal(unpack_bits(packed, width, vals.size), vals)


@small
@given(st.lists(st.integers(1, 10_000), min_size=2, max_size=40), st.data())
def test_huffman_coding_round_trips_exactly_and_meets_the_entropy_bound(counts, data):
    counts = np.array(counts)
    lengths = huffman_lengths(counts)
    assert sum(2.0 ** -L for L in lengths) == pytest.approx(1.0)       # a complete prefix code
    assert (counts * lengths).sum() < counts.sum() * (entropy_bits(counts) + 1)
    syms = np.array(data.draw(st.lists(st.integers(0, counts.size - 1), max_size=300)), np.int64)
    stream = huffman_encode(syms, lengths)
    np.testing.assert_array_equal(huffman_decode(stream, lengths, syms.size), syms)


@small
@given(float_arrays)
@example(np.array([-999.0, 998.0, -0.5], np.float32))   # -0.5 sits exactly on the edge of bin 128
@example(np.array([-511.0, 1.6659724], np.float32))      # the max half a bin from its centre
def test_entropy_adaptive_decodes_bin_centres_exactly(x):
    codec = EntropyAdaptiveHuffman(seed=1)
    enc = codec.compress(x)
    y = codec.decompress(enc)
    if x.size == 0:
        assert y.size == 0
        return
    n_bits = codec.last_bits
    assert codec.c <= n_bits <= codec.c + codec.M          # N = ceil(H + c), H <= M
    lo, hi = float(x.min()), float(x.max())
    step = (hi - lo) / 2**n_bits
    i = np.clip(np.floor((x.astype(np.float64) - lo) / step), 0, 2**n_bits - 1) if step > 0 else np.zeros(x.size)
    np.testing.assert_array_equal(y, (lo + step * (i + 0.5)).astype(np.float32))
    # + float32 rounding of the centre; the bound in float64 (a float32 sum would round it down)
    assert np.all(np.abs(y.astype(np.float64) - x) <= step / 2 + np.spacing(np.abs(y)).astype(np.float64))


@small
@given(st.integers(1, 127), st.data())
def test_qsgd_elias_coding_is_lossless(levels, data):
    x = data.draw(float_arrays)
    codec = QSGD(levels=levels, seed=3)
    enc = codec.compress(x)
    y = codec.decompress(enc)
    # the same seed gives rd's levels; the Elias stage must not change them
    ref = C.get("rd", levels=levels, p=2.0, seed=3)
    np.testing.assert_array_equal(y, ref.decompress(ref.compress(x)))


@small
@given(float_arrays, st.floats(1e-3, 10.0))
def test_wgt_sends_values_exactly_and_keeps_the_rest(x, t):
    codec = C.get("wgt", threshold=t)
    y = codec.decompress(codec.compress(x, key="w"))
    r = codec.residual("w")
    big = np.abs(x) >= np.float32(t)
    np.testing.assert_array_equal(y[big], x[big])
    np.testing.assert_array_equal(r[big], 0)
    np.testing.assert_array_equal(y[~big], 0)
    np.testing.assert_array_equal(r[~big], x[~big])


@small
@given(st.floats(1e-30, 1e30))
def test_log_scale_exponent_is_a_tight_upper_bound(scale):
    e = log_scale_exponent(scale)
    assert log_scale(e) >= scale
    assert log_scale(e - 1) < scale
    assert log_scale(e) <= scale * 2 ** (1 / LOG2_FRAC) * (1 + 1e-12)


# ----------------------------------------------------------------------------- costs
@pytest.mark.parametrize("n", [5, 1000, 123455])
def test_quartic_encoding_costs_exactly_1_6_bits_per_value(n):
    rng = np.random.default_rng(0)
    q = rng.integers(-1, 2, n).astype(np.int8)
    assert 8 * quartic_encode(q).size / n == 1.6
    enc = C.get("3lc-3v").compress(rng.standard_normal(n).astype(np.float32))
    assert 8 * (enc.codes.size - 4) / n == 1.6      # the message is float32 M + the quartic bytes


def test_all_zero_tensor_compresses_about_280x_under_full_3lc():
    n = 1_000_000
    x = np.zeros(n, np.float32)
    enc = ThreeLC().compress(x)
    ratio = x.nbytes / enc.nbytes
    assert ratio == pytest.approx(all_zero_ratio(n))
    assert 278 < ratio <= 280                       # 70 values per byte; the 4-byte M is the rest
    np.testing.assert_array_equal(ThreeLC().decompress(enc), x)


def test_zero_run_encoding_never_expands_and_sparser_s_is_smaller():
    rng = np.random.default_rng(1)
    g = gradient_like(rng, 50_000)
    sizes = []
    for s in (1.0, 1.5, 1.75, 1.9):
        full = ThreeLC(s=s, error_feedback=False).compress(g)
        quartic = C.get("3lc-3v", s=s, error_feedback=False).compress(g)
        assert full.codes.size <= quartic.codes.size
        sizes.append(full.codes.size)
    assert sizes == sorted(sizes, reverse=True)     # a larger s zeroes a superset of the values


def test_3lc_quantization_follows_equations_1_to_3():
    x = np.array([0.0, 0.4, 0.5, 0.51, -1.0, 0.9], np.float32)
    codec = C.get("3lc", s=1.0, error_feedback=False)
    y = codec.decompress(codec.compress(x))
    # M = max|x| = 1; round(x / M), half to even: 0.5 -> 0, 0.51 -> 1
    np.testing.assert_array_equal(y, np.float32([0, 0, 0, 1, -1, 1]))
    codec = C.get("3lc", s=1.9, error_feedback=False)
    y = codec.decompress(codec.compress(x))
    np.testing.assert_array_equal(y, np.float32([0, 0, 0, 0, -1.9, 0]))


def test_thresholded_transfer_follows_the_papers_rules():
    t = 0.25
    x = np.array([0.1, 0.3, -0.6, 1.0, 100.0], np.float32)
    bgt = C.get("bgt", threshold=t)
    assert bgt.threshold == pytest.approx(t, rel=2**(1 / 256) - 1)
    tt = np.float32(bgt.threshold)
    np.testing.assert_array_equal(bgt.decompress(bgt.compress(x, key="k")), [0, tt, -tt, tt, tt])
    qgt = C.get("qgt", threshold=t)
    m = np.floor(np.abs(x) / tt)
    want = np.sign(x) * np.minimum(m, 255) * tt
    np.testing.assert_allclose(qgt.decompress(qgt.compress(x, key="k")), want, rtol=1e-6)
    enc = qgt.compress(np.zeros(5, np.float32), key="fresh")
    assert sent_fraction(enc) == 0 and paper_bits(enc) == 0


# ----------------------------------------------------------------------------- error feedback
def _run_feedback(name, steps, switch=False, **opts):
    rng = np.random.default_rng(7)
    codec = C.get(name, **opts)
    total_in = np.zeros(2000)
    total_out = np.zeros(2000)
    for _ in range(steps):
        g = gradient_like(rng, 2000)
        if switch:
            ctx = ScaleContext(codec.scale_exponent(g, key="layer"), 1)
            out = codec.decode_sum(codec.encode_shared(g, ctx, key="layer"), ctx)
        else:
            out = codec.decompress(codec.compress(g, key="layer"))
        total_in += g
        total_out += out
    return codec, total_in, total_out


THRESH = {"bgt": dict(threshold=2e-3), "qgt": dict(threshold=2e-3), "wgt": dict(threshold=2e-2)}


@pytest.mark.parametrize("name,switch", [(n, False) for n in FEEDBACK] + [("3lc-3v", True), ("bgt", True),
                                                                         ("qgt", True)])
def test_error_feedback_keeps_the_long_run_sum_of_inputs(name, switch):
    opts = THRESH.get(name, {})
    codec, total_in, total_out = _run_feedback(name, 400, switch, **opts)
    r = codec.residual("layer").astype(np.float64)
    # what was not sent yet is exactly the residual (float32 rounding of 400 additions aside)
    np.testing.assert_allclose(total_in - total_out, r, atol=1e-5 * np.abs(total_in).max() + 1e-7)
    # and the residual stays small: a few steps' worth, not 400 steps' worth of the inputs' bias
    assert abs(r.mean()) < 0.02 * abs(total_in.mean())
    assert np.sqrt(np.mean(r ** 2)) < 0.1 * np.sqrt(np.mean(total_in ** 2))


@pytest.mark.parametrize("name", ["3lc", "bgt"])
def test_without_error_feedback_the_sums_drift_apart(name):
    opts = THRESH.get(name, {})
    if name == "3lc":
        opts = dict(s=1.75)
    _, total_in, total_out = _run_feedback(name, 400, error_feedback=False, **opts)
    assert abs((total_in - total_out).mean()) > 0.2 * abs(total_in.mean())


def test_residuals_are_per_key_and_a_size_change_is_refused():
    codec = C.get("3lc")
    codec.compress(np.ones(10, np.float32) * np.arange(10, dtype=np.float32), key="a")
    codec.compress(np.ones(7, np.float32), key="b")
    assert codec.residual("a").size == 10 and codec.residual("b").size == 7
    with pytest.raises(ValueError, match="'a'.*10 elements.*has 12"):
        codec.compress(np.ones(12, np.float32), key="a")
    codec.reset("a")
    assert codec.residual("a") is None and codec.residual("b") is not None
    codec.reset()
    assert codec.residual("b") is None


@pytest.mark.parametrize("name", FEEDBACK)
def test_a_call_without_key_is_stateless(name):
    codec = C.get(name, **THRESH.get(name, {}))
    x = np.linspace(-1e-2, 3e-2, 100, dtype=np.float32)
    first = codec.decompress(codec.compress(x))
    assert codec.residual(None) is None and len(codec.residual_keys()) == 0
    np.testing.assert_array_equal(codec.decompress(codec.compress(x)), first)   # no buffer carried over
    codec.compress(x, key="t")
    assert not np.array_equal(codec.decompress(codec.compress(x, key="t")), first)   # the key carries it


def test_mqgrad_ranks_with_different_codec_seeds_agree_on_bits():
    ranks = [C.get("mqgrad", seed=1000 + r, epsilon=0.5) for r in range(3)]
    for m in range(200):
        for c in ranks:
            c.observe_loss(2.0 - 0.001 * m, elapsed_ms=10.0)
        assert len({c.bits for c in ranks}) == 1


# ----------------------------------------------------------------------------- switch path
@pytest.mark.parametrize("name", SWITCH_LINEAR)
def test_switch_sum_of_integer_codes_equals_the_sum_of_each_workers_decode(name):
    rng = np.random.default_rng(11)
    xs = [gradient_like(rng, 3000, scale=10.0 ** -k) for k in (1, 2, 3)]
    workers = [C.get(name, **THRESH.get(name, {})) for _ in xs]
    assert all(w.switch_summable for w in workers)
    exponent = max(w.scale_exponent(x) for w, x in zip(workers, xs))
    ctxs = [ScaleContext(exponent, n_workers=3, seed=100 + i) for i in range(3)]
    codes = [w.encode_shared(x, c) for w, x, c in zip(workers, xs, ctxs)]
    for c in codes:
        assert c.dtype == np.dtype(np.int8) or name == "qgt"
    total = np.sum([c.astype(np.int64) for c in codes], axis=0)
    summed = workers[0].decode_sum(total, ctxs[0], raw=True)
    each = sum(w.decode_sum(c.astype(np.int64), ctx, raw=True).astype(np.float64)
               for w, c, ctx in zip(workers, codes, ctxs))
    np.testing.assert_allclose(summed, each, rtol=1e-6, atol=1e-12)


def test_qgt_payload_widens_for_the_papers_255_multiples():
    from ina.wire import PayloadType
    assert C.get("qgt").payload_type == PayloadType.INT32
    assert C.get("qgt", max_multiple=127).payload_type == PayloadType.INT8
    assert C.get("bgt").payload_type == PayloadType.INT8


@pytest.mark.parametrize("name", ["terngrad", "uniform-stochastic"])
def test_stochastic_switch_codes_are_unbiased(name):
    x = np.linspace(-1, 1, 64, dtype=np.float32) ** 3
    codec = C.get("uniform", bits=3, stochastic=True) if name == "uniform-stochastic" else C.get(name)
    ctx0 = ScaleContext(codec.scale_exponent(x), 1)
    trials = 4000
    acc = np.zeros(x.size)
    for i in range(trials):
        ctx = ScaleContext(ctx0.exponent, 1, seed=i)
        acc += codec.decode_sum(codec.encode_shared(x, ctx), ctx)
    mean = acc / trials
    scale = log_scale(ctx0.exponent)
    # per-element sd of one trial <= scale / 2 (terngrad) or step / 2 (uniform): 5 sigma of the mean
    tol = 5 * (scale / 2) / math.sqrt(trials)
    assert np.abs(mean - x).max() < tol
    if name == "terngrad":   # and compress() (the operator, exact max) is unbiased too
        acc = np.zeros(x.size)
        for _ in range(trials):
            acc += codec.decompress(codec.compress(x))
        assert np.abs(acc / trials - x).max() < 5 * (np.abs(x).max() / 2) / math.sqrt(trials)


def test_switch_encode_refuses_a_scale_below_the_tensor():
    x = np.ones(8, np.float32)
    for name in ("terngrad", "uniform"):
        codec = C.get(name)
        with pytest.raises(ValueError, match="exceeds"):
            codec.encode_shared(x, ScaleContext(codec.scale_exponent(x) - LOG2_FRAC, 1))


# ----------------------------------------------------------------------------- operator contract
@pytest.mark.parametrize("name", SEED_CODECS)
def test_torch_tensors_come_back_with_type_shape_and_dtype(name):
    t = torch.randn(6, 7, dtype=torch.float64) * 1e-2
    codec = C.get(name)
    y = codec.decompress(codec.compress(t))
    assert isinstance(y, torch.Tensor) and y.shape == t.shape and y.dtype == t.dtype


@pytest.mark.parametrize("name", SEED_CODECS)
def test_nan_is_refused_and_names_the_problem(name):
    x = np.ones(10, np.float32)
    x[3] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        C.get(name).compress(x)


@pytest.mark.parametrize("name", SEED_CODECS)
def test_truncated_or_padded_messages_are_refused(name):
    rng = np.random.default_rng(5)
    x = gradient_like(rng, 500)
    codec = C.get(name, **THRESH.get(name, {}))
    enc = codec.compress(x)
    enc.codes = enc.codes[: enc.codes.size // 2]
    with pytest.raises(ValueError):
        codec.decompress(enc)
    if name in ("3lc", "3lc-3v"):
        return   # a longer quartic/zero-run body decodes to too many values: checked below
    enc = codec.compress(x)
    enc.codes = np.concatenate([enc.codes, np.zeros(3, np.uint8)])
    with pytest.raises(ValueError):
        codec.decompress(enc)


def test_3lc_body_of_the_wrong_length_is_refused():
    codec = C.get("3lc")
    enc = codec.compress(np.ones(100, np.float32))
    enc.codes = np.concatenate([enc.codes, np.uint8([5])])
    with pytest.raises(ValueError, match="needs 20"):
        codec.decompress(enc)


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match=r"\[1, 2\)"):
        C.get("3lc", s=2.0)
    with pytest.raises(ValueError, match="threshold"):
        C.get("bgt", threshold=0)
    with pytest.raises(ValueError, match="1..255"):
        C.get("qgt", max_multiple=256)
    with pytest.raises(ValueError, match="bits"):
        C.get("uniform", bits=0)


# ----------------------------------------------------------------------------- MQGrad
def _mqgrad_run(bits_pay_off_late: bool, seed: int, iters: int = 6000):
    """Synthetic training: the loss falls by 0.02 per iteration whatever the bits; in the second
    half it falls by 0.02 * (bits - 1) when more bits pay off. An iteration takes 2 + 4 * bits ms."""
    ctl = MQGradController.tuned(seed=seed)
    rng = np.random.default_rng(seed + 100)
    loss = 100.0
    bits = []
    for m in range(iters):
        k = ctl.bits
        rate = 0.02 * (k - 1) if (bits_pay_off_late and m >= iters // 2) else 0.02
        loss += -rate + rng.normal(0, 0.01)
        ctl.observe_loss(loss, elapsed_ms=2.0 + 4.0 * k)
        bits.append(k)
    return np.array(bits), ctl


def test_mqgrad_controller_raises_the_bits_when_more_bits_pay_off_late():
    seeds = range(8)
    paid, paid_ctl = zip(*[_mqgrad_run(True, s) for s in seeds])
    control, control_ctl = zip(*[_mqgrad_run(False, s) for s in seeds])
    mid = np.mean([b[len(b) // 2 - 1] for b in paid])
    end_paid = np.mean([b[-1] for b in paid])
    end_control = np.mean([b[-1] for b in control])
    assert mid < 3.0                       # while extra bits only cost time it stays low
    assert end_paid >= end_control + 1.5   # it raises them when they speed the loss up
    for b, ctl in zip(paid + control, paid_ctl + control_ctl):
        assert b.min() >= 2 and b.max() <= 8
        n = [h["n"] for h in ctl.history]                  # the agent's bits never go down
        assert np.all(np.diff(n) >= 0)
        assert all(h["bits"] - h["n"] in (0, 1) for h in ctl.history)


def test_mqgrad_changes_bits_only_every_T_iterations_and_drives_the_quantizer():
    codec = C.get("mqgrad", seed=0, epsilon=1.0)        # always explore: a = 1 - greedy
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    seen = []
    for m in range(23):
        seen.append(codec.bits)
        enc = codec.compress(x)
        assert enc.codes[0] == codec.bits                 # K travels in the message
        assert enc.codes.size == 9 + math.ceil(1000 * codec.bits / 8)
        codec.observe_loss(1.0 - 0.01 * m, elapsed_ms=10.0)
    changes = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1]]
    assert changes and all(i % 5 == 0 for i in changes)
    assert len(codec.controller.history) == 4


def test_mqgrad_controller_rejects_bad_input():
    ctl = MQGradController()
    with pytest.raises(ValueError, match="not finite"):
        ctl.observe_loss(float("nan"))
    with pytest.raises(ValueError, match="elapsed_ms"):
        ctl.observe_loss(1.0, elapsed_ms=-1)


# ----------------------------------------------------------------------------- the benchmark runs
def test_bench_seed_codecs_quick_json():
    out = subprocess.run([sys.executable, "-m", "experiments.bench_seed_codecs", "--quick", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    rows = {r["codec"]: r for r in report["gradients"]}
    for name in ("3lc s=1.00", "3lc s=1.90", "eaq c=6", "bgt", "qgt", "wgt", "terngrad", "qsgd"):
        assert any(k.startswith(name) for k in rows), name
    for r in report["gradients"]:
        assert r["bits_per_value"] > 0 and "switch_feasible" in r
