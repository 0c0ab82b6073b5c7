"""Burst I/O on UDP sockets: recvmmsg/sendmmsg into preallocated buffers (DPDK's rx/tx burst).

One system call moves a whole burst. Receive buffers, iovecs, msghdrs and source addresses are
allocated once (numpy arrays whose memory the kernel writes into), so the hot path allocates
nothing per packet. Transmit takes a list of (buffer row, length, destination) triples; several
entries may point at the same row, which is how a result is multicast to every worker without a copy.

UDP GSO (``UDP_SEGMENT``): a run of consecutive entries to one destination with one length (its
last entry may be shorter) goes out as one message whose iovecs are the rows and whose cmsg names
the segment size; the kernel builds the datagrams once, at the bottom of the stack (or at the
receiver's), so a burst costs one trip through the UDP/IP stack per destination instead of one per
packet. The datagrams on the wire are the same as without it (one per entry, same bytes). If the
kernel refuses a GSO message, the batch falls back to one datagram per message for good.
Linux only (x86_64 / aarch64 layouts of struct mmsghdr).
"""
from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import logging
import math
import struct

import numpy as np
from numba import njit

from . import gro as G

log = logging.getLogger("ina.burst")

_libc = ctypes.CDLL(None, use_errno=True)
_recvmmsg = _libc.recvmmsg
_recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
_recvmmsg.restype = ctypes.c_int
_sendmmsg = _libc.sendmmsg
_sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
_sendmmsg.restype = ctypes.c_int

MSG_DONTWAIT = 0x40
MSG_WAITFORONE = 0x10000
SOL_UDP = 17
UDP_SEGMENT = 103             # setsockopt / cmsg: GSO segment size of a send (Linux 4.18+)
UDP_GRO = 104                 # setsockopt / cmsg: receive coalesced datagrams (Linux 5.0+)
GSO_MAX_SEGMENTS = 64         # UDP_MAX_SEGMENTS of Linux before 6.x (later kernels allow 128)
GSO_MAX_BYTES = 65507         # one IPv4 datagram's payload: the most a GSO message may carry
GRO_LANDING = 16              # coalesced messages a receive takes at most (64 kB each)
GRO_MAX_MESSAGE = 1 << 16     # the longest message GRO hands over (rows this long are received into directly)
DIRECT_AFTER = 4              # receives without a coalesced message before the ring receives into its rows again

# struct iovec { void *base; size_t len; }
IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])
# struct mmsghdr { struct msghdr hdr; unsigned msg_len; } (64 bytes on LP64 Linux)
MMSGHDR = np.dtype({
    "names": ["name", "namelen", "iov", "iovlen", "control", "controllen", "flags", "msg_len"],
    "formats": ["<u8", "<u4", "<u8", "<u8", "<u8", "<u8", "<i4", "<u4"],
    "offsets": [0, 8, 16, 24, 32, 40, 48, 56],
    "itemsize": 64,
})
# struct cmsghdr { size_t len; int level; int type; } + a u16 segment size, CMSG_SPACE(2) = 24 bytes
CMSG_U16 = np.dtype({"names": ["len", "level", "type", "value"], "formats": ["<u8", "<i4", "<i4", "<u2"],
                     "offsets": [0, 8, 12, 16], "itemsize": 24})
CMSG_LEN_U16 = 18
# struct sockaddr_in (16 bytes): family in host order, port and address in network order
SOCKADDR_IN = np.dtype([("family", "<u2"), ("port", ">u2"), ("addr", ">u4"), ("zero", "u1", (8,))])


def sockaddr(host: str, port: int) -> np.ndarray:
    a = np.zeros(1, SOCKADDR_IN)
    a["family"] = socket.AF_INET
    a["port"] = port
    a["addr"] = struct.unpack("!I", socket.inet_aton(socket.gethostbyname(host)))[0]
    return a


def addr_tuple(sa) -> tuple[str, int]:
    return socket.inet_ntoa(struct.pack("!I", int(sa["addr"]))), int(sa["port"])


