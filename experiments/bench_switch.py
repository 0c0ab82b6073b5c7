"""The switch's data-plane stages (parse, aggregate, harvest) on prepared bursts, without sockets.

    python -m experiments.bench_switch            # table
    python -m experiments.bench_switch --json

A switch is built in this process (``Switch`` on an ephemeral port that no traffic reaches); one
job is installed and bursts of DATA packets written straight into its receive ring, then the three
kernel stages run as ``Switch.poll_once`` runs them. Only the stage calls are timed; rewriting the
headers for the next round is not. Scenarios:

* ``nc8``:   4 workers, 64-packet bursts of 8192 one-byte natural-compression codes (re-encoded results);
* ``int32``: 4 workers, 64-packet bursts of 8192 int32 codes (block floating point's payload, raw sums);
* ``small``: 2 workers, 1-packet bursts of 256 codes: the fixed cost per burst (kernel dispatch).

The reference, measured in the same run, is numpy adding the same number of int64 values into a
register row (``np.add(row, vals, out=row)``) per packet: ``x numpy`` is the stages' time over it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ina.wire import HEADER_SIZE, MsgType, PayloadType, header_view, pack
from switch_model.dataplane import source_key
from switch_model.pipeline import Switch, SwitchConfig

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
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or n_bursts < 10:
            for i in range(burst):                     # the next round's headers (not timed)
                c = chunk + i // workers if burst >= workers else chunk
                hdr[i]["chunk"] = c
                hdr[i]["slot"] = (c % slots) | (((c // slots) & 1) << 15)
                hdr[i]["rank"] = i % workers if burst >= workers else n_bursts % workers
            sw.rx.buf[:burst, :HEADER_SIZE] = hdr.view(np.uint8).reshape(burst, HEADER_SIZE)
            t = time.perf_counter()
            sw.stage_parse(sw.rx.buf, sw.rx.lens, burst)
            sw.stage_aggregate(sw.rx.buf, burst)
            sw.stage_harvest(burst)
            busy += time.perf_counter() - t
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
                "x_numpy": round(ns / (ref * 1e9), 2)}
    finally:
        sw.sock.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per scenario")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = {name: run_scenario(*SCENARIOS[name], a.seconds) for name in a.scenarios}
    if a.json:
        print(json.dumps({"benchmark": "switch_stages", "reference": "numpy int64 add of the same elements per packet",
                          "results": rows}, indent=2))
    else:
        print(f"{'scenario':<8} {'ns/packet':>10} {'ns/burst':>10} {'M elem/s':>9} {'x numpy':>8}")
        for name, r in rows.items():
            print(f"{name:<8} {r['ns_per_packet']:>10.0f} {r['ns_per_burst']:>10.0f} {r['m_elements_per_s']:>9.0f} "
                  f"{r['x_numpy']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
