"""The switch's data plane: numba kernels over a burst of packets, integer arithmetic only.

Three kernels, one per pipeline stage that touches packet bytes (see pipeline.py for the stage list):

* :func:`parse`     validate every header against the job table; give each packet a :class:`Verdict`;
* :func:`aggregate` the ALU: per packet, the SwitchML slot protocol and the integer adds;
* :func:`harvest`   completed slots: write the result packet into the slot's shadow-copy row and
                    plan its multicast (and the unicast replays of retransmissions).

Each kernel takes the switch's whole data-plane state as one object, :class:`DataPlane`: the
registers, the per-set metadata, the job table, the counters and the burst's scratch. It is a
named tuple of numpy arrays, most of them structured (one record per set, per job, per packet,
per transmission, with named fields), so the kernels read ``dp.sets[s].round_chunk``. The switch
calls the kernels through :func:`bind` (compiled entry points, no per-call type dispatch), which
makes a call cheaper than the positional arrays it replaces (docs/architecture.md has the numbers).

Nothing here sees a float: natural-compression codes become integers by a shift
(code k -> 2**(k-1)), sums are re-encoded by an integer log2 and an integer random comparison.
tests/test_switch.py checks the compiled LLVM IR of these kernels for floating-point instructions.
"""
from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import numba
import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

from ina.wire import (HEADER_SIZE, MAX_WORKERS, OFFSET, SWITCH_RANK, TRAILER_SIZE, VERSION, Flag, MsgType, PayloadType,
                      chunk_newer, result_type, slot_of_chunk, sparse_next_ok)

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
F_SPARSE = int(Flag.SPARSE)
TRL = TRAILER_SIZE
P_NONE, P_NC8, P_INT32, P_INT64, P_INT8 = (int(PayloadType.NONE), int(PayloadType.NC8), int(PayloadType.INT32),
                                           int(PayloadType.INT64), int(PayloadType.INT8))
P_INT8N = int(PayloadType.INT8_NARROW)
P_MAX = max(int(t) for t in PayloadType)


# --- verdicts (parse, and aggregate's protocol drops) and actions (aggregate) -----------------------
class Verdict(IntEnum):
    """What the pipeline decides for a packet: OK, or the drop reason it is counted under
    (the counter of the same name in lower case)."""
    OK = 0
    TRUNCATED = 1              # shorter than a header, or cut by the receive buffer
    BAD_VERSION = 2
    BAD_MSG_TYPE = 3           # not a DATA packet
    BAD_PAYLOAD_TYPE = 4
    BAD_LENGTH = 5             # length does not match the job's fixed chunk for this payload type
    BAD_COUNT = 6              # count larger than the job's elements per packet
    UNKNOWN_JOB = 7
    UNKNOWN_WORKER = 8         # rank >= the job's worker count
    SLOT_OUT_OF_RANGE = 9      # pool index >= the job's slots (or one of another shard)
    SLOT_CHUNK_MISMATCH = 10   # pool index / shadow set do not follow from the chunk id (or id >= chunk modulus)
    PAYLOAD_TYPE_MISMATCH = 11  # differs from the slot's current round
    STALE = 12                 # chunk older than the slot's round in serial-number order (late duplicate)
    SLOT_BUSY = 13             # newer chunk while the slot's round is incomplete (protocol violation)
    RETRANSMIT_PENDING = 14    # retransmission while the round is still waiting for other workers
    FOREIGN_SOURCE = 15        # source address is not the one the rank joined from (checked last in parse)
    BAD_NEXT = 16              # sparse packet whose `next` is not an odd number of its stream's steps ahead


class Action(IntEnum):
    """What aggregate did with a packet that passed parsing (a dropped packet's action is its verdict)."""
    ABSORBED = 100   # added into the registers
    HARVEST = 101    # completed the slot
    REPLAY = 102     # retransmission to a completed slot: unicast the stored result


DROP_REASONS = tuple(v.name.lower() for v in Verdict)      # index = verdict; "ok" first
N_REASONS = len(DROP_REASONS)
COUNTERS = DROP_REASONS + ("overflow", "harvested", "replays", "rx_packets", "rx_bytes", "tx_packets", "tx_bytes",
                           "aborts_sent")
C = {name: i for i, name in enumerate(COUNTERS)}
C_OVERFLOW, C_HARVESTED, C_REPLAYS = C["overflow"], C["harvested"], C["replays"]
C_RX_PACKETS, C_RX_BYTES = C["rx_packets"], C["rx_bytes"]

