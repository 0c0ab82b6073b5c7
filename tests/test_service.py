"""A switch service you can leave running: chunk ids that wrap, safe defaults, the specified hash.

The switch runs as a real ``python -m switch_model serve`` subprocess; workers are ``ina.Client``
objects in threads of this process (real UDP on loopback).
"""
from __future__ import annotations

import os
import re
import sys
import threading

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sw_fuzz import header  # noqa: E402
from sw_harness import SwitchProc, bfp_reference, join_all  # noqa: E402

from ina.wire import HEADER_SIZE, chunk_modulus, chunk_newer, slot_of_chunk  # noqa: E402
from switch_model.harvest import nc_reencode_one  # noqa: E402


@pytest.fixture(scope="module")
def switch(tmp_path_factory):
    sw = SwitchProc("--slots", "64", "--elements", "64", log_path=tmp_path_factory.mktemp("sw") / "switch.log")
    yield sw
    assert sw.terminate() == 0, sw.log()


def allreduce_all(clients, xs, codec="bfp32"):
    """Every client's allreduce of its array, concurrently; the results (in place)."""
    errs = []

    def one(c, x):
        try:
            c.allreduce(x, codec)
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=one, args=(c, x)) for c, x in zip(clients, xs)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in ts), "an allreduce did not return"
    if errs:
        raise errs[0]
    return xs


# ------------------------------------------------------------------------------------------------
# chunk ids that wrap
# ------------------------------------------------------------------------------------------------
def test_chunk_id_rules():
    assert chunk_modulus(64) == 2**32                        # a power of two: the whole 32-bit space
    m = chunk_modulus(3)
    assert m % 6 == 0 and 2**32 - 6 < m < 2**32
    # across the wrap, chunk c + S uses c's pool index and the other shadow set
    for s in (3, 5, 64, 1000):
        m = chunk_modulus(s)
        for c in (m - 1, m - s, m - 2 * s - 1):
            a, b = slot_of_chunk(c, s), slot_of_chunk((c + s) % m, s)
            assert a & 0x7FFF == b & 0x7FFF and a >> 15 != b >> 15
    assert chunk_newer(0, 2**32 - 1, 2**32) and not chunk_newer(2**32 - 1, 0, 2**32)
    assert chunk_newer(5, m - 3, m) and not chunk_newer(m - 3, 5, m) and not chunk_newer(7, 7, m)


@pytest.mark.parametrize("slots", [4, 3])
def test_a_job_continues_across_the_chunk_id_wrap(switch, slots):
    n, elements = 3, 16
    first = chunk_modulus(slots) - 11                       # 11 chunks before the wrap
    clients = join_all(switch.port, 60 + slots, n, elements=elements, slots=slots, timeout=20, first_chunk=first)
    try:
        before = switch.stats()["drops"]
        for k in range(4):                                   # 4 x (1 negotiation + 7 data chunks): wraps once
            xs = [np.random.default_rng([k, r]).standard_normal(100).astype(np.float32) for r in range(n)]
            ref = bfp_reference([x.copy() for x in xs])
            allreduce_all(clients, xs)
            for r, x in enumerate(xs):
                assert np.array_equal(x.view(np.uint32), ref.view(np.uint32)), f"allreduce {k} rank {r} differs"
        assert clients[0].next_chunk < first                # the ids did wrap
        after = switch.stats()["drops"]
        assert after["stale"] == before["stale"] and after["slot_chunk_mismatch"] == before["slot_chunk_mismatch"]
    finally:
        for c in clients:
            c.close()


def test_a_first_chunk_out_of_range_is_refused_by_name_and_the_job_stays_usable(switch):
    """A bad ``first_chunk`` is a ValueError naming it (not an error of the half-built client), the
    rank leaves the job, and the job's next join of that rank works."""
    import ina
    with pytest.raises(ValueError, match="first_chunk -1 out of range"):
        ina.Client(("127.0.0.1", switch.port), rank=0, world_size=1, job=59, slots=8, elements=16, timeout=20,
                   first_chunk=-1)
    with ina.Client(("127.0.0.1", switch.port), rank=0, world_size=1, job=59, slots=8, elements=16,
                    timeout=20) as c:
        x = np.arange(40, dtype=np.float32)
        c.allreduce(x, codec="bfp32")
        assert np.array_equal(x, np.arange(40, dtype=np.float32))


# ------------------------------------------------------------------------------------------------
# the rounding hash (docs/switch.md, "The rounding hash")
# ------------------------------------------------------------------------------------------------
_M64 = 2**64 - 1


