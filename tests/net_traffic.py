"""Traffic endpoints for the link tests: real TCP/UDP sockets, run inside the hosts' namespaces.

Receivers print ``READY`` once bound (the test waits for that line before starting a sender) and,
at the end, one JSON line with what they measured. Rates are goodput (application payload bits
per second) measured by the receiver from the first to the last byte received.
"""
from __future__ import annotations

import argparse
import errno
import json
import socket
import sys
import time

END = b"END"
UDP_SEGMENT = 103   # linux/udp.h: UDP GSO, the kernel cuts one send into `size`-byte datagrams
UDP_GRO = 104       # linux/udp.h: receive coalesced datagrams in one read


def tcp_recv(a):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((a.bind, a.port))
    srv.listen(1)
    srv.settimeout(a.timeout)
    print("READY", flush=True)
    conn, peer = srv.accept()
    conn.settimeout(a.timeout)
    buf = bytearray(1 << 18)
    total = first = 0
    t_first = t_last = None
    while True:
        n = conn.recv_into(buf)
        now = time.perf_counter()
        if n == 0:
            break
        if t_first is None:
            t_first, first = now, n
        total += n
        t_last = now
    dt = (t_last - t_first) if t_first is not None else 0.0
    rate = (total - first) * 8 / dt if dt > 0 else 0.0
    print(json.dumps({"proto": "tcp", "bytes": total, "seconds": dt, "rate_bps": rate, "peer": peer[0]}), flush=True)


def tcp_send(a):
    s = socket.create_connection((a.to, a.port), timeout=a.timeout)
    chunk = memoryview(bytes(1 << 20))
    left = a.bytes
    t0 = time.perf_counter()
    while left > 0:
        n = min(left, len(chunk))
        s.sendall(chunk[:n])
        left -= n
    s.shutdown(socket.SHUT_WR)
    s.recv(1)   # wait for the receiver to close: everything was delivered
    s.close()
    print(json.dumps({"proto": "tcp", "sent": a.bytes, "seconds": time.perf_counter() - t0}), flush=True)


def udp_recv(a):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind((a.bind, a.port))
    s.settimeout(a.timeout)
    print("READY", flush=True)
    # UDP GRO: a batch sent with UDP GSO that reaches this socket still in one piece is read in
    # one call (the cmsg says how big its datagrams are); anything else is read datagram by datagram
    s.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
    buf = bytearray(65536)
    cmsg_space = socket.CMSG_SPACE(4)
    total = first = datagrams = 0
    t_first = t_last = None
    ended = "end-marker"
    while True:
        try:
            n, anc, _, _ = s.recvmsg_into([buf], cmsg_space)
        except socket.timeout:
            if t_first is None:
                raise SystemExit(f"udp-recv: no datagram within {a.timeout}s")
            ended = f"idle {a.idle}s"
            break
        now = time.perf_counter()
        if n == len(END) and buf[:n] == END:
            break
        seg = n
        for level, kind, data in anc:
            if level == socket.SOL_UDP and kind == UDP_GRO:
                seg = int.from_bytes(data[:4], sys.byteorder)
        if t_first is None:
            t_first, first = now, n
            s.settimeout(a.idle)
        total += n
        datagrams += -(-n // seg)
        t_last = now
    dt = (t_last - t_first) if t_first is not None else 0.0
    rate = (total - first) * 8 / dt if dt > 0 else 0.0
    # on the wire each datagram also carries UDP (8) + IPv4 (20) + Ethernet (14) header bytes
    wire = (total - first) * (1 + 42 / a.size) * 8 / dt if dt > 0 else 0.0
    print(json.dumps({"proto": "udp", "bytes": total, "datagrams": datagrams, "seconds": dt,
                      "rate_bps": rate, "wire_rate_bps": wire, "ended": ended}), flush=True)


def udp_send(a):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((a.to, a.port))
    count = -(-a.bytes // a.size)
    # Batch with UDP GSO: one send() carries up to 64 KB and leaves as ordinary `size`-byte
    # datagrams (each with its own headers on the wire), so a Python sender can outrun a 1 gbit
    # link even on a busy 2-core machine. --batch 1 sends one datagram per syscall.
    batch = max(1, min(a.batch, 65000 // a.size))
    if batch > 1:
        s.setsockopt(socket.SOL_UDP, UDP_SEGMENT, a.size)
    payload = bytes(a.size * batch)
    enobufs = sends = 0
    t0 = time.perf_counter()
    send = s.send
    # optional pacing (payload bit/s), e.g. to overload a download link by a known factor
    interval = a.size * batch * 8 / a.rate if a.rate else 0.0
    due = t0
    left = count
    while left > 0:
        n = min(batch, left)
        try:
            send(payload if n == batch else payload[:n * a.size])
        except OSError as e:
            if e.errno != errno.ENOBUFS:
                raise
            enobufs += 1
        left -= n
        sends += 1
        if interval:
            due += interval
            ahead = due - time.perf_counter()
            if ahead > 0.0005:
                time.sleep(ahead)   # pacing, not synchronisation
    if batch > 1:
        s.setsockopt(socket.SOL_UDP, UDP_SEGMENT, 0)
    for _ in range(20):   # several: the download queue may drop some; stop once the receiver is gone
        try:
            send(END)
        except ConnectionRefusedError:
            break
        except OSError as e:
            if e.errno != errno.ENOBUFS:
                raise
    print(json.dumps({"proto": "udp", "sent": count * a.size, "datagrams": count, "enobufs": enobufs,
                      "seconds": time.perf_counter() - t0}), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="mode", required=True)
    for name in ("tcp-recv", "udp-recv"):
        q = sub.add_parser(name)
        q.add_argument("--size", type=int, default=1472, help="udp-recv: datagram size (for the wire rate)")
        q.add_argument("--bind", default="0.0.0.0")
        q.add_argument("--port", type=int, required=True)
        q.add_argument("--timeout", type=float, default=30.0)
        q.add_argument("--idle", type=float, default=2.0,
                       help="udp-recv: seconds without a datagram that end the transfer when its end marker was lost (a starved sender can pause for most of a second)")
    for name in ("tcp-send", "udp-send"):
        q = sub.add_parser(name)
        q.add_argument("--to", required=True)
        q.add_argument("--port", type=int, required=True)
        q.add_argument("--bytes", type=int, required=True)
        q.add_argument("--size", type=int, default=1472)
        q.add_argument("--rate", type=float, default=0.0, help="udp-send: pace to this payload bit/s")
        q.add_argument("--batch", type=int, default=44, help="udp-send: datagrams per send (UDP GSO)")
        q.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args(argv)
    {"tcp-recv": tcp_recv, "tcp-send": tcp_send, "udp-recv": udp_recv, "udp-send": udp_send}[a.mode](a)


if __name__ == "__main__":
    sys.exit(main())
