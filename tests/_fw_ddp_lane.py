"""Run by tests/test_frameworks.py in 2 real processes (env:// rendezvous, backend 'ina'): buckets queued on the
DDP hook's lane at once, the lane taking them one after another: a bucket with NaN on one rank (Gloo), one whose
shape differs between the ranks (an error on both), and buckets through the switch before and after them; then
the process group ends with no Gloo thread left (a failed bucket's future must not keep it alive).
Records per rank to argv[1]/lane<r>.json and .pt."""
import json
import sys
import threading

import torch
import torch.distributed as dist

import ddp_exit  # before init_process_group
from gloo_patch.torch_backend import InaHookState, ina_allreduce_hook

out_dir = sys.argv[1]
dist.init_process_group("ina")
r, n = dist.get_rank(), dist.get_world_size()
pg = dist.group.WORLD


class Bucket:
    """What ina_allreduce_hook reads of a DDP GradBucket."""

    def __init__(self, index, buf, last=False):
        self.buf, self.i, self.last = buf, index, last

    def buffer(self):
        return self.buf

    def index(self):
        return self.i

    def is_last(self):
        return self.last

    def parameters(self):
        return [self.buf]


def values(size, salt):
    # integers: their sums and halves are exact in bfp32 and float32, so every rank's result is known
    return ((torch.arange(size, dtype=torch.float32) * (salt + 3)) % 97 - 40) * (r + 1)


state = InaHookState()
sizes = [20000, 3000, 2500, 100 + r, 4000, 1500]    # bucket 3: the ranks' shapes differ
bufs = [values(s, i) for i, s in enumerate(sizes)]
if r == 1:
    bufs[2][7] = float("nan")
inputs = [b.clone() for b in bufs]
# the lane waits at a gate (an item that goes "another way", on every rank alike) until every bucket is queued
gate = threading.Event()
state.lane.submit([torch.zeros(1)], True, None, decide=lambda: gate.wait(60) or True)
futs = [ina_allreduce_hook(state, Bucket(i, b, last=i == len(bufs) - 1)) for i, b in enumerate(bufs)]
gate.set()
outcomes = []
for f in futs:
    try:
        f.wait()
        outcomes.append({"ok": True})
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        outcomes.append({"ok": False, "message": str(e)})
hook_stats = state.stats()
state.close()
json.dump({"outcomes": outcomes, "hook": hook_stats}, open(f"{out_dir}/lane{r}.json", "w"), indent=1, default=str)
torch.save({"bufs": bufs, "inputs": inputs}, f"{out_dir}/lane{r}.pt")
dist.barrier()
del pg, state, futs
ddp_exit.end()
print(f"rank {r} lane done", flush=True)
