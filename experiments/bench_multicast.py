"""A burst of results to N workers: N unicast copies vs one IP multicast send, in the emulated topology.

    sudo python -m experiments.bench_multicast                     # table
    sudo python -m experiments.bench_multicast --json --workers 8 --rate 1gbit

A sender in the switch's namespace sends bursts of ``rows`` result datagrams of ``size`` bytes (nc's
results at 1024 elements per packet: 1044 bytes) to ``workers`` receivers, each in its own worker
namespace, in one of two modes, alternating, each ``--reps`` times:

    unicast     every row to every worker: one GSO message per worker (what the switch's tx stage does)
    multicast   every row once, as one GSO message to a group every receiver joined; the fabric's
                bridge replicates it onto each member's port

A further host (``--outsiders``) binds the same port but joins nothing: it must get no copy, and its
download (the egress of its bridge port) must not carry one. The bridge snoops IGMP
(ina.net.topology), so it forwards a group's packets to its members' ports only.

Reported per mode: the sender's thread CPU per burst (the switch's tx stage), the receivers' process CPU
per packet, the CPU of the whole machine per burst (/proc/stat; every process of the machine, noisy on a
shared one), datagrams each receiver got and what each worker's download queue (tbf) and the outsider's
saw; the ratios multicast / unicast. Bursts are paced at ``--interval`` (below the link rate, so the
shaping queues do not drop).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import struct
import sys
import threading
import time

import numpy as np

PORT = 47001
GROUP = "239.77.0.1"


def _join(sock: socket.socket, group: str, local_ip: str) -> None:
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(group) + socket.inet_aton(local_ip))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def receiver(args) -> None:
    """Receive for ever (GRO ring, as the client); print cumulative counters on each line of stdin."""
    from ina import burst as B
    sock = B.udp_socket("0.0.0.0", args.port)
    if args.group:
        _join(sock, args.group, args.ip)
    B.set_recv_timeout(sock, 0.05)
    ring = B.RxRing(sock, 256, 65560)
    got = [0, 0]                         # packets, bytes

    def report():
        for _ in sys.stdin:
            print(json.dumps({"packets": got[0], "bytes": got[1], "messages": ring.messages, "cpu_s": _cpu_s()}),
                  flush=True)
        os._exit(0)
    threading.Thread(target=report, daemon=True).start()
    print(json.dumps({"ready": True}), flush=True)
    while True:
        n = ring.recv()
        if n:
            got[0] += n
            got[1] += int(ring.lens[:n].sum())


def sender(args) -> None:
    """On each line of stdin (``unicast`` or ``multicast``) send ``bursts`` bursts; print the CPU it took."""
    from ina import burst as B
    sock = B.udp_socket("0.0.0.0", 0)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(args.ip))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 0)
    ips = args.workers_ips.split(",")
    uni = np.zeros(len(ips), B.SOCKADDR_IN)
    for i, ip in enumerate(ips):
        uni[i] = B.sockaddr(ip, args.port)[0]
    grp = B.sockaddr(args.group, args.port)
    rows = args.rows
    buf = np.random.default_rng(0).integers(0, 255, (rows, args.size), np.uint8)
    tx = B.TxBatch(sock, capacity=rows * len(ips))
    uni_rows, uni_dest = np.tile(np.arange(rows), len(ips)), np.repeat(np.arange(len(ips)), rows)
    print(json.dumps({"ready": True, "gso": tx.gso}), flush=True)
    for line in sys.stdin:
        mode = line.strip()
        cpu = 0
        m0 = tx.sent_messages
        t_next = time.perf_counter()
        for _ in range(args.bursts):
            t_next += args.interval
            t = time.thread_time_ns()
            if mode == "unicast":
                tx.send(buf, uni_rows, args.size, uni, uni_dest)
            else:
                tx.send(buf, np.arange(rows), args.size, grp, 0)
            cpu += time.thread_time_ns() - t
            delay = t_next - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        print(json.dumps({"cpu_ns": cpu, "messages": tx.sent_messages - m0, "gso": tx.gso}), flush=True)


def _machine_cpu() -> dict:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return {"busy_s": (sum(v[:3]) + sum(v[5:8])) / hz, "softirq_s": v[6] / hz, "system_s": v[2] / hz}


def _ask(p) -> dict:
    p.stdin.write("report\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def _expect_ready(p, what: str) -> dict:
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} exited before it was ready: {p.stderr.read()[-2000:]}")
    return json.loads(line)


def _settle(recvs, want: int, bound: float = 5.0) -> list:
    """Receivers' counters once every member got ``want`` more packets, or ``bound`` seconds passed."""
    deadline = time.monotonic() + bound
    while True:
        r = [_ask(p) for p in recvs]
        if all(x["packets"] >= want for x in r[:-1] or r) or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def run(args) -> dict:
    from ina.net import Topology
    me = [sys.executable, "-m", "experiments.bench_multicast"]
    with Topology(workers=args.workers + args.outsiders, rate=args.rate, mtu=args.mtu) as topo:
        members, outsiders = topo.workers[:args.workers], topo.workers[args.workers:]
        pipes = dict(stdin=-1, stdout=-1, stderr=-1, text=True, bufsize=1)
        recvs = [topo.popen(w, me + ["--role", "recv", "--ip", w.ip, "--port", str(PORT), "--group", GROUP], **pipes)
                 for w in members]
        recvs += [topo.popen(w, me + ["--role", "recv", "--ip", w.ip, "--port", str(PORT), "--group", ""], **pipes)
                  for w in outsiders]
        send = topo.popen(topo.switch, me + ["--role", "send", "--ip", topo.switch.ip, "--port", str(PORT),
                                             "--group", GROUP, "--workers-ips", ",".join(w.ip for w in members),
                                             "--rows", str(args.rows), "--size", str(args.size),
                                             "--bursts", str(args.bursts), "--interval", str(args.interval)], **pipes)
        for i, p in enumerate(recvs):
            _expect_ready(p, f"receiver {i}")
        info = _expect_ready(send, "sender")
        time.sleep(0.5)                     # IGMP reports of the joins reach the bridge
        per_mode = {"unicast": [], "multicast": []}
        order = ["unicast", "multicast"]
        for rep in range(args.reps):
            for mode in (order if rep % 2 == 0 else order[::-1]):
                r0, c0, m0 = [_ask(p) for p in recvs], topo.counters(), _machine_cpu()
                send.stdin.write(mode + "\n")
                send.stdin.flush()
                s = json.loads(send.stdout.readline())
                per = args.bursts * args.rows
                r1 = _settle(recvs, [x["packets"] + per for x in r0][0])
                c1, m1 = topo.counters(), _machine_cpu()
                got = [b["packets"] - a["packets"] for a, b in zip(r0, r1)]
                rx_cpu = sum(b["cpu_s"] - a["cpu_s"] for a, b in zip(r0[:args.workers], r1[:args.workers]))
                down = [c1[w.name].down_packets - c0[w.name].down_packets for w in members]
                out_down = [c1[w.name].down_packets - c0[w.name].down_packets for w in outsiders]
                per_mode[mode].append({
                    "sender_us_per_burst": s["cpu_ns"] / args.bursts / 1e3, "messages": s["messages"],
                    "receivers_us_per_packet": rx_cpu / max(1, sum(got[:args.workers])) * 1e6,
                    "machine_us_per_burst": (m1["busy_s"] - m0["busy_s"]) / args.bursts * 1e6,
                    "machine_softirq_us_per_burst": (m1["softirq_s"] - m0["softirq_s"]) / args.bursts * 1e6,
                    "received_per_member": got[:args.workers], "received_by_outsiders": got[args.workers:],
                    "member_download_packets": down, "outsider_download_packets": out_down,
                    "member_download_drops": [c1[w.name].down_drops - c0[w.name].down_drops for w in members]})
        for p in recvs + [send]:
            p.stdin.close()
            p.terminate()
    med = {}
    for mode, runs in per_mode.items():
        med[mode] = {k: float(np.median([r[k] for r in runs])) for k in
                     ("sender_us_per_burst", "receivers_us_per_packet", "machine_us_per_burst",
                      "machine_softirq_us_per_burst")}
    ratio = {k: med["multicast"][k] / med["unicast"][k] for k in med["unicast"] if med["unicast"][k]}
    return {"benchmark": "bench_multicast", "emulated": f"{args.workers} worker namespaces + {args.outsiders} "
            f"outsider(s), links {args.rate} (tbf), MTU {args.mtu}, Linux bridge with IGMP snooping", "gso": info["gso"],
            "workers": args.workers, "rows": args.rows, "size": args.size, "bursts": args.bursts,
            "interval_s": args.interval, "reps": args.reps, "load_average": os.getloadavg(),
            "median": med, "ratio_multicast_to_unicast": ratio, "runs": per_mode}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--outsiders", type=int, default=1, help="hosts that bind the port but join no group")
    ap.add_argument("--rate", default="1gbit", help="every worker link's rate (tbf), each direction")
    ap.add_argument("--rows", type=int, default=64, help="result datagrams per burst")
    ap.add_argument("--size", type=int, default=1044, help="bytes per datagram (nc at MTU 1500: 20 + 1024; the "
                    "sweep's MTU 9000: 8212, nc's 8192 or bfp32's 2048 elements)")
    ap.add_argument("--mtu", type=int, default=1500, help="the links' MTU (the sweep's: 9000)")
    ap.add_argument("--bursts", type=int, default=300)
    ap.add_argument("--interval", type=float, default=0.001, help="seconds between bursts (pacing)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--role", choices=("recv", "send"), help=argparse.SUPPRESS)
    ap.add_argument("--ip", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=PORT, help=argparse.SUPPRESS)
    ap.add_argument("--group", default=GROUP, help=argparse.SUPPRESS)
    ap.add_argument("--workers-ips", dest="workers_ips", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "recv":
        receiver(args)
        return 0
    if args.role == "send":
        sender(args)
        return 0
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{res['emulated']}; GSO {res['gso']}; {args.rows} x {args.size} B per burst; load {res['load_average']}")
    for mode, m in res["median"].items():
        print(f"{mode:>10}: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()))
    print("multicast / unicast: " + ", ".join(f"{k} {v:.2f}" for k, v in res["ratio_multicast_to_unicast"].items()))
    last = {m: r[-1] for m, r in res["runs"].items()}
    for mode, r in last.items():
        print(f"{mode:>10} (last rep): received {r['received_per_member']}, outsiders {r['received_by_outsiders']}, "
              f"member downloads {r['member_download_packets']}, outsider downloads {r['outsider_download_packets']}, "
              f"drops {r['member_download_drops']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
