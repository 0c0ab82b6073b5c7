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
be (the switch is reached over loopback, the port is taken: e.g. several workers of a job in one network
namespace, or ``multicast=False`` / ``INA_MULTICAST=0``) the worker binds any port, joins nothing and says
so at join: the switch then sends every worker its own unicast copy.

Joining also sends an IGMP membership report at once (the kernel's own follows on a timer), on the link the
join request then takes, so that a snooping bridge (the emulated fabric, ``ina.net.topology``) has this
worker on the group's port before the switch learns of the join and sends the first result.
"""
from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import struct

from . import burst as B
from .wire import multicast_group

log = logging.getLogger("ina.client")

IP_MULTICAST_ALL = 49          # Linux: 0 = deliver only the groups this socket joined (not the host's)
IGMP_V3_REPORT = 0x22
IGMP_V3_ROUTERS = "224.0.0.22"  # where IGMPv3 reports go (no report suppression among members, unlike v2)
CHANGE_TO_EXCLUDE = 4           # a group record: exclude no source = join


def default() -> bool:
    """Whether workers join their job's group unless told (``INA_MULTICAST=0`` turns it off)."""
    return os.environ.get("INA_MULTICAST", "1") != "0"


def data_socket(local_ip: str, job: int, want: bool | None,
                switch: tuple[str, int]) -> tuple[socket.socket, str | None]:
    """(a worker's bound data socket, the group it joined or None). ``local_ip``: this worker's address
    towards the switch; ``want``: join the group (None: :func:`default`); ``switch``: the switch's (IPv4
    address, port) as this worker reaches it."""
    want = default() if want is None else want
    if want and not ipaddress.ip_address(local_ip).is_loopback:
        group, port = multicast_group(job, switch)
        try:
            sock = B.udp_socket("0.0.0.0", port)
        except OSError as e:
            log.info("job %d: results as unicast: port %d of group %s not free here (%s)", job, port, group, e)
        else:
            try:
                accept_only(sock, switch[0], switch[1], MAX_SHARDS)   # before the join: no other sender's is queued
                join(sock, group, local_ip)
                return sock, group
            except OSError as e:
                sock.close()
                log.info("job %d: results as unicast: could not join group %s on %s (%s)", job, group, local_ip, e)
    return B.udp_socket("0.0.0.0", 0), None


def settle(sock: socket.socket, group: str | None, local_ip: str, config: dict, ports: list) -> bool:
    """After the join (``config``: the switch's reply): whether the switch multicasts the job's results. If
    it does, from address ``results_from`` and UDP ports ``ports`` (its shards'): the socket's filter takes
    those only; if not, the group is left and the filter removed (results come as unicast)."""
    multicast, source = bool(config.get("multicast", False)), config.get("results_from")
    if group is None:
        return multicast
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


def join(sock: socket.socket, group: str, local_ip: str) -> None:
    """Join ``group`` on the interface of ``local_ip``; deliver only this socket's groups to it."""
    sock.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(group) + socket.inet_aton(local_ip))
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
