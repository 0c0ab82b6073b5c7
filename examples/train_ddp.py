"""DDP training with the INA process group: an MLP on scikit-learn's digits.

    ina-switch serve --port 9999 &
    INA_SWITCH=127.0.0.1:9999 torchrun --nproc-per-node 4 examples/train_ddp.py --backend ina
    torchrun --nproc-per-node 4 examples/train_ddp.py --backend gloo                         # baseline
    INA_SWITCH=127.0.0.1:9999 torchrun --nproc-per-node 4 examples/train_ddp.py --backend gloo --ina-hook

--backend ina: torch.distributed backend 'ina' (gloo_patch.torch_backend): DDP's gradient
allreduces go through the switch, its broadcasts and everything else through an inner Gloo group.
--ina-hook: keep the gloo backend and register the INA DDP communication hook instead.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch._dynamo  # noqa: F401 - before init_process_group: see the end of main()
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_common import (Shard, full_loss, load_digits_tensors, local_grads, make_model,  # noqa: E402
                           param_checksum, save_grads, write_result)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("gloo", "ina"), default="ina")
    ap.add_argument("--ina-hook", action="store_true", help="gloo backend + the INA DDP communication hook")
    ap.add_argument("--switch", help="host:port of the switch (default: $INA_SWITCH)")
    ap.add_argument("--codec", help="switch codec (default: $INA_CODEC or nc)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="per-rank mini-batch")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                    help="dtype of the model (and so of the gradient buckets)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i] (CUDA tensors are staged through host memory)")
    ap.add_argument("--progress-every", type=int, default=20)
    ap.add_argument("--out-dir", help="write rank<r>.json (losses) and grads_rank<r>.pt (step-1 gradients)")
    args = ap.parse_args()
    if args.switch:
        os.environ["INA_SWITCH"] = args.switch
    if args.codec:
        os.environ["INA_CODEC"] = args.codec
    if args.backend == "ina" and args.ina_hook:
        ap.error("--ina-hook is for the gloo backend")

    if args.backend == "ina":
        import gloo_patch.torch_backend  # noqa: F401 - registers backend 'ina'
    dist.init_process_group(args.backend)
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    x, y = load_digits_tensors()
    x, y = x.to(dev, dtype), y.to(dev)
    shard = Shard(x, y, rank, size, args.batch, args.seed)
    module = make_model(args.seed).to(dev, dtype)
    model = DDP(module)
    hook_state = None
    if args.ina_hook:
        from gloo_patch.torch_backend import InaHookState, ina_allreduce_hook
        hook_state = InaHookState()
        model.register_comm_hook(hook_state, ina_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    if rank == 0:
        how = "gloo + INA comm hook" if args.ina_hook else args.backend
        print(f"[train_ddp] {size} ranks, backend {how}, {args.steps} steps, batch {args.batch}/rank, {args.dtype}, "
              f"loss at start {full_loss(module, x, y):.4f}", flush=True)
    t0 = time.monotonic()
    losses = []
    for step in range(args.steps):
        xb, yb = shard.next()
        local = local_grads(module, xb, yb) if step == 0 and args.out_dir else None
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        if local is not None:
            save_grads(args.out_dir, rank, local, {n: p.grad.detach().clone() for n, p in module.named_parameters()})
        opt.step()
        losses.append(float(loss.detach()))
        if rank == 0 and (step % args.progress_every == 0 or step == args.steps - 1):
            print(f"[train_ddp] step {step} loss {float(loss.detach()):.4f} ({time.monotonic() - t0:.1f}s)", flush=True)
    final = full_loss(module, x, y)
    result = {"ranks": size, "steps": args.steps, "final_loss": final, "losses": losses,
              "checksum": param_checksum(module), "seconds": time.monotonic() - t0, "ina": None}
    if hook_state is not None:
        result["ina"] = hook_state.stats()
    elif args.backend == "ina":
        result["ina"] = dist.distributed_c10d._get_default_group().stats()
    write_result(args.out_dir, rank, result)
    if rank == 0:
        print(f"[train_ddp] done: full-data loss {final:.4f} after {args.steps} steps ({time.monotonic() - t0:.1f}s)",
              flush=True)
    # every rank reaches this point before any rank closes its Gloo connections: a rank whose peer
    # closes while it still computes (its full-data loss, its files) can see the close as an error
    dist.barrier()
    if hook_state is not None:
        hook_state.close()
    # destroy_process_group joins Gloo's worker threads only when it drops the last reference to the group;
    # one left running can drop a finished collective while the interpreter finalizes, and the process
    # aborts (SIGABRT). The DDP model (its reducer) and the hook's state hold the group, and torch.distributed
    # modules imported after init_process_group bind it as an argument default (DDP's constructor imports
    # many through torch._dynamo: imported above, first).
    del model, hook_state, opt
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
