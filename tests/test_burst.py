"""Burst I/O on real UDP sockets: sendmmsg with UDP GSO (and its fallback), recvmmsg."""
import os
import socket
import sys

import numpy as np
import pytest

from ina import burst as B

sys.path.insert(0, os.path.dirname(__file__))
from sw_harness import SwitchProc, bfp_reference, client_threads, expected_inputs  # noqa: E402

pytestmark = pytest.mark.skipif(not B.gso_supported(B.udp_socket("127.0.0.1", 0, bufsize=1 << 16)),
                                reason="the kernel has no UDP_SEGMENT")


def _receivers(k):
    socks = [B.udp_socket("127.0.0.1", 0) for _ in range(k)]
    addrs = np.zeros(k, B.SOCKADDR_IN)
    for i, s in enumerate(socks):
        addrs[i] = B.sockaddr("127.0.0.1", s.getsockname()[1])[0]
        B.set_recv_timeout(s, 2.0)
    return socks, addrs


def _drain(sock, expect, stride=4096):
    """Every datagram waiting on ``sock`` (at least ``expect``; bounded by the socket's timeout)."""
    ring = B.RxRing(sock, burst=64, stride=stride)
    got = []
    while len(got) < expect:
        n = ring.recv(wait=True)
        if not n:
            break
        got += [ring.buf[i, : ring.lens[i]].tobytes() for i in range(n)]
    while n := ring.recv(wait=False):       # nothing more than expected may be there
        got += [ring.buf[i, : ring.lens[i]].tobytes() for i in range(n)]
    return got


def _packets(rows, width, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (rows, width), dtype=np.uint8)


@pytest.mark.parametrize("gso", [True, False])
def test_send_delivers_each_entry_as_one_datagram_in_order(gso):
    """Entries interleaved over 3 destinations, equal lengths except a shorter last entry for one of
    them: each receiver gets exactly its entries, byte for byte, in order; with GSO in fewer messages."""
    tx_sock = B.udp_socket("127.0.0.1", 0)
    socks, addrs = _receivers(3)
    buf = _packets(40, 1000)
    rows = np.arange(40)
    dest = np.repeat([0, 1, 2, 0, 1], 8)          # runs of 8 to one destination, destination 0 twice
    lens = np.full(40, 1000)
    lens[15] = 333                                # the last entry of destination 1's first run: an odd tail
    lens[39] = 1                                  # a one-byte tail
    tx = B.TxBatch(tx_sock, capacity=64, gso=gso)
    assert tx.send(buf, rows, lens, addrs, dest) == 40
    for d, s in enumerate(socks):
        want = [buf[r, : lens[r]].tobytes() for r in rows[dest == d]]
        assert _drain(s, len(want)) == want
    assert tx.sent_packets == 40 and tx.sent_bytes == int(lens.sum())
    assert tx.sent_messages == (5 if gso else 40)
    assert tx.gso_refused is None


def test_send_splits_runs_at_the_segment_and_byte_limits():
    """A run longer than a GSO message may carry arrives whole, in order, as separate datagrams."""
    tx_sock = B.udp_socket("127.0.0.1", 0)
    socks, addrs = _receivers(1)
    buf = _packets(300, 3000, seed=1)
    tx = B.TxBatch(tx_sock, capacity=1024, gso=True)
    tx.send(buf, np.arange(300), 3000, addrs, 0)         # 21 x 3000 bytes fit 65507
    assert _drain(socks[0], 300) == [buf[r].tobytes() for r in range(300)]
    assert tx.sent_messages == int(np.ceil(300 / 21))
    tx.send(buf, np.arange(200), 100, addrs, 0)          # 100-byte packets: the segment limit first
    assert _drain(socks[0], 200) == [buf[r, :100].tobytes() for r in range(200)]
    assert tx.sent_messages == int(np.ceil(300 / 21)) + int(np.ceil(200 / B.GSO_MAX_SEGMENTS))


