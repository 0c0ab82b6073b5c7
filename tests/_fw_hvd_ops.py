"""Run by tests/test_frameworks.py under real horovodrun: every allreduce entry point, the offloaded
dtypes, and the fallback paths. Saves inputs and outputs per rank to argv[1]/rank<r>.pt."""
import sys

import torch
import horovod.torch as hvd

out_dir = sys.argv[1]
ps0 = hvd.ProcessSet([0])
hvd.init(process_sets=[ps0])
r, n = hvd.rank(), hvd.size()
g = torch.Generator().manual_seed(100 + r)


def rnd(k, dtype=torch.float32, scale=1.0):
    return (torch.randn(k, generator=g) * scale).to(dtype)


inputs, outputs = {}, {}
# offloaded: fp32 spanning several packets, fp16, bf16; Average and Sum; every entry point
inputs["avg_f32"] = rnd(5000, scale=3.0)
outputs["avg_f32"] = hvd.allreduce(inputs["avg_f32"], name="avg_f32")                  # default op: Average
inputs["sum_f16"] = rnd(3000, torch.float16)
outputs["sum_f16"] = hvd.allreduce(inputs["sum_f16"], name="sum_f16", op=hvd.Sum)
# Horovod's own argument checks: CPU bfloat16 and non-contiguous tensors are refused with ValueError
for what, bad in [("cpu_bf16", rnd(1500, torch.bfloat16)), ("non_contiguous", rnd(60).reshape(6, 10).t())]:
    try:
        hvd.allreduce(bad, name=what, op=hvd.Sum)
        outputs[what] = "accepted"
    except ValueError as e:
        outputs[what] = f"ValueError: {e}"
inputs["async_a"] = rnd(2000).reshape(40, 50)
inputs["async_b"] = rnd(700, scale=0.01)
ta, tb = inputs["async_a"].clone(), inputs["async_b"].clone()
# issued in rank-dependent order: the names decide the order at the switch
if r % 2:
    hb = hvd.allreduce_async_(tb, name="async_b", op=hvd.Average)
    ha = hvd.allreduce_async_(ta, name="async_a", op=hvd.Sum)
else:
    ha = hvd.allreduce_async_(ta, name="async_a", op=hvd.Sum)
    hb = hvd.allreduce_async_(tb, name="async_b", op=hvd.Average)
assert hvd.poll(hb) in (True, False)
outputs["async_b"] = hvd.synchronize(hb)
outputs["async_a"] = hvd.synchronize(ha)
assert outputs["async_a"] is ta, "allreduce_async_ must work in place"
inputs["grouped_0"], inputs["grouped_1"] = rnd(1200), rnd(10, scale=100.0)
go = hvd.grouped_allreduce([inputs["grouped_0"], inputs["grouped_1"]], name="grouped", op=hvd.Sum)
outputs["grouped_0"], outputs["grouped_1"] = go
inputs["scaled"] = rnd(300)
outputs["scaled"] = hvd.allreduce(inputs["scaled"], name="scaled", op=hvd.Sum, prescale_factor=0.5,
                                  postscale_factor=4.0)
# fallbacks (Gloo): other dtypes, other ops, another process set
inputs["f64"] = rnd(100, torch.float64)
outputs["f64"] = hvd.allreduce(inputs["f64"], name="f64", op=hvd.Sum)
inputs["f64_again"] = rnd(10, torch.float64)
outputs["f64_again"] = hvd.allreduce(inputs["f64_again"], name="f64_again", op=hvd.Sum)
inputs["i32"] = torch.arange(50, dtype=torch.int32) * (r + 1)
outputs["i32"] = hvd.allreduce(inputs["i32"], name="i32", op=hvd.Sum)
inputs["max"] = rnd(64)
outputs["max"] = hvd.allreduce(inputs["max"], name="max", op=hvd.Max)
if r == 0:
    inputs["ps0"] = rnd(8)
    outputs["ps0"] = hvd.allreduce(inputs["ps0"], name="ps0", op=hvd.Sum, process_set=ps0)
# untouched collectives
outputs["bcast"] = hvd.broadcast(torch.full((4,), float(r)), root_rank=n - 1, name="bcast")
outputs["gather"] = hvd.allgather(torch.full((2,), float(r)), name="gather")

import gloo_patch.horovod as ina_hvd  # noqa: E402

torch.save({"inputs": inputs, "outputs": outputs, "stats": ina_hvd.stats(), "installed": ina_hvd.installed()},
           f"{out_dir}/rank{r}.pt")
print(f"rank {r} ops done", flush=True)
