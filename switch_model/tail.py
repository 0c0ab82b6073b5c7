"""Tail rounds: a second multicast of the result of a round completed by a packet flagged TAIL.

A worker flags the last chunk of each stream TAIL (ina.recovery.tail_copies; an exponent negotiation
packet is one): nothing it sends after that chunk can show the chunk's loss, so it sends the packet
twice, and the switch multicasts the round's result twice, each copy right after the first (the
plan stays grouped by destination, one GSO run per worker). A round is repeated when the packet that
completes it carries the flag (every worker flags the same chunk, the last of the stream). Replays
go out once. The kernel runs after harvest, on its plan.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ina.wire import OFFSET, Flag

from .dataplane import Action

HARVEST = int(Action.HARVEST)
FLAGS_LO = OFFSET["flags"] + 1          # the flags field is big-endian: TAIL is in its second byte
TAIL = int(Flag.TAIL)


@njit(cache=True)
def _completed_by_tail(pkts, buf, n, s):
    for i in range(n):
        if pkts[i].action == HARVEST and pkts[i].set_id == s and (buf[i, FLAGS_LO] & TAIL) != 0:
            return True
    return False


@njit(cache=True)
def repeat_tail_results(dp, buf, n, m):
    """dp.tx[:m] (harvest's plan for the burst ``buf[:n]``) with every multicast of a round completed
    by a TAIL packet planned twice, at most the plan's capacity. Returns the plan's new length."""
    pkts, tx, tmp = dp.pkts, dp.tx, dp.tx_order
    tail = False
    for i in range(n):
        if pkts[i].action == HARVEST and (buf[i, FLAGS_LO] & TAIL) != 0:
            tail = True
            break
    if not tail:
        return m
    extra = 0
    for j in range(m):
        tmp[j] = tx[j]
        if tx[j].length > 0 and _completed_by_tail(pkts, buf, n, tx[j].set_id):
            extra += 1
    room = min(extra, len(tx) - m)          # beyond the plan's capacity the rest go once
    out = 0
    for j in range(m):
        tx[out] = tmp[j]
        out += 1
        if room > 0 and tmp[j].length > 0 and _completed_by_tail(pkts, buf, n, tmp[j].set_id):
            tx[out] = tmp[j]
            out += 1
            room -= 1
    return out