def _ptr(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def udp_socket(host: str = "0.0.0.0", port: int = 0, bufsize: int = 32 << 20) -> socket.socket:
    """A bound UDP socket with large kernel buffers (forced past rmem_max when privileged)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt, force in ((socket.SO_RCVBUF, 33), (socket.SO_SNDBUF, 32)):  # SO_RCVBUFFORCE, SO_SNDBUFFORCE
        try:
            s.setsockopt(socket.SOL_SOCKET, force, bufsize)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, opt, bufsize)
    s.bind((host, port))
    return s


def set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    if sec == 0 and usec == 0:
        usec = 1
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, usec))


def _msghdrs(buf: np.ndarray, src: np.ndarray, control: np.ndarray | None = None):
    """Receive msghdrs of the rows of ``buf`` (one iovec each), their sources into ``src`` and, with
    ``control``, a cmsg buffer per row. Returns (iovecs, msghdrs, msghdrs as (n, 8) u64 words)."""
    n, stride = buf.shape
    iov = np.zeros(n, IOVEC)
    iov["base"] = _ptr(buf) + np.arange(n, dtype=np.uint64) * stride
    iov["len"] = stride
    msg = np.zeros(n, MMSGHDR)
    msg["name"] = _ptr(src) + np.arange(n, dtype=np.uint64) * SOCKADDR_IN.itemsize
    msg["namelen"] = SOCKADDR_IN.itemsize
    msg["iov"] = _ptr(iov) + np.arange(n, dtype=np.uint64) * IOVEC.itemsize
    msg["iovlen"] = 1
    if control is not None:
        msg["control"] = _ptr(control) + np.arange(n, dtype=np.uint64) * control.shape[1]
        msg["controllen"] = control.shape[1]
    return iov, msg, msg.view(np.uint64).reshape(n, 8)


def gro_enable(sock: socket.socket, on: bool = True) -> str | None:
    """Turn UDP GRO on (or off) for ``sock`` (on: the kernel may hand over several datagrams of one
    sender as one coalesced message); None when it did, else why not."""
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, int(on))
        return None
    except OSError as e:
        return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}"


def readable(fd: int, seconds: float) -> bool:
    """Whether descriptor ``fd`` becomes readable within ``seconds`` (0: whether it is now). A select, whose
    timer is precise to about 0.1 ms (poll's counts whole milliseconds); select takes descriptors below
    FD_SETSIZE (1024) only, so a higher one (a process with many files open) waits in poll instead. The
    project's one wait for a descriptor (ina.host_client too): select.select alone raises ValueError there."""
    if fd < 1024:
        return bool(select.select([fd], [], [], seconds)[0])
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(math.ceil(seconds * 1e3)))


class RxRing:
    """A preallocated pool of ``burst`` receive buffers of ``stride`` bytes and their msghdrs.

    UDP GRO (``gro``; default: on where the kernel has it, unless the environment sets ``INA_GRO=0``):
    the kernel may deliver a sender's GSO message (or datagrams it coalesced) as one message, with a
    cmsg naming the segment size. Such messages land in ``GRO_LANDING`` buffers of 64 kB (more are
    received until the rows are full or the socket is empty) and are cut into their datagrams, one
    row each, so callers see exactly the rows a per-datagram receive gives (segments that do not fit
    this burst's rows come first in the next). ``gro_refused``: why the
    kernel refused it (then every message is one datagram, received straight into the rows).
    ``messages`` counts what the kernel handed over, ``packets`` the rows.

    Rows of at least 64 kB hold any coalesced message whole, so while the kernel coalesces nothing
    (datagrams too large to share a GSO message, or links that cut super-frames) the ring receives
    straight into its rows, a burst per call, with no landing copy (``direct``); a coalesced message
    found there is cut in place, its segments moved to the rows after it (what does not fit the burst
    goes to the landing buffers, first in the next call). After a receive that found a coalesced
    message the ring lands messages again, and it goes back to receiving straight into the rows after
    ``DIRECT_AFTER`` receives in a row that found none. ``direct_receives`` counts those receives;
    ``direct=False`` always lands (to measure against it).
    """

    def __init__(self, sock: socket.socket, burst: int = 64, stride: int = 2048, gro: bool | None = None,
                 direct: bool | None = None):
        self.sock = sock
        self.fd = sock.fileno()
        self.burst = burst
        self.stride = stride
        self.buf = np.zeros((burst, stride), np.uint8)
        self.src = np.zeros(burst, SOCKADDR_IN)
        self._iov, self._msg, self._msg64 = _msghdrs(self.buf, self.src)
        self._msgp = _ptr(self._msg)
        self.lens = np.zeros(burst, np.int64)
        self.messages = self.packets = 0
        if gro is None:                          # INA_GRO=0 turns it off (to measure against it)
            gro = os.environ.get("INA_GRO", "1") != "0"
        self.gro_refused = gro_enable(sock) if gro else None
        self.gro = bool(gro) and self.gro_refused is None
        self.direct_receives = 0
        self._direct_ok = self._direct = False
        if self.gro:
            self._landing(min(burst, GRO_LANDING))
            self._src8 = self.src.view(np.uint8).reshape(burst, SOCKADDR_IN.itemsize)
            self._land_state = np.zeros(3, np.int64)        # landed messages, next message, next byte in it
            self._direct_ok = self._direct = stride >= GRO_MAX_MESSAGE and direct is not False
            self._calm = 0                                  # receives in a row that found no coalesced message
            if self._direct_ok:                             # the rows' own msghdrs, with a cmsg buffer each
                self._ctl = np.zeros((burst, 64), np.uint8)
                self._segs = np.zeros(burst, np.int64)
                self._dir_iov, self._dir_msg, self._dir_msg64 = _msghdrs(self.buf, self.src, self._ctl)
                self._dir_msgp = _ptr(self._dir_msg)
        self._warm_up()

    def _landing(self, m: int) -> None:
        """``m`` landing buffers of a whole UDP datagram's payload (64 kB), their sources and cmsgs."""
        self._land = np.zeros((m, GRO_MAX_MESSAGE), np.uint8)
        self._land_src = np.zeros(m, SOCKADDR_IN)
        self._land_ctl = np.zeros((m, 64), np.uint8)
        self._land_iov, self._land_msg, self._land_msg64 = _msghdrs(self._land, self._land_src, self._land_ctl)
        self._land_msgp = _ptr(self._land_msg)
        self._land_src8 = self._land_src.view(np.uint8).reshape(m, SOCKADDR_IN.itemsize)

    def _warm_up(self) -> None:
        """Load (or compile) the receive kernels now, on an empty burst, not in the first real one."""
        _take_lengths(self._msg64, 0, self.stride, self.lens)
        if self.gro:
            G.cut_segments(self._land, self._land_msg64, self._land_ctl, self._land_src8, self._land_state, self.buf,
                          self.lens, self._src8, 0)
        if self._direct_ok:
            G.direct_fit(self._dir_msg64, self._ctl, 0, self.stride, self.lens, self._segs)
            G.cut_in_place(self.buf, self._segs, self._src8, 0, 0, self.lens, self._land, self._land_msg64,
                          self._land_ctl, self._land_src8, self._land_state)

    def recv(self, wait: bool = True) -> int:
        """Receive up to a burst. With ``wait`` block until one packet or the socket's timeout.

        Returns the number of packets; ``self.buf[:n]`` holds them, ``self.lens[:n]`` their sizes
        (a size above ``stride`` means the datagram was truncated), ``self.src[:n]`` their senders.
        0 on timeout.
        """
        if self.gro:
            st = self._land_state
            if self._direct and st[1] >= st[0]:
                return self._recv_direct(wait)
            return self._recv_gro(wait)
        n = _recvmmsg(self.fd, self._msgp, self.burst, MSG_WAITFORONE if wait else MSG_DONTWAIT, None)
        if n < 0:
            return self._recv_error()
        _take_lengths(self._msg64, n, self.stride, self.lens)
        self.messages += n
        self.packets += n
        return n

    def recv_within(self, seconds: float, timeout: float) -> int:
        """Receive up to a burst, waiting at most ``seconds`` for the first packet; ``timeout`` is the
        socket's own receive timeout (SO_RCVTIMEO), what a wait that long blocks on. A shorter wait is a
        select: the socket's timeout counts in kernel ticks (HZ=250: a 1 ms or 50 us timeout waited 4 to
        12 ms, measured), select's timer is precise to about 0.1 ms. 0: nothing came."""
        if seconds >= timeout:
            return self.recv(wait=True)
        n = self.recv(wait=False)             # first what is here (landed GRO messages not cut yet included)
        if n or seconds <= 0 or not readable(self.fd, seconds):
            return n
        return self.recv(wait=False)

    def _recv_gro(self, wait: bool) -> int:
        """As :meth:`recv`: rows are filled from landed messages, receiving more until the rows are full
        or the socket is empty (so that fewer rows than a burst still means an emptied socket)."""
        st, m = self._land_state, self._land.shape[0]
        messages0 = self.messages - (st[0] - st[1])         # the landed messages not cut yet count as this call's
        n = 0 if st[1] >= st[0] else G.cut_segments(self._land, self._land_msg64, self._land_ctl, self._land_src8,
                                                      st, self.buf, self.lens, self._src8, 0)   # landed, not cut yet
        first = True
        while n < self.burst and st[1] >= st[0]:         # every landed message is cut: receive more
            flags = MSG_WAITFORONE if wait and first and n == 0 else MSG_DONTWAIT
            first = False
            got = _recvmmsg(self.fd, self._land_msgp, m, flags, None)
            if got <= 0:
                if got < 0 and n == 0:
                    return self._recv_error()
                break
            st[0], st[1], st[2] = got, 0, 0
            self.messages += got
            n = G.cut_segments(self._land, self._land_msg64, self._land_ctl, self._land_src8, st, self.buf,
                              self.lens, self._src8, n)
            if got < m:                                  # the socket had no more
                break
        self.packets += n
        if self._direct_ok and n:                        # every message one datagram: calm
            coalesced = n > self.messages - messages0 or st[1] < st[0]
            self._calm = 0 if coalesced else self._calm + 1
            self._direct = self._calm >= DIRECT_AFTER
        return n

    def _recv_direct(self, wait: bool) -> int:
        """As :meth:`recv`, straight into the rows (each may hold a coalesced message: it is cut in place)."""
        n = _recvmmsg(self.fd, self._dir_msgp, self.burst, MSG_WAITFORONE if wait else MSG_DONTWAIT, None)
        if n < 0:
            return self._recv_error()
        self.messages += n
        self.direct_receives += 1
        fit, rows = G.direct_fit(self._dir_msg64, self._ctl, n, self.stride, self.lens, self._segs)
        if rows > n or fit < n:                          # a coalesced message: cut it, land what does not fit
            if n - fit > self._land.shape[0]:
                log.info("more coalesced messages than landing buffers (%d > %d): more buffers",
                         n - fit, self._land.shape[0])
                self._landing(n - fit)
            rows = G.cut_in_place(self.buf, self._segs, self._src8, n, fit, self.lens, self._land, self._land_msg64,
                                 self._land_ctl, self._land_src8, self._land_state)
            if fit < n:                                  # the rows left take the first landed datagrams
                rows = G.cut_segments(self._land, self._land_msg64, self._land_ctl, self._land_src8, self._land_state,
                                     self.buf, self.lens, self._src8, rows)
            self._direct, self._calm = False, 0
        self.packets += rows
        return rows

    def _recv_error(self) -> int:
        e = ctypes.get_errno()
        if e in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
            return 0
        raise OSError(e, f"recvmmsg: {os.strerror(e)}")


@njit(cache=True)
def _take_lengths(msg, n, stride, lens):
    """Each received message's length into ``lens`` (``stride + 1`` where it was truncated), and its
    msghdr made ready for the next receive (the kernel rewrote namelen and flags)."""
    for i in range(n):
        truncated = (msg[i, 6] & np.uint64(0x20)) != 0          # msg_flags & MSG_TRUNC
        lens[i] = stride + 1 if truncated else np.int64(msg[i, 7] & np.uint64(0xFFFFFFFF))
        msg[i, 1] = 16                                          # namelen: sockaddr_in
        msg[i, 6] = 0


_ONE_VALUE: dict[int, np.ndarray] = {}     # one value's 1-element array (a send's length, its shard), made once


def _int64s(v) -> np.ndarray:
    """``v`` (an array or one value) as a 1-D int64 array, without a copy when it is one already. One int's
    array is made once and shared: the callers (the send kernels) only read it."""
    if type(v) is np.ndarray and v.dtype == np.int64 and v.ndim == 1:
        return v
    if type(v) is int:
        a = _ONE_VALUE.get(v)
        if a is None:
            if len(_ONE_VALUE) > 64:
                _ONE_VALUE.clear()
            a = _ONE_VALUE[v] = np.full(1, v, np.int64)
        return a
    return np.asarray(v, np.int64).reshape(-1)


def gso_supported(sock: socket.socket) -> bool:
    """Whether the kernel knows UDP_SEGMENT on this socket (it may still refuse a message: see TxBatch)."""
    try:
        sock.getsockopt(SOL_UDP, UDP_SEGMENT)
        return True
    except OSError:
        return False


@njit(cache=True)
def _plan_messages(lens, aidx, pos, k, gso, max_segments, max_bytes, starts):
    """The messages of entries ``pos .. k-1``: ``starts[:m]`` their first entries, ``starts[m] = k``;
    returns m. One rule (UDP_SEGMENT's): a run of consecutive entries to one destination with one
    length, whose last entry may be shorter, of at most ``max_segments`` entries and ``max_bytes``
    bytes. ``lens`` / ``aidx`` of one element stand for every entry."""
    m = 0
    i = pos
    one_len, one_dest = lens.size == 1, aidx.size == 1
    while i < k:
        starts[m] = i
        m += 1
        seg = lens[0 if one_len else i]
        dest = aidx[0 if one_dest else i]
        per = min(max_segments, max(1, max_bytes // max(seg, 1))) if gso else 1
        j = i + 1
        while j < k and j - i < per and aidx[0 if one_dest else j] == dest and lens[0 if one_len else j] == seg:
            j += 1
        if j < k and j - i < per and aidx[0 if one_dest else j] == dest and 0 < lens[0 if one_len else j] < seg:
            j += 1                            # a shorter (not empty: that is no segment) last entry closes the run
        i = j
    starts[m] = k
    return m


@njit(cache=True)
def _fill_messages(rows, lens, aidx, first, k, base, stride, abase, iov, iov_at, msg, cmsg_at, cmsg_value,
                   starts, m, pos):
    """Point the iovecs of entries ``first .. first+k-1`` of a send at their rows (``pos == 0``: all of
    them) and messages ``0 .. m-1`` at the runs ``starts`` found. Returns the entries' bytes."""
    one_len, one_dest = lens.size == 1, aidx.size == 1
    total = 0
    if pos == 0:
        for e in range(k):
            ln = lens[0 if one_len else first + e]
            iov[e, 0] = base + np.uint64(rows[first + e]) * stride
            iov[e, 1] = ln
            total += ln
    for q in range(m):
        s, count = starts[q], starts[q + 1] - starts[q]
        msg[q, 0] = abase + np.uint64(aidx[0 if one_dest else first + s]) * np.uint64(16)   # sockaddr_in
        msg[q, 1] = 16                                                          # namelen (+ padding)
        msg[q, 2] = iov_at[s]
        msg[q, 3] = count
        msg[q, 4] = cmsg_at[q] if count > 1 else np.uint64(0)
        msg[q, 5] = 24 if count > 1 else 0                                      # CMSG_SPACE(2)
        msg[q, 6] = 0
        msg[q, 7] = 0
        cmsg_value[q] = lens[0 if one_len else first + s]
    return total


@njit(cache=True)
def _build_messages(rows, lens, aidx, first, k, pos, gso, max_segments, max_bytes, base, stride, abase, iov, iov_at,
                    msg, cmsg_at, cmsg_value, starts):
    """:func:`_plan_messages` of entries ``first + pos .. first + k - 1`` and :func:`_fill_messages` of
    them, in one call. Returns (messages, the entries' bytes)."""
    sub_l = lens if lens.size == 1 else lens[first:first + k]
    sub_a = aidx if aidx.size == 1 else aidx[first:first + k]
    m = _plan_messages(sub_l, sub_a, pos, k, gso, max_segments, max_bytes, starts)
    return m, _fill_messages(rows, lens, aidx, first, k, base, stride, abase, iov, iov_at, msg, cmsg_at, cmsg_value,
                             starts, m, pos)


def gso_runs(lens: np.ndarray, aidx: np.ndarray, max_segments: int = GSO_MAX_SEGMENTS) -> np.ndarray:
    """Where the GSO messages of a transmit list start: indices of the first entry of each message.

    A message is a run of consecutive entries to one destination with one length, except that its
    last entry may be shorter (UDP_SEGMENT's rule), of at most ``max_segments`` entries and
    ``GSO_MAX_BYTES`` bytes.
    """
    n = len(lens)
    starts = np.zeros(n + 1, np.int64)
    m = _plan_messages(np.asarray(lens, np.int64), np.asarray(aidx, np.int64), 0, n, True, max_segments,
                       GSO_MAX_BYTES, starts)
    return starts[:m]


class TxBatch:
    """Up to ``capacity`` transmit entries per call; each entry is (row of a buffer, length, address).

    With ``gso`` (the default where the kernel has UDP_SEGMENT, unless the environment sets
    ``INA_GSO=0``) runs of entries to one destination
    are sent as GSO messages (:func:`gso_runs`); ``sent_messages`` counts what the kernel was handed,
    ``sent_packets`` the datagrams. ``gso_refused`` holds the kernel's reason when it refused GSO
    (then every later message is one datagram).
    """

    def __init__(self, sock: socket.socket, capacity: int = 4096, gso: bool | None = None):
        self.sock = sock
        self.fd = sock.fileno()
        self.capacity = capacity
        self._iov = np.zeros(capacity, IOVEC)
        self._iov_at = _ptr(self._iov) + np.arange(capacity, dtype=np.uint64) * IOVEC.itemsize
        self._cmsg = np.zeros(capacity, CMSG_U16)
        self._cmsg["len"], self._cmsg["level"], self._cmsg["type"] = CMSG_LEN_U16, SOL_UDP, UDP_SEGMENT
        self._cmsg_at = _ptr(self._cmsg) + np.arange(capacity, dtype=np.uint64) * CMSG_U16.itemsize
        self._cmsg_value = self._cmsg["value"]
        self._msg = np.zeros(capacity, MMSGHDR)
        self._msg["namelen"] = SOCKADDR_IN.itemsize
        self._msgp = _ptr(self._msg)
        self._iov64 = self._iov.view(np.uint64).reshape(capacity, 2)
        self._msg64 = self._msg.view(np.uint64).reshape(capacity, 8)
        self._starts = np.zeros(capacity + 1, np.int64)
        self._addresses: dict[int, tuple] = {}
        if gso is None:                          # INA_GSO=0 turns it off (to measure against it)
            gso = os.environ.get("INA_GSO", "1") != "0"
        self.gso = bool(gso) and gso_supported(sock)
        self.gso_max_segments = GSO_MAX_SEGMENTS
        self.gso_refused: str | None = None
        self.sent_packets = 0
        self.sent_messages = 0
        self.sent_bytes = 0
        self.refused = 0          # packets the kernel dropped for an earlier ICMP port unreachable
        self._warm_up()

    def _warm_up(self) -> None:
        """Load (or compile) the send kernels now, on an empty send: the first call in a process costs
        about 0.2 s (numba's cache load), which belongs to start-up, not to the first burst."""
        none = np.zeros(1, np.int64)
        _build_messages(none, none, none, 0, 0, 1, self.gso, self.gso_max_segments, GSO_MAX_BYTES, np.uint64(0),
                        np.uint64(0), np.uint64(0), self._iov64, self._iov_at, self._msg64, self._cmsg_at,
                        self._cmsg_value, self._starts)

    def send(self, buf: np.ndarray, rows: np.ndarray, lens, addrs: np.ndarray, addr_idx) -> int:
        """Send ``buf[rows[i], :lens[i]]`` to ``addrs[addr_idx[i]]`` for every i, in sendmmsg bursts.

        ``buf`` is a 2-D C-contiguous uint8 array, ``addrs`` a SOCKADDR_IN array that stays alive
        for the call; ``lens`` and ``addr_idx`` are arrays or one value for every entry. Returns the
        number of packets the kernel accepted.
        """
        rows = _int64s(rows)
        n = rows.size
        if n == 0:
            return 0
        lens, aidx = _int64s(lens), _int64s(addr_idx)
        base, abase = self._address(buf), self._address(addrs)
        stride = buf.strides[0]
        done = 0
        while done < n:
            k = min(self.capacity, n - done)
            pos = 0
            while pos < k:                       # again from ``pos`` after a GSO refusal
                pos = self._send_entries(rows, lens, aidx, done, k, pos, base, stride, abase)
            done += k
        self.sent_packets += n
        return n

    def _address(self, arr: np.ndarray) -> int:
        """The data address of ``arr``, remembered for the arrays sent from again and again (the ring)."""
        cache = self._addresses
        hit = cache.get(id(arr))
        if hit is not None and hit[0] is arr:
            return hit[1]
        if len(cache) > 8:
            cache.clear()
        at = _ptr(arr)
        cache[id(arr)] = (arr, at)
        return at

    def _send_entries(self, rows, lens, aidx, first: int, k: int, pos: int, base: int, stride: int,
                      abase: int) -> int:
        """Send entries ``first + pos .. first + k - 1`` as messages; returns k, or the entry (relative
        to ``first``) to resume from when the kernel refused GSO (which is then off)."""
        starts = self._starts
        m, sent_bytes = _build_messages(rows, lens, aidx, first, k, pos, self.gso, self.gso_max_segments,
                                        GSO_MAX_BYTES, np.uint64(base), np.uint64(stride), np.uint64(abase),
                                        self._iov64, self._iov_at, self._msg64, self._cmsg_at, self._cmsg_value,
                                        starts)
        if pos == 0:
            self.sent_bytes += int(sent_bytes)
        sent = 0
        while sent < m:
            r = _sendmmsg(self.fd, self._msgp + sent * MMSGHDR.itemsize, m - sent, 0)
            if r >= 0:
                sent += r
                continue
            e = ctypes.get_errno()
            if e in (errno.EINTR, errno.EAGAIN, errno.ENOBUFS):
                continue
            count = int(starts[sent + 1] - starts[sent])
            if e == errno.ECONNREFUSED:       # an earlier ICMP port unreachable; this message is gone
                self.refused += count
                sent += 1
                continue
            if count > 1 and e in (errno.EINVAL, errno.EIO, errno.EMSGSIZE, errno.ENOPROTOOPT, errno.EOPNOTSUPP):
                self.gso = False
                self.gso_refused = f"{errno.errorcode.get(e, e)}: {os.strerror(e)}"
                log.warning("the kernel refused a UDP GSO message (%d x %d bytes: %s); sending one datagram "
                            "per message from now on", count, int(self._cmsg["value"][sent]), self.gso_refused)
                self.sent_messages += sent
                return int(starts[sent])
            raise OSError(e, f"sendmmsg: {os.strerror(e)}")
        self.sent_messages += m
        return k
