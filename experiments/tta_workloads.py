"""Two real training workloads whose data are generated locally (no download), for time-to-accuracy.

``resnet``: a ResNet-style conv net (a stem, three stages of one residual BasicBlock each at 32/64/128
channels, global average pooling, a linear head: 29 parameter tensors, 308,650
parameters) on 3x32x32 colour images. The images are scikit-learn's handwritten digits (1797 8x8 scans
shipped inside the package), upsampled to 20x20, placed at a random offset on a 32x32 canvas, given a
random foreground and background colour, and noise. Train and test images come from disjoint sets
of scans (1437 / 360), so the test accuracy measures generalisation to unseen writers' digits.

``embedding``: a bag-of-tokens text classifier (``nn.EmbeddingBag`` of 8000 x 48 with dense gradients, a
hidden layer, 8 classes; 387,656 parameters, 99 % of them the embedding table) on a synthetic
corpus: every class has a topic (a sparse distribution over 300 of the 8000 tokens, overlapping between
classes), and a document of 32 tokens draws each token from its class's topic with probability 0.3,
else from a Zipf background over the whole vocabulary; 5 % of the labels are flipped. The
Bayes-optimal accuracy is below 100 %.

Both are deterministic given the seed: the test set and every rank's batch of every step. Each rank
draws its own batches (data parallelism), from a generator seeded with (seed, rank).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

WORKLOADS = ("resnet", "embedding")


# ---- ResNet-style conv net on 32x32 colour digits ------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.short = (nn.Sequential() if stride == 1 and c_in == c_out else
                      nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


def resnet(seed: int, classes: int = 10) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),   # 32x32 -> 16x16
                         BasicBlock(32, 32, 1), BasicBlock(32, 64, 2), BasicBlock(64, 128, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes))


class ColourDigits:
    """3x32x32 images made from scikit-learn's digits; ``split`` 'train' uses scans 0..1436, 'test' the rest."""

    def __init__(self, split: str, seed: int):
        from sklearn.datasets import load_digits  # noqa: PLC0415

        d = load_digits()
        lo, hi = (0, 1437) if split == "train" else (1437, len(d.target))
        base = torch.from_numpy((d.images[lo:hi] / 16.0).astype(np.float32))[:, None]
        self.base = nn.functional.interpolate(base, size=(20, 20), mode="bilinear", align_corners=False)[:, 0]
        self.labels = torch.from_numpy(d.target[lo:hi].astype(np.int64))
        self.g = torch.Generator().manual_seed(seed)

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.g
        idx = torch.randint(0, len(self.labels), (n,), generator=g)
        bg = torch.rand(n, 3, 1, 1, generator=g) * 0.4
        fg = 0.6 + 0.4 * torch.rand(n, 3, 1, 1, generator=g)
        off = torch.randint(0, 13, (n, 2), generator=g)
        x = bg.expand(n, 3, 32, 32).clone()
        for i in range(n):
            r, c = int(off[i, 0]), int(off[i, 1])
            digit = self.base[idx[i]]
            x[i, :, r:r + 20, c:c + 20] = bg[i] * (1 - digit) + fg[i] * digit
        x += 0.1 * torch.randn(x.shape, generator=g)
        return (x - 0.4) / 0.3, self.labels[idx]


# ---- embedding model on a synthetic topic corpus ------------------------------------------------------
VOCAB, DOC_LEN, CLASSES = 8000, 32, 8


class EmbeddingNet(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 48, classes: int = CLASSES):
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, dim, mode="mean")     # dense gradients (sparse=False)
        self.hidden = nn.Linear(dim, 64)
        self.head = nn.Linear(64, classes)

    def forward(self, tokens):
        return self.head(torch.relu(self.hidden(self.embed(tokens))))


def embedding_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return EmbeddingNet()


class TopicCorpus:
    """Documents of DOC_LEN tokens; the corpus (topics, background) is fixed by ``corpus_seed``."""

    def __init__(self, seed: int, corpus_seed: int = 12345, topic_p: float = 0.3, label_noise: float = 0.05):
        rng = np.random.default_rng(corpus_seed)
        zipf = 1.0 / np.arange(1, VOCAB + 1) ** 1.05
        self.background = torch.from_numpy(rng.permutation(zipf / zipf.sum()))
        topics = np.zeros((CLASSES, VOCAB))
        for c in range(CLASSES):
            words = rng.choice(VOCAB, 300, replace=False)
            topics[c, words] = rng.dirichlet(np.full(300, 0.3))
        self.topics = torch.from_numpy(topics)
        self.topic_p, self.label_noise = topic_p, label_noise
        self.g = torch.Generator().manual_seed(seed)

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.g
        y = torch.randint(0, CLASSES, (n,), generator=g)
        from_topic = torch.rand(n, DOC_LEN, generator=g) < self.topic_p
        topic_tok = torch.multinomial(self.topics[y], DOC_LEN, replacement=True, generator=g)
        bg_tok = torch.multinomial(self.background, n * DOC_LEN, replacement=True, generator=g).view(n, DOC_LEN)
        tokens = torch.where(from_topic, topic_tok, bg_tok)
        flip = torch.rand(n, generator=g) < self.label_noise
        y = torch.where(flip, torch.randint(0, CLASSES, (n,), generator=g), y)
        return tokens, y


# ---- what the worker uses -----------------------------------------------------------------------------
def make(workload: str, seed: int, rank: int):
    """(model, this rank's training data, the test set's (x, y)) for ``workload``."""
    if workload == "resnet":
        model, train, test = resnet(seed), ColourDigits("train", seed * 1000 + rank), ColourDigits("test", 999)
        return model, train, test.sample(2000)
    if workload == "embedding":
        return embedding_net(seed), TopicCorpus(seed * 1000 + rank), TopicCorpus(999).sample(4000)
    raise ValueError(f"unknown workload {workload!r} (expected one of {', '.join(WORKLOADS)})")


@torch.no_grad()
def accuracy(model: nn.Module, test: tuple[torch.Tensor, torch.Tensor], batch: int = 500) -> float:
    was = model.training
    model.eval()
    x, y = test
    hits = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum()) for i in range(0, len(y), batch))
    model.train(was)
    return hits / len(y)
