"""A worker that ends the way scripts do: ``python tests/exit_worker.py PORT RANK N JOB OPS MODE OUT``.

It joins job JOB without ``with``, runs OPS bfp32 allreduces of sw_harness inputs (seeds 900 + i, 1000
elements), writes its results to OUT (json), and then, by MODE:
  exit   returns from main without close(): the interpreter exits (the client must leave by itself);
  hard   os._exit(0) without close(): the control connection just closes (what a crash looks like);
  close  calls close() after OPS - 1 allreduces (the others then wait for it in their last one);
  hard-early  os._exit(0) after OPS - 1 allreduces.
An AllreduceError is written to OUT and the exit code is 3.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sw_harness import make_input  # noqa: E402

CLIENT = {"elements": 64, "slots": 8, "timeout": 30.0}      # the default retransmission timeouts; a no-progress
# timeout with room for a loaded machine (10 s: a rank not scheduled for 10 s made another time out)


def op(i: int) -> dict:
    return {"codec": "bfp32", "shape": [1000], "seed": 900 + i}


def main() -> int:
    port, rank, n, job, ops = (int(a) for a in sys.argv[1:6])
    mode, out = sys.argv[6], Path(sys.argv[7])
    from ina.client import AllreduceError, Client
    cl = Client(("127.0.0.1", port), rank=rank, world_size=n, job=job,
                **{**CLIENT, "timeout": float(os.environ.get("EXIT_WORKER_TIMEOUT", CLIENT["timeout"]))})
    res = {"results": [], "error": None}
    try:
        for i in range(ops - 1 if mode in ("close", "hard-early") else ops):
            x = make_input(op(i), rank)
            cl.allreduce(x, codec="bfp32")
            res["results"].append(x.tolist())
    except AllreduceError as e:
        res["error"] = str(e)
    out.write_text(json.dumps(res))
    if mode.startswith("hard"):
        os._exit(3 if res["error"] else 0)
    if mode == "close":
        cl.close()
    return 3 if res["error"] else 0       # mode "exit": no close(), the interpreter exits


if __name__ == "__main__":
    sys.exit(main())
