"""IP multicast of results: a job's result is sent once, to the job's group, and the network replicates it.

SwitchML's switch multicasts each result to the job's workers in its egress pipeline; in the emulation the
switch host sends one datagram (one GSO message per burst) to the job's group (``ina.wire.multicast_group``)
and the fabric's Linux bridge, which snoops IGMP (``ina.net.topology``), copies it onto every member's port,
whose shaping queue (the worker's download) sees each copy. A job's results go to its group when

* the switch's multicast is on (``SwitchConfig.multicast``; ``ina-switch serve --no-multicast`` turns it off),
* every worker joined the group with its data socket bound to the group's port (``ina.multicast``: not on
  loopback, nor where the port is taken) and the workers are distinct hosts, none the switch's own,
* the switch reaches every worker through one local address, the socket's multicast interface;

otherwise, and for the replay of one worker's lost result, each worker gets its own unicast copy. While
egress impairments are on, each worker's copy is impaired on its own, as on its own link: under loss
alone a result none of whose copies is lost still goes as one multicast, one that lost a copy as its
surviving unicast copies; with delay, duplication or reordering every result goes as unicast copies.

**When the group's packets do not arrive.** A worker that joined may still never get the group's packets
(a fabric without multicast routing, a firewall, a snooping bridge that lost the member, the host left
the group): each result then reaches it only as the replay of its resend, after a loss timer, and every
allreduce of the job is many times slower, with nothing else to show for it. The one rule
(:meth:`Multicast.judge`): over a window of at least ``FALLBACK_MIN_RESULTS`` results multicast to a
job's group, and at least ``FALLBACK_SLOTS`` times the job's slots (a window of results is in flight
before its replays come back, and the next chunks go out only after them: in the window where the group
stops at least 3/4 of the results are replayed, then all), if one rank was sent replays of at least
``FALLBACK_SHARE`` of them, the group does not reach that rank: from then on the job's results go as a
unicast copy per worker, with a warning in the log, the counter ``multicast_fallbacks`` and the job's
``multicast_fallback`` in the stats (the client needs nothing: its data socket takes unicast on the same
port). Only replays of resends without the GROUP_SEEN flag count (``ina.wire.Flag``): a worker sets it on
its resends while results come to it by the group (in the stream, or in its previous one: an allreduce's
data stream follows its negotiation). On a slow link a rank may resend while the result still queues in
its download; without the flag, ``make demo``'s 10 Mbit/s rows fell back on a healthy group (one rank was
replayed 415 resends against 276 results multicast). Losses of results on the way down that are the
links', not the group's, cost replays of a few per cent; a worker starved of CPU resends early and is
replayed what it resent, in the runs here far less than 0.7 of a window. The rule is not applied while egress impairments are on (a result that lost a
copy on the way down lost it to the impairment, not to the group). A job sharded over ``--cores N`` > 1 is not
judged: the shards' results interleave on the way down, and while the workers' loss rules compared
chunks across shards they resent on that reordering (8 workers, 1 Gbit/s: 1400-2200 resends per 5
allreduces against 0-7 with one shard) and one rank was replayed 69 of 133 and 98 of 136 results of a
healthy group. The rules now compare chunks of one shard (``ina.recovery.LossDetector``'s lanes) and
resends flagged GROUP_SEEN do not count; whether sharded jobs can be judged again is not measured.
"""
from __future__ import annotations

import ipaddress
import logging
import socket

import numpy as np

from ina.wire import MAX_WORKERS, multicast_group

log = logging.getLogger("ina.switch")

FALLBACK_SHARE = 0.7        # a rank replayed for this share of a window's multicast results: the group misses it
FALLBACK_MIN_RESULTS = 32   # the shortest window judged (results multicast)
FALLBACK_SLOTS = 4          # ... and at least this many times the job's slots