def test_gso_runs_rules():
    lens = np.array([10, 10, 10, 4, 10, 10, 5, 3, 10])
    dest = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1])
    # a shorter entry ends its run; a destination change and a longer entry start one; two shorter
    # entries in a row cannot both join
    assert B.gso_runs(lens, dest).tolist() == [0, 4, 5, 7, 8]
    assert B.gso_runs(np.full(10, 10), np.zeros(10), max_segments=4).tolist() == [0, 4, 8]
    assert B.gso_runs(np.full(5, 30000), np.zeros(5)).tolist() == [0, 2, 4]     # 65507 bytes a message
    assert B.gso_runs(np.zeros(0), np.zeros(0)).size == 0


def test_kernel_refusing_gso_falls_back_to_one_datagram_per_message():
    """More segments than the kernel's UDP_MAX_SEGMENTS: sendmmsg fails with EINVAL; the batch turns
    GSO off, says why, and every packet still arrives once, in order."""
    tx_sock = B.udp_socket("127.0.0.1", 0)
    socks, addrs = _receivers(2)
    buf = _packets(600, 100, seed=2)
    tx = B.TxBatch(tx_sock, capacity=1024, gso=True)
    tx.gso_max_segments = 300                  # beyond any kernel's limit (64, or 128 since Linux 6.x)
    dest = np.repeat([0, 1], 300)
    tx.send(buf, np.arange(600), 100, addrs, dest)
    assert not tx.gso and "EINVAL" in tx.gso_refused
    for d, s in enumerate(socks):
        assert _drain(s, 300) == [buf[r, :100].tobytes() for r in range(300 * d, 300 * d + 300)]
    assert tx.sent_packets == 600


def test_environment_turns_gso_off(monkeypatch):
    monkeypatch.setenv("INA_GSO", "0")
    assert not B.TxBatch(B.udp_socket("127.0.0.1", 0)).gso
    monkeypatch.setenv("INA_GSO", "1")
    assert B.TxBatch(B.udp_socket("127.0.0.1", 0)).gso


# ------------------------------------------------------------------------------------------------
# end to end: a switch and its workers batch their sends, and the sums stay bit-exact
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gso", ["1", "0"])
def test_switch_and_clients_send_gso_runs_and_results_stay_exact(tmp_path, monkeypatch, gso):
    """4 workers, bfp32 over 256-element packets (24 chunks plus an odd last one): with GSO the
    switch hands the kernel fewer messages than packets (a poll's results for one worker in one
    run) and each worker sends its first window of 16 chunks as one message; with INA_GSO=0 one message a packet. The sums are bit-exact either way."""
    monkeypatch.setenv("INA_GSO", gso)
    n, op = 4, {"codec": "bfp32", "shape": [256 * 24 + 17], "seed": 41}
    sw = SwitchProc("--slots", "64", "--elements", "256", log_path=tmp_path / "switch.log")
    try:
        def body(r, cl):
            x = expected_inputs(op, n)[r]
            for _ in range(3):
                y = x.copy()
                cl.allreduce(y, codec="bfp32")
            return y, cl.tx.sent_messages, cl.stats.packets_sent

        out = client_threads(sw.port, n, 5, body, join_timeout=90, elements=256, slots=16, timeout=30.0)
        st = sw.stats()
    finally:
        sw.terminate()
    ref = bfp_reference(expected_inputs(op, n))
    for y, _, _ in out:
        assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))
    c = st["counters"]
    assert st["config"]["udp_gso"] is (gso == "1") and st["config"]["udp_gso_refused"] is None
    if gso == "1":
        assert c["tx_messages"] < c["tx_packets"], c
        assert all(pkts - msgs >= 15 * 3 for _, msgs, pkts in out), [o[1:] for o in out]
    else:
        assert c["tx_messages"] == c["tx_packets"]
        assert all(msgs == pkts for _, msgs, pkts in out)


# ------------------------------------------------------------------------------------------------
# receive: UDP GRO cuts coalesced messages into the rows a per-datagram receive gives
# ------------------------------------------------------------------------------------------------
gro_only = pytest.mark.skipif(B.gro_enable(B.udp_socket("127.0.0.1", 0, bufsize=1 << 16)) is not None,
                              reason="the kernel has no UDP_GRO")


