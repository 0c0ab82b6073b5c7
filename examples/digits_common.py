"""What both training examples share: scikit-learn's digits (shipped inside the package, 1797 8x8
images), a small MLP, per-rank data shards and the result files the tests read."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy((d.data / 16.0).astype(np.float32))
    y = torch.from_numpy(d.target.astype(np.int64))
    return x, y


def make_model(seed: int, hidden: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


class Shard:
    """This rank's slice of the data set, served in mini-batches from a seeded permutation."""

    def __init__(self, x, y, rank: int, size: int, batch: int, seed: int):
        self.x, self.y = x[rank::size], y[rank::size]
        self.batch = batch
        self.g = torch.Generator().manual_seed(seed * 1000 + rank)
        self.perm = torch.randperm(len(self.x), generator=self.g)
        self.pos = 0

    def next(self):
        if self.pos + self.batch > len(self.perm):
            self.perm = torch.randperm(len(self.x), generator=self.g)
            self.pos = 0
        idx = self.perm[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return self.x[idx], self.y[idx]


def local_grads(model: nn.Module, xb, yb) -> dict[str, torch.Tensor]:
    """This rank's own gradients for (xb, yb), computed on a copy (no communication hooks)."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(m(xb), yb).backward()
    return {n: p.grad.detach().clone() for n, p in m.named_parameters()}


@torch.no_grad()
def full_loss(model: nn.Module, x, y) -> float:
    return float(nn.functional.cross_entropy(model(x), y))


def param_checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def write_result(out_dir: str | None, rank: int, result: dict) -> None:
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def save_grads(out_dir: str | None, rank: int, local: dict, reduced: dict) -> None:
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        torch.save({"local": local, "reduced": reduced}, Path(out_dir) / f"grads_rank{rank}.pt")
