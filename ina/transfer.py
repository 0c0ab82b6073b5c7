"""One packet stream of the streaming client (:meth:`ina.client.Client._stream`): its packet ring, the
state of its chunks, and the loop that sends them and takes their results.

A loop turn is a receive, one compiled pass over the burst (:func:`ina.stream_kernels.take_burst`:
the scan of the results, Karn's round trips, the loss detector's pending list and its count of
later results, and for a dense stream the headers of the chunks the results free), the decode of
the results, the loss check, the encode of the freed chunks and one ``sendmmsg``. The state the
pass updates lives in preallocated arrays; the Python between the calls is what the codec interface
(decode, encode), the loss rules (:mod:`ina.recovery`) and the counters need.
"""
from __future__ import annotations

import math
import time

import numpy as np

from . import lifetime
from . import sparse as sparse_mod
from . import stream_kernels as SK
from .coalescing import ArrivalSpacing
from .errors import AllreduceError
from .recovery import LossDetector, long_silence, tail_copies, tail_copy_wanted
from .wire import (HEADER_SIZE, PAYLOAD_WIDTH, Flag, PayloadType, header_view, payload_view, shard_of_slot,
                   slot_of_chunk)

_NO_ROWS = np.zeros(0, np.int64)
# a resend's flags: GROUP_SEEN while results reach this rank by the multicast group (the switch then does
# not count the resend's replay against the group: switch_model.harvest.counts_against_group)
_RESEND, _RESEND_GROUP_SEEN = int(Flag.RETRANSMIT), int(Flag.RETRANSMIT | Flag.GROUP_SEEN)


def burst_scratch(cl) -> tuple:
    """The client's receive-burst scratch arrays (made on its first stream)."""
    scratch = getattr(cl, "_burst_scratch", None)
    if scratch is None:
        burst = cl.rx.burst
        scratch = cl._burst_scratch = (np.zeros(burst, np.int64), np.zeros(burst, np.int64), np.zeros(burst, bool),
                                       np.zeros(burst),
                                       (np.zeros(burst, np.int64), np.zeros(burst, np.int64), np.zeros(burst, bool)))
    return scratch


