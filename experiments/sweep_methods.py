"""The methods an ina-sweep compares: Gloo's ring, the switch-summable codecs, the host-aggregated ones.

Shared by the sweep (``experiments/sweep.py``) and its report (``experiments/sweep_report.py``).
"""
from __future__ import annotations

CORE_METHODS = ["gloo", "ina:bfp32", "ina:nc", "ina:nc-det", "ina:nd"]
NOT_SEED = {"bfp32", "nc", "nc-det", "nd", "rd"}


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
    return CORE_METHODS + ["ina:rd"] + seed_methods() + host_methods()
