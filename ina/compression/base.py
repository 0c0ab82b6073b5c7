"""The one codec interface.

A codec is a small object. Two ways to use it:

* as a compression operator on one tensor: ``enc = codec.compress(x)``; ``codec.decompress(enc)``
  returns a tensor of x's type, shape, dtype and device (torch tensors on any device, numpy arrays);
* on the switch path (``switch_summable`` codecs): every worker proposes a scale exponent
  (:meth:`Codec.scale_exponent`), the workers agree on the max (the switch negotiates it), each
  encodes with the shared :class:`ScaleContext` (:meth:`Codec.encode_shared`) into fixed-width
  integer codes that an integer-only switch can sum, and :meth:`Codec.decode_sum` turns the
  switch's result back into floats.

Adding a codec touches its own module and the registry in ``ina/compression/__init__.py``.
"""
from __future__ import annotations

import hashlib
import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from ina.wire import PAYLOAD_DTYPE, PAYLOAD_WIDTH, PayloadType, result_type

from . import kernels as K

HOST_AGGREGATED = ("variable-length message: needs the host-aggregator mode of the switch service "
                   "(NOT switch-feasible)")


@dataclass(frozen=True)
class ScaleContext:
    """What the workers of one allreduce share: the negotiated exponent and the switch's resources."""
    exponent: int            # max over workers of their scale_exponent()
    n_workers: int = 1
    register_bits: int = 64  # switch register width (32 or 64)
    seed: int = 0            # per-worker, per-chunk randomness for stochastic codecs
    agreed: tuple = ()       # max over workers of each value of Codec.negotiated() (e.g. MQGrad's bits)
    elements: int = 0        # elements per packet (0: unknown); decode_sum sees whole packets (THC aligns to them)

    def from_element(self, first: int) -> "ScaleContext":
        """The context for encoding a block of the tensor that starts at element ``first``: its random
        stream is shifted so that the block draws what a whole-tensor encode draws for its elements."""
        return self if first == 0 else replace(self, seed=K.stream_seed(self.seed, first))


@dataclass
class Encoded:
    """What goes on the wire for one tensor: fixed-width integer codes plus a little metadata."""
    codec: str
    codes: np.ndarray
    shape: tuple
    meta: dict = field(default_factory=dict)
    like: Any = None          # the input (type, dtype and device are restored from it)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the codes plus 4 bytes per metadata number (exponent, norm...)."""
        return int(self.codes.nbytes) + 4 * sum(1 for v in self.meta.values() if np.isscalar(v))

    @property
    def bits_per_element(self) -> float:
        n = int(np.prod(self.shape)) if self.shape else 1
        return 8.0 * self.nbytes / max(n, 1)


def to_numpy_f32(x) -> np.ndarray:
    """A flat, contiguous float32 numpy view/copy of a torch tensor (any device) or numpy array."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    mod = type(x).__module__
    if mod.startswith("torch"):
        if x.device.type == "cpu" and x.dtype is _torch().float32 and x.is_contiguous():
            return x.detach().numpy().reshape(-1)    # the tensor's own memory, as below, in two calls not five
        return x.detach().reshape(-1).to(device="cpu", dtype=_torch().float32).contiguous().numpy()
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32)).reshape(-1)


def from_numpy_like(arr: np.ndarray, like, shape=None):
    """Put a flat float32 result back into the type, shape, dtype and device of ``like``."""
    shape = tuple(shape if shape is not None else np.shape(like))
    if isinstance(like, np.ndarray):
        return arr.reshape(shape).astype(like.dtype if like.dtype.kind == "f" else np.float32, copy=False)
    if like is not None and type(like).__module__.startswith("torch"):
        torch = _torch()
        t = torch.from_numpy(np.ascontiguousarray(arr)).reshape(shape)
        return t.to(device=like.device, dtype=like.dtype)
    return arr.reshape(shape)


def write_back(tensor, out: np.ndarray) -> None:
    """Copy a flat float32 result into ``tensor`` in place (numpy array, or torch tensor on any device);
    nothing to copy when ``out`` is the tensor's own memory (a contiguous float32 one, decoded into)."""
    if isinstance(tensor, np.ndarray):
        if not (tensor.dtype == np.float32 and tensor.flags.c_contiguous and _same_data(out, tensor.ctypes.data,
                                                                                        tensor.size)):
            np.copyto(tensor, out.reshape(tensor.shape), casting="unsafe")
        return
    torch = _torch()
    if (tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.is_contiguous()
            and _same_data(out, tensor.data_ptr(), tensor.numel())):
        return
    with torch.no_grad():
        tensor.copy_(torch.from_numpy(out).reshape(tensor.shape))


