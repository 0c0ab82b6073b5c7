"""Run by tests/test_frameworks.py under real horovodrun -np 2 with INA on: Horovod's contract.
Each case records, per rank, what happened (result, exception type and message, seconds taken) to
argv[1]/contract<r>.json; tensors go to argv[1]/contract<r>.pt."""
import json
import sys

import torch
import horovod.torch as hvd

import gloo_patch.horovod as ina_hvd
from _fw_cases import run_case

out_dir = sys.argv[1]
hvd.init()
r, n = hvd.rank(), hvd.size()
assert n == 2, "this script is written for 2 ranks"
cases, tensors = {}, {}


def case(name, fn):
    run_case(cases, name, fn)


def offloaded():
    return ina_hvd.stats()["offloaded_tensors"]


def ok_allreduce(tag):
    """An allreduce that must go through the switch: returns what the test checks."""
    before = offloaded()
    x = torch.arange(12, dtype=torch.float32) * (r + 1) - 3
    y = hvd.allreduce(x, name=f"ok.{tag}", op=hvd.Sum)
    tensors[f"ok.{tag}"] = y
    return {"through_switch": offloaded() - before, "sum": y.tolist()}


# 1. mismatches: same number of elements, different shape; different dims; dtype; op; prescale
case("shape", lambda: hvd.allreduce(torch.ones([17, 23 * 57] if r == 0 else [17, 23, 57]), name="shape").sum().item())
case("dims", lambda: hvd.allreduce(torch.ones([17 + r] * 3), name="dims").sum().item())
case("dtype_int_vs_float", lambda: hvd.allreduce(torch.ones(17, 17, dtype=torch.int32 if r == 0 else torch.float32),
                                                 name="dtype", op=hvd.Sum).sum().item())
case("op_sum_vs_average", lambda: hvd.allreduce(torch.ones(8), name="op", op=hvd.Sum if r == 0 else hvd.Average)
     .sum().item())
case("prescale", lambda: hvd.allreduce(torch.ones(8), name="prescale", op=hvd.Sum, prescale_factor=1.0 + r)
     .sum().item())
case("after_mismatches", lambda: ok_allreduce("a"))


# 2. argument checks Horovod makes
case("non_contiguous", lambda: hvd.allreduce(torch.ones(4, 6).t(), name="nc"))
case("cpu_bfloat16", lambda: hvd.allreduce(torch.ones(4, dtype=torch.bfloat16), name="bf16"))


def duplicate():
    h = hvd.allreduce_async(torch.ones(5), name="dup", op=hvd.Sum)
    try:
        hvd.allreduce_async(torch.ones(5), name="dup", op=hvd.Sum)
        second = "accepted"
    except ValueError as e:
        second = f"ValueError: {e}"
    first = hvd.synchronize(h).tolist()
    again = hvd.synchronize(h)            # Horovod: None for a handle already synchronized
    return {"second": second, "first": first, "again": again}


case("duplicate_name", duplicate)
case("after_checks", lambda: ok_allreduce("b"))


# 3. NaN/Inf on one rank reach every rank, as with Gloo
def nonfinite():
    x = torch.linspace(-1, 1, 3000)
    if r == 0:
        x[3], x[7], x[2500] = float("nan"), float("-inf"), float("inf")
    else:
        x[5], x[7] = float("inf"), float("inf")
    tensors["nf.in"] = x.clone()
    h1 = hvd.allreduce_async(x, name="nf.x", op=hvd.Sum)
    h2 = hvd.allreduce_async(torch.full((100,), 1.0 + r), name="nf.y", op=hvd.Sum)   # finite, same batch
    tensors["nf.x"], tensors["nf.y"] = hvd.synchronize(h1), hvd.synchronize(h2)
    return {"reasons": ina_hvd.stats()["fallback_reasons"]}


case("nonfinite", nonfinite)
case("after_nonfinite", lambda: ok_allreduce("c"))


# 4. shutdown/init: a fresh start, the switch again
def reinit():
    job = ina_hvd.stats()["job"]
    hvd.shutdown()
    hvd.init()
    return {"old_job": job, "new_job": ina_hvd.stats()["job"], **ok_allreduce("d")}


case("reinit", reinit)


# 5. join: rank 1 joins at once; rank 0's allreduces get zeros from it (Horovod's semantics)
def join():
    if r == 1:
        return {"ret": hvd.join()}
    a = torch.arange(10, dtype=torch.float32) + 1
    b = torch.arange(7, dtype=torch.float32) * 3
    ha = hvd.allreduce_async(a, name="join.a", op=hvd.Average)
    hb = hvd.allreduce_async(b, name="join.b", op=hvd.Sum)
    tensors["join.a"], tensors["join.b"] = hvd.synchronize(ha), hvd.synchronize(hb)
    tensors["join.a_in"], tensors["join.b_in"] = a, b
    return {"ret": hvd.join()}


case("join", join)
case("after_join", lambda: ok_allreduce("e"))



# 6. the ranks make their calls in different orders: rank 0 queues a and b before it waits for a, rank 1 waits
# for a before it queues its second allreduce, so their buckets differ ({a, b} against {a}, then {b} against
# {b}). The same b: the right sums; b of another shape: Horovod's mismatch error on every rank; another name (c):
# both ranks wait for an allreduce the other never queues, an error on every rank at once
def order(tag, shape, second):
    a = torch.arange(6, dtype=torch.float32) + r
    ha = hvd.allreduce_async(a, name=f"{tag}.a", op=hvd.Sum)
    if r == 0:
        hb = hvd.allreduce_async(torch.ones(shape), name=f"{tag}.b", op=hvd.Sum)
        tensors[f"{tag}.a"] = hvd.synchronize(ha)
    else:
        tensors[f"{tag}.a"] = hvd.synchronize(ha)
        hb = hvd.allreduce_async(torch.ones(shape), name=f"{tag}.{second}", op=hvd.Sum)
    return hvd.synchronize(hb).tolist()


case("order_same", lambda: order("order_same", [5], "b"))
case("order_shape", lambda: order("order_shape", [5 + r], "b"))
case("order_name", lambda: order("order_name", [5], "b" if r == 0 else "c"))
case("after_order", lambda: ok_allreduce("f"))

st = ina_hvd.stats()
json.dump({"cases": cases, "stats": st}, open(f"{out_dir}/contract{r}.json", "w"), indent=1, default=str)
torch.save(tensors, f"{out_dir}/contract{r}.pt")
print(f"rank {r} contract done", flush=True)
