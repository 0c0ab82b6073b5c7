"""Worker side of the switch service's host-aggregator mode.

Codecs whose messages are variable-length (``3lc``: quartic + zero-run, ``eaq``: Huffman, ``wgt``:
sparse whole values) cannot be summed by an integer switch at line rate. The switch service runs
a host aggregator for them (``switch_model/host_agg.py``): a parameter-server-like reduce on a host
CPU, the way 3LC's servers work. It is **NOT switch-feasible**, and every output says so
(:data:`~ina.host_wire.HOST_AGG_LABEL`).

>>> c = HostAggClient(("127.0.0.1", 10099), rank=r, world_size=n, job=7)
>>> codec = ina.compression.get("3lc", seed=r)       # one codec object per rank, distinct seeds
>>> c.allreduce(grad, codec, key="layer1.weight")     # in place; returns grad
>>> c.close()

One round (TCP gives the reliability; the frames are declared in :mod:`ina.host_wire`): each rank
sends a DATA frame (its codec's ``compress`` message); once all ``world_size`` ranks' messages of
the round have arrived, the aggregator decodes them, sums them (float64, in rank order, then
float32), **re-encodes the sum with the same codec** (its own codec object per job, error feedback
per (job, key): the downlink compression 3LC does at its servers) and sends the encoded sum back to
every rank as a RESULT frame. Anything wrong (ranks disagreeing on codec, element count, key or
round, a rank that does not deliver within the job's timeout, a rank that disconnects) comes back as
an ERROR frame naming the ranks and values, and :class:`~ina.errors.AllreduceError` is raised.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

import numpy as np

from .burst import readable
from .compression.base import to_numpy_f32
from .errors import AllreduceError, ConnectionGone, FrameError
from .host_wire import (HOST_AGG_LABEL, HOST_AGG_PORT_OFFSET, MAX_WORLD, Frame, FrameType, pack_encoded, recv_frame,
                        send_frame, unpack_encoded, wire_key)
from .worker import Worker, WorkerStats

log = logging.getLogger("ina.host_client")

__all__ = ["HostAggClient", "HostAggStats", "host_aggregator_address", "HOST_AGG_LABEL", "HOST_AGG_PORT_OFFSET"]


@dataclass
class HostAggStats(WorkerStats):
    frames_sent: int = 0
    frames_received: int = 0
    message_bytes_sent: int = 0   # codec messages only (DATA bodies)
    message_bytes_received: int = 0   # RESULT bodies
    compress_s: float = 0.0
    decompress_s: float = 0.0
    wait_s: float = 0.0           # from the DATA frame sent to the RESULT frame read

    def as_dict(self) -> dict:
        return {**self.__dict__, "label": HOST_AGG_LABEL}


class HostAggClient(Worker):
    """A worker of one job at the host aggregator of a switch service.

    ``HostAggClient(addr=(host, port), rank, world_size, job, timeout)`` connects and registers
    (``port``: the aggregator's, announced as ``host_aggregator.port`` in the switch's ``join``
    config and ``stats``; see :func:`host_aggregator_address`). ``timeout`` is the job's bound:
    once one rank's message of a round has arrived, the aggregator waits at most that long for the
    others, then reports the missing ranks to everyone. This client waits at most ``timeout +
    grace`` seconds for a round's result before giving up on the aggregator itself. ``token``:
    the switch service's shared token (default ``$INA_TOKEN``), sent in HELLO; a service started
    with a token refuses a HELLO without it.

    After any failed round the client is unusable (the job was aborted at the aggregator);
    create a new one with a new job id.
    """

    kind = "host-aggregator client"

    def __init__(self, addr=("127.0.0.1", 9999 + HOST_AGG_PORT_OFFSET), rank: int = 0, world_size: int = 1,
                 job: int = 0, timeout: float = 30.0, *, grace: float = 10.0, connect_timeout: float = 10.0,
                 seed: int | None = None, token: str | None = None):
        if not 1 <= world_size <= MAX_WORLD:
            raise ValueError(f"world_size must be 1..{MAX_WORLD}, got {world_size}")
        if not 0 <= job <= 0xFFFFFFFF:
            raise ValueError(f"job id {job} out of range 0..{0xFFFFFFFF}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._init_worker(rank, world_size, job, seed, None, HostAggStats())
        host, port = addr
        self.addr = (host, int(port))
        self.timeout, self.grace = float(timeout), float(grace)
        self.label = HOST_AGG_LABEL
        self._round = 0
        where = f"the host aggregator at tcp {host}:{port}"
        try:
            self.sock = socket.create_connection(self.addr, timeout=connect_timeout)
        except OSError as e:
            raise AllreduceError(f"rank {rank} of job {job}: cannot reach {where}: {e}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            token = token or os.environ.get("INA_TOKEN") or None     # the switch service's shared token
            self._send(Frame(FrameType.HELLO, job=job, rank=rank, world_size=world_size,
                             meta={"timeout": timeout, **({"token": token} if token else {})}))
            welcome = self._await(FrameType.WELCOME, 0, connect_timeout, "its WELCOME")
        except Exception as e:
            self.sock.close()
            raise AllreduceError(f"rank {rank} could not join job {job} at {where}: {e}") from None
        self.label = welcome.meta.get("label", HOST_AGG_LABEL)
        log.info("rank %d joined job %d at %s (%d/%d ranks connected) [%s]", rank, job, where,
                 len(welcome.meta.get("connected", [])), world_size, self.label)

    # ----------------------------------------------------------------------------------------------
    def allreduce(self, tensor, codec_obj, key=None, average: bool = False):
        """Sum (or average) ``tensor`` over the job's ranks through the host aggregator, in place.

        ``tensor``: a torch tensor (any float dtype, shape, device) or a numpy float array.
        ``codec_obj``: a codec object (``ina.compression.get(name, seed=...)``; every rank its own,
        with a distinct seed) or a codec name (then :meth:`codec` builds it). ``key`` names the
        tensor for error feedback (the rank's uplink residual and the aggregator's downlink
        residual are kept per key); without a key the round is stateless. Returns ``tensor``.
        """
        self._check_usable()
        codec = self.codec(codec_obj) if isinstance(codec_obj, str) else codec_obj
        x32 = to_numpy_f32(tensor)
        with self._latching():
            self._check_pushed()
        frame = self._data_frame(codec, x32, key)   # raises on NaN/Inf before anything is sent
        t1 = time.perf_counter()
        with self._latching():
            self._send(frame)
            self.stats.message_bytes_sent += frame.body.nbytes
            res = self._await(FrameType.RESULT, frame.round, self.timeout + self.grace,
                              f"the result of round {frame.round} ({codec.name}, {frame.count} elements)")
        self.stats.wait_s += time.perf_counter() - t1
        self._round += 1
        out = self._decode_result(codec, res, frame)
        return self._deliver(tensor, out, average)

    def _data_frame(self, codec, x32: np.ndarray, key) -> Frame:
        """This rank's DATA frame of the next round: the codec's message, its options and random state."""
        fp = codec.rng_fingerprint()
        t0 = time.perf_counter()
        enc = codec.compress(x32, **codec.key_argument(key))
        flags, env, body = pack_encoded(enc)
        self.stats.compress_s += time.perf_counter() - t0
        meta = {"options": codec.options(), **env}
        if fp is not None:
            meta["rng"] = fp
        return Frame(FrameType.DATA, flags, self.job, self.rank, self.world_size, self._round, codec.wire_id,
                     x32.size, wire_key(key), meta, body)

    def _decode_result(self, codec, res: Frame, sent: Frame) -> np.ndarray:
        t2 = time.perf_counter()
        n, rnd = sent.count, sent.round
        try:
            if res.count != n or res.codec != codec.wire_id:
                raise ValueError(f"result of round {rnd} is for codec id {res.codec} with {res.count} elements; "
                                 f"sent codec id {codec.wire_id} with {n}")
            out = to_numpy_f32(codec.decompress(unpack_encoded(codec.name, res)))
            if out.size != n:
                raise ValueError(f"result decodes to {out.size} elements, expected {n}")
        except ValueError as e:
            self._break(f"undecodable result: {e}")
            raise AllreduceError(f"job {self.job} rank {self.rank}: the host aggregator's {codec.name} result of "
                                 f"round {rnd} cannot be decoded: {e}") from None
        self.stats.decompress_s += time.perf_counter() - t2
        self.stats.message_bytes_received += int(np.asarray(res.body).nbytes)
        return out

    # ----------------------------------------------------------------------------------------------
    def _send(self, frame: Frame) -> None:
        self.sock.settimeout(self.timeout + self.grace)
        try:
            self.stats.bytes_sent += send_frame(self.sock, frame)
        except OSError as e:
            # the aggregator may have said why before it closed: read that first
            try:
                self._check_pushed()
            except AllreduceError:
                raise
            except Exception:  # noqa: BLE001 - the send error is the one to report
                pass
            raise AllreduceError(f"job {self.job} rank {self.rank}: sending a "
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
        where = f"host aggregator at {self.addr[0]}:{self.addr[1]}"
        deadline = time.monotonic() + bound
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AllreduceError(f"job {self.job} rank {self.rank}: no answer from the {where} within {bound:g} s "
                          f"waiting for {what} (the job's timeout is {self.timeout:g} s, after which it reports "
                          "missing ranks): the aggregator is hung or unreachable")
            try:
                f = self._read(left)
            except socket.timeout:
                continue
            except (FrameError, ConnectionGone, OSError) as e:
                raise AllreduceError(f"job {self.job} rank {self.rank}: waiting for {what} from the {where}: {e}") from None
            if f.type == FrameType.ERROR:
                raise AllreduceError(f"host aggregator [{f.meta.get('reason', 'error')}]: {f.text}")
            if f.type == ftype and (ftype != FrameType.RESULT or f.round == rnd):
                return f
            raise AllreduceError(f"job {self.job} rank {self.rank}: protocol error: got a {FrameType(f.type).name} frame "
                      f"(round {f.round}) from the {where} while waiting for {what}")

    def _check_pushed(self) -> None:
        """An ERROR the aggregator pushed between rounds (job aborted) is raised before sending."""
        while readable(self.sock.fileno(), 0):
            try:
                f = self._read(self.grace)
            except (FrameError, ConnectionGone, OSError) as e:
                raise AllreduceError(f"job {self.job} rank {self.rank}: the host aggregator connection failed: {e}") from None
            if f.type == FrameType.ERROR:
                raise AllreduceError(f"host aggregator [{f.meta.get('reason', 'error')}]: {f.text}")
            raise AllreduceError(f"job {self.job} rank {self.rank}: protocol error: unexpected "
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

