"""The switch's data plane: numba kernels over a burst of packets, integer arithmetic only.

Three kernels, one per pipeline stage that touches packet bytes (see pipeline.py for the stage list):

* :func:`parse`     validate every header against the job table; give each packet a verdict;
* :func:`aggregate` the ALU: per packet, the SwitchML slot protocol and the integer adds;
* :func:`harvest`   completed slots: write the result packet into the slot's shadow-copy row and
                    plan its multicast (and the unicast replays of retransmissions).

Nothing here sees a float: natural-compression codes become integers by a shift
(code k -> 2**(k-1)), sums are re-encoded by an integer log2 and an integer random comparison.
tests/test_switch.py checks the compiled LLVM IR of these kernels for floating-point instructions.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

from ina.wire import HEADER_SIZE, OFFSET, SWITCH_RANK, VERSION, MsgType, PayloadType, Flag, result_type

# --- header offsets, from the one declaration in ina/wire.py ---------------------------------------
O_VERSION = OFFSET["version"]
O_MSG = OFFSET["msg_type"]
O_FLAGS = OFFSET["flags"]
O_JOB = OFFSET["job"]
O_RANK = OFFSET["rank"]
O_SLOT = OFFSET["slot"]
O_CODEC = OFFSET["codec"]
O_PTYPE = OFFSET["payload_type"]
O_COUNT = OFFSET["count"]
O_EXP = OFFSET["exponent"]
O_CHUNK = OFFSET["chunk"]
HDR = HEADER_SIZE
DATA = int(MsgType.DATA)
RESULT = int(MsgType.RESULT)
F_OVERFLOW = int(Flag.OVERFLOW)
F_REPLAY = int(Flag.REPLAY)
F_RAW = int(Flag.RAW_SUM)
P_NONE, P_NC8, P_INT32, P_INT64, P_INT8 = (int(PayloadType.NONE), int(PayloadType.NC8), int(PayloadType.INT32),
                                           int(PayloadType.INT64), int(PayloadType.INT8))
P_INT8N = int(PayloadType.INT8_NARROW)
P_MAX = max(int(t) for t in PayloadType)

# --- job table columns ---------------------------------------------------------------------------
# J_SLOTS is the job's whole pool (pool indices 0..J_SLOTS-1 in packets); with --cores N the pool is
# sharded: pool index p lives in shard p % N at local slot J_SLOT_LO + p // N.
J_ACTIVE, J_NWORKERS, J_SLOT_LO, J_SLOTS, J_ELEMENTS, J_RAW, J_ADDR_BASE, J_SHARDS, J_SHARD = range(9)
J_COLUMNS = 9
MAX_JOBS = 1 << 16

# --- verdicts (parse) and actions (aggregate); the drop reasons are counters of the same names ----
OK = 0
DROP_REASONS = (
    "ok",
    "truncated",            # shorter than a header, or cut by the receive buffer
    "bad_version",
    "bad_msg_type",         # not a DATA packet
    "bad_payload_type",
    "bad_length",           # length does not match the job's fixed chunk for this payload type
    "bad_count",            # count larger than the job's elements per packet
    "unknown_job",
    "unknown_worker",       # rank >= the job's worker count
    "slot_out_of_range",    # pool index >= the job's slots
    "slot_chunk_mismatch",  # pool index / shadow set do not follow from the chunk id
    "payload_type_mismatch",  # differs from the slot's current round
    "stale",                # chunk older than the slot's current round (late duplicate)
    "slot_busy",            # newer chunk while the slot's round is incomplete (protocol violation)
    "retransmit_pending",   # retransmission while the round is still waiting for other workers
)
R = {name: i for i, name in enumerate(DROP_REASONS)}
N_REASONS = len(DROP_REASONS)
R_PTYPE_MISMATCH = R["payload_type_mismatch"]
R_STALE = R["stale"]
R_BUSY = R["slot_busy"]
R_RETX_PENDING = R["retransmit_pending"]
C_OVERFLOW = N_REASONS   # the "overflow" counter follows the drop reasons
ABSORBED = 100   # added into the registers
HARVEST = 101    # completed the slot
REPLAY = 102     # retransmission to a completed slot: unicast the stored result


_result_type = njit(inline="always")(result_type)   # ina.wire.result_type, for the kernels


@njit(inline="always")
def _rd16(b, i, o):
    return (np.int64(b[i, o]) << 8) | np.int64(b[i, o + 1])


@njit(inline="always")
def _rd32(b, i, o):
    return ((np.int64(b[i, o]) << 24) | (np.int64(b[i, o + 1]) << 16) | (np.int64(b[i, o + 2]) << 8)
            | np.int64(b[i, o + 3]))


@njit(inline="always")
def _wr16(b, i, o, v):
    b[i, o] = np.uint8((v >> 8) & 0xFF)
    b[i, o + 1] = np.uint8(v & 0xFF)


@njit(inline="always")
def _width(ptype):
    if ptype == P_NC8 or ptype == P_INT8 or ptype == P_INT8N:
        return 1
    if ptype == P_INT32:
        return 4
    if ptype == P_INT64:
        return 8
    return 0


@njit(cache=True)
def parse(buf, lens, n, jobs, verdict, slot2, rank, job, counters):
    """Validate headers against the job table. verdict[i] = OK or a drop reason index."""
    for i in range(n):
        ln = lens[i]
        v = OK
        if ln < HDR or ln > buf.shape[1]:
            v = 1
        elif buf[i, O_VERSION] != VERSION:
            v = 2
        elif buf[i, O_MSG] != DATA:
            v = 3
        else:
            pt = np.int64(buf[i, O_PTYPE])
            if pt > P_MAX:
                v = 4
            else:
                j = _rd16(buf, i, O_JOB)
                if jobs[j, J_ACTIVE] == 0:
                    v = 7
                elif ln != HDR + _width(pt) * jobs[j, J_ELEMENTS]:
                    v = 5
                elif _rd16(buf, i, O_COUNT) > jobs[j, J_ELEMENTS] or (pt == P_NONE and _rd16(buf, i, O_COUNT) != 0):
                    v = 6
                else:
                    r = _rd16(buf, i, O_RANK)
                    s = _rd16(buf, i, O_SLOT)
                    pool = s & 0x7FFF
                    shadow = s >> 15
                    nslots = jobs[j, J_SLOTS]
                    c = _rd32(buf, i, O_CHUNK)
                    if r >= jobs[j, J_NWORKERS]:
                        v = 8
                    elif pool >= nslots:
                        v = 9
                    elif (c % nslots) != pool or ((c // nslots) & 1) != shadow:
                        v = 10
                    elif pool % jobs[j, J_SHARDS] != jobs[j, J_SHARD]:
                        v = 9                                   # a pool index of another shard
                    else:
                        job[i] = j
                        rank[i] = r
                        slot2[i] = (jobs[j, J_SLOT_LO] + pool // jobs[j, J_SHARDS]) * 2 + shadow
        verdict[i] = v
        counters[v] += 1


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
def _harvest_pending(action, slot2, i, s):
    # did an earlier packet of this burst complete set s (its harvest runs after the whole burst)?
    for k in range(i):
        if action[k] == HARVEST and slot2[k] == s:
            return True
    return False


@njit(cache=True)
def aggregate(buf, n, verdict, slot2, rank, job, jobs, regs, bitmap, count, maxexp, round_chunk,
              complete, ptype, codec, nvalid, ovf, reg_bits, counters, action, vals):
    """The ALU stage: the slot protocol and integer adds for every packet that passed parsing.

    Per (slot, shadow set): the first packet of a round writes its values, later ones add; a
    worker whose bit is already set in the worker bitmap is retransmitting and only reads (a replay
    if the round is complete). A round is identified by its chunk id; older chunks are stale.
    """
    hi = (np.int64(1) << (reg_bits - 1)) - 1
    lo = -hi - 1
    max_shift = reg_bits - 1
    for i in range(n):
        if verdict[i] != OK:
            action[i] = verdict[i]
            continue
        s = slot2[i]
        j = job[i]
        w = rank[i]
        bit = np.uint64(1) << np.uint64(w)
        c = _rd32(buf, i, O_CHUNK)
        pt = np.int64(buf[i, O_PTYPE])
        e = _rd16(buf, i, O_EXP)
        if e >= 0x8000:
            e -= 0x10000
        cnt = _rd16(buf, i, O_COUNT)
        nw = jobs[j, J_NWORKERS]
        E = jobs[j, J_ELEMENTS]
        if c == round_chunk[s]:
            if bitmap[s] & bit:
                if complete[s]:
                    action[i] = REPLAY
                else:
                    action[i] = R_RETX_PENDING
                    counters[R_RETX_PENDING] += 1
                continue
            if pt != ptype[s]:
                action[i] = R_PTYPE_MISMATCH
                counters[R_PTYPE_MISMATCH] += 1
                continue
            first = False
        elif c > round_chunk[s]:
            if round_chunk[s] >= 0 and (not complete[s] or _harvest_pending(action, slot2, i, s)):
                # busy: the round is incomplete, or it completed in this burst and its result is not
                # harvested yet (a new round would overwrite the registers before the harvest stage)
                action[i] = R_BUSY
                counters[R_BUSY] += 1
                continue
            first = True
        else:
            action[i] = R_STALE
            counters[R_STALE] += 1
            continue
        # ---- integer ALU ----
        o = False
        if first:
            round_chunk[s] = c
            bitmap[s] = np.uint64(0)
            count[s] = 0
            complete[s] = 0
            ovf[s] = 0
            ptype[s] = pt
            codec[s] = np.int64(buf[i, O_CODEC])
            maxexp[s] = e
            nvalid[s] = cnt
        else:
            if e > maxexp[s]:
                maxexp[s] = e
            if cnt > nvalid[s]:
                nvalid[s] = cnt
        # decode the chunk's codes into signed integers (scratch row), checking they are in range
        mx_shift = np.int64(0)
        if pt == P_NC8:
            for k in range(E):
                code = np.int64(buf[i, HDR + k])
                kk = code & 0x7F
                mx_shift = max(mx_shift, kk)
                sg = code >> 7
                # 2**(k-1), and 0 for k = 0: a shift (unsigned, so that k = 63 gives +2**62, not -2**62)
                mag = np.int64((np.uint64(1) << np.uint64(kk & 63)) >> np.uint64(1))
                vals[k] = (mag ^ -sg) + sg                      # conditional negate, branch-free
            if mx_shift - 1 >= max_shift:                       # a code beyond the register: saturate
                for k in range(E):
                    code = np.int64(buf[i, HDR + k])
                    if (code & 0x7F) - 1 >= max_shift:
                        vals[k] = lo if (code & 0x80) else hi
                o = True
        elif pt == P_INT8 or pt == P_INT8N:
            for k in range(E):
                vals[k] = np.int64(np.int8(buf[i, HDR + k]))
        elif pt == P_INT32:
            for k in range(E):
                b0 = HDR + 4 * k
                u = ((np.uint32(buf[i, b0]) << np.uint32(24)) | (np.uint32(buf[i, b0 + 1]) << np.uint32(16))
                     | (np.uint32(buf[i, b0 + 2]) << np.uint32(8)) | np.uint32(buf[i, b0 + 3]))
                vals[k] = np.int64(np.int32(u))
        elif pt == P_INT64:
            for k in range(E):
                b0 = HDR + 8 * k
                u = np.uint64(0)
                for b in range(8):
                    u = (u << np.uint64(8)) | np.uint64(buf[i, b0 + b])
                vals[k] = np.int64(u)
        else:   # P_NONE (exponent round): no payload; the scratch row still holds the last packet's values
            for k in range(E):
                vals[k] = 0
        # the ALU: first packet of a round writes, the others add; overflow detected, never wrapped
        if first:
            for k in range(E):
                regs[s, k] = vals[k]
            if reg_bits < 64:
                for k in range(E):
                    if regs[s, k] > hi or regs[s, k] < lo:
                        regs[s, k] = hi if regs[s, k] > 0 else lo
                        o = True
        else:
            acc = np.int64(0)
            mn = np.int64(0)
            mxv = np.int64(0)
            for k in range(E):                                  # vectorisable: add + overflow witnesses
                a = regs[s, k]
                b = vals[k]
                r = a + b
                acc |= (a ^ r) & (b ^ r)
                mn = min(mn, r)
                mxv = max(mxv, r)
            if acc < 0 or mn < lo or mxv > hi:                  # rare: redo with saturation
                for k in range(E):
                    regs[s, k], of = _sat_add(regs[s, k], vals[k], lo, hi)
                    o |= of
            else:
                for k in range(E):
                    regs[s, k] += vals[k]
        if o:
            ovf[s] = 1
            counters[C_OVERFLOW] += 1
        bitmap[s] |= bit
        count[s] += 1
        if count[s] >= nw:
            complete[s] = 1
            action[i] = HARVEST
        else:
            action[i] = ABSORBED


@njit(inline="always")
def _mix64(z):
    # splitmix64 finaliser: a counter-based 64-bit integer hash (a switch's random-number extern)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(inline="always")
def _nc_reencode(v, key):
    # integer sum -> 8-bit natural-compression code: p = floor(log2 |v|) by count-leading-zeros,
    # round up to 2**(p+1) with probability (|v| - 2**p) / 2**p, by an integer random comparison
    neg = np.int64(v < 0)
    a = np.uint64((v ^ -neg) + neg)                     # |v|
    p = np.int64(63) - np.int64(leading_zeros(a | np.uint64(1)))
    mant = a - (np.uint64(1) << np.uint64(p))
    r = _mix64(key) >> np.uint64(64 - p) if p > 0 else np.uint64(0)   # uniform in [0, 2**p)
    up = np.int64(r < mant)
    k = min(p + up + 1, np.int64(127))
    code = np.uint8((neg << 7) | k)
    return code if a != np.uint64(0) else np.uint8(0)


@njit(cache=True)
def harvest(n, action, slot2, rank, job, jobs, regs, maxexp, round_chunk, ptype, codec, nvalid, ovf,
            reg_bits, seed, results, result_len, tx_row, tx_len, tx_addr, counters, c_harvest, c_replay):
    """Write completed slots' result packets into their shadow-copy rows; plan the transmissions.

    Returns the number of planned transmissions (tx_row/tx_len/tx_addr[:m]): a multicast to every
    worker of the job per completed slot, a unicast per replay.
    """
    m = 0
    for i in range(n):
        a = action[i]
        if a != HARVEST and a != REPLAY:
            continue
        s = slot2[i]
        j = job[i]
        if a == HARVEST:
            counters[c_harvest] += 1
            E = jobs[j, J_ELEMENTS]
            pt = ptype[s]
            raw = jobs[j, J_RAW] != 0 or pt != P_NC8
            out_pt = _result_type(pt, raw, reg_bits)      # the one rule of result widths (ina.wire)
            flags = (F_RAW if (raw and pt != P_NONE) else 0)
            o = ovf[s] != 0
            # header
            for b in range(HDR):
                results[s, b] = 0
            results[s, O_VERSION] = VERSION
            results[s, O_MSG] = RESULT
            _wr16(results, s, O_JOB, j)
            _wr16(results, s, O_RANK, SWITCH_RANK)
            slot_lo = jobs[j, J_SLOT_LO]
            pool = (s // 2 - slot_lo) * jobs[j, J_SHARDS] + jobs[j, J_SHARD]
            _wr16(results, s, O_SLOT, pool | ((s & 1) << 15))
            results[s, O_CODEC] = np.uint8(codec[s])
            results[s, O_PTYPE] = np.uint8(out_pt)
            _wr16(results, s, O_COUNT, nvalid[s])
            _wr16(results, s, O_EXP, maxexp[s] & 0xFFFF)
            c = round_chunk[s]
            results[s, O_CHUNK] = np.uint8((c >> 24) & 0xFF)
            results[s, O_CHUNK + 1] = np.uint8((c >> 16) & 0xFF)
            results[s, O_CHUNK + 2] = np.uint8((c >> 8) & 0xFF)
            results[s, O_CHUNK + 3] = np.uint8(c & 0xFF)
            # payload
            if out_pt == P_NC8:
                key0 = (np.uint64(seed) << np.uint64(32)) ^ (np.uint64(c) * np.uint64(0x9E3779B97F4A7C15))
                for k in range(E):
                    results[s, HDR + k] = _nc_reencode(regs[s, k], key0 + np.uint64(k) * np.uint64(0xD1B54A32D192ED03))
            elif out_pt == P_INT64:
                for k in range(E):
                    v = regs[s, k]
                    for b in range(8):
                        results[s, HDR + 8 * k + b] = np.uint8((v >> (56 - 8 * b)) & 0xFF)
            elif out_pt == P_INT32 or out_pt == P_INT8N:     # narrower than the registers: clamp, flag
                w = _width(out_pt)
                hi = (np.int64(1) << np.int64(8 * w - 1)) - 1
                lo = -hi - 1
                for k in range(E):
                    v = regs[s, k]
                    if v > hi:
                        v = hi
                        o = True
                    elif v < lo:
                        v = lo
                        o = True
                    for b in range(w):
                        results[s, HDR + w * k + b] = np.uint8((v >> (8 * (w - 1 - b))) & 0xFF)
            if o:
                flags |= F_OVERFLOW
            _wr16(results, s, O_FLAGS, flags)
            result_len[s] = HDR + _width(out_pt) * E
            nw = jobs[j, J_NWORKERS]
            ab = jobs[j, J_ADDR_BASE]
            for w in range(nw):        # multicast
                tx_row[m] = s
                tx_len[m] = result_len[s]
                tx_addr[m] = ab + w
                m += 1
        else:
            counters[c_replay] += 1
            # a replay carries the REPLAY flag: set it on the stored row for this send only is not
            # possible without a copy, so replays are marked by the tx stage (see pipeline.tx)
            tx_row[m] = s
            tx_len[m] = -result_len[s]      # negative length marks a replay for the tx stage
            tx_addr[m] = jobs[j, J_ADDR_BASE] + rank[i]
            m += 1
    return m
