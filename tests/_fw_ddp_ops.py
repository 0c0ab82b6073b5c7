"""Run by tests/test_frameworks.py in real processes (env:// rendezvous): backend 'ina' collectives,
offloaded and delegated. Saves inputs and outputs per rank to argv[1]/rank<r>.pt."""
import sys

import torch
import torch.distributed as dist

import ddp_exit  # before init_process_group
import gloo_patch.torch_backend  # noqa: F401 - registers 'ina'

out_dir = sys.argv[1]
dist.init_process_group("ina")
r, n = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(200 + r)


def rnd(k, dtype=torch.float32, scale=1.0):
    return (torch.randn(k, generator=g) * scale).to(dtype)


inputs, outputs = {}, {}
for name, dtype, op in [("sum_f32", torch.float32, dist.ReduceOp.SUM), ("avg_f32", torch.float32, dist.ReduceOp.AVG),
                        ("sum_f16", torch.float16, dist.ReduceOp.SUM), ("avg_bf16", torch.bfloat16, dist.ReduceOp.AVG)]:
    inputs[name] = rnd(2500, dtype)
    t = inputs[name].clone()
    dist.all_reduce(t, op=op)
    outputs[name] = t
inputs["async"] = rnd(4000)
t = inputs["async"].clone()
w = dist.all_reduce(t, async_op=True)
w.wait()
outputs["async"] = t
# fallbacks
for name, dtype, op in [("f64", torch.float64, dist.ReduceOp.SUM), ("max", torch.float32, dist.ReduceOp.MAX),
                        ("i64", torch.int64, dist.ReduceOp.SUM), ("avg_f64", torch.float64, dist.ReduceOp.AVG)]:
    inputs[name] = rnd(16).to(dtype) if dtype != torch.int64 else torch.arange(16) * (r + 1)
    t = inputs[name].clone()
    dist.all_reduce(t, op=op)
    outputs[name] = t
# delegated to the inner Gloo group
t = torch.full((3,), float(r))
dist.broadcast(t, src=n - 1)
outputs["broadcast"] = t
lst = [torch.zeros(2) for _ in range(n)]
dist.all_gather(lst, torch.full((2,), float(r)))
outputs["all_gather"] = torch.stack(lst)
t = torch.full((2,), float(r + 1))
dist.reduce(t, dst=0)
outputs["reduce"] = t
t = torch.zeros(n)
dist.all_to_all_single(t, torch.arange(n, dtype=torch.float32) + 10 * r)
outputs["all_to_all"] = t
t = torch.zeros(1)
dist.reduce_scatter_tensor(t, torch.arange(n, dtype=torch.float32) * (r + 1))
outputs["reduce_scatter"] = t
dist.barrier()
stats = dist.group.WORLD.stats()
torch.save({"inputs": inputs, "outputs": outputs, "stats": stats, "backend": dist.get_backend()}, f"{out_dir}/rank{r}.pt")
dist.barrier()
ddp_exit.end()
print(f"rank {r} ops done", flush=True)
