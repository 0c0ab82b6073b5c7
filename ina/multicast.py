"""IP multicast of results, the worker's side: a data socket that joined the job's group.

The switch sends a job's results once, to the job's group (``ina.wire.multicast_group``: address and UDP
port, from the job id and the switch's address), when every worker of the job joined it
(``switch_model/multicast.py``). A worker's data socket therefore binds the group's port and joins the
group on the interface towards the switch. From before the join, the socket takes only datagrams from the
switch's address and ports (:func:`accept_only`: a kernel socket filter; narrowed to the address the results
come from and the shards' ports once the switch says it multicasts, removed if it does not), so that another
sender to the same group (another switch whose job has the same id, in a fabric where their groups
coincide) cannot hand this worker its results; what the filter drops is in the socket's drops
(:func:`socket_drops`). Where that cannot
be (the port is taken: e.g. several workers of a job in one network namespace, or ``multicast=False`` /
``INA_MULTICAST=0``) the worker binds any port, joins nothing and says so at join: the switch then sends
every worker its own unicast copy.

**Over loopback** (the switch at 127.x; :func:`loopback_endpoint`) every worker of the job is on one
host: their data sockets all bind the group's port (``SO_REUSEADDR``) and join the group on ``lo``, so
one datagram the switch sends to the group is queued at each of them. A unicast datagram to
127.0.0.1 at that port would reach any one of them, so each worker also joins a group of its own
(``ina.wire.rank_group``), which it names as its address at join: the switch sends its replays (and
unicast copies) there, and only this worker gets them. It sends from a second socket with a port of
its own (the switch checks each rank's packets come from its address). Nothing of the host's
configuration changes: the switch sends with ``IP_MULTICAST_IF`` 127.0.0.1, which takes ``lo`` with
no route for the group and without ``lo``'s MULTICAST flag (Linux; measured), and the datagrams cannot
leave ``lo``. Before it binds, the worker checks a datagram to its own group comes back on ``lo``
(:func:`loopback_probe`); if it does not (a kernel or filter that drops multicast on ``lo``), or the port
is taken, it binds any port and joins nothing, and says why at join: results come as unicast copies.

Joining also sends an IGMP membership report at once (the kernel's own follows on a timer), on the link the
join request then takes, so that a snooping bridge (the emulated fabric, ``ina.net.topology``) has this
worker on the group's port before the switch learns of the join and sends the first result.
"""
from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import logging
import os
import select
import socket
import struct
import time
from typing import NamedTuple

from . import burst as B
from .wire import multicast_group, rank_group

log = logging.getLogger("ina.client")

IP_MULTICAST_ALL = 49          # Linux: 0 = deliver only the groups this socket joined (not the host's)
IGMP_V3_REPORT = 0x22
IGMP_V3_ROUTERS = "224.0.0.22"  # where IGMPv3 reports go (no report suppression among members, unlike v2)
CHANGE_TO_EXCLUDE = 4           # a group record: exclude no source = join


def default() -> bool:
    """Whether workers join their job's group unless told (``INA_MULTICAST=0`` turns it off)."""
    return os.environ.get("INA_MULTICAST", "1") != "0"


class Endpoint(NamedTuple):
    """A worker's data sockets: ``sock`` receives, ``send`` sends (the same socket but over loopback);
    ``group``: the job's group ``sock`` joined (None: none); ``address``: the (host, port) the switch
    sends this worker's own datagrams to; ``source``: the (host, port) its packets come from where that
    differs (loopback), else None; ``how``: how results come to it, for the log."""
    sock: socket.socket
    send: socket.socket
    group: str | None
    address: tuple[str, int]
    source: tuple[str, int] | None
    how: str


def data_socket(local_ip: str, job: int, want: bool | None, switch: tuple[str, int], rank: int = 0) -> Endpoint:
    """A worker's bound data sockets (:class:`Endpoint`). ``local_ip``: this worker's address towards the
    switch; ``want``: join the group (None: :func:`default`); ``switch``: the switch's (IPv4 address,
    port) as this worker reaches it; ``rank``: the worker's (its own group over loopback)."""
    want = default() if want is None else want
    why = "multicast=False or INA_MULTICAST=0"
    if want and ipaddress.ip_address(local_ip).is_loopback:
        ep, why = loopback_endpoint(job, rank, switch)
        if ep is not None:
            return ep
    elif want:
        group, port = multicast_group(job, switch)
        try:
            sock = B.udp_socket("0.0.0.0", port)
        except OSError as e:
            why = f"port {port} of group {group} not free here ({e})"
        else:
            try:
                accept_only(sock, switch[0], switch[1], MAX_SHARDS)   # before the join: no other sender's is queued
                join(sock, group, local_ip)
                return Endpoint(sock, sock, group, (local_ip, port), None, f"group {group}:{port}")
            except OSError as e:
                sock.close()
                why = f"could not join group {group} on {local_ip} ({e})"
    if want:
        log.info("job %d: results as unicast: %s", job, why)
    sock = B.udp_socket("0.0.0.0", 0)
    return Endpoint(sock, sock, None, (local_ip, sock.getsockname()[1]), None, f"unicast: {why}")


