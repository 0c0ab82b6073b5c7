"""The switch's data-plane stages (parse, aggregate, harvest) on prepared bursts, without sockets.

    python -m experiments.bench_switch            # table
    python -m experiments.bench_switch --json

A switch is built in this process (``Switch`` on an ephemeral port that no traffic reaches); one
job is installed and bursts of DATA packets written straight into its receive ring, then the three
kernel stages run as ``Switch.poll_once`` runs them. Only the stage calls are timed; rewriting the
headers for the next round is not (``ns_per_packet``: wall time; ``stage_cpu_us_p10`` / ``_median``:
each stage's thread CPU per burst, the figure to compare on a loaded machine). Scenarios:

* ``nc8``:   4 workers, 64-packet bursts of 8192 one-byte natural-compression codes (re-encoded results);
* ``int32``: 4 workers, 64-packet bursts of 8192 int32 codes (block floating point's payload, raw sums);
* ``small``: 2 workers, 1-packet bursts of 256 codes: the fixed cost per burst (kernel dispatch).

``--poll`` times the whole ``Switch.poll_once`` instead (every stage: recvmmsg, the Python around
the kernels, the kernels, the multicast's sendmmsg), with real loopback sockets: W worker sockets
in this process send one packet each per chunk (not timed), the switch's thread CPU time per burst
is measured around ``poll_once``, then the workers' sockets are drained (not timed). On loopback
the sender's ``sendmmsg`` runs the receivers' UDP receive path too, as it does in an allreduce.
Scenarios ``poll4`` / ``poll8`` (4 / 8 workers, 16 / 8 chunks of 8192 NC codes per burst: 64
packets in, 64 results out per worker), ``poll-small`` (2 workers, one 256-element chunk per
burst: the fixed cost of a burst) and ``poll8-replay`` (poll8 plus one retransmission per burst,
answered by a replay).

The reference, measured in the same run, is numpy adding the same number of int64 values into a
register row (``np.add(row, vals, out=row)``) per packet: ``x numpy`` is the stages' time over it.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time

import numpy as np

from ina import burst as B
from ina.wire import HEADER_SIZE, Flag, MsgType, PayloadType, header_view, max_packet_size, pack, slot_field
from switch_model.dataplane import source_key
from switch_model.pipeline import Switch, SwitchConfig

KERNEL_STAGES = ("parse", "aggregate", "harvest")
SCENARIOS = {   # name: (payload type, workers, packets per burst, elements per packet)
    "nc8": (PayloadType.NC8, 4, 64, 8192),
    "int32": (PayloadType.INT32, 4, 64, 8192),
    "small": (PayloadType.NC8, 2, 1, 256),
}


def _payload(ptype, elements: int, rng) -> np.ndarray:
    if ptype == PayloadType.NC8:
        return (rng.integers(1, 20, elements) | (rng.integers(0, 2, elements) << 7)).astype(np.uint8)
    return rng.integers(-2**20, 2**20, elements).astype(np.int32)


def run_scenario(ptype, workers: int, burst: int, elements: int, seconds: float) -> dict:
    slots = 64
    sw = Switch(SwitchConfig(host="127.0.0.1", port=0, slots=slots, elements=elements, burst=max(burst, 1),
                             sram_mb=512))
    try:
        sw.install_job(1, workers, slots, elements, ptype != PayloadType.NC8, [("127.0.0.1", 9)] * workers)
        sw.state.src[:] = source_key(0x7F000001, 9)                   # every packet from the joined address
        rng = np.random.default_rng(0)
        pkts = [pack(msg_type=MsgType.DATA, job=1, rank=i % workers, payload_type=ptype, count=elements,
                     payload=_payload(ptype, elements, rng), elements=elements) for i in range(burst)]
        size = len(pkts[0])
        for i, p in enumerate(pkts):
            sw.rx.buf[i, :size] = np.frombuffer(p, np.uint8)
            sw.rx.lens[i] = size
        hdr = header_view(sw.rx.buf[:burst, :HEADER_SIZE].copy())
        per_burst = max(1, burst // workers)          # chunks completed per burst
        chunk, n_bursts, busy = 0, 0, 0.0
        stage_cpu = {name: [] for name in KERNEL_STAGES}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or n_bursts < 10:
            for i in range(burst):                     # the next round's headers (not timed)
                c = chunk + i // workers if burst >= workers else chunk
                hdr[i]["chunk"] = c
                hdr[i]["slot"] = (c % slots) | (((c // slots) & 1) << 15)
                hdr[i]["rank"] = i % workers if burst >= workers else n_bursts % workers
            sw.rx.buf[:burst, :HEADER_SIZE] = hdr.view(np.uint8).reshape(burst, HEADER_SIZE)
            t, c0 = time.perf_counter(), time.thread_time_ns()
            sw.stage_parse(sw.rx.buf, sw.rx.lens, burst)
            c1 = time.thread_time_ns()
            sw.stage_aggregate(sw.rx.buf, burst)
            c2 = time.thread_time_ns()
            sw.stage_harvest(sw.rx.buf, burst)
            c3 = time.thread_time_ns()
            busy += time.perf_counter() - t
            for name, ns in zip(KERNEL_STAGES, (c1 - c0, c2 - c1, c3 - c2)):
                stage_cpu[name].append(ns)
            n_bursts += 1
            if burst >= workers:
                chunk += per_burst
            elif n_bursts % workers == 0:
                chunk += 1
        st = sw.stats()
        assert st["counters"]["parsed_ok"] == n_bursts * burst, st["drops"]
        assert st["counters"]["harvested"] == n_bursts * burst // workers
        row = np.zeros(elements, np.int64)
        vals = np.ones(elements, np.int64)
        reps = 2000
        t = time.perf_counter()
        for _ in range(reps):
            np.add(row, vals, out=row)
        ref = (time.perf_counter() - t) / reps
        ns = busy / (n_bursts * burst) * 1e9
        return {"payload_type": ptype.name, "workers": workers, "burst": burst, "elements": elements,
                "bursts": n_bursts, "ns_per_packet": round(ns, 1), "ns_per_burst": round(ns * burst, 1),
                "m_elements_per_s": round(elements / ns * 1e3, 1), "numpy_add_ns_per_packet": round(ref * 1e9, 1),
                "x_numpy": round(ns / (ref * 1e9), 2),
                # thread CPU per burst of each stage, p10 and median (on a shared machine the low
                # percentiles are the least disturbed)
                "stage_cpu_us_p10": {k: round(float(np.percentile(v, 10)) / 1e3, 1) for k, v in stage_cpu.items()},
                "stage_cpu_us_median": {k: round(float(np.median(v)) / 1e3, 1) for k, v in stage_cpu.items()}}
    finally:
        sw.sock.close()


POLL_SCENARIOS = {   # name: (workers, chunks per burst, elements per packet)
    "poll4": (4, 16, 8192),
    "poll8": (8, 8, 8192),
    "poll-small": (2, 1, 256),
    "poll8-replay": (8, 8, 8192, True),
}


def run_poll(workers: int, chunks: int, elements: int, seconds: float, replay: bool = False) -> dict:
    """Thread CPU and wall time of ``Switch.poll_once`` per burst, real loopback sockets both ways.
    ``replay``: each burst also carries rank 0's retransmission of the previous burst's last chunk
    (answered by a unicast replay), as in a burst after a spurious timeout."""
    slots = 64
    sw = Switch(SwitchConfig(host="127.0.0.1", port=0, slots=slots, elements=elements, burst=64, sram_mb=512))
    socks = [B.udp_socket("127.0.0.1", 0) for _ in range(workers)]
    try:
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.setblocking(False)
        sw.install_job(1, workers, slots, elements, False, [s.getsockname() for s in socks])
        rings = [B.RxRing(s, 64, max_packet_size(elements)) for s in socks]
        payload = _payload(PayloadType.NC8, elements, np.random.default_rng(0))
        pkts = {r: pack(msg_type=MsgType.DATA, job=1, rank=r, payload_type=PayloadType.NC8, count=elements,
                        payload=payload, elements=elements) for r in range(workers)}
        frames = {r: bytearray(p) for r, p in pkts.items()}
        dst = ("127.0.0.1", sw.port)
        chunk, n_bursts, cpu, wall, got = 0, 0, 0, 0, 0
        warm = 4 * slots                                # two passes over both sets of every slot, untimed
        per_burst = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or n_bursts < 10:
            burst = [(c, r, 0) for c in range(chunk, chunk + chunks) for r in range(workers)]
            if replay and chunk:
                burst.append((chunk - 1, 0, int(Flag.RETRANSMIT)))
            for c, r, flags in burst:                   # this burst's packets (not timed)
                h = header_view(np.frombuffer(frames[r], np.uint8)[None, :])
                h["chunk"], h["flags"] = c, flags
                h["slot"] = slot_field(c % slots, (c // slots) & 1)
                socks[r].sendto(frames[r], dst)
            t, c0 = time.perf_counter_ns(), time.thread_time_ns()
            n = 0
            while n < len(burst):
                k = sw.poll_once()
                if not k:
                    raise RuntimeError(f"the switch received {n} of {len(burst)} packets of a burst")
                n += k
            if chunk >= warm:                          # the first pass over the pool touches fresh pages
                per_burst.append(time.thread_time_ns() - c0)
                cpu += per_burst[-1]
                wall += time.perf_counter_ns() - t
                n_bursts += 1
            for ring in rings:                          # drain the results (not timed)
                while ring.recv(wait=False):
                    got += 1
            chunk += chunks
        st = sw.stats()
        assert st["counters"]["harvested"] == chunk, (st["counters"], st["drops"])
        return {"workers": workers, "chunks_per_burst": chunks, "elements": elements, "bursts": n_bursts,
                "cpu_us_per_burst": round(cpu / n_bursts / 1e3, 1), "wall_us_per_burst": round(wall / n_bursts / 1e3, 1),
                # on a shared machine the low percentiles are the least disturbed
                "cpu_us_p10": round(float(np.percentile(per_burst, 10)) / 1e3, 1),
                "cpu_us_median": round(float(np.median(per_burst)) / 1e3, 1),
                "cpu_us_per_packet_in": round(cpu / n_bursts / (chunks * workers) / 1e3, 2),
                "tx_messages_per_burst": round(st["counters"]["tx_messages"] / (chunk // chunks), 1),
                "stage_us_per_burst": {k: round(v / (chunk // chunks) / 1e3, 1)
                                       for k, v in st["timing"]["stage_ns"].items()}}
    finally:
        sw.sock.close()
        for s in socks:
            s.close()


def _print(rows: dict, record: dict, as_json: bool, header: str, line) -> None:
    """The results as JSON (``record`` plus the rows) or as a table (``header``, ``line(name, row)``)."""
    if as_json:
        print(json.dumps({**record, "results": rows}, indent=2))
        return
    print(header)
    for name, r in rows.items():
        print(line(name, r))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per scenario")
    ap.add_argument("--poll", action="store_true", help="time the whole poll loop with real sockets (scenarios "
                    + ", ".join(POLL_SCENARIOS) + ")")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.poll:
        _print({name: run_poll(*sc[:3], a.seconds, *sc[3:]) for name, sc in POLL_SCENARIOS.items()},
               {"benchmark": "switch_poll_loop"}, a.json,
               f"{'scenario':<11} {'CPU us/burst':>12} {'p10':>7} {'median':>7} {'wall us/burst':>13} {'CPU us/pkt in':>13} "
               f"{'tx msgs':>8}",
               lambda name, r: f"{name:<11} {r['cpu_us_per_burst']:>12.1f} {r['cpu_us_p10']:>7.1f} "
                               f"{r['cpu_us_median']:>7.1f} {r['wall_us_per_burst']:>13.1f} "
                               f"{r['cpu_us_per_packet_in']:>13.2f} {r['tx_messages_per_burst']:>8.1f}")
        return 0
    _print({name: run_scenario(*SCENARIOS[name], a.seconds) for name in a.scenarios},
           {"benchmark": "switch_stages", "reference": "numpy int64 add of the same elements per packet"}, a.json,
           f"{'scenario':<8} {'ns/packet':>10} {'ns/burst':>10} {'M elem/s':>9} {'x numpy':>8}",
           lambda name, r: f"{name:<8} {r['ns_per_packet']:>10.0f} {r['ns_per_burst']:>10.0f} "
                           f"{r['m_elements_per_s']:>9.0f} {r['x_numpy']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
