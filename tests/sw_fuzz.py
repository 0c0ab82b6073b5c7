"""Packet fuzzing for the switch: hypothesis strategies for bad packets, each tagged with the drop
reason the switch must count it under, and a model of valid slot-protocol scenarios.

Bad packets are built field by field so that exactly one validation rule fails (in the order the
switch checks them, docs/switch.md); fully random packets are classified by :func:`classify`, a
from-the-spec model of that order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from ina.wire import HEADER_DTYPE, HEADER_SIZE, TRAILER_SIZE, VERSION, Flag, MsgType, chunk_modulus, sparse_next_ok

HDR = HEADER_SIZE
WIDTH = {0: 0, 1: 1, 2: 4, 3: 8, 4: 1, 5: 1}    # bytes per element by payload type (NONE NC8 INT32 INT64 INT8 INT8_NARROW)
PAYLOAD_TYPES = tuple(WIDTH)
DATA = int(MsgType.DATA)


@dataclass(frozen=True)
class JobSpec:
    job: int
    n_workers: int
    slots: int
    elements: int


def header(*, version=VERSION, msg_type=DATA, flags=0, job=0, rank=0, slot=0, codec=3, ptype=2, count=0,
           exponent=0, chunk=0) -> bytes:
    h = np.zeros(1, HEADER_DTYPE)
    for k, v in dict(version=version, msg_type=msg_type, flags=flags, job=job, rank=rank, slot=slot, codec=codec,
                     payload_type=ptype, count=count, exponent=exponent, chunk=chunk).items():
        h[k] = v
    return h.tobytes()


def fill(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def classify(pkt: bytes, jobs: dict[int, JobSpec], stride: int, joined_source: bool = False) -> str:
    """The drop reason of a packet by the documented parse order ("ok" if it passes parsing);
    ``joined_source``: sent from the address its rank joined from (else it ends as foreign_source)."""
    ln = len(pkt)
    if ln < HDR or ln > stride:
        return "truncated"
    h = np.frombuffer(pkt[:HDR], HEADER_DTYPE)[0]
    if h["version"] != VERSION:
        return "bad_version"
    if h["msg_type"] != DATA:
        return "bad_msg_type"
    pt = int(h["payload_type"])
    if pt not in WIDTH:
        return "bad_payload_type"
    j = jobs.get(int(h["job"]))
    if j is None:
        return "unknown_job"
    sparse = bool(int(h["flags"]) & Flag.SPARSE)
    if ln != HDR + WIDTH[pt] * j.elements + (TRAILER_SIZE if sparse else 0):
        return "bad_length"
    if h["count"] > j.elements or (pt == 0 and h["count"] != 0):
        return "bad_count"
    if h["rank"] >= j.n_workers:
        return "unknown_worker"
    pool, shadow = int(h["slot"]) & 0x7FFF, int(h["slot"]) >> 15
    if pool >= j.slots:
        return "slot_out_of_range"
    c = int(h["chunk"])
    if c >= chunk_modulus(j.slots) or c % j.slots != pool or (c // j.slots) & 1 != shadow:
        return "slot_chunk_mismatch"
    if sparse and not sparse_next_ok(c, int.from_bytes(pkt[-TRAILER_SIZE:], "big"), j.slots, chunk_modulus(j.slots)):
        return "bad_next"
    return "ok" if joined_source else "foreign_source"


PARSE_REASONS = ("truncated", "bad_version", "bad_msg_type", "bad_payload_type", "unknown_job", "bad_length",
                 "bad_count", "unknown_worker", "slot_out_of_range", "slot_chunk_mismatch", "bad_next",
                 "foreign_source")
PROTOCOL_REASONS = ("payload_type_mismatch", "stale", "slot_busy", "retransmit_pending")


def bad_packets(jobs: dict[int, JobSpec], stride: int):
    """Strategy: (reason, packet bytes) with exactly that parse-stage drop reason, for packets sent
    from an address no rank joined from."""
    active = sorted(jobs)
    seeds = st.integers(0, 2**32 - 1)
    u16 = st.integers(0, 0xFFFF)
    u32 = st.integers(0, 0xFFFFFFFF)
    job_st = st.sampled_from(active)
    ptype_st = st.sampled_from(PAYLOAD_TYPES)

    def any_len(min_size=HDR):
        return st.integers(min_size, stride)

    @st.composite
    def truncated(draw):
        if draw(st.booleans()):
            n = draw(st.integers(0, HDR - 1))
        else:     # longer than the receive buffer: cut by the NIC ring
            n = draw(st.integers(stride + 1, stride + 300))
        return "truncated", fill(n, draw(seeds))

    @st.composite
    def bad_version(draw):
        v = draw(st.integers(0, 255).filter(lambda x: x != VERSION))
        rest = fill(draw(any_len()) - 1, draw(seeds))
        return "bad_version", bytes([v]) + rest

    @st.composite
    def bad_msg_type(draw):
        m = draw(st.integers(0, 255).filter(lambda x: x != DATA))
        pkt = bytes([VERSION, m]) + fill(draw(any_len()) - 2, draw(seeds))
        return "bad_msg_type", pkt

    @st.composite
    def bad_payload_type(draw):
        pkt = bytearray(header(job=draw(u16), ptype=draw(st.integers(6, 255)), chunk=draw(u32)))
        return "bad_payload_type", bytes(pkt) + fill(draw(any_len()) - HDR, draw(seeds))

    @st.composite
    def unknown_job(draw):
        j = draw(u16.filter(lambda x: x not in jobs))
        pt = draw(ptype_st)
        return "unknown_job", header(job=j, ptype=pt, rank=draw(u16), slot=draw(u16), chunk=draw(u32)) + \
            fill(draw(any_len()) - HDR, draw(seeds))

    def valid_fields(draw, j: JobSpec, pt: int):
        c = draw(st.integers(0, 2**31))
        return dict(job=j.job, ptype=pt, rank=draw(st.integers(0, j.n_workers - 1)),
                    slot=(c % j.slots) | (((c // j.slots) & 1) << 15), chunk=c,
                    count=0 if pt == 0 else draw(st.integers(0, j.elements)))

    @st.composite
    def bad_length(draw):
        j = jobs[draw(job_st)]
        pt = draw(ptype_st)
        good = HDR + WIDTH[pt] * j.elements
        n = draw(any_len().filter(lambda x: x != good))
        return "bad_length", header(**valid_fields(draw, j, pt)) + fill(n - HDR, draw(seeds))

    @st.composite
    def bad_count(draw):
        j = jobs[draw(job_st)]
        pt = draw(ptype_st)
        f = valid_fields(draw, j, pt)
        f["count"] = draw(st.integers(1, 0xFFFF)) if pt == 0 else draw(st.integers(j.elements + 1, 0xFFFF))
        return "bad_count", header(**f) + fill(WIDTH[pt] * j.elements, draw(seeds))

    @st.composite
    def unknown_worker(draw):
        j = jobs[draw(job_st)]
        pt = draw(ptype_st)
        f = valid_fields(draw, j, pt)
        f["rank"] = draw(st.integers(j.n_workers, 0xFFFF))
        return "unknown_worker", header(**f) + fill(WIDTH[pt] * j.elements, draw(seeds))

    @st.composite
    def slot_out_of_range(draw):
        j = jobs[draw(job_st)]
        pt = draw(ptype_st)
        f = valid_fields(draw, j, pt)
        f["slot"] = draw(st.integers(j.slots, 0x7FFF)) | (draw(st.integers(0, 1)) << 15)
        return "slot_out_of_range", header(**f) + fill(WIDTH[pt] * j.elements, draw(seeds))

    @st.composite
    def slot_chunk_mismatch(draw):
        j = jobs[draw(job_st)]
        pt = draw(ptype_st)
        f = valid_fields(draw, j, pt)
        good = f["slot"]
        f["slot"] = draw(st.integers(0, j.slots - 1).flatmap(
            lambda p: st.sampled_from([p, p | 0x8000])).filter(lambda s: s != good))
        return "slot_chunk_mismatch", header(**f) + fill(WIDTH[pt] * j.elements, draw(seeds))

    @st.composite
    def bad_next(draw):        # a sparse packet whose announcement breaks the rule of rounds
        j = jobs[draw(job_st)]
        pt = draw(ptype_st)
        f = valid_fields(draw, j, pt)
        m = chunk_modulus(j.slots)
        nxt = draw(u32.filter(lambda x: not sparse_next_ok(f["chunk"], x, j.slots, m)))
        return "bad_next", (header(**f, flags=int(Flag.SPARSE)) + fill(WIDTH[pt] * j.elements, draw(seeds))
                            + nxt.to_bytes(TRAILER_SIZE, "big"))

    @st.composite
    def foreign_source(draw):
        """A packet valid in every field, claiming a joined rank, sent from another address."""
        j = jobs[draw(job_st)]
        pt = draw(ptype_st)
        return "foreign_source", header(**valid_fields(draw, j, pt)) + fill(WIDTH[pt] * j.elements, draw(seeds))

    @st.composite
    def random_packet(draw):
        pkt = fill(draw(st.integers(0, stride + 100)), draw(seeds))
        if draw(st.booleans()) and len(pkt) >= 2:     # random bytes behind a plausible start
            pkt = bytes([VERSION, DATA]) + pkt[2:]
        reason = classify(pkt, jobs, stride)
        return reason, pkt

    return st.one_of(truncated(), bad_version(), bad_msg_type(), bad_payload_type(), unknown_job(), bad_length(),
                     bad_count(), unknown_worker(), slot_out_of_range(), slot_chunk_mismatch(), bad_next(),
                     foreign_source(), random_packet())


# ------------------------------------------------------------------------------------------------
# valid traffic of a 2-worker job, driven through the slot protocol's states
# ------------------------------------------------------------------------------------------------
SCENARIOS = ("complete", "retransmit_pending", "payload_type_mismatch", "slot_busy", "stale_complete",
             "stale_pending", "replay")


@dataclass
class ProtocolModel:
    """Sends rounds to a 2-worker job's slots and predicts the switch's counters and results."""
    job: JobSpec
    next_round: dict = field(default_factory=dict)      # (pool, shadow) -> round number m
    expected: dict = field(default_factory=lambda: {r: 0 for r in PROTOCOL_REASONS})
    ok: int = 0                # packets that pass parsing
    harvested: int = 0
    replays: int = 0
    sums: dict = field(default_factory=dict)            # chunk -> expected int64 sums (INT32 rounds)
    kinds: dict = field(default_factory=dict)          # chunk -> scenario kind
    last: int = -1                                      # chunk of the latest round

    def chunk(self, pool: int, shadow: int, m: int) -> int:
        return pool + self.job.slots * (2 * m + shadow)

    def fresh(self, pool: int, shadow: int) -> int:
        m = self.next_round.get((pool, shadow), 0)
        self.next_round[(pool, shadow)] = m + 1
        return self.chunk(pool, shadow, m)

    def pkt(self, rank: int, chunk: int, values: np.ndarray, ptype: int = 2) -> bytes:
        j = self.job
        slot = (chunk % j.slots) | (((chunk // j.slots) & 1) << 15)
        if ptype == 2:
            body = np.zeros(j.elements, ">i4")
            body[: values.size] = values
        else:
            body = np.zeros(j.elements, np.uint8)
        return header(job=j.job, rank=rank, slot=slot, ptype=ptype, count=values.size, chunk=chunk) + body.tobytes()

    def scenario(self, kind: str, pool: int, shadow: int, seed: int) -> list[bytes]:
        """Packets of one scenario; every scenario leaves its slot set complete.

        Like a real worker, the caller must not start the next round of a slot set before the
        result of its previous round came back (the shadow-copy rule): the switch harvests a burst
        after aggregating it, so a new round in the same burst would find the set busy."""
        rng = np.random.default_rng(seed)
        E = self.job.elements
        a = rng.integers(-2**29, 2**29, E)
        b = rng.integers(-2**29, 2**29, E)
        c = self.fresh(pool, shadow)
        if kind in ("stale_complete", "stale_pending") and c < 2 * self.job.slots:
            kind = "complete"          # no older round of this set exists yet
        out = [self.pkt(0, c, a)]
        if kind == "retransmit_pending":
            out.append(self.pkt(0, c, a))
        elif kind == "payload_type_mismatch":
            out.append(self.pkt(1, c, b, ptype=1))
        elif kind == "slot_busy":
            out.append(self.pkt(1, c + 2 * self.job.slots, b))
        elif kind == "stale_pending":
            out.append(self.pkt(1, c - 2 * self.job.slots, b))
        out.append(self.pkt(1, c, b))
        if kind == "stale_complete":
            out.append(self.pkt(0, c - 2 * self.job.slots, a))
        elif kind == "replay":
            out.append(self.pkt(0, c, a))
            self.replays += 1
        if kind in PROTOCOL_REASONS:
            self.expected[kind] += 1
        elif kind.startswith("stale"):
            self.expected["stale"] += 1
        self.ok += len(out)
        self.harvested += 1
        self.sums[c] = a + b
        self.kinds[c] = kind
        self.last = c
        return out

    def strategy(self):
        return st.tuples(st.sampled_from(SCENARIOS), st.integers(0, self.job.slots - 1), st.integers(0, 1),
                         st.integers(0, 2**32 - 1))
