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
import socket
import logging
import struct

import numpy as np

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


class RxRing:
    """A preallocated pool of ``burst`` receive buffers of ``stride`` bytes and their msghdrs."""

    def __init__(self, sock: socket.socket, burst: int = 64, stride: int = 2048):
        self.sock = sock
        self.fd = sock.fileno()
        self.burst = burst
        self.stride = stride
        self.buf = np.zeros((burst, stride), np.uint8)
        self.src = np.zeros(burst, SOCKADDR_IN)
        self._iov = np.zeros(burst, IOVEC)
        self._iov["base"] = _ptr(self.buf) + np.arange(burst, dtype=np.uint64) * stride
        self._iov["len"] = stride
        self._msg = np.zeros(burst, MMSGHDR)
        self._msg["name"] = _ptr(self.src) + np.arange(burst, dtype=np.uint64) * SOCKADDR_IN.itemsize
        self._msg["iov"] = _ptr(self._iov) + np.arange(burst, dtype=np.uint64) * IOVEC.itemsize
        self._msg["iovlen"] = 1
        self._msgp = _ptr(self._msg)
        self.lens = np.zeros(burst, np.int64)

    def recv(self, wait: bool = True) -> int:
        """Receive up to a burst. With ``wait`` block until one packet or the socket's timeout.

        Returns the number of packets; ``self.buf[:n]`` holds them, ``self.lens[:n]`` their sizes
        (a size above ``stride`` means the datagram was truncated). 0 on timeout.
        """
        self._msg["namelen"] = SOCKADDR_IN.itemsize
        self._msg["flags"] = 0
        n = _recvmmsg(self.fd, self._msgp, self.burst, MSG_WAITFORONE if wait else MSG_DONTWAIT, None)
        if n < 0:
            e = ctypes.get_errno()
            if e in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                return 0
            raise OSError(e, f"recvmmsg: {os.strerror(e)}")
        self.lens[:n] = self._msg["msg_len"][:n]
        trunc = (self._msg["flags"][:n] & 0x20) != 0   # MSG_TRUNC
        if trunc.any():
            self.lens[:n][trunc] = self.stride + 1
        return n


def gso_supported(sock: socket.socket) -> bool:
    """Whether the kernel knows UDP_SEGMENT on this socket (it may still refuse a message: see TxBatch)."""
    try:
        sock.getsockopt(SOL_UDP, UDP_SEGMENT)
        return True
    except OSError:
        return False


