"""Compression codecs behind one registry.

>>> import ina.compression as C
>>> C.available()                     # names
>>> codec = C.get("nc")               # a codec object (see ina.compression.base.Codec)
>>> C.natural_compression(t)          # the operator C_nat itself

To add a codec: write its module (a Codec subclass) and add one line to _REGISTRY.
"""
from __future__ import annotations

from .base import Codec, Encoded, ScaleContext
from .bfp import BlockFloatingPoint
from .dithering import NaturalDithering, RandomDithering
from .entropy_huffman import EntropyAdaptiveHuffman
from .mqgrad import MQGrad, MQGradController, UniformQuantizer
from .natural import NaturalCompression, NaturalCompressionDeterministic, natural_compression
from .qsgd import QSGD
from .terngrad import TernGrad
from .thc import THC
from .topk import TopK
from .threelc import ThreeLC, ThreeLCQuartic
from .thresholded import BinarizedGradientTransfer, QuantizedGradientTransfer, WholeGradientTransfer

_REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Add a codec class to the registry (names and wire ids must be unique)."""
    for other in _REGISTRY.values():
        if other.wire_id == cls.wire_id and other is not cls:
            raise ValueError(f"wire id {cls.wire_id} of {cls.name!r} is taken by {other.name!r}")
    _REGISTRY[cls.name] = cls
    return cls


for _cls in (NaturalCompression, NaturalCompressionDeterministic, BlockFloatingPoint,
             NaturalDithering, RandomDithering,
             # seed papers 000-003 and references (wire ids 10+): see docs/codecs.md
             ThreeLC, ThreeLCQuartic, WholeGradientTransfer, BinarizedGradientTransfer,
             QuantizedGradientTransfer, EntropyAdaptiveHuffman, UniformQuantizer, MQGrad, TernGrad, QSGD,
             # after the seeds (wire ids 20+): THC, and top-k as the sparsification reference
             THC, TopK):
    register(_cls)


def available() -> list[str]:
    """Names of all registered codecs."""
    return sorted(_REGISTRY)


def get(name: str, **options) -> Codec:
    """A new codec object by name; options go to its constructor (e.g. levels=, p=, seed=)."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(available())}") from None
    return cls(**options)


def by_wire_id(wire_id: int) -> type[Codec]:
    for cls in _REGISTRY.values():
        if cls.wire_id == wire_id:
            return cls
    raise ValueError(f"no codec has wire id {wire_id}")


__all__ = ["Codec", "Encoded", "ScaleContext", "available", "get", "register", "by_wire_id",
           "natural_compression", "MQGradController"]
