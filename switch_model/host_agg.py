"""Host-aggregator mode of the switch service: a reduce on a host CPU, NOT switch-feasible.

Codecs whose messages are variable-length (``3lc``: quartic + zero-run, ``eaq``: Huffman, ``wgt``:
sparse whole values) cannot be summed by an integer switch at line rate. ``ina-switch serve`` runs
this aggregator next to the data plane, in its own process (so that it does not take the GIL from
the switch's poll loop), on its own TCP port (``--host-agg-port``, default the switch's port + 100).
It works like 3LC's parameter servers (``docs/host-protocol.md``). Three parts:

* the protocol, declared once in :mod:`ina.host_wire`;
* the jobs and rounds, a state machine without sockets: :mod:`switch_model.host_rounds`;
* the codec step (decode, sum in float64 in rank order, re-encode with the aggregator's own codec
  object per job: the downlink compression 3LC does at its servers): :mod:`switch_model.host_reduce`;

and here, the thin TCP server around them (:class:`HostAggregator`: one thread per worker
connection, a watchdog thread for the round deadlines and the progress line) and the process
wrapper the service drives (:class:`HostAggregatorProcess`). A frame with a wrong magic or version
is answered with an ERROR frame, counted, and the connection is closed. Counters reach
``ina-switch stats`` under the ``host_aggregator`` key; the switch's ``join`` config announces
``host_aggregator: {"port": P, "label": "...NOT switch-feasible..."}``.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import socket
import socketserver
import sys
import threading
import time

from ina.errors import ConnectionGone, FrameError
from ina.host_wire import (HOST_AGG_LABEL, MAX_BODY, Frame, FrameType, frame_parts, recv_frame, set_recv_timeout,
                           set_send_timeout)

from .host_reduce import RoundFailed, aggregator_seed, downlink_codec, reduce_round
from .host_rounds import ERROR_REASONS, Job, Outcome, Peer, Round, Rounds, mb

log = logging.getLogger("ina.switch.host_agg")

__all__ = ["HostAggregator", "HostAggregatorProcess", "aggregator_seed", "ERROR_REASONS"]
TRANSPORT_COUNTERS = ("connections", "frames_in", "bytes_in", "frames_out", "bytes_out")


class _Conn(Peer):
    def __init__(self, sock: socket.socket, peer):
        super().__init__(f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer))
        self.sock = sock
        self.send_lock = threading.Lock()


class HostAggregator:
    """The aggregator: a threaded TCP server (one thread per worker connection) plus a watchdog
    thread that enforces the round deadlines and logs a progress line every ``stats_interval`` s."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0, *, seed: int = 0, stats_interval: float = 10.0,
                 max_body: int = MAX_BODY, frame_timeout: float = 30.0, fallback_port: bool = False,
                 token: str | None = None):
        self.seed = int(seed)
        self.stats_interval = float(stats_interval)
        self.max_body = int(max_body)
        self.frame_timeout = float(frame_timeout)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.rounds = Rounds(token)              # guarded by self._lock
        self._conns: set[_Conn] = set()
        self._stopped = False
        self._started = time.monotonic()
        self._c = dict.fromkeys(TRANSPORT_COUNTERS, 0)
        self.server = self._listen(host, port, fallback_port)
        self.host = host
        self.port = self.server.server_address[1]
        self._threads: list[threading.Thread] = []

    def _listen(self, host: str, port: int, fallback_port: bool) -> socketserver.ThreadingTCPServer:
        agg = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                agg._serve_connection(self.request, self.client_address)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        server = Server((host, port), Handler, bind_and_activate=False)
        try:
            server.server_bind()
        except OSError as e:
            if not fallback_port or port == 0:
                server.server_close()
                raise
            log.warning("host aggregator: tcp port %d is taken (%s); using a free port instead", port, e)
            server.server_address = (host, 0)
            server.server_bind()
        server.server_activate()
        return server

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
        c = {**self._c, **self.rounds.counters}
        log.info("host aggregator stopped: %d rounds, %d messages, in %s, out %s, %d jobs (%d aborted), "
                 "%d errors", c["rounds"], c["messages"], mb(c["bytes_in"]), mb(c["bytes_out"]),
                 c["jobs_started"], c["jobs_aborted"], sum(self.rounds.errors.values()))

    def stats(self) -> dict:
        with self._lock:
            r = self.rounds
            return {"label": HOST_AGG_LABEL, "port": self.port, "seed": self.seed, "max_body": self.max_body,
                    "token_required": r.token is not None,
                    "uptime_s": round(time.monotonic() - self._started, 3),
                    "process_cpu_ns": time.process_time_ns(),      # this process's CPU (every thread)
                    "counters": {**self._c, **r.counters, "connections_open": len(self._conns),
                                 "jobs_active": r.active_jobs()},
                    "errors": dict(r.errors),
                    "per_codec": {k: dict(v) for k, v in r.per_codec.items()},
                    "jobs": r.jobs_stats()}

    # --------------------------------------------------------------------------------------------
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
            with self._lock:
                self.rounds.count_error("send_failed")
            return False
        n = len(head) + len(parts[3])
        with self._lock:
            self._c["frames_out"] += 1
            self._c["bytes_out"] += n
        return True

    def _send_all(self, sends) -> int:
        return sum(self._send(conn, frame) for conn, frame in sends)

    def _act(self, out: Outcome) -> bool:
        """Carry out an event's outcome (outside the lock); False closes the connection."""
        self._send_all(out.sends)
        if out.complete is not None:
            self._complete(out.job, out.complete)
        return out.keep

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
            while self._serve_frame(conn):
                pass
        finally:
            with self._lock:
                self._conns.discard(conn)
                out = self.rounds.on_closed(conn)
            self._act(out)
            try:
                sock.close()
            except OSError:
                pass

    def _serve_frame(self, conn: _Conn) -> bool:
        """Read and handle one frame; False ends the connection."""
        try:
            f = recv_frame(conn.sock, self.max_body, rest_timeout=self.frame_timeout)
        except FrameError as e:
            job = conn.job.id if conn.job else 0
            log.warning("host aggregator: refusing the connection from %s (job %s rank %s): %s",
                        conn.peer, conn.job.id if conn.job else "-", conn.rank, e)
            with self._lock:
                self.rounds.count_error(e.reason)
            self._send(conn, Rounds.error_to(conn, e.reason, f"host aggregator refused the connection: {e}", job))
            _drain_and_close(conn.sock)
            return False
        except ConnectionGone as e:
            if conn.job is not None:
                log.debug("host aggregator: %s: %s", conn.peer, e)
            return False
        except OSError as e:        # reset by the peer, or shut down by stop()
            log.debug("host aggregator: %s: %s", conn.peer, e)
            return False
        if f is None:
            return False
        with self._cond:
            self._c["frames_in"] += 1
            self._c["bytes_in"] += f.nbytes
            out = self.rounds.on_frame(conn, f, time.monotonic())
            if out.round_started:
                self._cond.notify_all()
        return self._act(out)

    # --------------------------------------------------------------------------------------------
    def _complete(self, job: Job, rd: Round) -> None:
        """Decode, sum, re-encode and send one round's result (the last message's thread runs it)."""
        name, n, key = rd.spec["codec"], int(rd.spec["elements"]), rd.spec["key"]
        where = f"job {job.id} round {rd.number} ({name}, {n} elements)"
        with job.compute_lock:
            try:
                codec = downlink_codec(job.codecs, job.id, name, rd.spec["options"], self.seed, where)
                job.codec_names.add(name)
                res = reduce_round(codec, [rd.msgs[r] for r in range(job.world_size)], n, key, where)
            except RoundFailed as e:
                with self._lock:
                    sends = self.rounds.abort(job, e.reason, str(e))
                self._send_all(sends)
                return
        with self._lock:
            conns = dict(job.conns)
        sent = self._send_all((conns[r], Frame(FrameType.RESULT, res.flags, job.id, r, job.world_size, rd.number,
                                               rd.msgs[r].codec, n, key, res.meta, res.body))
                              for r in range(job.world_size) if r in conns)
        with self._lock:
            self.rounds.round_sent(job, rd, sent, res.body.nbytes, (res.decode_s, res.sum_s, res.encode_s))
        log.debug("%s: %d messages decoded in %.3f s, sum re-encoded in %.3f s (%d bytes) and sent to %d ranks",
                  where, job.world_size, res.decode_s, res.encode_s, res.body.nbytes, sent)

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
                expired, sends = self.rounds.expire(now)
                if not expired:
                    waits = [1.0]
                    deadline = self.rounds.next_deadline()
                    if deadline is not None:
                        waits.append(deadline - now)
                    if self.stats_interval > 0:
                        waits.append(last_log + self.stats_interval - now)
                    self._cond.wait(timeout=max(0.001, min(waits)))
            self._send_all(sends)
            now = time.monotonic()
            if self.stats_interval > 0 and now - last_log >= self.stats_interval:
                last_log, last_rounds = now, self._progress(now - last_log, last_rounds)

    def _progress(self, span: float, last_rounds: int) -> int:
        """Log a progress line (if anything happened); returns the rounds so far."""
        with self._lock:
            c = {**self._c, **self.rounds.counters}
            errors = sum(self.rounds.errors.values())
            active = self.rounds.active_jobs()
        if c["rounds"] != last_rounds or active:
            log.info("host aggregator [NOT switch-feasible]: %d rounds (+%d in %.1f s), in %s, out %s, "
                     "%d jobs active, %d errors", c["rounds"], c["rounds"] - last_rounds, span,
                     mb(c["bytes_in"]), mb(c["bytes_out"]), active, errors)
        return c["rounds"]


