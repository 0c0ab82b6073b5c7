"""Tail rounds: a second multicast of the result of a round completed by a packet flagged TAIL.

A worker flags the last chunk of each dense stream TAIL (ina.recovery.tail_copies; an exponent
negotiation packet is one): nothing it sends after that chunk can show the chunk's loss, so it sends
the packet twice, and the switch multicasts the round's result twice, each copy right after the
first (the plan stays grouped by destination, one GSO run per worker). A round is repeated when the
packet that completes it carries the flag (every worker flags the same chunk, the last of its
stream). The worker's second copy, when it arrives after the round completed, is not replayed: the
worker asked for nothing (no RETRANSMIT flag) and gets the result twice anyway; it is counted as a
``tail_duplicate`` instead of a replay. The kernel runs after harvest, on its plan.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ina.wire import OFFSET, Flag

from .dataplane import C_REPLAYS, Action
from .harvest import counts_against_group

HARVEST, REPLAY = int(Action.HARVEST), int(Action.REPLAY)
FLAGS_LO = OFFSET["flags"] + 1          # the flags field is big-endian: its bits 0-7 are in its second byte
TAIL, RETRANSMIT = int(Flag.TAIL), int(Flag.RETRANSMIT)


@njit(cache=True)
def _completed_by_tail(pkts, buf, n, s):
    for i in range(n):
        if pkts[i].action == HARVEST and pkts[i].set_id == s and (buf[i, FLAGS_LO] & TAIL) != 0:
            return True
    return False


@njit(cache=True)
def _tail_copy(pkts, buf, n, jobs, s, addr, used):
    """The index of an unused packet of this burst that is a worker's second TAIL copy (no RETRANSMIT)
    answered by the replay of set ``s`` to address index ``addr``; -1 if none."""
    for i in range(n):
        p = pkts[i]
        if (p.action == REPLAY and not used[i] and p.set_id == s and jobs[p.job].addr_base + p.rank == addr
                and (buf[i, FLAGS_LO] & (TAIL | RETRANSMIT)) == TAIL):
            return i
    return -1


@njit(cache=True)
def repeat_tail_results(dp, buf, n, m):
    """dp.tx[:m] (harvest's plan for the burst ``buf[:n]``) with every multicast of a round completed
    by a TAIL packet planned twice (at most the plan's capacity) and no replay of a second TAIL copy.
    Returns (the plan's new length, the replays left out)."""
    pkts, tx, tmp, jobs = dp.pkts, dp.tx, dp.tx_order, dp.jobs
    tail = False
    for i in range(n):
        if (buf[i, FLAGS_LO] & TAIL) != 0 and (pkts[i].action == HARVEST or pkts[i].action == REPLAY):
            tail = True
            break
    if not tail:
        return m, 0
    twice = np.zeros(m, np.bool_)           # multicasts of a round completed by a TAIL packet
    for j in range(m):
        tmp[j] = tx[j]
        twice[j] = tx[j].length > 0 and _completed_by_tail(pkts, buf, n, tx[j].set_id)
    room = min(int(twice.sum()), len(tx) - m)   # beyond the plan's capacity the rest go once
    used = np.zeros(n, np.bool_)
    out = 0
    dropped = 0
    for j in range(m):
        t = tmp[j]
        if t.length < 0:
            i = _tail_copy(pkts, buf, n, jobs, t.set_id, t.addr, used)
            if i >= 0:
                used[i] = True
                dropped += 1
                if counts_against_group(jobs[pkts[i].job], buf, i):    # harvest counted it against the group
                    dp.delivered[t.addr] -= 1
                continue
        tx[out] = t
        out += 1
        if room > 0 and twice[j]:
            tx[out] = t
            out += 1
            room -= 1
    dp.counters[C_REPLAYS] -= dropped
    return out, dropped
