"""The time-to-accuracy report: per-run ratios against the Gloo run of the same seed, statistics over seeds,
the tables and the plot of ``experiments.bench_tta``.

A short training run's final accuracy is chaotic (a relative perturbation of 1e-6 of the gradients moves the
ResNet-style net's final accuracy by about a point), so one run per method cannot tell a codec's effect
from noise. Every method therefore trains from several seeds (model initialisation, every rank's batches,
the stochastic codec's draws); the Gloo run of the same seed is its pair (same initialisation and batches).
Per workload, framework, rate and method, over the seeds:

* the paired differences ``d_s = acc(method, s) - acc(Gloo, s)`` (points): their mean, standard deviation
  and a 95 % confidence interval of the mean (Student's t, ``n - 1`` degrees of freedom);
* the criterion "reaches Gloo's final accuracy within ``margin`` points" as a non-inferiority test: *met*
  when the one-sided 95 % lower bound of the mean difference is above ``-margin``, *not met* when the
  one-sided 95 % upper bound is below ``-margin``, else *inconclusive* with this many seeds;
* "within seed noise": the two-sided 95 % interval contains 0 (no detectable difference to Gloo);
* Gloo's own seed-to-seed standard deviation, the scale of that noise.

Pooled over frameworks ("both"), a seed's difference is the mean over the frameworks' runs of that seed
(their Gloo runs are bit-identical: same model, seed, batches and fp32 averaging), so the pairs stay
independent across seeds.
"""
from __future__ import annotations

import math
import statistics

GROUP = ("workload", "framework", "rate", "ranks", "seed")


def key(r: dict, *fields: str) -> tuple:
    """The run's values of ``fields``; runs from before seeds were recorded are seed 0, before ranks 2."""
    defaults = {"seed": 0, "ranks": 2}
    return tuple(r.get(f, defaults.get(f)) for f in fields)


def time_to(curve: list[dict], target: float) -> float | None:
    """Wall-clock seconds at the first checkpoint whose accuracy reaches ``target`` (None: never)."""
    return next((c["seconds"] for c in curve if c["accuracy"] >= target), None)


def gloo_pair(runs: list[dict], r: dict) -> dict | None:
    """The Gloo run with ``r``'s workload, framework, rate, ranks and seed."""
    return next((b for b in runs if b["method"] == "gloo" and key(b, *GROUP) == key(r, *GROUP)), None)


def summarise(runs: list[dict], margin: float) -> None:
    """Adds, to every run, its Gloo pair's numbers (same workload, framework, rate, ranks, seed) and the ratios."""
    for r in runs:
        base = gloo_pair(runs, r)
        if base is None:
            continue
        target = base["final_accuracy"] - margin / 100
        tta, base_tta = time_to(r["curve"], target), time_to(base["curve"], target)
        r.update(gloo_final_accuracy=base["final_accuracy"], target_accuracy=target,
                 accuracy_vs_gloo_points=100 * (r["final_accuracy"] - base["final_accuracy"]),
                 time_to_target_s=tta, train_time_ratio=r["train_s"] / base["train_s"],
                 speedup_vs_gloo=base["train_s"] / r["train_s"],
                 tta_speedup_vs_gloo=(base_tta / tta) if tta and base_tta else None)


def t_quantile(p: float, dof: int) -> float:
    from scipy.stats import t  # noqa: PLC0415
    return float(t.ppf(p, dof))


def interval(diffs: list[float], margin: float) -> dict:
    """Mean, sd, 95 % intervals of the mean of the paired differences (points) and the verdicts."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return {"n": n, "mean": mean, "sd": None, "ci95": None, "verdict": "one seed: no statistics",
                "within_noise": None}
    sd = statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    two, one = t_quantile(0.975, n - 1) * se, t_quantile(0.95, n - 1) * se
    if mean - one > -margin:
        verdict = "met"
    elif mean + one < -margin:
        verdict = "not met"
    else:
        verdict = f"inconclusive with {n} seeds"
    return {"n": n, "mean": mean, "sd": sd, "ci95": [mean - two, mean + two], "one_sided_lower": mean - one,
            "verdict": verdict, "within_noise": mean - two <= 0 <= mean + two}


def seed_statistics(runs: list[dict], margin: float = 0.5) -> list[dict]:
    """One row per workload, rate, ranks, method and framework (and both frameworks pooled) over the seeds."""
    rows = []
    for wl, rate, ranks, method in dict.fromkeys(key(r, "workload", "rate", "ranks", "method") for r in runs):
        mine = [r for r in runs if key(r, "workload", "rate", "ranks", "method") == (wl, rate, ranks, method)
                and gloo_pair(runs, r) is not None]
        frameworks = list(dict.fromkeys(r["framework"] for r in mine))
        for fw in frameworks + (["both"] if len(frameworks) > 1 else []):
            sel = [r for r in mine if fw in ("both", r["framework"])]
            seeds = sorted({key(r, "seed")[0] for r in sel})
            diffs, accs, gloo_accs = [], [], []
            for s in seeds:
                of_seed = [r for r in sel if key(r, "seed")[0] == s]
                diffs.append(statistics.fmean(100 * (r["final_accuracy"] - gloo_pair(runs, r)["final_accuracy"])
                                              for r in of_seed))
                accs.append(statistics.fmean(100 * r["final_accuracy"] for r in of_seed))
                gloo_accs.append(100 * gloo_pair(runs, of_seed[0])["final_accuracy"])
            speed = [r["speedup_vs_gloo"] for r in sel]
            rows.append({"workload": wl, "framework": fw, "rate": rate, "ranks": ranks, "method": method,
                         "seeds": seeds, "accuracy_mean": statistics.fmean(accs),
                         "accuracy_sd": statistics.stdev(accs) if len(accs) > 1 else None,
                         "gloo_sd": statistics.stdev(gloo_accs) if len(gloo_accs) > 1 else None,
                         "vs_gloo": interval(diffs, margin), "speedup_mean": statistics.fmean(speed),
                         "speedup_min": min(speed), "speedup_max": max(speed),
                         "reached": sum(r.get("time_to_target_s") is not None for r in sel), "runs": len(sel)})
    return rows


# ---- tables -------------------------------------------------------------------------------------------------
def label(method: str) -> str:
    """The method's name in tables; host-aggregated codecs say so."""
    if method == "gloo":
        return "gloo"
    from ina import compression  # noqa: PLC0415
    return method if compression.get(method).aggregation == "switch" else f"{method} (host-aggregated, NOT switch-feasible)"