def _spec_code(v, seed, job, chunk, k):
    """The re-encoding exactly as docs/switch.md specifies it, in plain Python integers."""
    key = ((seed << 32) & _M64) ^ ((((job << 32) | chunk) * 0x9E3779B97F4A7C15) & _M64)
    z = (key + k * 0xD1B54A32D192ED03) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    a = abs(v)
    if a == 0:
        return 0
    p = a.bit_length() - 1
    r = z >> (64 - p) if p > 0 else 0
    return (0x80 if v < 0 else 0) | min(p + (r < a - (1 << p)) + 1, 127)


# (register sum, seed, job, chunk, element) -> the code byte: the test vectors of docs/switch.md
HASH_VECTORS = [
    ((5, 0, 0, 0, 0), 0x04), ((5, 0, 1, 0, 0), 0x03), ((-12345, 0, 0, 0, 0), 0x8F), ((-12345, 0, 1, 0, 0), 0x8E),
    ((-12345, 7, 3, 99, 2), 0x8E), ((-12345, 1, 65535, 0xFFFFFFFF, 1023), 0x8F), ((3, 0, 0, 0, 0), 0x03),
    ((3, 0, 1, 0, 0), 0x02), ((-(2**40 + 2**39), 0, 0, 0, 0), 0xAA), ((-(2**40 + 2**39), 7, 3, 99, 2), 0xA9),
    ((1000, 1, 65535, 0xFFFFFFFF, 1023), 0x0B), ((1, 0, 0, 0, 0), 0x01), ((0, 5, 5, 5, 5), 0x00),
]


@pytest.mark.parametrize("args,code", HASH_VECTORS)
def test_rounding_hash_test_vectors(args, code):
    assert int(nc_reencode_one(*args)) == code
    assert _spec_code(*args) == code


def test_spec_matches_the_switch_on_random_inputs():
    rng = np.random.default_rng(3)
    for _ in range(300):
        v = int(rng.integers(-2**62, 2**62)) >> int(rng.integers(0, 62))
        args = (v, int(rng.integers(0, 2**31)), int(rng.integers(0, 2**16)), int(rng.integers(0, 2**32)),
                int(rng.integers(0, 16384)))
        assert int(nc_reencode_one(*args)) == _spec_code(*args), args


def _nc_round(clients, job, chunk, elements, codes):
    """Send one NC8 round (chunk ``chunk``, rank r's codes codes[r]) from the joined sockets; the result payload."""
    for c in clients:
        c.sock.settimeout(10.0)
    for r, c in enumerate(clients):
        pkt = header(job=job, rank=r, slot=slot_of_chunk(chunk, 4), ptype=1, codec=1, count=elements, chunk=chunk)
        c.sock.sendto(pkt + bytes([codes[r]]) * elements, ("127.0.0.1", c.switch[1]))
    return clients[0].sock.recv(65536)[HEADER_SIZE:]


def test_two_jobs_with_equal_chunk_ids_round_differently(switch):
    elements = 64
    a = join_all(switch.port, 70, 2, elements=elements, slots=4, timeout=20)
    b = join_all(switch.port, 71, 2, elements=elements, slots=4, timeout=20)
    try:
        # codes 4 and 2: 8 + 2 = 10 in every register, rounded to 8 or 16 by the hash
        ra, rb = _nc_round(a, 70, 0, elements, (4, 2)), _nc_round(b, 71, 0, elements, (4, 2))
        assert list(ra) == [_spec_code(10, 0, 70, 0, k) for k in range(elements)]
        assert list(rb) == [_spec_code(10, 0, 71, 0, k) for k in range(elements)]
        assert set(ra) == {4, 5} and ra != rb
    finally:
        for c in a + b:
            c.close()


# ------------------------------------------------------------------------------------------------
# safe defaults: the data plane takes a rank's packets only from the address it joined from
# ------------------------------------------------------------------------------------------------
def test_foreign_source_dropped_and_counted_while_the_job_stays_exact(switch):
    import socket
    n, elements, slots = 2, 16, 4
    clients = join_all(switch.port, 80, n, elements=elements, slots=slots, timeout=20)
    forger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        before = switch.stats()["drops"]["foreign_source"]
        # forged packets claiming to be rank 0 and rank 1 for the chunk ids the job uses next (the
        # exponent round, then data): absorbed, they would poison the sums or complete rounds early
        forged = 0
        for chunk in range(8):
            for r in range(n):
                if chunk == 0:
                    pkt = header(job=80, rank=r, slot=slot_of_chunk(chunk, slots), ptype=0, count=0, chunk=chunk,
                                 exponent=30)
                else:
                    pkt = header(job=80, rank=r, slot=slot_of_chunk(chunk, slots), ptype=2, count=elements,
                                 chunk=chunk) + np.full(elements, 2**30, ">i4").tobytes()
                forger.sendto(pkt, ("127.0.0.1", switch.port))
                forged += 1
        for k in range(3):
            xs = [np.random.default_rng([k, r, 7]).standard_normal(90).astype(np.float32) for r in range(n)]
            ref = bfp_reference([x.copy() for x in xs])
            allreduce_all(clients, xs)
            for r, x in enumerate(xs):
                assert np.array_equal(x.view(np.uint32), ref.view(np.uint32)), f"allreduce {k} rank {r} differs"
        assert switch.stats()["drops"]["foreign_source"] - before == forged
    finally:
        forger.close()
        for c in clients:
            c.close()


