"""The aggregate stage's kernel: the switch's ALU (the SwitchML slot protocol and the integer adds).

One of the data plane's three kernels (switch_model/dataplane.py has the state they share).
Integer arithmetic only: tests/test_switch.py checks the compiled LLVM IR for floating point.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ina.wire import chunk_newer

from .dataplane import (C_OVERFLOW, F_LATE, F_RETRANSMIT, F_SPARSE, HDR, O_CHUNK, O_CODEC, O_COUNT, O_EXP, O_FLAGS,
                        O_PTYPE, P_INT8, P_INT8N, P_INT32, P_INT64, P_NC8, P_NONE, Action, Verdict, bswap32,
                        payload_width, rd16, rd32)


@njit(inline="always")
def _sat_add(a, b, lo, hi):
    # add with overflow detection: returns (sum saturated to [lo, hi], overflowed)
    s = a + b   # int64 wraps on overflow; detect it by signs
    wrapped = ((a ^ s) & (b ^ s)) < 0
    if wrapped:
        return (hi if a > 0 else lo), True
    if s > hi:
        return hi, True
    if s < lo:
        return lo, True
    return s, False


@njit(inline="always")
def _nc_value(code):
    """An NC8 code's integer: sign bit 7, k = the low 7 bits, 2**(k-1) (0 for k = 0). A shift (unsigned,
    so that k = 63 gives +2**62, not -2**62); codes beyond 64 bits wrap here: callers check ``k``."""
    kk = code & 0x7F
    sg = code >> 7
    mag = np.int64((np.uint64(1) << np.uint64(kk & 63)) >> np.uint64(1))
    return (mag ^ -sg) + sg                      # conditional negate, branch-free


@njit(inline="always")
def _be32(word):
    """A big-endian int32 payload element, read as a native uint32 word: its value."""
    return np.int64(np.int32(bswap32(word)))


# the payload loops are functions of their own (called once per packet), not inlined: inlining them
# into aggregate twice made its compilation about a quarter slower, for no speed
@njit
def _decode(buf, i, pt, E, out, max_shift, lo, hi):
    """Packet i's E values (payload type pt) as signed integers into ``out``; a code beyond the
    register's range is saturated to ``lo`` / ``hi``. Returns whether one was."""
    o = False
    if pt == P_NC8:
        mx_shift = np.int64(0)
        for k in range(E):
            code = np.int64(buf[i, HDR + k])
            mx_shift = max(mx_shift, code & 0x7F)
            out[k] = _nc_value(code)
        if mx_shift - 1 >= max_shift:                       # a code beyond the register: saturate
            for k in range(E):
                code = np.int64(buf[i, HDR + k])
                if (code & 0x7F) - 1 >= max_shift:
                    out[k] = lo if (code & 0x80) else hi
            o = True
    elif pt == P_INT8 or pt == P_INT8N:
        for k in range(E):
            out[k] = np.int64(np.int8(buf[i, HDR + k]))
    elif pt == P_INT32:
        words = buf[i, HDR: HDR + 4 * E].view(np.uint32)
        for k in range(E):
            out[k] = _be32(words[k])
    elif pt == P_INT64:
        for k in range(E):
            b0 = HDR + 8 * k
            u = np.uint64(0)
            for b in range(8):
                u = (u << np.uint64(8)) | np.uint64(buf[i, b0 + b])
            out[k] = np.int64(u)
    else:   # P_NONE (exponent round): no payload
        for k in range(E):
            out[k] = 0
    return o


