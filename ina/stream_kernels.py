"""Compiled per-burst steps of the streaming client (:class:`ina.transfer.Transfer`).

A burst of results is taken in one compiled call (:func:`take_burst`): the scan of the receive
ring's headers, Karn's round trips, the loss detector's pending list and its count of later
results (``ina.recovery_kernels``, called from here), and, for a dense stream, the chunks the
results free and their headers. Each of these was a numba call of its own with numpy glue between
(a dozen calls a burst, about 150 us of Python on a loaded machine). The header's byte offsets come
from :mod:`ina.wire` (the one declaration of the format); fields are read and written in network
byte order.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import recovery_kernels as RK
from .gro import copy_bytes
from .wire import OFFSET, Flag, MsgType, slot_of_chunk

_MSG_TYPE, _FLAGS, _JOB, _SLOT = OFFSET["msg_type"], OFFSET["flags"], OFFSET["job"], OFFSET["slot"]
_COUNT, _EXPONENT, _CHUNK = OFFSET["count"], OFFSET["exponent"], OFFSET["chunk"]
_RESULT, _ABORT = int(MsgType.RESULT), int(MsgType.ABORT)
_SPARSE, _OVERFLOW, _REPLAY, _LATE = int(Flag.SPARSE), int(Flag.OVERFLOW), int(Flag.REPLAY), int(Flag.LATE)
_slot_of_chunk = njit(inline="always")(slot_of_chunk)   # ina.wire's rule, as in the switch's data plane


@njit(cache=True, inline="always")
def _u16(row, at):
    return (np.int64(row[at]) << 8) | np.int64(row[at + 1])


@njit(cache=True, inline="always")
def _put16(row, at, v):
    row[at] = np.uint8((v >> 8) & 0xFF)
    row[at + 1] = np.uint8(v & 0xFF)


@njit(cache=True)
def scan_results(buf, lens, k, job, c0, modulus, n_chunks, res_len, skip_len, sparse, check_sparse, done, exps,
                 idx, jj, replayed):
    """Take a burst ``buf[:k]`` (lengths ``lens``) of one stream's results: chunk position j =
    (chunk - c0) mod ``modulus``; a result of this stream is a RESULT of ``job`` with j < ``n_chunks`` and
    the result length (``res_len``, or header-only ``skip_len`` when ``sparse``). The client passes one past
    the last position it sent as ``n_chunks``: a result of a chunk not sent yet is stale (e.g. from an
    earlier run of the same job on the same port).

    For each fresh one (its chunk not ``done`` and not earlier in the burst): ``done[j]`` is set,
    ``exps[j]`` gets its exponent, and ``idx`` (row), ``jj`` (position), ``replayed`` (REPLAY flag)
    get an entry, sorted by position. Returns (fresh, results of this stream incl. duplicates, other
    packets, bytes, the first ABORT row of ``job`` or -1, OVERFLOW results, results whose SPARSE flag
    disagrees with ``sparse``, counted when ``check_sparse``)."""
    fresh = ok = other = nbytes = overflow = mismatch = 0
    abort = -1
    for i in range(k):
        row = buf[i]
        nbytes += lens[i]
        mt = np.int64(row[_MSG_TYPE])
        if _u16(row, _JOB) != job:
            other += 1
            continue
        if mt == _ABORT and abort < 0:
            abort = i
        chunk = (_u16(row, _CHUNK) << 16) | _u16(row, _CHUNK + 2)
        j = (chunk - c0) % modulus
        if mt != _RESULT or j >= n_chunks:
            other += 1
            continue
        flags = _u16(row, _FLAGS)
        if check_sparse and ((flags & _SPARSE) != 0) != sparse:
            mismatch += 1
        if not (lens[i] == res_len or (sparse and lens[i] == skip_len)):
            other += 1
            continue
        ok += 1
        if done[j]:
            continue
        done[j] = True
        e = _u16(row, _EXPONENT)
        exps[j] = e - 65536 if e >= 32768 else e
        overflow += (flags & _OVERFLOW) != 0
        # insertion by position: bursts are short and arrive nearly sorted
        p = fresh
        while p > 0 and jj[p - 1] > j:
            jj[p], idx[p], replayed[p] = jj[p - 1], idx[p - 1], replayed[p - 1]
            p -= 1
        jj[p], idx[p], replayed[p] = j, i, (flags & _REPLAY) != 0
        fresh += 1
    return fresh, ok, other, nbytes, abort, overflow, mismatch


@njit(cache=True, inline="always")
def _fill_header(row, c, c0, modulus, slots, exps_in, count, elements, flags):
    cid = (c0 + c) % modulus
    _put16(row, _SLOT, _slot_of_chunk(cid, slots))
    _put16(row, _CHUNK, cid >> 16)
    _put16(row, _CHUNK + 2, cid & 0xFFFF)
    _put16(row, _EXPONENT, exps_in[0 if exps_in.size == 1 else c] & 0xFFFF)
    _put16(row, _FLAGS, flags)
    if elements:
        _put16(row, _COUNT, min(elements, count - c * elements))


@njit(cache=True)
def fill_headers(pkts, rows, chunks, c0, modulus, slots, exps_in, count, elements):
    """The headers of new chunks ``chunks`` in ring ``rows``: slot, chunk id, exponent (``exps_in``:
    one per chunk, or one for all), flags 0 and (with ``elements``) the valid element count of the
    tensor's ``count`` elements."""
    for q in range(rows.size):
        _fill_header(pkts[rows[q]], chunks[q], c0, modulus, slots, exps_in, count, elements, 0)


