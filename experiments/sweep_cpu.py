"""The CPU floor of an allreduce row: does the row measure the emulated link, or this machine's CPU?

The rule, in this one place (:func:`cpu_floor` computes it, :func:`cpu_bound` applies it; the
sweep's records, CSV, report and plots, and ``--dilation auto``'s probe all use these two):

    job CPU   = n x worker_cpu_per_allreduce + the switch's CPU per allreduce
                (the workers' process CPU over their timed allreduces, os.times: every thread, Gloo's
                included; the switch's: the larger of its processes' CPU, ``process_cpu_ns``: every
                thread of every shard's process and of the host aggregator's, control plane included,
                and its data planes' ``busy_cpu_ns``, each over the timed part / repetitions; which
                one is ``switch_cpu_source``. Only for the methods the switch serves (``ina:``): the
                switch idles through a Gloo row, and that is not the row's CPU)
    cpu_floor = job CPU / cores / K    (cores: os.sched_getaffinity of the launcher, recorded as
                                        ``cpu_cores``; K: the dilation factor, as CPU seconds are real)
    cpu_floor_ratio = cpu_floor / ideal_time
    cpu_floor_share = cpu_floor / time_median   (= cpu_floor_ratio / time/ideal)

A row is **CPU-bound** when ``cpu_floor_share >= CPU_BOUND_SHARE`` (0.5) or ``cpu_floor_ratio >= 1``.

Why half: the floor is the time the cores need if the job's CPU were spread perfectly over all of
them with nothing else running, so a share of 0.5 means the job's own processes kept every core busy
for at least half the measured time. Every packet of a link-paced allreduce needs a worker or the
switch to be scheduled the moment it arrives; at that utilisation a wake-up finds the cores taken
about as often as free, and the CPU explains at least as much of the time as the link does: the
row's time/ideal no longer says what the link costs. Why also a ratio of 1: on a loaded machine
(other programs on the same cores) the measured time grows and the share falls, yet a floor at or
above the link-bound ideal means the link's pace is out of this machine's reach whatever else ran.

The floor is derived, not measured: a bound computed from measured CPU seconds. It is a lower
bound of the CPU's share: it leaves out the kernel's work on the emulated links that is not charged
to these processes (softirq: tbf, veth, the bridge), and assumes perfect spreading over the cores.
Records from before the switch reported its processes' CPU have the data plane's busy CPU alone
(``switch_cpu_source`` "data plane"), which leaves out the control plane and the host aggregator.

What to do with a CPU-bound row: time dilation (experiments/dilation.py) shapes the links at
rate/K and divides the times by K but not the CPU seconds, so the floor's ratio to the ideal falls
by up to K. :func:`min_dilation` gives the smallest K at which the floor measured here
would be under ``CPU_BOUND_SHARE`` of the ideal: a lower bound, necessary and not sufficient. The CPU
per allreduce grows at slower shaped rates (packets arrive one by one, a wake-up and a system call
each: 8 workers' nc took 5-6x the CPU at 1 Gbit/s dilated x64 as in real time), and per-chunk
wake-ups on shared cores cost real time beyond the CPU (docs/performance.md, "Time dilation").
``--dilation auto`` measures instead and refuses a K whose run is CPU-bound by this rule.
"""
from __future__ import annotations

import math
import os

#: a row whose CPU floor is at least this share of its measured time is CPU-bound (module docstring)
CPU_BOUND_SHARE = 0.5
#: ... and so is a row whose CPU floor is at least this multiple of its link-bound ideal
CPU_BOUND_RATIO = 1.0

#: the fields :func:`add_cpu_floor` writes into a record
FIELDS = ("job_cpu_per_allreduce", "switch_cpu_per_allreduce", "switch_cpu_source", "cpu_floor", "cpu_floor_ratio",
          "cpu_floor_share", "cpu_bound", "cpu_bound_min_dilation")

#: the rule in one sentence, for the report under its table and the terminal's notes
RULE = (f"CPU floor = the job's measured CPU per allreduce (every worker's process CPU + the switch's: its "
        f"processes' CPU, or its data plane's busy CPU if that is larger) / the cores available / the dilation "
        f"factor K: the least time this machine's cores need for it, a bound derived from measured CPU seconds "
        f"(a lower bound: kernel softirq work on the links is not counted), not a measured time. A row is CPU-bound "
        f"when its floor is at least {CPU_BOUND_SHARE:g} of its measured time (its own processes kept every "
        f"core busy at least half the time: the CPU explains as much of the time as the link) or at least "
        f"{CPU_BOUND_RATIO:g}x its link-bound ideal (the link's pace is out of this machine's reach); its "
        f"time/ideal measures the emulator's CPU, not the link.")


