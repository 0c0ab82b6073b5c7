"""Where the switch's poll loop spends its time: per-stage nanoseconds and burst sizes (pipeline.py)."""
from __future__ import annotations

STAGES = ("rx", "ingress", "parse", "aggregate", "harvest", "tx")
# burst-size histogram buckets: bucket b counts bursts of 2**b .. 2**(b+1) - 1 packets
BURST_BUCKETS = 12


class StageClock:
    """Where a poll loop's time goes: nanoseconds per stage, and a histogram of burst sizes.

    ``poll_once`` reads the clock once before the first stage and once after each stage, so the
    stages partition each busy poll exactly: ``sum(stage_ns) == busy_ns``. Waiting for the first
    packet of a burst (the blocking receive of an idle switch) is ``wait_ns``, not a stage's time.
    Stage times are wall-clock times; ``busy_cpu_ns`` is the CPU time the data-plane thread got during
    the busy polls, so ``busy_ns - busy_cpu_ns`` is the time it was runnable but preempted (on a
    shared machine) or blocked in a system call.
    """

    def __init__(self):
        # Python ints, not numpy arrays: the poll loop adds to them six times a burst, and an int's
        # add is a fraction of a numpy element's read-modify-write
        self.stage_ns = [0] * len(STAGES)
        self.busy_ns = 0
        self.busy_cpu_ns = 0
        self.tx_cpu_ns = 0        # CPU ns of the tx stage alone (sendmmsg: the kernel's send path)
        self.wait_ns = 0
        self.bursts = 0
        self.burst_hist = [0] * BURST_BUCKETS

    def burst(self, n: int) -> None:
        self.bursts += 1
        self.burst_hist[min(n.bit_length() - 1, BURST_BUCKETS - 1)] += 1

    def to_dict(self) -> dict:
        hist = {(f"{1 << b}" if b == 0 else f"{1 << b}-{(1 << (b + 1)) - 1}"): int(v)
                for b, v in enumerate(self.burst_hist) if v}
        return {"stage_ns": {name: int(v) for name, v in zip(STAGES, self.stage_ns)}, "busy_ns": int(self.busy_ns),
                "busy_cpu_ns": int(self.busy_cpu_ns), "tx_cpu_ns": int(self.tx_cpu_ns), "wait_ns": int(self.wait_ns),
                "bursts": int(self.bursts),
                "burst_sizes": hist}


def add_timing(into: dict, other: dict) -> None:
    """Add one shard's ``StageClock.to_dict()`` into another's (the stats of a sharded switch; each shard's
    ``process_cpu_ns``, its process's CPU, too: the sum is the CPU of every shard's process)."""
    for group in ("stage_ns", "burst_sizes"):
        for key, v in other[group].items():
            into[group][key] = into[group].get(key, 0) + v
    for key in ("busy_ns", "busy_cpu_ns", "tx_cpu_ns", "wait_ns", "bursts", "process_cpu_ns"):
        if key in other:
            into[key] = into.get(key, 0) + other[key]
