"""The host aggregator's round state machine and codec step, without sockets.

``switch_model.host_rounds.Rounds`` is driven with the frames workers send (built with real codecs
and ``ina.host_wire``) and a clock given by the test; what it answers (frames to send, a completed
round, counters) is checked. ``switch_model.host_reduce`` is checked against a reference built from
fresh codec objects. The protocol's declaration is checked against docs/host-protocol.md.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest

import ina.compression as C
from ina.host_wire import (HEADER, HEADER_FIELDS, HEADER_SIZE, JOB_ROUND, Frame, FrameType, header_table,
                           pack_encoded)
from ina.wire import PAYLOAD_WIDTH, PayloadType, result_type
from switch_model.host_reduce import RoundFailed, aggregator_seed, downlink_codec, reduce_round
from switch_model.host_rounds import Peer, Rounds

T0 = 1000.0
JOB = 7


def hello(rank: int, world: int = 2, job: int = JOB, timeout: float = 5.0) -> Frame:
    return Frame(FrameType.HELLO, job=job, rank=rank, world_size=world, meta={"timeout": timeout})


def data(codec, x: np.ndarray, rank: int, rnd: int = 0, world: int = 2, job: int = JOB, key=None) -> Frame:
    fp = codec.rng_fingerprint()
    flags, env, body = pack_encoded(codec.compress(x, **codec.key_argument(key)))
    meta = {"options": codec.options(), **env, **({"rng": fp} if fp else {})}
    return Frame(FrameType.DATA, flags, job, rank, world, rnd, codec.wire_id, x.size, key, meta, body)


def joined(world: int = 2, job: int = JOB):
    """A Rounds with ``world`` ranks joined to ``job``; (rounds, peers)."""
    rounds = Rounds()
    peers = [Peer(f"10.0.0.{r}:5000") for r in range(world)]
    for r, p in enumerate(peers):
        out = rounds.on_frame(p, hello(r, world, job), T0)
        assert out.keep and [f.type for _, f in out.sends] == [FrameType.WELCOME]
        assert out.sends[0][1].meta["connected"] == list(range(r + 1)) and "NOT switch-feasible" in \
            out.sends[0][1].meta["label"]
    return rounds, peers


def errors_sent(out) -> dict:
    """{peer: (reason, text)} of the ERROR frames in an outcome."""
    return {p: (f.meta["reason"], f.text) for p, f in out.sends if f.type == FrameType.ERROR}


def test_a_round_completes_once_every_rank_delivered():
    rounds, peers = joined(3)
    x = np.linspace(-1, 1, 50, dtype=np.float32)
    for r in range(2):
        out = rounds.on_frame(peers[r], data(C.get("3lc", seed=r), x, r, world=3), T0 + r)
        assert out.keep and out.complete is None and not out.sends
        assert out.round_started == (r == 0)
    out = rounds.on_frame(peers[2], data(C.get("3lc", seed=2), x, 2, world=3), T0 + 2)
    assert out.complete is not None and sorted(out.complete.msgs) == [0, 1, 2] and out.job.next_round == 1
    assert out.complete.spec["codec"] == "3lc" and out.complete.spec["elements"] == 50
    assert rounds.counters["messages"] == 3 and rounds.per_codec["3lc"]["messages"] == 3
    rounds.round_sent(out.job, out.complete, 3, 10, (0.1, 0.2, 0.3))
    assert rounds.counters["rounds"] == 1 and rounds.per_codec["3lc"]["bytes_out"] == 30
    assert rounds.jobs_stats()[str(JOB)]["pending_round"] is None
    assert not any(rounds.errors.values())


def test_ranks_disagreeing_on_the_element_count_abort_the_job_for_everyone():
    rounds, peers = joined(2)
    rounds.on_frame(peers[0], data(C.get("3lc", seed=0), np.ones(10, np.float32), 0), T0)
    out = rounds.on_frame(peers[1], data(C.get("3lc", seed=1), np.ones(12, np.float32), 1), T0)
    errs = errors_sent(out)
    assert set(errs) == set(peers) and out.complete is None
    for reason, text in errs.values():
        assert reason == "mismatch" and "ranks disagree on the element count: rank 0: 10, rank 1: 12" in text
    assert rounds.errors["mismatch"] == 1 and rounds.counters["jobs_aborted"] == 1
    # a later message of the aborted job is answered (not counted again)
    again = rounds.on_frame(peers[0], data(C.get("3lc", seed=0), np.ones(10, np.float32), 0, rnd=1), T0)
    assert errors_sent(again)[peers[0]][0] == "aborted" and rounds.errors["mismatch"] == 1


def test_a_missing_rank_is_named_once_the_deadline_passes():
    rounds, peers = joined(2, job=JOB)
    rounds.on_frame(Peer("late:1"), hello(2, 3, job=8), T0)        # job 8: rank 2 of 3 joined
    out = rounds.on_frame(peers[0], data(C.get("eaq", seed=0), np.ones(8, np.float32), 0), T0)
    assert rounds.next_deadline() == pytest.approx(T0 + 5.0)
    assert rounds.expire(T0 + 4.9) == (0, [])
    n, sends = rounds.expire(T0 + 5.0)
    assert n == 1 and [p for p, _ in sends] == peers
    text = sends[0][1].text
    assert sends[0][1].meta["reason"] == "timeout" and sends[0][1].round == 0
    assert "rank(s) [1] did not deliver their message within 5 s of the first one; delivered: ranks [0]" in text
    assert rounds.errors["timeout"] == 1 and rounds.next_deadline() is None
    assert out.round_started


def test_a_rank_that_never_connected_is_named_as_such():
    rounds = Rounds()
    p0 = Peer("a:1")
    rounds.on_frame(p0, hello(0, 3), T0)
    rounds.on_frame(p0, data(C.get("wgt", threshold=0.5, seed=0), np.ones(4, np.float32), 0, world=3), T0)
    _, sends = rounds.expire(T0 + 6)
    assert "rank(s) [1, 2] never connected" in sends[0][1].text


def test_disconnect_and_bye_during_a_round_abort_it():
    rounds, peers = joined(3)
    rounds.on_frame(peers[0], data(C.get("3lc", seed=0), np.ones(6, np.float32), 0, world=3), T0)
    out = rounds.on_closed(peers[2])
    errs = errors_sent(out)
    assert set(errs) == {peers[0], peers[1]} and errs[peers[0]][0] == "disconnect"
    assert "rank 2 disconnected" in errs[peers[0]][1] and "round 0 had messages from ranks [0]" in errs[peers[0]][1]

    rounds, peers = joined(2)
    rounds.on_frame(peers[0], data(C.get("3lc", seed=0), np.ones(6, np.float32), 0), T0)
    out = rounds.on_frame(peers[1], Frame(FrameType.BYE, job=JOB, rank=1, world_size=2), T0)
    assert not out.keep and errors_sent(out)[peers[0]] == (
        "left", f"job {JOB}: rank 1 left the job during round 0 (delivered: ranks [0])")


def test_late_hello_to_an_aborted_job_hears_why_and_jobs_end_when_all_ranks_left():
    rounds, peers = joined(2)
    rounds.on_closed(peers[1])                       # no round pending: aborted as a disconnect
    assert rounds.jobs[JOB].aborted
    out = rounds.on_frame(Peer("late:2"), hello(1, 2), T0)
    assert not out.keep and errors_sent(out).popitem()[1][0] == "aborted"
    assert rounds.errors["disconnect"] == 1 and sum(rounds.errors.values()) == 1
    rounds.on_closed(peers[0])
    assert JOB not in rounds.jobs and rounds.counters["jobs_finished"] == 0

    rounds, peers = joined(2)
    for r, p in enumerate(peers):
        rounds.on_frame(p, Frame(FrameType.BYE, job=JOB, rank=r, world_size=2), T0)
        rounds.on_closed(p)
    assert JOB not in rounds.jobs and rounds.counters["jobs_finished"] == 1 and not any(rounds.errors.values())


def test_joining_rules():
    rounds, peers = joined(2)
    assert errors_sent(rounds.on_frame(Peer("x:1"), hello(0, 2), T0)).popitem()[1] == (
        "protocol", f"job {JOB}: rank 0 is already connected (from 10.0.0.0:5000)")
    assert "says world_size 3" in errors_sent(rounds.on_frame(Peer("x:2"), hello(2, 3), T0)).popitem()[1][1]
    assert errors_sent(rounds.on_frame(Peer("x:3"), hello(0, 2, timeout=0), T0)).popitem()[1][0] == "bad_frame"
    assert errors_sent(rounds.on_frame(Peer("x:4"), hello(5, 2, job=9), T0)).popitem()[1][0] == "bad_frame"
    second = rounds.on_frame(peers[0], hello(0, 2, job=9), T0)
    assert not second.keep and "a second HELLO" in errors_sent(second)[peers[0]][1]
    early = rounds.on_frame(Peer("x:5"), data(C.get("3lc"), np.ones(3, np.float32), 0), T0)
    assert early.keep and "before HELLO" in errors_sent(early).popitem()[1][1]
    assert rounds.errors["protocol"] == 3 and rounds.errors["mismatch"] == 1 and rounds.errors["bad_frame"] == 2


def test_round_numbers_unknown_codecs_and_same_seeds_are_refused():
    rounds, peers = joined(2)
    out = rounds.on_frame(peers[0], data(C.get("3lc"), np.ones(3, np.float32), 0, rnd=4), T0)
    assert "rank 0 sent round 4, the job is at round 0" in errors_sent(out)[peers[0]][1]

    rounds, peers = joined(2)
    f = data(C.get("3lc"), np.ones(3, np.float32), 0)
    f.codec = 250
    assert errors_sent(rounds.on_frame(peers[0], f, T0))[peers[0]][0] == "unknown_codec"

    rounds, peers = joined(2)
    x = np.linspace(0, 1, 40, dtype=np.float32)
    rounds.on_frame(peers[0], data(C.get("eaq", seed=5), x, 0, key="w"), T0)
    out = rounds.on_frame(peers[1], data(C.get("eaq", seed=5), x, 1, key="w"), T0)
    assert "ranks [0, 1] use eaq codec objects with the same random state" in errors_sent(out)[peers[1]][1]
    assert out.complete is None and rounds.errors["same_seed"] == 1


# ------------------------------------------------------------------------------------------------ codec step
@pytest.mark.parametrize("name,opts", [("3lc", {}), ("eaq", {}), ("wgt", {"threshold": 0.5}), ("nc", {})])
def test_reduce_round_is_the_rank_ordered_sum_re_encoded(name, opts):
    world, n, key = 3, 300, "layer"
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    ranks = [C.get(name, seed=10 + r, **opts) for r in range(world)]
    msgs = [data(ranks[r], xs[r], r, world=world, key=key) for r in range(world)]
    codecs = {}
    options = json.dumps(msgs[0].meta["options"], sort_keys=True)
    codec = downlink_codec(codecs, JOB, name, options, 0, "t")
    assert list(codecs) == [(name, options)] and downlink_codec(codecs, JOB, name, options, 0, "t") is codec
    res = reduce_round(codec, msgs, n, key, "t")
    # reference: fresh codecs with the same seeds
    refs = [C.get(name, seed=10 + r, **opts) for r in range(world)]
    acc = np.zeros(n, np.float64)
    for r in range(world):
        acc += np.asarray(refs[r].decompress(refs[r].compress(xs[r], **refs[r].key_argument(key))), np.float32)
    agg = C.get(name, seed=aggregator_seed(JOB, name, 0), **opts)
    flags, meta, body = pack_encoded(agg.compress(acc.astype(np.float32), **agg.key_argument(key)))
    assert res.flags == flags and res.meta == meta and np.array_equal(res.body, body)
    assert min(res.decode_s, res.sum_s, res.encode_s) >= 0


def test_reduce_round_names_what_failed():
    codec = C.get("3lc", seed=1)
    good = data(C.get("3lc", seed=2), np.ones(100, np.float32), 0)
    bad = Frame(FrameType.DATA, 0, JOB, 1, 2, 0, codec.wire_id, 100, None, {}, np.zeros(3, np.uint8))
    with pytest.raises(RoundFailed) as e:
        reduce_round(codec, [good, bad], 100, None, "job 7 round 0")
    assert e.value.reason == "decode" and "cannot decode rank 1's message (3 bytes)" in str(e.value)
    with pytest.raises(RoundFailed) as e:
        downlink_codec({}, JOB, "3lc", '{"s": "not a number"}', 0, "job 7 round 0")
    assert e.value.reason == "bad_codec_options"


# ------------------------------------------------------------------------------------------------ declarations
def test_the_protocol_doc_shows_the_declared_header():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "host-protocol.md").read_text()
    assert header_table() in doc
    assert HEADER.size == HEADER_SIZE == 48 and len(HEADER_FIELDS) == len(HEADER.unpack(bytes(48)))
    assert JOB_ROUND == 2**64 - 1


def test_result_widths_have_one_rule():
    P = PayloadType
    assert result_type(P.NC8, False, 64) == P.NC8
    assert result_type(P.NC8, True, 64) == P.INT64 and result_type(P.NC8, True, 32) == P.INT32
    assert result_type(P.INT8_NARROW, True, 64) == P.INT8_NARROW
    assert result_type(P.INT8, True, 64) == P.INT32 and result_type(P.INT32, False, 64) == P.INT32
    assert result_type(P.NONE, True, 64) == P.NONE
    assert C.get("nc").result_width(4) == 1 and C.get("bfp32").result_width(4) == 4
    assert C.get("3lc-3v").result_width(4) == 1 and C.get("3lc-3v").result_width(200) == 4
    mq = C.get("mqgrad")
    assert mq.adaptive_width and mq.result_width(2, any_state=True) == PAYLOAD_WIDTH[P.INT32]


@pytest.mark.parametrize("name", C.available())
def test_codec_metadata_is_declared_on_the_interface(name):
    codec = C.get(name)
    assert codec.aggregation == ("switch" if codec.switch_summable else "host")
    assert ("NOT switch-feasible" in codec.label) == (codec.aggregation == "host")
    takes_key = "key" in inspect.signature(codec.compress).parameters
    assert codec.keeps_residuals == takes_key
    assert codec.key_argument("k") == ({"key": "k"} if takes_key else {}) and codec.key_argument(None) == {}
    assert codec.residual_keys() == [] and codec.residual("k") is None
    again = C.get(name, seed=3, **codec.options())
    assert again.options() == codec.options()
    assert (codec.rng_fingerprint() is None) == (not codec.stochastic)


def test_a_block_encoded_from_its_element_draws_what_the_whole_tensor_draws():
    codec = C.get("nc")
    x = np.random.default_rng(2).standard_normal(3000).astype(np.float32)
    ctx = C.ScaleContext(codec.scale_exponent(x), 2, seed=12345)
    whole = codec.encode_shared(x, ctx)
    blocks = np.concatenate([codec.encode_shared(x[lo:lo + 1000], ctx.from_element(lo)) for lo in (0, 1000, 2000)])
    assert np.array_equal(whole, blocks)
    assert not np.array_equal(whole[1000:2000], codec.encode_shared(x[1000:2000], ctx))