def _rows_of(ring, expect):
    """(bytes, source port) of every row received (at least ``expect``; bounded by the socket timeout)."""
    got = []
    while len(got) < expect:
        n = ring.recv(wait=True)
        if not n:
            break
        got += [(ring.buf[i, : ring.lens[i]].tobytes(), B.addr_tuple(ring.src[i])[1]) for i in range(n)]
    while n := ring.recv(wait=False):
        got += [(ring.buf[i, : ring.lens[i]].tobytes(), B.addr_tuple(ring.src[i])[1]) for i in range(n)]
    return got


@gro_only
@pytest.mark.parametrize("burst", [5, 64])
def test_gro_rows_equal_per_datagram_receive(burst):
    """Two senders' GSO messages with mixed segment sizes, short last segments and single datagrams:
    a ring with GRO yields the same rows, lengths, sources and order (per sender) as one without,
    also when a coalesced message has more segments than the burst has rows (they come next call)."""
    senders = [B.udp_socket("127.0.0.1", 0) for _ in range(2)]
    rx = {gro: B.udp_socket("127.0.0.1", 0) for gro in (True, False)}
    rings = {gro: B.RxRing(s, burst=burst, stride=1500, gro=gro) for gro, s in rx.items()}
    assert rings[True].gro and rings[True].gro_refused is None and not rings[False].gro
    buf = _packets(60, 1500, seed=3)
    lens = np.array([1000] * 9 + [333] + [1400] * 20 + [7] + [1] * 12 + [1200] * 16 + [0, 1500])   # an empty one
    for gro, s in rx.items():
        B.set_recv_timeout(s, 2.0)
        addr = B.sockaddr("127.0.0.1", s.getsockname()[1])
        for sender in senders:
            B.TxBatch(sender, capacity=64, gso=True).send(buf, np.arange(60), lens, addr, 0)
    got = {gro: _rows_of(ring, 120) for gro, ring in rings.items()}
    for gro in (True, False):
        for sender in senders:
            port = sender.getsockname()[1]
            assert [b for b, p in got[gro] if p == port] == [buf[r, : lens[r]].tobytes() for r in range(60)]
    assert len(got[True]) == len(got[False]) == 120
    assert rings[True].packets == 120 and rings[True].messages < 120      # the kernel coalesced
    assert rings[False].messages == rings[False].packets == 120


@gro_only
@pytest.mark.parametrize("burst", [5, 64])
def test_gro_into_rows_of_64k_equals_per_datagram_receive(burst):
    """Rows of 64 kB are received into straight (no landing copy) while nothing is coalesced. The
    same datagrams and order as a ring without GRO, whatever the mix: first single datagrams, then GSO
    messages (cut in place, or landed when they do not fit the burst's rows), then single datagrams
    again, after which the ring receives straight into its rows again."""
    big = B.GRO_MAX_MESSAGE
    sender = B.udp_socket("127.0.0.1", 0)
    rx = {gro: B.udp_socket("127.0.0.1", 0) for gro in (True, False)}
    rings = {gro: B.RxRing(s, burst=burst, stride=big, gro=gro) for gro, s in rx.items()}
    assert rings[True].gro and rings[True].direct_receives == 0
    buf = _packets(48, 1500, seed=6)
    lens = np.array([1500] * 6 + [1000] * 9 + [333] + [1400] * 20 + [7, 0] + [1200] * 12)
    phases = [(slice(0, 6), False), (slice(6, 38), True), (slice(38, 48), False)]   # (rows, GSO)
    got = {True: [], False: []}
    for rows, gso in phases:
        direct_before = rings[True].direct_receives
        for gro, s in rx.items():
            B.set_recv_timeout(s, 2.0)
            addr = B.sockaddr("127.0.0.1", s.getsockname()[1])
            r = np.arange(48)[rows]
            if gso:
                B.TxBatch(sender, capacity=64, gso=True).send(buf, r, lens[rows], addr, 0)
            else:          # one datagram a message, a few receives apart: the ring calms down
                for i in r:
                    sender.sendto(buf[i, : lens[i]].tobytes(), ("127.0.0.1", s.getsockname()[1]))
                    got[gro] += _rows_of(rings[gro], 1)
            if gso:
                got[gro] += _rows_of(rings[gro], r.size)
        if gso:
            assert rings[True].direct_receives - direct_before == 1     # then it lands messages again
    want = [buf[r, : lens[r]].tobytes() for r in range(48)]
    for gro in (True, False):
        assert [b for b, _ in got[gro]] == want
        assert {p for _, p in got[gro]} == {sender.getsockname()[1]}
    ring = rings[True]
    assert ring.packets == 48 and ring.messages < 48                   # the kernel coalesced
    # single datagrams straight into rows: all of the first phase, and the last phase's once calm again
    assert ring.direct_receives >= 6 + 1 + (10 - B.DIRECT_AFTER)