def _drain_and_close(sock: socket.socket, bound_s: float = 1.0, max_bytes: int = 1 << 20) -> None:
    """Half-close, then read what the peer still sends (bounded), so that it sees our ERROR frame and a
    clean end of stream instead of a reset (closing with unread input sends RST)."""
    try:
        sock.shutdown(socket.SHUT_WR)
        set_recv_timeout(sock, bound_s)
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
                  log_level: str, max_body: int, token: str | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # the service process stops us (Ctrl-C reaches both)
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        agg = HostAggregator(host, port, seed=seed, stats_interval=stats_interval, fallback_port=fallback,
                             max_body=max_body, token=token)
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
    conn.close()
    from .cli import end_process
    end_process(0)


class HostAggregatorProcess:
    """The aggregator in a process of its own, driven over a pipe by the switch service.

    ``port``: the TCP port (0: a free one); with ``fallback=True`` a taken port falls back to a
    free one (the service's default, port + 100). :meth:`wait_ready` returns the port in use.
    """

    def __init__(self, host: str, port: int, *, fallback: bool = False, seed: int = 0, stats_interval: float = 10.0,
                 log_level: str = "INFO", max_body: int = MAX_BODY, token: str | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._lock = threading.Lock()
        self.host = host
        self.port: int | None = None
        self.proc = ctx.Process(target=_process_main, name="ina-host-agg", daemon=True,
                                args=(child, host, port, fallback, seed, stats_interval, log_level, max_body, token))
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

    def close(self, timeout: float = 30.0) -> None:
        """Stop the aggregator and wait (at most ``timeout`` s, then SIGTERM) for its process to end: it
        logs its last line within a second, but ending a spawned interpreter takes seconds on a loaded machine."""
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