# --- the state's records ---------------------------------------------------------------------------
MAX_JOBS = 1 << 16
# one register set (index = slot * 2 + shadow copy): the slot protocol's metadata
SET = np.dtype([("round_chunk", np.int64),   # the chunk id of the round it holds (-1: none yet)
                ("bitmap", np.uint64),       # workers whose packet of this round is in
                ("count", np.int64),         # how many
                ("maxexp", np.int64),        # max exponent of the round's packets
                ("ptype", np.int64),         # the round's payload type
                ("codec", np.int64),         # the round's codec id (echoed in the result)
                ("nvalid", np.int64),        # max count of the round's packets
                ("result_len", np.int64),    # bytes of the result packet in its results row
                ("next_dist", np.int64),     # sparse rounds: min over the packets of (next - chunk) mod M
                ("complete", np.uint8),      # every worker's packet is in
                ("overflow", np.uint8),      # a register saturated in this round
                ("sparse", np.uint8)], align=True)   # a packet of the round had the SPARSE flag
# one job-table entry, derived from a pipeline.Job record (Job.table_row): the fields of the same names.
# pool_slots is the job's whole pool (pool indices 0..pool_slots-1 in packets); with --cores N the pool
# is sharded: pool index p lives in shard p % shards at local slot slot_lo + p // shards.
# chunk_modulus: ina.wire.chunk_modulus(pool_slots), the job's chunk id space (ids wrap to 0 there).
JOB = np.dtype([(name, np.int64) for name in ("active", "n_workers", "slot_lo", "pool_slots", "elements", "raw",
                                              "addr_base", "shards", "shard", "chunk_modulus")])
# one packet of the burst: what parse and aggregate decided
PKT = np.dtype([("verdict", np.int64), ("set_id", np.int64), ("rank", np.int64), ("job", np.int64),
                ("action", np.int64)])
# one planned transmission: results row, length (negative: a replay), worker address index
TX = np.dtype([("set_id", np.int64), ("length", np.int64), ("addr", np.int64)])


class DataPlane(NamedTuple):
    """The switch's data-plane state: the one object every kernel takes."""
    regs: np.ndarray       # (sets, elements) int64 registers
    sets: np.ndarray       # (sets,) SET: per-set metadata
    results: np.ndarray    # (sets, stride) uint8: each set's result packet (the shadow copy replays read)
    jobs: np.ndarray       # (MAX_JOBS,) JOB: the job table
    counters: np.ndarray   # (len(COUNTERS),) int64
    pkts: np.ndarray       # (burst,) PKT: the current burst's verdicts and actions
    vals: np.ndarray       # (elements,) int64: the ALU's decoded chunk
    tx: np.ndarray         # (burst * MAX_WORKERS,) TX: the transmissions harvest planned, by destination
    tx_order: np.ndarray   # (burst * MAX_WORKERS,) TX: harvest's scratch for grouping the plan by destination
    tx_bins: np.ndarray    # (peers + 1,) int64: harvest's scratch, planned transmissions per destination
    peers: np.ndarray      # (worker addresses,) int64: source_key of the address each job's rank joined from
    src: np.ndarray        # (burst,) int64: source_key of each packet of the current burst
    register_bits: int     # 32 or 64
    seed: int              # of the stochastic re-encoding

    @classmethod
    def allocate(cls, slots: int, elements: int, burst: int, stride: int, register_bits: int, seed: int,
                 peers: int) -> "DataPlane":
        """``burst``: the most packets one pass hands the kernels (they do not check bounds: a pass of
        more packets than ``burst`` would write beyond ``pkts``, ``src`` and ``tx``)."""
        sets = np.zeros(2 * slots, SET)
        sets["round_chunk"] = -1
        return cls(regs=np.zeros((2 * slots, elements), np.int64), sets=sets,
                   results=np.zeros((2 * slots, stride), np.uint8), jobs=np.zeros(MAX_JOBS, JOB),
                   counters=np.zeros(len(COUNTERS), np.int64), pkts=np.zeros(burst, PKT),
                   vals=np.zeros(elements, np.int64), tx=np.zeros(burst * MAX_WORKERS, TX),
                   tx_order=np.zeros(burst * MAX_WORKERS, TX), tx_bins=np.zeros(peers + 1, np.int64),
                   peers=np.full(peers, -1, np.int64), src=np.zeros(burst, np.int64),
                   register_bits=int(register_bits), seed=int(seed))

    def reset_sets(self, lo: int, slots: int) -> None:
        """Forget the rounds of slots lo..lo+slots-1 (both sets): a new job starts from chunk 0."""
        s = self.sets[2 * lo: 2 * (lo + slots)]
        s["round_chunk"] = -1
        for name in ("complete", "bitmap", "count", "overflow", "sparse"):
            s[name] = 0


def source_key(ip: int, port: int):
    """A UDP source address as one integer: IPv4 address (host order) << 16 | port (numpy arrays too)."""
    return (ip << 16) | port