LOOPBACK_PROBE_WAIT = 0.5      # seconds a datagram to the worker's own group may take to come back on lo


def loopback_endpoint(job: int, rank: int, switch: tuple[str, int]) -> tuple[Endpoint | None, str]:
    """(the data sockets of a worker that reaches its switch over loopback, or None; why not): the
    receiving socket bound to the job's group port beside its peers' (``SO_REUSEADDR``), filtered to the
    switch's address and ports, a member of the job's group and of this rank's own group on ``lo``; a
    sending socket of its own port (the module's docstring)."""
    group, port = multicast_group(job, switch)
    mine = rank_group(job, rank, switch)
    why = loopback_probe(mine, port)
    if why is not None:
        return None, why
    try:
        sock = B.udp_socket("0.0.0.0", port, reuse=True)
    except OSError as e:
        return None, f"port {port} of group {group} not free here ({e})"
    try:
        accept_only(sock, switch[0], switch[1], MAX_SHARDS)   # before the joins: no other sender's is queued
        join(sock, group, LOOPBACK, report=False)
        join(sock, mine, LOOPBACK, report=False)
    except OSError as e:
        sock.close()
        return None, f"could not join group {group} on lo ({e})"
    send = B.udp_socket(LOOPBACK, 0)
    return Endpoint(sock, send, group, (mine, port), send.getsockname()[:2],
                    f"group {group}:{port} on lo (own group {mine})"), ""


LOOPBACK = "127.0.0.1"
SIOCGIFFLAGS, IFF_MULTICAST = 0x8913, 0x1000


def lo_has_multicast_flag() -> bool | None:
    """Whether ``lo`` has the MULTICAST flag in this network namespace (None: unknown). Not needed for
    multicast on ``lo`` (the switch names the interface): said in :func:`loopback_probe`'s reason."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0))
        return bool(struct.unpack("16sH14x", req)[1] & IFF_MULTICAST)
    except OSError:
        return None


def loopback_probe(group: str, port: int, wait: float = LOOPBACK_PROBE_WAIT) -> str | None:
    """Whether a datagram sent to ``group``:``port`` out of ``lo`` comes back to a socket that joined it
    on ``lo``, as the switch's results will: None if it does within ``wait`` s, else why not."""
    token = os.urandom(16)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx, \
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
            rx.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            rx.bind((group, port))                        # this group's datagrams only
            join(rx, group, LOOPBACK, report=False)
            tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(LOOPBACK))
            tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
            tx.sendto(token, (group, port))
            end = time.monotonic() + wait
            while (left := end - time.monotonic()) > 0 and select.select([rx], [], [], left)[0]:
                if rx.recv(64) == token:
                    return None
    except OSError as e:
        return f"multicast on lo failed ({e})"
    flag = lo_has_multicast_flag()
    return (f"a datagram to group {group}:{port} did not come back on lo within {wait:g} s (lo "
            f"{'has' if flag else 'lacks' if flag is False else 'may lack'} the MULTICAST flag)")


def settle(ep: Endpoint, local_ip: str, config: dict, ports: list) -> bool:
    """After the join (``config``: the switch's reply): whether the switch multicasts the job's results. If
    it does, from address ``results_from`` and UDP ports ``ports`` (its shards'): the socket's filter takes
    those only; if not, the group is left and the filter removed (results come as unicast), but over
    loopback, where the socket shares its port and takes its own datagrams by its own group: there the
    filter stays."""
    multicast, source = bool(config.get("multicast", False)), config.get("results_from")
    sock, group = ep.sock, ep.group
    if group is None:
        return multicast
    if ep.source is not None:          # loopback
        local_ip = LOOPBACK
        if not multicast:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_DROP_MEMBERSHIP,
                            socket.inet_aton(group) + socket.inet_aton(local_ip))
            return multicast
        source = source or LOOPBACK
    if multicast:
        if source:                       # (else: a switch that does not say; the filter of data_socket stays)
            try:
                accept_only(sock, source, min(ports), max(ports) - min(ports) + 1)
            except (OSError, ValueError) as e:   # the filter of data_socket (the switch's port range) stays
                log.warning("results from %s: the data socket's filter could not be narrowed to ports %s (%s)",
                            source, ports, e)
        return multicast
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_DROP_MEMBERSHIP, socket.inet_aton(group) + socket.inet_aton(local_ip))
    sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
    return multicast


