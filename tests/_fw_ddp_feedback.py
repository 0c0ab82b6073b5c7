"""Run by tests/test_ddp_error_feedback.py in 2 real processes (env:// rendezvous), INA_CODEC=3lc-3v:
the same gradients every step (fixed inputs, no optimizer step) averaged by DDP, either through the comm
hook on a Gloo group (argv[2] == "hook") or through backend 'ina' (argv[2] == "ina"). Records per rank, to
argv[1]/feedback<r>.pt: the true average gradient (Gloo), every step's averaged gradient, the counters and
the codec's residual keys."""
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_exit  # before init_process_group
from gloo_patch.torch_backend import InaHookState, ina_allreduce_hook

out_dir, mode = sys.argv[1], sys.argv[2]
STEPS = 40
dist.init_process_group("gloo" if mode == "hook" else "ina")
r, n = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
# DDP's first bucket holds up to 1 MB, the others bucket_cap_mb: the 4096x64 weight gets a bucket of its own
module = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 10))
g = torch.Generator().manual_seed(100 + r)          # each rank its own fixed batch
x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def grads() -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters()])


# the true average, through plain Gloo
torch.nn.functional.cross_entropy(module(x), y).backward()
true = grads().clone()
dist.all_reduce(true, group=dist.new_group(backend="gloo"))
true /= n
module.zero_grad()

model = DDP(module, bucket_cap_mb=0.01)      # several buckets per step, a residual each
state = None
if mode == "hook":
    state = InaHookState()
    model.register_comm_hook(state, ina_allreduce_hook)
steps = []
for _ in range(STEPS):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    steps.append(grads().clone())
if state:
    stats, keys = state.stats(), [str(k) for k in state.lane.client.codec("3lc-3v").residual_keys()]
else:
    stats, keys = dist.distributed_c10d._get_default_group().stats(), None
sizes = [p.numel() for p in module.parameters()]
torch.save({"true": true, "steps": torch.stack(steps), "stats": stats, "keys": keys, "sizes": sizes}, f"{out_dir}/feedback{r}.pt")
if state:
    state.close()
dist.barrier()
del model, state      # its reducer and the hook's state hold the groups
ddp_exit.end()
