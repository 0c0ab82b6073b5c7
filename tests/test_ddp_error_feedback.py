"""Error feedback through DDP, with real processes and a real `ina-switch` (INA_CODEC=3lc-3v).

What a user relies on: the DDP comm hook keys each bucket, so an error-feedback codec's residuals carry
what one step's encoding lost into the next step, and the mean of the averaged gradients over the steps
approaches the true average; backend 'ina' keys nothing (gloo_patch.torch_backend states the rule), so
there the codec runs without error feedback, and the backend says so once, naming the codec and the hook.
"""
from __future__ import annotations

import pytest
import torch

from test_frameworks import (PY, RUN_TIMEOUT, TESTS, assert_gloo_threads_joined, ina_env, launch_ranks,
                             start_test_switch, wait_all)


@pytest.fixture(scope="module")
def switch(tmp_path_factory):
    sw = start_test_switch(tmp_path_factory.mktemp("switch") / "switch.log")
    yield sw
    sw.stop(timeout=10)


def run_feedback(switch, mode: str, tmp_path) -> list[dict]:
    procs = launch_ranks(2, [PY, str(TESTS / "_fw_ddp_feedback.py"), str(tmp_path), mode],
                         ina_env(switch, "3lc-3v"), tmp_path)
    codes = wait_all(procs, RUN_TIMEOUT, f"ddp error feedback script ({mode})")
    assert codes == [0, 0], [(tmp_path / f"err{r}.txt").read_text()[-3000:] for r in range(2)]
    assert_gloo_threads_joined(tmp_path, 2)
    return [torch.load(tmp_path / f"feedback{r}.pt") for r in range(2)]


def relative_error(approx: torch.Tensor, true: torch.Tensor) -> float:
    return float((approx - true).norm() / true.norm())


def test_ddp_hook_keeps_3lc_residuals_per_bucket(switch, tmp_path):
    ranks = run_feedback(switch, "hook", tmp_path)
    for r, d in enumerate(ranks):
        steps, true = d["steps"], d["true"]
        one, mean = relative_error(steps[-1], true), relative_error(steps.mean(0), true)
        # one step's average is coarse (3 values per element); error feedback makes the running mean converge
        assert one > 0.3, (r, one)
        assert mean < 0.1 * one, (r, one, mean)
        assert d["stats"]["fallback_reasons"] == {}, d["stats"]
        # one residual per bucket (index and parameters): at least two buckets, every key a bucket's
        assert all(k.startswith("('ddp-bucket-") for k in d["keys"]), d["keys"]
        assert len({k.split(":")[0] for k in d["keys"]}) >= 2, d["keys"]
        # ... and within a bucket one residual and one scale per parameter (3LC's per-tensor context)
        per_bucket: dict[str, set] = {}
        for k in d["keys"]:
            bucket, position = k.rsplit(", ", 1)
            per_bucket.setdefault(bucket, set()).add(int(position.rstrip(")")))
        for bucket, positions in per_bucket.items():
            assert positions == set(range(bucket.count(",") + 1)), (bucket, positions)
        # so the first step (no residual yet) moves every parameter: with one scale per bucket, a
        # parameter whose gradients are all below half the bucket's largest one gets exact zeros
        for i, first in enumerate(d["steps"][0].split(d["sizes"])):
            assert first.count_nonzero() > 0, (r, i, d["sizes"])
    assert torch.equal(ranks[0]["steps"], ranks[1]["steps"])
    assert "error feedback is OFF" not in (tmp_path / "err0.txt").read_text()


def test_ina_backend_runs_3lc_without_error_feedback_and_says_so(switch, tmp_path):
    ranks = run_feedback(switch, "ina", tmp_path)
    for r, d in enumerate(ranks):
        steps, true = d["steps"], d["true"]
        assert d["stats"]["error_feedback"] is False
        # no residual: the mean over the steps is no better than one step
        assert relative_error(steps.mean(0), true) > 0.5 * relative_error(steps[-1], true) > 0.15, r
    err0 = (tmp_path / "err0.txt").read_text()
    assert err0.count("backend 'ina' with codec 3lc-3v: error feedback is OFF") == 1, err0[-3000:]
    assert "ina_allreduce_hook" in err0
    assert "error feedback is OFF" not in (tmp_path / "err1.txt").read_text()