def run_table(runs: list[dict]) -> str:
    lines = ["| workload | framework | ranks | rate | method | seed | final acc. (%) | vs Gloo (points) | "
             "train time (s) | speed vs Gloo | time to Gloo's final - 0.5 pt (s) | ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        tta = r.get("time_to_target_s")
        lines.append(f"| {r['workload']} | {r['framework']} | {key(r, 'ranks')[0]} | {r['rate']} | {label(r['method'])} "
                     f"| {key(r, 'seed')[0]} | {100 * r['final_accuracy']:.2f} | "
                     f"{r.get('accuracy_vs_gloo_points', 0):+.2f} | {r['train_s']:.1f} | "
                     f"{r.get('speedup_vs_gloo', 1):.2f}x | {'not reached' if tta is None else f'{tta:.1f}'} | "
                     f"{1e3 * r['median_step_s']:.0f} |")
    return "\n".join(lines)


def seed_table(rows: list[dict], margin: float = 0.5) -> str:
    def pm(mean, sd):
        return f"{mean:.2f}" + ("" if sd is None else f" ± {sd:.2f}")

    lines = [f"| workload | framework | rate | method | seeds | final acc. mean ± sd (%) | vs Gloo: mean [95 % CI] "
             f"(points) | Gloo's seed sd | within {margin} pt of Gloo | within seed noise | speed vs Gloo: mean "
             "(min-max) | runs reaching Gloo's final - 0.5 pt |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["method"] == "gloo":
            continue
        v = r["vs_gloo"]
        ci = "" if v["ci95"] is None else f" [{v['ci95'][0]:+.2f}, {v['ci95'][1]:+.2f}]"
        gloo_sd = "-" if r["gloo_sd"] is None else f"{r['gloo_sd']:.2f}"
        noise = "-" if v["within_noise"] is None else ("yes" if v["within_noise"] else "no")
        speed = (f"{r['speedup_mean']:.2f}x" + ("" if r["speedup_min"] == r["speedup_max"] else
                                                f" ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})"))
        lines.append(f"| {r['workload']} | {r['framework']} | {r['rate']} | {label(r['method'])} | {len(r['seeds'])} | "
                     f"{pm(r['accuracy_mean'], r['accuracy_sd'])} | {v['mean']:+.2f}{ci} | "
                     f"{gloo_sd} | {v['verdict']} | {noise} | "
                     f"{speed} | {r['reached']}/{r['runs']} |")
    return "\n".join(lines)


# ---- the plot -----------------------------------------------------------------------------------------------
def plot(runs: list[dict], path) -> None:
    """Accuracy against training wall-clock, one panel per workload/framework/rate/ranks: per method the mean
    over seeds (checkpoint by checkpoint) and a band from the lowest to the highest seed."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from experiments.plot_style import legend_label, style  # noqa: PLC0415

    panels = list(dict.fromkeys(key(r, "workload", "framework", "rate", "ranks") for r in runs))
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        of_panel = [r for r in runs if key(r, "workload", "framework", "rate", "ranks") == panel]
        for method in dict.fromkeys(r["method"] for r in of_panel):
            mine = [r for r in of_panel if r["method"] == method]
            m = "gloo" if method == "gloo" else f"ina:{method}"
            s = style(m)
            points = min(len(r["curve"]) for r in mine)
            secs = [statistics.fmean(r["curve"][i]["seconds"] for r in mine) for i in range(points)]
            accs = [[100 * r["curve"][i]["accuracy"] for r in mine] for i in range(points)]
            ax.plot([0] + secs, [None] + [statistics.fmean(a) for a in accs], color=s.colour, marker=s.marker,
                    linestyle=s.linestyle, markersize=4, label=f"{legend_label(m)} ({len(mine)} seed"
                                                               f"{'s' if len(mine) > 1 else ''})")
            if len(mine) > 1:
                ax.fill_between(secs, [min(a) for a in accs], [max(a) for a in accs], color=s.colour, alpha=0.12)
        wl, fw, rate, ranks = panel
        ax.set_title(f"{wl}, {'Horovod' if fw == 'horovod' else 'DDP'}, {ranks} ranks, {rate}", fontsize=9)
        ax.set_xlabel("training wall-clock (s)")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("Time to accuracy: ranks behind emulated links (tbf/htb), same steps per method; "
                 "line: mean over seeds, band: lowest to highest seed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
