"""A worker process for the switch tests: ``python tests/sw_worker.py SPEC.json``.

The spec names the switch port, rank, world size, job, Client options and a list of allreduce
ops (codec, shape, dtype, tensor kind, average, input distribution; see sw_harness.make_input).
The ops run ``loop`` times in order (loop 0: until an error, or until any rank sees ``stop_file``
after a pass: the ranks agree on stopping through a one-element allreduce).
Results go to an .npz (one float32 array per completed allreduce, in order), metadata (client
stats, the job's slot range, the error if any, timestamps) to a .json; one line per completed
allreduce to a .progress file.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sw_harness import make_input  # noqa: E402


def to_tensor(x32: np.ndarray, op: dict):
    dtype = op.get("dtype", "float32")
    if op.get("kind", "numpy") == "numpy":
        return x32.astype(dtype)          # float16/32/64 (bfloat16 only as torch)
    import torch
    if op.get("transpose"):      # a non-contiguous view with x32's values
        return torch.from_numpy(np.ascontiguousarray(x32.T)).to(getattr(torch, dtype)).T
    return torch.from_numpy(np.ascontiguousarray(x32)).to(getattr(torch, dtype))


def to_f32(t) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t.astype(np.float32)
    return t.detach().float().numpy().copy()


def wait_for_files(paths: list[str], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not all(Path(p).exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [p for p in paths if not Path(p).exists()]
            raise TimeoutError(f"{what}: {missing} did not appear within {timeout:g} s")
        time.sleep(0.005)      # polling files, bounded by the deadline above


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    from ina.client import AllreduceError, Client
    from ina.control import request
    meta = {"rank": spec["rank"], "error": None, "error_type": None}
    results = []
    progress = open(spec["progress"], "a")
    client = None
    try:
        if any(op.get("kind") == "torch" for op in spec["ops"]):
            # before the join: a rank importing torch after it (seconds of CPU, tens of seconds on a loaded
            # machine) kept its peers' first allreduce waiting that long, retransmitting on their timers
            import torch  # noqa: F401
        if spec.get("up"):             # join together once every rank of the job has started (imported)
            Path(spec["meta"].removesuffix(".json") + ".up").touch()
            wait_for_files(spec["up"], 120, "the other ranks to start")
        client = Client(("127.0.0.1", spec["port"]), rank=spec["rank"], world_size=spec["world_size"],
                        job=spec["job"], **spec["client"])
        meta["joined_at"] = time.time()
        meta["job_info"] = request("127.0.0.1", spec["port"], {"op": "stats"})["stats"]["jobs"].get(str(spec["job"]))
        modules_at_join = set(sys.modules)
        if spec.get("start_file"):     # a start line shared with other jobs (bounded wait)
            Path(spec["meta"] + ".joined").touch()
            wait_for_files([spec["start_file"]], 60, "the start line")
        ops = spec["ops"]
        loop = int(spec.get("loop", 1))
        it = 0
        while loop == 0 or it < loop:
            for op in ops:
                t = to_tensor(make_input(op, spec["rank"]), op)
                ret = client.allreduce(t, codec=op.get("codec", "bfp32"), average=bool(op.get("average", False)))
                assert ret is t, "allreduce must return the caller's tensor"
                if spec.get("keep_results", True):
                    results.append(to_f32(t))
                progress.write(f"{it} {time.time()}\n")
                done_ops = len(results) if spec.get("keep_results", True) else None
                if "imported_after_join" not in meta:       # between the join and the first result
                    meta["imported_after_join"] = sorted(set(sys.modules) - modules_at_join)
                if done_ops == spec.get("warmup_ops"):      # counters once the warm-up ops are done
                    meta["stats_after_warmup"] = client.stats.as_dict()
                progress.flush()
            it += 1
            if spec.get("stop_file"):    # stop together: the ranks agree through a one-element allreduce
                flag = np.array([1.0 if Path(spec["stop_file"]).exists() else 0.0], np.float32)
                client.allreduce(flag, codec="bfp32")
                if flag[0] > 0:
                    break
            if loop == 0 and it > 100000:
                break
    except AllreduceError as e:
        meta["error"], meta["error_type"] = str(e), "AllreduceError"
        meta["error_at"] = time.time()
    except Exception as e:  # noqa: BLE001 - reported to the test
        meta["error"], meta["error_type"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}", type(e).__name__
        meta["error_at"] = time.time()
    finally:
        if client is not None:
            meta["stats"] = client.stats.as_dict()
            meta["probe_timeout_s"] = client.probe_timeout(0.0)
            client.close()
    np.savez(spec["out"], **{f"r{i}": r for i, r in enumerate(results)})
    Path(spec["meta"]).write_text(json.dumps(meta))
    return 0 if meta["error"] is None else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