@njit(cache=True)
def round_trips(jj, tries, sent_at, now, scratch):
    """Karn's rule over a burst of fresh results of chunks ``jj``: the round trips ``now - sent_at`` of
    the chunks never resent. Returns (how many, the fastest, the median: the mean of the two middle
    ones when even) and whether any chunk of the burst was resent; ``scratch`` holds at least
    ``jj.size`` floats."""
    m = 0
    resent = False
    for q in range(jj.size):
        j = jj[q]
        if tries[j] == 0:
            scratch[m] = now - sent_at[j]
            m += 1
        else:
            resent = True
    if m == 0:
        return 0, 0.0, 0.0, resent
    r = scratch[:m]
    r.sort()
    return m, r[0], (r[(m - 1) // 2] + r[m // 2]) / 2, resent


@njit(cache=True)
def take_burst(buf, lens, k, scan, done, exps, idx, jj, replayed, ld_arrays, now, rtt_scratch, low, max_sent, ring,
               nxt):
    """One receive burst ``buf[:k]`` of a stream, in one pass:

    1. :func:`scan_results` (``scan``: job, c0, modulus, one past the last position sent, result length,
       header-only length or -1, sparse, check sparse) marks the fresh results done, takes their
       exponents and lists them in ``idx``, ``jj``, ``replayed`` (sorted by position);
    2. :func:`round_trips` of the fresh ones (``ld_arrays``: the loss detector's tries, sent_at, seq,
       witness, lane, later);
    3. with fresh results, the loss detector's pending chunks in ``low .. max_sent`` and its count of
       later results (``recovery_kernels.pending_chunks``, ``count_later``: LossDetector.pending and
       delivered's compiled steps);
    4. with ``ring`` = (pkts, slots, chunks, ring rows, c0, modulus, exps_in, count, elements) and slots > 0 (a
       dense stream, self-clocking): the chunks the results free (chunk j + slots), in ``nxt`` = (chunks,
       rows, witness), their headers written into ``pkts`` (flags LATE where not a witness: sent after a
       replay) -- everything but their codes;
    5. ``low`` moved past the chunks done.

    Returns (fresh, ok, other, bytes, abort row, overflow, mismatch, replayed count, (samples, fastest,
    median, resent), pending, new chunks, the largest new chunk or -1, low)."""
    job, c0, modulus, hi, res_len, skip_len, sparse, check_sparse = scan
    fresh, ok, other, nbytes, abort, overflow, mismatch = scan_results(
        buf, lens, k, job, c0, modulus, hi, res_len, skip_len, sparse, check_sparse, done, exps, idx, jj, replayed)
    tries, sent_at, seq, wit, lane, later = ld_arrays
    n_rep = 0
    for q in range(fresh):
        n_rep += replayed[q]
    rtts = round_trips(jj[:fresh], tries, sent_at, now, rtt_scratch)
    pending = RK.pending_chunks(low, max_sent, done, seq) if fresh else np.empty(0, np.int64)
    if fresh:
        RK.count_later(jj[:fresh], pending, seq, tries, wit, lane, later)
    pkts, slots, n_chunks, R, rc0, rmod, exps_in, count, elements = ring
    new_chunks, new_rows, new_wit = nxt
    n_new = 0
    top = -1
    if slots > 0:
        for q in range(fresh):
            c = jj[q] + slots
            if c < n_chunks:
                r = c % R
                new_chunks[n_new], new_rows[n_new], new_wit[n_new] = c, r, not replayed[q]
                _fill_header(pkts[r], c, rc0, rmod, slots, exps_in, count, elements, _LATE if replayed[q] else 0)
                top = max(top, c)
                n_new += 1
    return fresh, ok, other, nbytes, abort, overflow, mismatch, n_rep, rtts, pending, n_new, top, \
        first_not_done(low, done)


@njit(cache=True)
def first_not_done(low, done):
    """The first chunk from ``low`` on without its result (every chunk below it is done)."""
    while low < done.size and done[low]:
        low += 1
    return low


@njit(cache=True)
def copy_rows(dst, dst_rows, at, src, src_rows):
    """``dst[dst_rows[q], at:at + w] = src[src_rows[q]]`` for every q, one memcpy a row (C-contiguous
    uint8 arrays; ``w``: the width of ``src``'s rows)."""
    w = src.shape[1]
    for q in range(dst_rows.size):
        copy_bytes(dst, dst_rows[q] * dst.shape[1] + at, src, src_rows[q] * w, w)


@njit(cache=True)
def quiet_deadline(pending, sent_at, later, tries, srtt, rttvar, pto, probe_at):
    """The loss detector's test of a turn with no timer due (``ina.recovery.LossDetector.quiet_deadline``):
    NaN if one of the ``pending`` chunks has results of later chunks (rules 1 and 2 may find it lost: the
    rules run), else ``recovery_kernels.next_deadline`` of them (the same arguments), in one pass."""
    for q in range(pending.size):
        if later[pending[q]] > 0:
            return np.nan
    return RK.next_deadline(pending, sent_at, later, tries, srtt, rttvar, pto, probe_at)
