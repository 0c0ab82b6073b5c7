"""The host aggregator's jobs and rounds: a state machine without sockets.

:class:`Rounds` takes the events of the aggregator's connections (a frame from a worker, a closed
connection, the clock) and answers with an :class:`Outcome`: the frames to send to whom, whether
to keep reading the connection, and a round whose messages are all in (the server then decodes,
sums and re-encodes it, ``switch_model/host_reduce.py``, and reports back with
:meth:`Rounds.round_sent`). It keeps the counters (``rounds``, ``messages``, ``jobs_*``, errors
by reason, per codec). It is not thread-safe: the server calls it under one lock.

The rules (``docs/host-protocol.md``): the first rank's HELLO defines a job (world size, timeout);
a round starts with its first DATA frame and completes when all ranks' messages are in; ranks that
disagree on the round, codec, codec options, element count or key, two ranks with the same random
state, a rank that does not deliver within the job's timeout of the round's first message, a rank
that disconnects or leaves, abort the job: every connected rank gets an ERROR frame naming the
ranks and values. An aborted job is kept until all its ranks are gone, so that a late rank's
HELLO is told why instead of starting a new job under the same id.
"""
from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass, field

from ina import compression
from ina.host_wire import HOST_AGG_LABEL, JOB_ROUND, MAX_WORLD, Frame, FrameType, error_frame

log = logging.getLogger("ina.switch.host_agg")

ERROR_REASONS = ("bad_magic", "bad_version", "bad_frame", "frame_too_large", "bad_token", "protocol", "mismatch",
                 "timeout", "disconnect", "left", "unknown_codec", "bad_codec_options", "same_seed", "decode", "encode",
                 "send_failed")
CODEC_COUNTERS = ("rounds", "messages", "elements", "bytes_in", "bytes_out", "decode_s", "sum_s", "encode_s")
ROUND_COUNTERS = ("rounds", "messages", "jobs_started", "jobs_finished", "jobs_aborted")
MAX_TIMEOUT = 86400.0
SPEC_FIELDS = (("round", "round number"), ("codec", "codec"), ("elements", "element count"), ("key", "tensor key"),
               ("options", "codec options"))


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class Peer:
    """A worker's connection as the rounds see it: its name, and once it joined, its job and rank."""

    def __init__(self, name: str):
        self.peer = name
        self.job: Job | None = None
        self.rank: int | None = None
        self.bye = False


class Round:
    def __init__(self, number: int, spec: dict, now: float, timeout: float):
        self.number = number
        self.spec = spec                  # codec, elements, key, options of the first message
        self.started = now
        self.deadline = now + timeout
        self.msgs: dict[int, Frame] = {}
        self.specs: dict[int, dict] = {}
        self.rng: dict[int, str] = {}


class Job:
    def __init__(self, job: int, world_size: int, timeout: float):
        self.id = job
        self.world_size = world_size
        self.timeout = timeout
        self.created = time.monotonic()
        self.conns: dict[int, Peer] = {}
        self.ever: set[int] = set()       # ranks that ever connected
        self.left: set[int] = set()       # ranks that said BYE
        self.round: Round | None = None
        self.next_round = 0
        self.codecs: dict[tuple, object] = {}    # the aggregator's codec objects, by (name, options)
        self.compute_lock = threading.Lock()     # held by the server while it runs a round's codec step
        self.aborted: str | None = None
        self.rounds = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.codec_names: set[str] = set()


@dataclass
class Outcome:
    """What the server does after an event."""
    sends: list = field(default_factory=list)   # (Peer, Frame) to send, in order
    keep: bool = True                            # keep reading the connection the event came from
    complete: Round | None = None                # all messages of this round of ``job`` are in
    job: Job | None = None
    round_started: bool = False                  # a new deadline (the watchdog recomputes its wait)


