"""The switch's ALU (switch_model/alu.py) against a plain-Python model of saturating register adds.

The aggregate kernel adds NC8 and INT32 packets in one pass and, when a value overflows the
register, undoes that pass and redoes the packet with saturation; the other payload types take the
checked path directly. These tests drive a real ``Switch``'s parse, aggregate and harvest stages on
prepared bursts (no sockets: the packets are written into its receive ring) and compare every
register, the result packet and the overflow counter with the model, for bursts where nothing
overflows and bursts where some elements overflow and the others must come out exact.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from sw_harness import run_stages  # noqa: E402

from ina.wire import Flag, MsgType, PayloadType, pack, unpack  # noqa: E402
from switch_model.dataplane import source_key  # noqa: E402
from switch_model.pipeline import Switch, SwitchConfig  # noqa: E402

ELEMENTS = 64
WORKERS = 3


def _switch(bits: int) -> Switch:
    sw = Switch(SwitchConfig(host="127.0.0.1", port=0, slots=4, elements=ELEMENTS, register_bits=bits, burst=8))
    sw.install_job(5, WORKERS, 4, ELEMENTS, True, [("127.0.0.1", 9)] * WORKERS)
    sw.state.src[:] = source_key(0x7F000001, 9)           # every packet from the joined address
    return sw


def _nc_value(code: int, bits: int) -> int:
    k, neg = code & 0x7F, code >> 7
    if k - 1 >= bits - 1:                                  # beyond the register: saturated on decode
        return -2 ** (bits - 1) if neg else 2 ** (bits - 1) - 1
    v = 0 if k == 0 else 2 ** (k - 1)
    return -v if neg else v


def _model(values: list[list[int]], bits: int) -> tuple[list[int], bool]:
    """Registers after the packets in order, each add saturating to the register; whether any did."""
    hi, lo = 2 ** (bits - 1) - 1, -2 ** (bits - 1)
    regs, over = [0] * ELEMENTS, False
    for n, vals in enumerate(values):
        for k, v in enumerate(vals):
            s = v if n == 0 else regs[k] + v
            regs[k] = min(max(s, lo), hi)
            over |= regs[k] != s
    return regs, over


def _packets(rng, ptype: int, bits: int, big: bool) -> tuple[list[np.ndarray], list[list[int]]]:
    if ptype == PayloadType.NC8:
        top = bits + 4 if big else bits - 3            # big: codes at and beyond the register's width
        codes = [(rng.integers(0, top, ELEMENTS) | (rng.integers(0, 2, ELEMENTS) << 7)).astype(np.uint8)
                 for _ in range(WORKERS)]
        return codes, [[_nc_value(int(c), bits) for c in cs] for cs in codes]
    span = 2**31 - 1 if big else 2**20
    ints = [rng.integers(-span, span + 1, ELEMENTS).astype(np.int32) for _ in range(WORKERS)]
    if big:                                            # a run of maxima that overflows any 32-bit register
        ints[1][:8] = ints[2][:8] = 2**31 - 1
    return ints, [[int(v) for v in a] for a in ints]


def _run(sw: Switch, ptype: int, payloads: list[np.ndarray], chunk: int) -> None:
    pkts = [pack(msg_type=MsgType.DATA, job=5, rank=r, pool_index=chunk % 4, shadow=(chunk // 4) & 1,
                 payload_type=ptype, count=ELEMENTS, chunk=chunk, payload=p, elements=ELEMENTS)
            for r, p in enumerate(payloads)]
    assert run_stages(sw, pkts) == WORKERS                  # one completed slot, a copy to every worker


@pytest.mark.parametrize("bits", [64, 32])
@pytest.mark.parametrize("ptype", [PayloadType.NC8, PayloadType.INT32])
def test_registers_equal_the_saturating_model_with_and_without_overflow(bits, ptype):
    sw = _switch(bits)
    rng = np.random.default_rng(bits * 10 + int(ptype))
    try:
        chunk = 0
        for big in (False, True, False, True, True, False):
            payloads, values = _packets(rng, ptype, bits, big)
            want, over = _model(values, bits)
            ovf0 = int(sw.stats()["counters"]["overflow"])
            _run(sw, ptype, payloads, chunk)
            s = 2 * (chunk % 4) + ((chunk // 4) & 1)
            assert sw.state.regs[s].tolist() == want, (chunk, big)
            assert bool(sw.state.sets[s]["overflow"]) == over, (chunk, big)
            assert (int(sw.stats()["counters"]["overflow"]) > ovf0) == over
            res = unpack(bytes(sw.state.results[s, :sw.state.sets[s]["result_len"]]))
            assert res.chunk == chunk and res.msg_type == MsgType.RESULT
            width = 2**31 - 1 if (ptype == PayloadType.INT32 or bits == 32) else 2**63 - 1
            assert res.payload.astype(np.int64).tolist() == [min(max(v, -width - 1), width) for v in want]
            assert bool(res.flags & Flag.OVERFLOW) == (over or any(abs(v) > width for v in want))
            if big:
                assert over or ptype == PayloadType.INT32 and bits == 64, "the big case must overflow"
            chunk += 1
    finally:
        sw.sock.close()
