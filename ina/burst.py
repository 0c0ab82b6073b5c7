"""Burst I/O on UDP sockets: recvmmsg/sendmmsg into preallocated buffers (DPDK's rx/tx burst).

One system call moves a whole burst. Receive buffers, iovecs, msghdrs and source addresses are
allocated once (numpy arrays whose memory the kernel writes into), so the hot path allocates
nothing per packet. Transmit takes a list of (buffer row, length, destination) triples; several
entries may point at the same row, which is how a result is multicast to every worker without a copy.
Linux only (x86_64 / aarch64 layouts of struct mmsghdr).
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_recvmmsg = _libc.recvmmsg
_recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
_recvmmsg.restype = ctypes.c_int
_sendmmsg = _libc.sendmmsg
_sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
_sendmmsg.restype = ctypes.c_int

MSG_DONTWAIT = 0x40
MSG_WAITFORONE = 0x10000

# struct iovec { void *base; size_t len; }
IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])
# struct mmsghdr { struct msghdr hdr; unsigned msg_len; } (64 bytes on LP64 Linux)
MMSGHDR = np.dtype({
    "names": ["name", "namelen", "iov", "iovlen", "control", "controllen", "flags", "msg_len"],
    "formats": ["<u8", "<u4", "<u8", "<u8", "<u8", "<u8", "<i4", "<u4"],
    "offsets": [0, 8, 16, 24, 32, 40, 48, 56],
    "itemsize": 64,
})
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


class TxBatch:
    """Up to ``capacity`` transmit entries per call; each entry is (row of a buffer, length, address)."""

    def __init__(self, sock: socket.socket, capacity: int = 4096):
        self.sock = sock
        self.fd = sock.fileno()
        self.capacity = capacity
        self._iov = np.zeros(capacity, IOVEC)
        self._msg = np.zeros(capacity, MMSGHDR)
        self._msg["iov"] = _ptr(self._iov) + np.arange(capacity, dtype=np.uint64) * IOVEC.itemsize
        self._msg["iovlen"] = 1
        self._msg["namelen"] = SOCKADDR_IN.itemsize
        self._msgp = _ptr(self._msg)
        self.sent_packets = 0
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
        lens = np.broadcast_to(np.asarray(lens, dtype=np.uint64), (n,))
        aidx = np.broadcast_to(np.asarray(addr_idx, dtype=np.uint64), (n,))
        base, stride = _ptr(buf), buf.strides[0]
        abase = _ptr(addrs)
        done = 0
        while done < n:
            k = min(self.capacity, n - done)
            sl = slice(done, done + k)
            self._iov["base"][:k] = base + rows[sl] * stride
            self._iov["len"][:k] = lens[sl]
            self._msg["name"][:k] = abase + aidx[sl] * SOCKADDR_IN.itemsize
            sent = 0
            while sent < k:
                r = _sendmmsg(self.fd, self._msgp + sent * MMSGHDR.itemsize, k - sent, 0)
                if r < 0:
                    e = ctypes.get_errno()
                    if e in (errno.EINTR, errno.EAGAIN, errno.ENOBUFS):
                        continue
                    if e == errno.ECONNREFUSED:   # an earlier ICMP port unreachable; this packet is gone
                        self.refused += 1
                        sent += 1
                        continue
                    raise OSError(e, f"sendmmsg: {os.strerror(e)}")
                sent += r
            self.sent_bytes += int(lens[sl].sum())
            done += k
        self.sent_packets += n
        return n
