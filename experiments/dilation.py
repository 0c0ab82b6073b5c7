"""Time-dilated emulation: a K-times slower network in real time stands for a K-times faster one.

``ina-sweep --target-rates 10gbit,25gbit --dilation K|auto`` shapes the links at target/K and
stretches every emulated delay and timeout by K (the workers' RTO, their control-plane and Gloo
timeouts, the launcher's waits, the switch's impairment delay); the times it reports are the
measured ones divided by K, labelled "dilated xK". Bytes are not dilated: the links' byte counters
are reported as they are.

What is not dilated: CPU work. Python and kernel per-packet costs, the switch's loop and the codecs'
encode/decode run at this machine's real speed, so under dilation they look K times cheaper. The
codecs' share is put back explicitly (:func:`codec_time` measures encode+decode at real speed; the
end-to-end figure is ``time/K - codec/K + codec at the device speed``, assuming the codec work does
not overlap the transfer: an upper bound); the per-packet costs are what the ``auto`` probe keeps
small: it picks the smallest K at which a run agrees with the run at 2K and is not CPU-bound by the
sweep's CPU-floor rule (experiments/sweep_cpu.py) (:func:`auto_factor`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

#: the auto probe's first shaped rate (K0 = target / this, at least 1); then K doubles
PROBE_FIRST_RATE = "1gbit"
#: factors the probe tries at most (K0 .. 2**11 K0: 10gbit down to about 0.5 Mbit/s)
PROBE_STEPS = 12
#: K passes when the time/ideal ratios at K and 2K agree within this fraction ...
PROBE_AGREE = 0.05
#: ... and the one at K is within this fraction above its link-bound ideal
PROBE_WITHIN = 0.25
#: the workers' TCP under dilation: loss-based and clocked by ACKs, its one timer (the RTO) stretched;
#: BBR (this machine's default) paces by a 10 s min-RTT window and 200 ms ProbeRTT held in real time
DILATED_TCP_CC = "reno"
#: the shaped rate must stay within tbf's range (8 kbit .. about 34 gbit)
MIN_SHAPED_BPS = 8e3


#: record fields left in real seconds under dilation (not divided by K): the client's timeline, the
#: switch's stage clock, CPU seconds and the configuration's wall time
REAL_SECONDS_FIELDS = ("timeline_rank0", "timelines_all", "switch_counters", "worker_cpu_per_allreduce", "wall",
                       "rto", "max_rto", "worker_timeout")


class DilationError(ValueError):
    """A dilation that cannot be set up (the message names the setting)."""


def _bps(rate: str) -> float | None:
    """A target rate in bit/s (not capped at tbf's 34 gbit: only target/K is shaped)."""
    from ina.net import parse_rate
    return parse_rate(rate, tbf_limit=False)


@dataclass(frozen=True)
class Dilation:
    """One dilation factor K (1: real time)."""
    factor: float = 1.0

    def __post_init__(self):
        if not (self.factor >= 1 and math.isfinite(self.factor)):
            raise DilationError(f"dilation factor {self.factor!r}: expected a number >= 1")

    @property
    def on(self) -> bool:
        return self.factor != 1

    @property
    def label(self) -> str:
        return f"dilated x{self.factor:g}" if self.on else "real time"

    def shaped_rate(self, target: str) -> str:
        """The rate the links are shaped at for ``target``: target/K, as a tc rate string."""
        bps = _bps(target)
        if bps is None:
            if self.on:
                raise DilationError(f"rate {target!r}: an unshaped link cannot be dilated (give a target rate)")
            return target
        if not self.on:
            return target
        shaped = bps / self.factor
        if shaped < MIN_SHAPED_BPS:
            raise DilationError(f"target {target} dilated x{self.factor:g} is {shaped:.0f} bit/s, below tbf's "
                                f"{MIN_SHAPED_BPS:.0f} bit/s: use a smaller factor")
        return f"{shaped / 1e3:.10g}kbit"

    def stretch(self, seconds: float | None) -> float | None:
        """An emulated delay or a timeout, stretched by K (None stays None)."""
        return None if seconds is None else seconds * self.factor

    def report(self, seconds: float | None) -> float | None:
        """A measured time in the target's time: divided by K."""
        return None if seconds is None else seconds / self.factor

    def apply(self, rec: dict, target: str, ideal: float | None, codec: dict | None = None) -> dict:
        """Turn a record measured on the shaped links into the target's: times divided by K, the
        target's rate and link-bound ideal, the label, the codec's real-speed time put back."""
        shaped_bps = rec.get("rate_bps")
        for k in ("time_median", "time_mean", "time_min", "wall_per_allreduce"):
            if rec.get(k) is not None:
                rec[k] = self.report(rec[k])
        if rec.get("times"):
            rec["times"] = [self.report(t) for t in rec["times"]]
        rec.update(rate=target, rate_bps=_bps(target), shaped_rate_bps=shaped_bps, dilation=self.factor,
                   dilation_label=self.label)
        if self.on:       # the instruments' own clocks: real seconds on the shaped links, as measured
            rec["real_seconds_fields"] = [k for k in REAL_SECONDS_FIELDS if k in rec]
        if not rec.get("ideal_from_measured_bytes"):
            rec["ideal_time"] = ideal
        elif rec.get("ideal_time") is not None:
            rec["ideal_time"] = self.report(rec["ideal_time"])
        rec["bound_ratio"] = rec["time_median"] / rec["ideal_time"] if rec.get("ideal_time") else None
        if codec is not None:
            rec.update(codec)
            # the codec's CPU time shrank by K in the reported time: put it back at the device's speed
            rec["time_end_to_end"] = (rec["time_median"] - self.report(codec["codec_time_cpu"])
                                      + codec["codec_time_device"])
        return rec


def best_cpu_time(fn, reps: int = 3) -> float:
    """The least CPU time of this thread over ``reps`` calls of ``fn`` after an untimed one (numba
    compiles on the first). CPU time, not wall time: on a shared machine a thread waiting for a core
    is not computing (wall-clock best-of-3 of terngrad's 2 ms read 43-88 ms at load average 30)."""
    fn()
    return min(_thread_cpu(fn) for _ in range(reps))


def _thread_cpu(fn) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def codec_time(method: str, n: int, elements: int, device_gbps: float | None = None, reps: int = 3) -> dict:
    """Encode + decode CPU seconds of one worker's share of an allreduce, measured here at real speed
    (this thread's CPU time, best of ``reps`` after an untimed warm-up: :func:`best_cpu_time`), and the same work at ``device_gbps`` GB/s of float32 input per pass
    (None: this CPU). Gloo's ring: 0 (its float sums are part of the measured transfer); the Gloo-based
    baselines (experiments/baselines.py) compress inside their reducer: 0, not measured."""
    import numpy as np
    out = {"codec_time_cpu": 0.0, "codec_time_device": 0.0,
           "codec_device": "this CPU" if device_gbps is None else f"{device_gbps:g} GB/s"}
    if not method.startswith("ina:"):   # Gloo's ring; the baselines (fp16, PowerSGD ...): not measured here
        return out
    from ina import compression
    from ina.compression.base import ScaleContext
    from ina.wire import PAYLOAD_DTYPE
    c = compression.get(method[4:])
    x = (np.random.default_rng(0).standard_normal(elements) * 1e-2).astype(np.float32)

    def encode_decode():
        if c.aggregation == "host":
            c.decompress(c.compress(x))
        else:
            ctx = ScaleContext(c.scale_exponent(x), n, agreed=c.negotiated())
            codes = c.encode_shared(x, ctx)      # the switch's result has the shape and type of a sum
            c.decode_sum(codes.astype(PAYLOAD_DTYPE[c.result_type(ctx)].newbyteorder("=")), ctx, raw=False)
    best = best_cpu_time(encode_decode, reps)
    out["codec_time_cpu"] = best
    out["codec_time_device"] = best if device_gbps is None else 2 * elements * 4 / (device_gbps * 1e9)
    return out


def probe_factors_for(target: str, first_rate: str = PROBE_FIRST_RATE, steps: int = PROBE_STEPS) -> list[float]:
    """The factors the auto probe tries for ``target``, smallest first: K0 = target / ``first_rate``
    (at least 1), then 2 K0, 4 K0 ... (``steps`` of them), none shaping below tbf's minimum."""
    tbps = _bps(target)
    if tbps is None:
        raise DilationError(f"rate {target!r}: an unshaped link cannot be dilated")
    k0 = max(1.0, tbps / _bps(first_rate))
    return [k0 * 2 ** i for i in range(steps) if tbps / (k0 * 2 ** i) >= MIN_SHAPED_BPS]


def auto_factor(target: str, probe, factors=None, within: float = PROBE_WITHIN,
                agree: float = PROBE_AGREE) -> tuple[float, list]:
    """K for ``target`` from a measured CPU-headroom probe. ``probe(rate, K)`` runs a short allreduce
    dilated xK (links shaped at ``rate`` = target/K) and returns its record (a dict with ``bound_ratio``,
    median time / link-bound ideal, and the CPU floor's fields of experiments/sweep_cpu.py) or just
    that ratio. The rule: the smallest K of ``factors`` (default :func:`probe_factors_for`: K0, 2 K0,
    4 K0 ...) such that the runs at target/K and target/2K agree (their time/ideal ratios within
    ``agree``, 5%: the consistency a dilated result must have), the run at K is within ``within``
    (25%) of its ideal, and the run at K is not CPU-bound by the sweep's rule (``sweep_cpu.cpu_bound``,
    the one rule the report's flag uses: its processes' CPU floor under its ideal, and under half its
    time unless the run is within 1.1x its ideal). A run the emulator's per-packet costs hold back takes about the same real time
    at K and 2K, so its time/ideal halves from K to 2K; a link-bound one keeps it. Returns (K, the
    probe's [rate, ratio, K, CPU floor / time] steps); raises if no pair of the factors passes."""
    from .sweep_cpu import cpu_bound
    factors = list(factors or probe_factors_for(target))
    steps, prev, bound = [], None, None
    for k in factors:
        rate = Dilation(k).shaped_rate(target)
        got = probe(rate, k)
        rec = got if isinstance(got, dict) else {"bound_ratio": got}
        ratio = rec.get("bound_ratio")
        steps.append([rate, ratio, k, rec.get("cpu_floor_share")])
        if prev is not None and prev[1] is not None and ratio is not None and prev[1] <= 1 + within \
                and abs(ratio / prev[1] - 1) <= agree and not bound:
            return prev[2], steps
        prev, bound = steps[-1], cpu_bound(rec)
    tried = ", ".join(f"{k:g}" for k in factors)
    raise DilationError(f"auto dilation for {target}: no two successive factors of {tried} "
                        f"agreed within {agree:.0%} with the first within {within:.0%} of its link-bound ideal "
                        f"and not CPU-bound (probe [rate, time/ideal, K, CPU floor/time]: {steps}); "
                        f"give --dilation K")


def parse_dilation(text: str | None) -> float | str | None:
    """--dilation: a factor >= 1 or 'auto' (None: off)."""
    if text is None or text == "auto":
        return text
    try:
        k = float(text)
    except ValueError:
        raise DilationError(f"--dilation {text!r}: expected a factor >= 1 or 'auto'") from None
    Dilation(k)
    return k


# ------------------------------------------------------------------------------------------------
# the sweep's options
def add_arguments(ap) -> None:
    """ina-sweep's dilation, codec-speed and switch-profile options."""
    ap.add_argument("--target-rates", help="comma-separated target link rates (e.g. 10gbit,25gbit,100gbit) emulated "
                                           "by time dilation (needs --dilation; replaces --rates)")
    ap.add_argument("--dilation", help="time-dilation factor K (links shaped at target/K, delays and timeouts x K, "
                                       "times reported / K) or 'auto' (K from a CPU-headroom probe)")
    ap.add_argument("--probe-within", type=float, default=PROBE_WITHIN,
                    help="auto dilation: K passes only if its run's time is within this fraction of its ideal")
    ap.add_argument("--probe-agree", type=float, default=PROBE_AGREE,
                    help="auto dilation: K passes when the runs at K and 2K agree within this fraction")
    ap.add_argument("--codec-gbps", type=float, default=None,
                    help="codec speed of the modelled device in GB/s of float32 per pass (default: this CPU, "
                         "measured); end-to-end times include encode+decode at that speed")
    ap.add_argument("--profile", default="software",
                    help="switch hardware profile (software, tofino, tofino-recirc): the switch runs under it, "
                         "packets are sized for it, codecs it cannot sum are skipped")
    ap.add_argument("--switch-delay-ms", type=float, default=None,
                    help="one-way delay the switch adds to every packet (ms, emulated; stretched x K)")
    ap.add_argument("--tcp-cc", help="TCP congestion control in the workers' namespaces (those in "
                                     "net.ipv4.tcp_allowed_congestion_control, e.g. reno, bbr; default: the machine's "
                                     f"in real time, {DILATED_TCP_CC} under --dilation: BBR's 10 s and 200 ms clocks are "
                                     "real time and do not dilate, see docs/performance.md)")


def resolve(ap, args) -> None:
    """Check and fill in the options of :func:`add_arguments` (ap.error names a bad one):
    args.dilation (None, 'auto' or K), args.rates from --target-rates, args.max_elements,
    args.worker_timeout; the real-speed workloads (throughput, accuracy) are off under dilation."""
    from ina.profiles import ProfileError, get_profile
    try:
        args.dilation = parse_dilation(args.dilation)
        prof = get_profile(args.profile)
    except (DilationError, ProfileError) as e:
        ap.error(str(e))
    if args.target_rates:
        if args.dilation is None:
            ap.error("--target-rates needs --dilation K or --dilation auto")
        if args.rates:
            ap.error("give either --rates (real time) or --target-rates (dilated), not both")
        args.rates = args.target_rates
    if args.codec_gbps is not None and not args.codec_gbps > 0:
        ap.error(f"--codec-gbps {args.codec_gbps}: expected a positive speed in GB/s")
    if args.dilation is not None:
        if "unlimited" in (args.rates or "unlimited"):
            ap.error("--dilation needs shaped rates (--target-rates or --rates without 'unlimited')")
        if (args.tp_sizes not in (None, "none")) or args.acc_steps:
            ap.error("the throughput and accuracy workloads compute at real speed and cannot be dilated: "
                     "use --tp-sizes none --acc-steps 0 (the defaults under --dilation)")
        args.tp_sizes, args.acc_steps = "none", 0
        args.tcp_cc = args.tcp_cc or DILATED_TCP_CC
    k = args.dilation if isinstance(args.dilation, float) else 1.0
    if args.dilation is None and args.rates:
        from ina.net import RateError, parse_rate
        for r in args.rates.split(","):
            try:
                parse_rate(r)          # real time: the rate is shaped as given (tbf's cap applies)
            except RateError as e:
                ap.error(f"{e}; a faster target needs --target-rates with --dilation")
    args.worker_timeout = Dilation(k).stretch(args.timeout)
    args.max_elements = prof.elements or 8192


def feasible_methods(methods: list[str], profile_name: str) -> tuple[list[str], dict]:
    """(the methods a switch under the profile can run, {skipped method: why})."""
    from ina import compression
    from ina.profiles import get_profile
    prof = get_profile(profile_name)
    keep, skipped = [], {}
    for m in methods:
        ok, why = compression.get(m[4:]).feasible_under(prof) if m.startswith("ina:") else (True, "")
        if ok:
            keep.append(m)
        else:
            skipped[m] = why
    return keep, skipped


def switch_delay(args, dil: Dilation) -> dict | None:
    """The control-plane request that sets the switch's emulated one-way delay (each direction through
    the switch), stretched by K; None when the sweep emulates no delay."""
    if not args.switch_delay_ms:
        return None
    d = {"delay_ms": dil.stretch(args.switch_delay_ms)}
    return {"op": "impair", "ingress": d, "egress": d}


def set_switch_delay(host: str, port: int, args, dil: Dilation) -> None:
    msg = switch_delay(args, dil)
    if msg is not None:
        from ina.control import request
        request(host, port, msg, timeout=10.0)


def tcp_congestion_control(topo, n: int, want: str | None) -> str:
    """Set (``want``) and return the TCP congestion control of the first ``n`` workers' namespaces
    (Gloo's ring and the Gloo process group run over it); the sweep records it (meta ``tcp_cc``)."""
    key = "net.ipv4.tcp_congestion_control"
    for w in topo.workers[:n] if want else ():
        p = topo.run(w, ["sysctl", "-qw", f"{key}={want}"], timeout=10.0)
        if p.returncode != 0:
            raise DilationError(f"--tcp-cc {want}: sysctl in {w.name} failed: {p.stderr.strip()}")
    got = {topo.run(w, ["sysctl", "-n", key], timeout=10.0).stdout.strip() for w in topo.workers[:n]}
    return ",".join(sorted(got))


#: Linux's floor of TCP's retransmission timeout (tcp_rto_min_us default: 200 ms), a real-time constant,
#: and its largest RTO (TCP_RTO_MAX, tcp_rto_max_ms default: 120 s)
TCP_RTO_MIN, TCP_RTO_MAX = 0.2, 120.0


def set_tcp_rto_min(topo, dil: Dilation) -> float:
    """Stretch the workers' TCP retransmission-timeout floor (200 ms) by K, up to TCP's largest RTO
    (120 s), in their namespaces (net.ipv4.tcp_rto_min_us); returns the floor (seconds). A socket
    takes the floor when it is opened, so the sweep sets it before it starts a worker group, for the
    largest K that group runs. Not stretched, the floor is a real-time constant: at target/K a queue
    of a few frames outlasts it (a 9 kB frame takes 46 ms at 1.56 Mbit/s), and TCP retransmits
    spuriously and cuts its window, the more often the larger K (docs/performance.md: Gloo's ring
    with 16 workers)."""
    floor = min(dil.stretch(TCP_RTO_MIN), TCP_RTO_MAX)
    for w in topo.workers:
        p = topo.run(w, ["sysctl", "-qw", f"net.ipv4.tcp_rto_min_us={round(floor * 1e6)}"], timeout=10.0)
        if p.returncode != 0:
            raise DilationError(f"setting TCP's RTO floor in {w.name} to {floor:g} s failed: {p.stderr.strip()}")
    return floor


#: the probe's job ids: their own range of the switch's 16-bit job field, away from the sweep's (0..~10 000)
PROBE_JOBS = (40_000, 65_536)


def probe_job(n: int, i: int) -> int:
    """The job id of the ``i``-th probe run with ``n`` workers: in :data:`PROBE_JOBS` for any ``n`` and
    ``i`` (the probe's runs are sequential, so ids only need to differ from one run to the next)."""
    lo, hi = PROBE_JOBS
    return lo + (n * 1000 + i) % (hi - lo)


def probe_factors(topo, n: int, plan: list, args, out, meta: dict, bar=None) -> dict:
    """--dilation auto: K per (target rate, size) of the allreduce rows of ``plan`` with ``n`` workers,
    by :func:`auto_factor` over every method of the row (short real-time runs: 2 repetitions; the
    largest K of the row's methods, so every method of a row shares one K). The probe's steps go
    into ``meta["dilation_probe"]``."""
    import copy

    from .sweep import run_bench
    from .sweep_group import SWITCH_PORT, WorkerGroup
    pa = copy.copy(args)
    pa.reps = 2
    pa.worker_timeout = args.timeout * max(k for r in {p[2] for p in plan} for k in probe_factors_for(r))
    rows: dict = {}
    for wl, _, rate, el, m in plan:
        if wl == "allreduce":
            rows.setdefault((rate, el), []).append(m)
    ks, i = {}, 0
    set_tcp_rto_min(topo, Dilation(pa.worker_timeout / args.timeout))      # the largest K probed
    group = WorkerGroup(topo, n, out, pa)
    try:
        for (rate, el), methods in rows.items():
            start, k = 0, 1.0
            for m in methods:
                def probe(r, kp, m=m):
                    nonlocal i
                    i += 1
                    job = probe_job(n, i)
                    if bar is not None:
                        bar.set_postfix_str(f"dilation probe {m} n={n} {rate} x{kp:g} {el:,}")
                    topo.set_rate("workers", r)
                    set_switch_delay(topo.switch.ip, SWITCH_PORT, args, Dilation(kp))
                    return run_bench(group, topo, m, n, r, el, pa, job, job, Dilation(kp), rate)
                factors = probe_factors_for(rate)
                km, steps = auto_factor(rate, probe, factors[start:], args.probe_within, args.probe_agree)
                start = factors.index(km)          # later methods start at the factor this one passed
                k = max(k, km)
                meta.setdefault("dilation_probe", []).append({"workers": n, "target": rate, "elements": el,
                                                              "method": m, "steps": steps, "factor": km})
            ks[(rate, el)] = k
    finally:
        group.close()
    return ks


def config_key(workload, method, n, rate, elements, dilation=1, profile=None) -> str:
    """A configuration's key in results.json (a re-run skips the keys it has); a dilated or profiled
    run's keys name the factor and the profile, so runs at K and 2K can share a folder."""
    k = f"{workload}|{method}|{n}|{rate}|{elements}"
    return k + (f"|x{dilation:g}" if dilation != 1 else "") + (f"|{profile}" if profile not in (None, "software") else "")


def is_done(done: set, args, wl, m, n, rate, el) -> bool:
    """Is this configuration in results.json already (under this dilation factor and profile)?"""
    import re
    if args.dilation == "auto":       # any factor the probe chose
        return config_key(wl, m, n, rate, el, 1, args.profile) in {re.sub(r"\|x[^|]+", "", d) for d in done}
    return config_key(wl, m, n, rate, el, args.dilation or 1, args.profile) in done
