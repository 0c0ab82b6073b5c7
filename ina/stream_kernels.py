"""Compiled per-burst steps of the streaming client (ina.client's ``_Transfer``).

A burst of results is taken in one pass over the receive ring's headers instead of a dozen numpy
operations on structured views (each a few microseconds of Python per burst), and a burst of new
chunks gets its headers in one pass too. The header's byte offsets come from :mod:`ina.wire` (the
one declaration of the format); fields are read and written in network byte order.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .gro import copy_bytes
from .wire import OFFSET, Flag, MsgType, slot_of_chunk

_MSG_TYPE, _FLAGS, _JOB, _SLOT = OFFSET["msg_type"], OFFSET["flags"], OFFSET["job"], OFFSET["slot"]
_COUNT, _EXPONENT, _CHUNK = OFFSET["count"], OFFSET["exponent"], OFFSET["chunk"]
_RESULT, _ABORT = int(MsgType.RESULT), int(MsgType.ABORT)
_SPARSE, _OVERFLOW, _REPLAY = int(Flag.SPARSE), int(Flag.OVERFLOW), int(Flag.REPLAY)
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


@njit(cache=True)
def fill_headers(pkts, rows, chunks, c0, modulus, slots, exps_in, count, elements):
    """The headers of new chunks ``chunks`` in ring ``rows``: slot, chunk id, exponent (``exps_in``:
    one per chunk, or one for all), flags 0 and (with ``elements``) the valid element count of the
    tensor's ``count`` elements."""
    one_exp = exps_in.size == 1
    for q in range(rows.size):
        row = pkts[rows[q]]
        c = chunks[q]
        cid = (c0 + c) % modulus
        _put16(row, _SLOT, _slot_of_chunk(cid, slots))
        _put16(row, _CHUNK, cid >> 16)
        _put16(row, _CHUNK + 2, cid & 0xFFFF)
        _put16(row, _EXPONENT, exps_in[0 if one_exp else c] & 0xFFFF)
        _put16(row, _FLAGS, 0)
        if elements:
            _put16(row, _COUNT, min(elements, count - c * elements))


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
    r = np.sort(scratch[:m])
    return m, r[0], (r[(m - 1) // 2] + r[m // 2]) / 2, resent


@njit(cache=True)
def copy_rows(dst, dst_rows, at, src, src_rows):
    """``dst[dst_rows[q], at:at + w] = src[src_rows[q]]`` for every q, one memcpy a row (C-contiguous
    uint8 arrays; ``w``: the width of ``src``'s rows)."""
    w = src.shape[1]
    for q in range(dst_rows.size):
        copy_bytes(dst, dst_rows[q] * dst.shape[1] + at, src, src_rows[q] * w, w)
