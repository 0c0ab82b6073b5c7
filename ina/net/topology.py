"""Emulated hosts and links: one network namespace per host, veth links into a bridge, tc shaping.

::

    root namespace                fabric namespace (inanet-P-fabric)          host namespaces
    launchers, rendezvous         bridge P-br (no IP, no STP, IGMP snooping)
    P-root 10.213.X.254 ==veth== P-rootp -+
                                          +- P-swp  ==veth== ina0 10.213.X.1    inanet-P-sw
                                          +- P-w0p  ==veth== ina0 10.213.X.10   inanet-P-w0
                                          +- P-w1p  ==veth== ina0 10.213.X.11   inanet-P-w1
                                          ...

Every worker link is shaped per direction with a token bucket filter (tbf): the egress of the
host's ``ina0`` is the upload, the egress of the bridge port ``P-<host>p`` is the download.
Everything the topology consists of lives in the kernel and carries the prefix ``P``, so a
topology can be found, inspected and removed by another process (``ina-net status/down``) even
after the process that built it was killed.
"""
from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import re
import secrets
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass

from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns

from . import nsexec
from .kernel import (ALIAS_TAG, DIRECTIONS, FABRIC, HOST_IFNAME, LinkCounters, MAX_WORKERS, NETEM_HANDLE,
                    NS_RE, NetemParams, NetemUnavailable, QdiscCounterReader, SWITCH, SWITCH_OFFSET, TBF_HANDLE,
                    TC_H_ROOT, TERM_GRACE, TopologyError, WORKER_OFFSET, bridge_name, build_lock, check_prefix,
                    choose_subnet, disable_ipv6, ensure_addr, ensure_veth, ignoring, kill_pids, link_index,
                    list_topologies, ns_name, ns_pids, open_rtnl, port_name, probe_netem,
                    netem_of, root_ifname, root_peer_name, root_qdisc, tbf_of, teardown)
from .nsexec import require_privileges
from .shaping import (BURST_TIME, DOWN_QUEUE_FRAMES, QUEUE_TIME, UP_QUEUE_FRAMES, TbfParams, format_rate,
                      parse_rate, tbf_params)

log = logging.getLogger("ina.net")

MEMBERSHIP_INTERVAL_CS = 24 * 3600 * 100   # the bridge's multicast membership interval (1/100 s): a day
QUERY_RESPONSE_INTERVAL_CS = 10            # its query response interval (1/100 s): also how long it floods


def host_key(name) -> str:
    """Normalise a host name: ``switch``/``sw`` -> ``sw``, ``worker3``/``w3`` -> ``w3``."""
    if isinstance(name, Host):
        return name.name
    s = str(name).strip().lower()
    if s in ("sw", "switch"):
        return SWITCH
    m = re.fullmatch(r"(?:w|worker)(\d+)", s)
    if m:
        return f"w{int(m.group(1))}"
    raise TopologyError(f"unknown host {name!r}: hosts are 'sw' (or 'switch') and 'w0', 'w1', ... "
                        f"(or 'worker0', ...)")


@dataclass(frozen=True)
class Host:
    """One emulated host: its own network namespace with one link (``ifname``) into the fabric."""
    name: str            # "sw", "w0", "w1", ...
    role: str            # "switch" or "worker"
    rank: int | None     # worker index, None for the switch
    netns: str           # network namespace name (/var/run/netns/<netns>)
    ip: str              # IPv4 address of ifname
    ifname: str          # host side of the veth: use for GLOO_SOCKET_IFNAME / HOROVOD_GLOO_IFACE
    port: str            # bridge side of the veth (in the fabric namespace)

    def env(self) -> dict[str, str]:
        """Environment that pins Gloo/Horovod/TensorPipe to this host's link.

        Inside a namespace the hostname resolves to 127.0.0.1, so Gloo must be told the interface.
        """
        return {"GLOO_SOCKET_IFNAME": self.ifname, "HOROVOD_GLOO_IFACE": self.ifname,
                "TP_SOCKET_IFNAME": self.ifname}


