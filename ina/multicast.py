"""IP multicast of results, the worker's side: a data socket that joined the job's group.

The switch sends a job's results once, to the job's group (``ina.wire.multicast_group``: address and UDP
port), when every worker of the job joined it (``switch_model/multicast.py``). A worker's data socket
therefore binds the group's port and joins the group on the interface towards the switch. Where that cannot
be (the switch is reached over loopback, the port is taken: e.g. several workers of a job in one network
namespace, or ``multicast=False`` / ``INA_MULTICAST=0``) the worker binds any port, joins nothing and says
so at join: the switch then sends every worker its own unicast copy.

Joining also sends an IGMP membership report at once (the kernel's own follows on a timer), on the link the
join request then takes, so that a snooping bridge (the emulated fabric, ``ina.net.topology``) has this
worker on the group's port before the switch learns of the join and sends the first result.
"""
from __future__ import annotations

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


def data_socket(local_ip: str, job: int, want: bool = True) -> tuple[socket.socket, str | None]:
    """(a worker's bound data socket, the group it joined or None). ``local_ip``: this worker's address
    towards the switch."""
    if want and not ipaddress.ip_address(local_ip).is_loopback:
        group, port = multicast_group(job)
        try:
            sock = B.udp_socket("0.0.0.0", port)
        except OSError as e:
            log.info("job %d: results as unicast: port %d of group %s not free here (%s)", job, port, group, e)
        else:
            try:
                join(sock, group, local_ip)
                return sock, group
            except OSError as e:
                sock.close()
                log.info("job %d: results as unicast: could not join group %s on %s (%s)", job, group, local_ip, e)
    return B.udp_socket("0.0.0.0", 0), None


def join(sock: socket.socket, group: str, local_ip: str) -> None:
    """Join ``group`` on the interface of ``local_ip``; deliver only this socket's groups to it."""
    sock.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(group) + socket.inet_aton(local_ip))
    announce(group, local_ip)


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
    except OSError:
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