class Rounds:
    """Jobs, rounds and their counters (see the module doc)."""

    def __init__(self, token: str | None = None):
        self.token = token or None           # the switch service's shared token: HELLO must carry it
        self.jobs: dict[int, Job] = {}
        self.counters = dict.fromkeys(ROUND_COUNTERS, 0)
        self.errors = dict.fromkeys(ERROR_REASONS, 0)
        self.per_codec: dict[str, dict] = {}

    # -- counters ------------------------------------------------------------------------------
    def count_error(self, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1

    def codec_counters(self, name: str) -> dict:
        pc = self.per_codec.get(name)
        if pc is None:
            pc = self.per_codec[name] = {k: (0.0 if k.endswith("_s") else 0) for k in CODEC_COUNTERS}
        return pc

    def active_jobs(self) -> int:
        return sum(1 for j in self.jobs.values() if not j.aborted)

    def jobs_stats(self) -> dict:
        return {str(j.id): {"world_size": j.world_size, "connected": sorted(j.conns), "rounds": j.rounds,
                            "timeout": j.timeout, "codecs": sorted(j.codec_names), "aborted": j.aborted,
                            "pending_round": None if j.round is None else
                            {"round": j.round.number, "delivered": sorted(j.round.msgs),
                             "codec": j.round.spec["codec"], "elements": j.round.spec["elements"]}}
                for j in self.jobs.values()}

    # -- events ----------------------------------------------------------------------------------
    def on_frame(self, peer: Peer, f: Frame, now: float) -> Outcome:
        """A frame from a worker."""
        if f.type == FrameType.HELLO:
            return self.on_hello(peer, f)
        if f.type == FrameType.DATA:
            return self.on_data(peer, f, now)
        if f.type == FrameType.BYE:
            return self.on_bye(peer)
        text = f"unexpected {FrameType(f.type).name} frame from {peer.peer}: workers send HELLO, DATA and BYE"
        return self.refuse(peer, "protocol", text, f.job, keep=False)

    def refuse(self, peer: Peer, reason: str, text: str, job: int = 0, rnd: int = JOB_ROUND, *,
               keep: bool = True, count: bool = True) -> Outcome:
        """An error that concerns this connection only (the job, if any, goes on)."""
        if count:
            self.count_error(reason)
            log.warning("host aggregator: %s", text)
        return Outcome([(peer, self.error_to(peer, reason, text, job, rnd))], keep=keep)

    @staticmethod
    def error_to(peer: Peer, reason: str, text: str, job: int = 0, rnd: int = JOB_ROUND) -> Frame:
        return error_frame(reason, text, job=job, rank=peer.rank or 0,
                           world_size=peer.job.world_size if peer.job else 0, rnd=rnd)

    def on_hello(self, peer: Peer, f: Frame) -> Outcome:
        if peer.job is not None:
            return self.refuse(peer, "protocol", f"a second HELLO (job {f.job} rank {f.rank}) on a connection that "
                               f"joined job {peer.job.id} as rank {peer.rank}", f.job, keep=False)
        given = f.meta.get("token")
        if self.token is not None and not (isinstance(given, str) and
                                           hmac.compare_digest(given.encode(), self.token.encode())):
            return self.refuse(peer, "bad_token", f"refused bad token from {peer.peer}: job {f.job} rank {f.rank}: "
                               "HELLO needs the switch's shared token (INA_TOKEN) in its meta: "
                               + ("none given" if given is None else "wrong token"), f.job, keep=False)
        try:
            timeout = float(f.meta.get("timeout", 30.0))
        except (TypeError, ValueError):
            timeout = float("nan")
        if not 0 < timeout <= MAX_TIMEOUT:
            return self.refuse(peer, "bad_frame", f"job {f.job} rank {f.rank}: timeout {f.meta.get('timeout')!r} "
                               f"must be in (0, {MAX_TIMEOUT:g}] seconds", f.job, keep=False)
        if not 1 <= f.world_size <= MAX_WORLD or not 0 <= f.rank < f.world_size:
            return self.refuse(peer, "bad_frame", f"job {f.job}: rank {f.rank} out of range for world_size "
                               f"{f.world_size}", f.job, keep=False)
        job = self.jobs.get(f.job)
        created = job is None
        if created:
            job = self.jobs[f.job] = Job(f.job, f.world_size, timeout)
            self.counters["jobs_started"] += 1
        if job.aborted:    # ranks of the aborted job are still connected: a late rank hears why (counted before)
            return self.refuse(peer, "aborted", f"job {f.job} was aborted: {job.aborted}", f.job, keep=False,
                               count=False)
        err = self._join_error(job, f)
        if err:
            return self.refuse(peer, *err, job=f.job, keep=False)
        job.conns[f.rank] = peer
        job.ever.add(f.rank)
        peer.job, peer.rank = job, f.rank
        connected = sorted(job.conns)
        if created:
            log.info("job %d started at the host aggregator: %d ranks, timeout %g s [NOT switch-feasible]",
                     f.job, f.world_size, timeout)
        log.info("job %d: rank %d connected from %s (%d/%d)", f.job, f.rank, peer.peer, len(connected), f.world_size)
        return Outcome([(peer, Frame(FrameType.WELCOME, job=f.job, rank=f.rank, world_size=f.world_size,
                                     meta={"label": HOST_AGG_LABEL, "timeout": job.timeout, "connected": connected}))])

    @staticmethod
    def _join_error(job: Job, f: Frame) -> tuple[str, str] | None:
        if job.world_size != f.world_size:
            return "mismatch", (f"job {f.job}: rank {f.rank} says world_size {f.world_size}, ranks "
                                f"{sorted(job.conns)} joined with world_size {job.world_size}")
        if f.rank in job.conns:
            return "protocol", f"job {f.job}: rank {f.rank} is already connected (from {job.conns[f.rank].peer})"
        if f.rank in job.left:
            return "protocol", f"job {f.job}: rank {f.rank} has left the job and cannot rejoin it (use a new job id)"
        return None

    def on_data(self, peer: Peer, f: Frame, now: float) -> Outcome:
        job = peer.job
        if job is None:
            return self.refuse(peer, "protocol", f"DATA frame (job {f.job} rank {f.rank}) from {peer.peer} before "
                               "HELLO", f.job, f.round)
        spec, err = self._message_spec(peer, f)
        if err:
            return Outcome(self.abort(job, *err))
        where = f"job {job.id} round {f.round}"
        if job.aborted:   # this rank was told when the job was aborted; say it again to the sender
            return self.refuse(peer, "aborted", f"{where}: job {job.id} was aborted earlier: {job.aborted}", job.id,
                               f.round, count=False)
        out = Outcome(job=job)
        rd = job.round
        if job.left:
            err = ("left", f"{where}: rank(s) {sorted(job.left)} left the job, so the round cannot complete")
        elif rd is None and f.round != job.next_round:
            err = ("mismatch", f"job {job.id}: rank {f.rank} sent round {f.round}, the job is at round "
                   f"{job.next_round}")
        else:
            if rd is None:
                rd = job.round = Round(f.round, spec, now, job.timeout)
                out.round_started = True
            err = self._accept_message(job, rd, f, spec)
            if err is None and len(rd.msgs) == job.world_size:
                out.complete = rd
                job.round = None
                job.next_round += 1
        if err:
            out.sends = self.abort(job, *err)
            out.complete = None
            return out
        body_n = f.body_bytes
        self.counters["messages"] += 1
        pc = self.codec_counters(spec["codec"])
        pc["messages"] += 1
        pc["bytes_in"] += body_n
        job.bytes_in += body_n
        return out

    def _message_spec(self, peer: Peer, f: Frame) -> tuple[dict | None, tuple | None]:
        """What a DATA frame says about its round (round, codec, elements, key, options), or the
        (reason, text) of why it aborts the job."""
        job = peer.job
        if (f.job, f.rank, f.world_size) != (job.id, peer.rank, job.world_size):
            return None, ("protocol", f"job {job.id}: a DATA frame on rank {peer.rank}'s connection says job "
                          f"{f.job} rank {f.rank} world_size {f.world_size}")
        where = f"job {job.id} round {f.round}"
        try:
            name = compression.by_wire_id(f.codec).name
        except ValueError:
            return None, ("unknown_codec", f"{where}: rank {f.rank} sent codec wire id {f.codec}, which no codec "
                          "of this aggregator has")
        options = f.meta.get("options", {})
        if not isinstance(options, dict) or not all(v is None or isinstance(v, (bool, int, float, str))
                                                    for v in options.values()):
            return None, ("bad_frame", f"{where}: rank {f.rank}'s codec options {options!r} are not an object of "
                          "scalars")
        body_n = f.body_bytes
        if body_n > 16 * f.count + (1 << 20):
            return None, ("bad_frame", f"{where}: rank {f.rank}'s {name} message of {body_n} bytes is too large "
                          f"for {f.count} elements")
        return {"round": f.round, "codec": name, "elements": f.count, "key": f.key,
                "options": json.dumps(options, sort_keys=True)}, None

    @staticmethod
    def _accept_message(job: Job, rd: Round, f: Frame, spec: dict):
        """Add rank f.rank's message to the round; an (reason, text) error or None."""
        if f.rank in rd.msgs:
            return "protocol", f"job {job.id} round {rd.number}: rank {f.rank} sent its message twice"
        rd.msgs[f.rank] = f
        rd.specs[f.rank] = spec
        for name, what in SPEC_FIELDS:
            vals = {r: s[name] for r, s in sorted(rd.specs.items())}
            if len(set(vals.values())) > 1:
                return "mismatch", (f"job {job.id} round {rd.number}: ranks disagree on the {what}: "
                                    + ", ".join(f"rank {r}: {v!r}" if name != "options" else f"rank {r}: {v}"
                                                for r, v in vals.items()))
        fp = f.meta.get("rng")
        if fp:
            same = sorted(r for r, other in rd.rng.items() if other == fp)
            rd.rng[f.rank] = fp
            if same:
                return "same_seed", (f"job {job.id} round {rd.number}: ranks {sorted(same + [f.rank])} use "
                                     f"{spec['codec']} codec objects with the same random state; give every rank's "
                                     "codec its own seed (e.g. seed=rank)")
        return None

    def round_sent(self, job: Job, rd: Round, sent: int, body_bytes: int, times: tuple[float, float, float]) -> None:
        """The round's result went to ``sent`` ranks (``body_bytes`` each); times: decode, sum, encode (s)."""
        name, n = rd.spec["codec"], int(rd.spec["elements"])
        self.counters["rounds"] += 1
        job.rounds += 1
        job.bytes_out += body_bytes * sent
        pc = self.codec_counters(name)
        pc["rounds"] += 1
        pc["elements"] += n
        pc["bytes_out"] += body_bytes * sent
        pc["decode_s"] += times[0]
        pc["sum_s"] += times[1]
        pc["encode_s"] += times[2]

    def on_bye(self, peer: Peer) -> Outcome:
        job = peer.job
        out = Outcome(keep=False)
        if job is None:
            return out
        peer.bye = True
        if job.conns.get(peer.rank) is peer:
            del job.conns[peer.rank]
        job.left.add(peer.rank)
        rd = job.round
        log.info("job %d: rank %d left", job.id, peer.rank)
        if rd is not None and not job.aborted:
            out.sends = self.abort(job, "left", f"job {job.id}: rank {peer.rank} left the job during round "
                                   f"{rd.number} (delivered: ranks {sorted(rd.msgs)})")
        self._maybe_finish(job)
        return out

    def on_closed(self, peer: Peer) -> Outcome:
        """The connection closed (after BYE, or not)."""
        job = peer.job
        out = Outcome(keep=False)
        if job is None or peer.bye or job.conns.get(peer.rank) is not peer:
            return out
        del job.conns[peer.rank]
        rd = job.round
        if not job.aborted:
            pending = f"; round {rd.number} had messages from ranks {sorted(rd.msgs)}" if rd is not None else ""
            out.sends = self.abort(job, "disconnect", f"job {job.id}: rank {peer.rank} disconnected (its connection "
                                   f"from {peer.peer} closed without BYE){pending}")
        self._maybe_finish(job)
        return out

    def expire(self, now: float) -> tuple[int, list]:
        """Abort the jobs whose pending round is past its deadline: (how many, the ERROR frames to send)."""
        expired = [(j, j.round) for j in self.jobs.values() if j.round is not None and j.round.deadline <= now]
        sends = []
        for job, rd in expired:
            missing = sorted(set(range(job.world_size)) - set(rd.msgs))
            never = [r for r in missing if r not in job.ever]
            sends += self.abort(job, "timeout",
                                f"job {job.id} round {rd.number} ({rd.spec['codec']}, {rd.spec['elements']} "
                                f"elements): rank(s) {missing} did not deliver their message within {job.timeout:g} s "
                                f"of the first one; delivered: ranks {sorted(rd.msgs)}"
                                + (f"; rank(s) {never} never connected" if never else ""), only_round=rd)
        return len(expired), sends

    def next_deadline(self) -> float | None:
        return min((j.round.deadline for j in self.jobs.values() if j.round is not None), default=None)

    def abort(self, job: Job, reason: str, text: str, only_round: Round | None = None) -> list:
        """Abort the job: drop its pending round, count it; the ERROR frames for every connected rank."""
        if job.aborted or (only_round is not None and job.round is not only_round):
            return []
        job.aborted = text
        rnd = job.round.number if job.round is not None else JOB_ROUND
        job.round = None
        self.counters["jobs_aborted"] += 1
        self.count_error(reason)
        log.warning("host aggregator: job %d aborted [%s]: %s", job.id, reason, text)
        return [(c, error_frame(reason, text, job=job.id, rank=r, world_size=job.world_size, rnd=rnd))
                for r, c in sorted(job.conns.items())]

    def _maybe_finish(self, job: Job) -> None:
        """Forget the job once all its ranks are gone."""
        if job.conns or self.jobs.get(job.id) is not job:
            return
        del self.jobs[job.id]
        if job.aborted:
            log.info("job %d (aborted) closed: no rank is connected any more", job.id)
            return
        self.counters["jobs_finished"] += 1
        log.info("job %d finished at the host aggregator: %d rounds (%s), in %s, out %s", job.id, job.rounds,
                 ", ".join(sorted(job.codec_names)) or "no codec", mb(job.bytes_in), mb(job.bytes_out))
