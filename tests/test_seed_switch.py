"""Seed codecs through the real switch (ina.Client, UDP on loopback, one thread per rank).

What a user relies on when training with a stateful or adaptive codec on the switch path:
* error feedback works end to end: with a ``key`` the long-run sum of the switch's results plus the
  ranks' residuals equals the long-run sum of the inputs; without a key the sums drift apart;
* MQGrad ranks whose agents hold different bit widths still agree on one K (negotiated by max
  through the switch), so the integer sum is meaningful.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import ina.compression as C
from ina import Client
from ina.compression import ScaleContext

sys.path.insert(0, os.path.dirname(__file__))
from sw_harness import SwitchProc, client_threads  # noqa: E402

N = 3
ELEMS = 3000


@pytest.fixture(scope="module")
def switch(tmp_path_factory):
    sw = SwitchProc("--slots", "64", "--elements", "1024", log_path=tmp_path_factory.mktemp("sw") / "switch.log")
    yield sw
    assert sw.terminate() == 0, sw.log()


def run_ranks(switch, job, body, codec_options=None, timeout=60.0):
    """Run ``body(rank, client)`` in N threads, each with its own Client; return their results."""
    return client_threads(switch.port, N, job, body, join_timeout=timeout, elements=1024, slots=8, timeout=20.0,
                          seed=77, codec_options=codec_options)


def gradient(rank, step):
    rng = np.random.default_rng([rank, step])
    return (1e-2 * (rng.standard_t(3, ELEMS) * 0.3 + 0.05 * (rank + 1))).astype(np.float32)


STEPS = 60


@pytest.mark.parametrize("name,opts", [("3lc-3v", {}), ("bgt", {"threshold": 2e-3}), ("qgt", {"threshold": 2e-3})])
def test_error_feedback_through_the_switch_keeps_the_long_run_sum(switch, name, opts):
    job = {"3lc-3v": 41, "bgt": 42, "qgt": 43}[name]

    def body(rank, cl):
        results = np.zeros(ELEMS)
        for step in range(STEPS):
            x = gradient(rank, step)
            cl.allreduce(x, codec=name, key="layer1")
            results += x
        stateless = np.zeros(ELEMS)
        for step in range(STEPS):
            x = gradient(rank, step)
            cl.allreduce(x, codec=name)          # no key: no residual is read or kept
            stateless += x
        return results, cl.codec(name).residual("layer1").astype(np.float64), stateless

    out = run_ranks(switch, job, body, codec_options={name: opts})
    inputs = sum(gradient(r, s).astype(np.float64) for r in range(N) for s in range(STEPS))
    residuals = sum(o[1] for o in out)
    for r in range(N):      # every rank got the same sums
        np.testing.assert_array_equal(out[r][0], out[0][0])
    # sent + still in the buffers == everything that went in (float32 rounding aside)
    np.testing.assert_allclose(out[0][0] + residuals, inputs, atol=2e-5 * np.abs(inputs).max())
    bias_with = abs((inputs - out[0][0]).mean())
    bias_without = abs((inputs - out[0][2]).mean())
    # what is still owed is a few steps' worth (BGT sends at most T per step, so it owes more);
    # without a key the owed part is never sent: the sums drift apart
    assert bias_with < 0.2 * abs(inputs.mean()), (bias_with, inputs.mean())
    assert bias_without > 4 * bias_with, (bias_without, bias_with)


def test_mqgrad_ranks_holding_different_bits_agree_on_the_max(switch):
    bits = {0: 3, 1: 5, 2: 4}
    xs = [gradient(r, 99) for r in range(N)]

    def body(rank, cl):
        c = cl.codec("mqgrad")
        c.controller.bits = bits[rank]        # as if the agents had diverged
        x = xs[rank].copy()
        cl.allreduce(x, codec="mqgrad")
        return x

    out = run_ranks(switch, 44, body)
    for r in range(N):
        np.testing.assert_array_equal(out[r], out[0])
    # the reference: every rank quantized with K = 5 bits and the shared (max) range
    ref = C.get("mqgrad")
    ref.controller.bits = 5
    exponent = max(ref.scale_exponent(x) for x in xs)
    ctx = ScaleContext(exponent, N, agreed=(5,))
    codes = sum(ref.encode_shared(x, ctx).astype(np.int64) for x in xs)
    np.testing.assert_allclose(out[0], ref.decode_sum(codes, ctx), rtol=1e-6, atol=1e-9)
    # and with 3 bits the result would have been visibly coarser: the max was really used
    ctx3 = ScaleContext(exponent, N, agreed=(3,))
    coarse = ref.decode_sum(sum(ref.encode_shared(x, ctx3).astype(np.int64) for x in xs), ctx3)
    assert np.abs(coarse - out[0]).max() > 0


def test_variable_length_codecs_go_through_the_host_aggregator(switch):
    """Client.allreduce with 3lc (quartic + zero-run: not switch-summable) is served by the service's
    host aggregator: every rank gets the same sums; with error feedback their running total tracks the
    true one; far fewer bytes than fp32 go up."""
    steps = 20

    def body(rank, cl):
        assert cl.host_aggregator and "NOT switch-feasible" in cl.host_aggregator["label"]
        total, stateless = np.zeros(ELEMS), np.zeros(ELEMS)
        sent0 = cl.stats.bytes_sent
        for step in range(steps):
            x = gradient(rank, step)
            cl.allreduce(x, codec="3lc", key="w")
            total += x
        sent = (cl.stats.bytes_sent - sent0) / steps
        for step in range(steps):
            x = gradient(rank, step)
            cl.allreduce(x, codec="3lc")
            stateless += x
        return total, sent, stateless

    out = run_ranks(switch, 45, body)
    for r in range(N):
        np.testing.assert_array_equal(out[r][0], out[0][0])
    true = sum(gradient(r, s).astype(np.float64) for r in range(N) for s in range(steps))
    bias = abs((out[0][0] - true).mean())          # error feedback: what was held back is sent later
    bias_stateless = abs((out[0][2] - true).mean())
    assert bias < 0.6 * bias_stateless, (bias, bias_stateless)
    assert 0 < out[0][1] < 0.5 * 4 * ELEMS, out[0][1]      # under 2 bits per value on the uplink


def test_without_a_host_aggregator_a_variable_length_codec_is_refused_by_name(tmp_path):
    sw = SwitchProc("--slots", "8", "--elements", "256", "--host-agg-port", "-1", log_path=tmp_path / "sw.log")
    try:
        with Client(("127.0.0.1", sw.port), rank=0, world_size=1, job=1, elements=256, slots=4, timeout=10) as cl:
            assert cl.host_aggregator is None
            with pytest.raises(ValueError, match="'eaq' cannot be summed by an integer switch.*no host aggregator"):
                cl.allreduce(np.ones(100, np.float32), codec="eaq")
    finally:
        assert sw.terminate() == 0, sw.log()


def test_pipelined_encoding_draws_what_a_whole_tensor_encode_draws(switch):
    """The client encodes a block of `slots` chunks at a time; a stochastic codec must still draw, for
    every element, the random number a whole-tensor encode draws (no stream reused across blocks)."""
    x = np.concatenate([gradient(r, 5) for r in range(17)])[:50_000]     # 7 blocks of 8 x 1024
    with Client(("127.0.0.1", switch.port), rank=0, world_size=1, job=46, elements=1024, slots=8, timeout=20.0,
                seed=5) as cl:
        y = x.copy()
        cl.allreduce(y, codec="nc")
        bits = cl.register_bits
    ref = C.get("nc", seed=5 * 1_000_003)           # the client's codec for rank 0 (same seed, same stream)
    ctx = ScaleContext(ref.scale_exponent(x), 1, bits, seed=ref.next_seed())
    want = ref.decode_sum(ref.encode_shared(x, ctx), ctx, raw=False)
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("name,down", [("3lc-3v", 1), ("terngrad", 1), ("rd", 1), ("uniform", 4)])
def test_int8_sums_that_fit_come_back_as_int8(switch, name, down):
    """n x max|code| <= 127 (3-values, ternary, rd's 8 levels with 3 workers): the client sends
    INT8_NARROW and the switch returns int8 sums, 1 byte per element down; uniform's 8-bit codes
    (127 levels) could overflow int8, so their sums come back as int32. Either way the result is the
    sum of every rank's own decode."""
    job = {"3lc-3v": 47, "terngrad": 48, "rd": 49, "uniform": 50}[name]
    xs = [gradient(r, 11) for r in range(N)]

    def body(rank, cl):
        x = xs[rank].copy()
        r0, p0 = cl.stats.bytes_received, cl.stats.packets_received
        cl.allreduce(x, codec=name)
        return x, cl.stats.bytes_received - r0, cl.stats.packets_received - p0

    out = run_ranks(switch, job, body)
    for r in range(N):
        np.testing.assert_array_equal(out[r][0], out[0][0])
    got, nbytes, npkts = out[0]
    from ina.wire import HEADER_SIZE
    payload = nbytes - HEADER_SIZE * npkts
    n_neg = 1                                   # the scale-exponent round (no payload)
    per_elem = payload / ELEMS
    assert npkts > n_neg and per_elem == pytest.approx(down, rel=0.4), (per_elem, down)
    # exactly the integer sum of every rank's codes (each rank's codec: seed 77 * 1000003 + rank)
    refs = [C.get(name, seed=77 * 1_000_003 + r) for r in range(N)]
    exponent = max(ref.scale_exponent(x) for ref, x in zip(refs, xs))
    ctxs = [ScaleContext(exponent, N, 64, seed=ref.next_seed()) for ref in refs]
    codes = sum(ref.encode_shared(x, ctx).astype(np.int64) for ref, x, ctx in zip(refs, xs, ctxs))
    np.testing.assert_array_equal(got, refs[0].decode_sum(codes, ctxs[0], raw=True))