def egress_address(worker_ip: str) -> str:
    """The local address this host sends from to reach ``worker_ip`` (the kernel's route lookup)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((worker_ip, 9))
        return s.getsockname()[0]


class Multicast:
    """The switch's multicast: which jobs' results go to their group, and the socket's multicast egress.

    Group addresses live in the switch's address table after the workers' (``first`` + the job's address
    block); ``workers[block]`` is the job's worker count (to expand a multicast into unicast copies).
    """

    def __init__(self, sock: socket.socket, enabled: bool, first: int, blocks: int):
        self.sock, self.enabled, self.first = sock, bool(enabled), int(first)
        self.workers = np.zeros(blocks, np.int64)       # per address block: the job's workers (0: unicast)
        self.window = np.zeros(blocks, np.int64)        # per address block: results multicast per judged window
        self.mark = np.zeros(first + blocks, np.int64)  # per address: ``delivered`` at the window's start
        self.interface: str | None = None               # the socket's IP_MULTICAST_IF, once set
        self.installed = 0                              # jobs sending to a group now (none: nothing to expand)
        if self.enabled:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 0)

    def choose(self, job: int, addrs: list, groups: list | None, port: int) -> tuple[str | None, str]:
        """(the group to send ``job``'s results to, or None; why). ``addrs``: the workers' (host, port),
        ``groups``: the group each worker joined (None: none); ``port``: the switch's UDP port as the workers
        address it (shard 0's). The group follows from the address the switch reaches the workers from
        (``ina.wire.multicast_group``), which is the one the workers address it at where they joined it."""
        if not self.enabled:
            return None, "multicast turned off (--no-multicast)"
        groups = groups or [None] * len(addrs)
        if None in groups:
            return None, f"rank(s) {[r for r, g in enumerate(groups) if g is None][:8]} did not join a group"
        hosts = [h for h, _ in addrs]
        if len(set(hosts)) != len(hosts) or any(ipaddress.ip_address(h).is_loopback for h in hosts):
            return None, "workers share a host"
        try:
            via = {h: egress_address(h) for h in hosts}
        except OSError as e:
            return None, f"no route to the workers: {e}"
        if any(h == a for h, a in via.items()):        # the switch's own address: a multicast would not loop back
            return None, "a worker is on the switch's host"
        local = set(via.values())
        if len(local) != 1 or (self.interface is not None and local != {self.interface}):
            return None, f"workers reached through {sorted(local)}, the multicast interface is {self.interface}"
        source = local.pop()
        group, gport = multicast_group(job, (source, port))
        missing = [r for r, (g, (_, p)) in enumerate(zip(groups, addrs)) if g != group or int(p) != gport]
        if missing:
            return None, (f"rank(s) {missing[:8]} did not join group {group}:{gport} (this switch's for job {job} "
                          f"from {source}; they joined {sorted(set(groups) - {group})[:4]})")
        if self.interface is None:
            self.interface = source
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(self.interface))
        return group, f"group {group}:{gport} from {self.interface}"

    def install(self, block: int, n_workers: int, slots: int, delivered: np.ndarray, shards: int = 1) -> int:
        """The address index of block ``block``'s group (its job sends there); remembers its workers and
        starts the window :meth:`judge` looks at (``slots``: the job's slots here; ``delivered``: the data
        plane's counts; a job over ``shards`` > 1 is not judged)."""
        self.installed += not self.workers[block]
        self.workers[block] = n_workers
        self.window[block] = max(FALLBACK_MIN_RESULTS, FALLBACK_SLOTS * int(slots)) if shards == 1 else 0
        self._restart(block, delivered)
        return self.first + block

    def remove(self, block: int) -> None:
        self.installed -= bool(self.workers[block])
        self.workers[block] = 0
        self.window[block] = 0

    def _restart(self, block: int, delivered: np.ndarray) -> None:
        lo = block * MAX_WORKERS
        self.mark[lo: lo + MAX_WORKERS] = delivered[lo: lo + MAX_WORKERS]
        self.mark[self.first + block] = delivered[self.first + block]

    def judge(self, delivered: np.ndarray) -> list[tuple[int, list, str]]:
        """The multicasting jobs whose group does not reach a worker, by the rule of this module's
        docstring: [(address block, the ranks it misses, why)]; each is no longer multicast here (the caller
        moves its job to unicast copies). ``delivered``: the data plane's results multicast per group address
        and replays per worker address. A window that passes starts the next."""
        out = []
        for block in np.flatnonzero(self.window):
            g, lo, n = self.first + block, block * MAX_WORKERS, self.workers[block]
            sent = int(delivered[g] - self.mark[g])
            if sent < self.window[block]:
                continue
            replays = delivered[lo: lo + n] - self.mark[lo: lo + n]
            missed = np.flatnonzero(replays >= FALLBACK_SHARE * sent)
            if missed.size:
                out.append((int(block), missed.tolist(), f"rank(s) {missed.tolist()[:8]} needed a replay of "
                            f"{int(replays.max())} of the last {sent} results multicast to the group"))
                self.remove(block)
            else:
                self._restart(block, delivered)
        return out

    def copies(self, addr) -> int:
        """How many transmissions :meth:`expand` makes of these (a group send: one per worker of its job)."""
        n = np.size(addr)
        if not self.installed:
            return n
        addr = np.asarray(addr)
        mc = addr >= self.first
        return n + int(self.workers[addr[mc] - self.first].sum()) - int(np.count_nonzero(mc))

    def expand(self, rows, lens, addr, origin: bool = False):
        """(rows, lens, addr, number of multicasts replaced): the transmissions with each multicast replaced
        by a unicast copy per worker of its job, grouped by destination (each worker's entries keep their
        order). ``origin``: a fifth element, the index of each copy's transmission in ``rows`` (None when
        nothing was replaced: then each is its own)."""
        if not self.installed:                          # (a Python int: no array work per burst)
            return (rows, lens, addr, 0, None) if origin else (rows, lens, addr, 0)
        addr = np.asarray(addr)
        mc = addr >= self.first
        if not mc.any():
            return (rows, lens, addr, 0, None) if origin else (rows, lens, addr, 0)
        blocks = addr[mc] - self.first
        counts = self.workers[blocks]
        reps = np.where(mc, 0, 1)
        reps[mc] = counts
        rows2, lens2 = np.repeat(np.asarray(rows), reps), np.repeat(np.broadcast_to(lens, addr.shape), reps)
        addr2 = np.repeat(addr, reps)
        pos = np.flatnonzero(np.repeat(mc, reps))
        offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        addr2[pos] = np.repeat(blocks, counts) * MAX_WORKERS + offset
        order = np.argsort(addr2, kind="stable")
        out = rows2[order], lens2[order], addr2[order], int(blocks.size)
        return (*out, np.repeat(np.arange(addr.size), reps)[order]) if origin else out
