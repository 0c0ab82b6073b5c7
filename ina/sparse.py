"""Sparse block streaming (OmniReduce-style) for the streaming client: chunks whose codes are all zero
do not travel, and rounds skip the chunks that are zero at every worker.

A job's chunks form ``S`` *streams* (S: the job's pool slots): positions j, j + S, j + 2S, ... share a
pool index, and the stream's rounds go through that slot one after the other. In a sparse allreduce
every packet carries the SPARSE flag and a trailer ``next`` (ina.wire.SPARSE_TRAILER): the chunk id
of its sender's next round in the stream. The switch keeps the min over a round's packets and the
round's result carries it, so every worker learns the stream's next round; the chunks in between are
zero everywhere and are filled without any packet.

* The first chunk of each stream (positions 0..S-1) is a round of every worker.
* In a round, a worker whose chunk is non-zero sends it with its codes; a worker whose chunk is zero
  sends a header-only packet (payload NONE, 24 bytes): the switch completes a round when all workers'
  packets are in, so the slot protocol, its replays, duplicates and stale packets keep their rules.
* A worker announces its next non-zero chunk of the stream, or the chunk one step before it, so that
  consecutive rounds of a stream are an odd number of steps S apart (ina.wire.sparse_announce): they
  alternate between the slot's two shadow sets, as dense chunks do. Past the last chunk the
  announcement is the stream's first position after the tensor (what the next allreduce uses first).

Bytes up scale with a worker's own non-zero chunks (plus 24 bytes per round it is zero in), bytes
down with the chunks that are non-zero at some worker. Codes are zero blocks after encoding, so this
composes with every switch-summable codec; the whole tensor is encoded before the first packet (a
worker must know its next non-zero chunk), so encoding does not overlap the stream as in dense mode.
"""
from __future__ import annotations

import numpy as np

from .compression.base import native
from .errors import AllreduceError
from .wire import (HEADER_SIZE, PAYLOAD_DTYPE, PAYLOAD_WIDTH, TRAILER_DTYPE, TRAILER_SIZE, Flag, PayloadType,
                   payload_view, sparse_announce, sparse_next_ok)

__all__ = ["next_nonzero", "zero_sums", "encoded_blocks", "check_agreement", "SparseStream"]


