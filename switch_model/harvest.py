"""The harvest stage's kernel: completed slots' result packets, and the plan of their transmission.

One of the data plane's three kernels (switch_model/dataplane.py has the state they share).
The natural-compression re-encoding of register sums and its random numbers (the rounding hash,
specified in docs/switch.md) are here. Integer arithmetic only: tests/test_switch.py checks the
compiled LLVM IR for floating point.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

from ina.wire import SWITCH_RANK, result_type

from .dataplane import (C_HARVESTED, C_MULTICAST, C_REPLAYS, F_GROUP_SEEN, F_OVERFLOW, F_RAW, F_SPARSE, HDR, O_CHUNK,
                        O_CODEC, O_COUNT, O_EXP, O_FLAGS, O_JOB, O_MSG, O_PTYPE, O_RANK, O_SLOT, O_VERSION, P_INT8N, P_INT32,
                        P_INT64, P_NC8, P_NONE, RESULT, TRL, VERSION, Action, bswap32, payload_width, rd16, wr16)


# --- the re-encoding's random numbers (specified in docs/switch.md, "The rounding hash") -------------
KEY_CHUNK_MUL = 0x9E3779B97F4A7C15     # (job << 32 | chunk) times this: a bijection of 64-bit words
KEY_ELEMENT_MUL = 0xD1B54A32D192ED03   # element k adds k times this


@njit(inline="always")
def _mix64(z):
    # splitmix64 finaliser: a counter-based 64-bit integer hash (a switch's random-number extern)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(inline="always")
def _round_key0(seed, job, chunk):
    # the key of element 0 of a round; element k's key is key0 + k * KEY_ELEMENT_MUL (mod 2**64)
    return (np.uint64(seed) << np.uint64(32)) ^ (((np.uint64(job) << np.uint64(32)) | np.uint64(chunk))
                                                 * np.uint64(KEY_CHUNK_MUL))


@njit(cache=True)
def nc_reencode_one(v, seed, job, chunk, k):
    """The code the switch writes for register sum ``v``, element ``k`` of job ``job``'s round
    ``chunk`` under ``--seed`` ``seed``: the specified rounding, for test vectors and other
    implementations."""
    return _nc_reencode(np.int64(v), _round_key0(seed, job, chunk) + np.uint64(k) * np.uint64(KEY_ELEMENT_MUL))


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


_result_type = njit(inline="always")(result_type)   # ina.wire.result_type, the one rule of result widths


@njit(inline="always")
def _write_result(dp, s, j):
    """Set s's result packet into its results row (header, then the payload of the result type)."""
    results = dp.results
    m = dp.sets[s]
    job = dp.jobs[j]
    E = job.elements
    pt = m.ptype
    out_pt = _result_type(pt, job.raw != 0, dp.register_bits)
    flags = F_RAW if (out_pt != P_NC8 and pt != P_NONE) else 0
    o = m.overflow != 0
    for b in range(HDR):
        results[s, b] = 0
    results[s, O_VERSION] = VERSION
    results[s, O_MSG] = RESULT
    wr16(results, s, O_JOB, j)
    wr16(results, s, O_RANK, SWITCH_RANK)
    pool = (s // 2 - job.slot_lo) * job.shards + job.shard
    wr16(results, s, O_SLOT, pool | ((s & 1) << 15))
    results[s, O_CODEC] = np.uint8(m.codec)
    results[s, O_PTYPE] = np.uint8(out_pt)
    wr16(results, s, O_COUNT, m.nvalid)
    wr16(results, s, O_EXP, m.maxexp & 0xFFFF)
    c = m.round_chunk
    results[s, O_CHUNK] = np.uint8((c >> 24) & 0xFF)
    results[s, O_CHUNK + 1] = np.uint8((c >> 16) & 0xFF)
    results[s, O_CHUNK + 2] = np.uint8((c >> 8) & 0xFF)
    results[s, O_CHUNK + 3] = np.uint8(c & 0xFF)
    regs = dp.regs
    if out_pt == P_NC8:
        key0 = _round_key0(dp.seed, j, c)
        for k in range(E):
            results[s, HDR + k] = _nc_reencode(regs[s, k], key0 + np.uint64(k) * np.uint64(KEY_ELEMENT_MUL))
    elif out_pt == P_INT64:
        for k in range(E):
            v = regs[s, k]
            for b in range(8):
                results[s, HDR + 8 * k + b] = np.uint8((v >> (56 - 8 * b)) & 0xFF)
    elif out_pt == P_INT32:                           # narrower than the registers: clamp, flag
        hi = np.int64(0x7FFFFFFF)
        lo = -hi - 1
        words = results[s, HDR: HDR + 4 * E].view(np.uint32)       # big-endian words, written whole
        mn = np.int64(0)
        mx = np.int64(0)
        for k in range(E):                            # vectorisable: clamp, bswap, and two witnesses
            v = regs[s, k]
            mn = min(mn, v)
            mx = max(mx, v)
            words[k] = bswap32(np.uint32(min(max(v, lo), hi) & 0xFFFFFFFF))
        o |= mn < lo or mx > hi
    elif out_pt == P_INT8N:                           # narrower than the registers: clamp, flag
        w = payload_width(out_pt)
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
    m.result_len = HDR + payload_width(out_pt) * E
    if m.sparse != 0:            # the min of the round's announcements: every worker learns the next round
        flags |= F_SPARSE
        nxt = (c + m.next_dist) % job.chunk_modulus
        for b in range(4):
            results[s, m.result_len + b] = np.uint8((nxt >> (24 - 8 * b)) & 0xFF)
        m.result_len += TRL
    wr16(results, s, O_FLAGS, flags)


@njit(inline="always")
def counts_against_group(job, buf, i):
    """Whether the replay that answers packet ``i`` of the burst ``buf`` counts against ``job``'s multicast
    group (``dp.delivered`` of the rank's address, judged by multicast.py): the job has a group and the
    resend does not say GROUP_SEEN (its rank got results by the group)."""
    return job.group_addr >= 0 and (rd16(buf, i, O_FLAGS) & F_GROUP_SEEN) == 0


@njit(cache=True)
def harvest(dp, buf, n):
    """Write completed slots' result packets into their shadow-copy rows; plan the transmissions
    (``buf``: the burst's packets, for the flags of the resends replayed).

    Returns the number of planned transmissions (dp.tx[:m]): per completed slot, one to the job's
    multicast group where it has one, else a copy to every worker of the job; a unicast per replay
    (negative length: the tx stage sets its REPLAY flag on a copy of the stored row). The plan is
    grouped by destination (a stable counting sort by worker address: each worker's results keep their
    order), so that a burst's results for one worker are one run, which the tx stage sends as one GSO
    message.
    """
    pkts, jobs, sets, tx, counters, delivered = dp.pkts, dp.jobs, dp.sets, dp.tx, dp.counters, dp.delivered
    m = 0
    for i in range(n):
        p = pkts[i]
        if p.action != Action.HARVEST and p.action != Action.REPLAY:
            continue
        s = p.set_id
        job = jobs[p.job]
        if p.action == Action.HARVEST:
            counters[C_HARVESTED] += 1
            _write_result(dp, s, p.job)
            if job.group_addr >= 0:               # IP multicast: once, to the job's group (multicast.py)
                counters[C_MULTICAST] += 1
                delivered[job.group_addr] += 1
                m = _plan(tx, m, s, sets[s].result_len, job.group_addr)
            else:
                for w in range(job.n_workers):    # a unicast copy per worker
                    m = _plan(tx, m, s, sets[s].result_len, job.addr_base + w)
        else:
            counters[C_REPLAYS] += 1
            if counts_against_group(job, buf, i):        # a replay of a result multicast: the group missed this rank?
                delivered[job.addr_base + p.rank] += 1
            m = _plan(tx, m, s, -sets[s].result_len, job.addr_base + p.rank)
    _group_by_destination(tx, dp.tx_order, dp.tx_bins, m)
    return m


@njit(inline="always")
def _plan(tx, m, s, length, addr):
    """Plan transmission m: set ``s``'s stored result row, ``length`` bytes (negative: a replay), to
    address index ``addr``; returns m + 1."""
    t = tx[m]
    t.set_id = s
    t.length = length
    t.addr = addr
    return m + 1


@njit(inline="always")
def _group_by_destination(tx, tmp, bins, m):
    """Stable counting sort of tx[:m] by address index (bins: one counter per index, plus one)."""
    if m < 2:
        return
    lo = tx[0].addr
    hi = lo
    for i in range(m):
        lo = min(lo, tx[i].addr)
        hi = max(hi, tx[i].addr)
    if lo == hi:
        return
    for a in range(hi - lo + 2):
        bins[a] = 0
    for i in range(m):
        bins[tx[i].addr - lo + 1] += 1
    for a in range(1, hi - lo + 2):
        bins[a] += bins[a - 1]
    for i in range(m):
        k = tx[i].addr - lo
        tmp[bins[k]] = tx[i]
        bins[k] += 1
    for i in range(m):
        tx[i] = tmp[i]
