"""Host-aggregator mode of the switch service (NOT switch-feasible): variable-length codecs.

A real ``python -m switch_model serve`` subprocess (which starts the aggregator process), real TCP
sockets on loopback, one :class:`~ina.host_client.HostAggClient` per rank (threads of this process).
Every result is checked against a reference built here from fresh codec objects with the same seeds
and keys: each rank's decompress(compress(x)), summed in float64 in rank order, then compressed and
decompressed by a codec with the aggregator's seed (CRC-32 of "ina-host-agg/<seed>/<job>/<codec>").
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

import ina.compression as C
from ina.control import ControlChannel, request
from ina.errors import AllreduceError
from ina.host_client import HostAggClient, host_aggregator_address
from ina.host_wire import HEADER, HOST_AGG_LABEL, MAGIC, VERSION, FrameType, recv_frame
from switch_model.launch import start_switch

HOST_CODECS = [("3lc", {}), ("eaq", {}), ("wgt", {"threshold": 0.5}), ("topk", {"ratio": 0.05})]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The switch service with its host aggregator on the default port (switch port + 100)."""
    log_path = tmp_path_factory.mktemp("hagg") / "switch.log"
    sw = start_switch(None, "--stats-interval", "0", "--slots", "8", "--elements", "64", host="127.0.0.1",
                      log_path=log_path)
    port = sw.port
    addr = host_aggregator_address(("127.0.0.1", port))
    log = log_path.read_text()
    assert addr[1] == port + 100 or "is taken" in log, log
    assert f"host aggregator (NOT switch-feasible) on tcp 127.0.0.1:{addr[1]}" in log, log
    yield {"port": port, "addr": addr, "log": log_path}
    assert sw.stop(timeout=60) == 0, log_path.read_text()     # bounded generously: a loaded machine
    log = log_path.read_text()
    assert "host aggregator stopped:" in log and "signal 15: shutting down" in log, log
    with pytest.raises(OSError):          # the aggregator process went down with the service
        socket.create_connection(addr, timeout=2).close()


def agg_stats(service) -> dict:
    return request("127.0.0.1", service["port"], {"op": "stats"})["stats"]["host_aggregator"]


def agg_seed(job: int, name: str) -> int:
    return zlib.crc32(f"ina-host-agg/0/{job}/{name}".encode())


def run_ranks(addr, job: int, world: int, fn, ranks=None, timeout: float = 5.0):
    """Run fn(rank, client) for each rank in a thread with its own client; (results, errors) by rank."""
    ranks = list(range(world)) if ranks is None else ranks
    out, errs = {}, {}
    joined = threading.Barrier(len(ranks), timeout=timeout + 10)   # every rank registered before any sends

    def one(r):
        try:
            c = HostAggClient(addr, rank=r, world_size=world, job=job, timeout=timeout)
        except Exception as e:  # noqa: BLE001
            errs[r] = e
            joined.abort()
            return
        try:
            joined.wait()
            out[r] = fn(r, c)
        except Exception as e:  # noqa: BLE001
            errs[r] = e
        finally:
            c.close()

    ts = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=timeout + 30)
    assert not any(t.is_alive() for t in ts), "a rank did not return"
    return out, errs


