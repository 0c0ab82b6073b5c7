"""The INA wire format: golden bytes, round trips, scapy dissection vs the fast numpy path, bad bytes."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.utils import rdpcap, wrpcap

from ina import wire
from ina.dissect import INA, bind_port
from ina.wire import Flag, MsgType, PayloadType, WireError

# ------------------------------------------------------------------------------------------------
# Golden bytes: written by hand from the byte layout in docs/wire-format.md, not by the code.
#
#   off  width  field
#   0    1      version
#   1    1      msg_type
#   2    2      flags          (big-endian)
#   4    2      job
#   6    2      rank
#   8    2      slot           bit 15 shadow, bits 0-14 pool index
#   10   1      codec
#   11   1      payload_type
#   12   2      count
#   14   2      exponent       (signed)
#   16   4      chunk
#   20   ...    payload, elements * width, padded with zeros
# ------------------------------------------------------------------------------------------------
GOLDEN = [
    (  # a worker's NC8 data chunk: shadow set 1, pool index 0x1234, retransmitted, 3 valid of 4 codes
        dict(msg_type=MsgType.DATA, flags=Flag.RETRANSMIT, job=0x0102, rank=3, pool_index=0x1234, shadow=1,
             codec=1, payload_type=PayloadType.NC8, count=3, exponent=-2, chunk=0xDEADBEEF,
             payload=[0x81, 0x05, 0x7F], elements=4),
        "01 01 0001 0102 0003 9234 01 01 0003 fffe deadbeef" "81057f00",
    ),
    (  # the switch's INT32 result: rank 0xFFFF, overflow + replay + raw sums, shadow set 0
        dict(msg_type=MsgType.RESULT, flags=Flag.OVERFLOW | Flag.REPLAY | Flag.RAW_SUM, job=7, rank=0xFFFF,
             pool_index=0x7FFF, shadow=0, codec=3, payload_type=PayloadType.INT32, count=2, exponent=0x7FFF,
             chunk=1, payload=[-1, 2**31 - 1], elements=2),
        "01 02 000e 0007 ffff 7fff 03 02 0002 7fff 00000001" "ffffffff 7fffffff",
    ),
    (  # an exponent-negotiation packet: header only
        dict(msg_type=MsgType.DATA, job=0xFFFF, rank=0x8000, pool_index=0, shadow=1, codec=2,
             payload_type=PayloadType.NONE, count=0, exponent=-32768, chunk=0x00010000),
        "01 01 0000 ffff 8000 8000 02 00 0000 8000 00010000",
    ),
    (  # INT64 raw sums and INT8 levels
        dict(msg_type=MsgType.RESULT, flags=Flag.RAW_SUM, job=1, rank=0xFFFF, pool_index=1, codec=1,
             payload_type=PayloadType.INT64, count=1, exponent=5, chunk=2, payload=[-2], elements=2),
        "01 02 0008 0001 ffff 0001 01 03 0001 0005 00000002" "fffffffffffffffe 0000000000000000",
    ),
    (
        dict(msg_type=MsgType.ABORT, job=9, rank=4, codec=5, payload_type=PayloadType.INT8, count=3,
             payload=[-1, 5, -128], elements=3),
        "01 03 0000 0009 0004 0000 05 04 0003 0000 00000000" "ff0580",
    ),
]


def _hex(s: str) -> bytes:
    return bytes.fromhex(s.replace(" ", ""))


@pytest.mark.parametrize("fields,expected", GOLDEN, ids=[f"golden{i}" for i in range(len(GOLDEN))])
def test_golden_bytes(fields, expected):
    data = wire.pack(**fields)
    assert data.hex() == _hex(expected).hex()
    p = wire.unpack(_hex(expected))
    for k in ("msg_type", "flags", "job", "rank", "pool_index", "shadow", "codec", "payload_type", "count",
              "exponent", "chunk"):
        assert getattr(p, k) == fields.get(k, 0), k
    n = fields.get("elements", 0)
    expected_payload = list(fields.get("payload", [])) + [0] * (n - len(fields.get("payload", [])))
    assert p.payload.tolist() == expected_payload


def test_header_layout_matches_documented_offsets():
    assert wire.HEADER_SIZE == 20
    assert wire.OFFSET == dict(version=0, msg_type=1, flags=2, job=4, rank=6, slot=8, codec=10, payload_type=11,
                               count=12, exponent=14, chunk=16)
    assert wire.packet_size(PayloadType.NC8, 256) == 20 + 256
    assert wire.packet_size(PayloadType.INT32, 64) == 20 + 256
    assert wire.packet_size(PayloadType.NONE, 64) == 20


# ------------------------------------------------------------------------------------------------
# Round trips
# ------------------------------------------------------------------------------------------------
_ELEM_RANGE = {PayloadType.NC8: (0, 255), PayloadType.INT32: (-2**31, 2**31 - 1),
               PayloadType.INT64: (-2**63, 2**63 - 1), PayloadType.INT8: (-128, 127),
               PayloadType.INT8_NARROW: (-128, 127)}


@st.composite
def packets(draw, max_elements=64):
    ptype = draw(st.sampled_from(list(PayloadType)))
    f = dict(
        msg_type=draw(st.sampled_from(list(MsgType))),
        flags=draw(st.integers(0, 0xF)),
        job=draw(st.integers(0, 0xFFFF)),
        rank=draw(st.integers(0, 0xFFFF)),
        pool_index=draw(st.integers(0, wire.POOL_INDEX_MASK)),
        shadow=draw(st.integers(0, 1)),
        codec=draw(st.integers(0, 255)),
        payload_type=ptype,
        exponent=draw(st.integers(-2**15, 2**15 - 1)),
        chunk=draw(st.integers(0, 2**32 - 1)),
    )
    if ptype == PayloadType.NONE:
        f["count"] = 0
    else:
        lo, hi = _ELEM_RANGE[ptype]
        elements = draw(st.integers(1, max_elements))
        payload = draw(st.lists(st.integers(lo, hi), max_size=elements))
        f.update(payload=payload, elements=elements, count=len(payload))
    return f


def _fields_of(p: wire.Packet) -> dict:
    return dict(msg_type=p.msg_type, flags=int(p.flags), job=p.job, rank=p.rank, pool_index=p.pool_index,
                shadow=p.shadow, codec=p.codec, payload_type=p.payload_type, count=p.count, exponent=p.exponent,
                chunk=p.chunk)


@settings(max_examples=300, deadline=None)
@given(packets())
def test_pack_unpack_round_trip(f):
    data = wire.pack(**f)
    assert len(data) == wire.packet_size(f["payload_type"], f.get("elements", 0))
    p = wire.unpack(data)
    assert p.version == wire.VERSION
    expect = {k: v for k, v in f.items() if k not in ("payload", "elements")}
    assert _fields_of(p) == {**expect, "flags": int(f["flags"])}
    payload = f.get("payload", [])
    assert p.payload[: len(payload)].tolist() == payload
    assert not p.payload[len(payload):].any(), "padding must be zeros"
    # and back again: unpack -> pack reproduces the bytes
    again = wire.pack(**_fields_of(p), payload=p.payload, elements=p.payload.size)
    assert again == data


# ------------------------------------------------------------------------------------------------
# Scapy dissection and the fast numpy path agree
# ------------------------------------------------------------------------------------------------
def _assert_scapy_agrees(layer: INA, data: bytes):
    p = wire.unpack(data)
    assert layer.version == p.version
    assert layer.msg_type == int(p.msg_type)
    assert int(layer.flags) == int(p.flags)
    for k in ("job", "rank", "shadow", "pool_index", "codec", "count", "exponent", "chunk"):
        assert getattr(layer, k) == getattr(p, k), k
    assert layer.payload_type == int(p.payload_type)
    assert layer.codes == p.payload.tolist()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packets())
def test_scapy_dissection_agrees_with_unpack(f):
    data = wire.pack(**f)
    layer = INA(data)
    _assert_scapy_agrees(layer, data)
    assert not layer.payload, "no bytes may be left over after the INA layer"
    # and scapy builds the same bytes from the same fields
    kw = {k: v for k, v in f.items() if k not in ("payload", "elements", "pool_index", "shadow", "payload_type")}
    pad = f.get("elements", 0) - len(f.get("payload", []))
    built = INA(**kw, pool_index=f["pool_index"], shadow=f["shadow"], payload_type=int(f["payload_type"]),
                codes=list(f.get("payload", [])) + [0] * pad)
    assert bytes(built) == data


def test_scapy_field_names_come_from_the_declaration():
    names = [fd.name for fd in INA.fields_desc]
    expected = []
    for f in wire.HEADER:
        expected.extend(n for n, _ in f.bits) if f.bits else expected.append(f.name)
    assert names == expected + ["codes"] + [f.name for f in wire.SPARSE_TRAILER]   # the trailer: SPARSE only
    layer = INA(_hex(GOLDEN[0][1]))
    assert layer.sprintf("%INA.msg_type%") == "DATA"
    assert layer.sprintf("%INA.payload_type%") == "NC8"
    assert "RETRANSMIT" in layer.sprintf("%INA.flags%")
    assert layer.sprintf("%INA.codec%") == "nc"


def test_burst_header_view_agrees_with_scapy():
    rng = np.random.default_rng(2)
    elements, stride = 16, 20 + 16 * 4
    burst = np.zeros((32, stride), np.uint8)
    rows = []
    for i in range(32):
        ptype = PayloadType.INT32 if i % 2 else PayloadType.NC8
        lo, hi = _ELEM_RANGE[ptype]
        payload = rng.integers(lo, hi, elements, endpoint=True)
        data = wire.pack(msg_type=MsgType.DATA, job=5, rank=i, pool_index=int(rng.integers(0, 1000)),
                         shadow=i % 2, codec=1, payload_type=ptype, count=elements, exponent=int(rng.integers(-99, 99)),
                         chunk=1000 + i, flags=int(rng.integers(0, 16)), payload=payload, elements=elements)
        burst[i, : len(data)] = np.frombuffer(data, np.uint8)
        rows.append(data)
    hv = wire.header_view(burst)
    for i, data in enumerate(rows):
        layer = INA(data)
        for f in wire.HEADER:
            if f.bits:
                assert hv[f.name][i] == (layer.shadow << 15 | layer.pool_index)
            else:
                assert int(hv[f.name][i]) == int(getattr(layer, f.name)), f.name
        pv = wire.payload_view(burst[i : i + 1], layer.payload_type, elements)
        assert pv[0].tolist() == layer.codes


def test_pcap_written_by_scapy_is_dissected_by_rdpcap(tmp_path):
    rng = np.random.default_rng(3)
    frames, datagrams = [], []
    for i in range(24):
        ptype = [PayloadType.NC8, PayloadType.INT32, PayloadType.INT64, PayloadType.INT8, PayloadType.NONE][i % 5]
        kw = dict(msg_type=MsgType.RESULT if i % 3 == 0 else MsgType.DATA, job=11, rank=0xFFFF if i % 3 == 0 else i,
                  pool_index=i, shadow=(i // 2) % 2, codec=1 + i % 5, payload_type=ptype, exponent=-i, chunk=i,
                  flags=i % 16)
        if ptype != PayloadType.NONE:
            lo, hi = _ELEM_RANGE[ptype]
            kw.update(payload=rng.integers(lo, hi, 8, endpoint=True), elements=8, count=8)
        data = wire.pack(**kw)
        datagrams.append(data)
        # worker -> switch uses the switch's port as destination, switch -> worker as source
        udp = UDP(sport=40000 + i, dport=wire.DEFAULT_PORT) if i % 3 else UDP(sport=wire.DEFAULT_PORT, dport=40000 + i)
        frames.append(Ether() / IP(src="10.0.0.1", dst="10.0.0.2") / udp / data)
    path = tmp_path / "ina.pcap"
    wrpcap(str(path), frames)
    read = rdpcap(str(path))
    assert len(read) == len(datagrams)
    for pkt, data in zip(read, datagrams):
        assert INA in pkt, pkt.summary()
        assert bytes(pkt[UDP].payload) == data
        _assert_scapy_agrees(pkt[INA], data)


def test_bind_port_dissects_other_ports():
    data = wire.pack(msg_type=MsgType.DATA, job=1, rank=2, payload_type=PayloadType.NC8, payload=[1, 2], count=2)
    frame = Ether(bytes(Ether() / IP() / UDP(sport=31001, dport=31002) / data))
    assert INA not in frame
    bind_port(31002)
    frame = Ether(bytes(Ether() / IP() / UDP(sport=31001, dport=31002) / data))
    assert INA in frame
    _assert_scapy_agrees(frame[INA], data)
    with pytest.raises(ValueError, match="port"):
        bind_port(70000)


def test_scapy_leaves_a_partial_element_visible():
    data = wire.pack(msg_type=MsgType.DATA, job=1, rank=2, payload_type=PayloadType.INT32, payload=[1, 2], count=2)
    layer = INA(data[:-1])
    assert layer.codes == [1]
    assert bytes(layer.payload) == data[-4:-1]


# ------------------------------------------------------------------------------------------------
# Malformed and truncated bytes
# ------------------------------------------------------------------------------------------------
def _good(**kw) -> bytearray:
    base = dict(msg_type=MsgType.DATA, job=1, rank=2, payload_type=PayloadType.INT32, payload=[1, 2, 3],
                elements=4, count=3)
    base.update(kw)
    return bytearray(wire.pack(**base))


@pytest.mark.parametrize("length", [0, 1, 12, 19])
def test_truncated_header(length):
    with pytest.raises(WireError, match=r"truncated packet: %d bytes" % length):
        wire.unpack(bytes(_good())[:length])


def test_malformed_bytes_name_the_problem():
    b = _good()
    b[0] = 2
    with pytest.raises(WireError, match="unknown version 2"):
        wire.unpack(bytes(b))
    b = _good()
    b[1] = 0x42
    with pytest.raises(WireError, match="unknown msg_type 66"):
        wire.unpack(bytes(b))
    b = _good()
    b[11] = 9
    with pytest.raises(WireError, match="unknown payload_type 9"):
        wire.unpack(bytes(b))
    with pytest.raises(WireError, match="not a whole number of 4-byte elements"):
        wire.unpack(bytes(_good())[:-1])          # truncated payload
    b = _good()
    b[12:14] = (5).to_bytes(2, "big")
    with pytest.raises(WireError, match="count 5 exceeds the 4 elements"):
        wire.unpack(bytes(b))
    with pytest.raises(WireError, match="count 3 exceeds the 2 elements"):
        wire.unpack(bytes(_good())[:-8])          # chunk cut by two whole elements
    b = bytearray(wire.pack(msg_type=MsgType.DATA, job=1, rank=2)) + b"\x00\x01"
    with pytest.raises(WireError, match="payload_type NONE but 2 payload bytes follow"):
        wire.unpack(bytes(b))


def test_bad_arguments_to_pack_and_views():
    with pytest.raises(WireError, match="pool index 32768 out of range"):
        wire.pack(msg_type=MsgType.DATA, job=1, rank=1, pool_index=0x8000)
    with pytest.raises(WireError, match="more than the chunk's 2"):
        wire.pack(msg_type=MsgType.DATA, job=1, rank=1, payload_type=PayloadType.NC8, payload=[1, 2, 3], elements=2)
    with pytest.raises(WireError, match="2-D uint8"):
        wire.header_view(np.zeros(40, np.uint8))
    with pytest.raises(WireError, match="2-D uint8"):
        wire.header_view(np.zeros((2, 10), np.uint8))
    with pytest.raises(WireError, match="cannot hold 8 elements of INT32"):
        wire.payload_view(np.zeros((2, 40), np.uint8), PayloadType.INT32, 8)
