"""How the tests' DDP worker scripts end, so that no Gloo worker thread outlives the process group.

A Gloo worker thread drops its reference to a finished collective after the caller's wait returned;
that work's destructor needs the GIL. If the interpreter is finalizing by then, the thread is ended
inside that destructor and the process aborts ("terminate called without an active exception",
SIGABRT) after its results were written. ``destroy_process_group`` joins those threads only when it
drops the last reference to the group, and two things keep the group alive:

- ``torch.distributed`` modules imported after ``init_process_group`` bind the live group as the
  default of their ``group=group.WORLD`` arguments. DDP's constructor imports ``torch._dynamo``, which
  imports many of them: so this module imports it first (import it before ``init_process_group``);
- the DDP model (its reducer holds the group): delete it before :func:`end`.

:func:`end` destroys the group and prints how many Gloo worker threads are left (the tests assert 0).
"""
import gc
import os

import torch._dynamo  # noqa: F401 - before init_process_group, see above
import torch.distributed as dist

LEFT = "gloo worker threads left after destroy_process_group:"


def gloo_threads() -> int:
    """Threads of this process named like Gloo's worker loop (pt_gloo_runloop)."""
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:              # ended meanwhile
            pass
    return sum(n.startswith("pt_gloo") for n in names)


def end() -> None:
    """Destroy every process group (each rank past its last collective: call after a barrier) and
    report the Gloo worker threads left."""
    gc.collect()                  # DDP models and their groups in reference cycles (a reducer holds its group)
    dist.destroy_process_group()
    print(LEFT, gloo_threads(), flush=True)
