"""The streaming allreduce client: feeds a tensor's chunks through the switch's slots.

One allreduce is:

1. **exponent negotiation**: one packet with no payload whose exponent field is this worker's
   scale exponent (plus one such packet per further value the codec needs agreed, e.g. MQGrad's
   bits); the switch's max-exponent register returns the max over workers;
2. **stream** fixed-length chunks: chunk c goes to pool index c % slots, shadow set (c // slots) % 2;
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

import logging
import math
import time
from dataclasses import dataclass, replace

import numpy as np

from . import burst as B
from . import compression
from .compression._seedutil import ErrorFeedbackMixin
from .compression.base import ScaleContext, native, to_numpy_f32, write_back
from .control import ControlChannel, ControlError
from .wire import (HEADER_SIZE, PAYLOAD_WIDTH, VERSION, Flag, MsgType, PayloadType, header_view,
                   payload_view)

log = logging.getLogger("ina.client")


COALESCE_TARGET = 16      # results per receive burst that receive coalescing aims at
COALESCE_SPACING = 2e-4   # ... when results arrive further apart than this (a 8 kB packet at 330 Mbit/s)


class AllreduceError(RuntimeError):
    """An allreduce could not complete; the message says what was missing."""


@dataclass
class ClientStats:
    allreduces: int = 0
    packets_sent: int = 0
    bytes_sent: int = 0
    packets_received: int = 0
    bytes_received: int = 0
    retransmissions: int = 0
    stale_results: int = 0
    elements: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Client:
    """A worker of one job at one switch.

    ``Client(switch=("host", port), rank=r, world_size=n, job=j)`` joins job ``j`` at the switch
    (a rendezvous: it returns once all ``n`` ranks joined, or raises after ``timeout``).
    ``elements`` is the chunk length (elements per packet) and ``slots`` the job's share of the
    switch's slot pool, i.e. the window of chunks in flight.
    """

    def __init__(self, switch=("127.0.0.1", 9999), rank: int = 0, world_size: int = 1, job: int = 0, *,
                 elements: int = 1024, slots: int = 64, raw: bool = False, timeout: float = 30.0,
                 rto: float = 0.02, max_rto: float = 1.0, seed: int | None = None, codec_options: dict | None = None,
                 coalesce: float = 0.004):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        host, port = switch
        self.switch = (host, int(port))
        self.rank, self.world_size, self.job = rank, world_size, job
        self.timeout, self.rto, self.max_rto = float(timeout), float(rto), float(max_rto)
        self.coalesce = float(coalesce)       # longest pause to let results accumulate (0: off)
        self.stats = ClientStats()
        self._codecs: dict[str, compression.Codec] = {}
        self._codec_options = codec_options or {}
        self._seed = seed if seed is not None else int(np.random.default_rng().integers(0, 2**31))
        self._broken: str | None = None
        self.sock = B.udp_socket("0.0.0.0", 0)
        self.ctl = ControlChannel(host, int(port), timeout=min(timeout, 10.0))
        local_ip = self.ctl.sock.getsockname()[0]
        try:
            cfg = self.ctl.request({"op": "join", "job": job, "rank": rank, "world_size": world_size,
                                    "host": local_ip, "udp_port": self.sock.getsockname()[1], "slots": slots,
                                    "elements": elements, "raw": raw, "timeout": timeout},
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
        self.switch_addrs = np.zeros(len(ports), B.SOCKADDR_IN)     # one per switch shard (np.concatenate
        for i, p in enumerate(ports):                                # would drop the network byte order)
            self.switch_addrs[i] = B.sockaddr(host, p)[0]
        self.shards = len(ports)
        self.host_aggregator = cfg.get("host_aggregator")  # {"port", "label"} when the service runs one
        self._host: object | None = None                    # HostAggClient, connected on first use
        B.set_recv_timeout(self.sock, 0.002)
        self.rx = B.RxRing(self.sock, burst=256, stride=HEADER_SIZE + 8 * self.elements)
        self.tx = B.TxBatch(self.sock, capacity=1024)
        self._next_chunk = 0
        self.srtt: float | None = None      # smoothed round-trip time of a chunk (Jacobson/Karn), seconds
        self.rttvar = 0.0
        log.info("rank %d joined job %d at %s:%d: %d slots, %d elements per packet", rank, job, host, port,
                 self.slots, self.elements)

    # ----------------------------------------------------------------------------------------------
    def codec(self, name: str) -> compression.Codec:
        c = self._codecs.get(name)
        if c is None:
            opts = dict(self._codec_options.get(name, {}))
            opts.setdefault("seed", self._seed * 1_000_003 + self.rank)
            c = self._codecs[name] = compression.get(name, **opts)
        return c

    def allreduce(self, tensor, codec: str = "nc", average: bool = False, key=None):
        """Sum (or average) ``tensor`` over the job's workers through the switch, in place.

        ``tensor`` is a torch tensor (any float dtype, shape and device) or a numpy float array.
        ``key`` names the tensor (e.g. a parameter or bucket name) for codecs with error feedback
        (3lc-3v, bgt, qgt keep one residual per key; without a key they are stateless). Returns
        the same object.
        """
        if self._broken:
            raise AllreduceError(f"client of job {self.job} rank {self.rank} is unusable after an earlier "
                                 f"failure: {self._broken}")
        c = self.codec(codec)
        if not c.switch_summable:
            return self._host_allreduce(tensor, c, key, average)
        x32 = to_numpy_f32(tensor)
        n = x32.size
        if n == 0:
            return tensor
        kw = {"key": key} if isinstance(c, ErrorFeedbackMixin) else {}
        chunk0 = self._next_chunk
        try:
            exponent = c.scale_exponent(x32, **kw)     # raises ValueError on NaN/Inf before anything is sent
            proposals = np.array([exponent, *c.negotiated()], np.int64)
            bad = proposals[(proposals < -32768) | (proposals > 32767)]
            if bad.size:
                raise ValueError(f"negotiated value(s) {bad.tolist()} of codec {codec!r} do not fit the 16-bit "
                                 "exponent field")
            # one payload-less packet per value: the switch's max register returns the max over workers
            maxima = self._stream(proposals.size, PayloadType.NONE, c.wire_id, proposals)
            ctx = ScaleContext(int(maxima[0]), self.world_size, self.register_bits, seed=c.next_seed(),
                               agreed=tuple(int(v) for v in maxima[1:]), elements=self.elements)
            out = self._reduce(c, x32, ctx, kw)
        except AllreduceError as e:
            self._broken = str(e)
            raise
        except BaseException as e:
            if self._next_chunk != chunk0:     # packets went out: the switch holds partial rounds of ours
                self._broken = (f"{type(e).__name__} during an allreduce of job {self.job} (chunk ids from "
                                f"{chunk0}): {e}")
            raise
        if average:
            out = out / np.float32(self.world_size)
        self.stats.allreduces += 1
        self.stats.elements += n
        write_back(tensor, out)
        return tensor

    def _host_allreduce(self, tensor, c, key, average):
        """A codec an integer switch cannot sum (variable-length messages: 3lc, eaq, wgt) goes through
        the service's host aggregator (decode, sum, re-encode on a host CPU: NOT switch-feasible)."""
        if self.host_aggregator is None:
            raise ValueError(f"codec {c.name!r} cannot be summed by an integer switch and the switch service "
                             f"at {self.switch[0]}:{self.switch[1]} runs no host aggregator; switch-summable codecs: "
                             + ", ".join(n for n in compression.available() if compression.get(n).switch_summable))
        if self._host is None:
            from .host_client import HostAggClient
            self._host = HostAggClient((self.switch[0], int(self.host_aggregator["port"])), self.rank,
                                       self.world_size, self.job, timeout=self.timeout, seed=self._seed)
            log.warning("rank %d job %d: codec %s runs through the host aggregator (%s)", self.rank, self.job,
                        c.name, self.host_aggregator.get("label", "NOT switch-feasible"))
        sent0, recv0 = self._host.stats.bytes_sent, self._host.stats.bytes_received
        try:
            self._host.allreduce(tensor, c, key=key, average=average)
        except AllreduceError as e:
            self._broken = str(e)
            raise
        finally:
            self.stats.bytes_sent += self._host.stats.bytes_sent - sent0
            self.stats.bytes_received += self._host.stats.bytes_received - recv0
        self.stats.allreduces += 1
        self.stats.elements += int(np.prod(np.shape(tensor)))
        return tensor

    def _result_type(self, c) -> PayloadType:
        if c.payload_type == PayloadType.NC8:
            if not self.raw:
                return PayloadType.NC8
            return PayloadType.INT64 if self.register_bits == 64 else PayloadType.INT32
        return PayloadType.INT32

    def _reduce(self, c, x32: np.ndarray, ctx: ScaleContext, kw: dict) -> np.ndarray:
        """Encode, stream and decode, pipelined: a block of ``slots`` chunks is encoded when its first
        chunk is about to be sent, and each burst of results is decoded as it arrives, so the codec's
        CPU time overlaps the link time instead of adding to it. Codecs with error feedback encode the
        tensor as one block (their residual is kept per key for the whole tensor)."""
        n, E, S = x32.size, self.elements, self.slots
        n_chunks = max(1, math.ceil(n / E))
        block = n_chunks if kw else S                      # chunks per encoding block
        ptype = c.payload_type
        res_type = self._result_type(c)
        raw = res_type != c.payload_type or self.raw
        if c.int8_sums(ctx):
            ptype = res_type = PayloadType.INT8_NARROW      # the sum fits int8: 1 byte per element down
        out = np.empty(n_chunks * E, np.float32)
        out2d = out.reshape(n_chunks, E)

        def encode_block(b: int) -> np.ndarray:
            lo, hi = b * block * E, min(n, (b + 1) * block * E)
            # the kernels draw uniform(i, seed) = hash(i * 0x9E3779B9 + seed): shifting the seed by lo
            # elements makes block b draw exactly what a whole-tensor encode draws for its elements
            bctx = ctx if b == 0 else replace(ctx, seed=(ctx.seed + 0x9E3779B9 * lo) & 0xFFFFFFFF)
            codes = c.encode_shared(x32[lo:hi], bctx, **kw)
            rows = math.ceil((hi - lo) / E)
            if codes.size != rows * E:                     # the last chunk is zero-padded
                codes = np.concatenate([codes, np.zeros(rows * E - codes.size, codes.dtype)])
            return codes.reshape(rows, E)

        def decode(chunks: np.ndarray, payload: np.ndarray) -> None:
            out2d[chunks] = c.decode_sum(payload.reshape(-1), ctx, raw=raw).reshape(chunks.size, E)

        self._stream(n_chunks, ptype, c.wire_id, ctx.exponent, result_type=res_type, count=n,
                     encode_block=encode_block, block=block, decode=decode)
        return out[:n]

    # ----------------------------------------------------------------------------------------------
    def _stream(self, n_chunks: int, ptype: PayloadType, codec_id: int, exponent, result_type=PayloadType.NONE,
                count: int = 0, encode_block=None, block: int = 1, decode=None):
        """Send ``n_chunks`` chunks through the job's slots and collect their results.

        Without payload (negotiation) ``exponent`` holds one value per chunk and the returned array
        holds the switch's maxima. With payload, ``encode_block(b)`` gives the codes of chunks
        ``b*block ..`` as a (rows, E) array, and ``decode(chunk_ids, payloads)`` takes each burst of
        results. Packets live in a ring of 2 x slots rows: chunk c + 2S is sent only after c + S is
        done, which is sent only after c is done, so a row is never reused while its chunk is pending.
        """
        E = self.elements if ptype != PayloadType.NONE else 0
        S = self.slots
        width = PAYLOAD_WIDTH[ptype]
        pkt_len = HEADER_SIZE + width * E
        R = min(n_chunks, 2 * S)
        c0 = self._next_chunk
        self._next_chunk += n_chunks
        pkts = np.zeros((R, max(pkt_len, HEADER_SIZE)), np.uint8)
        hv = header_view(pkts)
        hv["version"] = VERSION
        hv["msg_type"] = int(MsgType.DATA)
        hv["job"] = self.job
        hv["rank"] = self.rank
        hv["codec"] = codec_id
        hv["payload_type"] = int(ptype)
        pv = payload_view(pkts, ptype, E) if E else None
        exps_in = np.broadcast_to(np.asarray(exponent, np.int64), (n_chunks,))
        blocks: dict[int, np.ndarray] = {}
        left_in_block: dict[int, int] = {}

        def load(chunks: np.ndarray) -> np.ndarray:
            """Write the packets of ``chunks`` (never loaded before) into their ring rows."""
            rows = chunks % R
            ids = c0 + chunks
            hv["slot"][rows] = (ids % S) | (((ids // S) & 1) << 15)
            hv["chunk"][rows] = ids & 0xFFFFFFFF
            hv["exponent"][rows] = exps_in[chunks]
            hv["flags"][rows] = 0
            if E:
                hv["count"][rows] = np.minimum(E, count - chunks * E)
                bs = chunks // block
                for b in np.unique(bs):
                    b = int(b)
                    if b not in blocks:
                        blocks[b] = encode_block(b)
                        left_in_block[b] = blocks[b].shape[0]
                    sel = bs == b
                    pv[rows[sel]] = blocks[b][chunks[sel] - b * block]
                    left_in_block[b] -= int(np.count_nonzero(sel))
                    if left_in_block[b] == 0:          # every chunk of the block is in the ring
                        del blocks[b], left_in_block[b]
            return rows

        rwidth = PAYLOAD_WIDTH[result_type]
        res_len = HEADER_SIZE + rwidth * E
        exps = np.zeros(n_chunks, np.int64)
        done = np.zeros(n_chunks, bool)
        sent_at = np.zeros(n_chunks)
        tries = np.zeros(n_chunks, np.int64)
        overflow = 0
        first = np.arange(min(S, n_chunks))
        self._send(pkts, load(first), pkt_len)
        now = time.monotonic()
        sent_at[first] = now
        max_sent = first.size - 1
        low = 0                       # every chunk below `low` is done
        n_done = 0
        last_progress = now
        next_check = now + self.current_rto()
        n_sent = first.size
        last_rx, per_pkt = None, 0.0          # arrival spacing (EWMA, seconds per packet) for coalescing
        while n_done < n_chunks:
            k = self.rx.recv(wait=True)
            now = time.monotonic()
            if not k:
                last_rx = None                # an idle gap (peers, a loss) says nothing about the link
            else:
                if last_rx is not None:
                    per_pkt = 0.8 * per_pkt + 0.2 * (now - last_rx) / k if per_pkt else (now - last_rx) / k
                last_rx = now
                self.stats.packets_received += k
                self.stats.bytes_received += int(self.rx.lens[:k].sum())
                buf = self.rx.buf[:k]
                h = header_view(buf)
                mt = h["msg_type"]
                if (mt == int(MsgType.ABORT)).any():
                    ab = h[(mt == int(MsgType.ABORT)) & (h["job"] == self.job)]
                    if ab.size:
                        raise AllreduceError(f"job {self.job} was aborted by the switch: rank {int(ab['rank'][0])} "
                                             f"left the job; {n_chunks - n_done} of {n_chunks} chunks incomplete")
                ok = (mt == int(MsgType.RESULT)) & (h["job"] == self.job) & (self.rx.lens[:k] == res_len)
                j = h["chunk"].astype(np.int64) - (c0 & 0xFFFFFFFF)
                ok &= (j >= 0) & (j < n_chunks)
                stale = int(np.count_nonzero(~ok))
                jj = j[ok]
                if jj.size:
                    fresh = ~done[jj]
                    idx = np.nonzero(ok)[0][fresh]
                    jj, first_pos = np.unique(jj[fresh], return_index=True)
                    idx = idx[first_pos]
                    stale += int(np.count_nonzero(ok)) - jj.size
                    if jj.size:
                        if E:
                            decode(jj, native(payload_view(buf[idx], result_type, E)))
                        first_try = jj[tries[jj] == 0]       # Karn: no samples from retransmitted chunks
                        if first_try.size and E:             # negotiation rounds wait for the slowest rank
                            self._rtt_sample(float(np.median(now - sent_at[first_try])))
                        exps[jj] = h["exponent"][idx]
                        overflow += int(np.count_nonzero(h["flags"][idx] & int(Flag.OVERFLOW)))
                        done[jj] = True
                        n_done += jj.size
                        last_progress = now
                        nxt = jj + S                      # self-clocking: each result frees its slot
                        nxt = nxt[nxt < n_chunks]
                        if nxt.size:
                            self._send(pkts, load(nxt), pkt_len)
                            sent_at[nxt] = time.monotonic()
                            n_sent += nxt.size
                            max_sent = max(max_sent, int(nxt[-1]))
                        while low < n_chunks and done[low]:
                            low += 1
                self.stats.stale_results += stale
                # receive coalescing: on a slow link results trickle in one by one and each loop turn costs
                # ~100 us of Python; with a full window still in flight, let a few more arrive first (on a
                # fast link they arrive faster than a loop turn and batch by themselves)
                in_flight = n_sent - n_done
                if k < COALESCE_TARGET and in_flight > 2 * COALESCE_TARGET and per_pkt > COALESCE_SPACING:
                    pause = min(self.coalesce, per_pkt * (COALESCE_TARGET - k), in_flight * per_pkt / 4)
                    if pause > 5e-5:
                        time.sleep(pause)
            if now >= next_check and n_done < n_chunks:
                rto = self.current_rto()
                next_check = now + rto / 2
                hi = max_sent + 1             # every sent, not-done chunk still owns its ring row
                win = np.arange(low, hi)
                w = win[(~done[low:hi]) & (sent_at[low:hi] > 0)]
                late = w[now - sent_at[w] > np.minimum(rto * 2.0 ** tries[w], self.max_rto)]
                if late.size:
                    rows = late % R
                    hv["flags"][rows] |= int(Flag.RETRANSMIT)
                    self._send(pkts, rows, pkt_len)
                    sent_at[late] = now
                    tries[late] += 1
                    self.stats.retransmissions += late.size
                if now - last_progress > self.timeout:
                    raise AllreduceError(self._stall_message(n_chunks, n_done, c0))
        if overflow:
            raise AllreduceError(f"job {self.job}: {overflow} chunk(s) came back with the OVERFLOW flag: a switch "
                                 "register saturated, so the sum is not exact (the inputs exceed the negotiated scale)")
        return exps

    def _rtt_sample(self, r: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = r, r / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - r)
            self.srtt = 0.875 * self.srtt + 0.125 * r

    def current_rto(self) -> float:
        """Retransmission timeout: srtt + 4 rttvar of the chunks' measured round trips (RFC 6298 with
        Karn's rule), at least ``rto`` (the configured minimum) and at most ``max_rto``. A full window
        queued behind a slow link or a busy switch makes the round trip long; a fixed timeout would
        retransmit spuriously and add to the load."""
        if self.srtt is None:
            return self.rto
        return min(self.max_rto, max(self.rto, self.srtt + 4 * self.rttvar))

    def _send(self, pkts, rows, pkt_len):
        """Send ring rows; pool index p (the slot field's low 15 bits) is served by shard p % shards."""
        shard = (header_view(pkts)["slot"][rows].astype(np.int64) & 0x7FFF) % self.shards
        self.tx.send(pkts, rows, pkt_len, self.switch_addrs, shard)
        self.stats.packets_sent += len(rows)
        self.stats.bytes_sent += len(rows) * pkt_len

    def _stall_message(self, n_chunks, n_done, c0) -> str:
        msg = (f"job {self.job} rank {self.rank}: no progress for {self.timeout:g} s; "
               f"{n_chunks - n_done} of {n_chunks} chunks incomplete (chunk ids from {c0})")
        try:
            st = self.ctl.request({"op": "status", "job": self.job}, timeout=min(5.0, self.timeout))["status"]
        except ControlError as e:
            return msg + f"; the switch does not answer either: {e}"
        if not st.get("active"):
            return msg + f"; the switch no longer knows job {self.job} (it was torn down)"
        missing = sorted({r for w in st.get("waiting", []) for r in w["missing_ranks"]})
        if missing:
            return msg + f"; the switch is waiting for rank(s) {missing} in {st['incomplete_slots']} slot(s)"
        return msg + "; the switch has no incomplete slot (results are being lost on the way back)"

    # ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the job (the switch frees its slots once every worker left)."""
        if self.ctl is None:
            return
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
            self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

