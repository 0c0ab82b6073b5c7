"""The streaming allreduce client: feeds a tensor's chunks through the switch's slots.

One allreduce is:

1. **exponent negotiation**: one packet with no payload whose exponent field is this worker's
   scale exponent (plus one such packet per further value the codec needs agreed, e.g. MQGrad's
   bits); the switch's max-exponent register returns the max over workers. While that round trip
   is out, the first window of chunks is encoded under the worker's own proposals, a guess at the
   maxima that holds when the workers' exponents agree (:class:`ina.chunk_encoding.FirstWindow`: used
   only if the maxima are the guess, so the codes are the agreed ones bit for bit), and the first data
   packets go out as soon as the maxima are back;
2. **stream** fixed-length chunks: chunk c goes to pool index c % slots, shadow set (c // slots) % 2
   (ina.wire.slot_of_chunk; ids count modulo ina.wire.chunk_modulus(slots) and wrap to 0 there);
   the window equals the job's slots and is self-clocking (the result of chunk c frees its slot
   for chunk c + slots); a chunk whose result is late is retransmitted with exponential backoff
   and an adaptive timeout;
3. **pipelined encode and decode**: each block of ``slots`` chunks is encoded with the shared
   :class:`~ina.compression.ScaleContext` just before its first chunk is sent, and each burst of
   results (multicast by the switch) is decoded into the caller's tensor as it arrives.

Every wait is bounded. If the switch or a worker is gone, :class:`AllreduceError` is raised within
``timeout`` seconds, naming what is missing (which ranks the switch is still waiting for, how
many chunks are incomplete).
"""
from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from . import burst as B
from . import chunk_encoding, compression, lifetime, staging
from . import multicast as mcast
from . import sparse as sparse_mod
from .compression.base import ScaleContext
from .control import ControlChannel, ControlError
from .recovery import TAIL_COPY_FROM
from .scheduling import RunQueueDelay
from .errors import AllreduceError
from .host_client import HostAggClient
from .timeline import Timeline
from .transfer import Transfer
from .wire import PayloadType, chunk_modulus, header_view, max_packet_size, shard_of_slot
from .worker import Worker, WorkerStats

log = logging.getLogger("ina.client")

RX_WAIT = 0.002           # the receive's longest wait (bounds a loop turn when nothing arrives)
RX_WAIT_MIN = 5e-5        # ... and its shortest, when a loss-recovery deadline is nearer

__all__ = ["Client", "ClientStats", "AllreduceError"]


@dataclass
class ClientStats(WorkerStats):
    packets_sent: int = 0
    packets_received: int = 0
    retransmissions: int = 0          # every resend: fast + probe + timeout retransmissions
    fast_retransmissions: int = 0     # resent because results of later chunks arrived first
    probe_retransmissions: int = 0    # resent after a silence of the probe timeout (tail losses)
    stall_probes: int = 0             # of these, probes of a silence with more than 3 chunks out (the longer wait)
    timeout_retransmissions: int = 0  # resent after the retransmission timeout (the safety net): its probes
    timeout_go_back: int = 0          # of these, the rest of a lane's timed-out chunks, resent once its probe was answered
    repeat_retransmissions: int = 0   # of all these, resends of a chunk resent before in its stream (any rule)
    fast_replayed: int = 0            # resends by each rule that the switch answered with a replay (the round
    probe_replayed: int = 0           # had completed: a result lost on the way back was recovered); the others
    timeout_replayed: int = 0         # waited for this rank's lost data packet or a peer's (ina.recovery)
    duplicate_results: int = 0        # results of chunks already done (replays of a resend, duplicates)
    tail_copies: int = 0              # second copies of a stream's last chunk sent (ina.recovery.tail_copies)
    coalesce_pause_s: float = 0.0     # time spent pausing for receive coalescing (a slow link's trickle)
    stale_results: int = 0
    sparse_header_only: int = 0       # sparse streaming: rounds this worker took part in with 24 bytes (zero chunk)
    sparse_chunks_skipped: int = 0    # sparse streaming: chunks zero at every worker (no packet, no round)