def _same_data(out: np.ndarray, address: int, size: int) -> bool:
    return out.size == size and out.flags.c_contiguous and (size == 0 or out.ctypes.data == address)


def native(a: np.ndarray) -> np.ndarray:
    """A contiguous, native-byte-order array (wire payload views are big-endian; numba needs native)."""
    a = np.asarray(a)
    if not a.dtype.isnative:
        return a.astype(a.dtype.newbyteorder("="))
    return np.ascontiguousarray(a)


def _torch():
    import torch
    return torch


def check_finite(bad: int, what: str = "tensor") -> None:
    if bad:
        raise ValueError(f"{what} contains {bad} NaN or Inf value(s); refusing to encode (nothing was sent)")


def max_exponent(x32: np.ndarray) -> int:
    """floor(log2(max |x|)) of a float32 array (-127 for an all-zero tensor); raises on NaN/Inf."""
    mx, bad = K.max_abs_exponent(x32.view(np.uint32))
    check_finite(bad)
    if mx == 0:  # zeros and denormals only
        a = float(np.max(np.abs(x32))) if x32.size else 0.0
        return math.frexp(a)[1] - 1 if a > 0 else -127
    return int(mx) - 127


class Codec:
    """Base class. Subclasses set the class attributes and implement the methods they support."""

    name: ClassVar[str]
    wire_id: ClassVar[int]
    payload_type: ClassVar[PayloadType] = PayloadType.NONE
    switch_summable: ClassVar[bool] = False   # can an integer-only switch sum the codes?
    unbiased: ClassVar[bool] = True
    stochastic: ClassVar[bool] = False
    adaptive_width: ClassVar[bool] = False    # does the code range change between allreduces (MQGrad's K)?
    description: ClassVar[str] = ""
    #: where the sum is computed: "switch" (integer codes summed at line rate by encode_shared /
    #: decode_sum) or "host" (compress() messages decoded, summed and re-encoded by the host aggregator)
    aggregation: ClassVar[str] = "switch"
    variable_length: ClassVar[bool] = False   # are compress()'s messages variable-length?
    label: ClassVar[str] = "switch-feasible: fixed-width integer codes summed by the switch"
    #: does the codec keep an error-feedback residual per tensor key? Then compress, scale_exponent
    #: and encode_shared take ``key=`` (see :meth:`key_argument`); ``error_feedback`` says whether it is on
    keeps_residuals: ClassVar[bool] = False
    error_feedback: bool = False
    #: can :meth:`encode_rows` encode any chunk of a tensor alone, straight into a packet (codes that are
    #: elementwise, their random stream positioned by element)?
    encodes_rows: ClassVar[bool] = False

    def __init__(self, seed: int | None = 0):
        self._rng = np.random.default_rng(seed)

    def next_seed(self) -> int:
        return int(self._rng.integers(0, 2**32))

    def rng_fingerprint(self) -> str | None:
        """A short hash of a stochastic codec's random state (None for deterministic codecs): two ranks'
        codec objects with the same fingerprint would draw the same random numbers."""
        if not self.stochastic:
            return None
        return hashlib.blake2b(repr(self._rng.bit_generator.state).encode(), digest_size=8).hexdigest()

    def options(self) -> dict:
        """The constructor options of this object that can be read back from it (scalars only, no seed).

        ``get(name, seed=s, **codec.options())`` builds a codec that encodes and decodes like this one
        (the host aggregator builds its own that way). Options a codec does not keep as an attribute of
        the same name (and non-scalar ones, e.g. MQGrad's controller) are left at their defaults.
        """
        out = {}
        for p in inspect.signature(type(self).__init__).parameters.values():
            if p.name in ("self", "seed") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if hasattr(self, p.name):
                v = getattr(self, p.name)
                if isinstance(v, np.generic):
                    v = v.item()
                if v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
                    out[p.name] = v
        return out

    # -- error feedback ---------------------------------------------------------------------------
    def key_argument(self, key) -> dict:
        """The keyword arguments that pass tensor ``key`` to this codec's methods: ``{"key": key}`` for
        a codec that keeps residuals per key, ``{}`` otherwise (or without a key)."""
        return {"key": key} if self.keeps_residuals and key is not None else {}

    def residual(self, key=None) -> np.ndarray | None:
        """The error-feedback residual of ``key`` (a copy; None when the key has none)."""
        return None

    def residual_keys(self) -> list:
        """The keys that hold an error-feedback residual."""
        return []

    def reset(self, key=...) -> None:
        """Drop the residual of ``key`` (all keys when called without one)."""

    # -- cost -----------------------------------------------------------------------------------
    @property
    def bits_per_element(self) -> float:
        """Bits on the wire per element (fixed-width codes; metadata excluded)."""
        return 8.0 * PAYLOAD_DTYPE[self.payload_type].itemsize

    # -- operator on one tensor -------------------------------------------------------------------
    def compress(self, x) -> Encoded:
        raise NotImplementedError

    def decompress(self, enc: Encoded):
        raise NotImplementedError

    def roundtrip(self, x):
        """decompress(compress(x)): the compression operator itself."""
        return self.decompress(self.compress(x))

    # -- switch path ------------------------------------------------------------------------------
    def scale_exponent(self, x32: np.ndarray) -> int:
        raise NotImplementedError(f"codec {self.name!r} is not switch-summable")

    def negotiated(self) -> tuple[int, ...]:
        """Further small integers (int16) the workers must agree on, by max, before encoding (the
        client negotiates them through the switch's max register next to the scale exponent and
        passes the maxima as ``ScaleContext.agreed``). Default: none."""
        return ()

    def max_abs_code(self, ctx: ScaleContext) -> int | None:
        """The largest |code| :meth:`encode_shared` can produce under ``ctx`` (None: no small bound).
        When ``ctx.n_workers`` times it is at most 127, the client sends INT8 codes as INT8_NARROW and
        the switch returns int8 sums: one byte per element down instead of four."""
        return None

    def int8_sums(self, ctx: ScaleContext) -> bool:
        """Do ``ctx.n_workers`` workers' int8 codes always sum within int8 (sent as INT8_NARROW)?"""
        if self.payload_type != PayloadType.INT8:
            return False
        bound = self.max_abs_code(ctx)
        return bound is not None and bound * ctx.n_workers <= 127

    def uplink_type(self, ctx: ScaleContext) -> PayloadType:
        """The payload type of this codec's codes on the wire under ``ctx`` (INT8_NARROW when
        :meth:`int8_sums`)."""
        return PayloadType.INT8_NARROW if self.int8_sums(ctx) else self.payload_type

    def result_type(self, ctx: ScaleContext, raw: bool = False) -> PayloadType:
        """The payload type the switch's results come back in (:func:`ina.wire.result_type` of the
        uplink type; ``raw``: the job asked for raw register sums)."""
        return PayloadType(result_type(self.uplink_type(ctx), raw, ctx.register_bits))

    def result_width(self, n_workers: int, *, any_state: bool = False) -> int:
        """Bytes per element of the switch's results for ``n_workers`` workers, in the codec's initial
        state (``any_state``: the widest over every state it can reach; an adaptive codec's code
        range grows, e.g. MQGrad's bits, so its narrow sums may widen later)."""
        ctx = ScaleContext(0, n_workers)
        up = self.payload_type if any_state and self.adaptive_width else self.uplink_type(ctx)
        return PAYLOAD_WIDTH[PayloadType(result_type(up, False, ctx.register_bits))]

    def feasible_under(self, profile, raw: bool = False) -> tuple[bool, str]:
        """(feasible, why) of this codec under a switch profile (:mod:`ina.profiles`): its sums must be
        computed by the switch's ALUs (or the profile allows the host aggregator), its payload type
        summable there, NC8 sums re-encodable unless the job asks for ``raw`` sums."""
        if self.aggregation == "host":
            return (profile.host_aggregator,
                    "runs on the service's host aggregator (NOT switch-feasible)" if profile.host_aggregator else
                    "variable-length messages need a host aggregator, which this device has not")
        if not self.switch_summable:
            return False, "its codes cannot be summed by an integer switch"
        if self.payload_type not in profile.payload_types:
            return False, f"payload {PayloadType(self.payload_type).name} cannot be summed by its ALUs"
        if self.payload_type == PayloadType.NC8 and not raw and not profile.nc8_reencode:
            return False, "re-encoding NC8 sums needs a leading-one search per element (raw sums only)"
        return True, "feasible"

    def encode_shared(self, x32: np.ndarray, ctx: ScaleContext) -> np.ndarray:
        raise NotImplementedError(f"codec {self.name!r} is not switch-summable")

    def encode_rows(self, x32: np.ndarray, ctx: ScaleContext, dst: np.ndarray, rows: np.ndarray, chunks: np.ndarray,
                    at: int, elements: int) -> None:
        """:meth:`encode_shared` of the whole tensor ``x32``, cut into chunks of ``elements``, but only
        chunks ``chunks`` and each straight into its packet: chunk ``chunks[q]``'s codes, in wire byte
        order and zero-padded past the tensor's end, go to ``dst[rows[q], at:]`` (``dst``: a 2-D
        C-contiguous uint8 packet ring). The same codes, bit for bit, without an encoded copy of the
        tensor. Only for codecs with ``encodes_rows``."""
        raise NotImplementedError(f"codec {self.name!r} encodes whole blocks (encode_shared), not single chunks")

    def decode_sum(self, payload: np.ndarray, ctx: ScaleContext, raw: bool) -> np.ndarray:
        raise NotImplementedError(f"codec {self.name!r} is not switch-summable")

    def decode_sum_into(self, payload: np.ndarray, ctx: ScaleContext, raw: bool, out: np.ndarray, rows: np.ndarray,
                        which: np.ndarray | None = None) -> None:
        """:meth:`decode_sum` of result payloads straight into the output: ``out[rows[i]]`` (a row of
        ``out``, shape (chunks, elements)) gets the decoded ``payload[which[i]]`` (``which`` None:
        ``payload[i]``). ``payload`` is 2-D, one packet's payload per row, in wire or native byte order
        (e.g. a view of the receive ring). Codecs with a fused kernel override it; this is the same
        arithmetic through :meth:`decode_sum`."""
        p = payload if which is None else payload[which]
        out[rows] = self.decode_sum(native(p).reshape(-1), ctx, raw=raw).reshape(len(rows), -1)

    def __repr__(self) -> str:
        return f"<codec {self.name} id={self.wire_id} {self.bits_per_element:g} bits/elem>"


class HostAggregated:
    """The declarations of a codec whose messages are variable-length (3lc, eaq, wgt, topk): no switch
    path; the service's host aggregator decodes, sums and re-encodes them (NOT switch-feasible).
    Listed first among a codec's bases, so that these values win."""

    payload_type = PayloadType.NONE
    switch_summable = False
    variable_length = True
    aggregation = "host"
    label = HOST_AGGREGATED