def next_nonzero(nonzero: np.ndarray, streams: int) -> np.ndarray:
    """For every chunk position j: the position of the next non-zero chunk of j's stream after j (the
    positions j + S, j + 2S, ...), or, if there is none, the stream's first position past the tensor."""
    n, S = nonzero.size, int(streams)
    R = -(-n // S)
    grid = np.ones((R + 1, S), bool)               # positions >= n and the row after the last: the end
    grid[:R].reshape(-1)[:n] = nonzero
    rows = np.where(grid, np.arange(R + 1)[:, None], R + 1)
    after = np.minimum.accumulate(rows[::-1], axis=0)[::-1]      # first marked row >= r, per stream
    return (after[1:] * S + np.arange(S)).reshape(-1)[:n]


def zero_sums(result_type: PayloadType, elements: int) -> np.ndarray:
    """The result payload of a chunk that is zero at every worker (native byte order, for decode_sum)."""
    return np.zeros(elements, PAYLOAD_DTYPE[result_type].newbyteorder("="))


def encoded_blocks(codes: np.ndarray, block: int):
    """The client's ``encode_block(b)`` for a tensor encoded ahead: rows b * block .. of ``codes``."""
    def rows(b: int) -> np.ndarray:
        return codes[b * block:(b + 1) * block]
    return rows


def check_agreement(result_flags: np.ndarray, sparse: bool, job: int) -> None:
    """Raise if results of this worker's data stream disagree with its ``sparse`` setting: a round that
    another worker streamed sparse (or dense) while this one did not; the results would never fit."""
    other = (result_flags & int(Flag.SPARSE)) == 0 if sparse else (result_flags & int(Flag.SPARSE)) != 0
    if other.any():
        raise AllreduceError(f"job {job}: this worker streams {'sparse' if sparse else 'dense'} chunks but the "
                             f"switch's results are {'dense' if sparse else 'sparse'}: every worker of an allreduce "
                             "must pass the same sparse= to Client.allreduce")


def _u32_be(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, TRAILER_DTYPE["next"]).view(np.uint8).reshape(-1, TRAILER_SIZE)


class SparseStream:
    """The sparse side of one data stream: which packets to send, and what the results announce.

    ``codes``: the tensor's codes, (chunks, E). ``c0``: the chunk id of position 0; ``modulus``: the
    job's chunk modulus; ``fill_zero(positions)``: writes the decoded sum of an all-zero chunk there.
    """

    def __init__(self, c0: int, *, codes: np.ndarray, streams: int, modulus: int, ptype: PayloadType,
                 result_type: PayloadType, fill_zero):
        n, E = codes.shape
        self.n, self.S, self.E, self.c0, self.modulus = n, int(streams), E, int(c0), int(modulus)
        self.nonzero = codes.reshape(n, -1).any(axis=1)
        self.announce = sparse_announce(np.arange(n), next_nonzero(self.nonzero, self.S), self.S)
        self.ptype, self.result_type, self.fill_zero = ptype, result_type, fill_zero
        self.data_len = HEADER_SIZE + PAYLOAD_WIDTH[ptype] * E + TRAILER_SIZE
        self.skip_len = HEADER_SIZE + TRAILER_SIZE
        self.result_len = HEADER_SIZE + PAYLOAD_WIDTH[result_type] * E + TRAILER_SIZE

    def load(self, pkts: np.ndarray, hv: np.ndarray, rows: np.ndarray, chunks: np.ndarray) -> int:
        """Turn the dense packets of ``chunks`` (in ring ``rows``) into sparse ones: the SPARSE flag,
        the trailer, and payload NONE (header only) where this worker's chunk is zero. Returns how
        many are header-only."""
        nz = self.nonzero[chunks]
        hv["flags"][rows] = int(Flag.SPARSE)
        hv["payload_type"][rows] = np.where(nz, int(self.ptype), int(PayloadType.NONE))
        hv["count"][rows[~nz]] = 0
        nxt = _u32_be((self.c0 + self.announce[chunks]) % self.modulus)
        for sel, off in ((nz, self.data_len - TRAILER_SIZE), (~nz, HEADER_SIZE)):
            pkts[rows[sel], off:off + TRAILER_SIZE] = nxt[sel]
        return int(np.count_nonzero(~nz))

    def lengths(self, hv: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Bytes to send of each ring row."""
        return np.where(hv["payload_type"][rows] == int(PayloadType.NONE), self.skip_len, self.data_len)

    def payloads(self, buf: np.ndarray, idx: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """The sums of results ``buf[idx]`` as (k, E) codes: zeros for the header-only results."""
        data = lens[idx] == self.result_len
        view = payload_view(buf, self.result_type, self.E)      # copies payloads only
        if data.all():
            return native(view[idx])
        out = np.zeros((idx.size, self.E), PAYLOAD_DTYPE[self.result_type].newbyteorder("="))
        if data.any():
            out[data] = native(view[idx[data]])
        return out

    def advance(self, buf: np.ndarray, idx: np.ndarray, lens: np.ndarray, jj: np.ndarray):
        """Results ``buf[idx]`` of rounds ``jj`` arrived: (the positions their announcements skip, zero
        everywhere, now filled; per result, the position of its stream's next round, past the tensor
        when the stream is done)."""
        off = lens[idx] - TRAILER_SIZE
        raw = buf[idx[:, None], off[:, None] + np.arange(TRAILER_SIZE)]
        ids = raw.copy().view(TRAILER_DTYPE)["next"].reshape(-1).astype(np.int64)
        bad = ~sparse_next_ok((self.c0 + jj) % self.modulus, ids, self.S, self.modulus)
        nxt = (ids - self.c0) % self.modulus
        steps = nxt - jj
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise AllreduceError(f"the result of chunk position {int(jj[k])} announces position {int(nxt[k])}, not an "
                                 f"odd number of {self.S}-chunk steps ahead in its stream (a switch without sparse "
                                 "streaming, or a protocol error)")
        gaps = steps // self.S - 1                 # chunks between a round and the next: zero everywhere
        step_no = np.arange(gaps.sum()) - np.repeat(np.cumsum(gaps) - gaps, gaps) + 1
        between = np.repeat(jj, gaps) + self.S * step_no
        between = between[between < self.n]
        if between.size:
            self.fill_zero(between)
        return between, nxt
