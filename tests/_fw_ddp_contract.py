"""Run by tests/test_frameworks.py in 2 real processes (env:// rendezvous), backend 'ina' and the DDP hook
on a Gloo group: mismatches raise on every rank, NaN/Inf propagate like Gloo, the group keeps working.
Records per rank to argv[1]/contract<r>.json and .pt."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_exit  # before init_process_group
from gloo_patch.torch_backend import InaHookState, ina_allreduce_hook

out_dir = sys.argv[1]
dist.init_process_group("ina")
r, n = dist.get_rank(), dist.get_world_size()
pg = dist.group.WORLD
cases, tensors = {}, {}


def case(name, fn):
    t0 = time.monotonic()
    try:
        cases[name] = {"ok": True, "seconds": time.monotonic() - t0, "result": fn()}
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        cases[name] = {"ok": False, "seconds": time.monotonic() - t0, "type": type(e).__name__, "message": str(e)}
    cases[name]["seconds"] = time.monotonic() - t0


def allreduce(t, op=dist.ReduceOp.SUM):
    dist.all_reduce(t, op=op)
    return t.sum().item()


def ok_allreduce():
    before = pg.stats()["offloaded_tensors"]
    t = torch.arange(12, dtype=torch.float32) * (r + 1) - 3
    dist.all_reduce(t)
    return {"through_switch": pg.stats()["offloaded_tensors"] - before, "sum": t.tolist()}


case("shape", lambda: allreduce(torch.ones([17, 23 * 57] if r == 0 else [17, 23, 57])))
case("dtype_int_vs_float", lambda: allreduce(torch.ones(17, 17, dtype=torch.int32 if r == 0 else torch.float32)))
case("op_sum_vs_avg", lambda: allreduce(torch.ones(8), dist.ReduceOp.SUM if r == 0 else dist.ReduceOp.AVG))
case("after_mismatches", ok_allreduce)


def nonfinite():
    x = torch.linspace(-1, 1, 3000)
    if r == 0:
        x[3], x[7] = float("nan"), float("-inf")
    else:
        x[5], x[7] = float("inf"), float("inf")
    tensors["nf.in"] = x.clone()
    dist.all_reduce(x)
    tensors["nf.x"] = x
    return pg.stats()["fallback_reasons"]


case("nonfinite", nonfinite)
case("after_nonfinite", ok_allreduce)


# the DDP hook on a Gloo group: a gradient with Inf on one rank reaches both ranks as with Gloo
def hook():
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 3), process_group=gloo)
    state = InaHookState(process_group=gloo)
    model.register_comm_hook(state, ina_allreduce_hook)
    x = torch.ones(2, 4) * (r + 1)
    model(x).sum().backward()
    finite = model.module.weight.grad.clone()
    model.zero_grad()
    model(x * (float("inf") if r == 1 else 1.0)).sum().backward()
    tensors["hook.finite"], tensors["hook.inf"] = finite, model.module.weight.grad.clone()
    st = state.stats()
    del model                     # its reducer holds the group (ddp_exit)
    state.close()
    return st


case("hook", hook)


# the DDP hook with find_unused_parameters: DDP allreduces its used-parameter map from backward's thread while the
# lane runs Gloo fallbacks (Inf on rank 1 every other step): the two never pair up wrongly, every step's gradients
# are the same on both ranks
class Unused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def hook_unused():
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = DDP(Unused(), process_group=gloo, find_unused_parameters=True, bucket_cap_mb=0.01)
    state = InaHookState(process_group=gloo)
    model.register_comm_hook(state, ina_allreduce_hook)
    grads = []
    for step in range(12):
        model.zero_grad()
        x = torch.ones(2, 64) * (r + 1) * (float("inf") if step % 2 and r == 1 else 1.0)
        model(x).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in (model.module.a.weight, model.module.b.weight,
                                                           model.module.a.bias, model.module.b.bias)]))
    tensors["hook_unused"] = torch.stack(grads)
    st = state.stats()
    del model
    state.close()
    return st


case("hook_unused", hook_unused)


# the DDP hook's agreement rounds after a round that cannot complete: rank 0 agrees on a bucket rank 1 never sends
# (an error naming rank 1 within the hook's timeout); after it, DDP steps go through the switch with the right average
def hook_rounds():
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 3), process_group=gloo)
    state = InaHookState(process_group=gloo, timeout=float(os.environ["HOOK_TIMEOUT"]))
    model.register_comm_hook(state, ina_allreduce_hook)
    out = {}

    def step():
        before = state.stats()["offloaded_calls"]
        model.zero_grad()
        model(torch.ones(2, 4) * (r + 1)).sum().backward()
        return {"weight": model.module.weight.grad.tolist(), "bias": model.module.bias.grad.tolist(),
                "through_switch": state.stats()["offloaded_calls"] - before, "given_up": state.rounds.given_up}

    def attempt(name, what):
        t0 = time.monotonic()
        try:
            state.agree_later([torch.ones(5)], what)()
            out[name] = {"ok": True}
        except RuntimeError as e:
            out[name] = {"ok": False, "message": str(e), "seconds": time.monotonic() - t0}

    if r == 0:
        attempt("never_reached", "bucket lonely")
    dist.barrier(group=gloo)
    out["after_never_reached"] = [step(), step()]
    del model
    state.close()
    return out


case("hook_rounds", hook_rounds)
json.dump({"cases": cases, "stats": pg.stats()}, open(f"{out_dir}/contract{r}.json", "w"), indent=1, default=str)
torch.save(tensors, f"{out_dir}/contract{r}.pt")
dist.barrier()
del pg
ddp_exit.end()
print(f"rank {r} contract done", flush=True)