class Transfer:
    """One :meth:`ina.client.Client._stream` call: its packet ring, the state of its chunks and the loop's steps."""

    def __init__(self, cl, c0: int, n_chunks: int, ptype: PayloadType, codec_id: int, exponent,
                 result_type: PayloadType, count: int, encoder, decode, sparse=None, timeline=None):
        self.cl, self.c0, self.n_chunks = cl, c0, n_chunks
        self.sparse = sparse          # an ina.sparse.SparseStream: chunks zero everywhere are skipped
        self.E = E = cl.elements if ptype != PayloadType.NONE else 0
        self.S = cl.slots
        self.pkt_len = HEADER_SIZE + PAYLOAD_WIDTH[ptype] * E
        self.R = min(n_chunks, 2 * self.S)
        self.pkts = cl.rings.stream(self.R, cl.job, cl.rank, codec_id, ptype, E, sparse)
        self.hv = header_view(self.pkts)
        self.pv = payload_view(self.pkts, ptype, E) if E else None
        self.exps_in = np.asarray(exponent, np.int64).reshape(-1)     # one per chunk, or one for all
        self.count, self.encoder, self.decode = count, encoder, decode
        self.res_len = HEADER_SIZE + PAYLOAD_WIDTH[result_type] * E
        self.res_pv = payload_view(cl.rx.buf, result_type, E) if E else None    # the receive ring's payloads
        self.exps = np.zeros(n_chunks, np.int64)
        self.done = np.zeros(n_chunks, bool)
        # a receive burst's fresh results (rows, positions, REPLAY), round-trip scratch, and the chunks a burst's
        # results free (dense streams: positions, ring rows, witness): SK.take_burst's outputs, written before
        # they are read in every turn, so one set per client serves all its streams (one runs at a time)
        self.fresh_idx, self.fresh_jj, self.fresh_replay, self.rtt_scratch, self.nxt = burst_scratch(cl)
        ld = self.ld = LossDetector(n_chunks, self.lanes(), cl.run_queue.probe_floor())
        self.ld_arrays = (ld.tries, ld.sent_at, ld.seq, ld.witness, ld.lane, ld.later)
        self.ring = (self.pkts, 0 if sparse else self.S, n_chunks, self.R, c0, cl.chunk_modulus, self.exps_in,
                     count, E)
        self.overflow = 0
        self.checked = False          # the loss check ran in this loop turn
        self.timers_due = 0.0         # the earliest time a loss rule could fire, as the last loss check found
        self.drained = True           # the last receive emptied the socket
        self.low = 0                  # every chunk below `low` is done
        self.n_done = self.n_sent = 0
        self.max_sent = -1
        # resends say RETRANSMIT, and GROUP_SEEN while results come by the job's multicast group (a fresh result
        # without REPLAY, in this stream or the client's last one): their replays then do not count against the
        # group (ina.wire.Flag). A stream whose results all came as replays clears it for the next.
        self.group_results = 0
        self.resend_flags = _RESEND_GROUP_SEEN if cl.group_seen else _RESEND
        self.tail_copy = tail_copy_wanted(bool(sparse), bool(E), n_chunks, cl.tail_copy_from)
        # the results' arrival spacing, for coalescing and the loss timers; until it settles, the timers use the
        # last stream's of the same packet sizes (the link does not change from allreduce to allreduce)
        self.link = (self.pkt_len, self.res_len)
        self.spacing = ArrivalSpacing(cl.link_spacing.get(self.link, 0.0))
        self.tl = timeline if self.E else None     # marks of the data stream (not of the negotiation)

    def lanes(self) -> np.ndarray | None:
        """The switch shard of each chunk of the stream (ina.wire.shard_of_slot), None with one."""
        cl = self.cl
        if cl.shards == 1:
            return None
        cids = (self.c0 + np.arange(self.n_chunks)) % cl.chunk_modulus
        return shard_of_slot(slot_of_chunk(cids, self.S), cl.shards)

    def load(self, chunks: np.ndarray) -> np.ndarray:
        """Write the packets of ``chunks`` (never loaded before) into their ring rows."""
        E = self.E
        rows = chunks % self.R
        SK.fill_headers(self.pkts, rows, chunks, self.c0, self.cl.chunk_modulus, self.S, self.exps_in, self.count, E)
        if E:
            self.encoder.load(self.pkts, self.pv, rows, chunks)
        if self.sparse:
            self.cl.stats.sparse_header_only += self.sparse.load(self.pkts, self.hv, rows, chunks)
        return rows

    def send_rows(self, rows: np.ndarray) -> None:
        lens = self.sparse.lengths(self.hv, rows) if self.sparse else self.pkt_len
        self.cl.send_packets(self.pkts, rows, lens)

    def send_new(self, chunks: np.ndarray, witness: np.ndarray | bool = True, resends: np.ndarray | None = None,
                 rows: np.ndarray | None = None, top: int = -1) -> None:
        """Send chunks for the first time (their packets are loaded into the ring first). ``witness``:
        whether a chunk's result may show the loss of chunks sent before it (ina.recovery). ``resends``:
        ring rows of this turn's resends (:meth:`retransmit_lost`), sent first in the same batch.
        ``rows``: the chunks' ring rows when their headers are written already (SK.take_burst: only their
        codes are loaded here, and ``top`` is the largest of ``chunks``)."""
        if not chunks.size:
            return
        if rows is None:
            rows = self.load(chunks)
            if witness is not True and not np.all(witness):   # sent after a replay: later than at the peers (Flag.LATE)
                self.hv["flags"][rows[~np.broadcast_to(witness, rows.shape)]] |= int(Flag.LATE)
            top = int(chunks.max())               # sparse rounds come in any order
        elif self.E:
            self.encoder.load(self.pkts, self.pv, rows, chunks)
        if self.tail_copy and top == self.n_chunks - 1:
            rows = tail_copies(rows, chunks, self.n_chunks, self.hv, self.cl.stats, top)     # ina.recovery
        self.send_rows(rows if resends is None or not resends.size else np.concatenate([resends, rows]))
        self.ld.sent(chunks, time.monotonic(), witness)
        self.n_sent += chunks.size
        self.max_sent = max(self.max_sent, top)
        if self.tl:
            self.tl.mark("first_send")
            if self.n_sent >= min(self.S, self.n_chunks):
                self.tl.mark("window_sent")
            if self.n_sent == self.n_chunks:
                self.tl.mark("last_send")

    def run(self, meanwhile=None) -> np.ndarray:
        """Send the first window, run ``meanwhile()`` if given (work that needs none of the results:
        the client encodes its first data window while the negotiation is out), then take results."""
        cl, n_chunks = self.cl, self.n_chunks
        started = time.monotonic()
        self.send_new(np.arange(min(self.S, n_chunks)))
        if meanwhile is not None:
            meanwhile()
        now = self.last_progress = time.monotonic()
        while self.n_done < n_chunks:
            k = cl.receive()
            now = time.monotonic()
            cl.run_queue.turn(now)
            self.checked = False                  # set once retransmit_lost ran in this turn
            self.drained = k < cl.rx.burst        # a full burst: more results may wait in the socket
            if not k:
                self.spacing.idle()
                if self.tl:
                    self.tl.idle_turns += 1
            else:
                self.receive(k, now)
            if self.n_done < n_chunks:
                if not self.checked:
                    self.retransmit_lost(now)
                if now - self.last_progress > cl.timeout:
                    raise AllreduceError(cl.stall_message(n_chunks, self.n_done, self.c0))
        if (prior := self.spacing.next_prior(started)) is not None:
            cl.link_spacing[self.link] = prior        # the next stream's timers start from it
        cl.group_seen = cl.multicast and self.group_results > 0
        if self.overflow:
            raise AllreduceError(f"job {cl.job}: {self.overflow} chunk(s) came back with the OVERFLOW flag: a switch "
                                 "register saturated, so the sum is not exact (the inputs exceed the negotiated scale)")
        return self.exps

    def receive(self, k: int, now: float) -> None:
        """Take a burst of ``k`` received packets: results of this transfer, aborts, stale packets."""
        cl, stats, sp, buf = self.cl, self.cl.stats, self.sparse, self.cl.rx.buf
        stats.packets_received += k
        scan = (cl.job, self.c0, cl.chunk_modulus, self.max_sent + 1, sp.result_len if sp else self.res_len,
                sp.skip_len if sp else -1, bool(sp), bool(self.E))
        fresh, ok, other, nbytes, abort, overflow, mismatch, n_rep, rtts, pending, n_new, top, self.low = \
            SK.take_burst(buf, cl.rx.lens, k, scan, self.done, self.exps, self.fresh_idx, self.fresh_jj,
                          self.fresh_replay, self.ld_arrays, now, self.rtt_scratch, self.low, self.max_sent, self.ring,
                          self.nxt)
        stats.bytes_received += nbytes
        if fresh > n_rep and cl.multicast:
            self.group_results += fresh - n_rep
            self.resend_flags = _RESEND_GROUP_SEEN
        if abort >= 0:
            why = lifetime.abort_reason(cl.ctl, cl.job, int(header_view(buf[abort:abort + 1])["rank"][0]))
            raise AllreduceError(f"job {cl.job} was aborted by the switch: {why}; "
                                 f"{self.n_chunks - self.n_done} of {self.n_chunks} chunks incomplete")
        if mismatch:
            sparse_mod.check_agreement(header_view(buf[:k])["flags"], bool(sp), cl.job)
        stats.duplicate_results += ok - fresh
        stats.stale_results += other
        self.overflow += overflow
        recovered = fresh > 0 and rtts[3]         # Karn: round trips only of chunks never resent
        self.spacing.sample(k, now, recovered, fresh > 0 and n_rep == fresh,
                            self.ld.probed_after() if recovered else math.inf)
        if fresh:
            self.complete(fresh, n_rep, rtts, pending, n_new, top, now)
            if self.drained and self.n_done < self.n_chunks:      # (a full burst: more results wait already)
                t = time.monotonic()
                stats.coalesce_pause_s += self.spacing.pause(self.n_sent - self.n_done, self.n_sent == self.n_chunks,
                                                             self.timers_due - t, t - now, cl.coalesce)

    def complete(self, fresh: int, n_rep: int, rtts: tuple, pending: np.ndarray, n_new: int, top: int,
                 now: float) -> None:
        """The burst's ``fresh`` results (SK.take_burst took them: marked done, exponents taken, counted
        against the ``pending`` chunks): decode, account, send the next chunks (``n_new`` of them with
        their headers written, dense streams). ``n_rep``: how many came with the REPLAY flag."""
        buf, idx, jj, replayed = self.cl.rx.buf, self.fresh_idx[:fresh], self.fresh_jj[:fresh], \
            self.fresh_replay[:fresh]
        if self.tl:
            self.tl.mark("first_result")
        sp = self.sparse
        if self.E:
            if sp:        # zeros for header-only results
                self.decode(jj, sp.payloads(buf, idx, self.cl.rx.lens))
            else:         # straight from the receive ring into the output
                self.decode(jj, self.res_pv, idx)
        ld = self.ld
        if n_rep:                                 # resends the switch answered with a replay, by rule
            ld.count_replayed(jj[replayed], self.cl.stats)
        if ld.rto_probing:                        # a timeout probe's answer arms its lane's go-back (rule 4)
            ld.answered(jj, replayed)
        samples, fastest, median, _ = rtts        # Karn: no samples from retransmitted chunks
        if samples:
            # a negotiation round waits for the slowest rank: no srtt sample, but the fastest round trip
            # is at most that long, so the tail probe has a bound from the first allreduce on; a round
            # whose wait ran other work first (``run(meanwhile)``, negotiations only) counts that work
            # too: still a bound, which the data stream's first results replace
            self.cl.rtt_min = min(self.cl.rtt_min, fastest)
            if self.E:    # the median
                self.cl.rtt_sample(median)
        ld.arrived(now)                           # (its count of later results ran in SK.take_burst)
        self.n_done += fresh
        self.last_progress = now
        if sp:            # the streams' next rounds; the chunks in between are zero everywhere
            skipped, nxt = sp.advance(buf, idx, self.cl.rx.lens, jj)
            self.done[skipped] = True
            self.n_done += skipped.size
            self.cl.stats.sparse_chunks_skipped += skipped.size
            self.low = SK.first_not_done(self.low, self.done)
        if self.tl and self.n_done == self.n_chunks:
            self.tl.mark("last_result")
        resends = self.retransmit_lost(now, pending, send=False)   # ahead of the new chunks, in their batch:
        self.checked = True                       # a peer that waits for one of ours gets it before what follows it
        if sp:
            follows = nxt < self.n_chunks
            if follows.any():
                # a replay came to this rank alone, after the others had the result: the chunk it frees is
                # sent here later than by the peers, so its result says nothing of the chunks sent before it
                self.send_new(nxt[follows], ~replayed[follows], resends)
                return
        elif n_new:       # self-clocking: each result frees its slot (chunk j + slots, headers written)
            chunks, rows, wit = self.nxt
            self.send_new(chunks[:n_new], wit[:n_new], resends, rows[:n_new], top)
            return
        if resends.size:
            self.send_rows(resends)

    def retransmit_lost(self, now: float, pending: np.ndarray | None = None, send: bool = True) -> np.ndarray:
        """Resend the chunks :class:`~ina.recovery.LossDetector` finds lost: fast where later results
        show the gap, after a silence or the timeout for the tail. Returns their ring rows (flagged
        RETRANSMIT); ``send`` False: not sent yet, the caller sends them ahead of its new chunks in one
        batch (one sendmmsg per turn)."""
        cl, ld = self.cl, self.ld
        if pending is None:   # (``pending``: computed since nothing was sent or completed)
            pending = ld.pending(self.low, self.max_sent, self.done)
        # a full receive burst: results may still wait in the socket (after a stall): no silence, no timeout yet
        per_pkt = self.spacing.for_timers()
        if self.drained:
            pto, rto, max_rto = cl.probe_timeout(per_pkt), cl.current_rto((self.n_sent - self.n_done) * per_pkt), \
                cl.max_rto
        else:     # (pto None: no probe, so max_rto bounds nothing below and next_deadline's cl.max_rto is moot)
            pto, rto, max_rto = None, math.inf, math.inf
        quiet = ld.quiet_deadline(pending, now, cl.srtt, rto, max_rto, pto, cl.rttvar, per_pkt)
        if quiet is not None:             # no rule can fire: the common turn, in one compiled pass
            self._await_timers(quiet, rto, max_rto, now)
            return _NO_ROWS
        fast, probe, late = ld.lost(pending, now, cl.srtt, rto, max_rto, pto, cl.rttvar, per_pkt)
        rows = _NO_ROWS
        if fast.size or probe.size or late.size:
            lost = np.concatenate([fast, probe, late])
            rows = lost % self.R                 # every sent, not-done chunk still owns its ring row
            self.hv["flags"][rows] |= self.resend_flags
            if send:
                self.send_rows(rows)
            cl.stats.repeat_retransmissions += int(np.count_nonzero(self.ld.tries[lost]))
            self.ld.resent(lost, now, probed=probe.size > 0, rules=(fast, probe, late))
            cl.stats.fast_retransmissions += fast.size
            cl.stats.probe_retransmissions += probe.size
            cl.stats.stall_probes += probe.size if long_silence(pending.size) else 0
            cl.stats.timeout_retransmissions += late.size
            cl.stats.timeout_go_back += self.ld.went_back
            cl.stats.retransmissions += lost.size
        self._await_timers(self.ld.next_deadline(pending, cl.srtt, cl.rttvar, pto, cl.max_rto, per_pkt), rto, max_rto,
                           now)
        return rows

    def _await_timers(self, due: float, rto: float, max_rto: float, now: float) -> None:
        """The receive waits at most until ``due`` (the next loss rule's deadline), and a coalescing pause ends
        before it and before rule 4's timer."""
        self.cl.wait_until(due, now)
        self.timers_due = min(due, self.ld.rto_at(rto, max_rto))
