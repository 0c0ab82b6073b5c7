"""Top-k with error feedback (host-aggregated sparsification reference): what is sent, the message,
the long-run sums. Through the host aggregator: tests/test_host_agg.py (HOST_CODECS)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ina.compression as C


def test_sends_exactly_the_k_largest_magnitudes_with_their_positions():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(10_000).astype(np.float32)
    codec = C.get("topk", ratio=0.01)
    enc = codec.compress(x)
    y = codec.decompress(enc)
    sent = np.flatnonzero(y)
    assert sent.size == 100
    np.testing.assert_array_equal(np.sort(sent), np.sort(np.argsort(-np.abs(x))[:100]))
    np.testing.assert_array_equal(y[sent], x[sent])          # values exact (float32)
    # 100 of 10,000: varint gaps (about 1 byte each) + 4-byte values + 5-byte header
    assert enc.codes.nbytes <= 5 + 100 * 4 + 100 * 2
    assert codec.description.endswith("(NOT switch-feasible)]") and codec.label == C.get("wgt").label


def test_k_option_bitmap_positions_zeros_and_shapes():
    x = np.zeros((4, 50), np.float32)
    x[1, 3], x[2, 7] = 5.0, -2.0
    codec = C.get("topk", k=150)                             # 150 of 200: bitmap is the smaller encoding
    y = codec.roundtrip(x)
    assert y.shape == x.shape and np.array_equal(y, x)        # zeros are not sent, nothing else is lost
    dense = np.arange(1, 201, dtype=np.float32).reshape(4, 50)
    enc = codec.compress(dense)
    assert enc.codes.nbytes == 5 + 25 + 150 * 4               # header + 200-bit bitmap + values
    assert np.count_nonzero(codec.decompress(enc)) == 150
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    out = C.get("topk", k=3).roundtrip(t)
    assert isinstance(out, torch.Tensor) and out.shape == t.shape and out.flatten()[-3:].tolist() == [9, 10, 11]
    assert C.get("topk").roundtrip(np.zeros(0, np.float32)).size == 0


def test_error_feedback_keeps_the_long_run_sum_and_stateless_drifts():
    rng = np.random.default_rng(2)
    bias = rng.uniform(-1, 1, 2000).astype(np.float32) * 1e-2
    with_key, without = C.get("topk", ratio=0.05), C.get("topk", ratio=0.05)
    tin = np.zeros(2000)
    t_ef = np.zeros(2000)
    t_none = np.zeros(2000)
    for step in range(300):
        x = (bias + 1e-2 * rng.standard_normal(2000)).astype(np.float32)
        tin += x
        t_ef += with_key.decompress(with_key.compress(x, key="w"))
        t_none += without.decompress(without.compress(x))
    r = with_key.residual("w").astype(np.float64)
    np.testing.assert_allclose(t_ef + r, tin, atol=1e-4)
    assert np.abs(t_ef - tin).max() < 0.1 * np.abs(tin).max()
    assert np.abs(t_none - tin).max() > 0.5 * np.abs(tin).max()
    assert without.residual("w") is None


def test_bad_input_and_messages_are_refused():
    with pytest.raises(ValueError, match="ratio must be a fraction"):
        C.get("topk", ratio=0)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        C.get("topk", k=0)
    codec = C.get("topk")
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.compress(np.array([1.0, np.inf], np.float32))
    enc = codec.compress(np.arange(1, 1001, dtype=np.float32))
    enc.codes = enc.codes[:-2]
    with pytest.raises(ValueError, match="truncated topk message: values"):
        codec.decompress(enc)
    assert not codec.switch_summable and codec.aggregation == "host" and codec.variable_length