@gro_only
def test_gro_marks_a_datagram_longer_than_a_row_truncated():
    """As without GRO: a datagram longer than the ring's rows reads as stride + 1 bytes (the caller's
    sign of truncation); its neighbours in the same coalesced message are intact."""
    tx_sock, rs = B.udp_socket("127.0.0.1", 0), B.udp_socket("127.0.0.1", 0)
    B.set_recv_timeout(rs, 2.0)
    ring = B.RxRing(rs, burst=16, stride=500, gro=True)
    buf = _packets(4, 900, seed=4)
    B.TxBatch(tx_sock, gso=True).send(buf, np.arange(4), np.array([900, 900, 900, 400]),
                                      B.sockaddr("127.0.0.1", rs.getsockname()[1]), 0)
    n = ring.recv(wait=True)
    n += ring.recv(wait=False)
    assert n == 4 and ring.lens[:4].tolist() == [501, 501, 501, 400]
    assert ring.buf[0, :500].tobytes() == buf[0, :500].tobytes()
    assert ring.buf[3, :400].tobytes() == buf[3, :400].tobytes()


def test_environment_turns_gro_off(monkeypatch):
    monkeypatch.setenv("INA_GRO", "0")
    assert not B.RxRing(B.udp_socket("127.0.0.1", 0)).gro
    monkeypatch.setenv("INA_GRO", "1")
    ring = B.RxRing(B.udp_socket("127.0.0.1", 0))
    assert ring.gro is (ring.gro_refused is None)


def test_gro_refused_falls_back_to_one_datagram_per_message():
    """A socket the kernel refuses UDP_GRO on (here a TCP socket stands for an old kernel): the ring
    says why, and receives one datagram per message as without GRO."""
    s = __import__("socket").socket()
    try:
        ring = B.RxRing(s, burst=4, stride=100, gro=True)
        assert not ring.gro and ring.gro_refused
    finally:
        s.close()


# ------------------------------------------------------------------------------------------------
# decoding straight from the receive ring: the same bits as decode_sum
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec,rtype,raw", [("nc", 1, False), ("nc", 3, True), ("bfp32", 2, False),
                                             ("qsgd", 2, False)])
