"""The switch's data plane: its state, and the kernels of the rx and parse stages.

The data plane is three numba kernels over a burst of packets, one per pipeline stage that touches
packet bytes (see pipeline.py for the stage list), integer arithmetic only, each in its own module:

* :func:`parse` (here)              validate every header against the job table; give each packet
                                    a :class:`Verdict`;
* :func:`switch_model.alu.aggregate` the ALU: per packet, the SwitchML slot protocol and the
                                    integer adds;
* :func:`switch_model.harvest.harvest` completed slots: write the result packet into the slot's
                                    shadow-copy row and plan its multicast (and the unicast replays
                                    of retransmissions).

and :func:`rx_account`, the rx stage's bookkeeping. Each kernel takes the switch's whole data-plane
state as one object, :class:`DataPlane`: the registers, the per-set metadata, the job table, the
counters and the burst's scratch. It is a named tuple of numpy arrays, most of them structured (one
record per set, per job, per packet, per transmission, with named fields), so the kernels read
``dp.sets[s].round_chunk``. The switch calls the kernels through :func:`bind` (compiled entry
points, no per-call type dispatch), which makes a call cheaper than the positional arrays it
replaces (docs/architecture.md has the numbers). This module also holds what the stages share:
the header offsets, the records, and the byte readers and writers (:func:`rd16`, :func:`rd32`,
:func:`wr16`, :func:`payload_width`).

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

from ina.wire import (HEADER_SIZE, MAX_WORKERS, OFFSET, TRAILER_SIZE, VERSION, Flag, MsgType, PayloadType, shard_of_slot,
                      slot_of_chunk, sparse_next_ok)

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
F_RETRANSMIT = int(Flag.RETRANSMIT)
F_LATE = int(Flag.LATE)
F_GROUP_SEEN = int(Flag.GROUP_SEEN)
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
    RETRANSMIT_CROSSED = 17    # a rank's first resend of a round another rank's resend (or LATE packet) completed: it crossed
                               # the result's multicast (alu._protocol)


class Action(IntEnum):
    """What aggregate did with a packet that passed parsing (a dropped packet's action is its verdict)."""
    ABSORBED = 100   # added into the registers
    HARVEST = 101    # completed the slot
    REPLAY = 102     # retransmission to a completed slot: unicast the stored result


DROP_REASONS = tuple(v.name.lower() for v in Verdict)      # index = verdict; "ok" first
N_REASONS = len(DROP_REASONS)
COUNTERS = DROP_REASONS + ("overflow", "harvested", "replays", "rx_packets", "rx_bytes", "tx_packets", "tx_bytes",
                           "aborts_sent", "multicast_results",     # results sent once, to their job's group
                           "multicast_as_copies",   # group sends made a unicast copy per worker (egress impairments: see pipeline)
                           "multicast_fallbacks")   # jobs sent unicast copies after their group failed (multicast.py)
C = {name: i for i, name in enumerate(COUNTERS)}
C_OVERFLOW, C_HARVESTED, C_REPLAYS, C_MULTICAST = C["overflow"], C["harvested"], C["replays"], C["multicast_results"]
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
                ("sparse", np.uint8),        # a packet of the round had the SPARSE flag
                ("recovered", np.uint8),     # the packet that completed the round was a resend or a late first send
                ("resent", np.uint64)], align=True)  # workers that sent a resend (RETRANSMIT) of this round