@njit
def _add_in_one_pass(buf, i, pt, E, row, max_shift, lo, hi):
    """The common case in one pass over the registers: add packet i's NC8 or INT32 values into ``row``,
    decoding as it goes, with overflow witnesses. Returns True when no value needed saturation; else
    (and for other payload types) False with ``row`` as it was: the pass is undone exactly (int64
    addition wraps, so r - y is x again), and the caller redoes the packet with saturation."""
    acc = np.int64(0)
    mn = np.int64(0)
    mxv = np.int64(0)
    if pt == P_NC8:
        mx_shift = np.int64(0)
        for k in range(E):                                  # vectorisable: decode + add + witnesses
            code = np.int64(buf[i, HDR + k])
            mx_shift = max(mx_shift, code & 0x7F)
            y = _nc_value(code)
            x = row[k]
            r = x + y
            acc |= (x ^ r) & (y ^ r)
            mn = min(mn, r)
            mxv = max(mxv, r)
            row[k] = r
        if mx_shift - 1 < max_shift and acc >= 0 and mn >= lo and mxv <= hi:
            return True
        for k in range(E):
            row[k] -= _nc_value(np.int64(buf[i, HDR + k]))
        return False
    if pt == P_INT32:
        words = buf[i, HDR: HDR + 4 * E].view(np.uint32)
        for k in range(E):
            y = _be32(words[k])
            x = row[k]
            r = x + y
            acc |= (x ^ r) & (y ^ r)
            mn = min(mn, r)
            mxv = max(mxv, r)
            row[k] = r
        if acc >= 0 and mn >= lo and mxv <= hi:
            return True
        for k in range(E):
            row[k] -= _be32(words[k])
        return False
    return False


@njit
def _add_checked(row, vals, E, lo, hi):
    """row += vals with overflow detection; a sum beyond [lo, hi] saturates. Returns whether one did."""
    acc = np.int64(0)
    mn = np.int64(0)
    mxv = np.int64(0)
    for k in range(E):                                      # vectorisable: add + overflow witnesses
        x = row[k]
        y = vals[k]
        r = x + y
        acc |= (x ^ r) & (y ^ r)
        mn = min(mn, r)
        mxv = max(mxv, r)
    o = False
    if acc < 0 or mn < lo or mxv > hi:                      # rare: redo with saturation
        for k in range(E):
            row[k], of = _sat_add(row[k], vals[k], lo, hi)
            o |= of
    else:
        for k in range(E):
            row[k] += vals[k]
    return o


@njit(inline="always")
def _harvest_pending(pkts, i, s):
    # did an earlier packet of this burst complete set s (its harvest runs after the whole burst)?
    for k in range(i):
        if pkts[k].action == Action.HARVEST and pkts[k].set_id == s:
            return True
    return False


_chunk_newer = njit(inline="always")(chunk_newer)


@njit(inline="always")
def _protocol(sets, pkts, i, c, bit, modulus, retx):
    """The slot protocol for packet i (chunk c, worker bit; chunk ids modulo ``modulus``; ``retx``: it
    carries the RETRANSMIT flag): (its Action, or the Verdict it is dropped with; whether it is the
    first packet of a new round).

    A resend of a round another rank's resend completed is not replayed when it is this rank's first
    resend of the round (RETRANSMIT_CROSSED): a lost data packet makes every rank resend at once (none
    can tell whose packet it was), the loser's resend completes the round, and the others' resends
    cross the result's multicast on its way to them; a replay would send each of them the result a
    second time. The same holds for a round completed by a LATE first send (a rank that lost the result
    of the slot's previous round sends this chunk only after its replay; its peers, seeing this round's
    result missing, resent). A rank that did lose that multicast resends again (after its reordering
    window) and is replayed then, as is every resend of a rank whose earlier resend of the round was read."""
    m = sets[pkts[i].set_id]
    if c == m.round_chunk:
        if m.bitmap & bit:
            crossed = retx and m.recovered != 0 and (m.resent & bit) == 0
            if retx:
                m.resent |= bit
            if m.complete:
                if crossed:
                    return np.int64(Verdict.RETRANSMIT_CROSSED), False
                return np.int64(Action.REPLAY), False
            return np.int64(Verdict.RETRANSMIT_PENDING), False
        return np.int64(Action.ABSORBED), False
    if m.round_chunk < 0 or _chunk_newer(c, m.round_chunk, modulus):
        if m.round_chunk >= 0 and (not m.complete or _harvest_pending(pkts, i, pkts[i].set_id)):
            # busy: the round is incomplete, or it completed in this burst and its result is not
            # harvested yet (a new round would overwrite the registers before the harvest stage)
            return np.int64(Verdict.SLOT_BUSY), False
        return np.int64(Action.ABSORBED), True
    return np.int64(Verdict.STALE), False


