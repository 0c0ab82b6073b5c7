"""The CPU floor of an allreduce row: does the row measure the emulated link, or this machine's CPU?

The rule, in this one place (:func:`cpu_floor` computes the floor, :func:`verdict` applies the rule and
:func:`cpu_bound` is its yes/no; the sweep's records, CSV, report and plots, and ``--dilation auto``'s
probe all use these):

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

A row is **CPU-bound** when ``cpu_floor_ratio >= CPU_BOUND_RATIO`` (1), or when
``cpu_floor_share >= CPU_BOUND_SHARE`` (0.5) and the row is measurably above its ideal: time/ideal
(= ratio / share) at least ``CPU_BOUND_ABOVE_IDEAL`` (1.1); an unshaped row (no ideal) by its share
alone. A row whose share is at least 0.5 but whose time is within 1.1x its ideal is **CPU-tight**,
not CPU-bound: the link set its pace and its time/ideal measures the link, but a slightly slower (or
busier) machine would make it CPU-bound. :func:`verdict` holds the rule ("bound", "tight", "no").

Why half: the floor is the time the cores need if the job's CPU were spread perfectly over all of
them with nothing else running, so a share of 0.5 means the job's own processes kept every core busy
for at least half the measured time. Every packet of a link-paced allreduce needs a worker or the
switch to be scheduled the moment it arrives; at that utilisation a wake-up finds the cores taken
about as often as free, and where the row is also above its ideal the CPU explains as much of the
excess as the link does. Why the margin: a row at its ideal kept the link's pace whatever its share
(a stored CI sweep, 425k elements, 2 cores: 2 workers at 1 Gbit/s at 1.01-1.09x their ideal with
shares 0.72-0.85), and rows whose cores were nearly idle (share under 0.15) measure 0.96-1.11x their
ideal here (the per-allreduce start and the last round trip; that sweep and docs/performance.md's
table), so 1.1 is where a row starts to be measurably slower than its link. Why also a ratio of
1: on a loaded machine (other programs on the same cores) the measured time grows and the share
falls, yet a floor at or above the link-bound ideal means the link's pace is out of this machine's
reach whatever else ran.

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
#: ... the share makes a shaped row CPU-bound only when its time/ideal is at least this (else: CPU-tight)
CPU_BOUND_ABOVE_IDEAL = 1.1

#: the fields :func:`add_cpu_floor` writes into a record
FIELDS = ("job_cpu_per_allreduce", "switch_cpu_per_allreduce", "switch_cpu_source", "cpu_floor", "cpu_floor_ratio",
          "cpu_floor_share", "cpu_bound", "cpu_tight", "cpu_bound_min_dilation")

#: the rule in one sentence, for the report under its table and the terminal's notes
RULE = (f"CPU floor = the job's measured CPU per allreduce (every worker's process CPU + the switch's: its "
        f"processes' CPU, or its data plane's busy CPU if that is larger) / the cores available / the dilation "
        f"factor K: the least time this machine's cores need for it, a bound derived from measured CPU seconds "
        f"(a lower bound: kernel softirq work on the links is not counted), not a measured time. A row is CPU-bound "
        f"when its floor is at least {CPU_BOUND_RATIO:g}x its link-bound ideal (the link's pace is out of this "
        f"machine's reach), or at least {CPU_BOUND_SHARE:g} of its measured time (its own processes kept every core "
        f"busy at least half the time) while the row is at least {CPU_BOUND_ABOVE_IDEAL:g}x its ideal (measurably "
        f"slower than its link; an unshaped row: the share alone); its time/ideal measures the emulator's CPU, not "
        f"the link. A row with that share but within {CPU_BOUND_ABOVE_IDEAL:g}x its ideal is CPU-tight: the link "
        f"set its pace, with little CPU to spare (a slightly slower machine would make it CPU-bound).")


#: the rule in a few words, for the terminal's notes and the plots' legends
SHORT_RULE = (f"the processes' measured CPU per allreduce over the cores is at least {CPU_BOUND_RATIO:g}x the "
              f"ideal, or {CPU_BOUND_SHARE:g} of a time at least {CPU_BOUND_ABOVE_IDEAL:g}x the ideal")


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
    v = verdict({**out, "bound_ratio": t / ideal if t and ideal else None})
    out["cpu_bound"], out["cpu_tight"] = (None, None) if v is None else (v == "bound", v == "tight")
    out["cpu_bound_min_dilation"] = min_dilation(ratio, k) if out["cpu_bound"] else None
    return out


def switch_cpu(rec: dict) -> tuple[float, str]:
    """(the switch's CPU seconds per allreduce, where they were read: "processes" or "data plane"): for an
    ``ina:`` method :func:`switch_cpu_of` its counters; for other methods the data planes' busy CPU
    alone (the switch idles through them)."""
    c = rec.get("switch_counters") or {}
    ina = str(rec.get("method", "")).startswith("ina:")
    return switch_cpu_of(c.get("busy_cpu_ns", 0), c.get("process_cpu_ns") if ina else None, rec["reps"])


def switch_cpu_of(busy_cpu_ns: float, process_cpu_ns: float | None, reps: int) -> tuple[float, str]:
    """(the switch's CPU seconds per allreduce over ``reps`` allreduces, where they were read: "processes"
    or "data plane"): the larger of its processes' CPU (``process_cpu_ns``, :func:`switch_process_cpu_ns`;
    None: not reported) and its data planes' busy CPU (the processes' includes it, but a record or an
    older switch may lack them)."""
    busy = busy_cpu_ns / 1e9 / reps
    if process_cpu_ns is None or process_cpu_ns / 1e9 / reps <= busy:
        return busy, "data plane"
    return process_cpu_ns / 1e9 / reps, "processes"


def switch_process_cpu_ns(stats: dict) -> int | None:
    """The CPU of every process of the switch, from its control plane's ``stats``: its shards' processes
    (``timing.process_cpu_ns``: every thread, the control plane's too, summed over the shards) and its host
    aggregator's; None for a switch that does not report it. Cumulative: take differences."""
    tm = stats.get("timing", {})
    if "process_cpu_ns" not in tm:
        return None
    return tm["process_cpu_ns"] + stats.get("host_aggregator", {}).get("process_cpu_ns", 0)


def verdict(fl: dict) -> str | None:
    """The rule (module docstring): "bound" (CPU-bound), "tight" (CPU-tight: the share is high but the row
    is within CPU_BOUND_ABOVE_IDEAL of its ideal), "no", or None (not known). ``fl``: :func:`cpu_floor`'s
    fields, or a record that has them; time/ideal is its ``bound_ratio``, else cpu_floor_ratio / share."""
    share, ratio = fl.get("cpu_floor_share"), fl.get("cpu_floor_ratio")
    if share is None and ratio is None:
        return None
    if ratio is not None and ratio >= CPU_BOUND_RATIO:
        return "bound"
    if share is None or share < CPU_BOUND_SHARE:
        return "no"
    if ratio is None:                    # unshaped: no ideal, no link pace to keep; the share decides
        return "bound"
    over = fl.get("bound_ratio") or ratio / share
    return "bound" if over >= CPU_BOUND_ABOVE_IDEAL else "tight"


def cpu_bound(fl: dict) -> bool | None:
    """True if :func:`verdict` says CPU-bound (None: not known)."""
    v = verdict(fl)
    return None if v is None else v == "bound"


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
    if real is not None:
        real += [f for f in ("job_cpu_per_allreduce", "switch_cpu_per_allreduce") if f in rec and f not in real]
    return rec


def describe(rec: dict) -> str:
    """The report's cell: '**yes** 0.78 (K >= 5)', 'tight 0.72', 'no 0.12' or '–' (share of the measured time)."""
    if rec.get("cpu_bound") is None:
        return "–"
    share = rec.get("cpu_floor_share")
    s = "–" if share is None else f"{share:.2f}"
    if rec["cpu_bound"]:
        return f"**yes** {s}" + (f" (K >= {rec['cpu_bound_min_dilation']})" if rec.get("cpu_bound_min_dilation") else "")
    return f"tight {s}" if rec.get("cpu_tight") else f"no {s}"
