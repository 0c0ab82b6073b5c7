"""The notes printed under the demo's and the sweep's tables say true things: the expected error of the
norm-scaled quantizers matches what they do, and the demo prints its notes under its table."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ina.compression as C
from experiments.explain import demo_notes, dither_error_range

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["rd", "qsgd", "nd"])
@pytest.mark.parametrize("elements", [10_000, 1_000_000])
def test_expected_error_of_norm_scaled_quantizers_matches_the_codec(name, elements):
    x = (np.random.default_rng(7).standard_normal(elements) * 1e-3).astype(np.float32)
    c = C.get(name)
    err = float(np.linalg.norm(c.decompress(c.compress(x)) - x) / np.linalg.norm(x))
    if name == "nd" and elements < 250_000:     # nd's smallest step is ||x|| / 128: most values lie above it
        assert dither_error_range(c, elements) is None
        return
    lo, hi = dither_error_range(c, elements)       # the codec's own message uses the exact norm: c = 1
    assert hi == pytest.approx(lo * 2 ** 0.5)
    if name == "nd":     # values above the smallest level have smaller errors: the note is an upper estimate
        assert 0.75 * lo < err < 1.02 * lo, (err, lo)
    else:
        assert err == pytest.approx(lo, rel=0.05)


def test_notes_explain_every_large_error_and_group_alike_codecs():
    lines = demo_notes({"bfp32": 1e-8, "rd": 14.0, "qsgd": 13.9, "nd": 3.39, "bgt": 0.9}, 1_000_000)
    text = "\n".join(lines)
    assert "rel. error" in text and "vs fp32" in text
    rd = next(line for line in lines if "rd 14" in line)
    assert "qsgd 13.9" in rd and "norm-scaled" in rd and "10-14" in rd     # one line for both
    assert any("nd 3.39" in line and "2.5-3.5" in line for line in lines)
    assert any("bgt 0.9" in line and "error feedback" in line for line in lines)
    assert "bfp32" not in text                                              # small errors need no note
    assert dither_error_range(C.get("bfp32"), 1000) is None


@pytest.mark.timeout(240)
def test_demo_prints_its_table_then_the_notes():
    p = subprocess.run([sys.executable, "-m", "experiments.demo", "--workers", "2", "--elements", "20000"],
                       cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    table, notes = out.split("How to read it:")
    rows = {ln.split()[0]: ln.split() for ln in table.splitlines() if ln and ln.split()[0] in C.available()}
    assert {"bfp32", "nc", "rd", "nd"} <= set(rows)
    assert float(rows["bfp32"][-1]) < 1e-5
    rd_err = float(rows["rd"][-1])
    lo, hi = dither_error_range(C.get("rd"), 20000)
    assert 0.8 * lo < rd_err < 1.2 * hi                 # what the note says is what the table shows
    assert f"rd {rd_err:.3g}" in notes and "norm-scaled" in notes
