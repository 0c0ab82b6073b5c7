"""Kernel state of emulated topologies: names, netlink helpers, process cleanup, discovery, teardown.

Everything here works from what the kernel holds (namespaces, links, qdiscs, processes), never from
a ``Topology`` object, so another process can find and remove a topology (``ina-net status/down``)
after the process that built it was killed. ``ina.net.topology`` builds and drives topologies on top
of these helpers.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import logging
import os
import re
import signal
import socket
import struct
import threading
import zlib
import time
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns
from pyroute2.netlink.exceptions import NetlinkError

from . import nsexec
from .nsexec import require_privileges
from .shaping import TbfParams

log = logging.getLogger("ina.net")

NS_PREFIX = "inanet-"            # every namespace this module creates starts with this
HOST_IFNAME = "ina0"             # host side of each link: the same name in every host namespace
FABRIC = "fabric"
SWITCH = "sw"
MAX_WORKERS = 200
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
NS_RE = re.compile(r"^inanet-([a-z][a-z0-9]{0,7})-(fabric|sw|w(\d{1,3}))$")
ROOT_LINK_RE = re.compile(r"^([a-z][a-z0-9]{0,7})-root$")
ALIAS_TAG = "inanet"             # ifalias of the root-namespace link: "inanet prefix=P"
SUBNET_POOL = ipaddress.ip_network("10.213.0.0/16")
SWITCH_OFFSET = 1                # switch host: .1
WORKER_OFFSET = 10               # worker i: .10+i
LOCK_PATH = "/run/ina-net.lock"
LOCK_TIMEOUT = 30.0
TC_H_ROOT = 0xFFFFFFFF
TBF_HANDLE = 0x10000             # 1:
NETEM_HANDLE = 0x100000          # 10:
TERM_GRACE = 3.0                 # seconds between SIGTERM and SIGKILL for processes in our hosts
DIRECTIONS = ("up", "down", "both")


class TopologyError(RuntimeError):
    """A topology cannot be built, found or changed as asked."""


class NetemUnavailable(TopologyError):
    """Delay/loss were asked of the kernel, but it has no netem qdisc."""


# ----------------------------------------------------------------------------------------------
# names

def check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not PREFIX_RE.match(prefix):
        raise TopologyError(
            f"prefix {prefix!r}: must be 1-8 characters, a lowercase letter then letters/digits "
            f"(it goes into interface names, which the kernel limits to 15 characters)")
    return prefix


def ns_name(prefix: str, host: str) -> str:
    return f"{NS_PREFIX}{prefix}-{host}"


def port_name(prefix: str, host: str) -> str:
    return f"{prefix}-{host}p"


def bridge_name(prefix: str) -> str:
    return f"{prefix}-br"


def root_ifname(prefix: str) -> str:
    return f"{prefix}-root"


def root_peer_name(prefix: str) -> str:
    return f"{prefix}-rootp"

@dataclass(frozen=True)
class LinkCounters:
    """Kernel counters of one host's link.

    ``tx_*``/``rx_*``: the device counters of the host side of the veth (tx = upload, rx =
    download). A GSO super-frame counts its headers once there, so they undercount bytes on the
    wire by a few percent under TCP. ``up_*``/``down_*``: the counters of the shaping queues
    (zero when that direction is unshaped): bytes/packets as the token bucket charged them (every
    frame with its own headers: the numbers to compare with the rate), frames dropped because the
    queue was full, times the bucket ran out of tokens (overlimits: the shaper was the
    bottleneck), and bytes waiting now (backlog).
    """
    host: str
    tx_bytes: int
    tx_packets: int
    rx_bytes: int
    rx_packets: int
    up_bytes: int
    up_packets: int
    up_drops: int
    up_overlimits: int
    up_backlog: int
    down_bytes: int
    down_packets: int
    down_drops: int
    down_overlimits: int
    down_backlog: int


@dataclass(frozen=True)
class NetemProbe:
    available: bool
    detail: str


# ----------------------------------------------------------------------------------------------
# netlink helpers

def open_rtnl(netns: str | None) -> IPRoute:
    """An RTNL socket in the root namespace (None) or in an existing named namespace."""
    if netns is None:
        return IPRoute()
    if netns not in pr_netns.listnetns():
        raise TopologyError(f"network namespace {netns!r} does not exist")
    return IPRoute(netns=netns, flags=0)


def link_index(ipr: IPRoute, ifname: str) -> int | None:
    found = ipr.link_lookup(ifname=ifname)
    return found[0] if found else None


@contextlib.contextmanager
def ignoring(*codes):
    try:
        yield
    except NetlinkError as e:
        if e.code not in codes:
            raise


def disable_ipv6(ipr: IPRoute, index: int) -> None:
    """No link-local address on our links: no router/neighbour solicitations in the counters."""
    ipr.link("set", index=index, IFLA_AF_SPEC={
        "attrs": [["AF_INET6", {"attrs": [["IFLA_INET6_ADDR_GEN_MODE", 1]]}]]})


def ensure_addr(ipr: IPRoute, index: int, ip: str, plen: int) -> None:
    have = [(a.get_attr("IFA_ADDRESS"), a["prefixlen"]) for a in ipr.get_addr(family=socket.AF_INET, index=index)]
    for addr, p in have:
        if (addr, p) != (ip, plen):
            ipr.addr("del", index=index, address=addr, prefixlen=p)
    if (ip, plen) not in have:
        ipr.addr("add", index=index, address=ip, prefixlen=plen)


def ensure_veth(ipr: IPRoute, ifname: str, peer_ipr: IPRoute, peer_name: str, peer_netns: str,
                note: str) -> tuple[int, int]:
    """ifindices of the veth pair ``ifname`` (in ``ipr``'s namespace) <-> ``peer_name`` (in namespace
    ``peer_netns``, whose RTNL socket is ``peer_ipr``); when either end is missing, the pair is
    created afresh and ``note`` logged."""
    a, b = link_index(ipr, ifname), link_index(peer_ipr, peer_name)
    if a is None or b is None:
        if a is not None:
            ipr.link("del", index=a)
        if b is not None:
            peer_ipr.link("del", index=b)
        log.info("%s", note)
        fd = os.open(nsexec.netns_path(peer_netns), os.O_RDONLY)
        try:
            ipr.link("add", ifname=ifname, kind="veth", peer={"ifname": peer_name, "net_ns_fd": fd})
        finally:
            os.close(fd)
        a, b = link_index(ipr, ifname), link_index(peer_ipr, peer_name)
    return a, b


def root_qdisc(ipr: IPRoute, index: int):
    for q in ipr.get_qdiscs(index=index):
        if q["index"] == index and q["parent"] == TC_H_ROOT:
            return q
    return None


class QdiscCounterReader:
    """The counters of links and of their root qdiscs, read cheaply and often (about 9 to 14 microseconds a read).

    pyroute2 dumps every qdisc of the namespace and decodes each message attribute by attribute in
    Python: 1-2 ms a read, longer than the time in which a 1 gbit link sends 100 frames; its link
    get takes about 1 ms. This sends one ``RTM_GETQDISC`` (or ``RTM_GETLINK``) for one link on its
    own NETLINK_ROUTE socket (opened in namespace ``netns``; None: the caller's) and picks the
    statistics structures out of the reply. :meth:`read` returns the root qdisc's ``bytes``,
    ``packets``, ``drops``, ``overlimits`` and ``backlog`` (0 for a qdisc that keeps no statistics);
    :meth:`read_link` the device's ``tx_bytes``, ``tx_packets``, ``rx_bytes`` and ``rx_packets``.
    Both read link ``ifindex`` unless given another link of the same namespace; one read at a time
    per reader (a lock), so threads may share it.
    """

    _NLMSG = struct.Struct("=IHHII")       # nlmsghdr: len, type, flags, seq, pid
    _TCMSG = struct.Struct("=BxxxiIII")    # tcmsg: family, ifindex, handle, parent, info
    _IFINFO = struct.Struct("=BxHiII")     # ifinfomsg: family, type, index, flags, change
    _NLA = struct.Struct("=HH")            # nlattr: len, type
    RTM_NEWLINK, RTM_GETLINK, RTM_NEWQDISC, RTM_GETQDISC, NLMSG_ERROR = 16, 18, 36, 38, 2
    NLM_F_REQUEST, NLM_F_ECHO = 0x1, 0x8   # the answer to a qdisc get is a notification: echo it to us
    TCA_STATS2, TCA_STATS_BASIC, TCA_STATS_QUEUE = 7, 1, 3
    IFLA_STATS64 = 23                      # struct rtnl_link_stats64: rx_packets, tx_packets, rx_bytes, tx_bytes, ...
    TIMEOUT = 5.0                          # seconds the kernel may take to answer

    def __init__(self, netns: str | None, ifindex: int):
        self.netns = netns
        self.ifindex = self._checked(ifindex)
        self.seq = 0
        self.lock = threading.Lock()
        self.sock = self._socket(netns)
        try:
            self.sock.bind((0, 0))
            self.sock.settimeout(self.TIMEOUT)
        except OSError:
            self.sock.close()
            raise
        self.buf = bytearray(1 << 16)

    def _checked(self, ifindex) -> int:
        if isinstance(ifindex, bool) or not isinstance(ifindex, int) or ifindex <= 0:
            raise TopologyError(f"netlink: no such link to read the counters of (ifindex {ifindex!r} in "
                                f"namespace {self.netns or 'of the caller'})")
        return ifindex

    @staticmethod
    def _socket(netns: str | None) -> socket.socket:
        """A NETLINK_ROUTE socket of namespace ``netns`` (None: the caller's). A socket belongs to the
        namespace its creator was in: a short-lived thread enters it (setns of CLONE_NEWNET moves the
        calling thread alone), so the caller's thread never leaves its own. A thread that answers
        after the caller gave up on it closes what it opened."""
        if netns is None:
            return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        lock = threading.Lock()
        box: dict = {}          # "out": the socket or the error; "abandoned": the caller gave up

        def make():
            try:
                target = os.open(nsexec.netns_path(netns), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    nsexec.setns(target)
                finally:
                    os.close(target)
                out = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
            except OSError as e:
                out = e
            with lock:
                if not box.get("abandoned"):
                    box["out"] = out
                    return
            if not isinstance(out, OSError):
                out.close()
        t = threading.Thread(target=make, name=f"netlink socket in {netns}", daemon=True)
        t.start()
        t.join(QdiscCounterReader.TIMEOUT)
        with lock:
            out = box.get("out")
            box["abandoned"] = out is None
        if out is None:
            raise TopologyError(f"netlink: no socket in namespace {netns} within {QdiscCounterReader.TIMEOUT}s")
        if isinstance(out, OSError):
            raise TopologyError(f"netlink: cannot open a socket in namespace {netns}: {out}") from out
        return out

    def read(self, ifindex: int | None = None) -> dict:
        """The counters of the root qdisc of link ``ifindex`` (None: the reader's link)."""
        idx = self.ifindex if ifindex is None else self._checked(ifindex)
        with self.lock:
            a, b = self._ask(self.RTM_GETQDISC, self.NLM_F_REQUEST | self.NLM_F_ECHO,
                             self._TCMSG.pack(0, idx, 0, TC_H_ROOT, 0), self.RTM_NEWQDISC,
                             f"the root qdisc of ifindex {idx}")
            return self._stats(a + self._TCMSG.size, b)

    def read_link(self, ifindex: int | None = None) -> dict:
        """The device counters of link ``ifindex`` (None: the reader's link)."""
        idx = self.ifindex if ifindex is None else self._checked(ifindex)
        with self.lock:
            a, b = self._ask(self.RTM_GETLINK, self.NLM_F_REQUEST, self._IFINFO.pack(0, 0, idx, 0, 0),
                             self.RTM_NEWLINK, f"link ifindex {idx}")
            for kind, c, d in self._attrs(a + self._IFINFO.size, b):
                if kind == self.IFLA_STATS64 and d - c >= 32:
                    rx_packets, tx_packets, rx_bytes, tx_bytes = struct.unpack_from("=4Q", self.buf, c)
                    return {"tx_bytes": tx_bytes, "tx_packets": tx_packets, "rx_bytes": rx_bytes,
                            "rx_packets": rx_packets}
        raise TopologyError(f"netlink: the kernel's answer for link ifindex {idx} in namespace "
                            f"{self.netns or 'of the caller'} has no 64-bit statistics")

    def _ask(self, kind: int, flags: int, body: bytes, reply: int, what: str) -> tuple[int, int]:
        """Send one request; the (start, end) in ``self.buf`` of the payload of its ``reply`` message."""
        where = f"{what} in namespace {self.netns or 'of the caller'}"
        self.seq += 1
        self.sock.send(self._NLMSG.pack(self._NLMSG.size + len(body), kind, flags, self.seq, 0) + body)
        deadline = time.monotonic() + self.TIMEOUT
        while True:
            try:
                n = self.sock.recv_into(self.buf)
            except socket.timeout:
                n = -1
            if n < 0 or time.monotonic() > deadline:
                raise TopologyError(f"netlink: no answer within {self.TIMEOUT}s reading {where}")
            off = 0
            while off + self._NLMSG.size <= n:
                length, got, _, seq, _ = self._NLMSG.unpack_from(self.buf, off)
                if length < self._NLMSG.size:
                    raise TopologyError(f"netlink: malformed message of {length} bytes reading {where}")
                if seq == self.seq:
                    if got == self.NLMSG_ERROR:
                        code = -struct.unpack_from("=i", self.buf, off + self._NLMSG.size)[0]
                        raise OSError(code, f"netlink: reading {where}: {os.strerror(code)}")
                    if got == reply:
                        return off + self._NLMSG.size, off + length
                off += (length + 3) & ~3

    def _attrs(self, start: int, end: int):
        while start + 4 <= end:
            length, kind = self._NLA.unpack_from(self.buf, start)
            if length < 4:
                break
            yield kind & 0x3FFF, start + 4, start + length
            start += (length + 3) & ~3

    def _stats(self, start: int, end: int) -> dict:
        out = {"drops": 0, "backlog": 0, "bytes": 0, "packets": 0, "overlimits": 0}
        for kind, a, b in self._attrs(start, end):
            if kind == self.TCA_STATS2:
                for sub, c, _ in self._attrs(a, b):
                    if sub == self.TCA_STATS_BASIC:
                        out["bytes"], out["packets"] = struct.unpack_from("=QI", self.buf, c)
                    elif sub == self.TCA_STATS_QUEUE:
                        _, out["backlog"], out["drops"], _, out["overlimits"] = struct.unpack_from("=5I", self.buf, c)
        return out

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def tbf_of(q) -> TbfParams | None:
    """The shaping a root tbf applies, as read back from the kernel."""
    if q is None or q.get_attr("TCA_KIND") != "tbf":
        return None
    parms = q.get_attr("TCA_OPTIONS").get_attr("TCA_TBF_PARMS")
    rate = parms["rate"]
    # buffer is the bucket in psched ticks (64 ns); burst in bytes = rate * time
    burst = int(round(rate * parms["buffer"] * 64e-9))
    return TbfParams(rate_bps=rate * 8, burst=burst, limit=parms["limit"])


@dataclass(frozen=True)
class NetemParams:
    """The delay and loss a netem qdisc applies to one direction of a link, as read back from the kernel."""
    delay: float         # one-way delay, seconds
    loss: float          # loss probability, 0..1


def netem_of(qdiscs) -> NetemParams | None:
    """The netem among a link's qdiscs (the child of its tbf, or its root when the direction is
    unshaped), as read back from the kernel; None: the link has none (no delay, no loss)."""
    for q in qdiscs:
        if q.get_attr("TCA_KIND") == "netem":
            opts = q.get_attr("TCA_OPTIONS")
            # latency in psched ticks (64 ns: tbf_of's), loss a fraction of 2^32 - 1 (tc's encoding)
            return NetemParams(delay=round(opts["delay"] * 64e-9, 9), loss=round(opts["loss"] / 0xFFFFFFFF, 9))
    return None


def ns_pids(names) -> dict[int, str]:
    """pid -> namespace name, for every process living in one of the named namespaces."""
    inodes = {}
    for name in names:
        with contextlib.suppress(OSError):
            st = os.stat(nsexec.netns_path(name))
            inodes[(st.st_dev, st.st_ino)] = name
    found = {}
    if not inodes:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        name = inodes.get((st.st_dev, st.st_ino))
        if name is not None and int(entry) != os.getpid():
            found[int(entry)] = name
    return found


def kill_pids(pids, grace: float = TERM_GRACE) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace`` seconds; returns the pids signalled."""
    pids = list(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if pid_alive(p)}
        if alive:
            time.sleep(0.02)
    for pid in alive:
        log.warning("process %d ignored SIGTERM for %.1fs: sending SIGKILL", pid, grace)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if pid_alive(p)}
        if alive:
            time.sleep(0.02)
    if alive:
        raise TopologyError(f"processes {sorted(alive)} survived SIGKILL for {grace}s")
    return pids


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie no longer holds its namespace: not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


@contextlib.contextmanager
def build_lock(timeout: float = LOCK_TIMEOUT):
    """Serialise bring-ups on this machine (subnet choice must not race)."""
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TopologyError(f"waited {timeout:.0f}s for {LOCK_PATH}, held by another "
                                        f"ina-net bring-up") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def choose_subnet(root: IPRoute, root_link: str, prefix: str, requested=None) -> ipaddress.IPv4Network:
    """The /24 of topology ``prefix``: the one its root link ``root_link`` already has (adopting an
    existing topology), else ``requested`` if it is free, else a free /24 of SUBNET_POOL chosen from
    a hash of the prefix. Free: no address or route of the root namespace (``root``) overlaps it."""
    idx = link_index(root, root_link)
    if idx is not None:  # adopting an existing topology: keep its addresses
        addrs = root.get_addr(family=socket.AF_INET, index=idx)
        if addrs:
            a = addrs[0]
            net = ipaddress.ip_interface(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}").network
            if requested is not None and net != requested:
                raise TopologyError(f"topology {prefix} already exists on {net}, not "
                                    f"{requested}: `ina-net down --prefix {prefix}` first")
            return net
    used = []
    for a in root.get_addr(family=socket.AF_INET):
        if a.get_attr("IFA_LABEL") == root_link:
            continue
        used.append((ipaddress.ip_interface(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}").network,
                     f"address {a.get_attr('IFA_ADDRESS')}/{a['prefixlen']} on {a.get_attr('IFA_LABEL')}"))
    for r in root.get_routes(family=socket.AF_INET, table=254):
        if r["dst_len"] > 0 and r.get_attr("RTA_DST"):
            used.append((ipaddress.ip_network(f"{r.get_attr('RTA_DST')}/{r['dst_len']}", strict=False),
                         f"route {r.get_attr('RTA_DST')}/{r['dst_len']}"))
    def conflict(net):
        return next((why for u, why in used if u.overlaps(net)), None)
    if requested is not None:
        why = conflict(requested)
        if why:
            raise TopologyError(f"subnet {requested} overlaps {why} in the root namespace")
        return requested
    subnets = list(SUBNET_POOL.subnets(new_prefix=24))
    start = zlib.crc32(prefix.encode()) % len(subnets)
    for k in range(len(subnets)):
        net = subnets[(start + k) % len(subnets)]
        if not conflict(net):
            return net
    raise TopologyError(f"every /24 of {SUBNET_POOL} is in use in the root namespace")


# ----------------------------------------------------------------------------------------------
# discovery and teardown (work from kernel state only)

def list_topologies() -> list[str]:
    """Prefixes of every topology present on this machine (namespaces or root links)."""
    prefixes = set()
    for name in pr_netns.listnetns():
        m = NS_RE.match(name)
        if m:
            prefixes.add(m.group(1))
    with IPRoute() as ipr:
        for link in ipr.get_links():
            m = ROOT_LINK_RE.match(link.get_attr("IFLA_IFNAME") or "")
            alias = link.get_attr("IFLA_IFALIAS") or ""
            if m and alias.startswith(ALIAS_TAG):
                prefixes.add(m.group(1))
    return sorted(prefixes)


def teardown(prefix: str, *, grace: float = TERM_GRACE) -> dict:
    """Remove every namespace, link and qdisc of topology ``prefix``; returns what was removed.

    Works from kernel state alone, so it also cleans up after a builder that was killed.
    Processes still running inside the topology's hosts are terminated first (a namespace lives
    as long as one process is inside it, and with it the links and qdiscs).
    """
    check_prefix(prefix)
    require_privileges("tear down emulated links")
    names = sorted(n for n in pr_netns.listnetns() if (m := NS_RE.match(n)) and m.group(1) == prefix)
    report = {"prefix": prefix, "namespaces": [], "links": [], "killed": []}
    pids = ns_pids(names)
    if pids:
        log.info("%s: terminating %d process(es) still inside its hosts: %s", prefix, len(pids),
                 ", ".join(f"{p} ({n})" for p, n in sorted(pids.items())))
        report["killed"] = kill_pids(pids, grace)
    with IPRoute() as ipr:
        idx = link_index(ipr, root_ifname(prefix))
        if idx is not None:
            with ignoring(errno.ENODEV):
                ipr.link("del", index=idx)
            report["links"].append(root_ifname(prefix))
    fab = ns_name(prefix, FABRIC)
    if fab in names:
        # delete the links explicitly (synchronously) rather than leaving it to namespace cleanup
        with contextlib.suppress(TopologyError, OSError), open_rtnl(fab) as ipr:
            for link in ipr.get_links():
                ifname = link.get_attr("IFLA_IFNAME")
                if ifname and ifname.startswith(f"{prefix}-"):
                    with ignoring(errno.ENODEV):
                        ipr.link("del", index=link["index"])
                    report["links"].append(ifname)
    for name in names:
        path = nsexec.netns_path(name)
        with contextlib.suppress(OSError):
            pr_netns.remove(name)
        if os.path.exists(path):  # a bare mount point left by a crash during creation
            with contextlib.suppress(OSError):
                os.unlink(path)
        if os.path.exists(path):
            raise TopologyError(f"could not remove network namespace {name} ({path})")
        report["namespaces"].append(name)
    if names or report["links"]:
        log.info("%s: removed %d namespace(s), %d link(s)", prefix, len(report["namespaces"]),
                 len(report["links"]))
    return report


_netem_probe: NetemProbe | None = None


def probe_netem(refresh: bool = False) -> NetemProbe:
    """Try to create a netem qdisc on a dummy link in a scratch namespace; cached per process."""
    global _netem_probe
    if _netem_probe is not None and not refresh:
        return _netem_probe
    require_privileges("probe for the netem qdisc")
    scratch = f"{NS_PREFIX}probe{os.getpid()}"
    try:
        pr_netns.create(scratch)
        with IPRoute(netns=scratch, flags=0) as ipr:
            try:
                ipr.link("add", ifname="probe0", kind="dummy")
                where = "a dummy link in a scratch namespace"
                idx = link_index(ipr, "probe0")
            except NetlinkError:   # kernel without CONFIG_DUMMY: the scratch namespace's loopback
                where = "the loopback of a scratch namespace"
                idx = link_index(ipr, "lo")
            ipr.link("set", index=idx, state="up")
            try:
                ipr.tc("add", "netem", idx, handle=NETEM_HANDLE, parent=TC_H_ROOT, delay=1000)
                result = NetemProbe(True, f"netem qdisc available (probed on {where}): delay/loss "
                                          f"can be emulated by the kernel")
            except NetlinkError as e:
                result = NetemProbe(False, (
                    f"netem qdisc not available in this kernel (adding one to {where} failed: "
                    f"{os.strerror(e.code)}; the kernel lacks CONFIG_NET_SCH_NETEM): delay and loss "
                    f"are emulated by the switch's user-space impairment stage (ina-switch --loss/"
                    f"--delay-ms); links only shape rate"))
    finally:
        with contextlib.suppress(OSError):
            pr_netns.remove(scratch)
    _netem_probe = result
    return result


def netem_available(refresh: bool = False) -> bool:
    return probe_netem(refresh).available


