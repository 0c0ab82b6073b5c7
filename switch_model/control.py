"""The switch's control plane: job registration (a rendezvous of the job's workers), liveness,
stats and impairment settings, as JSON lines over TCP on the data plane's port number.

Each worker keeps its join connection open for the life of the job. If it closes without a
"leave" (the worker died, or exited without closing its client), the switch keeps the job for a
grace period (``grace`` seconds): a peer whose last result was lost can still get it replayed.
Then the job is torn down, its slots freed and the other workers get an ABORT packet naming the
rank; ``status`` of the job then says why (``ended``), and for a live job which ranks left cleanly
(``left``) and which disconnected (``disconnected``).

Limits (docs/switch.md, "Control plane"): with a shared token, "join" and "impair" must carry it
("token"); a request line is at most ``max_line`` bytes; at most ``max_connections`` connections are
open; a connection that has not joined a job is closed after ``idle_s`` seconds without a request;
a join waits at most ``max_join_wait`` seconds for the other ranks. Refusals are logged and counted
(stats "control").
"""
from __future__ import annotations

import hmac
import json
import logging
import socket
import socketserver
import threading
import time
from collections import Counter

from ina.wire import MAX_WORKERS

log = logging.getLogger("ina.switch.control")
DISCONNECT_GRACE = 2.0     # seconds a job outlives a member's disconnect (replays of its last round)
ENDED_KEPT = 256           # why the last this many jobs ended, for the ranks' error messages


class _Pending:
    def __init__(self, spec: dict):
        self.spec = spec
        self.members: dict[int, tuple] = {}
        self.groups: dict[int, str | None] = {}     # the multicast group each rank joined (None: none)
        self.cond = threading.Condition()
        self.result: dict | None = None
        self.error: str | None = None


MAX_LINE = 64 * 1024          # bytes of one request line
MAX_CONNECTIONS = 512         # open control connections (every worker of every job holds one)
IDLE_S = 60.0                 # a connection that has not joined: seconds to its next request
MAX_JOIN_WAIT = 600.0         # longest rendezvous a join may ask for
TOKEN_OPS = ("join", "impair")  # the operations that need the shared token when one is set


class Refused(ValueError):
    """A request refused by a limit or the token check (counted under ``reason``)."""

    def __init__(self, reason: str, msg: str):
        super().__init__(msg)
        self.reason = reason