class Topology:
    """A switch host and ``workers`` worker hosts, each in its own network namespace.

    ::

        with Topology(workers=4, rate="100mbit") as topo:
            p = topo.popen(topo.switch, ["ina-switch", ...])
            for w in topo.workers:
                topo.popen(w, [...], env={**os.environ, **w.env()})
            topo.set_rate("all", "1gbit")          # live, e.g. for a bandwidth sweep
            print(topo.counters())

    ``rate`` shapes every worker link's upload; ``rate_down`` its download (``None``: same as
    ``rate``; ``"unlimited"``: not shaped). ``switch_rate`` shapes the switch host's own link
    (default unshaped: the worker links are the bottleneck, as in a switch with one port per
    worker). ``prefix`` names the topology (default: a fresh random one); bring-up with an
    existing prefix adopts and converges that topology. ``keep=True`` leaves it up on exit.
    """

    def __init__(self, workers: int = 4, rate="100mbit", rate_down=None, prefix: str | None = None, *,
                 switch_rate=None, mtu: int = 1500, subnet=None, delay: float | None = None,
                 loss: float | None = None, keep: bool = False, burst_time: float = BURST_TIME,
                 queue_time: float = QUEUE_TIME):
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
            raise TopologyError(f"workers={workers!r}: must be an integer from 1 to {MAX_WORKERS}")
        if isinstance(mtu, bool) or not isinstance(mtu, int) or not 576 <= mtu <= 65535:
            raise TopologyError(f"mtu={mtu!r}: must be an integer from 576 to 65535")
        self.workers_count = workers
        self._rate = parse_rate(rate)
        self._rate_down = self._rate if rate_down is None else parse_rate(rate_down)
        self._switch_rate = parse_rate(switch_rate)
        self._host_rates: dict[str, tuple[int | None, int | None]] = {}   # set_rate's and attach's, per host
        self.mtu = mtu
        self.burst_time = float(burst_time)
        self.queue_time = float(queue_time)
        tbf_params(1_000_000, mtu, burst_time=self.burst_time, queue_time=self.queue_time)  # validates
        if delay is not None and not (isinstance(delay, (int, float)) and 0 <= delay <= 10):
            raise TopologyError(f"delay={delay!r}: one-way delay in seconds, from 0 to 10")
        if loss is not None and not (isinstance(loss, (int, float)) and 0 <= loss <= 1):
            raise TopologyError(f"loss={loss!r}: a probability from 0 to 1")
        self.delay, self.loss = delay, loss
        self.keep = keep
        self._explicit_prefix = prefix is not None
        self.prefix = check_prefix(prefix) if prefix is not None else self._fresh_prefix()
        self._requested_subnet = None
        if subnet is not None:
            try:
                net = ipaddress.ip_network(subnet)
            except ValueError as e:
                raise TopologyError(f"subnet={subnet!r}: {e}") from None
            if net.version != 4 or net.prefixlen > 24 or not net.is_private:
                raise TopologyError(f"subnet={subnet!r}: must be a private IPv4 network of /24 or larger")
            self._requested_subnet = net
        self.subnet: ipaddress.IPv4Network | None = None
        self.root_ip: str | None = None
        self.switch: Host | None = None
        self.workers: list[Host] = []
        self._handles: dict[str | None, IPRoute] = {}
        self._readers: dict[str, QdiscCounterReader] = {}     # counters(): one raw netlink socket per namespace
        self._opening = threading.RLock()    # one netlink socket (handle, reader) per namespace, whatever the threads
        self._indices: dict[tuple[str, str], int] = {}
        self._procs: list[tuple[Host, subprocess.Popen]] = []
        self._is_up = False

    # ---- naming -------------------------------------------------------------------------------
    @staticmethod
    def _fresh_prefix() -> str:
        taken = set(list_topologies()) if nsexec.missing_caps() == [] else set()
        for _ in range(100):
            p = "ina" + secrets.token_hex(2)
            if p not in taken:
                return p
        raise TopologyError("could not find a free random prefix")

    @property
    def fabric_netns(self) -> str:
        return ns_name(self.prefix, FABRIC)

    @property
    def root_ifname(self) -> str:
        return root_ifname(self.prefix)

    @property
    def hosts(self) -> list[Host]:
        return ([self.switch] if self.switch else []) + list(self.workers)

    def host(self, name) -> Host:
        if isinstance(name, Host):
            return name
        key = host_key(name)
        for h in self.hosts:
            if h.name == key:
                return h
        raise TopologyError(f"host {name!r} is not part of topology {self.prefix} "
                            f"(hosts: {', '.join(h.name for h in self.hosts)})")

    def _make_hosts(self) -> None:
        base = self.subnet.network_address
        def mk(name, role, rank, offset):
            return Host(name=name, role=role, rank=rank, netns=ns_name(self.prefix, name),
                        ip=str(base + offset), ifname=HOST_IFNAME, port=port_name(self.prefix, name))
        self.switch = mk(SWITCH, "switch", None, SWITCH_OFFSET)
        self.workers = [mk(f"w{i}", "worker", i, WORKER_OFFSET + i) for i in range(self.workers_count)]
        self.root_ip = str(self.subnet.broadcast_address - 1)

    def _h(self, netns: str | None) -> IPRoute:
        with self._opening:
            ipr = self._handles.get(netns)
            if ipr is None:
                ipr = self._handles[netns] = open_rtnl(netns)
            return ipr

    def _index(self, netns: str, ifname: str) -> int | None:
        """ifindex of a link of this topology (cached: it does not change while the link exists)."""
        key = (netns, ifname)
        idx = self._indices.get(key)
        if idx is None:
            idx = link_index(self._h(netns), ifname)
            if idx is not None:
                self._indices[key] = idx
        return idx

    def _reader(self, netns: str, idx: int) -> QdiscCounterReader:
        """The counter reader of namespace ``netns`` (opened on link ``idx``; it reads any link there)."""
        with self._opening:
            r = self._readers.get(netns)
            if r is None:
                r = self._readers[netns] = QdiscCounterReader(netns, idx)
            return r

    def _forget_links(self) -> None:
        """Drop what was looked up of the links (ifindices, counter readers): they may be rebuilt."""
        with self._opening:
            self._indices.clear()
            for r in self._readers.values():
                r.close()
            self._readers.clear()

    def close_handles(self) -> None:
        """Close this object's netlink sockets (the topology stays up; they reopen when needed).
        Before exec'ing into a host, or when an attached topology is no longer used."""
        with self._opening:
            self._forget_links()
            for ipr in self._handles.values():
                with contextlib.suppress(Exception):
                    ipr.close()
            self._handles.clear()

    # ---- bring-up -----------------------------------------------------------------------------
    def __enter__(self) -> "Topology":
        try:
            self.up()
        except BaseException:
            if not self.keep:
                with contextlib.suppress(Exception):
                    self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.keep:
            self.close_handles()
        else:
            self.down()

    def up(self) -> "Topology":
        """Build the topology (or converge an existing one with this prefix to this spec)."""
        require_privileges()
        if self.delay or self.loss:
            probe = probe_netem()
            if not probe.available:
                raise NetemUnavailable(
                    f"delay={self.delay} loss={self.loss} asked of the kernel, but {probe.detail}. "
                    f"Build the topology without delay/loss and give them to the switch's impairment "
                    f"stage instead (`ina-switch serve --loss P --delay-ms D`, or `ina-switch impair` "
                    f"on a running switch).")
        t0 = time.monotonic()
        self._forget_links()
        with build_lock():
            self.subnet = self._choose_subnet()
            self._make_hosts()
            log.info("%s: bringing up switch + %d workers on %s (root %s on %s)", self.prefix,
                     self.workers_count, self.subnet, self.root_ip, self.root_ifname)
            self._build_fabric()
            for h in self.hosts:
                self._build_host(h)
            self._remove_extra_workers()
        for h in self.hosts:
            self._apply_shaping(h)
        self._is_up = True
        log.info("%s: up in %.2fs: %s", self.prefix, time.monotonic() - t0, self._rate_summary())
        return self

    def _rate_summary(self) -> str:
        try:
            return (f"workers up {format_rate(self.rate)} / down {format_rate(self.rate_down)}, "
                    f"switch {format_rate(self.switch_rate)}")
        except TopologyError:
            return "rates per host: " + ", ".join(f"{h.name} up {format_rate(u)} / down {format_rate(d)}"
                                                  for h in self.hosts for u, d in [self._spec_rates(h)])

    # The rates are per host once set_rate gave a host its own (or attach found them so): ``rate``,
    # ``rate_down`` and ``switch_rate`` then answer only while the links they stand for agree.
    def _common_rate(self, hosts, directions, what: str, spec) -> int | None:
        if not hosts:                 # not up yet: what it is built with
            return spec
        links = [(h.name, d, self._spec_rates(h)[i]) for h in hosts for i, d in directions]
        if len({r for _, _, r in links}) > 1:
            each = ", ".join(f"{name} {d} {format_rate(r)}" for name, d, r in links)
            raise TopologyError(f"{self.prefix}: the {what} differs per link ({each}): rates() gives each host's")
        return links[0][2]

    @property
    def rate(self) -> int | None:
        """The workers' upload rate in bit/s (None: unshaped)."""
        return self._common_rate(self.workers, [(0, "up")], "workers' upload rate", self._rate)

    @property
    def rate_down(self) -> int | None:
        """The workers' download rate in bit/s (None: unshaped)."""
        return self._common_rate(self.workers, [(1, "down")], "workers' download rate", self._rate_down)

    @property
    def switch_rate(self) -> int | None:
        """The switch host's rate, both directions, in bit/s (None: unshaped)."""
        return self._common_rate([self.switch] if self.switch else [], [(0, "up"), (1, "down")],
                                 "switch's rate", self._switch_rate)

    def _choose_subnet(self) -> ipaddress.IPv4Network:
        return choose_subnet(self._h(None), self.root_ifname, self.prefix, self._requested_subnet)

    def _ensure_netns(self, name: str) -> None:
        if name in pr_netns.listnetns():
            try:
                self._h(name)
            except OSError as e:   # a bare mount point left by a crash in the middle of creating it
                log.warning("%s: %s is not a usable namespace (%s): recreating it", self.prefix, name, e)
                with contextlib.suppress(OSError):
                    pr_netns.remove(name)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(nsexec.netns_path(name))
        if name not in pr_netns.listnetns():
            log.info("%s: creating namespace %s", self.prefix, name)
            pr_netns.create(name)
        ipr = self._h(name)
        lo = link_index(ipr, "lo")
        ipr.link("set", index=lo, state="up")

    def _build_fabric(self) -> None:
        fab_ns = self.fabric_netns
        self._ensure_netns(fab_ns)
        fab = self._h(fab_ns)
        br = bridge_name(self.prefix)
        if link_index(fab, br) is None:
            log.info("%s: creating bridge %s in %s", self.prefix, br, fab_ns)
            # no STP (ports forward at once)
            fab.link("add", ifname=br, kind="bridge", br_stp_state=0)
        bi = link_index(fab, br)
        # IGMP snooping: a group's packets (the switch's multicast results) go to its members' ports only, so
        # a host outside a job carries none on its download; the bridge is the querier (hosts keep their
        # memberships fresh), of IGMPv3 (a v2 query turns hosts to v2, whose hosts suppress their report on
        # hearing another member's: measured, members were left out), and a membership lasts a day without
        # a report (no expiry during a run). Switching the querier on makes the bridge wait one query response
        # interval (default 10 s) before it trusts its memberships, and it floods every group to every port
        # until then: that interval is set short first (a separate request: the kernel applies the querier
        # before the interval within one)
        fab.link("set", index=bi, kind="bridge", br_mcast_query_response_intvl=QUERY_RESPONSE_INTERVAL_CS)
        fab.link("set", index=bi, kind="bridge", br_mcast_snooping=1, br_mcast_querier=1, br_mcast_igmp_version=3,
                 br_mcast_membership_intvl=MEMBERSHIP_INTERVAL_CS)
        disable_ipv6(fab, bi)
        fab.link("set", index=bi, mtu=self.mtu, state="up")
        root = self._h(None)
        rif, rpeer = self.root_ifname, root_peer_name(self.prefix)
        ri, pi = ensure_veth(root, rif, fab, rpeer, fab_ns,
                             f"{self.prefix}: creating root link {rif} <-> {rpeer}")
        root.link("set", index=ri, ifalias=f"{ALIAS_TAG} prefix={self.prefix}")
        disable_ipv6(root, ri)
        disable_ipv6(fab, pi)
        fab.link("set", index=pi, master=bi, mtu=self.mtu, state="up")
        root.link("set", index=ri, mtu=self.mtu)
        ensure_addr(root, ri, self.root_ip, self.subnet.prefixlen)
        root.link("set", index=ri, state="up")

    def _build_host(self, h: Host) -> None:
        self._ensure_netns(h.netns)
        fab, hh = self._h(self.fabric_netns), self._h(h.netns)
        pi, hi = ensure_veth(fab, h.port, hh, h.ifname, h.netns,
                             f"{self.prefix}: creating link {h.port} ({self.fabric_netns}) <-> {h.name}")
        disable_ipv6(fab, pi)
        disable_ipv6(hh, hi)
        fab.link("set", index=pi, master=link_index(fab, bridge_name(self.prefix)), mtu=self.mtu, state="up")
        hh.link("set", index=hi, mtu=self.mtu)
        ensure_addr(hh, hi, h.ip, self.subnet.prefixlen)
        hh.link("set", index=hi, state="up")

    def _remove_extra_workers(self) -> None:
        keep = {h.netns for h in self.hosts} | {self.fabric_netns}
        extra = [n for n in pr_netns.listnetns()
                 if (m := NS_RE.match(n)) and m.group(1) == self.prefix and n not in keep]
        if not extra:
            return
        log.info("%s: removing hosts no longer in the spec: %s", self.prefix, ", ".join(extra))
        pids = ns_pids(extra)
        if pids:
            kill_pids(pids)
        fab = self._h(self.fabric_netns)
        for n in extra:
            host = NS_RE.match(n).group(2)
            idx = link_index(fab, port_name(self.prefix, host))
            if idx is not None:
                fab.link("del", index=idx)
            h = self._handles.pop(n, None)
            if h is not None:
                h.close()
            pr_netns.remove(n)

    # ---- shaping ------------------------------------------------------------------------------
    def _targets(self, h: Host, direction: str):
        """(handle, ifindex, label) for the qdiscs shaping ``direction`` of host ``h``'s link."""
        out = []
        if direction in ("up", "both"):
            ipr = self._h(h.netns)
            out.append((ipr, self._index(h.netns, h.ifname), f"{h.name} up ({h.ifname} egress)"))
        if direction in ("down", "both"):
            ipr = self._h(self.fabric_netns)
            out.append((ipr, self._index(self.fabric_netns, h.port), f"{h.name} down ({h.port} egress)"))
        for _, idx, label in out:
            if idx is None:
                raise TopologyError(f"{self.prefix}: link for {label} is missing: is the topology up?")
        return out

    def _spec_rates(self, h: Host) -> tuple[int | None, int | None]:
        """Host ``h``'s (upload, download) in bit/s (None: unshaped): what set_rate last gave it, or what
        attach found, else what the topology was built with."""
        if h.name in self._host_rates:
            return self._host_rates[h.name]
        if h.role == "switch":
            return self._switch_rate, self._switch_rate
        return self._rate, self._rate_down

    def _apply_shaping(self, h: Host) -> None:
        up, down = self._spec_rates(h)
        netem = (self.delay or self.loss) and h.role == "worker"
        for (ipr, idx, label), rate, d in zip(self._targets(h, "both"), (up, down), ("up", "down")):
            self._shape(ipr, idx, label, rate, d, netem=bool(netem))

    def _shape(self, ipr: IPRoute, idx: int, label: str, rate_bps: int | None, direction: str,
               netem: bool = False) -> None:
        current = root_qdisc(ipr, idx)
        kind = current.get_attr("TCA_KIND") if current is not None else None
        if rate_bps is None:
            if kind in ("tbf", "netem"):
                with ignoring(errno.ENOENT, errno.EINVAL):
                    ipr.tc("del", index=idx, parent=TC_H_ROOT, handle=current["handle"])
            if netem:
                ipr.tc("add", "netem", idx, handle=TBF_HANDLE, parent=TC_H_ROOT, **self._netem_args())
            log.info("%s: %s: unlimited", self.prefix, label)
            return
        p = tbf_params(rate_bps, self.mtu, burst_time=self.burst_time, queue_time=self.queue_time,
                       queue_frames=UP_QUEUE_FRAMES if direction == "up" else DOWN_QUEUE_FRAMES)
        live = tbf_of(current) if kind == "tbf" else None
        # A tbf changed in place keeps its queue, and a queued packet larger than the new bucket never
        # gathers enough tokens: the link stalls for good (GSO super-frames queued under a larger
        # bucket). A shrinking bucket therefore replaces the qdisc, dropping its backlog as a link
        # reset would; the senders recover by retransmission.
        if (kind not in (None, "tbf", "noqueue") or (kind == "tbf" and current["handle"] != TBF_HANDLE)
                or (live is not None and p.burst < live.burst)):
            ipr.tc("del", index=idx, parent=TC_H_ROOT, handle=current["handle"])
        ipr.tc("replace", "tbf", idx, handle=TBF_HANDLE, parent=TC_H_ROOT,
               rate=p.rate_bytes, burst=p.burst, limit=p.limit)
        if netem:
            ipr.tc("replace", "netem", idx, handle=NETEM_HANDLE, parent=TBF_HANDLE | 1, **self._netem_args())
        log.info("%s: %s: tbf rate %s burst %d B queue %d B%s", self.prefix, label, format_rate(rate_bps),
                 p.burst, p.limit, " + netem" if netem else "")

    def _netem_args(self) -> dict:
        args = {}
        if self.delay:
            args["delay"] = int(round(self.delay * 1e6))   # microseconds
        if self.loss:
            args["loss"] = self.loss * 100                  # percent
        # netem's own queue (packets) must not be the bottleneck behind tbf
        args["limit"] = 10000
        return args

    def set_rate(self, host_or_all, rate, direction: str = "both") -> None:
        """Change the rate of live links. ``host_or_all``: a Host, a name ('w0', 'sw'), a list of
        them, ``"all"`` (every host) or ``"workers"``. ``direction``: 'up', 'down' or 'both'.
        ``rate``: e.g. '1gbit', or 'unlimited' to remove shaping."""
        if direction not in DIRECTIONS:
            raise TopologyError(f"direction {direction!r}: must be one of {', '.join(DIRECTIONS)}")
        rate_bps = parse_rate(rate)
        self._require_up()
        if isinstance(host_or_all, str) and host_or_all in ("all", "workers"):
            hosts = self.hosts if host_or_all == "all" else list(self.workers)
        elif isinstance(host_or_all, (list, tuple, set)):
            hosts = [self.host(h) for h in host_or_all]
        else:
            hosts = [self.host(host_or_all)]
        for h in hosts:
            netem = bool((self.delay or self.loss) and h.role == "worker")
            for d in (("up", "down") if direction == "both" else (direction,)):
                (ipr, idx, label), = self._targets(h, d)
                self._shape(ipr, idx, label, rate_bps, d, netem=netem)
                up, down = self._spec_rates(h)
                self._host_rates[h.name] = (rate_bps, down) if d == "up" else (up, rate_bps)

    def rates(self) -> dict[str, tuple[int | None, int | None]]:
        """``{host: (upload bit/s, download bit/s)}`` as the kernel applies them (None: unshaped)."""
        self._require_up()
        out = {}
        for h in self.hosts:
            (hi, hidx, _), (fi, fidx, _) = self._targets(h, "both")
            up, down = tbf_of(root_qdisc(hi, hidx)), tbf_of(root_qdisc(fi, fidx))
            out[h.name] = (up.rate_bps if up else None, down.rate_bps if down else None)
        return out

    def shaping(self) -> dict[str, dict[str, TbfParams | None]]:
        """``{host: {'up': TbfParams|None, 'down': ...}}`` read back from the kernel."""
        self._require_up()
        out = {}
        for h in self.hosts:
            (hi, hidx, _), (fi, fidx, _) = self._targets(h, "both")
            out[h.name] = {"up": tbf_of(root_qdisc(hi, hidx)), "down": tbf_of(root_qdisc(fi, fidx))}
        return out

    def netem(self) -> dict[str, dict[str, NetemParams | None]]:
        """``{host: {'up': NetemParams|None, 'down': ...}}``: the delay and loss of each link direction's
        netem, read back from the kernel (None: none). A kernel without netem has none: ``up`` refuses
        delay and loss there, and the switch's impairment stage emulates them (its stats show them)."""
        self._require_up()
        out = {}
        for h in self.hosts:
            out[h.name] = {d: netem_of(q for q in ipr.get_qdiscs(index=idx) if q["index"] == idx)
                           for (ipr, idx, _), d in zip(self._targets(h, "both"), ("up", "down"))}
        return out

    def _netem_spec(self, found: dict) -> tuple[float | None, float | None]:
        """(delay, loss) as ``up`` was given them, from the links' netem as :meth:`netem` read them: ``up``
        puts the same on both directions of every worker link and none on the switch's. Links that differ
        from that (changed by hand) are refused: this object could not say, nor keep, what they do."""
        seen = {found[h.name][d] for h in self.workers for d in ("up", "down")}
        if len(seen) == 1 and not any(found[self.switch.name].values()):
            p = seen.pop()
            return (None, None) if p is None else (p.delay or None, p.loss or None)
        each = ", ".join(f"{h} {d} " + ("none" if p is None else f"delay {p.delay * 1e3:g} ms loss {p.loss:g}")
                         for h, dirs in found.items() for d, p in dirs.items())
        raise TopologyError(f"topology {self.prefix}: its links' delay/loss (netem qdiscs) are not what `ina-net up` "
                            f"sets, the same on both directions of every worker link ({each}): `ina-net down "
                            f"--prefix {self.prefix}` and bring it up again")

    def counters(self, *hosts) -> dict[str, LinkCounters]:
        """Per-link byte/packet counters from the kernel (the host side of each veth) and the
        counters of both shaping queues; of every host, or only of ``hosts`` (names or Hosts).
        Read with one raw netlink request each (:class:`~ina.net.kernel.QdiscCounterReader`,
        about 50 microseconds a host: 0.25 ms for 5 hosts), so a caller may sample them while traffic runs."""
        self._require_up()
        out = {}
        for h in ([self.host(x) for x in hosts] if hosts else self.hosts):
            (_, hidx, _), (_, fidx, _) = self._targets(h, "both")       # raises naming a missing link
            where = f"{h.name}'s link ({h.ifname} in {h.netns}, {h.port} in {self.fabric_netns})"
            try:
                host = self._reader(h.netns, hidx)
                link, upq = host.read_link(hidx), host.read(hidx)
                downq = self._reader(self.fabric_netns, fidx).read(fidx)
            except (OSError, TopologyError) as e:
                raise TopologyError(f"{self.prefix}: reading the counters of {where}: {e}") from e
            out[h.name] = LinkCounters(
                host=h.name, **link,
                **{f"{d}_{k}": q[k] for d, q in (("up", upq), ("down", downq))
                   for k in ("bytes", "packets", "drops", "overlimits", "backlog")})
        return out

    def status(self) -> dict:
        """Everything ``ina-net status`` shows, as a JSON-ready dict."""
        self._require_up()
        shaping, counters, delays = self.shaping(), self.counters(), self.netem()
        netem = probe_netem()
        hosts = []
        for h in self.hosts:
            hosts.append({
                "name": h.name, "role": h.role, "netns": h.netns, "ip": h.ip, "ifname": h.ifname,
                "port": h.port,
                "up": asdict(shaping[h.name]["up"]) if shaping[h.name]["up"] else None,
                "down": asdict(shaping[h.name]["down"]) if shaping[h.name]["down"] else None,
                "delay_loss": {d: asdict(p) if p else None for d, p in delays[h.name].items()},   # the links' netem
                "counters": asdict(counters[h.name]),
            })
        delay, loss = self._netem_spec(delays)
        return {"prefix": self.prefix, "subnet": str(self.subnet), "root_ip": self.root_ip,
                "root_ifname": self.root_ifname, "fabric_netns": self.fabric_netns, "mtu": self.mtu,
                "netem": {"available": netem.available, "detail": netem.detail},
                "delay": delay, "loss": loss, "hosts": hosts}

    # ---- processes ----------------------------------------------------------------------------
    def popen(self, host, argv, *, sysfs: bool = True, **kw) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace; keyword arguments go to subprocess.Popen.

        Without ``env=``, the child gets this process's environment plus ``host.env()``
        (GLOO_SOCKET_IFNAME etc.). The process is terminated on ``down()`` if it still runs.
        ``sysfs=False`` skips the private /sys mount (/sys/class/net then shows the root
        namespace's interfaces).
        """
        self._require_up()
        h = self.host(host)
        if kw.get("env") is None:
            kw["env"] = {**os.environ, **h.env()}
        p = nsexec.popen_in_netns(h.netns, argv, sysfs=sysfs, **kw)
        log.debug("%s: started pid %d in %s: %s", self.prefix, p.pid, h.name, argv)
        self._procs.append((h, p))
        return p

    def run(self, host, argv, *, timeout: float = 60.0, check: bool = False, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion (bounded by ``timeout`` seconds); output is
        captured as text unless ``stdout``/``stderr``/``text`` say otherwise."""
        kw.setdefault("text", True)
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        p = self.popen(host, argv, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise TopologyError(f"{argv!r} in host {self.host(host).name} did not finish within {timeout}s") from None
        cp = subprocess.CompletedProcess(argv, p.returncode, out, err)
        if check:
            cp.check_returncode()
        return cp

    # ---- teardown -----------------------------------------------------------------------------
    def down(self) -> dict:
        """Stop the processes started in the hosts, remove every namespace, link and qdisc."""
        running = [(h, p) for h, p in self._procs if p.poll() is None]
        if running:
            log.info("%s: stopping %d process(es) started in its hosts", self.prefix, len(running))
            for _, p in running:
                p.terminate()
            deadline = time.monotonic() + TERM_GRACE
            for h, p in running:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s: pid %d in %s ignored SIGTERM: SIGKILL", self.prefix, p.pid, h.name)
                    p.kill()
                    p.wait(timeout=TERM_GRACE)
        self._procs.clear()
        self.close_handles()
        report = teardown(self.prefix)
        self._is_up = False
        return report

    def _require_up(self) -> None:
        if not self._is_up:
            raise TopologyError(f"topology {self.prefix} is not up (use `with Topology(...)` or .up())")

    # ---- attach to a running topology ---------------------------------------------------------
    @classmethod
    def attach(cls, prefix: str) -> "Topology":
        """A handle on a topology built elsewhere (e.g. by ``ina-net up``); ``down()`` still
        removes it, leaving the ``with`` block does not (``keep=True``)."""
        check_prefix(prefix)
        require_privileges("inspect emulated links")
        names = [n for n in pr_netns.listnetns() if (m := NS_RE.match(n)) and m.group(1) == prefix]
        if ns_name(prefix, FABRIC) not in names or ns_name(prefix, SWITCH) not in names:
            found = list_topologies()
            raise TopologyError(f"no topology with prefix {prefix!r} is up"
                                + (f" (found: {', '.join(found)})" if found else " (none found)"))
        ranks = sorted(int(NS_RE.match(n).group(3)) for n in names if NS_RE.match(n).group(3))
        if not ranks or ranks != list(range(len(ranks))):
            raise TopologyError(f"topology {prefix} is incomplete (worker namespaces {ranks}): "
                                f"`ina-net down --prefix {prefix}` and bring it up again")
        topo = cls(workers=len(ranks), rate=None, prefix=prefix, keep=True)
        root = topo._h(None)
        ri = link_index(root, topo.root_ifname)
        addrs = root.get_addr(family=socket.AF_INET, index=ri) if ri is not None else []
        if not addrs:
            raise TopologyError(f"topology {prefix} has no root link {topo.root_ifname} with an "
                                f"address: `ina-net down --prefix {prefix}` and bring it up again")
        a = addrs[0]
        topo.subnet = ipaddress.ip_interface(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}").network
        topo._make_hosts()
        topo.mtu = root.link("get", index=ri)[0].get_attr("IFLA_MTU")
        topo._is_up = True
        for h in topo.hosts:
            idx = link_index(topo._h(h.netns), h.ifname)
            addr = topo._h(h.netns).get_addr(family=socket.AF_INET, index=idx) if idx else []
            if not addr or addr[0].get_attr("IFA_ADDRESS") != h.ip:
                raise TopologyError(f"topology {prefix}: host {h.name} has no link {h.ifname} with "
                                    f"address {h.ip}: `ina-net down --prefix {prefix}` and bring it up again")
        topo._host_rates = topo.rates()     # each host's own: set-rate may have given one a rate of its own
        # delay and loss as the links' netem has them (a kernel without netem: none, up refused them), so that
        # the handle reports them and set_rate / up keep them
        topo.delay, topo.loss = topo._netem_spec(topo.netem())
        return topo

    def __repr__(self) -> str:
        state = "up" if self._is_up else "down"
        impaired = "".join(f", {k}={v:g}" for k, v in (("delay", self.delay), ("loss", self.loss)) if v)
        return (f"Topology(prefix={self.prefix!r}, workers={self.workers_count}, {self._rate_summary()}{impaired}, "
                f"subnet={self.subnet}, {state})")
