"""The host-aggregator protocol, declared once (as :mod:`ina.wire` declares the switch's).

Codecs whose messages are variable-length (3lc, eaq, wgt) are summed by the switch service's host
aggregator over TCP (``switch_model/host_agg.py``, NOT switch-feasible). Everything about the bytes
between :class:`~ina.host_client.HostAggClient` and the aggregator is here: the frame header
(:data:`HEADER_FIELDS`, from which the ``struct`` layout :data:`HEADER` and the table in
``docs/host-protocol.md`` are derived: ``python -m ina.host_wire`` prints it), the frame types,
the flags, the limits, and the envelope that carries a codec message in a frame.

A frame is a 48-byte header (network byte order) then three length-prefixed parts: key (UTF-8),
meta (a UTF-8 JSON object) and body. The body of DATA and RESULT is the codec's message. A codec
whose ``compress`` gives uint8 codes and no metadata (3lc, eaq, wgt, ...) sends ``Encoded.codes`` as
is; otherwise (ENVELOPE flag) the body is the codes' bytes and meta holds ``"dtype"`` (numpy dtype
string) and ``"meta"`` (``Encoded.meta``), so that any codec can be host-aggregated. DATA meta also
holds ``"options"`` (the codec's constructor options, so that the aggregator builds the same codec)
and ``"rng"`` (a fingerprint of a stochastic codec's random state: ranks must use distinct seeds).
ERROR frames carry the text in the body and ``{"reason": ...}`` in meta.
"""
from __future__ import annotations

import enum
import json
import math
import socket
import struct
from dataclasses import dataclass, field

import numpy as np

from .errors import ConnectionGone, FrameError
from .wire import Field

MAGIC = b"INAH"
VERSION = 1
JOB_ROUND = 2**64 - 1                        # round field of an ERROR frame about the whole job
MAX_KEY = 4096                               # bytes of a tensor key
MAX_META = 1 << 20                           # bytes of a meta object
MAX_BODY = 1 << 30                           # default limit of a body: a larger declared body_len is refused
MAX_WORLD = 0xFFFF
HOST_AGG_PORT_OFFSET = 100                   # default port: the switch's port + 100
HOST_AGG_LABEL = ("host aggregator: variable-length messages decoded, summed and re-encoded on a host CPU "
                  "(NOT switch-feasible)")


class FrameType(enum.IntEnum):
    HELLO = 1     # worker -> aggregator: job, rank, world_size; meta {"timeout": s}
    WELCOME = 2   # aggregator -> worker: meta {"label", "timeout", "connected"}
    DATA = 3      # worker -> aggregator: one round's message
    RESULT = 4    # aggregator -> worker: the round's encoded sum
    ERROR = 5     # either way: body = text, meta {"reason": ...}
    BYE = 6       # worker -> aggregator: leaving the job (then the aggregator closes)


FRAME_TYPES = frozenset(t.value for t in FrameType)   # the valid values of the header's type field


class FrameFlag(enum.IntFlag):
    KEYED = 0x0001      # a tensor key is present
    ENVELOPE = 0x0002   # the body is the codes' bytes; meta holds their dtype and Encoded.meta


#: The frame header, in order (numpy type strings, network byte order). The single declaration.
HEADER_FIELDS: tuple[Field, ...] = (
    Field("magic", "S4", 'b"INAH"'),
    Field("version", "u1", "1"),
    Field("type", "u1", "FrameType: 1 HELLO, 2 WELCOME, 3 DATA, 4 RESULT, 5 ERROR, 6 BYE"),
    Field("flags", ">u2", "FrameFlag bits: 0x1 KEYED (a tensor key is present), 0x2 ENVELOPE"),
    Field("job", ">u4", "job id"),
    Field("rank", ">u2", "the worker's rank (in frames from the aggregator: the addressee's)"),
    Field("world_size", ">u2", "ranks of the job"),
    Field("round", ">u8", "0, 1, 2, ... per job (ERROR frames about the whole job: 2**64 - 1)"),
    Field("codec", ">u2", "the codec's wire id (ina.compression.by_wire_id)"),
    Field("key_len", ">u2", f"bytes of the key (UTF-8, at most {MAX_KEY})"),
    Field("meta_len", ">u4", f"bytes of the meta object (UTF-8 JSON, at most {MAX_META})"),
    Field("count", ">u8", "elements of the tensor"),
    Field("body_len", ">u8", "bytes of the body"),
)

HEADER_DTYPE = np.dtype([(f.name, f.dtype) for f in HEADER_FIELDS])
_STRUCT_CODE = {("u", 1): "B", ("u", 2): "H", ("u", 4): "I", ("u", 8): "Q"}
HEADER = struct.Struct("!" + "".join(f"{d.itemsize}s" if d.kind == "S" else _STRUCT_CODE[d.kind, d.itemsize]
                                     for d in (np.dtype(f.dtype) for f in HEADER_FIELDS)))
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == HEADER_DTYPE.itemsize == 48, HEADER_SIZE


