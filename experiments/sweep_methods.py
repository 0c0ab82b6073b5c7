"""The methods an ina-sweep compares: Gloo's ring, the strong non-INA baselines
(``experiments.baselines``), the switch-summable codecs, the host-aggregated ones.

Shared by the sweep (``experiments/sweep.py``) and its report (``experiments/sweep_report.py``).
"""
from __future__ import annotations

from .baselines import BASELINES, is_baseline

CORE_METHODS = ["gloo", "ina:bfp32", "ina:nc", "ina:nc-det", "ina:nd"]
NOT_SEED = {"bfp32", "nc", "nc-det", "nd", "rd", "thc"}


def seed_methods() -> list[str]:
    """Every switch-summable codec of the seed papers (3LC, thresholded, MQGrad, TernGrad, QSGD ...)."""
    from ina import compression
    return [f"ina:{n}" for n in compression.available() if n not in NOT_SEED and compression.get(n).switch_summable]


def host_methods() -> list[str]:
    """Codecs with variable-length messages (3lc, eaq, wgt): they run through the switch service's host
    aggregator (decode, sum, re-encode on a CPU), labelled NOT switch-feasible in every output."""
    from ina import compression
    return [f"ina:{n}" for n in compression.available() if compression.get(n).aggregation == "host"]


def is_host_method(method: str) -> bool:
    if not method.startswith("ina:"):
        return False
    from ina import compression
    return compression.get(method[4:]).aggregation == "host"


def all_methods() -> list[str]:
    return CORE_METHODS + list(BASELINES) + ["ina:rd", "ina:thc"] + seed_methods() + host_methods()


def aggregation(method: str) -> str:
    """Where the method's sum is formed, in the words of the results table."""
    if method == "gloo":
        return "Gloo ring"
    if is_baseline(method):
        return BASELINES[method]
    return "host (NOT switch-feasible)" if is_host_method(method) else "switch"


def method_label(method: str) -> str:
    """The method's name in the report's plots and tables."""
    if method == "gloo":
        return "Gloo ring fp32"
    if is_baseline(method):
        return BASELINES[method]
    return f"host-aggregated {method[4:]} (NOT switch-feasible)" if is_host_method(method) else "INA " + method[4:]
