"""Why a codec's numbers look the way they do: the short notes printed under the demo's and the
sweep's tables (a relative error of 14 is expected of a norm-scaled quantizer on a 1M tensor)."""
from __future__ import annotations

import math


def dither_error_range(codec, elements: int) -> tuple[float, float] | None:
    """Expected relative L2 error of one norm-scaled dithering (rd, qsgd, nd) of N(0, s^2) values.

    A value |x_i| below the smallest level step L = c * ||x|| / s_eff is rounded, unbiased, to 0 or L:
    variance |x_i| * L. Summed over the tensor: L * ||x||_1 = c * ||x|| * ||x||_1 / s_eff, and for
    Gaussian values ||x||_1 / ||x|| = sqrt(2/pi) * sqrt(d), so the relative error is about
    sqrt(sqrt(2/pi) * sqrt(d) * c / s_eff). c = 2^E / ||x|| is 1 for the codec's own message and in
    [1, 2) on the switch path (a power-of-two norm bound shared by the workers); s_eff = s levels
    (rd, qsgd) or 2^(s-1) (nd: smallest level 2^(1-s)). The estimate holds while most values are
    below one step (sqrt(d) >= 4 s_eff); None outside that range and for other codecs.
    """
    levels = getattr(codec, "levels", None)
    if levels is None or not hasattr(codec, "natural"):
        return None
    s_eff = 2.0 ** (levels - 1) if codec.natural else float(levels)
    if math.sqrt(elements) < 4 * s_eff:
        return None
    k = math.sqrt(2 / math.pi) * math.sqrt(elements) / s_eff
    return math.sqrt(k), math.sqrt(2 * k)


def error_note(name: str, elements: int) -> str:
    """One line: why codec ``name`` has the relative error it has on a tensor of ``elements`` values."""
    from ina import compression
    c = compression.get(name)
    rng = dither_error_range(c, elements)
    if rng:
        return (f"norm-scaled quantizer: values rounded, unbiased, to levels of the whole tensor's norm; for "
                f"{elements:,} Gaussian values expect {rng[0]:.2g}-{rng[1]:.2g} (grows as d^(1/4))")
    if getattr(c, "error_feedback", False):
        return "error feedback: the unsent part is kept (residual) for later rounds; one round's error is large"
    if c.adaptive_width:
        return "few-bit uniform codes whose width an agent adapts (starting at 2 bits): small values round to 0"
    return ("unbiased" if c.unbiased else "biased") + ": " + c.description


DEMO_COLUMNS = [
    "time ms: one allreduce on loopback after one warm-up, rank 0's wall time; no link is emulated here",
    "  (CPU-bound: ina-sweep shapes the links and compares with the Gloo ring).",
    "bytes sent/worker: what rank 0's client sent, packet headers included; vs fp32 = that / (4 bytes x elements).",
    "rel. error: ||result - exact sum|| / ||exact sum||, the exact sum in float64 from the same inputs.",
]


def demo_notes(errors: dict[str, float], elements: int) -> list[str]:
    """The lines printed under the demo's table: the columns, then every codec whose error is not small."""
    out = ["", "How to read it:"] + ["  " + s for s in DEMO_COLUMNS]
    groups: dict[str, list[str]] = {}
    for n, e in errors.items():
        if e > 0.05:
            groups.setdefault(error_note(n, elements), []).append(f"{n} {e:.3g}")
    if groups:
        out.append("  Why some errors are large (SGD needs an unbiased sum, not an exact one; the sweep's accuracy "
                   "table is the check):")
        for note, who in groups.items():
            out.append(f"    {', '.join(who)}: {note}")
    return out