def header_table() -> str:
    """The header as a markdown table (offset, size, field, meaning), derived from :data:`HEADER_FIELDS`."""
    rows = ["| offset | size | field | meaning |", "|---:|---:|---|---|"]
    for f in HEADER_FIELDS:
        dt, off = HEADER_DTYPE.fields[f.name][:2]
        rows.append(f"| {off} | {dt.itemsize} | `{f.name}` | {f.doc} |")
    rows.append(f"| {HEADER_SIZE} | | | key, meta, body |")
    return "\n".join(rows)


@dataclass
class Frame:
    type: int
    flags: int = 0
    job: int = 0
    rank: int = 0
    world_size: int = 0
    round: int = 0
    codec: int = 0
    count: int = 0
    key: str | None = None
    meta: dict = field(default_factory=dict)
    body: object = b""            # bytes-like (a uint8 numpy array when received)
    nbytes: int = 0               # bytes on the wire (set by send_frame / recv_frame)

    @property
    def text(self) -> str:
        return bytes(self.body).decode("utf-8", "replace")

    @property
    def body_bytes(self) -> int:
        return memoryview(self.body).nbytes


def error_frame(reason: str, text: str, *, job: int = 0, rank: int = 0, world_size: int = 0,
                rnd: int = JOB_ROUND) -> Frame:
    """An ERROR frame (body: the text; meta: the reason and the aggregator's label)."""
    return Frame(FrameType.ERROR, job=job, rank=rank, world_size=world_size, round=rnd,
                 meta={"reason": reason, "label": HOST_AGG_LABEL}, body=text.encode("utf-8"))


def frame_parts(f: Frame) -> list:
    """The frame as buffers: header, key, meta, body."""
    key = b"" if f.key is None else f.key.encode("utf-8")
    meta = json.dumps(f.meta, separators=(",", ":")).encode("utf-8") if f.meta else b""
    body = f.body if isinstance(f.body, (bytes, bytearray)) else memoryview(np.ascontiguousarray(f.body)).cast("B")
    if len(key) > MAX_KEY:
        raise ValueError(f"tensor key of {len(key)} bytes (max {MAX_KEY})")
    if len(meta) > MAX_META:
        raise ValueError(f"frame meta of {len(meta)} bytes (max {MAX_META})")
    flags = int(f.flags) | (FrameFlag.KEYED if f.key is not None else 0)
    hdr = HEADER.pack(MAGIC, VERSION, int(f.type), flags, f.job, f.rank, f.world_size, f.round, f.codec,
                      len(key), len(meta), f.count, len(body))
    return [hdr, key, meta, body]


def send_frame(sock: socket.socket, f: Frame) -> int:
    """Send one frame (header, key and meta in one write, the body in a second); returns its bytes."""
    hdr, key, meta, body = frame_parts(f)
    head = hdr + key + meta
    sock.sendall(head)
    if len(body):
        sock.sendall(body)
    f.nbytes = len(head) + len(body)
    return f.nbytes


def _recv_into(sock: socket.socket, view: memoryview, got_before: int) -> None:
    pos = 0
    while pos < len(view):
        k = sock.recv_into(view[pos:])
        if k == 0:
            raise ConnectionGone(got_before + pos, f"connection closed {got_before + pos} byte(s) into a frame")
        pos += k


def _check_header(head: bytearray, max_body: int) -> tuple:
    """The header's fields, or FrameError naming the first that breaks the format."""
    (_, version, ftype, flags, job, rank, world, rnd, codec, key_len, meta_len, count,
     body_len) = fields = HEADER.unpack(head)
    if version != VERSION:
        raise FrameError("bad_version", f"frame version {version}; this side speaks version {VERSION} "
                         "of the ina host-aggregator protocol")
    if ftype not in FRAME_TYPES:
        raise FrameError("bad_frame", f"unknown frame type {ftype} (valid: 1..{len(FrameType)})")
    if key_len > MAX_KEY or meta_len > MAX_META:
        raise FrameError("bad_frame", f"key of {key_len} bytes (max {MAX_KEY}) or meta of {meta_len} bytes "
                         f"(max {MAX_META})")
    if body_len > max_body:
        raise FrameError("frame_too_large", f"frame body of {body_len} bytes exceeds the limit of "
                         f"{max_body} bytes")
    return fields