@njit(cache=True)
def aggregate(dp, buf, n):
    """The ALU stage: the slot protocol and integer adds for every packet that passed parsing.

    Per (slot, shadow set): the first packet of a round writes its values, later ones add; a
    worker whose bit is already set in the worker bitmap is retransmitting and only reads (a replay
    if the round is complete). A round is identified by its chunk id; older chunks (serial-number
    order modulo the job's chunk modulus, ina.wire.chunk_newer) are stale.
    """
    # the state's arrays, taken out once: each use of dp.<array> (or an array handed to a helper) in
    # the packet loop costs reference counting, measurable on small packets (bench_switch)
    regs, sets, jobs, counters, pkts, vals = dp.regs, dp.sets, dp.jobs, dp.counters, dp.pkts, dp.vals
    reg_bits = dp.register_bits
    hi = (np.int64(1) << (reg_bits - 1)) - 1
    lo = -hi - 1
    max_shift = reg_bits - 1
    for i in range(n):
        p = pkts[i]
        if p.verdict != Verdict.OK:
            p.action = p.verdict
            continue
        s = p.set_id
        m = sets[s]
        bit = np.uint64(1) << np.uint64(p.rank)
        c = rd32(buf, i, O_CHUNK)
        pt = np.int64(buf[i, O_PTYPE])
        job = jobs[p.job]
        flags = rd16(buf, i, O_FLAGS)
        retx = (flags & F_RETRANSMIT) != 0
        a, first = _protocol(sets, pkts, i, c, bit, job.chunk_modulus, retx)
        sparse = (flags & F_SPARSE) != 0
        adopt = False            # a sparse round's first data packet after header-only (zero) packets
        if a == Action.ABSORBED and not first and pt != m.ptype:
            if sparse and m.sparse != 0 and (pt == P_NONE or m.ptype == P_NONE):
                adopt = m.ptype == P_NONE
            else:
                a = Verdict.PAYLOAD_TYPE_MISMATCH
        p.action = a
        if a != Action.ABSORBED:
            if a != Action.REPLAY:
                counters[a] += 1
            continue
        e = rd16(buf, i, O_EXP)
        if e >= 0x8000:
            e -= 0x10000
        cnt = rd16(buf, i, O_COUNT)
        dist = job.pool_slots        # a dense packet's next round is the stream's next chunk
        if sparse:
            dist = (rd32(buf, i, HDR + payload_width(pt) * job.elements) - c) % job.chunk_modulus
        if first:
            m.sparse = np.uint8(1) if sparse else np.uint8(0)
            m.next_dist = dist
            m.round_chunk = c
            m.bitmap = np.uint64(0)
            m.count = 0
            m.complete = 0
            m.overflow = 0
            m.recovered = 0
            m.resent = np.uint64(0)
            m.ptype = pt
            m.codec = np.int64(buf[i, O_CODEC])
            m.maxexp = e
            m.nvalid = cnt
        else:
            if e > m.maxexp:
                m.maxexp = e
            if cnt > m.nvalid:
                m.nvalid = cnt
            if sparse:
                m.sparse = np.uint8(1)
            if dist < m.next_dist:
                m.next_dist = dist
            if adopt:
                m.ptype = pt
                m.codec = np.int64(buf[i, O_CODEC])
        E = job.elements
        row = regs[s]
        # the ALU: first packet of a round writes, the others add; overflow detected, never wrapped
        if first:
            o = _decode(buf, i, pt, E, row, max_shift, lo, hi)     # straight into the registers
            if reg_bits < 64:
                for k in range(E):
                    if row[k] > hi or row[k] < lo:
                        row[k] = hi if row[k] > 0 else lo
                        o = True
        elif pt == P_NONE:            # a header-only packet (a sparse round's zero chunk) adds nothing
            o = False
        elif _add_in_one_pass(buf, i, pt, E, row, max_shift, lo, hi):
            o = False
        else:                         # rare (or a payload type without a one-pass add): decode, add checked
            o = _decode(buf, i, pt, E, vals, max_shift, lo, hi)
            o |= _add_checked(row, vals, E, lo, hi)
        if o:
            m.overflow = 1
            counters[C_OVERFLOW] += 1
        m.bitmap |= bit
        m.count += 1
        if retx:
            m.resent |= bit
        if m.count >= job.n_workers:
            m.complete = 1
            m.recovered = np.uint8(1) if retx or (flags & F_LATE) != 0 else np.uint8(0)
            p.action = Action.HARVEST
