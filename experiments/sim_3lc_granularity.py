"""One-process simulation of 2-rank data-parallel training of the time-to-accuracy embedding model
(``experiments/tta_workloads.py``), to tell a codec's own loss from its integration's: no network,
no switch. Each step both ranks' gradients are averaged either exactly (``avg``, = Gloo) or by the
3lc-3v switch path over the Codec interface (shared M negotiated as the max of both ranks'
``scale_exponent``, int8 3-values summed, ``decode_sum`` / 2, error feedback on), with one key and
one M for the whole model (``bucket``: what one DDP bucket of all parameters gets) or per parameter
(``tensor``: 3LC's per-tensor compression context). SGD, momentum 0.9, linear decay, as bench_tta.

    python -m experiments.sim_3lc_granularity --lr 1.0 --modes avg,bucket,tensor --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from experiments.tta_workloads import accuracy, make
from ina import compression
from ina.compression.base import ScaleContext

MODES = ("avg", "bucket", "tensor")


def average(grads: list[list[torch.Tensor]], codecs, groups: list[list[int]]) -> list[torch.Tensor]:
    """Both ranks' gradients averaged through the 3lc-3v switch path, one key (and M) per group."""
    out: list[torch.Tensor | None] = [None] * len(grads[0])
    for gi, grp in enumerate(groups):
        flats = [torch.cat([g[i].reshape(-1) for i in grp]).numpy().astype(np.float32) for g in grads]
        ctx = ScaleContext(exponent=max(c.scale_exponent(f, gi) for c, f in zip(codecs, flats)),
                           n_workers=len(codecs))
        total = sum(c.encode_shared(f, ctx, gi).astype(np.int32) for c, f in zip(codecs, flats))
        dec = codecs[0].decode_sum(total, ctx) / len(codecs)
        off = 0
        for i in grp:
            n = grads[0][i].numel()
            out[i] = torch.from_numpy(dec[off:off + n].copy()).view_as(grads[0][i])
            off += n
    return out


def train(mode: str, lr0: float, steps: int, batch: int, seed: int, s: float) -> float:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    torch.set_num_threads(1)
    model, data, test = make("embedding", seed, 0)
    data = [data, make("embedding", seed, 1)[1]]
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1.0, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr0 * (1 - k / steps))
    codecs = [type(compression.get("3lc-3v"))(s=s) for _ in data]
    groups = [list(range(len(params)))] if mode == "bucket" else [[i] for i in range(len(params))]
    for _ in range(steps):
        grads = []
        for d in data:
            x, y = d.sample(batch)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.detach().clone() for p in params])
        new = [(a + b) / 2 for a, b in zip(*grads)] if mode == "avg" else average(grads, codecs, groups)
        for p, g in zip(params, new):
            p.grad = g
        opt.step()
        sched.step()
    return accuracy(model, test)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--lr", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16, help="per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--s", type=float, default=1.0, help="3LC sparsity multiplier")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    rows = []
    for mode in a.modes.split(","):
        acc = train(mode, a.lr, a.steps, a.batch, a.seed, a.s)
        rows.append({"mode": mode, "lr": a.lr, "s": a.s, "steps": a.steps, "seed": a.seed, "accuracy": acc})
        print(f"{mode:7s} lr {a.lr:g} s {a.s:g}: final accuracy {100 * acc:.2f} %", file=sys.stderr, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"what": "one-process simulation, 2 ranks, 3lc-3v switch path", "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
