"""The framework test scripts' case recorder: each case's outcome (result, or the exception's type, its
classes and message) and its time, written out for the test to judge."""
from __future__ import annotations

import time


def run_case(cases: dict, name: str, fn) -> None:
    t0 = time.monotonic()
    try:
        res = fn()
        cases[name] = {"ok": True, "seconds": time.monotonic() - t0, "result": res}
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        cases[name] = {"ok": False, "seconds": time.monotonic() - t0, "type": type(e).__name__,
                       "types": [c.__name__ for c in type(e).__mro__], "message": str(e)}
