"""Worker side of the switch service's host-aggregator mode, and its frame format (declared once).

Codecs whose messages are variable-length (``3lc``: quartic + zero-run, ``eaq``: Huffman, ``wgt``:
sparse whole values) cannot be summed by an integer switch at line rate. The switch service runs
a host aggregator for them (``switch_model/host_agg.py``): a parameter-server-like reduce on a host
CPU, the way 3LC's servers work. It is **NOT switch-feasible**, and every output says so
(:data:`HOST_AGG_LABEL`).

>>> c = HostAggClient(("127.0.0.1", 10099), rank=r, world_size=n, job=7)
>>> codec = ina.compression.get("3lc", seed=r)       # one codec object per rank, distinct seeds
>>> c.allreduce(grad, codec, key="layer1.weight")     # in place; returns grad
>>> c.close()

One round (TCP gives the reliability; every frame is length-prefixed, see :data:`HEADER`):
each rank sends a DATA frame (its codec's ``compress`` message); once all ``world_size`` ranks'
messages of the round have arrived, the aggregator decodes them, sums them (float64, in rank
order, then float32), **re-encodes the sum with the same codec** (its own codec object per job,
error feedback per (job, key): the downlink compression 3LC does at its servers) and sends the
encoded sum back to every rank as a RESULT frame. Anything wrong (ranks disagreeing on codec,
element count, key or round, a rank that does not deliver within the job's timeout, a rank that
disconnects) comes back as an ERROR frame naming the ranks and values, and
:class:`~ina.client.AllreduceError` is raised.

Frame (network byte order, 48-byte header then three length-prefixed parts)::

    off size field
      0   4  magic       b"INAH"
      4   1  version     1
      5   1  type        1 HELLO, 2 WELCOME, 3 DATA, 4 RESULT, 5 ERROR, 6 BYE
      6   2  flags       bit 0 KEYED (a tensor key is present), bit 1 ENVELOPE (see below)
      8   4  job         job id
     12   2  rank
     14   2  world_size
     16   8  round       0, 1, 2, ... per job (ERROR frames about the whole job: 2**64 - 1)
     24   2  codec       the codec's wire id (ina.compression.by_wire_id)
     26   2  key_len     bytes of the key (UTF-8)
     28   4  meta_len    bytes of the meta object (UTF-8 JSON)
     32   8  count       elements of the tensor
     40   8  body_len    bytes of the body
     48      key | meta | body

The body of DATA and RESULT is the codec's message. A codec whose ``compress`` gives uint8 codes
and no metadata (3lc, eaq, wgt, ...) sends ``Encoded.codes`` as is; otherwise (ENVELOPE flag) the
body is the codes' bytes and meta holds ``"dtype"`` (numpy dtype string) and ``"meta"``
(``Encoded.meta``), so that any codec can be host-aggregated. DATA meta also holds
``"options"`` (the codec's constructor options, so that the aggregator builds the same codec) and
``"rng"`` (a fingerprint of a stochastic codec's random state: ranks must use distinct seeds).
ERROR frames carry the text in the body and ``{"reason": ...}`` in meta.
"""
from __future__ import annotations

import enum
import hashlib
import inspect
import json
import logging
import math
import select
import socket
import struct
import time
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("ina.host_client")

MAGIC = b"INAH"
VERSION = 1
HEADER = struct.Struct("!4sBBHIHHQHHIQQ")   # see the module doc for the table
HEADER_SIZE = HEADER.size                    # 48
JOB_ROUND = 2**64 - 1                        # round field of an ERROR frame about the whole job
MAX_KEY = 4096                               # bytes of a tensor key
MAX_META = 1 << 20                           # bytes of a meta object
MAX_WORLD = 0xFFFF
HOST_AGG_PORT_OFFSET = 100                   # default port: the switch's port + 100
HOST_AGG_LABEL = ("host aggregator: variable-length messages decoded, summed and re-encoded on a host CPU "
                  "(NOT switch-feasible)")

assert HEADER_SIZE == 48