def inputs(codec: str, rank: int, rnd: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([zlib.crc32(codec.encode()), rank, rnd])
    x = rng.standard_normal(n) * (0.5 + rank)
    x[rng.random(n) < 0.3] = 0.0                 # some sparsity (zero runs for 3lc)
    return x.astype(np.float32)


def reference(name: str, opts: dict, job: int, world: int, rounds: int, n: int, key, rank_seed, x_of=None):
    """Per round: the aggregator's output, from fresh codecs (ranks' and aggregator's seeds)."""
    x_of = x_of or (lambda r, t: inputs(name, r, t, n))
    ranks = [C.get(name, seed=rank_seed(r), **opts) for r in range(world)]
    agg = C.get(name, seed=agg_seed(job, name), **opts)
    kw = {"key": key} if key is not None else {}
    outs = []
    for t in range(rounds):
        acc = np.zeros(n, np.float64)
        for r in range(world):
            acc += ranks[r].decompress(ranks[r].compress(x_of(r, t), **kw)).astype(np.float64)
        outs.append(agg.decompress(agg.compress(acc.astype(np.float32), **kw)))
    return outs, ranks, agg


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,opts", HOST_CODECS)
def test_variable_length_codecs_match_the_reference(service, name, opts):
    """4 workers, 3 rounds with error feedback: every rank gets exactly the reference result."""
    import torch
    job, world, rounds, shape = 10 + [c for c, _ in HOST_CODECS].index(name), 4, 3, (37, 101)
    n = int(np.prod(shape))
    codecs = {}

    def work(r, c):
        codec = codecs[r] = C.get(name, seed=100 + r, **opts)
        assert codec.variable_length and codec.aggregation == "host" and "NOT switch-feasible" in codec.label
        assert "NOT switch-feasible" in c.label
        got = []
        for t in range(rounds):
            x = inputs(name, r, t, n).reshape(shape)
            if r == 0:                            # rank 0 passes torch tensors: written back in place
                x = torch.from_numpy(x.copy())
            assert c.allreduce(x, codec, key="layer1.weight") is x
            got.append(np.asarray(x).reshape(-1).copy())
        return got, c.stats.as_dict()

    out, errs = run_ranks(service["addr"], job, world, work)
    assert not errs, errs
    ref, _, _ = reference(name, opts, job, world, rounds, n, "layer1.weight", lambda r: 100 + r)
    for r in range(world):
        for t in range(rounds):
            assert np.array_equal(out[r][0][t], ref[t]), (name, r, t)
    st = out[1][1]
    assert st["allreduces"] == rounds and "NOT switch-feasible" in st["label"]
    # variable length on the wire: fewer bytes than float32 up and down
    assert 0 < st["message_bytes_sent"] < 4 * n * rounds and 0 < st["message_bytes_received"] < 4 * n * rounds


@pytest.mark.parametrize("name,opts", [("3lc", {}), ("wgt", {"threshold": 0.5}), ("topk", {"ratio": 0.3})])
def test_error_feedback_keeps_long_run_sums(service, name, opts):
    """Over 40 rounds with a key: sum of results == sum of inputs - ranks' residuals - aggregator's
    residual, and the error stays bounded; without a key (stateless) the same inputs drift away."""
    world, rounds, n = 3, 40, 300
    bias = np.random.default_rng(7).uniform(-0.3, 0.3, n).astype(np.float32)

    def x_of(r, t):
        return (bias * (r + 1) + 0.05 * np.random.default_rng([r, t]).standard_normal(n)).astype(np.float32)

    true = sum(x_of(r, t).astype(np.float64) for r in range(world) for t in range(rounds))
    results = {}
    for job, key in ((30 + len(name), "g"), (40 + len(name), None)):
        codecs = {r: C.get(name, seed=r, **opts) for r in range(world)}

        def work(r, c):
            cum = np.zeros(n, np.float64)
            for t in range(rounds):
                x = x_of(r, t)
                c.allreduce(x, codecs[r], key=key)
                cum += x
            return cum

        out, errs = run_ranks(service["addr"], job, world, work)
        assert not errs, errs
        assert all(np.array_equal(out[0], out[r]) for r in range(world))
        results[key] = (out[0], codecs)
    cum, codecs = results["g"]
    _, _, agg = reference(name, opts, 30 + len(name), world, rounds, n, "g", lambda r: r, x_of)
    residuals = sum(codecs[r].residual("g").astype(np.float64) for r in range(world)) + agg.residual("g")
    assert np.allclose(cum + residuals, true, rtol=1e-5, atol=1e-3), np.max(np.abs(cum + residuals - true))
    err_ef = np.max(np.abs(cum - true))
    err_stateless = np.max(np.abs(results[None][0] - true))
    one_round = np.max(np.abs(true)) / rounds
    print(name, "error with feedback", err_ef, "stateless", err_stateless, "one round", one_round)
    assert err_ef < 3 * one_round, (err_ef, one_round)
    assert err_stateless > 4 * err_ef, (err_stateless, err_ef)


def test_missing_rank_is_named_within_the_timeout(service):
    """Rank 2 connects but never sends, rank 3 never connects: ranks 0 and 1 get a bounded error."""
    before = agg_stats(service)["errors"]["timeout"]
    idle = HostAggClient(service["addr"], rank=2, world_size=4, job=50, timeout=1.0)
    try:
        t0 = time.monotonic()
        out, errs = run_ranks(service["addr"], 50, 4, lambda r, c: c.allreduce(np.ones(1000, np.float32),
                                                                            C.get("3lc", seed=r), key="w"),
                              ranks=[0, 1], timeout=1.0)
        took = time.monotonic() - t0
        assert not out and set(errs) == {0, 1}
        for e in errs.values():
            assert isinstance(e, AllreduceError)
            assert "rank(s) [2, 3] did not deliver their message within 1 s" in str(e), str(e)
            assert "delivered: ranks [0, 1]" in str(e) and "rank(s) [3] never connected" in str(e), str(e)
        assert took < 20, took      # bounded (by the 1 s deadline, not the 30 s frame timeout); a loaded machine adds seconds
        # the idle rank learns of the abort before it sends anything
        with pytest.raises(AllreduceError, match=r"\[timeout\].*rank\(s\) \[2, 3\]"):
            idle.allreduce(np.ones(1000, np.float32), C.get("3lc", seed=2), key="w")
    finally:
        idle.close()
    assert agg_stats(service)["errors"]["timeout"] == before + 1


def test_disconnected_rank_aborts_the_round(service):
    before = agg_stats(service)["errors"]["disconnect"]
    c0 = HostAggClient(service["addr"], rank=0, world_size=2, job=51, timeout=60.0)
    c1 = HostAggClient(service["addr"], rank=1, world_size=2, job=51, timeout=60.0)
    try:
        c1.sock.close()                       # rank 1 dies without BYE
        c1.sock = None
        t0 = time.monotonic()
        with pytest.raises(AllreduceError, match="rank 1 disconnected"):
            c0.allreduce(np.ones(500, np.float32), C.get("wgt", seed=0), key="w")
        assert time.monotonic() - t0 < 30     # not the job's 60 s timeout (room for a loaded machine)
    finally:
        c0.close()
    assert agg_stats(service)["errors"]["disconnect"] == before + 1


def test_mismatched_element_count_names_the_ranks(service):
    before = agg_stats(service)["errors"]["mismatch"]
    out, errs = run_ranks(service["addr"], 52, 3, lambda r, c: c.allreduce(
        np.ones(999 if r == 2 else 1000, np.float32), C.get("eaq", seed=r), key="w"))
    assert not out and set(errs) == {0, 1, 2}
    for e in errs.values():
        assert isinstance(e, AllreduceError)
        assert "ranks disagree on the element count" in str(e) and "rank 2: 999" in str(e), str(e)
        assert "1000" in str(e), str(e)
    assert agg_stats(service)["errors"]["mismatch"] == before + 1


def test_same_seed_on_two_ranks_is_refused(service):
    out, errs = run_ranks(service["addr"], 53, 2, lambda r, c: c.allreduce(
        np.arange(100, dtype=np.float32), C.get("eaq", seed=5), key="w"))
    assert not out and set(errs) == {0, 1}
    for e in errs.values():
        assert "ranks [0, 1] use eaq codec objects with the same random state" in str(e), str(e)


@pytest.mark.parametrize("field,value,reason,text", [
    ("magic", b"XXXX", "bad_magic", "bad magic b'XXXX'"),
    ("version", 9, "bad_version", "frame version 9"),
    # a declared body beyond the limit is refused from the header, before anything is allocated
    ("body_len", 2**32 - 1, "frame_too_large", "frame body of 4294967295 bytes exceeds the limit"),
])
def test_bad_frame_is_refused_and_counted(service, field, value, reason, text):
    before = agg_stats(service)["errors"][reason]
    hdr = dict(magic=MAGIC, version=VERSION, type=int(FrameType.HELLO), flags=0, job=1, rank=0, world_size=1,
               round=0, codec=0, key_len=0, meta_len=0, count=0, body_len=0)
    hdr[field] = value
    with socket.create_connection(service["addr"], timeout=5) as s:
        s.sendall(HEADER.pack(*hdr.values()))
        reply = recv_frame(s, max_body=1 << 20)
        assert reply.type == FrameType.ERROR and reply.meta["reason"] == reason
        assert "host aggregator refused the connection" in reply.text and text in reply.text, reply.text
        assert recv_frame(s, max_body=1 << 20) is None          # and it closed the connection
    assert agg_stats(service)["errors"][reason] == before + 1


def test_switch_summable_codec_through_the_host_path_and_counters(service):
    """nc (codes + metadata in an envelope) host-aggregated, averaged; counters match the clients'."""
    before = agg_stats(service)
    world, rounds, n, job = 2, 2, 5000, 54

    def work(r, c):
        codec = C.get("nc", seed=200 + r)
        got = []
        for t in range(rounds):
            x = inputs("nc", r, t, n)
            c.allreduce(x, codec, average=True)
            got.append(x)
        return got, c.stats.as_dict()

    out, errs = run_ranks(service["addr"], job, world, work)
    assert not errs, errs
    ref, _, _ = reference("nc", {}, job, world, rounds, n, None, lambda r: 200 + r)
    for r in range(world):
        for t in range(rounds):
            assert np.array_equal(out[r][0][t], ref[t] / np.float32(world))
    after = agg_stats(service)
    nc0 = before["per_codec"].get("nc", dict.fromkeys(("rounds", "messages", "elements", "bytes_in", "bytes_out"), 0))
    nc1 = after["per_codec"]["nc"]
    assert nc1["rounds"] - nc0["rounds"] == rounds and nc1["messages"] - nc0["messages"] == rounds * world
    assert nc1["elements"] - nc0["elements"] == rounds * n
    assert nc1["bytes_in"] - nc0["bytes_in"] == sum(out[r][1]["message_bytes_sent"] for r in range(world))
    assert nc1["bytes_out"] - nc0["bytes_out"] == sum(out[r][1]["message_bytes_received"] for r in range(world))
    assert nc1["decode_s"] > nc0.get("decode_s", 0) and nc1["encode_s"] > nc0.get("encode_s", 0)
    c0, c1 = before["counters"], after["counters"]
    assert c1["rounds"] - c0["rounds"] == rounds and c1["jobs_finished"] - c0["jobs_finished"] == 1
    assert c1["bytes_in"] - c0["bytes_in"] == sum(out[r][1]["bytes_sent"] for r in range(world)) + 48 * world  # + BYE
    assert c1["bytes_out"] - c0["bytes_out"] == sum(out[r][1]["bytes_received"] for r in range(world))
    assert after["errors"] == before["errors"]


def test_a_rank_whose_socket_is_above_select_s_limit_still_reduces(service):
    """A process with many files open (data loaders, a framework's sockets) gets descriptors above 1024,
    where select refuses to look (ValueError): the client's check for an ERROR pushed between rounds must
    still work there, or every host-aggregated allreduce of such a process fails."""
    import os
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1600:
        pytest.skip(f"the hard limit of open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1600), hard))
    c = None
    try:
        c = HostAggClient(service["addr"], rank=0, world_size=1, job=61, timeout=10.0)
        high = socket.socket(fileno=os.dup2(c.sock.fileno(), 1500))
        c.sock.close()
        c.sock = high
        x = inputs("3lc", 0, 0, 300)
        c.allreduce(x, C.get("3lc", seed=300))
        (want,), _, _ = reference("3lc", {}, 61, 1, 1, 300, None, lambda r: 300)
        assert np.array_equal(x, want)
    finally:
        if c is not None:
            c.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_announced_in_join_config_and_stats_cli(service):
    ch = ControlChannel("127.0.0.1", service["port"])
    try:
        cfg = ch.request({"op": "join", "job": 77, "rank": 0, "world_size": 1, "udp_port": 9, "slots": 2,
                          "elements": 8})["config"]
        ch.request({"op": "leave"})
    finally:
        ch.close()
    assert cfg["host_aggregator"] == {"port": service["addr"][1], "label": HOST_AGG_LABEL}
    assert "NOT switch-feasible" in cfg["host_aggregator"]["label"]
    r = subprocess.run([sys.executable, "-m", "switch_model", "stats", "--port", str(service["port"])],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    ha = json.loads(r.stdout)["host_aggregator"]
    assert ha["port"] == service["addr"][1] and "NOT switch-feasible" in ha["label"]
    assert {"rounds", "messages", "bytes_in", "bytes_out", "jobs_started"} <= set(ha["counters"])
    assert {"bad_magic", "bad_version", "mismatch", "timeout", "disconnect"} <= set(ha["errors"])