# ------------------------------------------------------------------------------------------------
# safe defaults: the shared token, the control plane's limits, the bind address
# ------------------------------------------------------------------------------------------------
TOKEN = "s3cret-for-the-test"


@pytest.fixture(scope="module")
def token_switch(tmp_path_factory):
    sw = SwitchProc("--slots", "16", "--elements", "32", "--token", TOKEN, "--host-agg-port", "0",
                    log_path=tmp_path_factory.mktemp("swt") / "switch.log")
    yield sw
    assert sw.terminate() == 0, sw.log()


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_join_and_impair_without_the_token_are_refused_and_counted(token_switch, monkeypatch):
    from ina.client import AllreduceError
    from ina.control import ControlError, request
    monkeypatch.delenv("INA_TOKEN", raising=False)
    port = token_switch.port
    refused0 = token_switch.stats()["control"]["refused"].get("bad_token", 0)
    with pytest.raises(AllreduceError, match="token"):
        join_all(port, 90, 1, elements=8, slots=2, timeout=5)
    with pytest.raises(AllreduceError, match="wrong token"):
        join_all(port, 90, 1, elements=8, slots=2, timeout=5, token="guess")
    with pytest.raises(ControlError, match="token"):
        request("127.0.0.1", port, {"op": "impair", "ingress": {"loss": 1.0}})
    st = token_switch.stats()                                # stats: read-only, no token needed
    assert st["control"]["token_required"] is True
    assert st["control"]["refused"]["bad_token"] - refused0 == 3
    assert st["impairments"]["ingress"]["loss"] == 0.0
    assert "refused bad token from 127.0.0.1" in token_switch.log()
    (c,) = join_all(port, 90, 1, elements=8, slots=2, timeout=5, token=TOKEN)
    try:
        x = np.arange(20, dtype=np.float32)
        c.allreduce(x, "bfp32")
        assert np.array_equal(x, np.arange(20, dtype=np.float32))
    finally:
        c.close()


def test_oversized_control_line_refused_without_growing_memory(token_switch):
    import socket
    rss0 = _rss_kib(token_switch.proc.pid)
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", token_switch.port), timeout=10)
        try:
            chunk = b"x" * (1 << 20)
            try:
                for _ in range(16):                          # 16 MiB without a newline
                    s.sendall(chunk)
            except OSError:
                pass                                         # the switch closed the connection: expected
            reply = s.makefile("rb").readline()
        finally:
            s.close()
        assert b"request line longer than 65536 bytes" in reply, reply
    assert _rss_kib(token_switch.proc.pid) - rss0 < 8 * 1024, "the switch's memory grew with the line"
    assert token_switch.stats()["control"]["refused"]["line_too_long"] == 3


def test_host_aggregator_hello_without_the_token_is_refused_and_counted(token_switch, monkeypatch):
    from ina.client import AllreduceError, Client
    from ina.host_client import HostAggClient, host_aggregator_address
    monkeypatch.delenv("INA_TOKEN", raising=False)
    addr = host_aggregator_address(("127.0.0.1", token_switch.port))
    before = token_switch.stats()["host_aggregator"]["errors"]["bad_token"]
    with pytest.raises(AllreduceError, match="shared token .*none given"):
        HostAggClient(addr, rank=0, world_size=1, job=91, timeout=5)
    with pytest.raises(AllreduceError, match="wrong token"):
        HostAggClient(addr, rank=0, world_size=1, job=91, timeout=5, token="guess")
    hagg = token_switch.stats()["host_aggregator"]
    assert hagg["token_required"] is True and hagg["errors"]["bad_token"] - before == 2
    assert hagg["counters"]["jobs_started"] == 0                 # a refused HELLO starts no job
    assert "refused bad token from 127.0.0.1" in token_switch.log()
    # a Client with the token takes it to the aggregator too: a variable-length codec runs
    with Client(("127.0.0.1", token_switch.port), rank=0, world_size=1, job=92, elements=8, slots=2, timeout=10,
                token=TOKEN) as c:
        x = np.linspace(-1, 1, 500).astype(np.float32)
        c.allreduce(x, "3lc")
        assert np.isfinite(x).all() and np.abs(x).max() > 0
    assert token_switch.stats()["host_aggregator"]["counters"]["rounds"] == 1


