"""The INA wire format, declared once.

Every packet is one UDP datagram: a fixed 20-byte header followed by a fixed-length chunk of
``elements`` codes (the job's elements per packet), all in network byte order. Everything else in
the project derives from :data:`HEADER` and :data:`PAYLOAD_TYPES` below:

* the numpy structured dtype :data:`HEADER_DTYPE` that the fast path lays over whole bursts,
* the byte offsets (:data:`OFFSET`) that the numba kernels of the switch read,
* the scapy layer :class:`INA` (built in :mod:`ina.dissect`) so that ``rdpcap()`` dissects captures.

``docs/wire-format.md`` documents the same table byte by byte.
"""
from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

import numpy as np

VERSION = 1
DEFAULT_PORT = 9999          # UDP port of the switch's data plane (and the scapy binding)
MAX_WORKERS = 64             # the worker bitmap is one 64-bit register


class MsgType(enum.IntEnum):
    DATA = 1      # worker -> switch: a chunk of codes for one slot
    RESULT = 2    # switch -> worker(s): the aggregate of a completed slot (to every worker: one IP multicast
    #               to the job's group (multicast_group) or a unicast copy each; a replay: unicast)
    ABORT = 3     # switch -> workers: the job was torn down (rank field names the worker that left)


class Flag(enum.IntFlag):
    RETRANSMIT = 0x0001   # worker: this chunk was sent before (timeout)
    OVERFLOW = 0x0002     # switch: a register saturated while aggregating this slot; the result is not exact
    REPLAY = 0x0004       # switch: unicast replay of an already completed slot to a retransmitting worker
    RAW_SUM = 0x0008      # switch: payload is the raw integer register sums (not re-encoded codes)
    SPARSE = 0x0010       # sparse block streaming: the 4-byte SPARSE_TRAILER (`next`) follows the payload
    TAIL = 0x0020         # worker: the last chunk of a dense stream (a negotiation packet is one): nothing sent
    #                       after it shows its loss, so the worker sends it twice and the switch multicasts
    #                       its result twice (ina.recovery, "tail copies"); a second copy is a duplicate
    LATE = 0x0040         # worker: a first send that waited for a replay of a result this worker lost (its peers
    #                       sent the chunk long before and may have resent it: the switch replays none of their
    #                       first resends that crossed the round's result; docs/switch.md)
    GROUP_SEEN = 0x0080   # worker: a resend from a rank that got results by its job's multicast group in this
    #                       stream or its previous one: its replay does not say the group misses the rank (switch_model/multicast.py)


class PayloadType(enum.IntEnum):
    NONE = 0      # no payload (exponent negotiation packets)
    NC8 = 1       # uint8 natural-compression code: bit 7 sign, bits 0-6 exponent code (0 = zero)
    INT32 = 2     # big-endian two's complement int32 (block floating point, raw 32-bit sums)
    INT64 = 3     # big-endian two's complement int64 (raw 64-bit sums)
    INT8 = 4      # two's complement int8 (linear small-integer codes: dithering levels, ternary)
    INT8_NARROW = 5  # int8 codes whose sum over the job's workers fits int8 (the sender guarantees
    #                  n x max|code| <= 127): the switch returns int8 sums, 1 byte per element down


#: numpy dtype of one payload element, per payload type (network byte order)
PAYLOAD_DTYPE = {
    PayloadType.NONE: np.dtype("u1"),
    PayloadType.NC8: np.dtype("u1"),
    PayloadType.INT32: np.dtype(">i4"),
    PayloadType.INT64: np.dtype(">i8"),
    PayloadType.INT8: np.dtype("i1"),
    PayloadType.INT8_NARROW: np.dtype("i1"),
}
PAYLOAD_WIDTH = {t: (0 if t == PayloadType.NONE else d.itemsize) for t, d in PAYLOAD_DTYPE.items()}

_NONE, _NC8, _INT32, _INT64, _INT8N = (int(PayloadType.NONE), int(PayloadType.NC8), int(PayloadType.INT32),
                                       int(PayloadType.INT64), int(PayloadType.INT8_NARROW))


# --- chunk ids: the slot mapping and the order, the one rule client and switch share ---------------
# A job's chunk ids count modulo its chunk modulus M, the largest multiple of 2S below 2**32 (S: the
# job's pool slots), so that chunk c and chunk c + S (mod M) always use the same pool index and the
# other shadow set, across the wrap too (M = 2**32 when S is a power of two). Ids are ordered in
# serial-number arithmetic (RFC 1982) modulo M. Plain integer code: the switch's kernels compile it.

