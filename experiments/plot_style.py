"""One look per method in every sweep plot: colour hue = codec family, shade + marker = the method,
line style = where the sum is computed.

* family: the codec's module in ``ina.compression`` (natural compression, dithering, 3LC, thresholded
  transfers, ...), one hue per family, a lighter or darker shade per member;
* marker: unique per method (the registry's order), so a method can be told apart in greyscale too;
* line style: solid = switch-summable INA codec, dashed = host-aggregated (NOT switch-feasible),
  dotted = baseline (Gloo ring).

Styles depend only on the registry, never on which methods one plot happens to show, so a method
looks the same in every figure.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

BASELINE_COLOUR = "#000000"
# families in this order get these tab10 hues (grey is left out: too close to the black baseline);
# a family not listed (a new codec module) takes the next hue
FAMILY_ORDER = ["natural", "bfp", "dithering", "terngrad", "mqgrad", "thresholded", "threelc", "entropy_huffman"]
HUES = ["#1f77b4", "#d62728", "#2ca02c", "#17becf", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#bcbd22"]
SAME_FAMILY = {"qsgd": "dithering"}   # QSGD's stochastic levels are random dithering's (rd is "QSGD-like")
BASELINE_MARKERS = ["x", "+", "1"]
MARKERS = ["o", "s", "^", "v", "D", "P", "X", "*", "p", "h", "<", ">", "d", "H", "8"]
LINESTYLE = {"switch": "-", "host": "--", "baseline": ":"}
SHADES = [0.0, 0.45, -0.35, 0.7]      # >0: towards white, <0: towards black
FAMILY_NAME = {"bfp": "block floating point", "natural": "natural compression",
               "dithering": "dithering / QSGD", "threelc": "3LC", "thresholded": "thresholded transfers", "mqgrad": "MQGrad",
               "terngrad": "TernGrad", "entropy_huffman": "entropy + Huffman"}


@dataclass(frozen=True)
class Style:
    colour: str
    marker: str
    linestyle: str
    family: str

    def kw(self) -> dict:
        """Keyword arguments for ``Axes.plot``."""
        return {"color": self.colour, "marker": self.marker, "linestyle": self.linestyle, "markersize": 6,
                "markeredgecolor": self.colour if self.family == "baseline" else "black",
                "markeredgewidth": 0.5, "linewidth": 1.6}


def shade(colour: str, amount: float) -> str:
    """``colour`` mixed with white (amount > 0) or black (amount < 0)."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    tgt = 255 if amount > 0 else 0
    a = abs(amount)
    return "#" + "".join(f"{round(c + (tgt - c) * a):02x}" for c in rgb)


def family(method: str) -> str:
    if not method.startswith("ina:"):
        return "baseline"
    from ina import compression
    mod = type(compression.get(method[4:])).__module__.rsplit(".", 1)[-1]
    return SAME_FAMILY.get(mod, mod)


def aggregation(method: str) -> str:
    """baseline, switch or host (the codec's declared aggregation: host = NOT switch-feasible)."""
    if not method.startswith("ina:"):
        return "baseline"
    from .sweep_methods import is_host_method
    return "host" if is_host_method(method) else "switch"


@lru_cache(maxsize=None)
def styles(extra: tuple[str, ...] = ()) -> dict[str, Style]:
    """Every registered method's style (plus ``extra`` methods such as other baselines)."""
    from ina import compression
    methods = ["gloo"] + [f"ina:{c}" for c in compression.available()] + [m for m in extra if m != "gloo"]
    methods = list(dict.fromkeys(methods))
    fams: dict[str, list[str]] = {f: [] for f in ["baseline"] + FAMILY_ORDER}
    for m in methods:
        fams.setdefault(family(m), []).append(m)
    out: dict[str, Style] = {}
    k = hue_i = 0
    for fam, members in fams.items():
        if not members:
            continue
        for j, m in enumerate(members):
            if fam == "baseline":           # black (further baselines: greys), unfilled markers
                out[m] = Style(shade("#808080", -1 + 0.5 * min(j, 1.6)),
                               BASELINE_MARKERS[j % len(BASELINE_MARKERS)], LINESTYLE["baseline"], fam)
                continue
            amount = SHADES[j % len(SHADES)]
            colour = shade(HUES[hue_i % len(HUES)], amount) if amount else HUES[hue_i % len(HUES)]
            out[m] = Style(colour, MARKERS[k % len(MARKERS)], LINESTYLE[aggregation(m)], fam)
            k += 1
        hue_i += fam != "baseline"
    return out


def style(method: str) -> Style:
    s = styles()
    return s[method] if method in s else styles((method,))[method]


def legend_order(methods) -> list[str]:
    """Methods grouped by family (baseline first), as the legend lists them."""
    rank = {m: i for i, m in enumerate(styles(tuple(methods)))}
    return sorted(methods, key=lambda m: rank[m])


def legend_label(method: str) -> str:
    """Short legend entry: the codec name, its family and, for host-aggregated ones, NOT switch-feasible."""
    if method == "gloo":
        return "Gloo ring fp32 (baseline)"
    fam = FAMILY_NAME.get(family(method), family(method))
    tail = ", host-aggregated, NOT switch-feasible" if aggregation(method) == "host" else ""
    return f"{method[4:]} ({fam}{tail})"
