"""Plots (matplotlib Agg) and the markdown report of an ina-sweep results folder."""
from __future__ import annotations

import math
from pathlib import Path

from .sweep_cpu import CPU_BOUND_ABOVE_IDEAL, CPU_BOUND_SHARE, RULE, SHORT_RULE, describe
from .sweep_methods import is_host_method, method_label

#: marks a CPU-bound row's cells in the speed-up tables, the terminal's headline and the plots
CPU_MARK = "†"

RATE_ORDER = {"10mbit": 0, "100mbit": 1, "1gbit": 2, "unlimited": 3}
RATE_LABEL = {"10mbit": "10 Mbit/s", "100mbit": "100 Mbit/s", "1gbit": "1 Gbit/s", "unlimited": "unshaped"}


_SHOWN = {"dilated": {}, "profile": "software"}   # of the records being reported (set by _note_run)


def _note_run(records) -> None:
    """Remember the dilation labels per rate and the switch profile of the records being reported, so
    that every table, plot title and axis names them."""
    _SHOWN["dilated"] = {}
    for r in records:
        if r.get("dilation", 1) != 1:
            _SHOWN["dilated"].setdefault(r["rate"], set()).add(r["dilation"])
    _SHOWN["profile"] = next((r["profile"] for r in records if r.get("profile")), "software")


def rate_name(rate: str) -> str:
    """'10 Gbit/s, dilated x100' (the label of a dilated rate), '100 Mbit/s', 'unshaped'."""
    from ina.net import parse_rate
    b = parse_rate(rate, tbf_limit=False)
    name = RATE_LABEL.get(rate) or (f"{b / 1e9:g} Gbit/s" if b >= 1e9 else f"{b / 1e6:g} Mbit/s")
    ks = _SHOWN["dilated"].get(rate)
    return f"{name}, dilated " + "/".join(f"x{k:g}" for k in sorted(ks)) if ks else name


def _rk(rate: str) -> float:
    from ina.net import parse_rate
    b = parse_rate(rate, tbf_limit=False)
    return math.inf if b is None else b