def recv_frame(sock: socket.socket, max_body: int, rest_timeout: float | None = None) -> Frame | None:
    """Read one frame; None on a clean close between frames.

    The magic is checked on the first 4 bytes, before anything else is read, so that a peer that
    speaks another protocol gets a clear error at once. With ``rest_timeout`` (seconds), the rest
    of a frame whose first bytes arrived must arrive within that time (``SO_RCVTIMEO``; the wait
    for a frame to start stays unbounded, as an idle worker between rounds is normal).
    Raises :class:`FrameError` (bad magic, version, type, sizes, JSON) or :class:`ConnectionGone`.
    """
    head = bytearray(HEADER_SIZE)
    view = memoryview(head)
    k = sock.recv_into(view[:4])
    if k == 0:
        return None
    timed = False
    try:
        if rest_timeout is not None:
            set_recv_timeout(sock, rest_timeout)
            timed = True
        try:
            _recv_into(sock, view[k:4], k)
            if bytes(head[:4]) != MAGIC:
                raise FrameError("bad_magic", f"bad magic {bytes(head[:4])!r} (expected {MAGIC!r}): not a frame of "
                                 "the ina host-aggregator protocol")
            _recv_into(sock, view[4:], 4)
            (_, _, ftype, flags, job, rank, world, rnd, codec, key_len, meta_len, count,
             body_len) = _check_header(head, max_body)
            kb = bytearray(key_len)
            _recv_into(sock, memoryview(kb), HEADER_SIZE)
            mb = bytearray(meta_len)
            _recv_into(sock, memoryview(mb), HEADER_SIZE + key_len)
            body = np.empty(body_len, np.uint8)
            _recv_into(sock, memoryview(body), HEADER_SIZE + key_len + meta_len)
        except (BlockingIOError, socket.timeout):
            within = f"{rest_timeout:g} s of its first bytes" if rest_timeout is not None else "the time left"
            raise FrameError("bad_frame", f"incomplete frame: the rest did not arrive within {within}") from None
    finally:
        if timed:
            set_recv_timeout(sock, 0.0)
    try:
        key = kb.decode("utf-8") if flags & FrameFlag.KEYED else None
        meta = json.loads(mb) if meta_len else {}
    except (UnicodeDecodeError, ValueError) as e:
        raise FrameError("bad_frame", f"undecodable key or meta in a frame: {e}") from None
    if not isinstance(meta, dict):
        raise FrameError("bad_frame", f"frame meta must be a JSON object, got {type(meta).__name__}")
    return Frame(ftype, flags, job, rank, world, rnd, codec, count, key, meta, body,
                 HEADER_SIZE + key_len + meta_len + body_len)


def _timeval(seconds: float) -> bytes:
    sec = int(seconds)
    return struct.pack("ll", sec, int((seconds - sec) * 1e6))


def set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound every receive on a blocking socket (``SO_RCVTIMEO``; 0: unbounded)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound every send on a blocking socket (``SO_SNDTIMEO``) without bounding its receives."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))


# ------------------------------------------------------------------------------------------------
# the envelope: codec messages <-> frame bodies (shared by the client and the aggregator)
# ------------------------------------------------------------------------------------------------
def json_scalar(v):
    """``v`` as a JSON scalar (numpy scalars unwrapped); TypeError for anything else."""
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
        return v
    raise TypeError(f"{type(v).__name__} value {v!r}")


def pack_encoded(enc) -> tuple[int, dict, np.ndarray]:
    """(flags, meta entries, body) of an :class:`~ina.compression.Encoded` for a DATA/RESULT frame."""
    codes = np.ascontiguousarray(enc.codes).reshape(-1)
    if codes.dtype == np.uint8 and not enc.meta:
        return 0, {}, codes
    try:
        meta = {str(k): json_scalar(v) for k, v in enc.meta.items()}
    except TypeError as e:
        raise ValueError(f"codec {enc.codec!r}: metadata {e} cannot go into a host-aggregator frame") from None
    return int(FrameFlag.ENVELOPE), {"dtype": codes.dtype.str, "meta": meta}, codes.view(np.uint8)


def unpack_encoded(name: str, frame: Frame):
    """The :class:`~ina.compression.Encoded` (flat shape ``(count,)``) in a DATA/RESULT frame."""
    from .compression.base import Encoded
    body = np.asarray(frame.body, np.uint8)
    if not frame.flags & FrameFlag.ENVELOPE:
        return Encoded(name, body, (int(frame.count),), {})
    try:
        dt = np.dtype(str(frame.meta["dtype"]))
        meta = dict(frame.meta.get("meta") or {})
    except (KeyError, TypeError) as e:
        raise ValueError(f"{name} envelope without a valid dtype: {e}") from None
    if dt.kind not in "iuf" or body.size % dt.itemsize:
        raise ValueError(f"{name} envelope of {body.size} bytes cannot hold {dt} codes")
    return Encoded(name, body.view(dt), (int(frame.count),), meta)


def wire_key(key) -> str | None:
    """The tensor key as it goes on the wire: strings as they are, anything else by repr."""
    if key is None:
        return None
    return key if isinstance(key, str) else repr(key)


if __name__ == "__main__":
    print(header_table())