# one job-table entry, derived from a pipeline.Job record (Job.table_row): the fields of the same names.
# pool_slots is the job's whole pool (pool indices 0..pool_slots-1 in packets); with --cores N the pool
# is sharded: pool index p lives in shard p % shards at local slot slot_lo + p // shards.
# chunk_modulus: ina.wire.chunk_modulus(pool_slots), the job's chunk id space (ids wrap to 0 there).
# group_addr: the address index of the job's multicast group (-1: a unicast copy per worker; multicast.py).
JOB = np.dtype([(name, np.int64) for name in ("active", "n_workers", "slot_lo", "pool_slots", "elements", "raw",
                                              "addr_base", "shards", "shard", "chunk_modulus", "group_addr")])
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
    delivered: np.ndarray  # (addresses,) int64: results multicast to each group address, replays sent to each
                           # worker address (multicast.py judges whether a job's group reaches its workers)
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
                   delivered=np.zeros(peers, np.int64),
                   register_bits=int(register_bits), seed=int(seed))

    def reset_sets(self, lo: int, slots: int) -> None:
        """Forget the rounds of slots lo..lo+slots-1 (both sets): a new job starts from chunk 0."""
        s = self.sets[2 * lo: 2 * (lo + slots)]
        s["round_chunk"] = -1
        for name in ("complete", "bitmap", "count", "overflow", "sparse", "recovered", "resent"):
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
def rd16(b, i, o):
    return (np.int64(b[i, o]) << 8) | np.int64(b[i, o + 1])


@njit(inline="always")
def rd32(b, i, o):
    return ((np.int64(b[i, o]) << 24) | (np.int64(b[i, o + 1]) << 16) | (np.int64(b[i, o + 2]) << 8)
            | np.int64(b[i, o + 3]))


@njit(inline="always")
def wr16(b, i, o, v):
    b[i, o] = np.uint8((v >> 8) & 0xFF)
    b[i, o + 1] = np.uint8(v & 0xFF)


@njit(inline="always")
def bswap32(u):
    """A uint32 with its bytes reversed: a big-endian int32 field read or written as a native word of
    a little-endian machine (x86_64, aarch64: ina/burst.py assumes them too). LLVM makes it one
    instruction, and vectorises it: the payload loops read and write whole words, not bytes."""
    return ((u >> np.uint32(24)) | ((u >> np.uint32(8)) & np.uint32(0xFF00))
            | ((u << np.uint32(8)) & np.uint32(0xFF0000)) | (u << np.uint32(24)))


@njit(inline="always")
def payload_width(ptype):
    if ptype == P_NC8 or ptype == P_INT8 or ptype == P_INT8N:
        return 1
    if ptype == P_INT32:
        return 4
    if ptype == P_INT64:
        return 8
    return 0


_slot_of_chunk = njit(inline="always")(slot_of_chunk)   # ina.wire's rules of chunk ids, shared with clients
_shard_of_slot = njit(inline="always")(shard_of_slot)   # ina.wire's rule of the shard serving a slot (the client sends by it)
_sparse_next_ok = njit(inline="always")(sparse_next_ok)     # ina.wire's rule of sparse rounds


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
    j = rd16(buf, i, O_JOB)
    job = jobs[j]
    if job.active == 0:
        return Verdict.UNKNOWN_JOB, 0, 0, 0
    sparse = (rd16(buf, i, O_FLAGS) & F_SPARSE) != 0
    if ln != HDR + payload_width(pt) * job.elements + (TRL if sparse else 0):
        return Verdict.BAD_LENGTH, 0, 0, 0
    cnt = rd16(buf, i, O_COUNT)
    if cnt > job.elements or (pt == P_NONE and cnt != 0):
        return Verdict.BAD_COUNT, 0, 0, 0
    r = rd16(buf, i, O_RANK)
    s = rd16(buf, i, O_SLOT)
    pool = s & 0x7FFF
    shadow = s >> 15
    c = rd32(buf, i, O_CHUNK)
    if r >= job.n_workers:
        return Verdict.UNKNOWN_WORKER, 0, 0, 0
    if pool >= job.pool_slots:
        return Verdict.SLOT_OUT_OF_RANGE, 0, 0, 0
    if c >= job.chunk_modulus or _slot_of_chunk(c, job.pool_slots) != s:
        return Verdict.SLOT_CHUNK_MISMATCH, 0, 0, 0
    if _shard_of_slot(s, job.shards) != job.shard:
        return Verdict.SLOT_OUT_OF_RANGE, 0, 0, 0             # a pool index of another shard
    if sparse and not _sparse_next_ok(c, rd32(buf, i, ln - TRL), job.pool_slots, job.chunk_modulus):
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
        src[i] = (rd32(srcs, i, SOCKADDR_ADDR) << 16) | rd16(srcs, i, SOCKADDR_PORT)
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
