"""Sparse block streaming: chunks zero at a worker do not travel, chunks zero everywhere get no round.

Real switch processes and real UDP sockets on loopback; fixed seeds. The exactness reference is the
dense block floating point arithmetic (sw_harness.bfp_reference): skipping zero chunks must not change
a single bit. Bytes are measured on the switch's counters and compared with a model of the protocol
written here from its rules (every worker sends every round: its codes, or 24 header-only bytes).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from ina import dissect, wire
from ina.client import AllreduceError
from ina.sparse import next_nonzero

sys.path.insert(0, os.path.dirname(__file__))
from sw_harness import SwitchProc, bfp_reference, client_threads  # noqa: E402

N = 4
E = 64


def sparse_inputs(n_chunks: int, zero_fraction: float, seed: int, world: int = N) -> list[np.ndarray]:
    """Per rank: normal values in (n_chunks, E) blocks, each block zero with ``zero_fraction``; ranks
    draw their non-zero blocks independently (they differ), and scales differ by rank."""
    out = []
    for r in range(world):
        rng = np.random.default_rng([seed, r])
        x = rng.standard_normal((n_chunks, E)) * 2.0 ** (r % 3 - 1)
        x[rng.random(n_chunks) < zero_fraction] = 0.0
        out.append(x.astype(np.float32).reshape(-1))
    return out


def model_rounds(masks: list[np.ndarray], S: int) -> np.ndarray:
    """The positions that get a round, by the protocol's rules (an independent loop, not ina.sparse):
    the first chunk of each stream; then the min over workers of their announcements, where a worker
    announces its next non-zero chunk of the stream if it is an odd number of steps ahead, else the
    chunk one step before it; past the tensor: the stream's first position after it."""
    n = masks[0].size
    rounds = []
    for s in range(min(S, n)):
        j = s
        while j < n:
            rounds.append(j)
            ann = []
            for m in masks:
                t = j + S
                while t < n and not m[t]:
                    t += S
                ann.append(t if ((t - j) // S) % 2 == 1 else t - S)
            j = min(ann)
    return np.array(sorted(rounds))


# ------------------------------------------------------------------------------------------------
# the rules, without a switch
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("S", [1, 3, 8])
def test_rounds_cover_every_nonzero_chunk_and_alternate_shadow_sets(S):
    rng = np.random.default_rng(7)
    for trial in range(200):
        n = int(rng.integers(1, 60))
        masks = [rng.random(n) < rng.choice([0.0, 0.1, 0.5, 1.0]) for _ in range(3)]
        rounds = model_rounds(masks, S)
        union = np.flatnonzero(np.any(masks, axis=0))
        assert set(union) <= set(rounds), (trial, union, rounds)
        for s in range(min(S, n)):
            mine = rounds[rounds % S == s]
            assert np.all((np.diff(mine) // S) % 2 == 1), (trial, s, mine)
            ids = np.append(mine, next(j for j in range(mine[-1] + S, n + 2 * S, S) if j >= n))
            shadows = (wire.slot_of_chunk(ids, S) >> 15) & 1
            assert np.all(shadows[1:] != shadows[:-1]), (trial, s, ids)   # the next allreduce's chunk too


def test_next_nonzero_agrees_with_a_loop():
    rng = np.random.default_rng(3)
    for _ in range(100):
        n, S = int(rng.integers(1, 50)), int(rng.integers(1, 9))
        m = rng.random(n) < 0.3
        want = []
        for j in range(n):
            t = j + S
            while t < n and not m[t]:
                t += S
            want.append(t)
        assert next_nonzero(m, S).tolist() == want


def test_sparse_packets_round_trip_through_unpack_and_scapy():
    data = wire.pack(msg_type=wire.MsgType.DATA, job=7, rank=2, pool_index=3, codec=3,
                     payload_type=wire.PayloadType.INT32, count=2, exponent=1, chunk=3, payload=[-1, 5],
                     elements=2, next=3 + 8 * 3)
    assert data == bytes.fromhex("01010010000700020003030200020001 00000003 ffffffff00000005 0000001b".replace(" ", ""))
    p = wire.unpack(data)
    assert (p.next, p.payload.tolist(), p.flags) == (27, [-1, 5], wire.Flag.SPARSE)
    skip = wire.pack(msg_type=wire.MsgType.DATA, job=7, rank=1, pool_index=3, codec=3, exponent=1, chunk=3, next=11)
    assert skip == bytes.fromhex("0101001000070001000303000000000100000003 0000000b".replace(" ", ""))
    assert len(skip) == wire.HEADER_SIZE + wire.TRAILER_SIZE and wire.unpack(skip).next == 11
    result = wire.pack(msg_type=wire.MsgType.RESULT, job=7, rank=wire.SWITCH_RANK, pool_index=3, codec=3,
                       payload_type=wire.PayloadType.INT32, count=2, exponent=1, chunk=3, payload=[-1, 5], elements=2,
                       flags=wire.Flag.RAW_SUM, next=11)      # docs/wire-format.md, example 7
    assert result == bytes.fromhex("010200180007ffff0003030200020001 00000003 ffffffff00000005 0000000b"
                                   .replace(" ", ""))
    for b in (data, skip, result):
        s = dissect.INA(b)
        assert s.next == wire.unpack(b).next and bytes(s) == b
    assert dissect.INA(data).codes == [-1, 5]
    with pytest.raises(wire.WireError, match="SPARSE trailer"):
        wire.unpack(skip[:22])


# ------------------------------------------------------------------------------------------------
# through the switch
# ------------------------------------------------------------------------------------------------
def _run(port, inputs_per_op, sparse_per_op, job, codec="bfp32", **client):
    def body(r, cl):
        outs = []
        for xs, sp in zip(inputs_per_op, sparse_per_op):
            t = xs[r].copy()
            cl.allreduce(t, codec=codec, sparse=sp)
            outs.append(t)
        return outs, cl.stats.as_dict()
    return client_threads(port, N, job, body, elements=E, **client)


def assert_exact(res, ops):
    """Every rank's result of every op equals the dense block floating point arithmetic, bit for bit."""
    for i, xs in enumerate(ops):
        ref = bfp_reference(xs)
        for r in range(N):
            assert np.array_equal(res[r][0][i].view(np.uint32), ref.view(np.uint32)), (i, r)


@pytest.mark.parametrize("zero_fraction", [0.0, 0.5, 0.99, 1.0])
def test_sparse_bfp32_is_exact(tmp_path, zero_fraction):
    """Sparse allreduces equal the dense integer arithmetic bit for bit, for 0-100% zero blocks whose
    positions differ between the workers; dense and sparse allreduces interleave in one job (and the
    99% case starts near the chunk id wrap, with 5 slots: a chunk modulus below 2**32)."""
    slots, first = (5, wire.chunk_modulus(5) - 37) if zero_fraction == 0.99 else (8, 0)
    ops = [sparse_inputs(300, zero_fraction, seed=11), sparse_inputs(130, zero_fraction, seed=12),
           sparse_inputs(3, zero_fraction, seed=13)]
    sparse = [True, False, True, True]
    ops.insert(2, ops[1])
    sw = SwitchProc("--slots", "64", "--elements", str(E), log_path=tmp_path / "switch.log")
    try:
        res = _run(sw.port, ops, sparse, job=1, slots=slots, first_chunk=first, timeout=30)
        drops = sw.stats()["drops"]
    finally:
        sw.terminate()
    assert_exact(res, ops)
    assert drops["bad_next"] == drops["payload_type_mismatch"] == drops["slot_busy"] == drops["stale"] == 0, drops


@pytest.mark.parametrize("codec", ["nc", "rd"])
def test_sparse_composes_with_stochastic_codecs(tmp_path, codec):
    """Natural compression (NC8 codes, raw int64 sums) and random dithering (int8 codes, int8 sums
    back): a sparse allreduce returns the same bits as a dense one of the same codes (two jobs, same
    chunk ids, same client seeds)."""
    xs = [sparse_inputs(200, 0.9, seed=21)]
    sw = SwitchProc("--slots", "64", "--elements", str(E), log_path=tmp_path / "switch.log")
    try:
        dense = _run(sw.port, xs, [False], job=2, codec=codec, slots=8, raw=True, seed=5)
        sparse = _run(sw.port, xs, [True], job=3, codec=codec, slots=8, raw=True, seed=5)
    finally:
        sw.terminate()
    for r in range(N):
        assert np.array_equal(dense[r][0][0], sparse[r][0][0]), r
    assert np.count_nonzero(dense[0][0][0]) > 0


def test_sparse_streams_across_switch_cores(tmp_path):
    """--cores 2: each pool index (a stream) lives in one shard; sparse results stay exact."""
    ops = [sparse_inputs(200, 0.9, seed=51), sparse_inputs(70, 0.5, seed=52)]
    sw = SwitchProc("--slots", "64", "--elements", str(E), "--cores", "2", log_path=tmp_path / "switch.log")
    try:
        res = _run(sw.port, ops, [True, True], job=5, slots=8, timeout=30)
    finally:
        sw.terminate()
    assert_exact(res, ops)


def test_sparse_with_a_host_aggregated_codec_is_refused(tmp_path):
    sw = SwitchProc("--slots", "64", "--elements", str(E), log_path=tmp_path / "switch.log")
    try:
        def body(r, cl):
            with pytest.raises(ValueError, match="host aggregator"):
                cl.allreduce(np.ones(10, np.float32), codec="topk", sparse=True)
            t = np.full(10, float(r), np.float32)
            cl.allreduce(t, codec="bfp32", sparse=True)     # the client stays usable
            return t
        out = client_threads(sw.port, 2, 6, body, elements=E, slots=4)
    finally:
        sw.terminate()
    assert out[0].tolist() == [1.0] * 10


def test_client_default_and_ina_sparse(tmp_path, monkeypatch):
    """Client(sparse=True) (what gloo_patch passes for INA_SPARSE=1) streams switch-summable codecs
    sparse without a per-call argument, and leaves host-aggregated codecs to the host aggregator."""
    from gloo_patch.common import InaConfig, InaConfigError
    monkeypatch.setenv("INA_SWITCH", "127.0.0.1:9999")
    monkeypatch.setenv("INA_SPARSE", "1")
    assert InaConfig.from_env().client_kwargs()["sparse"] is True
    monkeypatch.setenv("INA_SPARSE", "yes")
    with pytest.raises(InaConfigError, match="INA_SPARSE='yes': expected an integer"):
        InaConfig.from_env()
    monkeypatch.delenv("INA_SPARSE")
    assert InaConfig.from_env().client_kwargs()["sparse"] is False
    xs = sparse_inputs(100, 0.9, seed=70, world=2)
    sw = SwitchProc("--slots", "64", "--elements", str(E), log_path=tmp_path / "switch.log")
    try:
        def body(r, cl):
            t = xs[r].copy()
            cl.allreduce(t, codec="bfp32")
            cl.allreduce(np.ones(100, np.float32), codec="topk")      # host-aggregated: not sparse, no error
            return t, cl.stats.sparse_chunks_skipped
        out = client_threads(sw.port, 2, 8, body, elements=E, slots=4, sparse=True)
    finally:
        sw.terminate()
    ref = bfp_reference(xs)
    for t, skipped in out:
        assert np.array_equal(t.view(np.uint32), ref.view(np.uint32))
        assert skipped > 0


def test_workers_that_disagree_on_sparse_get_a_clear_error(tmp_path):
    """Rank 0 streams sparse, rank 1 dense: rank 1 is told at its first result that the results are
    sparse, rank 0 gets the bounded stall error; nothing hangs."""
    xs = sparse_inputs(40, 0.5, seed=60, world=2)
    sw = SwitchProc("--slots", "64", "--elements", str(E), log_path=tmp_path / "switch.log")
    try:
        def body(r, cl):
            try:
                cl.allreduce(xs[r].copy(), codec="bfp32", sparse=(r == 0))
            except AllreduceError as e:
                return str(e)
            return None
        msgs = client_threads(sw.port, 2, 7, body, elements=E, slots=4, timeout=5)
    finally:
        sw.terminate()
    assert msgs[1] is not None and "must pass the same sparse=" in msgs[1], msgs
    assert msgs[0] is not None, msgs


def test_sparse_survives_loss_and_duplication(tmp_path):
    """5% loss and 5% duplication both ways: sparse bfp32 stays exact (no chunk counted twice, none
    missing), and the switch saw losses and duplicates."""
    ops = [sparse_inputs(400, f, seed=30 + k) for k, f in enumerate((0.9, 0.99, 0.5))]
    sw = SwitchProc("--slots", "64", "--elements", str(E), "--loss", "0.05", "--duplicate", "0.05", "--seed", "4",
                    log_path=tmp_path / "switch.log")
    try:
        res = _run(sw.port, ops, [True] * 3, job=4, slots=8, timeout=60, rto=0.05, max_rto=0.4)
        imp = sw.stats()["impairments"]
    finally:
        sw.terminate()
    dropped = sum(imp[d]["dropped"] for d in ("ingress", "egress"))
    duplicated = sum(imp[d]["duplicated"] for d in ("ingress", "egress"))
    assert dropped >= 20 and duplicated >= 20, imp
    assert_exact(res, ops)
    assert sum(res[r][1]["retransmissions"] for r in range(N)) > 0


def test_bytes_on_the_wire_scale_with_the_nonzero_fraction(tmp_path):
    """The switch's received bytes of a sparse allreduce equal the protocol's model (every worker
    sends every round: its codes, or 24 bytes if its chunk is zero) and follow the workers' non-zero
    fraction of the dense bytes; the results' bytes follow the union of the non-zero chunks."""
    S, n_chunks = 8, 800
    fractions = (0.0, 0.9, 0.99)
    ops = [sparse_inputs(n_chunks, f, seed=40) for f in fractions]
    sw = SwitchProc("--slots", "64", "--elements", str(E), log_path=tmp_path / "switch.log")
    rx, tx, resent, stats = [], [], [], []
    try:
        # one allreduce at a time, counters read between them: run the ops one per client_threads call
        for k, (xs, sp) in enumerate([(ops[0], False)] + [(o, True) for o in ops]):
            before = sw.stats()["counters"]
            # timeouts far above loopback round trips: resends are rare (fast retransmissions of a
            # round that waits for a slower rank), and each adds at most one packet up and one down
            res = _run(sw.port, [xs], [sp], job=10 + k, slots=S, rto=2.0, min_rto=1.0, max_rto=4.0)
            resent.append(sum(r[1]["retransmissions"] for r in res))
            stats.append([r[1] for r in res])
            after = sw.stats()["counters"]
            rx.append(after["rx_bytes"] - before["rx_bytes"])
            tx.append(after["tx_bytes"] - before["tx_bytes"])
    finally:
        sw.terminate()
    # the exponent negotiation: one header per worker, and its result; each twice (the last chunk of a
    # stream is sent twice and its result multicast twice: ina.recovery's tail copies)
    neg = 2 * N * wire.HEADER_SIZE
    data_len = wire.HEADER_SIZE + 4 * E + wire.TRAILER_SIZE
    dense_up = rx[0] - neg              # the dense stream's last chunk is a tail copy too (sparse streams have none)
    assert 0 <= dense_up - N * (n_chunks + 1) * (wire.HEADER_SIZE + 4 * E) <= resent[0] * data_len
    for f, up, down, xs, extra, st in zip(fractions, rx[1:], tx[1:], ops, resent[1:], stats[1:]):
        masks = [x.reshape(n_chunks, E).any(axis=1) for x in xs]
        rounds = model_rounds(masks, S)
        own = sum(int(m.sum()) for m in masks)
        # the clients' counters say the same: header-only packets, chunks no worker sent
        assert sum(s["sparse_header_only"] for s in st) == N * rounds.size - own
        assert {s["sparse_chunks_skipped"] for s in st} == {n_chunks - rounds.size}
        want_up = own * data_len + (N * rounds.size - own) * (wire.HEADER_SIZE + wire.TRAILER_SIZE)
        assert 0 <= up - neg - want_up <= extra * data_len, (f, up - neg, want_up, extra)
        union = np.any(masks, axis=0)
        data_rounds = int(union[rounds].sum())
        want_down = N * (data_rounds * data_len + (rounds.size - data_rounds) * 24)
        assert 0 <= down - neg - want_down <= extra * data_len, (f, down - neg, want_down, extra)
        density = own / (N * n_chunks)
        # 64 elements per packet: the trailer and the 24-byte header-only packets cost 9% of a chunk each
        assert density <= (up - neg) / dense_up < 1.5 * density + 0.01, (f, (up - neg) / dense_up, density)
