"""Error feedback through Horovod's fusion, with real horovodrun and a real `ina-switch` (INA_CODEC=3lc-3v).

What a user relies on: two named gradients fused into one buffer each keep their own residual and their own
scale (as 3LC keeps one compression context per tensor, and as the DDP comm hook does per parameter), so a
gradient much smaller than the other is not sent as zeros, and over the steps the mean of the averages
approaches the true average.
"""
from __future__ import annotations

import torch

from test_frameworks import TESTS, horovod_ready, horovodrun, ina_env, switch  # noqa: F401 - fixtures


def relative_error(approx: torch.Tensor, true: torch.Tensor) -> float:
    return float((approx - true).norm() / true.norm())


def test_horovod_fusion_keeps_3lc_residuals_per_tensor(switch, horovod_ready, tmp_path):  # noqa: F811
    horovodrun(2, [str(TESTS / "_fw_hvd_feedback.py"), str(tmp_path)], ina_env(switch, "3lc-3v"),
               "horovodrun error feedback script")
    ranks = [torch.load(tmp_path / f"feedback{r}.pt") for r in range(2)]
    for r, d in enumerate(ranks):
        st = d["stats"]
        assert st["fallback_calls"] == 0, st["fallback_reasons"]
        assert st["agreement_rounds"] == 30 and st["offloaded_tensors"] == 60, st   # one bucket a step, both fused
        # one residual per tensor of the fused buffer, keyed by its name and position
        assert sorted(d["keys"]) == ["('grad.big', 0)", "('grad.small', 0)"], d["keys"]
        for i, (first, true) in enumerate(zip(d["steps"][0].split(d["sizes"]), d["true"].split(d["sizes"]))):
            # its own scale: the small gradient moves in the first step (no residual yet); with one scale for
            # the buffer (3lc-3v: M = max |g|, values below M/2 sent as 0) it would be exact zeros
            assert first.count_nonzero() > 0, (r, i)
            one = relative_error(first, true)
            mean = relative_error(d["steps"][:, sum(d["sizes"][:i]):sum(d["sizes"][:i + 1])].mean(0), true)
            assert mean < 0.2 * one, (r, i, one, mean)      # error feedback: the running mean converges
    assert torch.equal(ranks[0]["steps"], ranks[1]["steps"])
