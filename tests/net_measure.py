"""Transfers across emulated links, measured: used by tests/test_net.py and runnable as a sweep.

``python tests/net_measure.py [--json]`` measures how closely TCP and UDP transfers follow the
configured rate for several rates, MTUs and bucket sizes (the table in docs/links.md).
"""
from __future__ import annotations

import argparse
import json
import select
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAFFIC = str(HERE / "net_traffic.py")
PY = sys.executable


def read_line(stream, timeout: float, what: str) -> str:
    """One line from a child's pipe, waiting at most ``timeout`` seconds."""
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        raise AssertionError(f"no line within {timeout}s while waiting for {what}")
    return stream.readline()


def transfer(topo, proto, src, dst, nbytes, *, port=5001, pace=0.0, size=1472, timeout=60.0) -> dict:
    """Send ``nbytes`` from host ``src`` to host ``dst`` with real sockets inside their namespaces.

    Returns the receiver's measurement (goodput ``rate_bps``; for UDP also ``wire_rate_bps``),
    the sender's report, and per host the kernel counter deltas over the transfer.
    """
    recv = topo.popen(dst, [PY, TRAFFIC, f"{proto}-recv", "--port", str(port), "--timeout", str(timeout),
                            "--size", str(size)],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = read_line(recv.stdout, 15, f"{proto} receiver in {dst.name}")
        assert line.strip() == "READY", (line, recv.stderr.read() if recv.poll() is not None else "")
        c0 = topo.counters()
        send = topo.popen(src, [PY, TRAFFIC, f"{proto}-send", "--to", dst.ip, "--port", str(port),
                                "--bytes", str(nbytes), "--rate", str(pace), "--size", str(size),
                                "--timeout", str(timeout)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sout, serr = send.communicate(timeout=timeout)
        rout, rerr = recv.communicate(timeout=timeout)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.communicate()
    c1 = topo.counters()
    assert send.returncode == 0 and recv.returncode == 0, (sout, serr, rout, rerr)
    res = json.loads(rout.strip().splitlines()[-1])
    res["sender"] = json.loads(sout.strip().splitlines()[-1])
    for h in {src.name, dst.name}:
        res[h] = {k: getattr(c1[h], k) - getattr(c0[h], k) for k in c1[h].__dataclass_fields__ if k != "host"}
    if proto == "tcp":   # bytes on the wire: what the upload shaper charged, every frame with headers
        up = res[src.name]["up_bytes"] or res[src.name]["tx_bytes"]
        res["wire_rate_bps"] = res["rate_bps"] * up / res["bytes"]
    return res


def main(argv=None) -> int:
    from ina.net import Topology, format_rate, parse_rate
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rates", default="10mbit,100mbit,1gbit,2gbit,5gbit")
    p.add_argument("--mtus", default="1500,9000")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--burst-times", default="0.002", help="bucket sizes to compare, in seconds of tokens")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = []
    for mtu in [int(m) for m in a.mtus.split(",")]:
        for bt in [float(b) for b in a.burst_times.split(",")]:
            for rate in a.rates.split(","):
                bps = parse_rate(rate)
                with Topology(workers=2, rate=rate, mtu=mtu, burst_time=bt) as topo:
                    w0, w1 = topo.workers
                    size = mtu - 28
                    n = int(bps / 8 * a.seconds)
                    for label, proto, src, dst, pace in (("tcp w0->w1", "tcp", w0, w1, 0.0),
                                                          ("udp w0->sw (upload)", "udp", w0, topo.switch, 0.0),
                                                          ("udp sw->w1 (download, 1.25x)", "udp", topo.switch, w1, 1.25 * bps)):
                        res = transfer(topo, proto, src, dst, int(n * (1.25 if pace else 1)), pace=pace, size=size)
                        row = {"rate": format_rate(bps), "mtu": mtu, "burst_time": bt, "flow": label,
                               "goodput": res["rate_bps"] / bps, "wire": res["wire_rate_bps"] / bps,
                               "seconds": res["seconds"]}
                        rows.append(row)
                        print(f"[sweep] mtu {mtu} burst {bt * 1e3:g}ms {row['rate']:>7} {label:30s} "
                              f"wire {row['wire']:.4f} goodput {row['goodput']:.4f}", file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print("| rate | MTU | bucket | flow | on the wire / rate | goodput / rate |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['rate']} | {r['mtu']} | {r['burst_time'] * 1e3:g} ms | {r['flow']} | "
                  f"{r['wire']:.3f} | {r['goodput']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