#: the rule in a few words, for the terminal's notes and the plots' legends
SHORT_RULE = (f"the processes' measured CPU per allreduce over the cores is at least {CPU_BOUND_SHARE:g} of the "
              f"time or {CPU_BOUND_RATIO:g}x the ideal")


def cpu_cores() -> int:
    """The cores this process (and the workers and switch it starts, which inherit its affinity) may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:              # not Linux
        return os.cpu_count() or 1


def cpu_floor(rec: dict) -> dict:
    """The CPU floor of an allreduce record from its measured figures (module docstring), as the
    fields of :data:`FIELDS`; {} for a record without them (other workloads, records from before
    ``cpu_cores`` was recorded)."""
    if rec.get("workload") != "allreduce" or rec.get("worker_cpu_per_allreduce") is None or not rec.get("cpu_cores"):
        return {}
    k = rec.get("dilation") or 1
    switch, source = switch_cpu(rec)
    job = rec["workers"] * rec["worker_cpu_per_allreduce"] + switch
    floor = job / rec["cpu_cores"] / k
    ideal, t = rec.get("ideal_time"), rec.get("time_median")
    ratio = floor / ideal if ideal else None
    share = floor / t if t else None
    out = {"job_cpu_per_allreduce": job, "switch_cpu_per_allreduce": switch, "switch_cpu_source": source,
           "cpu_floor": floor, "cpu_floor_ratio": ratio, "cpu_floor_share": share}
    out["cpu_bound"] = cpu_bound(out)
    out["cpu_bound_min_dilation"] = min_dilation(ratio, k) if out["cpu_bound"] else None
    return out


def switch_cpu(rec: dict) -> tuple[float, str]:
    """(the switch's CPU seconds per allreduce, where they were read: "processes" or "data plane"): for an
    ``ina:`` method the larger of its processes' CPU (``process_cpu_ns``) and its data planes' busy CPU
    (the processes' includes it, but a record may lack them); for other methods the data planes' busy CPU
    alone (the switch idles through them)."""
    c, reps = rec.get("switch_counters") or {}, rec["reps"]
    busy = c.get("busy_cpu_ns", 0) / 1e9 / reps
    procs = c.get("process_cpu_ns")
    if procs is None or not str(rec.get("method", "")).startswith("ina:") or procs / 1e9 / reps <= busy:
        return busy, "data plane"
    return procs / 1e9 / reps, "processes"


def cpu_bound(fl: dict) -> bool | None:
    """The rule: CPU-bound if the floor is >= CPU_BOUND_SHARE of the measured time or >= CPU_BOUND_RATIO x
    the ideal (None: not known). ``fl``: :func:`cpu_floor`'s fields (or a record that has them)."""
    share, ratio = fl.get("cpu_floor_share"), fl.get("cpu_floor_ratio")
    if share is None and ratio is None:
        return None
    return (share is not None and share >= CPU_BOUND_SHARE) or (ratio is not None and ratio >= CPU_BOUND_RATIO)


def min_dilation(ratio: float | None, k: float = 1.0) -> int | None:
    """The smallest whole dilation factor K' > k at which a floor of ``ratio`` x the ideal measured at
    dilation ``k`` would be under CPU_BOUND_SHARE of the ideal (the CPU seconds stay, the ideal's real
    time grows K'/k-fold): a lower bound for the K a CPU-bound row needs."""
    if ratio is None:
        return None
    return max(math.floor(k) + 1, math.floor(k * ratio / CPU_BOUND_SHARE) + 1)


def add_cpu_floor(rec: dict) -> dict:
    """Write (or rewrite, under the current rule) the CPU floor's fields into ``rec``; returns it."""
    for f in FIELDS:
        rec.pop(f, None)
    rec.update(cpu_floor(rec))
    real = rec.get("real_seconds_fields")        # dilated: the job's CPU seconds are real, the floor is / K
    if real is not None and "job_cpu_per_allreduce" in rec and "job_cpu_per_allreduce" not in real:
        real.append("job_cpu_per_allreduce")
    return rec


def describe(rec: dict) -> str:
    """The report's cell: '**yes** 0.78 (K >= 5)', 'no 0.12' or '–' (share of the measured time)."""
    if rec.get("cpu_bound") is None:
        return "–"
    share = rec.get("cpu_floor_share")
    s = "–" if share is None else f"{share:.2f}"
    if rec["cpu_bound"]:
        return f"**yes** {s}" + (f" (K >= {rec['cpu_bound_min_dilation']})" if rec.get("cpu_bound_min_dilation") else "")
    return f"no {s}"