def test_decode_sum_into_equals_decode_sum_of_the_same_payloads(codec, rtype, raw):
    """Result payloads in wire byte order in ring rows (picked out of order, some rows unused) decode into
    the chosen output rows bit for bit as decode_sum of the same payloads does (fused kernels: nc, bfp32;
    the default: every other codec)."""
    from ina import compression
    from ina.compression.base import ScaleContext
    from ina.wire import PAYLOAD_DTYPE, HEADER_SIZE, PayloadType, payload_view
    E, rows = 64, 12
    rng = np.random.default_rng(5)
    ring = np.zeros((rows, HEADER_SIZE + 8 * E + 4), np.uint8)
    pv = payload_view(ring, PayloadType(rtype), E)
    pv[:] = rng.integers(0, 128 if rtype == 1 else 2**20, (rows, E)).astype(PAYLOAD_DTYPE[PayloadType(rtype)])
    c = compression.get(codec)
    ctx = ScaleContext(3, 4, seed=1, elements=E)
    which, chunks = np.array([7, 2, 9, 0]), np.array([3, 0, 5, 1])
    out = np.full((6, E), np.nan, np.float32)
    c.decode_sum_into(pv, ctx, raw, out, chunks, which)
    for w, ch in zip(which, chunks):
        want = c.decode_sum(pv[w].astype(pv.dtype.newbyteorder("=")), ctx, raw=raw)
        assert np.array_equal(out[ch].view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert np.isnan(out[[2, 4]]).all()          # rows no result went to are untouched


@gro_only
def test_gro_receive_fills_the_burst_from_more_messages_than_it_lands_at_once():
    """A burst shorter than the ring still means the socket was emptied (the client's loss detection
    relies on it), also when more single datagrams wait than GRO lands in one system call."""
    tx_sock, rs = B.udp_socket("127.0.0.1", 0), B.udp_socket("127.0.0.1", 0)
    B.set_recv_timeout(rs, 2.0)
    ring = B.RxRing(rs, burst=64, stride=200, gro=True)
    dst = ("127.0.0.1", rs.getsockname()[1])
    for i in range(100):                      # one datagram per send: nothing to coalesce
        tx_sock.sendto(bytes([i]) * 100, dst)
    assert B.GRO_LANDING < 64
    assert ring.recv(wait=True) == 64 and ring.recv(wait=False) == 36
    assert [int(b) for b in ring.buf[:36, 0]] == list(range(64, 100))


# ------------------------------------------------------------------------------------------------
# the client's compiled per-burst steps
# ------------------------------------------------------------------------------------------------
def test_copy_rows_puts_each_code_row_after_the_header_of_its_ring_row():
    """Codes go into the payload of the named ring rows only: headers and other rows untouched."""
    from ina import stream_kernels as SK
    from ina.wire import HEADER_SIZE, PayloadType, payload_view
    rng = np.random.default_rng(8)
    ring = rng.integers(0, 256, (10, HEADER_SIZE + 64 + 4), dtype=np.uint8)     # a trailer after the payload
    before = ring.copy()
    codes = rng.integers(0, 256, (6, 64), dtype=np.uint8)
    rows, src = np.array([7, 2, 9]), np.array([5, 0, 3])
    SK.copy_rows(ring, rows, HEADER_SIZE, codes, src)
    assert np.array_equal(payload_view(ring, PayloadType.NC8, 64)[rows], codes[src])
    assert np.array_equal(ring[:, :HEADER_SIZE], before[:, :HEADER_SIZE])
    assert np.array_equal(ring[:, HEADER_SIZE + 64:], before[:, HEADER_SIZE + 64:])
    others = np.setdiff1d(np.arange(10), rows)
    assert np.array_equal(ring[others], before[others])


@pytest.mark.parametrize("tries", [[0, 0, 0, 0, 0], [0, 1, 0, 0, 2], [0, 1, 0, 0, 0], [3, 1, 2, 1, 1]])
def test_round_trips_follow_karns_rule(tries):
    """Round-trip samples come only from chunks never resent: count, fastest and median (the mean of
    the middle two when even) of those, and whether the burst held a resent chunk."""
    from ina import stream_kernels as SK
    sent_at = np.array([0.5, 0.1, 0.7, 0.3, 0.2, 0.9])
    tries_all = np.zeros(6, np.int64)
    jj = np.array([4, 1, 0, 3, 2])
    tries_all[jj] = tries
    m, fastest, median, resent = SK.round_trips(jj, tries_all, sent_at, 1.0, np.zeros(8))
    first = jj[tries_all[jj] == 0]
    assert m == first.size and resent == bool(tries_all[jj].any())
    if m:
        rtts = np.sort(1.0 - sent_at[first])
        assert fastest == rtts[0] and median == np.median(rtts)


@pytest.mark.parametrize("c0", [5, (1 << 10) - 2], ids=["ids-in-range", "ids-wrap-mid-stream"])
def test_a_receive_burst_frees_the_next_chunks_with_their_headers_in_one_pass(c0):
    """take_burst: fresh results of a stream are marked done (duplicates, other jobs and chunks not sent yet
    are not), their round trips follow Karn's rule, every pending chunk sent before a result counts it, and
    each result frees chunk j + slots, whose header is what fill_headers writes, flagged LATE when the result
    was a replay (the peers sent that chunk long before: ina.recovery)."""
    from ina import stream_kernels as SK
    from ina.wire import Flag, MsgType, header_view
    S, n, E, mod, job = 4, 10, 8, 1 << 10, 3
    done, exps = np.zeros(n, bool), np.zeros(n, np.int64)
    tries, sent_at = np.zeros(n, np.int64), np.zeros(n)
    seq, wit, later = np.zeros(n, np.int64), np.ones(n, bool), np.zeros(n, np.int64)
    seq[:S] = np.arange(1, S + 1)                  # chunks 0..3 went out in order
    sent_at[:S] = [0.1, 0.2, 0.3, 0.4]
    tries[2] = 1                                   # chunk 2 was resent: no round-trip sample from it
    buf, lens = np.zeros((8, 64), np.uint8), np.full(8, 20 + E, np.int64)
    hv = header_view(buf)
    hv["msg_type"], hv["job"] = int(MsgType.RESULT), job
    hv["chunk"][:6] = (c0 + np.array([3, 1, 2, 3, 7, 0])) % mod   # 3 twice; 7 not sent yet
    hv["job"][5] = job + 1                         # another job's result of chunk 0
    hv["exponent"][:6] = [-2, 5, 6, 9, 1, 1]
    hv["flags"][1] = int(Flag.REPLAY)
    burst = 8
    idx, jj, rep = np.zeros(burst, np.int64), np.zeros(burst, np.int64), np.zeros(burst, bool)
    exps_in = np.array([7], np.int64)
    pkts, ref = np.zeros((2 * S, 64), np.uint8), np.zeros((2 * S, 64), np.uint8)
    nxt = (np.zeros(burst, np.int64), np.zeros(burst, np.int64), np.zeros(burst, bool))
    scan = (job, c0, mod, S, 20 + E, -1, False, True)
    (fresh, ok, other, nbytes, abort, overflow, mismatch, n_rep, rtts, pending, n_new, top, low) = SK.take_burst(
        buf, lens, 6, scan, done, exps, idx, jj, rep, (tries, sent_at, seq, wit, np.zeros(n, np.int64), later), 1.0, np.zeros(burst), 0,
        S - 1, (pkts, S, n, 2 * S, c0, mod, exps_in, 75, E), nxt)
    assert (fresh, ok, other, abort, n_rep) == (3, 4, 2, -1, 1)
    assert jj[:3].tolist() == [1, 2, 3] and idx[:3].tolist() == [1, 2, 0] and rep[:3].tolist() == [True, False, False]
    assert done.tolist() == [False, True, True, True] + [False] * 6 and exps[[1, 2, 3]].tolist() == [5, 6, -2]
    assert rtts[0] == 2 and np.isclose(rtts[1], 0.6) and np.isclose(rtts[2], 0.7) and rtts[3]   # chunks 3 and 1
    assert pending.tolist() == [0] and later[0] == 2          # results of 1 and 3 (2 was resent: Karn)
    assert n_new == 3 and top == 7 and low == 0
    assert nxt[0][:3].tolist() == [5, 6, 7] and nxt[1][:3].tolist() == [5, 6, 7]
    assert nxt[2][:3].tolist() == [False, True, True]
    SK.fill_headers(ref, np.array([5, 6, 7]), np.array([5, 6, 7]), c0, mod, S, exps_in, 75, E)
    ph = header_view(pkts)
    ph_flags = ph["flags"].copy()
    assert ph_flags[5] == int(Flag.LATE) and not ph_flags[[6, 7]].any()
    ph["flags"][5] = 0
    assert np.array_equal(pkts, ref)


def test_a_wait_for_results_works_on_a_descriptor_above_select_s_limit():
    """A process with many files open (data loaders, a framework's sockets) gets socket descriptors above
    1024, where select refuses to wait (ValueError): the client's receive wait must still work there."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1600:
        pytest.skip(f"the hard limit of open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1600), hard))
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    high = None
    try:
        rx.bind(("127.0.0.1", 0))
        high = socket.socket(fileno=os.dup2(rx.fileno(), 1500))
        ring = B.RxRing(high, burst=4, stride=256, gro=False)
        assert ring.fd >= 1024
        assert ring.recv_within(0.001, 1.0) == 0                   # nothing came: no ValueError from select
        tx.sendto(b"x" * 40, rx.getsockname())
        assert B.readable(ring.fd, 1.0)
        assert ring.recv_within(0.5, 1.0) == 1 and ring.lens[0] == 40
    finally:
        for s in (rx, tx, high):
            if s is not None:
                s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
