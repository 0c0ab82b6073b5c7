"""The switch: register resources, job table, and the packet pipeline.

A packet's life, one burst at a time, run to completion in a poll loop (DPDK style)::

    rx         recvmmsg a burst into the preallocated receive ring (no per-packet allocation)
    ingress    user-space impairments worker -> switch (loss, duplication, reordering, delay)
    parse      validate headers against the job table; bad packets get a drop reason
    aggregate  the integer ALU: SwitchML slot protocol; first packet writes, the others add
    harvest    completed slots: result packet into the slot's shadow-copy row; plan multicast
    tx         egress impairments, then sendmmsg: multicast results, unicast replays

``Switch.poll_once`` is exactly that list. The data-plane kernels are in dataplane.py (rx, parse), alu.py
(aggregate) and harvest.py (harvest).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ina import burst as B
from ina.wire import MAX_WORKERS, OFFSET, Flag, MsgType, chunk_modulus, max_packet_size, pack

from . import alu, dataplane as D, harvest, tail
from .clock import STAGES, StageClock
from .impair import Impairment, ImpairmentConfig
from .multicast import Multicast

log = logging.getLogger("ina.switch")

COUNTERS, C = D.COUNTERS, D.C
C_REPLAYS, C_TX_PACKETS, C_TX_BYTES = C["replays"], C["tx_packets"], C["tx_bytes"]
C_MULTICAST_AS_COPIES, C_FALLBACKS = C["multicast_as_copies"], C["multicast_fallbacks"]
MAX_ACTIVE_JOBS = 64
RX_TIMEOUT = 0.02       # seconds a poll blocks for a packet when nothing is held (the socket's timeout)


@dataclass
class SwitchConfig:
    host: str = "0.0.0.0"
    port: int = 9999
    slots: int = 512              # aggregator slots in the pool (each has two sets: the shadow copy)
    elements: int = 1024          # registers per slot = the largest elements-per-packet a job may use
    register_bits: int = 64       # register width: 32 or 64
    sram_mb: float = 64.0         # register memory budget; bigger configurations are refused
    burst: int = 64               # packets per rx burst
    seed: int = 0                 # randomness of the switch-side stochastic re-encoding
    ingress: ImpairmentConfig = field(default_factory=ImpairmentConfig)
    egress: ImpairmentConfig = field(default_factory=ImpairmentConfig)
    stats_interval: float = 10.0  # seconds between log lines with rates (0: never)
    multicast: bool = True        # a job's results to its IP multicast group where every worker joined it

    def register_memory(self) -> int:
        """Bytes of switch SRAM: registers of both sets plus per-set metadata
        (64-bit worker bitmap, counter, max exponent, round chunk id, sparse streaming's min next
        distance: 8 + 4 + 2 + 4 + 4 bytes)."""
        sets = self.slots * 2
        return sets * self.elements * self.register_bits // 8 + sets * 22

    def validate(self) -> None:
        if self.register_bits not in (32, 64):
            raise ValueError(f"register_bits must be 32 or 64, got {self.register_bits}")
        if not 1 <= self.slots <= 0x7FFF:
            raise ValueError(f"slots must be in 1..32767 (15-bit pool index), got {self.slots}")
        if not 1 <= self.elements <= 16384:
            raise ValueError(f"elements per slot must be in 1..16384, got {self.elements}")
        mem = self.register_memory()
        if mem > self.sram_mb * 2**20:
            raise ValueError(f"configuration needs {mem / 2**20:.1f} MiB of register memory "
                             f"({self.slots} slots x 2 sets x {self.elements} x {self.register_bits}-bit), "
                             f"over the SRAM budget of {self.sram_mb:g} MiB (--sram-mb)")


@dataclass
class Job:
    """One installed job: the control plane's record, and the source of its job-table entry
    (``table_row``: the fields named in ``dataplane.JOB``), which the kernels match packets on."""
    job: int
    n_workers: int
    slot_lo: int                  # this switch's slots slot_lo .. slot_lo + slots - 1
    slots: int
    elements: int
    raw: bool
    addr_block: int               # worker addresses at addr_block * MAX_WORKERS + rank
    addrs: list
    pool_slots: int = 0           # the job's whole pool (slots is this shard's part of it)
    shards: int = 1
    shard: int = 0
    group_addr: int = -1          # address index of the job's multicast group (-1: unicast copies)
    multicast_fallback: str = ""  # why its results went from multicast to unicast copies (multicast.py)
    results_from: str = ""        # the address its multicast results come from (the workers filter on it)
    created: float = field(default_factory=time.time)

    active = True

    @property
    def addr_base(self) -> int:
        return self.addr_block * MAX_WORKERS

    @property
    def chunk_modulus(self) -> int:
        return chunk_modulus(self.pool_slots)

    def table_row(self) -> tuple:
        return tuple(int(getattr(self, name)) for name in D.JOB.names)


class Switch:
    """A software programmable switch with an integer-only aggregation data plane."""

    def __init__(self, config: SwitchConfig, sock=None):
        config.validate()
        self.cfg = cfg = config
        self.sock = sock or B.udp_socket(cfg.host, cfg.port)
        self.port = self.sock.getsockname()[1]
        B.set_recv_timeout(self.sock, RX_TIMEOUT)
        stride = max_packet_size(cfg.elements)     # INT64 sums, and the sparse trailer
        self.rx = B.RxRing(self.sock, cfg.burst, stride)
        self.txq = B.TxBatch(self.sock, capacity=cfg.burst * MAX_WORKERS)
        # --- the data-plane state: registers, per-set metadata, job table, counters, burst scratch ---
        # the most packets one pass hands the kernels (their scratch's size; the ingress impairments
        # release at most this many per pass, the rest stays held): the kernels do not check bounds
        self.max_pass = cfg.burst
        self.state = D.DataPlane.allocate(cfg.slots, cfg.elements, self.max_pass, stride, cfg.register_bits,
                                          cfg.seed, MAX_ACTIVE_JOBS * (MAX_WORKERS + 1))
        self.counters = self.state.counters
        tx = self.state.tx                # harvest's transmission plan, as field views made once (not per burst)
        self._tx_rows, self._tx_lens, self._tx_addr = tx["set_id"], tx["length"], tx["addr"]
        self._tx_mark = np.zeros(len(self.state.results), bool)     # stage_tx: rows sent as results
        self.clock = StageClock()
        self._waited = 0
        self.slot_owner = np.full(cfg.slots, -1, np.int64)
        # worker addresses by job block, then the jobs' multicast groups by job block
        self.addrs = np.zeros(MAX_ACTIVE_JOBS * (MAX_WORKERS + 1), B.SOCKADDR_IN)
        self.multicast = Multicast(self.sock, cfg.multicast, MAX_ACTIVE_JOBS * MAX_WORKERS, MAX_ACTIVE_JOBS)
        self.fallbacks: deque = deque(maxlen=16)     # the last jobs moved from multicast to unicast, and why
        self._free_blocks = list(range(MAX_ACTIVE_JOBS))
        self.job_info: dict[int, Job] = {}
        self._replays = False             # the last harvest planned replays
        self.tail_repeats = 0             # results of TAIL rounds multicast a second time
        self.tail_duplicates = 0          # second TAIL copies that arrived after their round completed
        self._rx_src = self.rx.src.view(np.uint8).reshape(cfg.burst, B.SOCKADDR_IN.itemsize)   # as bytes
        self.ingress = Impairment(cfg.ingress, width=stride)
        self.egress = Impairment(cfg.egress, width=stride)
        self._commands: list = []
        self._cmd_lock = threading.Lock()
        self._stop = threading.Event()
        self._dp_thread: threading.Thread | None = None    # the thread running serve_forever
        self._running = False
        self.started = time.time()
        self._rate_mark = (time.time(), 0, 0, 0, 0)   # time, rx packets, rx bytes, tx packets, tx bytes
        self.rates = {"rx_pps": 0.0, "rx_bps": 0.0, "tx_pps": 0.0, "tx_bps": 0.0}
        self._warm_up()

    # ------------------------------------------------------------------------------------------
    # the pipeline
    # ------------------------------------------------------------------------------------------
    def poll_once(self) -> int:
        """Run one burst through every stage. Returns the number of packets received.
        The time of each stage goes to ``self.clock`` (a :class:`StageClock`)."""
        clk, now, ns = self.clock, time.perf_counter_ns, self.clock.stage_ns
        t0, cpu0 = now(), time.thread_time_ns()
        n = self.stage_rx()
        t1 = now()
        if not n and not self._holding():
            clk.wait_ns += t1 - t0          # nothing came: the blocking receive timed out
            return 0
        if self._waited:
            clk.wait_ns += self._waited
            t0 += self._waited
        ns[0] += t1 - t0
        buf, lens, n_in = self.stage_ingress(n)
        t2 = now()
        ns[1] += t2 - t1
        if n_in:
            self.stage_parse(buf, lens, n_in)
            t3 = now()
            self.stage_aggregate(buf, n_in)
            t4 = now()
            m = self.stage_harvest(buf, n_in)
            t5, cpu5 = now(), time.thread_time_ns()
            self.stage_tx(m)
            t6 = now()
            clk.tx_cpu_ns += time.thread_time_ns() - cpu5
            ns[2] += t3 - t2
            ns[3] += t4 - t3
            ns[4] += t5 - t4
            ns[5] += t6 - t5
        else:
            if self.egress.active:
                self.stage_tx(0)
            t6 = now()
            ns[5] += t6 - t2
        clk.busy_ns += t6 - t0
        clk.busy_cpu_ns += time.thread_time_ns() - cpu0
        if n:
            clk.burst(n)
        return n

    def stage_rx(self) -> int:
        """Receive a burst without waiting; if nothing is there, wait for one (its time is the wait's,
        ``self._waited`` ns, not the stage's)."""
        self._waited = 0
        n = self.rx.recv(wait=False)
        if not n:
            wait = self._rx_wait_bound()
            if wait:
                t = time.perf_counter_ns()
                n = self.rx.recv_within(wait, RX_TIMEOUT)
                self._waited = time.perf_counter_ns() - t
        if n:
            self._rx_account(self.state, self._rx_src, self.rx.lens, n, self.rx.stride)
        return n

    def stage_ingress(self, n: int):
        """Ingress impairments over the burst as arrays (impair.py). At most a burst's worth goes on
        (the parse scratch holds ``burst`` packets); the rest stays held, due at the next poll."""
        if not self.ingress.active or self.ingress.untouched(n):
            return self.rx.buf, self.rx.lens, n
        src = self.state.src
        buf, rows, lens, tags = self.ingress.apply(self.rx.buf, np.arange(n), self.rx.lens[:n], src[:n],
                                                   time.monotonic(), self.max_pass)
        if buf is self.rx.buf:
            return buf, self.rx.lens, n
        k = rows.size                   # rows 0..k-1 of buf: the pool's, or the ring's rows after a loss
        src[:k] = tags
        return buf, lens, k

    # buf / lens: the receive ring's (rx.buf, rx.lens) or the ingress side pool's, of the same types
    def stage_parse(self, buf, lens, n: int) -> None:
        if n > self.max_pass:     # the kernels do not check bounds: refuse before they write beyond the scratch
            raise RuntimeError(f"a pass of {n} packets exceeds the data plane's scratch of {self.max_pass}")
        self._parse(self.state, buf, lens, n)

    def stage_aggregate(self, buf, n: int) -> None:
        self._aggregate(self.state, buf, n)

    def stage_harvest(self, buf, n: int) -> int:
        """Harvest's plan of the burst, with the tail copies' rule applied (:meth:`_repeat_tail_results`),
        then the multicast judge over the replays left in it: the number of planned transmissions."""
        r0 = self.counters[C_REPLAYS]
        m = self._harvest(self.state, buf, n)
        if m:
            m = self._repeat_tail_results(buf, n, m)
        self._replays = self.counters[C_REPLAYS] != r0     # (tail.py takes back the replays it leaves out)
        if self._replays and not self.egress.active:     # (egress impairments: a lost copy is theirs)
            self._judge_multicast()
        return m

    def _judge_multicast(self) -> None:
        """Jobs whose group does not reach a worker (multicast.py's rule) go on with a unicast copy per worker
        (from the next burst on: this one's plan stands, its replays reach their rank anyway)."""
        for block, ranks, why in self.multicast.judge(self.state.delivered):
            info = next(i for i in self.job_info.values() if i.addr_block == block)
            info.group_addr = -1
            info.multicast_fallback = why
            self.fallbacks.append({"job": info.job, "ranks": ranks, "why": why, "at": round(time.time(), 3)})
            self.state.jobs[info.job]["group_addr"] = -1
            self.counters[C_FALLBACKS] += 1
            log.warning("job %d: its multicast group does not reach %s (%s): results go as a unicast copy per "
                        "worker from now on (is multicast forwarded on the way: routing, a firewall, the bridge's "
                        "snooping?)", info.job, ", ".join("%s:%d" % tuple(info.addrs[r]) for r in ranks[:8]), why)

    def _repeat_tail_results(self, buf, n: int, m: int) -> int:
        """A second multicast of each TAIL round's result, no replay of a second TAIL copy (tail.py);
        counted in ``tail_repeats`` and ``tail_duplicates``."""
        m2, dropped = self._repeat_tail(self.state, buf, n, m)
        self.tail_repeats += m2 - m + dropped
        self.tail_duplicates += dropped
        return m2

    def stage_tx(self, m: int) -> None:
        """Send harvest's plan (grouped by destination there: one GSO message per worker and burst). Replays
        (negative length) go in the same send with the REPLAY flag set in the stored row for it (the egress
        impairments copy a packet they hold); in a second one if their row also goes out as a result."""
        rows, lens, addr = self._tx_rows[:m], self._tx_lens[:m], self._tx_addr[:m]
        buf = self.state.results
        if not (m and self._replays):
            return self._send_impaired(buf, rows, lens, addr)
        rep, mark = lens < 0, self._tx_mark
        mark[rows[~rep]] = True
        both, mark[rows] = mark[rows[rep]].any(), False
        if both:
            self._send_impaired(buf, rows[~rep], lens[~rep], addr[~rep])
            rows, lens, addr, rep = rows[rep], lens[rep], addr[rep], rep[rep]
        flags = buf[:, OFFSET["flags"]: OFFSET["flags"] + 2].view(">u2")[:, 0]     # a view: in place
        flags[rows[rep]] |= int(Flag.REPLAY)
        try:
            self._send_impaired(buf, rows, np.abs(lens), addr)
        finally:
            flags[rows[rep]] &= ~int(Flag.REPLAY) & 0xFFFF

    def _send_impaired(self, buf, rows, lens, addr) -> None:
        """Send ``buf[rows]`` through the egress impairments when they are on (impair.py: a dropped
        packet changes the rows sent, without a copy; held packets that are due join the send)."""
        if self.egress.active:          # each worker's copy is impaired on its own
            if self.egress.loss_only:
                return self._send_lossy(buf, rows, lens, addr)
            rows, lens, addr, groups = self.multicast.expand(rows, lens, addr)
            self.counters[C_MULTICAST_AS_COPIES] += groups
            out = self.egress.apply(buf, rows, lens, addr, time.monotonic(), 1 << 30, gather=False)
            if out[0] is not buf and self.txq.gso and len(out[1]) > 1:   # due packets joined: one run per worker
                order = np.argsort(out[3], kind="stable")
                out = (out[0], out[1][order], np.asarray(out[2])[order], out[3][order])
            buf, rows, lens, addr = out
        self._send(buf, rows, lens, addr)

    def _send_lossy(self, buf, rows, lens, addr) -> None:
        """Egress loss alone (nothing copied or held): each worker's copy of a group send is lost on its own
        (the fates drawn per copy, as the copies' own send would), but a group send none of whose copies is
        lost goes out as the one multicast it is; only one that lost a copy goes as its surviving copies.
        Sending every group send as copies made the impairment path itself cost the 100 Mbit/s runs about
        1.16x at 1.7 M elements (4 sends a result: the switch's send CPU 78 -> 172 ms an allreduce)."""
        keep = self.egress.survivors(self.multicast.copies(addr))
        if keep is None:                                # nothing lost: every transmission as it is
            return self._send(buf, rows, lens, addr)
        x_rows, x_lens, x_addr, _, origin = self.multicast.expand(rows, lens, addr, origin=True)
        if origin is None:                              # no group send: the copies are the transmissions
            return self._send(buf, np.asarray(rows)[keep], np.broadcast_to(lens, keep.shape)[keep],
                              np.broadcast_to(addr, keep.shape)[keep])
        addr = np.asarray(addr)
        broken = np.zeros(addr.size, bool)
        broken[origin[~keep]] = True                    # transmissions that lost a copy
        self.counters[C_MULTICAST_AS_COPIES] += int(np.count_nonzero(broken & (addr >= self.multicast.first)))
        whole, copies = ~broken, keep & broken[origin]
        # in the burst's order: a worker's results must not overtake each other (three later results before
        # a late one are a loss to the worker's duplicate threshold)
        order = np.argsort(np.concatenate([np.flatnonzero(whole), origin[copies]]), kind="stable")
        self._send(buf, np.concatenate([np.asarray(rows)[whole], x_rows[copies]])[order],
                   np.concatenate([np.broadcast_to(lens, addr.shape)[whole], x_lens[copies]])[order],
                   np.concatenate([addr[whole], x_addr[copies]])[order])

    def _send(self, buf, rows, lens, addr) -> None:
        if len(rows):
            txq, b0 = self.txq, self.txq.sent_bytes         # TxBatch sums the entries' lengths as it fills them
            txq.send(buf, rows, lens, self.addrs, addr)
            self.counters[C_TX_PACKETS] += len(rows)
            self.counters[C_TX_BYTES] += txq.sent_bytes - b0

    # ------------------------------------------------------------------------------------------
    # service loop, control plane hooks
    # ------------------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """The poll loop, until ``stop()``. The calling thread becomes the data-plane thread: from now
        on ``call`` hands commands to it instead of running them in the caller."""
        self._dp_thread = threading.current_thread()
        self._running = True
        try:
            log.info("switch serving on udp %s:%d: %d slots x 2 sets x %d registers of %d bits (%.1f MiB of %g MiB "
                     "SRAM)", self.cfg.host, self.port, self.cfg.slots, self.cfg.elements, self.cfg.register_bits,
                     self.cfg.register_memory() / 2**20, self.cfg.sram_mb)
            while not self._stop.is_set():
                self._run_commands()
                self.poll_once()
                self._update_rates()
            self._run_commands()
            log.info("switch stopped: %s", self.summary())
        finally:
            self._running = False

    def stop(self) -> None:
        self._stop.set()

    @property
    def ports(self) -> list:
        """UDP ports of the data plane, one per shard (a single switch has one)."""
        return [self.port]

    def dp(self, name: str, *args, **kwargs):
        """Call the data-plane method ``name`` between bursts (what the control plane uses)."""
        return self.call(lambda sw: getattr(sw, name)(*args, **kwargs))

    def call(self, fn, timeout: float = 10.0):
        """Run ``fn(self)`` in the data-plane thread between bursts and return its result."""
        if threading.current_thread() is self._dp_thread or not self._running:
            return fn(self)
        done = threading.Event()
        box = {}

        def wrapped(sw):
            try:
                box["r"] = fn(sw)
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                box["e"] = e
            done.set()

        with self._cmd_lock:
            self._commands.append(wrapped)
        if not done.wait(timeout):
            raise TimeoutError(f"data plane did not run a control command within {timeout:g} s")
        if "e" in box:
            raise box["e"]
        return box.get("r")

    def _run_commands(self) -> None:
        if self._commands:
            with self._cmd_lock:
                cmds, self._commands = self._commands, []
            for c in cmds:
                c(self)

    def start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, name="dataplane", daemon=True)
        t.start()
        return t

    # jobs ----------------------------------------------------------------------------------------
    def free_slots(self) -> int:
        return int((self.slot_owner < 0).sum())

    def _find_range(self, want: int) -> int:
        free = self.slot_owner < 0
        run = 0
        for i, f in enumerate(free):
            run = run + 1 if f else 0
            if run == want:
                return i - want + 1
        return -1

    def install_job(self, job: int, n_workers: int, slots: int, elements: int, raw: bool, addrs: list,
                    shards: int = 1, shard: int = 0, created: float | None = None, groups: list | None = None) -> Job:
        """Allocate a slot range and a job-table entry (data-plane thread). ``groups``: the multicast group
        each worker joined (results go to the job's group where all did, multicast.py).

        ``slots`` is the job's pool; with ``shards`` > 1 this switch holds pool indices p with
        p % shards == shard, i.e. ceil((slots - shard) / shards) of them.
        """
        pool_slots = slots
        slots = max(1, (pool_slots - shard + shards - 1) // shards)
        if not 0 <= job < D.MAX_JOBS:
            raise ValueError(f"job id {job} out of range 0..{D.MAX_JOBS - 1}")
        if self.state.jobs[job]["active"]:
            raise ValueError(f"job {job} is already registered")
        if not 1 <= n_workers <= MAX_WORKERS:
            raise ValueError(f"a job has 1..{MAX_WORKERS} workers (one 64-bit worker bitmap), got {n_workers}")
        if not 1 <= elements <= self.cfg.elements:
            raise ValueError(f"elements per packet {elements} exceeds the switch's {self.cfg.elements} registers per slot")
        if slots < 1:
            raise ValueError(f"a job needs at least one slot, asked for {slots}")
        if not self._free_blocks:
            raise ValueError(f"too many active jobs (at most {MAX_ACTIVE_JOBS})")
        lo = self._find_range(slots)
        if lo < 0:
            raise ValueError(f"not enough free slots for job {job}: asked for {slots}, "
                             f"{self.free_slots()} of {self.cfg.slots} are free (not necessarily contiguous)")
        block = self._free_blocks.pop(0)
        info = Job(job, n_workers, lo, slots, elements, raw, block, list(addrs), pool_slots, shards, shard)
        if created is not None:
            info.created = created
        for r, (h, p) in enumerate(addrs):
            self.addrs[info.addr_base + r] = a = B.sockaddr(h, p)[0]
            self.state.peers[info.addr_base + r] = D.source_key(int(a["addr"]), int(a["port"]))
        group, how = self.multicast.choose(job, addrs, groups, self.port - shard)
        if group is not None:
            info.results_from = self.multicast.interface
            info.group_addr = self.multicast.install(block, n_workers, slots, self.state.delivered, shards)
            self.addrs[info.group_addr] = B.sockaddr(group, int(addrs[0][1]))[0]     # choose: every rank bound its port
        self.slot_owner[lo: lo + slots] = job
        self.state.reset_sets(lo, slots)
        self.state.jobs[job] = info.table_row()
        self.job_info[job] = info
        log.info("job %d installed: %d workers, slots %d..%d, %d elements per packet, results %s, %s: %s",
                 job, n_workers, lo, lo + slots - 1, elements, "raw sums" if raw else "re-encoded codes",
                 "multicast" if group else "unicast", how)
        return info

    def remove_job(self, job: int, reason: str, notify_rank: int | None = None,
                   incarnation: float | None = None) -> bool:
        """Free a job's slots and table entry; with ``notify_rank`` tell the other workers (ABORT).
        With ``incarnation`` only that incarnation of the job id is removed."""
        info = self.job_info.get(job)
        if info is None or (incarnation is not None and info.created != incarnation):
            return False
        del self.job_info[job]
        self.state.jobs[job] = 0
        self.slot_owner[info.slot_lo: info.slot_lo + info.slots] = -1
        self.state.peers[info.addr_base: info.addr_base + MAX_WORKERS] = -1
        self.state.reset_sets(info.slot_lo, info.slots)
        self.multicast.remove(info.addr_block)
        if notify_rank is not None:
            pkt = pack(msg_type=MsgType.ABORT, job=job, rank=notify_rank)
            for r, addr in enumerate(info.addrs):
                if r != notify_rank:
                    try:
                        self.sock.sendto(pkt, tuple(addr))
                        self.counters[C["aborts_sent"]] += 1
                    except OSError as e:
                        log.warning("could not send ABORT of job %d to rank %d at %s: %s", job, r, addr, e)
        self._free_blocks.append(info.addr_block)
        log.info("job %d removed (%s); slots %d..%d freed", job, reason, info.slot_lo, info.slot_lo + info.slots - 1)
        return True

    def job_status(self, job: int) -> dict:
        info = self.job_info.get(job)
        if info is None:
            return {"job": job, "active": False}
        sets = self.state.sets[2 * info.slot_lo: 2 * (info.slot_lo + info.slots)]
        pending = np.nonzero((sets["round_chunk"] >= 0) & (sets["complete"] == 0))[0]
        waiting = []
        for k in pending[:16]:
            have = int(sets[k]["bitmap"])
            missing = [r for r in range(info.n_workers) if not (have >> r) & 1]
            waiting.append({"pool_index": (int(k) // 2) * info.shards + info.shard, "shadow": int(k) % 2,
                            "chunk": int(sets[k]["round_chunk"]), "missing_ranks": missing})
        return {"job": job, "active": True, "workers": info.n_workers, "slot_lo": info.slot_lo,
                "slots": info.slots, "elements": info.elements, "raw": info.raw,
                "incomplete_slots": int(pending.size), "waiting": waiting}

    # impairments ----------------------------------------------------------------------------------
    def _holding(self) -> bool:
        return self.ingress.holding or self.egress.holding

    def _rx_wait_bound(self) -> float:
        """How long the receive may block (seconds; 0: not at all, a held packet is due now): until the
        next held packet is due (sleeping, not spinning: on a shared machine a spinning switch takes the
        workers' CPU), else ``RX_TIMEOUT``, the socket's own timeout. A shorter wait is precise
        (``RxRing.recv_within``), not rounded up to a kernel tick, which would hold a packet delayed or
        reordered by 1 ms for 4 to 12 ms whenever nothing else arrives."""
        if not self._holding():           # the common case: nothing held, the usual bound
            return RX_TIMEOUT
        due = [t for t in (self.ingress.next_release(), self.egress.next_release()) if t is not None]
        want = RX_TIMEOUT if not due else min(due) - time.monotonic()
        if want < 5e-5:
            return 0.0
        return min(RX_TIMEOUT, want)

    def set_impairments(self, ingress: dict | None = None, egress: dict | None = None) -> dict:
        new = [(imp, imp.config.updated(changes, where))       # both checked before either changes
               for imp, changes, where in ((self.ingress, ingress, "ingress"), (self.egress, egress, "egress"))]
        for imp, cfg in new:
            if cfg is not imp.config:
                imp.set(cfg)
        log.info("impairments now ingress=%s egress=%s", self.ingress.config.to_dict(), self.egress.config.to_dict())
        return {"ingress": self.ingress.config.to_dict(), "egress": self.egress.config.to_dict()}

    # observability -----------------------------------------------------------------------------------
    def _update_rates(self) -> None:
        now = time.time()
        t0, rxp, rxb, txp, txb = self._rate_mark
        dt = now - t0
        if dt >= 1.0:
            c = self.counters
            rxp1, rxb1, txp1, txb1 = (int(c[C["rx_packets"]]), int(c[C["rx_bytes"]]), int(c[C["tx_packets"]]),
                                      int(c[C["tx_bytes"]]))
            self.rates = {"rx_pps": (rxp1 - rxp) / dt, "rx_bps": 8 * (rxb1 - rxb) / dt,
                          "tx_pps": (txp1 - txp) / dt, "tx_bps": 8 * (txb1 - txb) / dt}
            if self.cfg.stats_interval and int(now) % max(1, int(self.cfg.stats_interval)) == 0 and rxp1 != rxp:
                log.info("rx %.0f pkt/s %.1f Mbit/s, tx %.1f Mbit/s, %d jobs, %d/%d slots in use, drops %d",
                         self.rates["rx_pps"], self.rates["rx_bps"] / 1e6, self.rates["tx_bps"] / 1e6,
                         len(self.job_info), self.cfg.slots - self.free_slots(), self.cfg.slots, self.drops())
            self._rate_mark = (now, rxp1, rxb1, txp1, txb1)

    def drops(self) -> int:
        return int(self.counters[1: len(D.DROP_REASONS)].sum())

    def stats(self) -> dict:
        c = {name: int(self.counters[i]) for i, name in enumerate(COUNTERS)}
        drops = {name: c.pop(name) for name in D.DROP_REASONS[1:]}
        c["parsed_ok"] = c.pop("ok")
        c["tail_repeats"] = self.tail_repeats     # second multicast copies of TAIL rounds' results
        c["tail_duplicates"] = self.tail_duplicates   # second TAIL copies after the round completed: not replayed
        c["tx_refused"] = self.txq.refused     # sends the kernel refused after an ICMP port unreachable
        c["tx_messages"] = self.txq.sent_messages   # what sendmmsg was handed: a GSO message counts once
        sets = self.state.sets
        sets_busy = int(((sets["round_chunk"] >= 0) & (sets["complete"] == 0)).sum())
        return {
            "uptime_s": round(time.time() - self.started, 3),
            "config": {"port": self.port, "slots": self.cfg.slots, "elements": self.cfg.elements,
                       "register_bits": self.cfg.register_bits,
                       "register_memory_mib": round(self.cfg.register_memory() / 2**20, 3),
                       "sram_mb": self.cfg.sram_mb, "burst": self.cfg.burst, "udp_gso": self.txq.gso,
                       "udp_gso_refused": self.txq.gso_refused, "multicast": self.multicast.enabled},
            "stages": list(STAGES),
            "counters": c,
            # process_cpu_ns: the CPU of the switch's whole process (every thread: the control plane's too)
            "timing": {**self.clock.to_dict(), "process_cpu_ns": time.process_time_ns()},
            "drops": drops,
            "rates": {k: round(v, 1) for k, v in self.rates.items()},
            "occupancy": {"slots_allocated": self.cfg.slots - self.free_slots(), "slots_total": self.cfg.slots,
                          "sets_aggregating": sets_busy},
            "jobs": {str(j): {"workers": i.n_workers, "slot_lo": i.slot_lo, "slots": i.slots,
                              "elements": i.elements, "raw": i.raw, "multicast": i.group_addr >= 0,
                              **({"multicast_fallback": i.multicast_fallback} if i.multicast_fallback else {})}
                     for j, i in self.job_info.items()},
            "multicast_fallbacks": list(self.fallbacks),
            "impairments": {"ingress": self.ingress.stats(), "egress": self.egress.stats()},
        }

    def summary(self) -> str:
        c = self.counters
        return (f"rx {int(c[C['rx_packets']])} packets, tx {int(c[C['tx_packets']])} packets, "
                f"{int(c[C['harvested']])} slots harvested, {self.drops()} dropped")

    def _warm_up(self) -> None:
        """Compile (or load from cache) the kernels before serving, bound to this switch's state and
        buffer types (dataplane.bind); then run each on an empty burst."""
        st, buf, lens = self.state, self.rx.buf, self.rx.lens
        self._parse = D.bind(D.parse, st, buf, lens, 0)
        self._aggregate = D.bind(alu.aggregate, st, buf, 0)
        self._harvest = D.bind(harvest.harvest, st, buf, 0)
        self._repeat_tail = D.bind(tail.repeat_tail_results, st, buf, 0, 0)
        self._rx_account = D.bind(D.rx_account, st, self._rx_src, lens, 0, 0)
        self.stage_parse(buf, lens, 0)
        self.stage_aggregate(buf, 0)
        self.stage_harvest(buf, 0)