@pytest.fixture(scope="module")
def limits_switch(tmp_path_factory):
    # without a token: an earlier test that started a switch beyond loopback exported one (INA_TOKEN)
    # to this process, and this test's joins carry none
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("INA_TOKEN", raising=False)
        sw = SwitchProc("--slots", "8", "--elements", "16", "--max-line", "4096", "--max-connections", "4",
                        "--idle-timeout", "1", "--host-agg-port", "0", "--host-agg-max-body", "65536",
                        log_path=tmp_path_factory.mktemp("swl") / "switch.log")
    yield sw
    assert sw.terminate() == 0, sw.log()


def _exchange(port: int, payload: bytes, timeout: float = 10.0) -> bytes:
    """Send ``payload`` on a new control connection; the reply line (b"" if the switch closed without one)."""
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(payload)
        except OSError:
            pass
        return s.makefile("rb").readline()


def test_control_limits_from_the_command_line(limits_switch):
    import json
    import socket

    from sw_harness import wait_until
    port = limits_switch.port
    ctl = limits_switch.stats()["control"]
    assert (ctl["max_line"], ctl["max_connections"], ctl["idle_s"]) == (4096, 4, 1.0)
    assert b"request line longer than 4096 bytes" in _exchange(port, b"x" * 5000 + b"\n")
    assert b"no request within 1 s" in _exchange(port, b"")          # idle before any join: closed, told why
    refused = limits_switch.stats()["control"]["refused"]
    assert refused["line_too_long"] == 1 and refused["idle"] == 1
    # four rendezvous that wait (world_size 5, one rank missing) hold every connection the switch allows
    held = []
    try:
        for r in range(4):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            held.append(s)
            s.sendall(json.dumps({"op": "join", "job": 5, "rank": r, "world_size": 5, "udp_port": 9,
                                  "elements": 16, "slots": 2, "timeout": 6}).encode() + b"\n")
        replies = []

        def refused():
            replies.append(_exchange(port, b'{"op": "stats"}\n'))
            return replies[-1] if b"control connections" in replies[-1] else None
        try:
            reply = wait_until(refused, 10, "a connection beyond the 4 to be refused")
        except AssertionError as e:     # say what the switch answered instead (its connection count)
            raise AssertionError(f"{e}; its last answer: {replies[-1][:600]!r}") from None
        assert b"4 control connections are already open" in reply, reply
        for s in held:                                          # their rendezvous time out after 6 s
            assert b"timed out after 6 s waiting for ranks" in s.makefile("rb").readline()
    finally:
        for s in held:
            s.close()
    wait_until(lambda: b'"ok": true' in _exchange(port, b'{"op": "stats"}\n'), 20, "the switch to serve stats again")
    # (a held connection whose rendezvous timed out may also be closed as idle before the test closes it)
    assert limits_switch.stats()["control"]["refused"]["too_many_connections"] >= 1


def test_host_aggregator_frame_beyond_the_declared_limit_refused_from_its_header(limits_switch):
    """--host-agg-max-body: a frame declaring a larger body is refused as soon as its header is in."""
    import socket

    from ina.host_client import host_aggregator_address
    from ina.host_wire import HEADER, MAGIC, VERSION, FrameType, recv_frame
    addr = host_aggregator_address(("127.0.0.1", limits_switch.port))
    assert limits_switch.stats()["host_aggregator"]["max_body"] == 65536
    with socket.create_connection(addr, timeout=10) as s:
        # the header only: the aggregator must answer without waiting for (or allocating) the body
        s.sendall(HEADER.pack(MAGIC, VERSION, int(FrameType.DATA), 0, 1, 0, 1, 0, 0, 0, 0, 16385, 65537))
        reply = recv_frame(s, max_body=1 << 20)
    assert reply.type == FrameType.ERROR and reply.meta["reason"] == "frame_too_large", reply
    assert "frame body of 65537 bytes exceeds the limit of 65536 bytes" in reply.text
    assert limits_switch.stats()["host_aggregator"]["errors"]["frame_too_large"] == 1


