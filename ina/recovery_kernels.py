"""Compiled per-burst bookkeeping of :class:`ina.recovery.LossDetector` (the send order, the pending
list, the count of later results): each step one pass over the chunk arrays instead of a few numpy
operations and temporaries per burst. The rules themselves (when a chunk counts as lost) stay in
:mod:`ina.recovery`."""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def mark_sent(chunks, now, witness, one_witness, next_seq, sent_at, seq, later, wit):
    """``chunks`` went out at ``now`` in this order, send numbers from ``next_seq``: their send time,
    send number, later-count (0) and witness flag (``witness[q]``, or ``witness[0]`` for all when
    ``one_witness``). Returns how many of them were never sent before."""
    first = 0
    for q in range(chunks.size):
        c = chunks[q]
        first += seq[c] == 0
        wit[c] = witness[0] if one_witness else witness[q]
        sent_at[c] = now
        seq[c] = next_seq + q
        later[c] = 0
    return first


@njit(cache=True)
def pending_chunks(low, high, done, seq):
    """Chunks in ``low..high`` that were sent (``seq > 0``) and are not ``done``, in order."""
    out = np.empty(max(0, high - low + 1), np.int64)
    m = 0
    for c in range(low, high + 1):
        if not done[c] and seq[c] > 0:
            out[m] = c
            m += 1
    return out[:m]


@njit(cache=True)
def count_later(chunks, pending, seq, tries, wit, later):
    """Results of ``chunks`` arrived: each ``pending`` chunk's ``later`` grows by how many of them
    were sent after it, counting only first sends (``tries == 0``, Karn) of witnesses (``wit``)."""
    arrived = np.empty(chunks.size, np.int64)
    m = 0
    for q in range(chunks.size):
        c = chunks[q]
        if tries[c] == 0 and wit[c]:
            arrived[m] = seq[c]
            m += 1
    if m == 0 or pending.size == 0:
        return
    arrived = np.sort(arrived[:m])
    for q in range(pending.size):
        p = pending[q]
        s = seq[p]
        lo, hi = 0, m                      # the first arrival sent after p (searchsorted, side="right")
        while lo < hi:
            mid = (lo + hi) // 2
            if arrived[mid] <= s:
                lo = mid + 1
            else:
                hi = mid
        later[p] += m - lo