def chunk_modulus(pool_slots):
    """M: the chunk ids of a job with ``pool_slots`` slots are 0..M-1, and M - 1 is followed by 0."""
    return (1 << 32) - (1 << 32) % (2 * pool_slots)


def slot_of_chunk(chunk, pool_slots):
    """The slot field of chunk ``chunk`` (0 <= chunk < M): pool index chunk % S, shadow bit (chunk // S) % 2
    (numpy arrays too)."""
    return (chunk % pool_slots) | (((chunk // pool_slots) & 1) << 15)


def shard_of_slot(slot, shards):
    """The switch shard (``--cores``) that serves slot field ``slot``: pool index (the low 15 bits) % shards,
    at UDP port ``port + shard`` (switch_model/shards.py; numpy arrays too). The client sends by it, the
    switch's parse drops a packet of another shard by it."""
    return (slot & POOL_INDEX_MASK) % shards


def chunk_newer(chunk, than, modulus):
    """Whether chunk id ``chunk`` comes after ``than`` in serial-number arithmetic modulo ``modulus``:
    (chunk - than) mod M in 1 .. M/2 - 1."""
    d = (chunk - than) % modulus
    return 0 < d < modulus // 2


# --- sparse streaming: the rounds of a stream, the one rule client and switch share -----------------
# The chunks of a job with S pool slots form S streams (chunk ids c, c + S, c + 2S, ... share pool index
# c % S). A sparse packet of chunk c announces ``next``, the chunk id of its sender's next round in the
# stream; the round's result carries the min over the round's packets, so rounds skip the chunks that
# are zero at every worker. Consecutive rounds of a stream are an odd number of steps S apart, so that
# they alternate between the slot's two shadow sets as dense chunks do (the stored result of one round
# survives while the next aggregates, for replays).

def sparse_next_ok(chunk, nxt, pool_slots, modulus):
    """Whether ``nxt`` is a valid announcement in a sparse packet of chunk ``chunk``: newer, in the same
    stream and an odd number of steps ``pool_slots`` ahead (modulo ``modulus``)."""
    d = (nxt - chunk) % modulus        # & rather than and: numpy arrays too
    return (nxt < modulus) & (d > 0) & (d < modulus // 2) & (d % pool_slots == 0) & ((d // pool_slots) % 2 == 1)


def sparse_announce(chunk, nonzero, pool_slots):
    """The ``next`` a sender announces in chunk ``chunk``'s packet, as a chunk position (not wrapped):
    ``nonzero``, the position of its next non-zero chunk of the stream (or the stream's first position
    past the tensor), if it is an odd number of steps ahead, else the position one step before it
    (a round where this sender is zero: it sends a header-only packet there)."""
    steps = (nonzero - chunk) // pool_slots
    return nonzero - pool_slots * (1 - steps % 2)         # plain arithmetic: numpy arrays too


MULTICAST_PREFIX = 239         # a job's results group: 239.<switch byte>.<job high>.<job low> (administratively scoped)
MULTICAST_PORT_BASE = 16384    # ... at UDP port 16384 + (job + switch port) % 16384 (below Linux's ephemeral range)


def multicast_group(job: int, switch: tuple[str, int]) -> tuple[str, int]:
    """The IP multicast group and UDP port job ``job``'s results are sent to by the switch at ``switch``
    (its IPv4 address as the workers reach it, its UDP port) when every worker of the job joined it: the
    one rule, used by the client (join, its data socket's port) and the switch (send).

    The group's second byte is the XOR of the switch address's four bytes, so two switches in one /24
    subnet (one layer-2 fabric) never share a group, nor do two jobs of one switch; two switches on one
    host (one address) differ in the port. Beyond that (fabrics larger than a /24) two switches may
    share a group for the same job id; the workers then drop what does not come from their switch
    (``ina.multicast.accept_only``)."""
    job = int(job)
    if not 0 <= job <= 0xFFFF:
        raise ValueError(f"job id {job} out of range 0..65535 (16-bit job field)")
    ip, port = switch
    a, b, c, d = ipaddress.IPv4Address(ip).packed
    group = f"{MULTICAST_PREFIX}.{a ^ b ^ c ^ d}.{job >> 8}.{job & 0xFF}"
    return group, MULTICAST_PORT_BASE + (job + int(port)) % 16384


def max_packet_size(elements: int) -> int:
    """The longest packet of a job with ``elements`` per packet: INT64 sums and the sparse trailer."""
    return HEADER_SIZE + 8 * elements + TRAILER_SIZE


def result_type(payload_type: int, raw: bool, register_bits: int) -> int:
    """The payload type a slot's result comes back in: the one rule of result widths.

    NC8 codes come back re-encoded as NC8, or (``raw``: the job asked for raw sums) as the registers'
    integers, int64 or int32 by ``register_bits``; INT8_NARROW codes (the sender guarantees that the
    sum fits int8) as int8; every other integer code as int32 sums; no payload as no payload.
    Plain integer code, so that the switch's numba kernels compile it too (``njit(result_type)``).
    """
    if payload_type == _NONE:
        return _NONE
    if payload_type == _NC8:
        if not raw:
            return _NC8
        return _INT64 if register_bits == 64 else _INT32
    if payload_type == _INT8N:
        return _INT8N
    return _INT32


@dataclass(frozen=True)
class Field:
    name: str
    dtype: str           # numpy type string, network byte order
    doc: str
    bits: tuple = ()     # optional sub-fields (name, width) from the most significant bit down


#: The header, in order. The single declaration of the format.
HEADER: tuple[Field, ...] = (
    Field("version", "u1", "protocol version, always 1"),
    Field("msg_type", "u1", "MsgType: 1 DATA, 2 RESULT, 3 ABORT"),
    Field("flags", ">u2", "Flag bits: 0x1 RETRANSMIT, 0x2 OVERFLOW, 0x4 REPLAY, 0x8 RAW_SUM, 0x10 SPARSE"),
    Field("job", ">u2", "job id, chosen by the workers and registered at the switch"),
    Field("rank", ">u2", "sending worker's rank; 0xFFFF in packets from the switch (ABORT: the rank that left)"),
    Field("slot", ">u2", "bit 15: shadow set (0/1); bits 0-14: pool index of the aggregator slot",
          bits=(("shadow", 1), ("pool_index", 15))),
    Field("codec", "u1", "codec wire id (ina.compression registry)"),
    Field("payload_type", "u1", "PayloadType of the elements that follow"),
    Field("count", ">u2", "valid elements in this chunk (the rest of the fixed-length chunk is zero padding)"),
    Field("exponent", ">i2", "exponent/scale field: the worker's max exponent; in results, the max over workers"),
    Field("chunk", ">u4", "packet id: chunk sequence number within the job, across allreduces, modulo "
          "chunk_modulus(slots)"),
)

#: What a packet with the SPARSE flag carries after its payload (payload NONE: right after the header).
SPARSE_TRAILER: tuple[Field, ...] = (
    Field("next", ">u4", "sparse streaming: chunk id of the sender's next round in this chunk's stream (its next "
          "non-zero chunk, or the one before it, see sparse_announce); in results, the min over the round's packets"),
)

HEADER_DTYPE = np.dtype([(f.name, f.dtype) for f in HEADER])
TRAILER_DTYPE = np.dtype([(f.name, f.dtype) for f in SPARSE_TRAILER])
TRAILER_SIZE = TRAILER_DTYPE.itemsize
HEADER_SIZE = HEADER_DTYPE.itemsize
OFFSET = {f.name: HEADER_DTYPE.fields[f.name][1] for f in HEADER}
SHADOW_BIT = 0x8000
POOL_INDEX_MASK = 0x7FFF
SWITCH_RANK = 0xFFFF

assert HEADER_SIZE == 20, HEADER_SIZE
assert TRAILER_SIZE == 4, TRAILER_SIZE


class WireError(ValueError):
    """Malformed or truncated bytes; the message names what was wrong."""


def slot_field(pool_index: int, shadow: int) -> int:
    if not 0 <= pool_index <= POOL_INDEX_MASK:
        raise WireError(f"pool index {pool_index} out of range 0..{POOL_INDEX_MASK}")
    return (int(shadow) & 1) << 15 | pool_index


def packet_size(payload_type: int, elements: int, sparse: bool = False) -> int:
    return HEADER_SIZE + PAYLOAD_WIDTH[PayloadType(payload_type)] * elements + (TRAILER_SIZE if sparse else 0)


def pack(*, msg_type: int, job: int, rank: int, pool_index: int = 0, shadow: int = 0, codec: int = 0,
         payload_type: int = PayloadType.NONE, count: int = 0, exponent: int = 0, chunk: int = 0,
         flags: int = 0, payload=None, elements: int | None = None, next: int | None = None) -> bytes:
    """One packet as bytes. ``payload`` is an array of codes; it is padded to ``elements``. ``next``
    (sparse streaming) sets the SPARSE flag and appends the trailer."""
    if next is not None:
        flags = int(flags) | Flag.SPARSE
    ptype = PayloadType(payload_type)
    hdr = np.zeros(1, HEADER_DTYPE)
    values = dict(version=VERSION, msg_type=int(msg_type), flags=int(flags), job=job, rank=rank,
                  slot=slot_field(pool_index, shadow), codec=codec, payload_type=int(ptype),
                  count=count, exponent=exponent, chunk=chunk)
    for k, v in values.items():
        hdr[k] = v
    if ptype == PayloadType.NONE:
        body = b""
    else:
        arr = np.asarray(payload if payload is not None else [], dtype=PAYLOAD_DTYPE[ptype])
        n = elements if elements is not None else arr.size
        if arr.size > n:
            raise WireError(f"payload has {arr.size} elements, more than the chunk's {n}")
        padded = np.zeros(n, PAYLOAD_DTYPE[ptype])
        padded[: arr.size] = arr
        body = padded.tobytes()
    if int(flags) & Flag.SPARSE:
        body += np.array([(0 if next is None else next,)], TRAILER_DTYPE).tobytes()
    return hdr.tobytes() + body


@dataclass
class Packet:
    """A parsed packet (slow path, one at a time; the switch parses whole bursts instead)."""
    version: int
    msg_type: MsgType
    flags: Flag
    job: int
    rank: int
    shadow: int
    pool_index: int
    codec: int
    payload_type: PayloadType
    count: int
    exponent: int
    chunk: int
    payload: np.ndarray
    next: int | None = None     # the SPARSE trailer's field (None without the SPARSE flag)


def unpack(data: bytes | memoryview) -> Packet:
    """Parse and validate one packet; raises :class:`WireError` naming what is wrong."""
    buf = memoryview(data)
    if len(buf) < HEADER_SIZE:
        raise WireError(f"truncated packet: {len(buf)} bytes, the header alone is {HEADER_SIZE}")
    h = np.frombuffer(buf[:HEADER_SIZE], HEADER_DTYPE)[0]
    if h["version"] != VERSION:
        raise WireError(f"unknown version {int(h['version'])} (expected {VERSION})")
    try:
        mtype = MsgType(int(h["msg_type"]))
    except ValueError:
        raise WireError(f"unknown msg_type {int(h['msg_type'])}") from None
    try:
        ptype = PayloadType(int(h["payload_type"]))
    except ValueError:
        raise WireError(f"unknown payload_type {int(h['payload_type'])}") from None
    end, nxt = len(buf), None
    if int(h["flags"]) & Flag.SPARSE:
        if end < HEADER_SIZE + TRAILER_SIZE:
            raise WireError(f"truncated packet: {end} bytes, the header and the SPARSE trailer are "
                            f"{HEADER_SIZE + TRAILER_SIZE}")
        end -= TRAILER_SIZE
        nxt = int(np.frombuffer(buf[end:], TRAILER_DTYPE)[0]["next"])
    body = end - HEADER_SIZE
    width = PAYLOAD_WIDTH[ptype]
    if width == 0:
        if body:
            raise WireError(f"payload_type NONE but {body} payload bytes follow")
        payload = np.zeros(0, np.uint8)
    else:
        if body % width:
            raise WireError(f"payload of {body} bytes is not a whole number of {width}-byte elements")
        payload = np.frombuffer(buf[HEADER_SIZE:end], PAYLOAD_DTYPE[ptype])
        if int(h["count"]) > payload.size:
            raise WireError(f"count {int(h['count'])} exceeds the {payload.size} elements carried")
    slot = int(h["slot"])
    return Packet(version=int(h["version"]), msg_type=mtype, flags=Flag(int(h["flags"])), job=int(h["job"]),
                  rank=int(h["rank"]), shadow=slot >> 15, pool_index=slot & POOL_INDEX_MASK,
                  codec=int(h["codec"]), payload_type=ptype, count=int(h["count"]),
                  exponent=int(h["exponent"]), chunk=int(h["chunk"]), payload=payload, next=nxt)


def header_view(burst: np.ndarray) -> np.ndarray:
    """Structured view of the headers of a burst buffer of shape (n, stride) uint8 (fast path)."""
    if burst.ndim != 2 or burst.dtype != np.uint8 or burst.shape[1] < HEADER_SIZE:
        raise WireError("a burst is a 2-D uint8 buffer with rows of at least one header")
    return burst[:, :HEADER_SIZE].view(HEADER_DTYPE)[:, 0]


def payload_view(burst: np.ndarray, payload_type: int, elements: int) -> np.ndarray:
    """(n, elements) view of the payloads of a burst, in the payload type's dtype."""
    ptype = PayloadType(payload_type)
    end = HEADER_SIZE + PAYLOAD_WIDTH[ptype] * elements
    if burst.shape[1] < end:
        raise WireError(f"burst rows of {burst.shape[1]} bytes cannot hold {elements} elements of {ptype.name}")
    return burst[:, HEADER_SIZE:end].view(PAYLOAD_DTYPE[ptype])
