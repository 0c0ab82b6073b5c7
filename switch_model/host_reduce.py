"""The host aggregator's codec step: decode each rank's message, sum, re-encode the sum.

The aggregator has its own codec object per job and codec options (:func:`downlink_codec`, seeded
with :func:`aggregator_seed`), so that a codec with error feedback keeps the downlink residual per
(job, key), the downlink compression 3LC does at its servers. The sum is float64 in rank order,
then float32 (so that it does not depend on arrival order). No sockets here.
"""
from __future__ import annotations

import json
import logging
import time
import zlib
from dataclasses import dataclass

import numpy as np

from ina import compression
from ina.compression.base import to_numpy_f32
from ina.host_wire import Frame, pack_encoded, unpack_encoded

log = logging.getLogger("ina.switch.host_agg")


def aggregator_seed(job: int, codec_name: str, service_seed: int = 0) -> int:
    """The seed of the aggregator's own codec object for ``codec_name`` in job ``job``:
    CRC-32 of ``"ina-host-agg/<service seed>/<job>/<codec name>"`` (``--seed`` is the service seed)."""
    return zlib.crc32(f"ina-host-agg/{service_seed}/{job}/{codec_name}".encode())


class RoundFailed(Exception):
    """The round cannot complete; ``reason`` is the error counter, the message names what failed."""

    def __init__(self, reason: str, text: str):
        super().__init__(text)
        self.reason = reason


@dataclass
class Reduced:
    """A round's result: the RESULT frames' flags, meta and body, and the step's times (seconds)."""
    flags: int
    meta: dict
    body: np.ndarray
    decode_s: float
    sum_s: float
    encode_s: float


def downlink_codec(codecs: dict, job: int, name: str, options_json: str, service_seed: int, where: str):
    """The aggregator's codec object of ``job`` for ``name`` with these options (built on first use and
    kept in ``codecs``); :class:`RoundFailed` if the options do not build one."""
    ck = (name, options_json)
    codec = codecs.get(ck)
    if codec is None:
        options = json.loads(options_json)
        seed = aggregator_seed(job, name, service_seed)
        try:
            codec = compression.get(name, seed=seed, **options)
        except (ValueError, TypeError) as e:
            raise RoundFailed("bad_codec_options", f"{where}: the ranks' codec options {options} do not build a "
                              f"{name} codec: {e}") from None
        codecs[ck] = codec
        log.info("job %d: %s codec for the downlink (seed %d, options %s)", job, name, seed, options)
    return codec


def reduce_round(codec, msgs: list[Frame], n: int, key, where: str) -> Reduced:
    """Decode the ranks' messages (in rank order), sum them, re-encode the sum with ``codec``."""
    t0 = time.perf_counter()
    acc = np.zeros(n, np.float64)
    for r, m in enumerate(msgs):
        try:
            x = to_numpy_f32(codec.decompress(unpack_encoded(codec.name, m)))
            if x.size != n:
                raise ValueError(f"it decodes to {x.size} elements, not {n}")
        except (ValueError, KeyError, IndexError) as e:
            raise RoundFailed("decode", f"{where}: cannot decode rank {r}'s message ({m.body_bytes} bytes): "
                              f"{e}") from None
        acc += x
    t1 = time.perf_counter()
    total = acc.astype(np.float32)
    t2 = time.perf_counter()
    try:
        flags, env, body = pack_encoded(codec.compress(total, **codec.key_argument(key)))
    except (ValueError, OverflowError) as e:
        raise RoundFailed("encode", f"{where}: cannot re-encode the sum: {e}") from None
    return Reduced(flags, env, body, t1 - t0, t2 - t1, time.perf_counter() - t2)