SOCKADDR_PORT, SOCKADDR_ADDR = 2, 4       # byte offsets in a struct sockaddr_in (network byte order)


def bind(kernel, *example_args):
    """``kernel`` compiled (or loaded from numba's cache) for the types of ``example_args``, as its
    machine-code entry point. Calling it skips numba's per-call type dispatch, which for a named
    tuple costs more than a small burst's work; it does not check the types again, so every call
    must pass arguments of exactly the example's types (the switch's own state and buffers)."""
    return kernel.compile(tuple(numba.typeof(a) for a in example_args))


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


@njit(inline="always")
def _check_header(jobs, peers, src, buf, lens, i):
    """The verdict of packet i, and for an OK packet its job, rank and register set."""
    ln = lens[i]
    if ln < HDR or ln > buf.shape[1]:
        return Verdict.TRUNCATED, 0, 0, 0
    if buf[i, O_VERSION] != VERSION:
        return Verdict.BAD_VERSION, 0, 0, 0
    if buf[i, O_MSG] != DATA:
        return Verdict.BAD_MSG_TYPE, 0, 0, 0
    pt = np.int64(buf[i, O_PTYPE])
    if pt > P_MAX:
        return Verdict.BAD_PAYLOAD_TYPE, 0, 0, 0
    j = _rd16(buf, i, O_JOB)
    job = jobs[j]
    if job.active == 0:
        return Verdict.UNKNOWN_JOB, 0, 0, 0
    sparse = (_rd16(buf, i, O_FLAGS) & F_SPARSE) != 0
    if ln != HDR + _width(pt) * job.elements + (TRL if sparse else 0):
        return Verdict.BAD_LENGTH, 0, 0, 0
    cnt = _rd16(buf, i, O_COUNT)
    if cnt > job.elements or (pt == P_NONE and cnt != 0):
        return Verdict.BAD_COUNT, 0, 0, 0
    r = _rd16(buf, i, O_RANK)
    s = _rd16(buf, i, O_SLOT)
    pool = s & 0x7FFF
    shadow = s >> 15
    c = _rd32(buf, i, O_CHUNK)
    if r >= job.n_workers:
        return Verdict.UNKNOWN_WORKER, 0, 0, 0
    if pool >= job.pool_slots:
        return Verdict.SLOT_OUT_OF_RANGE, 0, 0, 0
    if c >= job.chunk_modulus or _slot_of_chunk(c, job.pool_slots) != s:
        return Verdict.SLOT_CHUNK_MISMATCH, 0, 0, 0
    if pool % job.shards != job.shard:
        return Verdict.SLOT_OUT_OF_RANGE, 0, 0, 0             # a pool index of another shard
    if sparse and not _sparse_next_ok(c, _rd32(buf, i, ln - TRL), job.pool_slots, job.chunk_modulus):
        return Verdict.BAD_NEXT, 0, 0, 0
    if src[i] != peers[job.addr_base + r]:
        return Verdict.FOREIGN_SOURCE, 0, 0, 0
    return Verdict.OK, j, r, (job.slot_lo + pool // job.shards) * 2 + shadow


@njit(cache=True)
def rx_account(dp, srcs, lens, n, stride):
    """The rx stage's bookkeeping of a received burst: each packet's source_key (from the receive
    ring's sockaddr_in records, as bytes: ``srcs`` is (burst, 16) uint8) into dp.src, and the
    rx_packets / rx_bytes counters (a truncated datagram counts ``stride`` bytes)."""
    src, counters = dp.src, dp.counters
    nbytes = np.int64(0)
    for i in range(n):
        src[i] = (_rd32(srcs, i, SOCKADDR_ADDR) << 16) | _rd16(srcs, i, SOCKADDR_PORT)
        nbytes += min(lens[i], stride)
    counters[C_RX_PACKETS] += n
    counters[C_RX_BYTES] += nbytes


@njit(cache=True)
def parse(dp, buf, lens, n):
    """Validate headers against the job table: dp.pkts[i].verdict = OK or a drop reason."""
    jobs, pkts, counters, peers, src = dp.jobs, dp.pkts, dp.counters, dp.peers, dp.src   # taken out once
    for i in range(n):
        v, j, r, s = _check_header(jobs, peers, src, buf, lens, i)
        p = pkts[i]
        p.verdict = v
        if v == Verdict.OK:
            p.job = j
            p.rank = r
            p.set_id = s
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
def _harvest_pending(pkts, i, s):
    # did an earlier packet of this burst complete set s (its harvest runs after the whole burst)?
    for k in range(i):
        if pkts[k].action == Action.HARVEST and pkts[k].set_id == s:
            return True
    return False


_slot_of_chunk = njit(inline="always")(slot_of_chunk)   # ina.wire's rules of chunk ids, shared with clients
_chunk_newer = njit(inline="always")(chunk_newer)
_sparse_next_ok = njit(inline="always")(sparse_next_ok)     # ina.wire's rule of sparse rounds


@njit(inline="always")
def _protocol(sets, pkts, i, c, bit, modulus):
    """The slot protocol for packet i (chunk c, worker bit; chunk ids modulo ``modulus``): (its Action,
    or the Verdict it is dropped with; whether it is the first packet of a new round)."""
    m = sets[pkts[i].set_id]
    if c == m.round_chunk:
        if m.bitmap & bit:
            if m.complete:
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
        c = _rd32(buf, i, O_CHUNK)
        pt = np.int64(buf[i, O_PTYPE])
        job = jobs[p.job]
        a, first = _protocol(sets, pkts, i, c, bit, job.chunk_modulus)
        sparse = (_rd16(buf, i, O_FLAGS) & F_SPARSE) != 0
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
        e = _rd16(buf, i, O_EXP)
        if e >= 0x8000:
            e -= 0x10000
        cnt = _rd16(buf, i, O_COUNT)
        dist = job.pool_slots        # a dense packet's next round is the stream's next chunk
        if sparse:
            dist = (_rd32(buf, i, HDR + _width(pt) * job.elements) - c) % job.chunk_modulus
        if first:
            m.sparse = np.uint8(1) if sparse else np.uint8(0)
            m.next_dist = dist
            m.round_chunk = c
            m.bitmap = np.uint64(0)
            m.count = 0
            m.complete = 0
            m.overflow = 0
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
        # decode the chunk's codes into signed integers (scratch row vals), checking they are in range
        o = False
        if pt == P_NC8:
            mx_shift = np.int64(0)
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
        else:   # P_NONE (exponent round): no payload
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
        elif pt != P_NONE:            # a header-only packet (a sparse round's zero chunk) adds nothing
            acc = np.int64(0)
            mn = np.int64(0)
            mxv = np.int64(0)
            for k in range(E):                                  # vectorisable: add + overflow witnesses
                x = regs[s, k]
                y = vals[k]
                r = x + y
                acc |= (x ^ r) & (y ^ r)
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
            m.overflow = 1
            counters[C_OVERFLOW] += 1
        m.bitmap |= bit
        m.count += 1
        if m.count >= job.n_workers:
            m.complete = 1
            p.action = Action.HARVEST


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
    _wr16(results, s, O_JOB, j)
    _wr16(results, s, O_RANK, SWITCH_RANK)
    pool = (s // 2 - job.slot_lo) * job.shards + job.shard
    _wr16(results, s, O_SLOT, pool | ((s & 1) << 15))
    results[s, O_CODEC] = np.uint8(m.codec)
    results[s, O_PTYPE] = np.uint8(out_pt)
    _wr16(results, s, O_COUNT, m.nvalid)
    _wr16(results, s, O_EXP, m.maxexp & 0xFFFF)
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
    m.result_len = HDR + _width(out_pt) * E
    if m.sparse != 0:            # the min of the round's announcements: every worker learns the next round
        flags |= F_SPARSE
        nxt = (c + m.next_dist) % job.chunk_modulus
        for b in range(4):
            results[s, m.result_len + b] = np.uint8((nxt >> (24 - 8 * b)) & 0xFF)
        m.result_len += TRL
    _wr16(results, s, O_FLAGS, flags)


@njit(cache=True)
def harvest(dp, n):
    """Write completed slots' result packets into their shadow-copy rows; plan the transmissions.

    Returns the number of planned transmissions (dp.tx[:m]): a multicast to every worker of the
    job per completed slot, a unicast per replay (negative length: the tx stage sets its REPLAY flag
    on a copy of the stored row). The plan is grouped by destination (a stable counting sort by
    worker address: each worker's results keep their order), so that a burst's results for one
    worker are one run, which the tx stage sends as one GSO message.
    """
    pkts, jobs, sets, tx, counters = dp.pkts, dp.jobs, dp.sets, dp.tx, dp.counters    # taken out once
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
            for w in range(job.n_workers):        # multicast
                t = tx[m]
                t.set_id = s
                t.length = sets[s].result_len
                t.addr = job.addr_base + w
                m += 1
        else:
            counters[C_REPLAYS] += 1
            t = tx[m]
            t.set_id = s
            t.length = -sets[s].result_len
            t.addr = job.addr_base + p.rank
            m += 1
    _group_by_destination(tx, dp.tx_order, dp.tx_bins, m)
    return m


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