def join(sock: socket.socket, group: str, local_ip: str, report: bool = True) -> None:
    """Join ``group`` on the interface of ``local_ip``; deliver only this socket's groups to it. ``report``:
    send an IGMP report at once (:func:`announce`; not on ``lo``, where no bridge listens)."""
    sock.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(group) + socket.inet_aton(local_ip))
    if report:
        announce(group, local_ip)


# Linux (asm-generic/socket.h, linux/sock_diag.h)
SO_ATTACH_FILTER, SO_DETACH_FILTER, SO_MEMINFO, SK_MEMINFO_DROPS = 26, 27, 55, 8
SKF_NET_OFF = -0x100000        # classic BPF: offsets from the network (IP) header
MAX_SHARDS = 256               # before the join: results may come from the switch's port and this many after it


def accept_only(sock: socket.socket, source_ip: str, first_port: int, ports: int) -> None:
    """Let ``sock`` take only datagrams from ``source_ip``, UDP ports ``first_port`` .. ``first_port + ports
    - 1`` (the switch's shards): a classic BPF socket filter, run by the kernel before the datagram is
    queued, so it costs the receive loop nothing. Dropped datagrams count in :func:`socket_drops`."""
    want = struct.unpack("!I", socket.inet_aton(source_ip))[0]
    prog = [(0x20, 0, 0, (SKF_NET_OFF + 12) & 0xFFFFFFFF),     # A = the IP header's source address
            (0x15, 0, 4, want),                                 # A != want: drop
            (0x28, 0, 0, 0),                                    # A = the UDP header's source port
            (0x35, 0, 2, first_port),                           # A < first_port: drop
            (0x35, 1, 0, first_port + ports),                   # A >= first_port + ports: drop
            (0x06, 0, 0, 0xFFFFFFFF),                           # accept whole
            (0x06, 0, 0, 0)]                                    # drop
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HL", len(prog), ctypes.addressof(code)))
    log.debug("data socket %s takes datagrams from %s ports %d..%d only", sock.getsockname(), source_ip,
              first_port, first_port + ports - 1)


def socket_drops(sock: socket.socket) -> int:
    """Datagrams the kernel dropped at ``sock``: refused by its filter (:func:`accept_only`) or beyond its
    receive buffer."""
    info = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 4 * (SK_MEMINFO_DROPS + 1))
    return struct.unpack(f"{SK_MEMINFO_DROPS + 1}I", info)[SK_MEMINFO_DROPS]


def close(sock: socket.socket, rank: int, job: int) -> None:
    """Close a worker's data socket at the end of its job, logging the datagrams the kernel dropped there."""
    try:
        n = socket_drops(sock)
    except OSError as e:             # a kernel without SO_MEMINFO: nothing to report
        log.debug("rank %d job %d: the data socket's drops cannot be read (%s)", rank, job, e)
        n = 0
    finally:
        sock.close()
    if n:
        log.info("rank %d job %d: the kernel dropped %d datagram(s) at the data socket (not from the switch, "
                 "or beyond its receive buffer)", rank, job, n)


def _checksum(data: bytes) -> int:
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


def announce(group: str, local_ip: str) -> bool:
    """Send an IGMPv3 membership report joining ``group`` from ``local_ip`` now (needs CAP_NET_RAW;
    without it, False: the kernel's own report comes a few milliseconds later)."""
    try:
        raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_IGMP)
    except OSError as e:
        log.debug("group %s: no IGMP report of our own (%s): the kernel's follows on its timer", group, e)
        return False
    with raw:
        raw.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(local_ip))
        raw.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
        raw.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 0)
        msg = struct.pack("!BBHHHBBH4s", IGMP_V3_REPORT, 0, 0, 0, 1, CHANGE_TO_EXCLUDE, 0, 0,
                          socket.inet_aton(group))
        msg = msg[:2] + struct.pack("!H", _checksum(msg)) + msg[4:]
        raw.sendto(msg, (IGMP_V3_ROUTERS, 0))
    return True