def test_serve_beyond_loopback_needs_a_token(tmp_path, monkeypatch):
    import subprocess

    from sw_harness import PY, ROOT
    monkeypatch.delenv("INA_TOKEN", raising=False)
    env = {k: v for k, v in os.environ.items() if k != "INA_TOKEN"}
    r = subprocess.run([PY, "-m", "switch_model", "serve", "--host", "0.0.0.0", "--port", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "beyond loopback" in r.stderr and "token" in r.stderr, r.stderr
    helptext = subprocess.run([PY, "-m", "switch_model", "serve", "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60, env=env).stdout
    assert "(default: 127.0.0.1)" in helptext and "default 512" in helptext and "(default: None)" not in helptext
    flat = " ".join(helptext.split("options:")[-1].split())          # the option list, not the usage line
    for flag, default in (("--max-line", "65536"), ("--max-connections", "512"), ("--idle-timeout", "60.0"),
                          ("--host-agg-max-body", str(1 << 30))):
        assert re.search(f"{flag} [A-Z_]+ .*?\\(default: {default}\\)", flat), (flag, helptext)


# ------------------------------------------------------------------------------------------------
# a thousand allreduces under loss, duplication and reordering
# ------------------------------------------------------------------------------------------------
def test_1000_allreduces_exact_under_5pct_loss_1pct_duplication_and_reordering(tmp_path):
    from sw_harness import Workers, expected_inputs
    sw = SwitchProc("--slots", "16", "--elements", "32", "--loss", "0.05", "--duplicate", "0.01",
                    "--reorder", "0.05", "--seed", "5", "--host-agg-port", "-1", log_path=tmp_path / "switch.log")
    try:
        n = 3
        ops = [{"codec": "bfp32", "shape": [8 + i % 57], "seed": 2000 + i} for i in range(1000)]
        client = {"elements": 32, "slots": 4, "timeout": 20.0, "rto": 0.01, "max_rto": 0.1}
        out = Workers(tmp_path, sw.port, n, job=9, ops=ops, client=client, name="k").wait(timeout=600)
        st = sw.stats()
        imp = st["impairments"]
        assert all(imp[d]["dropped"] > 0 and imp[d]["reordered"] > 0 for d in ("ingress", "egress")), imp
        assert imp["ingress"]["duplicated"] + imp["egress"]["duplicated"] > 0
        assert sum(m["stats"]["retransmissions"] for m in out.values()) > 0
        exact = 0
        for i, op in enumerate(ops):
            ref = bfp_reference(expected_inputs(op, n))
            exact += all(np.array_equal(out[r]["results"][i].view(np.uint32), ref.view(np.uint32)) for r in range(n))
        assert exact == 1000, f"{exact} of 1000 allreduces exact"
        assert st["occupancy"]["slots_allocated"] == 0                     # the job left: its slots are free
    finally:
        assert sw.terminate() == 0


# ------------------------------------------------------------------------------------------------
# the ingress impairments release more packets at once than a receive burst
# ------------------------------------------------------------------------------------------------
def test_ingress_release_larger_than_a_burst_stays_exact_and_exits_cleanly(tmp_path):
    """With a 4-packet burst and every packet held 20 ms at ingress (a third duplicated), far more
    than a burst falls due at once. A pass must not hand the kernels more than their scratch holds:
    when it did, the kernels (which do not check bounds) wrote past it, results stayed exact, and
    the corrupted heap crashed the switch at exit (SIGSEGV)."""
    sw = SwitchProc("--slots", "64", "--elements", "64", "--burst", "4", "--ingress-delay-ms", "20",
                    "--ingress-duplicate", "0.3", "--host-agg-port", "-1", log_path=tmp_path / "switch.log")
    try:
        clients = join_all(sw.port, 1, 4, elements=64, slots=32, timeout=30)
        try:
            for k in range(6):
                xs = [np.random.default_rng([k, r, 11]).standard_normal(5000).astype(np.float32) for r in range(4)]
                ref = bfp_reference([x.copy() for x in xs])
                allreduce_all(clients, xs)
                for r, x in enumerate(xs):
                    assert np.array_equal(x.view(np.uint32), ref.view(np.uint32)), f"allreduce {k} rank {r} differs"
        finally:
            for c in clients:
                c.close()
        imp = sw.stats()["impairments"]["ingress"]
        assert imp["delayed"] > 1000 and imp["duplicated"] > 0, imp
    finally:
        rc = sw.terminate()
    assert rc == 0, f"the switch exited with {rc}:\n{sw.log()[-3000:]}"