def gso_runs(lens: np.ndarray, aidx: np.ndarray, max_segments: int = GSO_MAX_SEGMENTS) -> np.ndarray:
    """Where the GSO messages of a transmit list start: indices of the first entry of each message.

    A message is a run of consecutive entries to one destination with one length, except that its
    last entry may be shorter (UDP_SEGMENT's rule), of at most ``max_segments`` entries and
    ``GSO_MAX_BYTES`` bytes.
    """
    n = lens.size
    if n == 0:
        return np.zeros(0, np.int64)
    lens, aidx = lens.astype(np.int64), aidx.astype(np.int64)
    same = aidx[1:] == aidx[:-1]
    brk = np.ones(n, bool)
    brk[1:] = ~same | (lens[1:] != lens[:-1])
    last = np.ones(n, bool)                  # last entry of its run (before merging short tails)
    last[:-1] = brk[1:]
    tail = np.zeros(n, bool)                 # a shorter last entry joins the run before it
    tail[1:] = same & (lens[1:] < lens[:-1]) & last[1:]
    tail[1:] &= ~tail[:-1]                   # ... unless that run ends with a shorter entry itself
    brk &= ~tail
    idx = np.arange(n)
    start = np.maximum.accumulate(np.where(brk, idx, 0))
    seg = np.maximum(lens[start], 1)
    per_msg = np.clip(GSO_MAX_BYTES // seg, 1, max_segments)
    return np.nonzero(brk | ((idx - start) % per_msg == 0))[0]


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
        self._msg = np.zeros(capacity, MMSGHDR)
        self._msg["namelen"] = SOCKADDR_IN.itemsize
        self._msgp = _ptr(self._msg)
        if gso is None:                          # INA_GSO=0 turns it off (to measure against it)
            gso = os.environ.get("INA_GSO", "1") != "0"
        self.gso = bool(gso) and gso_supported(sock)
        self.gso_max_segments = GSO_MAX_SEGMENTS
        self.gso_refused: str | None = None
        self.sent_packets = 0
        self.sent_messages = 0
        self.sent_bytes = 0
        self.refused = 0          # packets the kernel dropped for an earlier ICMP port unreachable

    def send(self, buf: np.ndarray, rows: np.ndarray, lens, addrs: np.ndarray, addr_idx) -> int:
        """Send ``buf[rows[i], :lens[i]]`` to ``addrs[addr_idx[i]]`` for every i, in sendmmsg bursts.

        ``buf`` is a 2-D C-contiguous uint8 array, ``addrs`` a SOCKADDR_IN array that stays alive
        for the call. Returns the number of packets the kernel accepted.
        """
        rows = np.asarray(rows, dtype=np.uint64)
        n = rows.size
        if n == 0:
            return 0
        uniform = np.ndim(lens) == 0 and np.ndim(addr_idx) == 0     # one length to one destination
        lens = np.broadcast_to(np.asarray(lens, dtype=np.uint64), (n,))
        aidx = np.broadcast_to(np.asarray(addr_idx, dtype=np.uint64), (n,))
        base, stride = _ptr(buf), buf.strides[0]
        done = 0
        while done < n:
            k = min(self.capacity, n - done)
            sl = slice(done, done + k)
            self._iov["base"][:k] = base + rows[sl] * stride
            self._iov["len"][:k] = lens[sl]
            pos = 0
            while pos < k:                       # again from ``pos`` after a GSO refusal
                pos = self._send_entries(pos, k, lens[sl], aidx[sl], _ptr(addrs), uniform)
            self.sent_bytes += int(lens[sl].sum())
            done += k
        self.sent_packets += n
        return n

    def _send_entries(self, pos: int, k: int, lens: np.ndarray, aidx: np.ndarray, abase: int,
                      uniform: bool = False) -> int:
        """Send iovec entries ``pos .. k-1`` as messages; returns k, or the entry to resume from when
        the kernel refused GSO (which is then off). ``uniform``: every entry has one length and one
        destination (the runs are then evenly spaced)."""
        if self.gso and k - pos > 1 and uniform:
            starts = np.arange(pos, k, min(self.gso_max_segments, max(1, GSO_MAX_BYTES // max(1, int(lens[0])))))
        elif self.gso and k - pos > 1:
            starts = pos + gso_runs(lens[pos:k], aidx[pos:k], self.gso_max_segments)
        else:
            starts = np.arange(pos, k)
        m = starts.size
        counts = np.diff(starts, append=k)
        msg = self._msg[:m]
        msg["iov"] = self._iov_at[starts]
        msg["iovlen"] = counts
        msg["name"] = abase + aidx[starts] * SOCKADDR_IN.itemsize
        multi = counts > 1
        msg["control"] = np.where(multi, self._cmsg_at[:m], 0)
        msg["controllen"] = np.where(multi, CMSG_U16.itemsize, 0)
        self._cmsg["value"][:m] = lens[starts]
        sent = 0
        while sent < m:
            r = _sendmmsg(self.fd, self._msgp + sent * MMSGHDR.itemsize, m - sent, 0)
            if r >= 0:
                sent += r
                continue
            e = ctypes.get_errno()
            if e in (errno.EINTR, errno.EAGAIN, errno.ENOBUFS):
                continue
            if e == errno.ECONNREFUSED:       # an earlier ICMP port unreachable; this message is gone
                self.refused += int(counts[sent])
                sent += 1
                continue
            if counts[sent] > 1 and e in (errno.EINVAL, errno.EIO, errno.EMSGSIZE, errno.ENOPROTOOPT,
                                          errno.EOPNOTSUPP):
                self.gso = False
                self.gso_refused = f"{errno.errorcode.get(e, e)}: {os.strerror(e)}"
                log.warning("the kernel refused a UDP GSO message (%d x %d bytes: %s); sending one datagram "
                            "per message from now on", int(counts[sent]), int(lens[starts[sent]]), self.gso_refused)
                self.sent_messages += sent
                return int(starts[sent])
            raise OSError(e, f"sendmmsg: {os.strerror(e)}")
        self.sent_messages += m
        return k
