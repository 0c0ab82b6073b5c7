"""Host-aggregator mode of the switch service: a reduce on a host CPU, NOT switch-feasible.

Codecs whose messages are variable-length (``3lc``: quartic + zero-run, ``eaq``: Huffman, ``wgt``:
sparse whole values) cannot be summed by an integer switch at line rate. ``ina-switch serve`` runs
this aggregator next to the data plane, in its own process (so that it does not take the GIL from
the switch's poll loop), on its own TCP port (``--host-agg-port``, default the switch's port + 100).
It works like 3LC's parameter servers:

* the workers of a job connect (:class:`ina.host_client.HostAggClient`: HELLO, then one DATA
  frame per round holding the rank's codec message);
* once all ``world_size`` ranks' messages of a round have arrived, the aggregator decodes each
  with the codec, sums them in float64 in rank order (then float32), **re-encodes the sum with the
  same codec** (its own codec object per job and codec options, seeded with
  :func:`aggregator_seed`, error feedback per (job, key): the downlink compression 3LC does at its
  servers) and sends the encoded sum to every rank (RESULT);
* ranks that disagree on the round, codec, codec options, element count or key, a stochastic
  codec with the same random state on two ranks, a rank that does not deliver within the job's
  timeout of the round's first message, a rank that disconnects or leaves, an undecodable message:
  the job is aborted and every connected rank gets an ERROR frame naming the ranks and values.
  Each is counted under its reason (``errors`` in :meth:`HostAggregator.stats`);
* a frame with a wrong magic or version is answered with an ERROR frame, counted, and the
  connection is closed.

The frame format is declared once, in :mod:`ina.host_client`. Counters reach ``ina-switch stats``
under the ``host_aggregator`` key; the switch's ``join`` config announces
``host_aggregator: {"port": P, "label": "...NOT switch-feasible..."}``.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
import zlib

import numpy as np

from ina.errors import ConnectionGone, FrameError
from ina.host_wire import (HOST_AGG_LABEL, JOB_ROUND, MAX_WORLD, Frame, FrameType, frame_parts, pack_encoded,
                           recv_frame, set_send_timeout, unpack_encoded)

log = logging.getLogger("ina.switch.host_agg")

ERROR_REASONS = ("bad_magic", "bad_version", "bad_frame", "frame_too_large", "protocol", "mismatch", "timeout",
                 "disconnect", "left", "unknown_codec", "bad_codec_options", "same_seed", "decode", "encode",
                 "send_failed")
CODEC_COUNTERS = ("rounds", "messages", "elements", "bytes_in", "bytes_out", "decode_s", "sum_s", "encode_s")
MAX_TIMEOUT = 86400.0


def aggregator_seed(job: int, codec_name: str, service_seed: int = 0) -> int:
    """The seed of the aggregator's own codec object for ``codec_name`` in job ``job``:
    CRC-32 of ``"ina-host-agg/<service seed>/<job>/<codec name>"`` (``--seed`` is the service seed)."""
    return zlib.crc32(f"ina-host-agg/{service_seed}/{job}/{codec_name}".encode())


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class _Conn:
    def __init__(self, sock: socket.socket, peer):
        self.sock = sock
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.send_lock = threading.Lock()
        self.job: _Job | None = None
        self.rank: int | None = None
        self.bye = False


class _Round:
    def __init__(self, number: int, spec: dict, now: float, timeout: float):
        self.number = number
        self.spec = spec                  # codec, elements, key, options of the first message
        self.started = now
        self.deadline = now + timeout
        self.msgs: dict[int, Frame] = {}
        self.specs: dict[int, dict] = {}
        self.rng: dict[int, str] = {}


class _Job:
    def __init__(self, job: int, world_size: int, timeout: float):
        self.id = job
        self.world_size = world_size
        self.timeout = timeout
        self.created = time.monotonic()
        self.conns: dict[int, _Conn] = {}
        self.ever: set[int] = set()       # ranks that ever connected
        self.left: set[int] = set()       # ranks that said BYE
        self.round: _Round | None = None
        self.next_round = 0
        self.codecs: dict[tuple, object] = {}
        self.compute_lock = threading.Lock()
        self.aborted: str | None = None
        self.rounds = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.codec_names: set[str] = set()


class HostAggregator:
    """The aggregator: a threaded TCP server (one thread per worker connection) plus a watchdog
    thread that enforces the round deadlines and logs a progress line every ``stats_interval`` s."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0, *, seed: int = 0, stats_interval: float = 10.0,
                 max_body: int = 1 << 30, frame_timeout: float = 30.0, fallback_port: bool = False):
        self.seed = int(seed)
        self.stats_interval = float(stats_interval)
        self.max_body = int(max_body)
        self.frame_timeout = float(frame_timeout)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._jobs: dict[int, _Job] = {}
        self._conns: set[_Conn] = set()
        self._stopped = False
        self._started = time.monotonic()
        self._c = dict.fromkeys(("connections", "frames_in", "bytes_in", "frames_out", "bytes_out", "rounds",
                                 "messages", "jobs_started", "jobs_finished", "jobs_aborted"), 0)
        self._errors = dict.fromkeys(ERROR_REASONS, 0)
        self._per_codec: dict[str, dict] = {}
        agg = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                agg._serve_connection(self.request, self.client_address)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self.server = Server((host, port), Handler, bind_and_activate=False)
        try:
            self.server.server_bind()
        except OSError as e:
            if not fallback_port or port == 0:
                self.server.server_close()
                raise
            log.warning("host aggregator: tcp port %d is taken (%s); using a free port instead", port, e)
            self.server.server_address = (host, 0)
            self.server.server_bind()
        self.server.server_activate()
        self.host = host
        self.port = self.server.server_address[1]
        self._threads: list[threading.Thread] = []

    # --------------------------------------------------------------------------------------------
    def start(self) -> None:
        for target, name in ((self.server.serve_forever, "host-agg-accept"), (self._watch, "host-agg-watchdog")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("host aggregator listening on tcp %s:%d [%s]", self.host, self.port, HOST_AGG_LABEL)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            conns = list(self._conns)
            self._cond.notify_all()
        self.server.shutdown()
        self.server.server_close()
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        c = self._c
        log.info("host aggregator stopped: %d rounds, %d messages, in %s, out %s, %d jobs (%d aborted), "
                 "%d errors", c["rounds"], c["messages"], _mb(c["bytes_in"]), _mb(c["bytes_out"]),
                 c["jobs_started"], c["jobs_aborted"], sum(self._errors.values()))

    def stats(self) -> dict:
        with self._lock:
            jobs = {str(j.id): {"world_size": j.world_size, "connected": sorted(j.conns), "rounds": j.rounds,
                                "timeout": j.timeout, "codecs": sorted(j.codec_names), "aborted": j.aborted,
                                "pending_round": None if j.round is None else
                                {"round": j.round.number, "delivered": sorted(j.round.msgs),
                                 "codec": j.round.spec["codec"], "elements": j.round.spec["elements"]}}
                    for j in self._jobs.values()}
            return {"label": HOST_AGG_LABEL, "port": self.port, "seed": self.seed,
                    "uptime_s": round(time.monotonic() - self._started, 3),
                    "counters": {**self._c, "connections_open": len(self._conns),
                                 "jobs_active": sum(1 for j in self._jobs.values() if not j.aborted)},
                    "errors": dict(self._errors),
                    "per_codec": {k: dict(v) for k, v in self._per_codec.items()},
                    "jobs": jobs}

    # --------------------------------------------------------------------------------------------
    def _count(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._errors[reason] = self._errors.get(reason, 0) + n

    def _send(self, conn: _Conn, frame: Frame) -> bool:
        parts = frame_parts(frame)
        head = parts[0] + parts[1] + parts[2]
        try:
            with conn.send_lock:
                conn.sock.sendall(head)
                if len(parts[3]):
                    conn.sock.sendall(parts[3])
        except OSError as e:
            log.warning("host aggregator: sending a %s frame to %s (job %s rank %s) failed: %s",
                        FrameType(frame.type).name, conn.peer, frame.job, conn.rank, e)
            self._count("send_failed")
            return False
        n = len(head) + len(parts[3])
        with self._lock:
            self._c["frames_out"] += 1
            self._c["bytes_out"] += n
        return True

    def _error_frame(self, conn: _Conn, reason: str, text: str, job: int = 0, rnd: int = JOB_ROUND) -> Frame:
        return Frame(FrameType.ERROR, job=job, rank=conn.rank or 0,
                     world_size=conn.job.world_size if conn.job else 0, round=rnd,
                     meta={"reason": reason, "label": HOST_AGG_LABEL}, body=text.encode("utf-8"))

    # --------------------------------------------------------------------------------------------
    def _serve_connection(self, sock: socket.socket, peer) -> None:
        conn = _Conn(sock, peer)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_send_timeout(sock, self.frame_timeout)
        with self._lock:
            if self._stopped:
                sock.close()
                return
            self._conns.add(conn)
            self._c["connections"] += 1
        log.debug("host aggregator: connection from %s", conn.peer)
        try:
            while True:
                try:
                    f = recv_frame(sock, self.max_body, rest_timeout=self.frame_timeout)
                except FrameError as e:
                    self._count(e.reason)
                    log.warning("host aggregator: refusing the connection from %s (job %s rank %s): %s",
                                conn.peer, conn.job.id if conn.job else "-", conn.rank, e)
                    self._send(conn, self._error_frame(conn, e.reason, f"host aggregator refused the connection: {e}",
                                                       conn.job.id if conn.job else 0))
                    _drain_and_close(sock)
                    break
                except ConnectionGone as e:
                    if conn.job is not None:
                        log.debug("host aggregator: %s: %s", conn.peer, e)
                    break
                except OSError as e:        # reset by the peer, or shut down by stop()
                    log.debug("host aggregator: %s: %s", conn.peer, e)
                    break
                if f is None:
                    break
                with self._lock:
                    self._c["frames_in"] += 1
                    self._c["bytes_in"] += f.nbytes
                if not self._dispatch(conn, f):
                    break
        finally:
            self._connection_closed(conn)
            try:
                sock.close()
            except OSError:
                pass

    def _dispatch(self, conn: _Conn, f: Frame) -> bool:
        """Handle one frame; False closes the connection."""
        if f.type == FrameType.HELLO:
            return self._on_hello(conn, f)
        if f.type == FrameType.DATA:
            self._on_data(conn, f)
            return True
        if f.type == FrameType.BYE:
            self._on_bye(conn, f)
            return False
        text = (f"unexpected {FrameType(f.type).name} frame from {conn.peer}: workers send HELLO, DATA and BYE")
        self._count("protocol")
        log.warning("host aggregator: %s", text)
        self._send(conn, self._error_frame(conn, "protocol", text, f.job))
        return False

    def _refuse(self, conn: _Conn, reason: str, text: str, job: int = 0, rnd: int = JOB_ROUND) -> None:
        """An error that concerns this connection only (the job, if any, goes on)."""
        self._count(reason)
        log.warning("host aggregator: %s", text)
        self._send(conn, self._error_frame(conn, reason, text, job, rnd))

    def _on_hello(self, conn: _Conn, f: Frame) -> bool:
        if conn.job is not None:
            self._refuse(conn, "protocol", f"a second HELLO (job {f.job} rank {f.rank}) on a connection that joined "
                         f"job {conn.job.id} as rank {conn.rank}", f.job)
            return False
        try:
            timeout = float(f.meta.get("timeout", 30.0))
        except (TypeError, ValueError):
            timeout = float("nan")
        if not 0 < timeout <= MAX_TIMEOUT:
            self._refuse(conn, "bad_frame", f"job {f.job} rank {f.rank}: timeout {f.meta.get('timeout')!r} must be "
                         f"in (0, {MAX_TIMEOUT:g}] seconds", f.job)
            return False
        if not 1 <= f.world_size <= MAX_WORLD or not 0 <= f.rank < f.world_size:
            self._refuse(conn, "bad_frame", f"job {f.job}: rank {f.rank} out of range for world_size {f.world_size}",
                         f.job)
            return False
        err = None
        with self._lock:
            job = self._jobs.get(f.job)
            created = job is None
            if created:
                job = self._jobs[f.job] = _Job(f.job, f.world_size, timeout)
                self._c["jobs_started"] += 1
            if job.aborted:    # ranks of the aborted job are still connected: a late rank hears why
                err = ("aborted", f"job {f.job} was aborted: {job.aborted}")
            elif job.world_size != f.world_size:
                err = ("mismatch", f"job {f.job}: rank {f.rank} says world_size {f.world_size}, ranks "
                       f"{sorted(job.conns)} joined with world_size {job.world_size}")
            elif f.rank in job.conns:
                err = ("protocol", f"job {f.job}: rank {f.rank} is already connected (from {job.conns[f.rank].peer})")
            elif f.rank in job.left:
                err = ("protocol", f"job {f.job}: rank {f.rank} has left the job and cannot rejoin it "
                       "(use a new job id)")
            else:
                job.conns[f.rank] = conn
                job.ever.add(f.rank)
                conn.job, conn.rank = job, f.rank
                connected = sorted(job.conns)
        if err:
            if err[0] == "aborted":         # counted when the job was aborted
                self._send(conn, self._error_frame(conn, *err, f.job))
            else:
                self._refuse(conn, *err, job=f.job)
            return False
        if created:
            log.info("job %d started at the host aggregator: %d ranks, timeout %g s [NOT switch-feasible]",
                     f.job, f.world_size, timeout)
        log.info("job %d: rank %d connected from %s (%d/%d)", f.job, f.rank, conn.peer, len(connected), f.world_size)
        return self._send(conn, Frame(FrameType.WELCOME, job=f.job, rank=f.rank, world_size=f.world_size,
                                      meta={"label": HOST_AGG_LABEL, "timeout": job.timeout, "connected": connected}))

    # --------------------------------------------------------------------------------------------
    def _on_data(self, conn: _Conn, f: Frame) -> None:
        job = conn.job
        if job is None:
            self._refuse(conn, "protocol", f"DATA frame (job {f.job} rank {f.rank}) from {conn.peer} before HELLO",
                         f.job, f.round)
            return
        if (f.job, f.rank, f.world_size) != (job.id, conn.rank, job.world_size):
            self._abort(job, "protocol", f"job {job.id}: a DATA frame on rank {conn.rank}'s connection says job "
                        f"{f.job} rank {f.rank} world_size {f.world_size}")
            return
        where = f"job {job.id} round {f.round}"
        try:
            from ina import compression
            name = compression.by_wire_id(f.codec).name
        except ValueError:
            self._abort(job, "unknown_codec", f"{where}: rank {f.rank} sent codec wire id {f.codec}, which no codec "
                        "of this aggregator has")
            return
        options = f.meta.get("options", {})
        if not isinstance(options, dict) or not all(v is None or isinstance(v, (bool, int, float, str))
                                                    for v in options.values()):
            self._abort(job, "bad_frame", f"{where}: rank {f.rank}'s codec options {options!r} are not an object "
                        "of scalars")
            return
        body_n = int(np.asarray(f.body).nbytes)
        if body_n > 16 * f.count + (1 << 20):
            self._abort(job, "bad_frame", f"{where}: rank {f.rank}'s {name} message of {body_n} bytes is too large "
                        f"for {f.count} elements")
            return
        spec = {"round": f.round, "codec": name, "elements": f.count, "key": f.key,
                "options": json.dumps(options, sort_keys=True)}
        err = complete = None
        now = time.monotonic()
        with self._cond:
            if job.aborted:
                text = f"{where}: job {job.id} was aborted earlier: {job.aborted}"
            else:
                text = None
                rd = job.round
                if job.left:
                    err = ("left", f"{where}: rank(s) {sorted(job.left)} left the job, so the round cannot complete")
                elif rd is None and f.round != job.next_round:
                    err = ("mismatch", f"job {job.id}: rank {f.rank} sent round {f.round}, the job is at round "
                           f"{job.next_round}")
                else:
                    if rd is None:
                        rd = job.round = _Round(f.round, spec, now, job.timeout)
                        self._cond.notify_all()
                    err = self._accept_message(job, rd, f, spec, name)
                    if err is None and len(rd.msgs) == job.world_size:
                        complete = rd
                        job.round = None
                        job.next_round += 1
                if err is None:
                    self._c["messages"] += 1
                    pc = self._codec_counters(name)
                    pc["messages"] += 1
                    pc["bytes_in"] += body_n
                    job.bytes_in += body_n
        if text:   # this rank was told when the job was aborted; say it again to the sender
            self._send(conn, self._error_frame(conn, "aborted", text, job.id, f.round))
            return
        if err:
            self._abort(job, *err)
            return
        if complete is not None:
            self._complete(job, complete)

    def _accept_message(self, job: _Job, rd: _Round, f: Frame, spec: dict, name: str):
        """Add rank f.rank's message to the round; an (reason, text) error or None. Holds the lock."""
        if f.rank in rd.msgs:
            return "protocol", f"job {job.id} round {rd.number}: rank {f.rank} sent its message twice"
        rd.msgs[f.rank] = f
        rd.specs[f.rank] = spec
        for field, what in (("round", "round number"), ("codec", "codec"), ("elements", "element count"),
                            ("key", "tensor key"), ("options", "codec options")):
            vals = {r: s[field] for r, s in sorted(rd.specs.items())}
            if len(set(vals.values())) > 1:
                return "mismatch", (f"job {job.id} round {rd.number}: ranks disagree on the {what}: "
                                    + ", ".join(f"rank {r}: {v!r}" if field != "options" else f"rank {r}: {v}"
                                                for r, v in vals.items()))
        fp = f.meta.get("rng")
        if fp:
            same = sorted(r for r, other in rd.rng.items() if other == fp)
            rd.rng[f.rank] = fp
            if same:
                return "same_seed", (f"job {job.id} round {rd.number}: ranks {sorted(same + [f.rank])} use {name} "
                                     "codec objects with the same random state; give every rank's codec its own "
                                     "seed (e.g. seed=rank)")
        return None

    def _codec_counters(self, name: str) -> dict:
        pc = self._per_codec.get(name)
        if pc is None:
            pc = self._per_codec[name] = {k: (0.0 if k.endswith("_s") else 0) for k in CODEC_COUNTERS}
        return pc

    def _complete(self, job: _Job, rd: _Round) -> None:
        """Decode, sum, re-encode and send one round's result (the last message's thread runs it)."""
        from ina import compression
        from ina.compression.base import to_numpy_f32
        name, n, key = rd.spec["codec"], int(rd.spec["elements"]), rd.spec["key"]
        options = json.loads(rd.spec["options"])
        where = f"job {job.id} round {rd.number} ({name}, {n} elements)"
        with job.compute_lock:
            ck = (name, rd.spec["options"])
            codec = job.codecs.get(ck)
            if codec is None:
                seed = aggregator_seed(job.id, name, self.seed)
                try:
                    codec = compression.get(name, seed=seed, **options)
                except (ValueError, TypeError) as e:
                    self._abort(job, "bad_codec_options", f"{where}: the ranks' codec options {options} do not "
                                f"build a {name} codec: {e}")
                    return
                job.codecs[ck] = codec
                job.codec_names.add(name)
                log.info("job %d: %s codec for the downlink (seed %d, options %s); first round: %d elements, key %r",
                         job.id, name, seed, options, n, key)
            t0 = time.perf_counter()
            acc = np.zeros(n, np.float64)
            for r in range(job.world_size):
                try:
                    x = to_numpy_f32(codec.decompress(unpack_encoded(name, rd.msgs[r])))
                    if x.size != n:
                        raise ValueError(f"it decodes to {x.size} elements, not {n}")
                except (ValueError, KeyError, IndexError) as e:
                    self._abort(job, "decode", f"{where}: cannot decode rank {r}'s message "
                                f"({np.asarray(rd.msgs[r].body).nbytes} bytes): {e}")
                    return
                acc += x
            t1 = time.perf_counter()
            total = acc.astype(np.float32)
            t2 = time.perf_counter()
            try:
                flags, env, body = pack_encoded(codec.compress(total, **codec.key_argument(key)))
            except (ValueError, OverflowError) as e:
                self._abort(job, "encode", f"{where}: cannot re-encode the sum: {e}")
                return
            t3 = time.perf_counter()
        with self._lock:
            conns = dict(job.conns)
        sent = 0
        for r in range(job.world_size):
            c = conns.get(r)
            if c is None:
                continue
            if self._send(c, Frame(FrameType.RESULT, flags, job.id, r, job.world_size, rd.number,
                                   rd.msgs[r].codec, n, key, env, body)):
                sent += 1
        with self._lock:
            self._c["rounds"] += 1
            job.rounds += 1
            job.bytes_out += body.nbytes * sent
            pc = self._codec_counters(name)
            pc["rounds"] += 1
            pc["elements"] += n
            pc["bytes_out"] += body.nbytes * sent
            pc["decode_s"] += t1 - t0
            pc["sum_s"] += t2 - t1
            pc["encode_s"] += t3 - t2
        log.debug("%s: %d messages decoded in %.3f s, sum re-encoded in %.3f s (%d bytes) and sent to %d ranks",
                  where, job.world_size, t1 - t0, t3 - t2, body.nbytes, sent)

    # --------------------------------------------------------------------------------------------
    def _on_bye(self, conn: _Conn, f: Frame) -> None:
        job = conn.job
        if job is None:
            return
        err = None
        with self._lock:
            conn.bye = True
            if job.conns.get(conn.rank) is conn:
                del job.conns[conn.rank]
            job.left.add(conn.rank)
            rd = job.round
            if rd is not None and not job.aborted:
                err = ("left", f"job {job.id}: rank {conn.rank} left the job during round {rd.number} "
                       f"(delivered: ranks {sorted(rd.msgs)})")
        log.info("job %d: rank %d left", job.id, conn.rank)
        if err:
            self._abort(job, *err)
        self._maybe_finish(job)

    def _connection_closed(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.discard(conn)
            job = conn.job
            gone = job is not None and not conn.bye and job.conns.get(conn.rank) is conn
            if gone:
                del job.conns[conn.rank]
                rd = job.round
        if not gone:
            return
        if not job.aborted:
            pending = (f"; round {rd.number} had messages from ranks {sorted(rd.msgs)}" if rd is not None else "")
            self._abort(job, "disconnect", f"job {job.id}: rank {conn.rank} disconnected (its connection from "
                        f"{conn.peer} closed without BYE){pending}")
        self._maybe_finish(job)

    def _maybe_finish(self, job: _Job) -> None:
        """Forget the job once all its ranks are gone (an aborted one stays until then, so that a late
        rank's HELLO is told why instead of starting a new job under the same id)."""
        with self._lock:
            if job.conns or self._jobs.get(job.id) is not job:
                return
            del self._jobs[job.id]
            if not job.aborted:
                self._c["jobs_finished"] += 1
        if job.aborted:
            log.info("job %d (aborted) closed: no rank is connected any more", job.id)
            return
        log.info("job %d finished at the host aggregator: %d rounds (%s), in %s, out %s", job.id, job.rounds,
                 ", ".join(sorted(job.codec_names)) or "no codec", _mb(job.bytes_in), _mb(job.bytes_out))

    def _abort(self, job: _Job, reason: str, text: str, only_round: _Round | None = None) -> None:
        """Abort the job: drop its pending round, tell every connected rank (an ERROR frame), count it."""
        with self._lock:
            if job.aborted or (only_round is not None and job.round is not only_round):
                return
            job.aborted = text
            rnd = job.round.number if job.round is not None else JOB_ROUND
            job.round = None
            self._c["jobs_aborted"] += 1
            self._errors[reason] = self._errors.get(reason, 0) + 1
            conns = sorted(job.conns.items())
        log.warning("host aggregator: job %d aborted [%s]: %s", job.id, reason, text)
        for r, c in conns:
            self._send(c, Frame(FrameType.ERROR, job=job.id, rank=r, world_size=job.world_size, round=rnd,
                                meta={"reason": reason, "label": HOST_AGG_LABEL}, body=text.encode("utf-8")))

    # --------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Round deadlines (bounded waits) and the periodic progress line."""
        last_log = time.monotonic()
        last_rounds = 0
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                expired = [(j, j.round) for j in self._jobs.values() if j.round is not None and j.round.deadline <= now]
                if not expired:
                    waits = [j.round.deadline - now for j in self._jobs.values() if j.round is not None]
                    if self.stats_interval > 0:
                        waits.append(last_log + self.stats_interval - now)
                    self._cond.wait(timeout=max(0.001, min(waits + [1.0])))
            for job, rd in expired:
                missing = sorted(set(range(job.world_size)) - set(rd.msgs))
                never = [r for r in missing if r not in job.ever]
                self._abort(job, "timeout",
                            f"job {job.id} round {rd.number} ({rd.spec['codec']}, {rd.spec['elements']} elements): "
                            f"rank(s) {missing} did not deliver their message within {job.timeout:g} s of the first "
                            f"one; delivered: ranks {sorted(rd.msgs)}"
                            + (f"; rank(s) {never} never connected" if never else ""), only_round=rd)
            now = time.monotonic()
            if self.stats_interval > 0 and now - last_log >= self.stats_interval:
                with self._lock:
                    c, errors = dict(self._c), sum(self._errors.values())
                    active = sum(1 for j in self._jobs.values() if not j.aborted)
                if c["rounds"] != last_rounds or active:
                    log.info("host aggregator [NOT switch-feasible]: %d rounds (+%d in %.1f s), in %s, out %s, "
                             "%d jobs active, %d errors", c["rounds"], c["rounds"] - last_rounds, now - last_log,
                             _mb(c["bytes_in"]), _mb(c["bytes_out"]), active, errors)
                last_log, last_rounds = now, c["rounds"]


def _drain_and_close(sock: socket.socket, bound_s: float = 1.0, max_bytes: int = 1 << 20) -> None:
    """Half-close, then read what the peer still sends (bounded), so that it sees our ERROR frame and a
    clean end of stream instead of a reset (closing with unread input sends RST)."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(bound_s),
                                                                           int(bound_s % 1 * 1e6)))
        deadline, got = time.monotonic() + bound_s, 0
        while got < max_bytes and time.monotonic() < deadline:
            k = len(sock.recv(65536))
            if k == 0:
                break
            got += k
    except OSError:
        pass


# ------------------------------------------------------------------------------------------------
# the aggregator as a process of the switch service
# ------------------------------------------------------------------------------------------------
def _process_main(conn, host: str, port: int, fallback: bool, seed: int, stats_interval: float,
                  log_level: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # the service process stops us (Ctrl-C reaches both)
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        agg = HostAggregator(host, port, seed=seed, stats_interval=stats_interval, fallback_port=fallback)
    except OSError as e:
        conn.send(("err", f"host aggregator cannot listen on tcp {host}:{port}: {e}"))
        return
    agg.start()
    conn.send(("ok", agg.port))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):          # the service process is gone
            break
        if msg is None:
            break
        if msg == "stats":
            conn.send(("ok", agg.stats()))
        else:
            conn.send(("err", f"unknown request {msg!r} (stats, or None to stop)"))
    agg.stop()


class HostAggregatorProcess:
    """The aggregator in a process of its own, driven over a pipe by the switch service.

    ``port``: the TCP port (0: a free one); with ``fallback=True`` a taken port falls back to a
    free one (the service's default, port + 100). :meth:`wait_ready` returns the port in use.
    """

    def __init__(self, host: str, port: int, *, fallback: bool = False, seed: int = 0, stats_interval: float = 10.0,
                 log_level: str = "INFO"):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._lock = threading.Lock()
        self.host = host
        self.port: int | None = None
        self.proc = ctx.Process(target=_process_main, args=(child, host, port, fallback, seed, stats_interval,
                                                            log_level), name="ina-host-agg", daemon=True)
        self.proc.start()
        child.close()

    def wait_ready(self, timeout: float = 60.0) -> int:
        try:
            if not self._conn.poll(timeout):
                raise RuntimeError(f"the host aggregator did not start within {timeout:g} s")
            status, val = self._conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise RuntimeError(f"the host aggregator process exited (code {self.proc.exitcode}) before it was "
                               "ready") from None
        except RuntimeError:
            self.close()
            raise
        if status != "ok":
            self.close()
            raise ValueError(val)
        self.port = int(val)
        return self.port

    def info(self) -> dict:
        """What the switch's join config announces."""
        return {"port": self.port, "label": HOST_AGG_LABEL}

    def stats(self, timeout: float = 5.0) -> dict:
        with self._lock:
            try:
                self._conn.send("stats")
                if not self._conn.poll(timeout):
                    raise TimeoutError(f"the host aggregator did not answer 'stats' within {timeout:g} s")
                status, val = self._conn.recv()
            except (EOFError, OSError) as e:
                raise RuntimeError(f"the host aggregator process is gone (exit code {self.proc.exitcode}): "
                                   f"{e or type(e).__name__}") from None
        if status != "ok":
            raise RuntimeError(val)
        return val

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            try:
                self._conn.send(None)
            except OSError:
                pass
            self.proc.join(timeout)
            if self.proc.is_alive():
                log.warning("the host aggregator did not stop within %g s; terminating it", timeout)
                self.proc.terminate()
                self.proc.join(2)
            self._conn.close()
