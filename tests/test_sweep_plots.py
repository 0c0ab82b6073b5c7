"""The sweep's figures can be read: every method has its own (colour, marker, line style), families
share a hue, line style says where the sum is computed, and legends sit outside the axes."""
from __future__ import annotations

import colorsys

import matplotlib
import pytest

matplotlib.use("Agg")

from experiments.plot_style import legend_label, style, styles  # noqa: E402
from experiments.sweep_methods import all_methods, is_host_method  # noqa: E402


def _hue(colour: str) -> float:
    r, g, b = (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return colorsys.rgb_to_hls(r, g, b)[0]


def test_every_method_has_a_unique_look():
    methods = all_methods()
    looks = {m: (style(m).colour, style(m).marker, style(m).linestyle) for m in methods}
    assert len(set(looks.values())) == len(methods), looks
    # distinct even without colour (greyscale print) and without line style: markers alone
    assert len({style(m).marker for m in methods}) == len(methods)
    assert len({style(m).colour for m in methods}) == len(methods)


def test_families_share_a_hue_and_line_style_says_where_the_sum_is():
    s = styles()
    assert _hue(s["ina:nc"].colour) == pytest.approx(_hue(s["ina:nc-det"].colour), abs=0.02)
    assert _hue(s["ina:3lc"].colour) == pytest.approx(_hue(s["ina:3lc-3v"].colour), abs=0.02)
    assert _hue(s["ina:nc"].colour) != pytest.approx(_hue(s["ina:bfp32"].colour), abs=0.05)
    for m in all_methods():
        want = ":" if m == "gloo" else ("--" if is_host_method(m) else "-")
        assert style(m).linestyle == want, m
        assert ("NOT switch-feasible" in legend_label(m)) == is_host_method(m)
    # a method outside the registry (another baseline) still gets a look of its own
    assert style("mpi") != style("gloo")


def _records():
    recs = []
    for k, m in enumerate(all_methods()):
        for n in (2, 4):
            for j, rate in enumerate(("10mbit", "100mbit", "1gbit")):
                t = (1 + k / 10) / (j + 1) * (1 + n / 10)
                recs.append({"workload": "allreduce", "method": m, "workers": n, "rate": rate, "elements": 1000,
                             "time_median": t, "ideal_time": t / 1.1, "speedup_vs_gloo": 1 + k / 5,
                             "wire_up_bytes_per_worker": 4000 / (1 + k), "wire_down_bytes_per_worker": 4000})
                recs.append({"workload": "throughput", "method": m, "workers": n, "rate": rate, "elements": 1000,
                             "model": "resnet110", "samples_per_s": 100 * (1 + k / 5)})
        recs.append({"workload": "accuracy", "method": m, "workers": 4, "rate": "100mbit",
                     "curve": [{"step": s, "time": s / 10, "accuracy": 0.5 + s / 100 - k / 1000} for s in range(0, 40, 4)]})
    return recs


def test_plots_show_every_method_with_its_look_and_the_legend_outside(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    from experiments import sweep_report
    seen = {}

    def keep(fig, path):                       # saved as usual, kept open for inspection
        fig.savefig(path, dpi=sweep_report.DPI)
        seen[path.name] = fig
    monkeypatch.setattr(sweep_report, "_save", keep)
    made = sweep_report.plots(tmp_path, _records())
    assert set(made) == {"speedup_vs_bandwidth.png", "bytes_vs_time.png", "scaling_workers.png", "throughput.png",
                         "accuracy.png"}
    for name in made:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        fig = seen[name]
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        (leg,) = fig.legends
        lb = leg.get_window_extent(r)
        for ax in fig.axes:                    # the legend covers no axes
            ab = ax.get_window_extent(r)
            assert lb.x0 >= ab.x1 - 1 or not lb.overlaps(ab), name
        labels = [t.get_text() for t in leg.get_texts()]
        want = all_methods() if name in ("speedup_vs_bandwidth.png", "bytes_vs_time.png", "throughput.png",
                                         "accuracy.png") else ["gloo", "ina:bfp32", "ina:nc", "ina:nc-det", "ina:nd"]
        assert {legend_label(m) for m in want} <= set(labels), name
        # every line drawn for a method has that method's look
        looks = {(style(m).colour, style(m).marker, style(m).linestyle) for m in want}
        for ax in fig.axes:
            for ln in ax.get_lines():
                if ln.get_marker() not in ("None", None, ""):
                    c = matplotlib.colors.to_hex(ln.get_color())
                    assert (c, ln.get_marker(), ln.get_linestyle()) in looks, (name, c, ln.get_marker())
        plt.close(fig)