class ControlPlane:
    def __init__(self, switch, host: str = "127.0.0.1", host_agg=None, token: str | None = None,
                 max_line: int = MAX_LINE, max_connections: int = MAX_CONNECTIONS, idle_s: float = IDLE_S,
                 grace: float = DISCONNECT_GRACE, profile=None, max_join_wait: float = MAX_JOIN_WAIT):
        from ina.profiles import get_profile
        self.switch = switch
        self.profile = profile or get_profile(None)   # ina.profiles.SwitchProfile: what the device imposes
        self.grace = float(grace)
        self._gone: dict[int, set] = {}      # job -> ranks that disconnected without leaving
        self._ended: dict[int, str] = {}     # job -> why it was torn down
        self.host_agg = host_agg      # switch_model.host_agg.HostAggregatorProcess, or None
        self.token = token or None
        self.max_line, self.max_connections, self.idle_s = int(max_line), int(max_connections), float(idle_s)
        self.max_join_wait = float(max_join_wait)
        self.refused: Counter = Counter()     # reason -> refused requests and connections
        self.connections = 0
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._left: dict[int, set] = {}
        plane = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                plane._serve_connection(self)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self.server = Server((host, switch.port), Handler)

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.server.serve_forever, name="control", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # --------------------------------------------------------------------------------------------
    def _refuse(self, reason: str, peer, what: str) -> Refused:
        with self._lock:
            self.refused[reason] += 1
        log.warning("refused %s from %s:%d: %s", reason.replace("_", " "), peer[0], peer[1], what)
        return Refused(reason, what)

    def _check_token(self, msg: dict, op, peer) -> None:
        if self.token is None or op not in TOKEN_OPS:
            return
        given = msg.get("token")
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), self.token.encode()):
            raise self._refuse("bad_token", peer, f"{op!r} needs the switch's shared token (INA_TOKEN): "
                                                  + ("none given" if given is None else "wrong token"))

    def _lines(self, h, peer, joined):
        """The connection's request lines, each at most max_line bytes; before a join, each within idle_s."""
        while True:
            h.connection.settimeout(None if joined() else self.idle_s)
            try:
                line = h.rfile.readline(self.max_line + 1)
            except socket.timeout:
                raise self._refuse("idle", peer, f"no request within {self.idle_s:g} s (a connection that has "
                                                 "not joined a job is closed when idle)") from None
            if not line:
                return
            if len(line) > self.max_line:
                raise self._refuse("line_too_long", peer, f"request line longer than {self.max_line} bytes")
            yield line

    def control_stats(self) -> dict:
        with self._lock:
            return {"connections": self.connections, "max_connections": self.max_connections,
                    "max_line": self.max_line, "idle_s": self.idle_s, "max_join_wait": self.max_join_wait,
                    "token_required": self.token is not None, "refused": dict(self.refused)}

    def _serve_connection(self, h) -> None:
        peer = h.client_address
        with self._lock:
            self.connections += 1
            over = self.connections > self.max_connections
        try:
            if over:
                raise self._refuse("too_many_connections", peer,
                                   f"{self.max_connections} control connections are already open")
            self._requests(h, peer)
        except Refused as e:
            self._reply(h, {"ok": False, "error": str(e)})
        finally:
            with self._lock:
                self.connections -= 1

    @staticmethod
    def _reply(h, out: dict) -> None:
        try:
            h.wfile.write(json.dumps(out).encode() + b"\n")
            h.wfile.flush()
        except OSError:
            pass

    def _requests(self, h, peer) -> None:
        joined: tuple | None = None   # (job, rank) once this connection joined a job
        left = False
        try:
            for line in self._lines(h, peer, lambda: joined is not None):
                try:
                    msg = json.loads(line)
                    if not isinstance(msg, dict):
                        raise ValueError(f"a request is a JSON object with an \"op\" field, got a JSON "
                                         f"{type(msg).__name__}: {line[:80].decode(errors='replace').strip()}")
                    op = msg.get("op")
                    self._check_token(msg, op, peer)
                    if op == "join":
                        if joined:
                            raise ValueError(f"this connection already joined job {joined[0]} as rank {joined[1]}")
                        reply = self._join(msg, peer)
                        joined = (int(msg["job"]), int(msg["rank"]), reply["config"]["incarnation"])
                    elif op == "leave":
                        if not joined:
                            raise ValueError("leave without join")
                        self._leave(*joined[:2])
                        left = True
                        reply = {}
                    elif op == "stats":
                        reply = {"stats": {**self.switch.dp("stats"), "control": self.control_stats(),
                                           "profile": self.profile.describe()}}
                        if self.host_agg is not None:
                            reply["stats"]["host_aggregator"] = self._host_agg_stats()
                    elif op == "status":
                        reply = {"status": self._status(int(msg["job"]))}
                    elif op == "impair":
                        reply = {"impairments": self.switch.dp("set_impairments", msg.get("ingress"),
                                                               msg.get("egress"))}
                    else:
                        raise ValueError(f"unknown op {op!r} (join, leave, status, stats, impair)")
                    out = {"ok": True, **reply}
                except Refused:
                    raise
                except (ValueError, KeyError, TypeError, TimeoutError) as e:
                    out = {"ok": False, "error": str(e) if not isinstance(e, KeyError) else f"missing field {e}"}
                self._reply(h, out)
                if left:
                    break
        except OSError:
            pass
        finally:
            if joined and not left:
                self._worker_gone(*joined)

    def _join(self, msg: dict, peer) -> dict:
        job, rank, n = int(msg["job"]), int(msg["rank"]), int(msg["world_size"])
        host = msg.get("host") or peer[0]
        addr = (host, int(msg["udp_port"]))
        spec = {"world_size": n, "slots": int(msg.get("slots", 64)), "elements": int(msg.get("elements", 1024)),
                "raw": bool(msg.get("raw", False))}
        timeout = float(msg.get("timeout", 30.0))
        if not timeout >= 0:           # NaN included: a wait for it never runs out
            raise ValueError(f"join timeout must be a number of seconds >= 0, got {msg.get('timeout')!r}")
        timeout = min(timeout, self.max_join_wait)
        if not 0 <= rank < n:
            raise ValueError(f"rank {rank} out of range for world_size {n}")
        # what the switch can never install is refused now, not after the whole rendezvous
        if not 0 <= job <= 0xFFFF:
            raise ValueError(f"job id {job} out of range 0..65535 (16-bit job field)")
        if n > MAX_WORKERS:
            raise ValueError(f"a job has 1..{MAX_WORKERS} workers (one 64-bit worker bitmap), got world_size {n}")
        self.profile.check_join(n, spec["elements"], spec["raw"], len(self.switch.job_info) + len(self._pending) -
                                (job in self._pending), codecs=[str(c) for c in msg.get("codecs", ())])
        cfg = self.switch.cfg
        if not 1 <= spec["elements"] <= cfg.elements:
            raise ValueError(f"elements per packet {spec['elements']} exceeds the switch's {cfg.elements} registers "
                             f"per slot" if spec["elements"] > 0 else
                             f"elements per packet must be at least 1, got {spec['elements']}")
        if not 1 <= spec["slots"] <= cfg.slots:
            raise ValueError(f"job {job} asks for {spec['slots']} slots; the switch's pool has 1..{cfg.slots}")
        with self._lock:
            if job in self.switch.job_info:
                raise ValueError(f"job {job} is already running on this switch")
            p = self._pending.get(job)
            if p is None:
                p = self._pending[job] = _Pending(spec)
            if p.spec != spec:
                raise ValueError(f"job {job}: rank {rank} asks for {spec}, other ranks joined with {p.spec}")
            if rank in p.members:
                raise ValueError(f"job {job}: rank {rank} has already joined")
            p.members[rank] = addr
            p.groups[rank] = msg.get("multicast_group")
            log.info("job %d: rank %d joined from %s:%d (%d/%d)", job, rank, addr[0], addr[1], len(p.members), n)
            if len(p.members) == n:
                del self._pending[job]
                try:
                    info = self.switch.dp("install_job", job, n, spec["slots"], spec["elements"], spec["raw"],
                                          [p.members[r] for r in range(n)], groups=[p.groups[r] for r in range(n)])
                    p.result = {"job": job, "slot_lo": info.slot_lo, "slots": spec["slots"], "ports": self.switch.ports,
                                "elements": info.elements,
                                "raw": info.raw, "register_bits": self.switch.cfg.register_bits, "world_size": n,
                                "incarnation": info.created, "profile": self.profile.name,
                                "multicast": info.group_addr >= 0, "results_from": info.results_from or None}
                    if self.host_agg is not None:
                        p.result["host_aggregator"] = self.host_agg.info()
                    self._left[job] = set()
                    self._ended.pop(job, None)
                except (ValueError, TimeoutError) as e:
                    p.error = str(e)
                with p.cond:
                    p.cond.notify_all()
        deadline = time.monotonic() + timeout
        with p.cond:
            while p.result is None and p.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                p.cond.wait(left)
        if p.result is not None:
            return {"config": p.result}
        if p.error is not None:
            raise ValueError(p.error)
        with self._lock:
            p.members.pop(rank, None)
            missing = sorted(set(range(n)) - set(p.members) - {rank})
            if not p.members and self._pending.get(job) is p:
                del self._pending[job]
        raise ValueError(f"job {job}: timed out after {timeout:g} s waiting for ranks {missing} to join")

    def _host_agg_stats(self) -> dict:
        try:
            return self.host_agg.stats()
        except (RuntimeError, TimeoutError) as e:
            return {**self.host_agg.info(), "error": str(e)}

    def _status(self, job: int) -> dict:
        st = self.switch.dp("job_status", job)
        with self._lock:
            if st.get("active"):
                st["left"] = sorted(self._left.get(job, ()))
                st["disconnected"] = sorted(self._gone.get(job, ()))
            elif job in self._ended:
                st["ended"] = self._ended[job]
        return st

    def _end(self, job: int, reason: str, notify_rank: int | None = None, incarnation: float | None = None) -> None:
        """Tear the job down (ABORT to the others with ``notify_rank``), keeping the reason for ``status``."""
        with self._lock:
            self._ended[job] = reason           # before the ABORT: an aborted rank asks for it at once
            while len(self._ended) > ENDED_KEPT:
                self._ended.pop(next(iter(self._ended)))
            self._left.pop(job, None)
            self._gone.pop(job, None)
        try:
            self.switch.dp("remove_job", job, reason, notify_rank=notify_rank, incarnation=incarnation)
        except TimeoutError as e:
            log.error("could not tear down job %d: %s", job, e)

    def _departed(self, job: int) -> tuple[list, list, bool]:
        """(ranks that left, ranks that disconnected, whether that is every rank). Holds the lock."""
        info = self.switch.job_info.get(job)
        left, gone = self._left.setdefault(job, set()), self._gone.setdefault(job, set())
        return sorted(left), sorted(gone), info is not None and len(left | gone) >= info.n_workers

    def _leave(self, job: int, rank: int) -> None:
        with self._lock:
            self._left.setdefault(job, set()).add(rank)
            _, gone, done = self._departed(job)
        log.info("job %d: rank %d left", job, rank)
        if done:
            self._end(job, "all workers left" + (f" (rank(s) {gone} disconnected without leaving)" if gone else ""))

    def _worker_gone(self, job: int, rank: int, incarnation: float) -> None:
        info = self.switch.job_info.get(job)
        if info is None or info.created != incarnation:
            return   # that job is already gone (another rank's departure tore it down)
        with self._lock:
            self._gone.setdefault(job, set()).add(rank)
            left, _, done = self._departed(job)
        if done:
            self._end(job, f"every worker left or disconnected (rank {rank} disconnected without leaving)",
                      incarnation=incarnation)
            return
        log.warning("job %d: rank %d closed its control connection without leaving; the job answers replays for "
                    "%g s, then the other ranks are aborted", job, rank, self.grace)
        t = threading.Timer(self.grace, self._abort_after_grace, (job, rank, incarnation))
        t.daemon = True
        t.start()

    def _abort_after_grace(self, job: int, rank: int, incarnation: float) -> None:
        info = self.switch.job_info.get(job)
        if info is None or info.created != incarnation:
            return   # every other rank left meanwhile, or another departure already tore it down
        with self._lock:
            left = sorted(self._left.get(job, ()))
        reason = (f"rank {rank} disconnected without leaving the job (its control connection closed: it crashed, "
                  f"was killed or exited without closing its client); the switch answered replays for {self.grace:g} "
                  f"s, then aborted the job" + (f"; rank(s) {left} had left cleanly" if left else ""))
        log.warning("job %d: %s", job, reason)
        self._end(job, reason, notify_rank=rank, incarnation=incarnation)
