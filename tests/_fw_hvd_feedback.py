"""Run by tests/test_horovod_error_feedback.py under real horovodrun -np 2, INA_CODEC=3lc-3v: the same two
gradients every step (a large and a small one), queued as two named allreduces that one bucket fuses into
one buffer. Records per rank, to argv[1]/feedback<r>.pt: the true average (Gloo: allgather of the inputs),
every step's averages, the counters and the codec's residual keys."""
import sys

import torch
import horovod.torch as hvd

import gloo_patch.horovod as ina_hvd

out_dir = sys.argv[1]
STEPS = 30
hvd.init()
r, n = hvd.rank(), hvd.size()
g = torch.Generator().manual_seed(100 + r)        # each rank its own fixed gradients
big = torch.randn(3000, generator=g)
small = torch.randn(500, generator=g) * 1e-3      # all well below half the large one's max |g|
true = [hvd.allgather(t.reshape(1, -1), name=f"true.{i}").mean(0) for i, t in enumerate((big, small))]   # Gloo
steps = []
for _ in range(STEPS):
    hb = hvd.allreduce_async(big.clone(), name="grad.big", op=hvd.Average)
    hs = hvd.allreduce_async(small.clone(), name="grad.small", op=hvd.Average)
    steps.append(torch.cat([hvd.synchronize(hb), hvd.synchronize(hs)]))
st = ina_hvd.stats()
torch.save({"true": torch.cat(true), "steps": torch.stack(steps), "stats": st, "keys": st["residual_keys"],
            "sizes": [big.numel(), small.numel()]}, f"{out_dir}/feedback{r}.pt")
hvd.shutdown()
