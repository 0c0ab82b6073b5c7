"""Run by tests/test_frameworks.py under real horovodrun -np 2 with INA on (a short INA_TIMEOUT): the agreement
rounds after a round that cannot complete. Each case records, per rank, what happened to argv[1]/rounds<r>.json.

1. never reached: rank 0 allreduces 'lonely', rank 1 never does (it waits in Horovod's barrier, which rank 0
   joins after its error): rank 0 gets an error naming 'lonely' and rank 1; the next allreduces work on both.
2. reached late: rank 0 gives up on 'late'; rank 1 allreduces 'late' only afterwards: an error at once (not
   after another INA_TIMEOUT); the next allreduces work on both.
3. hvd.shutdown(); hvd.init(): fresh rounds, the switch again."""
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
cases = {}


def case(name, fn):
    run_case(cases, name, fn)


def ok_allreduce(tag):
    """An allreduce that must go through the switch, then a second one (the rounds stay paired)."""
    got = []
    for i in range(2):
        before = ina_hvd.stats()["offloaded_tensors"]
        x = torch.arange(12, dtype=torch.float32) * (r + 1) - 3 + i
        y = hvd.allreduce(x, name=f"ok.{tag}.{i}", op=hvd.Sum)
        got.append({"through_switch": ina_hvd.stats()["offloaded_tensors"] - before, "sum": y.tolist()})
    return {"runs": got, "given_up": ina_hvd.stats()["agreement_rounds_given_up"]}


# 1. never reached
if r == 0:
    case("never_reached", lambda: hvd.allreduce(torch.ones(8), name="lonely", op=hvd.Sum).tolist())
hvd.barrier()
case("after_never_reached", lambda: ok_allreduce("a"))

# 2. reached late
if r == 0:
    case("late", lambda: hvd.allreduce(torch.ones(8), name="late", op=hvd.Sum).tolist())
    hvd.barrier()
else:
    hvd.barrier()
    case("late", lambda: hvd.allreduce(torch.ones(8), name="late", op=hvd.Sum).tolist())
case("after_late", lambda: ok_allreduce("b"))


# 3. shutdown/init
def reinit():
    hvd.shutdown()
    hvd.init()
    return ok_allreduce("d")


case("reinit", reinit)
json.dump({"cases": cases, "stats": ina_hvd.stats()},
          open(f"{out_dir}/rounds{r}.json", "w"), indent=1, default=str)
print(f"rank {r} rounds done", flush=True)