class FrameType(enum.IntEnum):
    HELLO = 1     # worker -> aggregator: job, rank, world_size; meta {"timeout": s}
    WELCOME = 2   # aggregator -> worker: meta {"label", "timeout", "connected"}
    DATA = 3      # worker -> aggregator: one round's message
    RESULT = 4    # aggregator -> worker: the round's encoded sum
    ERROR = 5     # either way: body = text, meta {"reason": ...}
    BYE = 6       # worker -> aggregator: leaving the job (then the aggregator closes)


class FrameFlag(enum.IntFlag):
    KEYED = 0x0001
    ENVELOPE = 0x0002


class FrameError(ValueError):
    """A frame that breaks the format; ``reason`` is the counter it is counted under."""

    def __init__(self, reason: str, text: str):
        super().__init__(text)
        self.reason = reason


class ConnectionGone(ConnectionError):
    """The peer closed the connection (at a frame boundary, or ``partial`` bytes into a frame)."""

    def __init__(self, partial: int = 0, what: str = ""):
        super().__init__(what or "connection closed")
        self.partial = partial


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
            _set_rcvtimeo(sock, rest_timeout)
            timed = True
        try:
            _recv_into(sock, view[k:4], k)
            if bytes(head[:4]) != MAGIC:
                raise FrameError("bad_magic", f"bad magic {bytes(head[:4])!r} (expected {MAGIC!r}): not a frame of "
                                 "the ina host-aggregator protocol")
            _recv_into(sock, view[4:], 4)
            (_, version, ftype, flags, job, rank, world, rnd, codec, key_len, meta_len, count,
             body_len) = HEADER.unpack(head)
            if version != VERSION:
                raise FrameError("bad_version", f"frame version {version}; this side speaks version {VERSION} "
                                 "of the ina host-aggregator protocol")
            if ftype not in FrameType._value2member_map_:
                raise FrameError("bad_frame", f"unknown frame type {ftype} (valid: 1..6)")
            if key_len > MAX_KEY or meta_len > MAX_META:
                raise FrameError("bad_frame", f"key of {key_len} bytes (max {MAX_KEY}) or meta of {meta_len} bytes "
                                 f"(max {MAX_META})")
            if body_len > max_body:
                raise FrameError("frame_too_large", f"frame body of {body_len} bytes exceeds the limit of "
                                 f"{max_body} bytes")
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
            _set_rcvtimeo(sock, 0.0)
    try:
        key = kb.decode("utf-8") if flags & FrameFlag.KEYED else None
        meta = json.loads(mb) if meta_len else {}
    except (UnicodeDecodeError, ValueError) as e:
        raise FrameError("bad_frame", f"undecodable key or meta in a frame: {e}") from None
    if not isinstance(meta, dict):
        raise FrameError("bad_frame", f"frame meta must be a JSON object, got {type(meta).__name__}")
    return Frame(ftype, flags, job, rank, world, rnd, codec, count, key, meta, body,
                 HEADER_SIZE + key_len + meta_len + body_len)


