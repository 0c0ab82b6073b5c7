"""A worker of the multicast tests, run inside an emulated host: ``python tests/mc_worker.py SPEC_JSON OUT``.

SPEC: switch ip and port, rank, world size, job, codec, the input op (sw_harness.make_input), allreduces
to run; ``leave_group``: after the join, leave the job's multicast group (the host then drops the results
multicast to it: lost); ``hold``: say "joined" after the join and "done" after the allreduces on stdout,
and wait for a line on stdin after each. OUT (.npz): the last result; OUT.json: the client's stats, whether
the switch multicasts its results, the seconds of each allreduce and how many of its results came as
replays of resends, the datagrams the kernel dropped at the data socket.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sw_harness import make_input  # noqa: E402


def _hold(spec: dict, step: str) -> None:
    """With ``hold``: say ``step`` on stdout and wait for a line on stdin (the test's go-ahead)."""
    if spec.get("hold"):
        print(step, flush=True)
        sys.stdin.readline()


def main(spec_json: str, out: str) -> int:
    from ina.client import Client
    from ina.multicast import socket_drops
    spec = json.loads(spec_json)
    x = make_input(spec["op"], spec["rank"])
    with Client((spec["ip"], spec["port"]), rank=spec["rank"], world_size=spec["world"], job=spec["job"],
                timeout=60.0, **spec.get("client", {})) as cl:
        if spec.get("leave_group") and cl.multicast:     # this host no longer takes the job's group: results lost
            import socket
            from ina.wire import multicast_group
            local = socket.inet_aton(cl.ctl.sock.getsockname()[0])
            cl.sock.setsockopt(socket.IPPROTO_IP, socket.IP_DROP_MEMBERSHIP,
                               socket.inet_aton(multicast_group(spec["job"], cl.ctl.sock.getpeername())[0]) + local)
        _hold(spec, "joined")
        seconds, replayed = [], []
        for _ in range(spec.get("repeat", 1)):
            y = x.copy()
            t = time.perf_counter()
            cl.allreduce(y, codec=spec["codec"])
            seconds.append(time.perf_counter() - t)
            s = cl.stats
            replayed.append(s.fast_replayed + s.probe_replayed + s.timeout_replayed - sum(replayed))
        _hold(spec, "done")
        meta = {"multicast": cl.multicast, "stats": asdict(cl.stats), "seconds": seconds, "replayed": replayed,
                "socket_drops": socket_drops(cl.sock)}
    np.savez(out, result=y)
    Path(out + ".json").write_text(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
