"""Where a process's CPU goes, per thread: time on a core and time runnable but waiting for one.

Linux keeps, per thread, ``/proc/<pid>/task/<tid>/schedstat``: nanoseconds run on a CPU, nanoseconds spent
runnable on a run queue (waiting for a core another thread held) and the number of time slices. On a
machine with fewer cores than busy threads the second number says how much a thread was held back by the
others: the measure of contention for the cores that wall-clock step times mix in with the work itself.

    before = snapshot()            # this process (or snapshot(pid) for another one)
    ...
    per_thread = since(before)     # {label: {"run_s", "wait_s", "slices", "threads"}}

Threads are labelled by their Python name where the thread is a Python thread of this process (the
main thread is ``MainThread``), else by the kernel's name (``comm``: C++ threads of torch, Gloo, Horovod
share the process's name); threads of one label are added up.
"""
from __future__ import annotations

import os
import threading


def _read(pid: int | str) -> dict[int, tuple[str, int, int, int]]:
    out = {}
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                run, wait, slices = (int(x) for x in f.read().split()[:3])
            with open(f"{base}/{tid}/comm") as f:
                comm = f.read().strip()
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue          # the thread ended meanwhile
        out[int(tid)] = (comm, run, wait, slices)
    return out


def _labels(pid: int | str) -> dict[int, str]:
    if pid != "self" and pid != os.getpid():
        return {}
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def snapshot(pid: int | str = "self") -> dict:
    """Every thread's counters now."""
    return {"pid": pid, "threads": _read(pid), "labels": _labels(pid)}


def since(before: dict) -> dict[str, dict]:
    """Per label: seconds run and seconds waiting for a core since ``before``, time slices, thread count. A
    thread started after the snapshot counts from zero; one that ended meanwhile is not counted."""
    now = _read(before["pid"])
    labels = {**before["labels"], **_labels(before["pid"])}
    out: dict[str, dict] = {}
    for tid, (comm, run, wait, slices) in now.items():
        _, run0, wait0, slices0 = before["threads"].get(tid, (comm, 0, 0, 0))
        d = out.setdefault(labels.get(tid, comm), {"run_s": 0.0, "wait_s": 0.0, "slices": 0, "threads": 0})
        d["run_s"] += (run - run0) / 1e9
        d["wait_s"] += (wait - wait0) / 1e9
        d["slices"] += slices - slices0
        d["threads"] += 1
    return out


def per_step(totals: dict[str, dict], steps: int, min_run_s: float = 0.0) -> dict[str, dict]:
    """``totals`` divided by ``steps`` (labels that ran less than ``min_run_s`` per step left out)."""
    return {k: {"run_s": v["run_s"] / steps, "wait_s": v["wait_s"] / steps, "slices": v["slices"] / steps,
                "threads": v["threads"]}
            for k, v in sorted(totals.items(), key=lambda kv: -kv[1]["run_s"]) if v["run_s"] / steps >= min_run_s}