def _set_rcvtimeo(sock: socket.socket, seconds: float) -> None:
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, int((seconds - sec) * 1e6)))


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound every send on a blocking socket (``SO_SNDTIMEO``) without bounding its receives."""
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, int((seconds - sec) * 1e6)))


# ------------------------------------------------------------------------------------------------
# codec messages <-> frame bodies (shared by the client and the aggregator)
# ------------------------------------------------------------------------------------------------
def _json_scalar(v):
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
        meta = {str(k): _json_scalar(v) for k, v in enc.meta.items()}
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


def codec_options(codec) -> dict:
    """The constructor options of a codec object that can be read back from it (scalars only).

    The aggregator builds its own codec with these (and its own seed), so that it decodes and
    re-encodes exactly like the workers' codecs. Options a codec does not keep as an attribute of
    the same name (and non-scalar ones, e.g. MQGrad's controller) are left at their defaults.
    """
    out = {}
    for p in inspect.signature(type(codec).__init__).parameters.values():
        if p.name in ("self", "seed") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if hasattr(codec, p.name):
            try:
                out[p.name] = _json_scalar(getattr(codec, p.name))
            except TypeError:
                pass
    return out


def accepts_key(codec) -> bool:
    """Does ``codec.compress`` take ``key=`` (error feedback per tensor)?"""
    try:
        return "key" in inspect.signature(codec.compress).parameters
    except (TypeError, ValueError):
        return False


def rng_fingerprint(codec) -> str | None:
    """A short hash of a stochastic codec's random state (None for deterministic codecs)."""
    rng = getattr(codec, "_rng", None)
    if not getattr(codec, "stochastic", False) or rng is None:
        return None
    return hashlib.blake2b(repr(rng.bit_generator.state).encode(), digest_size=8).hexdigest()


def wire_key(key) -> str | None:
    """The tensor key as it goes on the wire: strings as they are, anything else by repr."""
    if key is None:
        return None
    return key if isinstance(key, str) else repr(key)


def __getattr__(name):
    # ina.client may import this module; the error class is taken from it lazily (no import cycle)
    if name == "AllreduceError":
        return _allreduce_error()
    raise AttributeError(name)


def _allreduce_error():
    from .client import AllreduceError
    return AllreduceError


# ------------------------------------------------------------------------------------------------
# the worker
# ------------------------------------------------------------------------------------------------
@dataclass
class HostAggStats:
    allreduces: int = 0           # rounds completed
    elements: int = 0
    frames_sent: int = 0
    bytes_sent: int = 0           # every frame byte (header, key, meta, body)
    frames_received: int = 0
    bytes_received: int = 0
    message_bytes_sent: int = 0   # codec messages only (DATA bodies)
    message_bytes_received: int = 0   # RESULT bodies
    compress_s: float = 0.0
    decompress_s: float = 0.0
    wait_s: float = 0.0           # from the DATA frame sent to the RESULT frame read

    def as_dict(self) -> dict:
        return {**self.__dict__, "label": HOST_AGG_LABEL}


class HostAggClient:
    """A worker of one job at the host aggregator of a switch service.

    ``HostAggClient(addr=(host, port), rank, world_size, job, timeout)`` connects and registers
    (``port``: the aggregator's, announced as ``host_aggregator.port`` in the switch's ``join``
    config and ``stats``; see :func:`host_aggregator_address`). ``timeout`` is the job's bound:
    once one rank's message of a round has arrived, the aggregator waits at most that long for the
    others, then reports the missing ranks to everyone. This client waits at most ``timeout +
    grace`` seconds for a round's result before giving up on the aggregator itself.

    After any failed round the client is unusable (the job was aborted at the aggregator);
    create a new one with a new job id.
    """

    def __init__(self, addr=("127.0.0.1", 9999 + HOST_AGG_PORT_OFFSET), rank: int = 0, world_size: int = 1,
                 job: int = 0, timeout: float = 30.0, *, grace: float = 10.0, connect_timeout: float = 10.0,
                 seed: int | None = None):
        if not 1 <= world_size <= MAX_WORLD:
            raise ValueError(f"world_size must be 1..{MAX_WORLD}, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if not 0 <= job <= 0xFFFFFFFF:
            raise ValueError(f"job id {job} out of range 0..{0xFFFFFFFF}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        host, port = addr
        self.addr = (host, int(port))
        self.rank, self.world_size, self.job = int(rank), int(world_size), int(job)
        self.timeout, self.grace = float(timeout), float(grace)
        self.stats = HostAggStats()
        self.label = HOST_AGG_LABEL
        self._round = 0
        self._broken: str | None = None
        self._codecs: dict = {}
        self._seed = seed if seed is not None else int(np.random.default_rng().integers(0, 2**31))
        where = f"the host aggregator at tcp {host}:{port}"
        try:
            self.sock = socket.create_connection(self.addr, timeout=connect_timeout)
        except OSError as e:
            raise _allreduce_error()(f"rank {rank} of job {job}: cannot reach {where}: {e}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._send(Frame(FrameType.HELLO, job=job, rank=rank, world_size=world_size, meta={"timeout": timeout}))
            welcome = self._await(FrameType.WELCOME, 0, connect_timeout, "its WELCOME")
        except Exception as e:
            self.sock.close()
            raise _allreduce_error()(f"rank {rank} could not join job {job} at {where}: {e}") from None
        self.label = welcome.meta.get("label", HOST_AGG_LABEL)
        log.info("rank %d joined job %d at %s (%d/%d ranks connected) [%s]", rank, job, where,
                 len(welcome.meta.get("connected", [])), world_size, self.label)

    # ----------------------------------------------------------------------------------------------
    def codec(self, name: str, **options):
        """A codec object of this client by name (seed: distinct per rank), built once per name."""
        c = self._codecs.get(name)
        if c is None:
            from . import compression
            options.setdefault("seed", self._seed * 1_000_003 + self.rank)
            c = self._codecs[name] = compression.get(name, **options)
        return c

    def allreduce(self, tensor, codec_obj, key=None, average: bool = False):
        """Sum (or average) ``tensor`` over the job's ranks through the host aggregator, in place.

        ``tensor``: a torch tensor (any float dtype, shape, device) or a numpy float array.
        ``codec_obj``: a codec object (``ina.compression.get(name, seed=...)``; every rank its own,
        with a distinct seed) or a codec name (then :meth:`codec` builds it). ``key`` names the
        tensor for error feedback (the rank's uplink residual and the aggregator's downlink
        residual are kept per key); without a key the round is stateless. Returns ``tensor``.
        """
        err = _allreduce_error()
        if self._broken:
            raise err(f"host-aggregator client of job {self.job} rank {self.rank} is unusable after an "
                      f"earlier failure: {self._broken}")
        codec = self.codec(codec_obj) if isinstance(codec_obj, str) else codec_obj
        from .compression.base import to_numpy_f32, write_back
        x32 = to_numpy_f32(tensor)
        n = x32.size
        try:
            self._check_pushed()
        except err as e:
            self._broken = str(e)
            raise
        fp = rng_fingerprint(codec)
        t0 = time.perf_counter()
        kw = {"key": key} if key is not None and accepts_key(codec) else {}
        enc = codec.compress(x32, **kw)       # raises on NaN/Inf before anything is sent
        flags, env, body = pack_encoded(enc)
        self.stats.compress_s += time.perf_counter() - t0
        meta = {"options": codec_options(codec), **env}
        if fp is not None:
            meta["rng"] = fp
        rnd = self._round
        frame = Frame(FrameType.DATA, flags, self.job, self.rank, self.world_size, rnd, codec.wire_id, n,
                      wire_key(key), meta, body)
        t1 = time.perf_counter()
        try:
            self._send(frame)
            self.stats.message_bytes_sent += body.nbytes
            res = self._await(FrameType.RESULT, rnd, self.timeout + self.grace,
                              f"the result of round {rnd} ({codec.name}, {n} elements)")
        except err as e:
            self._broken = str(e)
            raise
        self.stats.wait_s += time.perf_counter() - t1
        self._round += 1
        t2 = time.perf_counter()
        try:
            if res.count != n or res.codec != codec.wire_id:
                raise ValueError(f"result of round {rnd} is for codec id {res.codec} with {res.count} elements; "
                                 f"sent codec id {codec.wire_id} with {n}")
            out = to_numpy_f32(codec.decompress(unpack_encoded(codec.name, res)))
            if out.size != n:
                raise ValueError(f"result decodes to {out.size} elements, expected {n}")
        except ValueError as e:
            self._broken = f"undecodable result: {e}"
            raise err(f"job {self.job} rank {self.rank}: the host aggregator's {codec.name} result of round "
                      f"{rnd} cannot be decoded: {e}") from None
        self.stats.decompress_s += time.perf_counter() - t2
        self.stats.message_bytes_received += int(np.asarray(res.body).nbytes)
        if average:
            out = out / np.float32(self.world_size)
        self.stats.allreduces += 1
        self.stats.elements += n
        write_back(tensor, out)
        return tensor

    # ----------------------------------------------------------------------------------------------
    def _send(self, frame: Frame) -> None:
        self.sock.settimeout(self.timeout + self.grace)
        try:
            self.stats.bytes_sent += send_frame(self.sock, frame)
        except OSError as e:
            # the aggregator may have said why before it closed: read that first
            try:
                self._check_pushed()
            except _allreduce_error():
                raise
            except Exception:  # noqa: BLE001 - the send error is the one to report
                pass
            raise _allreduce_error()(f"job {self.job} rank {self.rank}: sending a "
                                     f"{FrameType(frame.type).name} frame to the host aggregator at "
                                     f"{self.addr[0]}:{self.addr[1]} failed: {e}") from None
        self.stats.frames_sent += 1

    def _read(self, timeout: float) -> Frame:
        self.sock.settimeout(max(timeout, 1e-3))
        f = recv_frame(self.sock, max_body=1 << 40)
        if f is None:
            raise ConnectionGone(0, "the host aggregator closed the connection")
        self.stats.frames_received += 1
        self.stats.bytes_received += f.nbytes
        return f

    def _await(self, ftype: FrameType, rnd: int, bound: float, what: str) -> Frame:
        err = _allreduce_error()
        where = f"host aggregator at {self.addr[0]}:{self.addr[1]}"
        deadline = time.monotonic() + bound
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise err(f"job {self.job} rank {self.rank}: no answer from the {where} within {bound:g} s "
                          f"waiting for {what} (the job's timeout is {self.timeout:g} s, after which it reports "
                          "missing ranks): the aggregator is hung or unreachable")
            try:
                f = self._read(left)
            except socket.timeout:
                continue
            except (FrameError, ConnectionGone, OSError) as e:
                raise err(f"job {self.job} rank {self.rank}: waiting for {what} from the {where}: {e}") from None
            if f.type == FrameType.ERROR:
                raise err(f"host aggregator [{f.meta.get('reason', 'error')}]: {f.text}")
            if f.type == ftype and (ftype != FrameType.RESULT or f.round == rnd):
                return f
            raise err(f"job {self.job} rank {self.rank}: protocol error: got a {FrameType(f.type).name} frame "
                      f"(round {f.round}) from the {where} while waiting for {what}")

    def _check_pushed(self) -> None:
        """An ERROR the aggregator pushed between rounds (job aborted) is raised before sending."""
        err = _allreduce_error()
        while select.select([self.sock], [], [], 0)[0]:
            try:
                f = self._read(self.grace)
            except (FrameError, ConnectionGone, OSError) as e:
                raise err(f"job {self.job} rank {self.rank}: the host aggregator connection failed: {e}") from None
            if f.type == FrameType.ERROR:
                raise err(f"host aggregator [{f.meta.get('reason', 'error')}]: {f.text}")
            raise err(f"job {self.job} rank {self.rank}: protocol error: unexpected "
                      f"{FrameType(f.type).name} frame from the host aggregator between rounds")

    # ----------------------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Leave the job: BYE, then wait (bounded) for the aggregator to close its side."""
        if self.sock is None:
            return
        try:
            send_frame(self.sock, Frame(FrameType.BYE, job=self.job, rank=self.rank, world_size=self.world_size))
            self.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                self.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                if not self.sock.recv(65536):
                    break
        except OSError as e:
            log.debug("rank %d: leaving job %d at the host aggregator: %s", self.rank, self.job, e)
        finally:
            self.sock.close()
            self.sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def host_aggregator_address(switch=("127.0.0.1", 9999), timeout: float = 10.0) -> tuple[str, int]:
    """(host, port) of a running switch service's host aggregator, from its control plane's stats."""
    from .control import ControlError, request
    host, port = switch
    st = request(host, int(port), {"op": "stats"}, timeout=timeout)["stats"]
    ha = st.get("host_aggregator")
    if not ha or "port" not in ha:
        raise ControlError(f"the switch at {host}:{port} runs without a host aggregator "
                           "(started with --host-agg-port -1?)")
    return host, int(ha["port"])

