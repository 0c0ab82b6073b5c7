"""The strongest non-INA baselines a user can switch on today, as ina-sweep methods.

* ``gloo-fp16``: Horovod's ``Compression.fp16`` semantics on Gloo's ring: cast the float32 gradient
  to float16, allreduce (sum) in float16, cast back (then divide by the workers for an average). Half
  the ring's bytes; the float16 sum rounds to 11 significant bits.
* ``powersgd``: PyTorch's own PowerSGD DDP communication hook
  (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``, rank 1 as its default, error
  feedback and warm start on). The gradient goes through a real ``DistributedDataParallel`` model
  whose parameters have the training model's shapes (the bench: one matrix of about sqrt(n) x
  sqrt(n)); PowerSGD compresses every matrix to rank-r factors P, Q (allreduced by Gloo) and sends
  vectors uncompressed. Its hook runs plain allreduces for its first ``start_powerSGD_iter`` = 2
  iterations (PyTorch requires >= 2 with error feedback): the reducer runs the first on a zero
  gradient when it is built, so the caller's first call (the sweep's warm-up) is the last plain one
  and every measured allreduce and training step after it is compressed. (A compressed step of an
  all-zero gradient would leave the warm-start memory at zero, or NaN: the sweep's warm-ups with
  zeros must stay plain.) The hook averages; the reducer multiplies by the workers for a sum.

Both run over torch.distributed's Gloo group of the sweep workers, on the same shaped links.
"""
from __future__ import annotations

import math

BASELINES = {
    "gloo-fp16": "Gloo ring fp16 (Horovod Compression.fp16: cast, allreduce, cast back)",
    "powersgd": "PyTorch PowerSGD DDP hook (rank 1, error feedback; Gloo allreduce of the factors)",
}
POWERSGD_RANK = 1
POWERSGD_START_ITER = 2


def is_baseline(method: str) -> bool:
    return method in BASELINES


def ring_time(n: int, elements: int, width: int, bps: float) -> float:
    """Link-bound time of Gloo's ring allreduce: 2 (n - 1) / n of the tensor's bytes each way."""
    return 2 * (n - 1) / n * elements * width * 8 / bps


def ideal_time(method: str, n: int, elements: int, bps: float | None) -> float | None:
    """fp16 ring: 2 bytes per element; PowerSGD: no fixed width (None: measured bytes instead)."""
    if bps is None or method == "powersgd":
        return None
    return ring_time(n, elements, 2, bps)


def wait_bound(method: str, n: int, elements: int, bps: float | None) -> float | None:
    """Link-bound time to size the launcher's waits: PowerSGD is never slower than the fp32 ring."""
    if bps is None:
        return None
    return ring_time(n, elements, 4 if method == "powersgd" else 2, bps)


def fp16_reducer(dist, world: int):
    def red(t, average=False, key=None):
        h = t.half()
        dist.all_reduce(h)
        t.copy_(h)
        if average:
            t /= world
        return t
    return red


class PowerSGDReducer:
    """Allreduce of a flat gradient through DDP + PyTorch's PowerSGD hook (one DDP model per shape set)."""

    def __init__(self, torch, world: int):
        self.torch, self.world = torch, world
        self._models: dict[tuple, object] = {}

    @staticmethod
    def bench_shape(n: int) -> tuple[int, int]:
        rows = max(1, math.isqrt(n))
        return rows, math.ceil(n / rows)

    def _model(self, shapes: tuple):
        ddp = self._models.get(shapes)
        if ddp is None:
            torch = self.torch
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

            class Holder(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

                def forward(self, flat):       # d(loss)/d(p) = p's segment of flat
                    loss, off = flat.new_zeros(()), 0
                    for p in self.ps:
                        loss = loss + (p * flat[off:off + p.numel()].view_as(p)).sum()
                        off += p.numel()
                    return loss

            ddp = torch.nn.parallel.DistributedDataParallel(Holder())
            state = P.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                    start_powerSGD_iter=POWERSGD_START_ITER)
            ddp.register_comm_hook(state, P.powerSGD_hook)
            self._models[shapes] = ddp
            zero = torch.zeros(sum(math.prod(s) for s in shapes))
            for _ in range(POWERSGD_START_ITER - 1):  # the hook's plain iterations but the caller's first
                self._step(ddp, zero)
        return ddp

    def _step(self, ddp, flat):
        for p in ddp.module.ps:
            p.grad = None
        ddp(flat).backward()
        return self.torch.cat([p.grad.reshape(-1) for p in ddp.module.ps])

    def __call__(self, t, average=False, key=None, shapes=None):
        n = t.numel()
        shapes = tuple(tuple(s) for s in shapes) if shapes else (self.bench_shape(n),)
        total = sum(math.prod(s) for s in shapes)
        flat = t.reshape(-1).float()
        if total != n:
            flat = self.torch.cat([flat, flat.new_zeros(total - n)])
        g = self._step(self._model(shapes), flat)[:n]       # the hook's average over the workers
        t.copy_((g if average else g * self.world).view_as(t))
        return t


def reducer(method: str, torch, dist, world: int, shapes=None):
    """The allreduce function ``red(t, average=False, key=None)`` of a baseline method."""
    if method == "gloo-fp16":
        return fp16_reducer(dist, world)
    if method == "powersgd":
        psgd = PowerSGDReducer(torch, world)
        return lambda t, average=False, key=None: psgd(t, average=average, key=key, shapes=shapes)
    raise ValueError(f"unknown baseline {method!r}: expected one of {', '.join(BASELINES)}")