class Client(Worker):
    """A worker of one job at one switch.

    ``Client(switch=("host", port), rank=r, world_size=n, job=j)`` joins job ``j`` at the switch
    (a rendezvous: it returns once all ``n`` ranks joined, or raises after ``timeout``).
    ``elements`` is the chunk length (elements per packet) and ``slots`` the job's share of the
    switch's slot pool, i.e. the window of chunks in flight. ``first_chunk`` is the chunk id the
    job's first packet carries (0; a long-running job's ids wrap to 0 after chunk_modulus - 1). ``codecs``: the codecs
    this job will use, declared at join so that a switch under a hardware profile refuses one it cannot sum.
    ``sparse``: the default of :meth:`allreduce`'s ``sparse`` for switch-summable codecs (gloo_patch: INA_SPARSE).
    ``multicast``: join the job's multicast group, so the switch may send each result once (ina.multicast;
    None: unless INA_MULTICAST=0); ``self.multicast`` says whether the switch does.
    """

    def __init__(self, switch=("127.0.0.1", 9999), rank: int = 0, world_size: int = 1, job: int = 0, *,
                 elements: int = 1024, slots: int = 64, raw: bool = False, timeout: float = 30.0,
                 rto: float = 0.02, min_rto: float = 0.001, max_rto: float = 1.0, seed: int | None = None,
                 codec_options: dict | None = None, coalesce: float | None = None, first_chunk: int = 0,
                 token: str | None = None, timeline: bool = False, codecs: tuple = (), sparse: bool = False,
                 tail_copy_from: int = TAIL_COPY_FROM, multicast: bool | None = None):
        self._init_worker(rank, world_size, job, seed, codec_options, ClientStats())
        host, port = switch
        self.switch = (host, int(port))
        self.timeout, self.rto, self.max_rto = float(timeout), float(rto), float(max_rto)
        self.min_rto = float(min_rto)         # floor of the tail probe timeout (``rto``: of the safety net)
        # the longest receive-coalescing pause (seconds; 0: off; None: only ina.coalescing.pause_length's bounds)
        self.coalesce = math.inf if coalesce is None else float(coalesce)
        self.sparse = bool(sparse)            # allreduce's default: sparse block streaming (ina.sparse)
        self.tail_copy_from = int(tail_copy_from)   # data streams this long send their last chunk twice (ina.recovery)
        self.record_timeline = bool(timeline)  # keep the last allreduce's Timeline in last_timeline
        self.last_timeline: dict | None = None
        self._timeline: Timeline | None = None
        self.ctl = ControlChannel(host, int(port), timeout=min(timeout, 10.0), token=token)   # token: INA_TOKEN
        local_ip = self.ctl.sock.getsockname()[0]
        self.sock, group = mcast.data_socket(local_ip, job, multicast, self.ctl.sock.getpeername()[:2])
        try:
            cfg = self.ctl.request({"op": "join", "job": job, "rank": rank, "world_size": world_size,
                                    "multicast_group": group,
                                    "host": local_ip, "udp_port": self.sock.getsockname()[1], "slots": slots,
                                    "elements": elements, "raw": raw, "timeout": timeout, "codecs": list(codecs)},
                                   timeout=timeout + 5.0)["config"]
        except ControlError as e:
            self.sock.close()
            self.ctl.close()
            raise AllreduceError(f"rank {rank} could not join job {job} at switch {host}:{port}: {e}") from None
        self.slots = int(cfg["slots"])
        self.elements = int(cfg["elements"])
        self.raw = bool(cfg["raw"])
        self.register_bits = int(cfg["register_bits"])
        ports = [int(p) for p in cfg.get("ports", [port])]
        self.multicast = mcast.settle(self.sock, group, local_ip, cfg, ports)   # the switch sends results to the group
        self.group_seen = False   # the last stream (or this one) got results by the group: resends say GROUP_SEEN
        self.switch_addrs = np.zeros(len(ports), B.SOCKADDR_IN)     # one per switch shard (np.concatenate
        for i, p in enumerate(ports):                                # would drop the network byte order)
            self.switch_addrs[i] = B.sockaddr(host, p)[0]
        self.shards = len(ports)
        self.host_aggregator = cfg.get("host_aggregator")  # {"port", "label"} when the service runs one
        self._host: HostAggClient | None = None             # connected on first use
        self._rx_wait = RX_WAIT
        B.set_recv_timeout(self.sock, RX_WAIT)
        # rows of the packet size: GRO-coalesced messages land and are cut into them (64 kB rows received into
        # straight doubled bfp32's time at 8 workers on shaped links: docs/performance.md)
        self.rx = B.RxRing(self.sock, burst=256, stride=max_packet_size(self.elements))
        self.tx = B.TxBatch(self.sock, capacity=1024)
        self.rings = chunk_encoding.PacketRings(2 * self.slots)    # the streams' packet rings, reused
        self.chunk_modulus = chunk_modulus(self.slots)      # chunk ids wrap to 0 there (ina.wire)
        self._leave_at_exit = None     # lifetime.leave_at_exit, once the client is whole
        if not 0 <= first_chunk < self.chunk_modulus:
            self.close()
            raise ValueError(f"first_chunk {first_chunk} out of range 0..{self.chunk_modulus - 1} (the chunk ids of a "
                             f"job with {self.slots} slots)")
        self._next_chunk = int(first_chunk)
        self.srtt: float | None = None      # smoothed round-trip time of a chunk (Jacobson/Karn), seconds
        self.rttvar = 0.0
        self.rtt_min = math.inf             # the fastest chunk round trip seen (nothing queued ahead of it)
        self.link_spacing: dict = {}        # (packet, result length): the last stream's result spacing (ina.transfer)
        self.run_queue = RunQueueDelay()    # the machine's wait for a core: the loss timers' floors
        self._leave_at_exit = lifetime.leave_at_exit(self)    # leaves cleanly even without close()
        log.info("rank %d joined job %d at %s:%d: %d slots, %d elements per packet, results by %s", rank, job, host,
                 port, self.slots, self.elements, f"multicast to {group}" if self.multicast else "unicast")

    # ----------------------------------------------------------------------------------------------
    def allreduce(self, tensor, codec: str = "nc", average: bool = False, key=None, sparse: bool | None = None):
        """Sum (or average) ``tensor`` over the job's workers through the switch, in place.

        ``tensor`` is a torch tensor (any float dtype, shape and device) or a numpy float array.
        ``key`` names the tensor (e.g. a parameter or bucket name) for codecs with error feedback
        (3lc-3v, bgt, qgt keep one residual per key; without a key they are stateless). Returns
        the same object. ``sparse=True`` streams only the chunks whose codes are not all zero
        (OmniReduce-style sparse block streaming, :mod:`ina.sparse`; every worker of the allreduce must
        pass the same value); None: the client's ``sparse`` (which host-aggregated codecs ignore).
        Results are decoded straight into a contiguous float32 host tensor's memory: if the allreduce
        raises after packets went out, such a tensor holds partial sums (as with Gloo's ring).
        """
        self._check_usable()
        c = self.codec(codec)
        if not c.switch_summable:
            if sparse:
                raise ValueError(f"sparse=True streams a switch-summable codec's chunks; codec {codec!r} goes "
                                 "through the host aggregator (variable-length messages): use sparse=False")
            return self._host_allreduce(tensor, c, key, average)
        sparse = self.sparse if sparse is None else bool(sparse)
        x32 = staging.to_host(tensor)        # CUDA tensors: through a pinned host buffer
        n = x32.size
        if n == 0:
            return tensor
        kw = {"key": key} if c.keeps_residuals else {}
        chunk0 = self._next_chunk
        tl = self._timeline = Timeline() if self.record_timeline else None
        try:
            exponent = c.scale_exponent(x32, **kw)     # raises ValueError on NaN/Inf before anything is sent
            values = (exponent, *c.negotiated())
            bad = [v for v in values if not -32768 <= v <= 32767]
            if bad:
                raise ValueError(f"negotiated value(s) {bad} of codec {codec!r} do not fit the 16-bit "
                                 "exponent field")
            proposals = np.array(values, np.int64)
            seed = c.next_seed()
            first = None if kw or sparse else self._first_window(c, x32, self._context(proposals, seed))
            # one payload-less packet per value: the switch's max register returns the max over workers;
            # the first data window is encoded meanwhile, under this worker's own proposals
            maxima = self._stream(proposals.size, PayloadType.NONE, c.wire_id, proposals,
                                  meanwhile=functools.partial(first.encode, self._packet_waiting) if first else None)
            if tl:
                tl.mark("negotiated")
            ctx = self._context(maxima, seed)
            self.run_queue.sample()
            out = self._reduce(c, x32, ctx, kw, sparse, first if first and first.take(ctx) else None)
        except AllreduceError as e:
            self._break(str(e))
            raise
        except BaseException as e:
            if self._next_chunk != chunk0:     # packets went out: the switch holds partial rounds of ours
                self._break(f"{type(e).__name__} during an allreduce of job {self.job} (chunk ids from "
                            f"{chunk0}): {e}")
            raise
        finally:
            self._timeline = None
        out = self._deliver(tensor, out, average)
        if tl:
            tl.mark("done")
            self.last_timeline = tl.to_dict()
        return out

    def _host_allreduce(self, tensor, c, key, average):
        """A codec an integer switch cannot sum (variable-length messages: 3lc, eaq, wgt) goes through
        the service's host aggregator (decode, sum, re-encode on a host CPU: NOT switch-feasible)."""
        if self.host_aggregator is None:
            raise ValueError(f"codec {c.name!r} cannot be summed by an integer switch and the switch service "
                             f"at {self.switch[0]}:{self.switch[1]} runs no host aggregator; switch-summable codecs: "
                             + ", ".join(n for n in compression.available() if compression.get(n).switch_summable))
        if self._host is None:
            self._host = HostAggClient((self.switch[0], int(self.host_aggregator["port"])), self.rank,
                                       self.world_size, self.job, timeout=self.timeout, seed=self._seed,
                                       token=self.ctl.token)
            log.warning("rank %d job %d: codec %s runs through the host aggregator (%s)", self.rank, self.job,
                        c.name, self.host_aggregator.get("label", "NOT switch-feasible"))
        sent0, recv0 = self._host.stats.bytes_sent, self._host.stats.bytes_received
        try:
            with self._latching():
                self._host.allreduce(tensor, c, key=key, average=average)
        finally:
            self.stats.bytes_sent += self._host.stats.bytes_sent - sent0
            self.stats.bytes_received += self._host.stats.bytes_received - recv0
        self.stats.allreduces += 1
        self.stats.elements += int(np.prod(np.shape(tensor)))
        return tensor

    def _context(self, maxima: np.ndarray, seed: int) -> ScaleContext:
        """The encoding context of the negotiated ``maxima`` (exponent, then the codec's further values)."""
        return ScaleContext(int(maxima[0]), self.world_size, self.register_bits, seed=seed,
                            agreed=tuple(int(v) for v in maxima[1:]), elements=self.elements)

    def _first_window(self, c, x32: np.ndarray, guess: ScaleContext) -> chunk_encoding.FirstWindow:
        """The first data window, to be encoded under ``guess`` while the negotiation is out."""
        ring = None
        if c.encodes_rows:             # straight into the rows of the ring the data stream will use
            ring = self.rings.stream(chunk_encoding.FirstWindow.window_chunks(x32.size, self.elements, self.slots),
                                     self.job, self.rank, c.wire_id, c.uplink_type(guess), self.elements)
        return chunk_encoding.FirstWindow(c, x32, guess, self.elements, self.slots, ring, self._timeline)

    def _packet_waiting(self) -> bool:
        """Whether a packet waits in the data socket (while negotiating: the maxima, most likely)."""
        return B.readable(self.rx.fd, 0)

    def _reduce(self, c, x32: np.ndarray, ctx: ScaleContext, kw: dict, sparse: bool = False,
                first: chunk_encoding.FirstWindow | None = None) -> np.ndarray:
        """Encode, stream and decode, pipelined: chunks are encoded into their packets as they are sent
        (:mod:`ina.chunk_encoding`: one by one for nc, else a block of ``slots`` chunks when its
        first is sent) and each burst of results is decoded as it arrives, so the codec's CPU time
        overlaps the link time instead of adding to it. ``first``: the first window, encoded under
        ``ctx`` while negotiating."""
        n, E, S = x32.size, self.elements, self.slots
        n_chunks = max(1, math.ceil(n / E))
        block = n_chunks if kw else S                      # chunks per encoding block
        ptype = c.uplink_type(ctx)                         # INT8_NARROW when the sum fits int8
        res_type = c.result_type(ctx, raw=self.raw)
        raw = self.raw or res_type != c.payload_type       # results are register sums, not codes
        output = chunk_encoding.ChunkOutput(x32, E, n_chunks)      # results go straight into x32
        tl = self._timeline

        def decode_into(payload, rows, chunks, which):
            c.decode_sum_into(payload, ctx, raw, rows, chunks, which)

        def decode(chunks: np.ndarray, payload: np.ndarray, which: np.ndarray | None = None) -> None:
            t = time.perf_counter()
            output.decode(decode_into, chunks, payload, which)
            if tl:
                tl.decode_s += time.perf_counter() - t
                tl.rx_bursts += 1
                tl.results += chunks.size

        streams = None
        if c.encodes_rows and not kw and not sparse:
            encoder = chunk_encoding.RowEncoder(c, x32, ctx, E, tl, ready=first.ready if first else 0)
        else:
            encode_block = chunk_encoding.encode_block_fn(c, x32, ctx, kw, E, block, tl)
            encoder = chunk_encoding.BlockEncoder(encode_block, block, first.codes if first else None)
        if sparse:        # every chunk's codes first: a worker announces its next non-zero chunk
            codes = np.concatenate([encode_block(b) for b in range(math.ceil(n_chunks / block))])
            zero = c.decode_sum(sparse_mod.zero_sums(res_type, E), ctx, raw=raw)    # an all-zero chunk's sum

            def fill_zero(chunks: np.ndarray) -> None:
                output.fill(chunks, zero)
            streams = functools.partial(sparse_mod.SparseStream, codes=codes, streams=S, modulus=self.chunk_modulus,
                                        ptype=ptype, result_type=res_type, fill_zero=fill_zero)
            encoder = chunk_encoding.BlockEncoder(sparse_mod.encoded_blocks(codes, block), block)   # codes ready
        self._stream(n_chunks, ptype, c.wire_id, ctx.exponent, result_type=res_type, count=n, encoder=encoder,
                     decode=decode, sparse=streams)
        return output.flat

    # ----------------------------------------------------------------------------------------------
    @property
    def next_chunk(self) -> int:
        """The chunk id the next packet stream starts at (ids wrap to 0 at ``chunk_modulus``)."""
        return self._next_chunk

    def _stream(self, n_chunks: int, ptype: PayloadType, codec_id: int, exponent, result_type=PayloadType.NONE,
                count: int = 0, encoder=None, decode=None, sparse=None, meanwhile=None):
        """Send ``n_chunks`` chunks through the job's slots and collect their results.

        Without payload (negotiation) ``exponent`` holds one value per chunk and the returned array
        holds the switch's maxima. With payload, ``encoder.load(...)`` writes new chunks' codes into
        their ring rows (:mod:`ina.chunk_encoding`), and ``decode(chunk_ids, payloads, which)`` takes each burst
        of results (``payloads[which]``: their payload rows; which None: all rows, in order). Packets
        live in a ring of 2 x slots rows: chunk c + 2S is sent only after c + S is done, which is
        sent only after c is done, so a row is never reused while its chunk is pending.
        ``sparse(c0)``, if given, makes the :class:`~ina.sparse.SparseStream` of a sparse data stream
        (one round in flight per stream, so the ring's rule holds too). ``meanwhile()``, if given, runs
        once the first window is out, before the first receive (:meth:`ina.transfer.Transfer.run`).
        """
        c0 = self._next_chunk
        self._next_chunk = (c0 + n_chunks) % self.chunk_modulus
        return Transfer(self, c0, n_chunks, ptype, codec_id, exponent, result_type, count, encoder, decode,
                        sparse(c0) if sparse else None, self._timeline).run(meanwhile)

    def rtt_sample(self, r: float) -> None:
        """A chunk's round trip ``r`` (seconds) updates srtt and rttvar (Jacobson/Karn)."""
        if self.srtt is None:
            self.srtt, self.rttvar = r, r / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - r)
            self.srtt = 0.875 * self.srtt + 0.125 * r

    def current_rto(self, queued: float = 0.0) -> float:
        """Retransmission timeout, the safety net of :mod:`ina.recovery`: srtt + 4 rttvar of the chunks'
        measured round trips (RFC 6298 with Karn's rule), at least ``rto`` and at most ``max_rto``. It
        stays well above a round trip (fast retransmission and the tail probe find real losses much
        sooner); when it fires it probes one chunk per switch shard and goes back for the rest only once
        that one's answer shows them lost (ina.recovery, rule 4; a whole window of results lost on the
        way back is mostly found sooner, by the tail probe's replay, rule 3). ``queued``: the serialisation time of the chunks in flight
        (their count x the result spacing); the last of a window on a slow link waits that long in the
        link's queue, so the timeout is at least the fastest round trip plus twice that."""
        rtt_floor = 0.0 if math.isinf(self.rtt_min) else self.rtt_min + 2 * queued
        floor = max(self.rto, rtt_floor, self.run_queue.timeout_floor())
        if self.srtt is None:
            return min(self.max_rto, floor)
        return min(self.max_rto, max(floor, self.srtt + 4 * self.rttvar))

    def probe_timeout(self, spacing: float) -> float | None:
        """How long a silence (no result at all) may last while chunks are out before the oldest is
        resent (the tail probe of :mod:`ina.recovery`): two of the fastest round trips plus four
        result spacings, at least ``min_rto``. None before the first round trip was measured."""
        if math.isinf(self.rtt_min):
            return None
        return max(self.min_rto, 2 * self.rtt_min + 4 * spacing, self.run_queue.probe_floor())

    def wait_until(self, deadline: float, now: float) -> None:
        """Let the next receive (:meth:`receive`) wait no longer than until ``deadline`` (monotonic
        seconds; a loss-recovery rule may fire then), and at most RX_WAIT."""
        self._rx_wait = min(RX_WAIT, max(RX_WAIT_MIN, deadline - now))

    def receive(self) -> int:
        """Receive a burst (``self.rx``), waiting at most as long as :meth:`wait_until` said (RX_WAIT is the
        socket's timeout; a shorter wait is precise, not rounded up to a kernel tick, which made a 1 ms
        tail probe fire after 5 to 8 ms of silence: ``RxRing.recv_within``)."""
        return self.rx.recv_within(self._rx_wait, RX_WAIT)

    def send_packets(self, pkts, rows, pkt_len):
        """Send ring rows, each to the switch shard that serves its slot (ina.wire.shard_of_slot)."""
        shard = 0
        if self.shards > 1:
            shard = shard_of_slot(header_view(pkts)["slot"][rows].astype(np.int64), self.shards)
            if self.tx.gso:                      # each shard's packets in a row: one GSO message each
                order = np.argsort(shard, kind="stable")
                rows, shard = np.asarray(rows)[order], shard[order]
                if np.ndim(pkt_len):             # per-packet lengths (sparse rounds) follow their rows
                    pkt_len = np.asarray(pkt_len)[order]
        self.tx.send(pkts, rows, pkt_len, self.switch_addrs, shard)
        self.stats.packets_sent += len(rows)
        self.stats.bytes_sent += int(np.sum(pkt_len)) if isinstance(pkt_len, np.ndarray) else int(pkt_len) * len(rows)

    def stall_message(self, n_chunks, n_done, c0) -> str:
        """Why a stream made no progress for ``timeout`` seconds, as far as the switch can tell."""
        msg = (f"job {self.job} rank {self.rank}: no progress for {self.timeout:g} s; "
               f"{n_chunks - n_done} of {n_chunks} chunks incomplete (chunk ids from {c0})")
        try:
            st = self.ctl.request({"op": "status", "job": self.job}, timeout=min(5.0, self.timeout))["status"]
        except ControlError as e:
            return msg + f"; the switch does not answer either: {e}"
        if not st.get("active"):
            return msg + f"; the switch no longer knows job {self.job} (it was torn down: {st.get('ended', '?')})"
        for key, how in (("left", "left the job cleanly"), ("disconnected", "disconnected without leaving")):
            msg += f"; rank(s) {st[key]} {how}" if st.get(key) else ""
        missing = sorted({r for w in st.get("waiting", []) for r in w["missing_ranks"]})
        if missing:
            return msg + f"; the switch is waiting for rank(s) {missing} in {st['incomplete_slots']} slot(s)"
        return msg + "; the switch has no incomplete slot (results are being lost on the way back)"

    # ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the job (the switch frees its slots once every worker left)."""
        if self.ctl is None:
            return
        if self._leave_at_exit is not None:
            self._leave_at_exit.detach()
        if self._host is not None:
            self._host.close()
            self._host = None
        try:
            self.ctl.request({"op": "leave"}, timeout=5.0)
        except ControlError as e:
            log.warning("rank %d: leaving job %d: %s", self.rank, self.job, e)
        finally:
            self.ctl.close()
            self.ctl = None
            mcast.close(self.sock, self.rank, self.job)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
