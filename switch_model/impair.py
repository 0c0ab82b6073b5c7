"""User-space link impairments (this kernel has no netem): loss, duplication, reordering, delay.

One :class:`Impairment` per direction (ingress: workers -> switch, egress: switch -> workers).
Seeded, so a run with the same seed and the same traffic drops the same packets. When every
probability and the delay are zero the stage is a pass-through and costs nothing.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class ImpairmentConfig:
    loss: float = 0.0        # probability a packet is dropped
    duplicate: float = 0.0   # probability a packet is delivered twice
    reorder: float = 0.0     # probability a packet is held back and delivered after later ones
    delay_ms: float = 0.0    # fixed one-way delay added to every packet
    reorder_ms: float = 1.0  # how long a reordered packet is held back (on top of the delay)
    seed: int = 0

    def __post_init__(self):
        for name in ("loss", "duplicate", "reorder"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"impairment {name}={p} is not a probability in [0, 1]")
        for name in ("delay_ms", "reorder_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"impairment {name}={getattr(self, name)} must be >= 0")

    @property
    def active(self) -> bool:
        return bool(self.loss or self.duplicate or self.reorder or self.delay_ms)

    def to_dict(self) -> dict:
        return asdict(self)


class Impairment:
    """Applies one direction's impairments to packets given as bytes with a destination tag."""

    def __init__(self, config: ImpairmentConfig | None = None):
        self.set(config or ImpairmentConfig())
        self.dropped = 0
        self.duplicated = 0
        self.reordered = 0
        self.delayed = 0
        self._held: list = []            # heap of (release time, seq, packet, tag)
        self._seq = itertools.count()

    def set(self, config: ImpairmentConfig) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)

    @property
    def active(self) -> bool:
        return self.config.active or bool(self._held)

    def next_release(self) -> float | None:
        return self._held[0][0] if self._held else None

    def apply(self, packets, now: float) -> list:
        """packets: list of (bytes, tag). Returns the (bytes, tag) list to deliver now, in order."""
        cfg = self.config
        out = []
        n = len(packets)
        if n:
            u = self._rng.random((n, 3))
            for (pkt, tag), (ul, ud, ur) in zip(packets, u):
                if ul < cfg.loss:
                    self.dropped += 1
                    continue
                copies = 2 if ud < cfg.duplicate else 1
                self.duplicated += copies - 1
                for _ in range(copies):
                    hold = cfg.delay_ms / 1e3
                    if ur < cfg.reorder:
                        hold += cfg.reorder_ms / 1e3
                        self.reordered += 1
                    if hold > 0:
                        self.delayed += 1
                        heapq.heappush(self._held, (now + hold, next(self._seq), pkt, tag))
                    else:
                        out.append((pkt, tag))
        while self._held and self._held[0][0] <= now:
            _, _, pkt, tag = heapq.heappop(self._held)
            out.append((pkt, tag))
        return out

    def requeue(self, packets) -> None:
        """Hand (bytes, tag) packets back, in order, to be delivered by the next ``apply``."""
        for pkt, tag in packets:
            heapq.heappush(self._held, (0.0, next(self._seq), pkt, tag))

    def counters(self) -> dict:
        return {"dropped": self.dropped, "duplicated": self.duplicated, "reordered": self.reordered,
                "delayed": self.delayed, "held": len(self._held)}