def _fmt(x, spec=".3g", none="–"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def _kname(k) -> str:
    return k if isinstance(k, str) else format(k, "g")


def _ms(x):
    return None if x is None else x * 1e3


def _mb(x):
    return _fmt(None if x is None else x / 1e6, ".3f")


def _methods(records):
    seen = []
    for r in records:
        if r["method"] not in seen:
            seen.append(r["method"])
    return sorted(seen, key=lambda m: (m != "gloo", m))


def _rec(records, m, n, rate, el):
    """The record of method m with n workers at this rate and size (None if not measured)."""
    return next((x for x in records if x["method"] == m and x["workers"] == n and x["rate"] == rate
                 and x["elements"] == el), None)


def _pick_n(ar, prefer=4):
    ns = sorted({r["workers"] for r in ar})
    return prefer if prefer in ns else (ns[-1] if ns else None)


def targets(records, meta) -> list[dict]:
    """The issue's targets, checked against the measured records (None where not measured)."""
    ar = [r for r in records if r["workload"] == "allreduce"]
    sizes = sorted({r["elements"] for r in ar})
    big = sizes[-1] if sizes else None

    def get(m, n, rate, el=big):
        return next((r for r in ar if r["method"] == m and r["workers"] == n and r["rate"] == rate
                     and r["elements"] == el), None)
    out = []
    for el in sizes:                      # every size that has the 4-worker, 100 Mbit/s configurations
        at = f" ({el:,} elements)" if len(sizes) > 1 else ""
        nc, g, bf = get("ina:nc", 4, "100mbit", el), get("gloo", 4, "100mbit", el), get("ina:bfp32", 4, "100mbit", el)
        if nc and g:
            s = g["time_median"] / nc["time_median"]
            out.append({"target": f"4 workers, 100 Mbit/s{at}: INA nc >= 5x faster than Gloo ring fp32",
                        "measured": f"{s:.2f}x (ring {g['time_median']:.3f} s, nc {nc['time_median']:.3f} s)",
                        "met": s >= 5})
            out.append({"target": f"4 workers, 100 Mbit/s{at}: INA nc within 1.15x of the link-bound ideal",
                        "measured": f"{nc['bound_ratio']:.3f}x (ideal {nc['ideal_time']:.3f} s)",
                        "met": nc["bound_ratio"] <= 1.15})
        if bf and g:
            s = g["time_median"] / bf["time_median"]
            out.append({"target": f"4 workers, 100 Mbit/s{at}: INA bfp32 >= 1.3x faster than the ring (ideal 1.5x)",
                        "measured": f"{s:.2f}x (bfp32 {bf['time_median']:.3f} s, {bf['bound_ratio']:.3f}x of its ideal)",
                        "met": s >= 1.3})
    for el in sizes:
        at = f" ({el:,} elements)" if len(sizes) > 1 else ""
        for m, rate in (("ina:nc", "100mbit"), ("ina:bfp32", "100mbit"), ("ina:nc", "10mbit"), ("ina:bfp32", "10mbit")):
            pts = {r["workers"]: r for r in ar if r["method"] == m and r["rate"] == rate and r["elements"] == el}
            gp = {r["workers"]: r for r in ar if r["method"] == "gloo" and r["rate"] == rate and r["elements"] == el}
            if len(pts) >= 2:
                lo, hi = min(pts), max(pts)
                ratio = pts[hi]["time_median"] / pts[lo]["time_median"]
                ring = (f"; ring {gp[lo]['time_median']:.3f} -> {gp[hi]['time_median']:.3f} s "
                        f"({gp[hi]['time_median'] / gp[lo]['time_median']:.2f}x)") if lo in gp and hi in gp else ""
                grows = (lo in gp and hi in gp and gp[hi]["time_median"] > gp[lo]["time_median"])
                out.append({"target": f"{method_label(m)} time flat (within 10%) from {lo} to {hi} workers at "
                                      f"{rate_name(rate)}{at} while the ring's grows",
                            "measured": f"{pts[lo]['time_median']:.3f} -> {pts[hi]['time_median']:.3f} s "
                                        f"({ratio:.3f}x){ring}",
                            "met": abs(ratio - 1) <= 0.10 and (grows if ring else True)})
    ncb = [r for r in ar if r["method"] == "ina:nc" and r["rate"] != "unlimited"]
    pair = [(r, get("ina:bfp32", r["workers"], r["rate"], r["elements"])) for r in ncb]
    pair = [(a, b) for a, b in pair if b]
    gpair = [(r, get("gloo", r["workers"], r["rate"], r["elements"])) for r in ncb]
    gpair = [(a, b) for a, b in gpair if b]
    if pair:
        a, b = next(((a, b) for a, b in pair if a["workers"] == 4 and a["rate"] == "100mbit"), pair[0])
        fr = a["wire_up_bytes_per_worker"] / b["wire_up_bytes_per_worker"]
        extra = ""
        ga = next((gb for na, gb in gpair if na is a), None)
        if ga:
            extra = (f"; vs the ring's fp32 traffic ({ga['wire_up_bytes_per_worker'] / 1e6:.2f} MB up per worker): "
                     f"{a['wire_up_bytes_per_worker'] / ga['wire_up_bytes_per_worker']:.3f}")
        out.append({"target": "bytes on the wire per worker for nc ~ 1/4 of fp32 (measured on the links)",
                    "measured": f"nc {a['wire_up_bytes_per_worker'] / 1e6:.3f} MB vs INA fp32 (bfp32) "
                                f"{b['wire_up_bytes_per_worker'] / 1e6:.3f} MB up per worker per allreduce = {fr:.3f} "
                                f"({a['workers']} workers, {rate_name(a['rate'])}){extra}",
                    "met": 0.2 <= fr <= 0.3})
    acc = [r for r in records if r["workload"] == "accuracy"]
    base = next((r for r in acc if r["method"] == "gloo"), None)
    if base:
        worst = [(r["method"], (r["final_accuracy"] - base["final_accuracy"]) * 100) for r in acc if r["method"] != "gloo"]
        core = [(m, d) for m, d in worst if m in ("ina:bfp32", "ina:nc", "ina:nc-det", "ina:nd")]
        if core:
            out.append({"target": "accuracy after the same number of steps within 0.5 points of the baseline "
                                  "(INA bfp32 / nc / nc-det / nd)",
                        "measured": ", ".join(f"{m[4:]} {d:+.2f}" for m, d in core)
                                    + f" points (Gloo {base['final_accuracy'] * 100:.2f}%, {base['steps']} steps)",
                        "met": all(abs(d) <= 0.5 for _, d in core)})
    return out


# ------------------------------------------------------------------------------------------------
# Plots: every method keeps one look (experiments.plot_style: hue = family, marker = method, line
# style = switch / host-aggregated / baseline); the legend sits outside the axes, on the right.
DPI = 100


def _figure(ncols: int = 1, width: float = 6.4, height: float = 4.8):
    import matplotlib.pyplot as plt
    return plt.subplots(1, ncols, figsize=(width * ncols + 3.6, height), squeeze=False, layout="constrained")


def _finish(fig, out: Path, name: str, methods, made: list[str], note: str = "") -> None:
    """Legend (one entry per method, grouped by family) outside the axes, then save and close."""
    from matplotlib.lines import Line2D
    from .plot_style import legend_label, legend_order, style
    order = legend_order(methods)
    handles = [Line2D([], [], **style(m).kw()) for m in order]
    labels = [legend_label(m) for m in order]
    if note:
        handles.append(Line2D([], [], linestyle="none"))
        labels.append(note)
    fig.legend(handles, labels, loc="outside right upper", fontsize=9, frameon=False,
               title="solid: switch-summable INA\ndashed: host-aggregated (NOT switch-feasible)\ndotted: baseline",
               title_fontsize=9, alignment="left")
    _save(fig, out / name)
    made.append(name)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _dodge(i: int, count: int, width: float = 0.4) -> float:
    """Horizontal offset of the i-th of ``count`` methods on a categorical axis, so markers do not hide each other."""
    return (i - (count - 1) / 2) * width / max(count - 1, 1)


def _log_y(ax) -> None:
    """Log y axis with plain tick labels (0.5, 2, 10; not 5 x 10^-1)."""
    from matplotlib.ticker import FuncFormatter
    ax.set_yscale("log")
    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(FuncFormatter(
        lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))


CPU_NOTE = f"{CPU_MARK}: CPU-bound: " + SHORT_RULE.replace(" is at", "\nis at").replace(" per allreduce", "\nper allreduce").replace(
    ", or", ",\nor")


def _mark_cpu_bound(ax, pts) -> bool:
    """Mark each (x, y, record) point whose record is CPU-bound with CPU_MARK; True if any was."""
    hit = False
    for x, y, r in pts:
        if r.get("cpu_bound"):
            ax.annotate(CPU_MARK, (x, y), xytext=(3, 3), textcoords="offset points", fontsize=10, color="black")
            hit = True
    return hit


def _plot_speedup(out, ar, methods, rates, n, big, made):
    from .plot_style import style
    fig, axs = _figure()
    ax = axs[0][0]
    shown, cpu = [], False
    for i, m in enumerate(methods):
        recs = [(k + _dodge(i, len(methods)), r) for k, rate in enumerate(rates)
                if (r := _rec(ar, m, n, rate, big)) and r.get("speedup_vs_gloo") is not None]
        if recs:
            ax.plot([x for x, _ in recs], [r["speedup_vs_gloo"] for _, r in recs], **style(m).kw())
            shown.append(m)
            cpu |= _mark_cpu_bound(ax, [(x, r["speedup_vs_gloo"], r) for x, r in recs])
    ax.set_xticks(range(len(rates)), [rate_name(r) for r in rates])
    _log_y(ax)
    ax.axhline(1, color="grey", lw=0.8)
    ax.set_xlabel("per-worker link rate (methods side by side at each rate)")
    ax.set_ylabel("allreduce speedup vs Gloo ring fp32")
    ax.set_title(f"{n} workers, {big:,} elements; switch profile {_SHOWN['profile']}")
    ax.grid(True, which="major", alpha=0.3)
    _finish(fig, out, "speedup_vs_bandwidth.png", shown, made, note=CPU_NOTE if cpu else "")


def _plot_bytes_time(out, ar, methods, rates, n, big, made):
    from .plot_style import style
    fig, axs = _figure(height=4.6)
    ax = axs[0][0]
    shown = []
    for m in methods:
        pts = [(r["time_median"], r["wire_up_bytes_per_worker"] / 1e6) for rate in rates
               if (r := _rec(ar, m, n, rate, big))]
        if pts:
            ax.plot(*zip(*pts), **style(m).kw())
            shown.append(m)
    for rate in rates:                    # the rate of each point: the ring's time at that rate
        g = _rec(ar, "gloo", n, rate, big)
        if g:
            ax.axvline(g["time_median"], color="grey", lw=0.6, alpha=0.6)
            ax.annotate(rate_name(rate), (g["time_median"], 1), xycoords=("data", "axes fraction"),
                        xytext=(2, -2), textcoords="offset points", ha="left", va="top", fontsize=7, color="grey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("allreduce time (s, median); one point per link rate, grey lines: the ring's time")
    ax.set_ylabel("bytes sent per worker (MB, link counters)")
    ax.set_title(f"{n} workers, {big:,} elements; switch profile {_SHOWN['profile']}")
    ax.grid(True, which="major", alpha=0.3)
    _finish(fig, out, "bytes_vs_time.png", shown, made)


def _plot_scaling(out, ar, methods, rates, big, made):
    from .plot_style import style
    ns = sorted({r["workers"] for r in ar})
    srates = [r for r in ("10mbit", "100mbit") if r in rates] or rates[:1]
    fig, axs = _figure(len(srates), width=5.0)
    core = [m for m in methods if m in ("gloo", "ina:bfp32", "ina:nc", "ina:nc-det", "ina:nd")] or methods
    shown, cpu = [], False
    for ax, rate in zip(axs[0], srates):
        for m in core:          # the seed codecs' scaling is in the tables
            recs = sorted((x for x in ar if x["method"] == m and x["rate"] == rate and x["elements"] == big),
                          key=lambda x: x["workers"])
            if len(recs) >= 2:
                st = style(m)
                ax.plot([x["workers"] for x in recs], [x["time_median"] for x in recs], **st.kw())
                shown.append(m)
                cpu |= _mark_cpu_bound(ax, [(x["workers"], x["time_median"], x) for x in recs])
                if recs[0]["ideal_time"] is not None and m in ("gloo", "ina:nc", "ina:bfp32"):
                    ax.plot([x["workers"] for x in recs], [x["ideal_time"] for x in recs], "-.", color=st.colour,
                            lw=0.9, alpha=0.7)
        ax.set_xticks(ns)
        _log_y(ax)
        ax.set_xlabel("workers")
        ax.set_ylabel("allreduce time (s)")
        ax.set_title(f"{rate_name(rate)} per link, {big:,} elements", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    _finish(fig, out, "scaling_workers.png", list(dict.fromkeys(shown)), made,
            note="thin dash-dot: link-bound ideal" + ("\n" + CPU_NOTE if cpu else ""))


def _plot_throughput(out, tp, methods, rates, n, made):
    from .plot_style import style
    models = sorted({(r["elements"], r.get("model") or str(r["elements"])) for r in tp})
    fig, axs = _figure(len(models), width=4.6)
    shown = []
    for ax, (el, name) in zip(axs[0], models):
        here = [m for m in methods if any(x["method"] == m and x["elements"] == el and x["workers"] == n for x in tp)]
        for i, m in enumerate(here):
            ys = [next((x["samples_per_s"] for x in tp if x["method"] == m and x["elements"] == el
                        and x["workers"] == n and x["rate"] == rate), None) for rate in rates]
            xs = [k for k, y in enumerate(ys) if y is not None]
            ax.plot([k + _dodge(i, len(here)) for k in xs], [ys[k] for k in xs], **style(m).kw())
            shown.append(m)
        ax.set_xticks(range(len(rates)), [rate_name(r) for r in rates], fontsize=8)
        _log_y(ax)
        ax.set_title(f"{name} ({el:,} params), {n} workers", fontsize=10)
        ax.set_ylabel("samples/s (measured, synthetic data)")
        ax.grid(True, which="major", alpha=0.3)
    _finish(fig, out, "throughput.png", list(dict.fromkeys(shown)), made)


def _plot_accuracy(out, acc, made):
    """Test accuracy against steps and wall time; y from 80 % (where the codecs differ), markers staggered."""
    from .plot_style import style
    fig, (axs,) = _figure(2, width=4.6)
    a1, a2 = axs
    for i, r in enumerate(acc):
        c, kw = r["curve"], style(r["method"]).kw()
        every = max(1, len(c) // 4)
        kw["markevery"] = (1 + i % every, every)
        a1.plot([p["step"] for p in c], [p["accuracy"] * 100 for p in c], **kw)
        a2.plot([p["time"] for p in c], [p["accuracy"] * 100 for p in c], **kw)
    lo = min(80.0, min(r["final_accuracy"] * 100 for r in acc) - 2) if all("final_accuracy" in r for r in acc) else 80.0
    where = f"{acc[0]['workers']} workers, {rate_name(acc[0]['rate'])}"
    for ax, xl in ((a1, "SGD step"), (a2, "wall time (s)")):
        ax.set_ylim(lo, 100)
        ax.set_xlabel(xl)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{where}: accuracy vs {xl.split(' (')[0]}", fontsize=10)
    a1.set_ylabel(f"test accuracy (%), digits (axis from {lo:g} %)")
    _finish(fig, out, "accuracy.png", [r["method"] for r in acc], made)


def plots(out: Path, records) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    made: list[str] = []
    _note_run(records)
    ar = [r for r in records if r["workload"] == "allreduce"]
    methods = _methods(ar)
    rates = sorted({r["rate"] for r in ar}, key=_rk)
    n = _pick_n(ar)
    if ar:
        sizes = sorted({r["elements"] for r in ar})
        # the size measured in the most configurations (the other sizes are in the report's tables)
        big = max(sizes, key=lambda el: (sum(1 for r in ar if r["elements"] == el), el))
        _plot_speedup(out, ar, methods, rates, n, big, made)
        _plot_bytes_time(out, ar, methods, rates, n, big, made)
        if len({r["workers"] for r in ar}) >= 2:
            _plot_scaling(out, ar, methods, rates, big, made)
    tp = [r for r in records if r["workload"] == "throughput"]
    if tp:
        _plot_throughput(out, tp, _methods(tp), rates or sorted({r["rate"] for r in tp}, key=_rk), n or _pick_n(tp),
                         made)
    acc = [r for r in records if r["workload"] == "accuracy"]
    if acc:
        _plot_accuracy(out, acc, made)
    return made


# ------------------------------------------------------------------------------------------------
def report_md(meta, records, images: list[str], img_prefix: str = "") -> str:
    _note_run(records)
    ar = [r for r in records if r["workload"] == "allreduce"]
    acc = [r for r in records if r["workload"] == "accuracy"]
    tp = [r for r in records if r["workload"] == "throughput"]
    methods = _methods(ar or acc)
    rates = sorted({r["rate"] for r in ar}, key=_rk)
    sizes = sorted({r["elements"] for r in ar})
    L = _md_intro(meta, records) + _md_targets(records, meta)
    if ar:
        L += _md_allreduce(ar, acc, methods, rates, sizes)
    if tp:
        L += _md_throughput(meta, tp, ar, methods, rates, sizes)
    if acc:
        L += _md_accuracy(acc)
    if images:
        L += ["## Figures", "", "Colour hue: codec family; marker: method; line: solid switch-summable INA, dashed "
              "host-aggregated (NOT switch-feasible), dotted Gloo ring baseline.", ""]
        for im in images:
            L.append(f"![{im}]({img_prefix}{im})")
            L.append("")
    return "\n".join(L)


def _md_intro(meta, records=()) -> list[str]:
    L = ["# ina-sweep report", ""]
    L.append(f"Command(s): " + "; ".join(f"`{c}`" for c in meta.get("runs", [meta.get("command", "")])))
    L.append("")
    L.append(f"Emulated topology: switch host (unshaped link) + worker hosts, each worker link shaped by tbf in both "
             f"directions, MTU {meta.get('mtu')}. INA window {meta.get('slots')} slots per job; {meta.get('warmup')} "
             f"warm-up allreduce(s), then {meta.get('reps')} timed repetitions (median reported; a repetition ends "
             f"when the slowest rank has its result; a Gloo barrier precedes each). Bytes are the links' kernel "
             f"counters (tbf byte counters of shaped directions, device counters when unshaped), per worker per "
             f"allreduce. Sizes: " + ", ".join(f"{k} = {v:,}" for k, v in meta.get("sizes", {}).items())
             + (f" (model parameter counts divided by {meta['scale']:g})" if meta.get("scale", 1) != 1 else "")
             + f". Elapsed {meta.get('elapsed', 0):.0f} s.")
    L.append("")
    ideal = ("Link-bound ideal: ring 2(n-1)/n x 4N bytes / rate; INA max(N x upload width, N x download width) / "
             "rate (upload and download run concurrently on the full-duplex link; switch time neglected); payload "
             "only (headers, Ethernet framing excluded).")
    L.append(ideal)
    L.append("")
    L.append(f"Switch profile: {meta.get('profile', 'software')}"
             + "".join(f"; {m} skipped ({why})" for m, why in (meta.get("profile_skipped") or {}).items())
             + (f"; {meta['switch_shards']} switch process(es) (--switch-cores {meta.get('switch_cores', 'auto')})"
                if meta.get("switch_shards") else "") + ". "
             + ("Real time (not dilated)." if meta.get("dilation", 1) == 1 else
                f"**Time-dilated** (--dilation {_kname(meta.get('dilation'))}): links shaped at target/K, delays and "
                f"timeouts x K, times / K; CPU work (per-packet costs, codecs) is not dilated (docs/performance.md).")
             + f" End-to-end times include encode+decode at {meta.get('codec_device', 'this CPU')}."
             + (f" INA results: {meta['results_delivery']}." if meta.get("results_delivery") else "")
             + "".join(f" **{r['method']} n={r['workers']} {r['rate']}: results as unicast copies after the multicast "
                       f"group failed** ({r['multicast_fallback']})." for r in records if r.get("multicast_fallback"))
             + (f" Workers' TCP (Gloo): {meta['tcp_cc']}." if meta.get("tcp_cc") else ""))
    L.append("")
    slow = meta.get("too_slow")
    if slow:
        L.append(f"Not run: {len(slow['skipped'])} configuration(s) whose link-bound time exceeds --max-ring-time "
                 f"{slow['max_ring_time']:g} s per allreduce: "
                 + "; ".join(f"{k} ({v:.0f} s)" for k, v in slow["skipped"].items()) + ".")
        L.append("")
    return L


def _md_targets(records, meta) -> list[str]:
    L = []
    tg = targets(records, meta)
    if tg:
        L += ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
        for t in tg:
            L.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} |")
        L.append("")
    return L


def _md_allreduce(ar, acc, methods, rates, sizes) -> list[str]:
    L = []
    n = _pick_n(ar)
    accd = {}
    base = next((r for r in acc if r["method"] == "gloo"), None)
    if base:
        accd = {r["method"]: (r["final_accuracy"] - base["final_accuracy"]) * 100 for r in acc}
    for el in sizes[::-1]:
        L += [f"## Speedup over Gloo ring fp32 ({n} workers, {el:,} elements) — compare with 3LC Table 1", ""]
        L.append("| method | " + " | ".join(rate_name(r) for r in rates) + " | accuracy diff (points) |")
        L.append("|---" * (len(rates) + 2) + "|")
        for m in methods:
            row = []
            for rate in rates:
                r = _rec(ar, m, n, rate, el)
                row.append(_fmt(r.get("speedup_vs_gloo") if r else None, ".2f")
                           + ("x" if r and r.get("speedup_vs_gloo") is not None else "")
                           + (CPU_MARK if r and r.get("cpu_bound") else ""))
            L.append(f"| {method_label(m)} | " + " | ".join(row) + f" | {_fmt(accd.get(m), '+.2f')} |")
        L.append("")
        if any((r := _rec(ar, m, n, rate, el)) and r.get("cpu_bound") for m in methods for rate in rates):
            L += [f"{CPU_MARK}: CPU-bound row (below, \"CPU-bound rows\"): it measures this machine's CPU, not the "
                  "link.", ""]
    L += ["## All allreduce measurements", "",
          "| workers | rate | elements | method | time (s) | ideal (s) | time/ideal | speedup | up MB/worker | "
          "down MB/worker | bytes vs ring | drops | rel. error | codec CPU (ms) | end-to-end (s) | CPU floor/ideal | "
          "CPU-bound (floor/time) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(ar, key=lambda r: (r["workers"], _rk(r["rate"]), r["elements"], r["method"] != "gloo",
                                       r["method"])):
        g = next((x for x in ar if x["method"] == "gloo" and x["workers"] == r["workers"] and x["rate"] == r["rate"]
                  and x["elements"] == r["elements"]), None)
        bvr = r["wire_up_bytes_per_worker"] / g["wire_up_bytes_per_worker"] if g and g["wire_up_bytes_per_worker"] else None
        L.append(f"| {r['workers']} | {rate_name(r['rate'])} | {r['elements']:,} "
                 f"| {method_label(r['method'])} "
                 f"| {r['time_median']:.4f} | {_fmt(r['ideal_time'], '.4f')} | {_fmt(r['bound_ratio'], '.2f')} | "
                 f"{_fmt(r.get('speedup_vs_gloo'), '.2f')} | {_mb(r['wire_up_bytes_per_worker'])} | "
                 f"{_mb(r['wire_down_bytes_per_worker'])} | {_fmt(bvr, '.3f')} | {r['wire_drops']} | "
                 f"{_fmt(r['rel_error'], '.2g')} | {_fmt(_ms(r.get('codec_time_cpu')), '.3g')} | "
                 f"{_fmt(r.get('time_end_to_end'), '.4f')} | {_fmt(r.get('cpu_floor_ratio'), '.2f')} | "
                 f"{describe(r)} |")
    L.append("")
    return L + _md_cpu_bound(ar)


def _md_cpu_bound(ar) -> list[str]:
    """The notes under the table: what the CPU floor columns mean, which rows are CPU-bound or CPU-tight
    (unshaped ones in a phrase, shaped ones in a small table) and the dilation that would put each
    CPU-bound row under the link's pace."""
    L = [f"**CPU floor** (derived from measured CPU, not measured time): {RULE} The rule's code: "
         "experiments/sweep_cpu.py. "
         "'CPU floor/ideal': the floor over the link-bound ideal; 'CPU-bound': the rule's verdict (yes, tight: "
         "CPU-tight, no) and the floor over the measured time; '–': no CPU figures in the record.", ""]
    bound = [r for r in ar if r.get("cpu_bound")]
    tight = [r for r in ar if r.get("cpu_tight")]
    shaped = [r for r in bound + tight if r.get("ideal_time")]
    unshaped = [r for r in bound if not r.get("ideal_time")]
    if not shaped and not unshaped:
        return L
    head = f"**CPU-bound rows: {len(bound)} of {len(ar)}**"
    if unshaped:
        sh = [r["cpu_floor_share"] for r in unshaped]
        span = f"{min(sh):.2f}" + (f"-{max(sh):.2f}" if max(sh) > min(sh) else "")
        head += (f", {len(unshaped)} of them unshaped (no link sets their pace: they measure the CPU by definition, "
                 f"floor {span} of the time; not dilatable)")
    if tight:
        head += (f"; **CPU-tight rows: {len(tight)}** (within {CPU_BOUND_ABOVE_IDEAL:g}x their ideal: they measure "
                 "the link, with little CPU to spare)")
    L += [head + (". The shaped ones:" if shaped else "."), ""]
    if shaped:
        sizes = len({r["elements"] for r in ar}) > 1
        L += ["| workers | rate | " + ("elements | " if sizes else "") + "method | verdict | time/ideal | "
              "floor/ideal | floor/time | K >= |",
              "|---|---|" + ("---|" if sizes else "") + "---|---|---|---|---|---|"]
        for r in sorted(shaped, key=lambda r: (not r.get("cpu_bound"), r["workers"], _rk(r["rate"]), r["elements"],
                                               r["method"] != "gloo", r["method"])):
            L.append(f"| {r['workers']} | {rate_name(r['rate'])} | " + (f"{r['elements']:,} | " if sizes else "")
                     + f"{method_label(r['method'])} | {'CPU-bound' if r.get('cpu_bound') else 'CPU-tight'} | "
                     f"{_fmt(r.get('bound_ratio'), '.2f')} | {_fmt(r.get('cpu_floor_ratio'), '.2f')} | "
                     f"{_fmt(r.get('cpu_floor_share'), '.2f')} | {_fmt(r.get('cpu_bound_min_dilation'), 'd')} |")
        L.append("")
    if bound:
        L += ["CPU-bound rows' time/ideal and speedups measure this machine's CPU (the emulator), not the emulated "
              "link. To put a shaped one under the link's pace, run it time-dilated: `--dilation auto` (its probe "
              "refuses a factor at which the run is CPU-bound by the rule above) or `--target-rates <rate> "
              "--dilation K` with K at least the one in 'K >=' (the smallest factor at which the floor measured here "
              f"would be under {CPU_BOUND_SHARE:g} of the ideal if the CPU per allreduce stayed as measured: a lower "
              "bound, since the CPU per allreduce grows at slower shaped rates and per-packet wake-ups cost real time "
              "too: docs/performance.md, \"The CPU floor in the sweep's outputs\").", ""]
    return L


def _md_throughput(meta, tp, ar, methods, rates, sizes) -> list[str]:
    L = []
    n = _pick_n(tp)
    L += [f"## Training throughput (samples/s, {n} workers) — compare with the natural-compression paper's "
          "throughput figures", "",
          f"Measured: data-parallel SGD with synthetic data (batch {meta.get('batch', 32)} per worker) of a "
          + (("ResNet with that parameter count and a real conv net's per-tensor layout (``sweep_worker.layout_model``"
              ": ResNet-110 itself at its 1.7 M; 3x4x4 inputs); per step forward+backward, the gradients allreduced "
              "in buckets of the integrations' size (one fused buffer each, in backward's order), SGD step; ")
             if all("tensors" in r for r in tp) else      # rows measured before the per-tensor layout
             "fully connected model with that parameter count; per step forward+backward, one allreduce of all "
             "gradients, SGD step; ") +
          f"{meta.get('tp_steps', '?')} timed steps after one warm-up step. samples/s = "
          "workers x batch x steps / wall time of the slowest rank (in parentheses: ratio to Gloo). The model has "
          "little compute per parameter, like an accelerator; on this 2-core CPU the workers share the cores, "
          "and the median forward+backward time per step is given with each model.", ""]
    models = sorted({(r["elements"], r.get("model") or "") for r in tp})
    for el, name in models:
        ct = sorted(r["compute_time"] for r in tp if r["elements"] == el and r["workers"] == n)
        ct = ct[len(ct) // 2] if ct else float("nan")
        L.append(f"**{name or el} ({el:,} parameters; median compute {ct * 1000:.1f} ms/step per worker)**")
        L.append("")
        L.append("| method | " + " | ".join(rate_name(r) for r in rates) + " |")
        L.append("|---" * (len(rates) + 1) + "|")
        for m in methods:
            row = []
            for rate in rates:
                r = _rec(tp, m, n, rate, el)
                row.append(f"{r['samples_per_s']:.1f} ({r['speedup_vs_gloo']:.2f}x)" if r and r.get("speedup_vs_gloo")
                           else (_fmt(r["samples_per_s"], ".1f") if r else "–"))
            L.append(f"| {method_label(m)} | " + " | ".join(row) + " |")
        L.append("")
    L += ["## Data volume per worker per allreduce (MB sent, link counters) — compare with the natural-compression "
          "paper's data-volume figure", ""]
    L.append("| method | " + " | ".join(f"{el:,}" for el in sizes) + " |")
    L.append("|---" * (len(sizes) + 1) + "|")
    for m in methods:
        row = []
        for el in sizes:
            r = next((x for x in ar if x["method"] == m and x["workers"] == n and x["rate"] != "unlimited"
                      and x["elements"] == el), None)
            row.append(_mb(r["wire_up_bytes_per_worker"]) if r else "–")
        L.append(f"| {method_label(m)} | " + " | ".join(row) + " |")
    L.append("")
    return L


def _md_accuracy(acc) -> list[str]:
    L = []
    base = next((r for r in acc if r["method"] == "gloo"), None)
    L += [f"## Accuracy on scikit-learn digits ({acc[0]['workers']} workers, "
          f"{rate_name(acc[0]['rate'])}, {acc[0]['steps']} SGD steps, same seed and batches)", "",
          "MLP 64-128-10 (9,610 parameters), batch 32 per worker, SGD lr 0.05 momentum 0.9, averaged gradients; "
          "test split 30% (540 images: one image is 0.185 points).", "",
          "| method | final accuracy (%) | diff vs Gloo (points) | training time (s) | of which allreduce (s) |",
          "|---|---|---|---|---|"]
    for r in sorted(acc, key=lambda r: (r["method"] != "gloo", r["method"])):
        d = (r["final_accuracy"] - base["final_accuracy"]) * 100 if base else None
        L.append(f"| {method_label(r['method'])} | {r['final_accuracy'] * 100:.2f} | {_fmt(d, '+.2f')} | "
                 f"{r['train_time']:.2f} | {r['comm_time']:.2f} |")
    L.append("")
    return L


def write_report(out: Path, meta, records, plots: bool = True) -> None:
    images = globals()["plots"](out, records) if plots else []
    (out / "report.md").write_text(report_md(meta, records, images))


def write_docs(out: Path, docs: Path, intro: str) -> None:
    """docs/results.md from a results folder: the figures copied to docs/img/sweep-*.png, the raw results
    to docs/data/sweep-results.json."""
    import json
    import shutil
    data = json.loads((out / "results.json").read_text())
    (docs / "img").mkdir(parents=True, exist_ok=True)
    (docs / "data").mkdir(parents=True, exist_ok=True)
    shutil.copy(out / "results.json", docs / "data" / "sweep-results.json")     # to redraw the figures later
    images = []
    for png in sorted(out.glob("*.png")):
        shutil.copy(png, docs / "img" / f"sweep-{png.name}")
        images.append(png.name)
    body = report_md(data["meta"], data["records"], images, img_prefix="img/sweep-")
    body = body.replace("# ina-sweep report\n", "", 1)
    (docs / "results.md").write_text(intro.rstrip() + "\n\n" + body)


# ------------------------------------------------------------------------------------------------
# The terminal summary at the end of ina-sweep: the headline table and what its numbers mean.
HEADLINE_NOTES = [
    "speedup: Gloo ring fp32's allreduce time / the method's (same workers, size and link rate); > 1 is faster.",
    "(x.xx): time vs ideal = measured time / link-bound ideal: the ring 2(n-1)/n x 4 bytes x N / rate, INA",
    "  N x its widest payload width / rate, headers excluded; 1.00 = the link is the only cost; unshaped: no ideal.",
    "Unshaped rows measure the CPU, not a link (Gloo's C++ ring wins there); shaped rows whose CPU sets the pace: *.",
    "host-aggregated rows are NOT switch-feasible: variable-length messages summed on a CPU by the switch service;",
    "  their ideal is the link time of the bytes they actually sent.",
]


def headline(meta, records) -> list[str]:
    """Speed-up over the ring per rate with time vs ideal, and accuracy, as terminal lines."""
    _note_run(records)
    ar = [r for r in records if r["workload"] == "allreduce"]
    acc = {r["method"]: r for r in records if r["workload"] == "accuracy"}
    if not ar and not acc:
        return ["ina-sweep: no measurements"]
    n = _pick_n(ar) if ar else None
    el = max({r["elements"] for r in ar}, key=lambda e: (sum(1 for r in ar if r["elements"] == e), e)) if ar else None
    rates = sorted({r["rate"] for r in ar}, key=_rk)
    methods = _methods(ar or list(acc.values()))
    base = acc.get("gloo")
    acc_head = ""
    if acc:
        a0 = next(iter(acc.values()))
        acc_head = f"accuracy ({a0['workers']} workers, {rate_name(a0['rate'])}, {a0['steps']} steps)"
    w = max(len(method_label(m)) for m in methods)
    head = f"{'method':<{w}}" + "".join(f"  {rate_name(r):>14}" for r in rates) + (f"  {acc_head}" if acc else "")
    L = ["", f"ina-sweep headline: speedup over the Gloo ring (time vs ideal)"
             + (f", {n} workers, {el:,} elements" if ar else ""), head, "-" * len(head)]
    for m in methods:
        cells = []
        for rate in rates:
            r = _rec(ar, m, n, rate, el)
            sp = r.get("speedup_vs_gloo") if r else None
            cells.append(f"{_fmt(sp, '.2f')}x ({_fmt(r['bound_ratio'], '.2f', '-')})" + ("*" if r.get("cpu_bound") else "")
                         if sp is not None else "-")
        a = acc.get(m)
        at = (f"{a['final_accuracy'] * 100:.2f}% ({(a['final_accuracy'] - base['final_accuracy']) * 100:+.2f})"
              if a and base else (f"{a['final_accuracy'] * 100:.2f}%" if a else "-"))
        L.append(f"{method_label(m):<{w}}" + "".join(f"  {c:>14}" for c in cells) + (f"  {at}" if acc else ""))
    L += ["", "How to read it:"] + ["  " + s for s in HEADLINE_NOTES]
    if any(r.get("cpu_bound") for r in ar):
        L += ["  *: CPU-bound, the row measures this machine's CPU, not the link:", f"    {SHORT_RULE}",
              "    (report.md: the rule, and the dilation that would fix it; --dilation auto)."]
    if acc:
        L.append("  accuracy: final test accuracy on scikit-learn digits, in parentheses the difference to Gloo in "
                 "points (one test image = 0.185 points).")
    return L


def print_headline(out: Path, meta, records, file=None) -> None:
    """The headline table and its notes on the terminal, then where the full report is."""
    import sys
    lines = headline(meta, records) + [f"  Full report: {out / 'report.md'} (every size and worker count, bytes, "
                                       f"errors, throughput); raw data: {out / 'results.json'}"]
    print("\n".join(lines), file=file or sys.stdout, flush=True)
