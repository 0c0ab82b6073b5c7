"""CPU per packet of a burst send and receive with and without UDP GSO and GRO, on loopback, in the same run.

    python -m experiments.bench_burst                  # table
    python -m experiments.bench_burst --json

A burst shaped like the switch's: ``rows`` result rows multicast to ``dests`` receivers, sorted by
destination (what ``Switch.stage_tx`` hands to ``TxBatch``). The sender's thread CPU per packet
(``sendmmsg``; on loopback it includes the kernel's delivery to the receiving sockets) and the
receivers' (``recvmmsg``) are measured for plain datagrams and for GSO messages, alternating, and
reported with their ratio (the figure that matters on a shared machine). A third mode sends GSO
messages to receivers with UDP GRO on (``ina.burst.RxRing``: the kernel delivers each GSO message
whole and the ring cuts it into its datagrams). ``--rx-stride 65560`` gives the receive rings rows of
64 kB (the client's), which take a message straight into the rows while GRO coalesces nothing, and
adds the mode ``gso_gro_landing`` (the same rings, always landing): e.g. ``--sizes 8212 32792
--rx-stride 65560`` (32 kB: bfp32's 8192 int32 results, one datagram a GSO message).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ina import burst as B


def measure(size: int, rows: int, dests: int, rounds: int, gso: bool, gro: bool = False, stride: int | None = None,
            direct: bool | None = None) -> dict:
    tx_sock = B.udp_socket("127.0.0.1", 0)
    socks = [B.udp_socket("127.0.0.1", 0) for _ in range(dests)]
    addrs = np.zeros(dests, B.SOCKADDR_IN)
    for i, s in enumerate(socks):
        addrs[i] = B.sockaddr("127.0.0.1", s.getsockname()[1])[0]
    rings = [B.RxRing(s, 256, stride or size, gro=gro, direct=direct) for s in socks]
    buf = np.zeros((rows, size), np.uint8)
    order = np.argsort(np.tile(np.arange(dests), rows), kind="stable")
    row_of, dest_of = np.repeat(np.arange(rows), dests)[order], np.tile(np.arange(dests), rows)[order]
    tx = B.TxBatch(tx_sock, capacity=rows * dests, gso=gso)
    send_ns = recv_ns = got = 0
    for _ in range(rounds):
        t = time.thread_time_ns()
        tx.send(buf, row_of, size, addrs, dest_of)
        send_ns += time.thread_time_ns() - t
        t = time.thread_time_ns()
        for ring in rings:
            while k := ring.recv(wait=False):
                got += k
        recv_ns += time.thread_time_ns() - t
    for s in socks + [tx_sock]:
        s.close()
    n = rounds * rows * dests
    if got != n:
        raise RuntimeError(f"{n} datagrams sent, {got} received (a receive buffer overflowed?)")
    return {"send_us_per_packet": send_ns / n / 1e3, "recv_us_per_packet": recv_ns / n / 1e3,
            "messages": tx.sent_messages, "packets": n, "gso": tx.gso, "gro": all(r.gro for r in rings),
            "rx_messages": sum(r.messages for r in rings)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[276, 1044, 8212], help="datagram bytes")
    ap.add_argument("--rows", type=int, default=64, help="result rows per burst")
    ap.add_argument("--dests", type=int, default=4, help="receivers (workers)")
    ap.add_argument("--rounds", type=int, default=20, help="bursts per measurement")
    ap.add_argument("--reps", type=int, default=3, help="alternating plain/GSO measurements (median)")
    ap.add_argument("--rx-stride", type=int, default=None, help="receive rows' bytes (default: the datagram's)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if not B.gso_supported(B.udp_socket("127.0.0.1", 0, bufsize=1 << 16)):
        print("this kernel has no UDP_SEGMENT", file=sys.stderr)
        return 1
    rows = []
    for size in a.sizes:
        modes = {"plain": (False, False, None), "gso": (True, False, None), "gso_gro": (True, True, None)}
        if a.rx_stride:
            modes["gso_gro_landing"] = (True, True, False)
        runs = {m: [] for m in modes}
        for _ in range(a.reps):
            for m, (gso, gro, direct) in modes.items():
                runs[m].append(measure(size, a.rows, a.dests, a.rounds, gso, gro, a.rx_stride, direct))
        row = {"bytes": size}
        for m in modes:
            row[m] = {k: float(np.median([r[k] for r in runs[m]])) for k in ("send_us_per_packet", "recv_us_per_packet")}
            row[m]["messages_per_burst"] = runs[m][0]["messages"] / a.rounds
            row[m]["rx_messages_per_burst"] = runs[m][0]["rx_messages"] / a.rounds
        row["gro"] = runs["gso_gro"][0]["gro"]
        row["send_cpu_gso_vs_plain"] = row["gso"]["send_us_per_packet"] / row["plain"]["send_us_per_packet"]
        both = {m: row[m]["send_us_per_packet"] + row[m]["recv_us_per_packet"] for m in modes}
        row["send_recv_cpu_gro_vs_gso"] = both["gso_gro"] / both["gso"]
        if a.rx_stride:
            row["recv_cpu_gro_rows_vs_landing"] = (row["gso_gro"]["recv_us_per_packet"]
                                                   / row["gso_gro_landing"]["recv_us_per_packet"])
        rows.append(row)
    if a.json:
        print(json.dumps({"benchmark": "burst_send_gso", "reference": "the same burst as plain datagrams (GRO: as GSO without GRO)",
                          "rows_per_burst": a.rows, "destinations": a.dests, "rx_stride": a.rx_stride,
                          "results": rows}, indent=2))
    else:
        print(f"{'bytes':>6} {'plain snd/rcv us':>17} {'gso snd/rcv us':>15} {'gso+gro snd/rcv us':>19} "
              f"{'gso/plain snd':>14} {'gro/gso snd+rcv':>16}")
        for r in rows:
            cols = " ".join(f"{r[m]['send_us_per_packet']:>7.2f}/{r[m]['recv_us_per_packet']:<7.2f}"
                            for m in ("plain", "gso", "gso_gro"))
            print(f"{r['bytes']:>6} {cols} {r['send_cpu_gso_vs_plain']:>14.2f} {r['send_recv_cpu_gro_vs_gso']:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
