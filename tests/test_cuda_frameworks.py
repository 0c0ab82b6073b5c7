"""CUDA models through every framework entry point (the `ina` backend, the DDP hook, Horovod): training on
the GPU matches the CPU Gloo run, the gradients are reduced on the GPU. Runs where CUDA exists; the
staging logic itself is tested on the CPU in test_staging.py."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, os.path.dirname(__file__))
from test_frameworks import (EXAMPLES, check_bfp_step, check_grads_agree, check_training, gloo_baseline,  # noqa: E402
                             horovod_ready, horovodrun, ina_env, load_run, switch, torchrun)

__all__ = ["horovod_ready", "switch"]     # fixtures, used by name


@pytest.mark.parametrize("mode", ["ina", "hook"])
def test_ddp_cuda_model_matches_cpu_gloo(mode, switch, tmp_path_factory):
    gloo_results, _ = gloo_baseline("ddp", 2, tmp_path_factory.getbasetemp())
    out = tmp_path_factory.mktemp(f"ddp_cuda_{mode}")
    how = ["--backend", "ina"] if mode == "ina" else ["--backend", "gloo", "--ina-hook"]
    torchrun(2, [str(EXAMPLES / "train_ddp.py"), *how, "--device", "cuda", "--out-dir", str(out)],
             ina_env(switch, "bfp32"), f"torchrun -np 2 {mode} on CUDA")
    results, grads = load_run(out, 2)
    assert all(t.device.type == "cuda" for g in grads for t in g["reduced"].values())
    grads = [{k: {n: t.cpu() for n, t in v.items()} for k, v in g.items()} for g in grads]
    check_grads_agree(grads)
    # bit-identical to the integer reference of this run's (GPU-computed) local gradients; the GPU's
    # local gradients differ from the CPU's in the last bits, so the Gloo comparison is check_training's
    check_bfp_step(grads, grads, flatten=True)
    check_training(results, gloo_results, "bfp32")
    assert results[0]["ina"]["fallback_calls"] == 0


def test_horovod_cuda_model_matches_cpu_gloo(switch, horovod_ready, tmp_path_factory):
    gloo_results, _ = gloo_baseline("horovod", 2, tmp_path_factory.getbasetemp())
    out = tmp_path_factory.mktemp("hvd_cuda")
    horovodrun(2, [str(EXAMPLES / "train_horovod.py"), "--device", "cuda", "--out-dir", str(out)],
               ina_env(switch, "bfp32"), "horovodrun -np 2 on CUDA (bfp32)")
    results, grads = load_run(out, 2)
    grads = [{k: {n: t.cpu() for n, t in v.items()} for k, v in g.items()} for g in grads]
    check_grads_agree(grads)
    check_training(results, gloo_results, "bfp32")
    st = results[0]["ina"]
    assert st["fallback_calls"] == 0 and st["offloaded_tensors"] == 200 * 6
