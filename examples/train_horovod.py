"""A normal Horovod training script (nothing INA-specific in it): an MLP on scikit-learn's digits.

    horovodrun -np 4 -H localhost:4 --gloo python examples/train_horovod.py                 # Gloo
    INA_SWITCH=127.0.0.1:9999 horovodrun -np 4 -H localhost:4 --gloo python examples/train_horovod.py
    python -m gloo_patch.horovodrun --start-switch -- -np 4 -H localhost:4 --gloo python examples/train_horovod.py

With INA_SWITCH set, the patch that `make install` hooks into the venv sends the gradient
allreduces of hvd.DistributedOptimizer through the switch (see docs/frameworks.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_common import (Shard, full_loss, load_digits_tensors, local_grads, make_model,  # noqa: E402
                           param_checksum, save_grads, write_result)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="per-rank mini-batch")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                    help="dtype of the gradients on the wire (fp16 uses hvd.Compression.fp16)")
    ap.add_argument("--groups", type=int, default=0, help="DistributedOptimizer groups (0: one allreduce per tensor)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i] (CUDA tensors are staged through host memory)")
    ap.add_argument("--progress-every", type=int, default=20)
    ap.add_argument("--out-dir", help="write rank<r>.json (losses) and grads_rank<r>.pt (step-1 gradients)")
    args = ap.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    dev = torch.device(args.device)
    x, y = load_digits_tensors()
    x, y = x.to(dev), y.to(dev)
    shard = Shard(x, y, rank, size, args.batch, args.seed)
    model = make_model(args.seed).to(dev)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = {"float32": hvd.Compression.none, "float16": hvd.Compression.fp16}.get(args.dtype)
    if args.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
        x = x.to(torch.bfloat16)
        compression = hvd.Compression.none
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   op=hvd.Average, groups=args.groups or None)
    if rank == 0:
        print(f"[train_horovod] {size} ranks, {args.steps} steps, batch {args.batch}/rank, {args.dtype}, "
              f"loss at start {full_loss(model, x, y):.4f}", flush=True)
    t0 = time.monotonic()
    losses = []
    for step in range(args.steps):
        xb, yb = shard.next()
        if args.dtype == "bfloat16":
            xb = xb.to(torch.bfloat16)
        local = local_grads(model, xb, yb) if step == 0 and args.out_dir else None
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        if local is not None:
            opt.synchronize()
            save_grads(args.out_dir, rank, local, {n: p.grad.detach().clone() for n, p in model.named_parameters()})
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        losses.append(float(loss.detach()))
        if rank == 0 and (step % args.progress_every == 0 or step == args.steps - 1):
            print(f"[train_horovod] step {step} loss {float(loss.detach()):.4f} ({time.monotonic() - t0:.1f}s)", flush=True)
    final = full_loss(model, x, y)
    result = {"ranks": size, "steps": args.steps, "final_loss": final, "losses": losses,
              "checksum": param_checksum(model), "seconds": time.monotonic() - t0}
    try:
        import gloo_patch.horovod as ina_hvd
        result["ina"] = ina_hvd.stats() if ina_hvd.installed() else None
    except ImportError:
        result["ina"] = None
    write_result(args.out_dir, rank, result)
    if rank == 0:
        print(f"[train_horovod] done: full-data loss {final:.4f} after {args.steps} steps "
              f"({time.monotonic() - t0:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
