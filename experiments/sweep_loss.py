"""Packet loss as a sweep dimension: ``ina-sweep --loss 0,0.0001,0.001,0.01``.

The loss is the switch's user-space impairment (this kernel has no netem), the same probability in
each direction (worker -> switch and switch -> worker), seeded. It reaches only the traffic that
goes through the switch's data plane: the switch-summable ``ina:<codec>`` methods. Gloo's ring, the
other baselines (TCP between the workers) and the host-aggregated codecs (TCP to the host
aggregator) cannot be impaired there, and this kernel has no qdisc that drops at random (no netem,
no gact), so they run once, lossless, and are shown as the **lossless reference** at every loss
rate (a horizontal line in the plots, labelled so). Every record carries ``loss`` and
``impairment`` (what was emulated and how); the lossless run of each configuration is the reference
of the ratios.
"""
from __future__ import annotations

from pathlib import Path

SEED = 1                    # ingress stream; egress is SEED + 1 (as ina-switch --seed)


def add_arguments(ap) -> None:
    ap.add_argument("--loss", default="0",
                    help="comma-separated packet-loss probabilities, each direction of the switch's links "
                         "(user-space impairments in the switch), e.g. 0,0.0001,0.001,0.01 (default 0). Only "
                         "switch-summable ina:<codec> traffic is impaired; Gloo, the baselines and host-aggregated "
                         "codecs run lossless, as the reference")


def parse_losses(ap, spec: str) -> list[float]:
    """The loss levels, 0 first (the lossless runs are every ratio's reference)."""
    out = []
    for s in spec.split(","):
        try:
            p = float(s)
        except ValueError:
            ap.error(f"--loss {s!r}: expected a probability such as 0.001")
        if not 0.0 <= p < 1.0:
            ap.error(f"--loss {s}: a loss probability must be in [0, 1)")
        out.append(p)
    return sorted(set(out) | {0.0})


def impairable(method: str) -> bool:
    """Does the method's traffic go through the switch's data plane (where the impairments are)?"""
    from .sweep_methods import aggregation
    return aggregation(method) == "switch"


def plan_at(plan: list, loss: float) -> list:
    """The configurations of ``plan`` to run at ``loss``: all at 0; at a loss, those the switch can
    impair (throughput and allreduce workloads of switch-summable methods)."""
    return plan if not loss else [p for p in plan if p[0] != "accuracy" and impairable(p[4])]


def done_at(records: list, loss: float, key_of) -> set:
    return {key_of(r) for r in records if r.get("loss", 0.0) == loss}


def describe(loss: float, method: str | None = None) -> str:
    if method is not None and not impairable(method):
        return "not impaired (TCP, not through the switch's data plane): the lossless reference"
    if not loss:
        return "none (lossless)"
    return f"switch user-space impairment: loss {loss:g} in each direction (seeded), no duplication or reordering"


def set_loss(host: str, port: int, loss: float) -> None:
    """Set the switch's packet loss of both directions to ``loss``, no duplication or reordering (an
    emulated delay the sweep set, experiments/dilation.py, stays)."""
    from ina.control import request
    cfg = {"loss": loss, "duplicate": 0.0, "reorder": 0.0}
    request(host, port, {"op": "impair", "ingress": {**cfg, "seed": SEED}, "egress": {**cfg, "seed": SEED + 1}},
            timeout=10)


def stamp(rec: dict, loss: float) -> dict:
    rec["loss"] = loss
    rec["impairment"] = describe(loss, rec["method"])
    return rec


def lossless(records: list) -> list:
    return [r for r in records if not r.get("loss")]


# ------------------------------------------------------------------------------------------------
# report: a table and a plot of time (and training throughput) against the loss rate
def _series(records: list, workload: str, value: str) -> dict:
    """{(workers, rate, elements): {method: {loss: value}}} of the configurations run at a loss > 0."""
    lossy = {(r["workers"], r["rate"], r["elements"]) for r in records if r["workload"] == workload and r.get("loss")}
    out: dict = {}
    for r in records:
        k = (r["workers"], r["rate"], r["elements"])
        if r["workload"] == workload and k in lossy and r.get(value) is not None:
            out.setdefault(k, {}).setdefault(r["method"], {})[r.get("loss", 0.0)] = r[value]
    return out


def _pct(p: float) -> str:
    return "0" if not p else f"{100 * p:g}%"


def table_md(records: list) -> list[str]:
    lines = []
    for workload, value, unit, fmt in (("allreduce", "time_median", "ms per allreduce", lambda v: f"{v * 1e3:.1f}"),
                                      ("throughput", "samples_per_s", "samples/s", lambda v: f"{v:.0f}")):
        for (n, rate, el), by_m in sorted(_series(records, workload, value).items(), key=str):
            losses = sorted({p for v in by_m.values() for p in v})
            lines += [f"**{workload}**, {n} workers, {rate}, {el:,} elements: {unit} "
                      "(x: against the same method's lossless run)", "",
                      "| method | " + " | ".join(f"loss {_pct(p)}" for p in losses) + " |",
                      "|---|" + "---|" * len(losses)]
            for m, v in sorted(by_m.items()):
                ref = v.get(0.0)
                if not impairable(m):
                    lines.append(f"| {m} (lossless reference, not impaired) | {fmt(ref)} |" + " |" * (len(losses) - 1))
                    continue
                cells = [(fmt(v[p]) + (f" ({v[p] / ref:.2f}x)" if ref and p else "")) if p in v else "–" for p in losses]
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
            lines.append("")
    return lines


def plot(out: Path, records: list) -> list[str]:
    """loss-<workload>-n<N>-<rate>-<elements>.png: the value against the loss rate, one line per
    method; methods the switch cannot impair as a dashed horizontal line at their lossless value."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plot_style import legend_label, style
    made = []
    for workload, value, ylabel, scale in (("allreduce", "time_median", "time per allreduce (ms)", 1e3),
                                          ("throughput", "samples_per_s", "training throughput (samples/s)", 1.0)):
        for (n, rate, el), by_m in sorted(_series(records, workload, value).items(), key=str):
            losses = sorted({p for v in by_m.values() for p in v})
            xs = range(len(losses))
            fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
            for m, v in sorted(by_m.items()):
                st = style(m).kw()
                if impairable(m):
                    pts = [(i, v[p] * scale) for i, p in enumerate(losses) if p in v]
                    ax.plot(*zip(*pts), label=legend_label(m), **st)
                elif 0.0 in v:
                    ax.axhline(v[0.0] * scale, color=st.get("color"), linestyle="--", linewidth=1.2,
                               label=f"{legend_label(m)}: lossless reference (TCP, not impaired)")
            ax.set_xticks(list(xs), [_pct(p) for p in losses])
            ax.set_xlabel("packet loss, each direction (switch user-space impairment)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{workload} under packet loss: {n} workers, {rate}, {el:,} elements", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            name = f"loss-{workload}-n{n}-{rate}-{el}.png"
            fig.savefig(out / name, dpi=120)
            plt.close(fig)
            made.append(name)
    return made


def write_section(out: Path, records: list, plots: bool = True) -> list[str]:
    """Append the packet-loss section to report.md (when the sweep ran at a loss > 0)."""
    if not any(r.get("loss") for r in records):
        return []
    images = plot(out, records) if plots else []
    text = ["", "## Packet loss", "", __doc__.split("\n\n", 1)[1].strip(), "", *table_md(records),
            *[f"![{i}]({i})" for i in images], ""]
    with open(out / "report.md", "a") as f:
        f.write("\n".join(text))
    return images
