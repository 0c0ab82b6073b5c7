"""Rates and token-bucket (tbf) parameters for the emulated links.

Rates follow tc's conventions: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` are decimal bits per
second (``100mbit`` = 100 000 000 bit/s) and, like tc, a rate counts the bytes of the Ethernet frame
as the kernel sees it (Ethernet header + IP packet; no preamble, inter-frame gap or FCS).
tc's byte-based spellings (``mbps`` = megaBYTES per second) are rejected on purpose: they are the
classic source of 8x mistakes.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: bits per second per unit
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
#: tbf's rate field is a 32-bit count of bytes per second
MAX_RATE_BPS = 8 * (2**32 - 1)
MIN_RATE_BPS = 8_000
#: spellings that mean "no shaping on this direction" (and None); a rate of zero, in any spelling, is refused
UNLIMITED = ("unlimited", "none", "off")
#: Ethernet header the kernel counts in a veth frame (no FCS on veth)
ETH_HLEN = 14

_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)(?:/s)?\s*$", re.IGNORECASE)


class RateError(ValueError):
    """A rate that cannot be used for a link."""


def parse_rate(value, tbf_limit: bool = True) -> int | None:
    """Parse a link rate into bits per second; ``None``/"unlimited" mean no shaping. Zero, whether
    ``0`` or ``"0"`` or ``"0mbit"``, is refused: it reads as a stopped link as well as an unshaped one.

    Accepts an int/float (bit/s) or a string with a tc unit: ``"10mbit"``, ``"1gbit"``,
    ``"2.5gbit"``, ``"500kbit"``, ``"1000000"``. ``tbf_limit=False`` for a rate that is never
    shaped itself (a time-dilation target such as 100gbit, shaped at target/K): no 34 gbit cap.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise RateError(f"rate {value!r}: expected a number of bit/s or a string like '100mbit'")
    text = repr(value)
    if isinstance(value, (int, float)):
        bps = float(value)
    elif isinstance(value, str):
        if value.strip().lower() in UNLIMITED:
            return None
        m = _RATE_RE.match(value)
        if not m:
            raise RateError(f"rate {value!r}: expected a number and a tc unit, e.g. '100mbit', '1gbit'")
        unit = m.group(2).lower() or "bit"
        if unit.endswith("bps"):
            raise RateError(
                f"rate {value!r}: '{m.group(2)}' means bytes per second in tc's notation; "
                f"write the rate in bits, e.g. '{m.group(1)}{unit[:-3] or ''}bit' "
                f"(units: {', '.join(RATE_UNITS)})")
        if unit not in RATE_UNITS:
            raise RateError(f"rate {value!r}: unknown unit '{m.group(2)}' (units: {', '.join(RATE_UNITS)})")
        bps = float(m.group(1)) * RATE_UNITS[unit]
    else:
        raise RateError(f"rate {value!r}: expected a number of bit/s or a string like '100mbit'")
    if bps == 0:
        raise RateError(f"rate {text}: zero is not a rate; for a link without shaping write 'unlimited'")
    if not math.isfinite(bps) or bps < 0:
        raise RateError(f"rate {text}: must be a positive number of bit/s (or 'unlimited')")
    if bps < MIN_RATE_BPS:
        raise RateError(f"rate {text}: below the minimum of {format_rate(MIN_RATE_BPS)}")
    if tbf_limit and bps > MAX_RATE_BPS:
        raise RateError(f"rate {text}: above tbf's 32-bit limit of {format_rate(MAX_RATE_BPS)} "
                        "(about 34 gbit)")
    # tbf works in whole bytes per second
    return int(round(bps / 8)) * 8


def format_rate(bps: int | None) -> str:
    """``100000000`` -> ``'100mbit'``; ``None`` -> ``'unlimited'``."""
    if bps is None:
        return "unlimited"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scale = RATE_UNITS[unit]
        if bps >= scale:
            v = bps / scale
            return f"{v:g}{unit}" if v == round(v, 3) else f"{v:.3f}{unit}"
    return f"{bps}bit"


@dataclass(frozen=True)
class TbfParams:
    """One direction of one link: a token bucket in front of a byte-limited FIFO."""
    rate_bps: int        # token rate, bit/s of Ethernet frames
    burst: int           # bucket depth in bytes (also the largest frame sent without segmenting)
    limit: int           # FIFO size in bytes (queued frames beyond this are dropped)

    @property
    def rate_bytes(self) -> int:
        return self.rate_bps // 8


#: defaults for :func:`tbf_params` (see docs/links.md for the measurements behind them)
BURST_TIME = 0.002        # bucket = 2 ms of tokens at the link rate, at least two full frames
QUEUE_TIME = 0.020        # FIFO = 20 ms at the link rate...
UP_QUEUE_FRAMES = 1000    # ...but the upload queue (the host's NIC queue) at least txqueuelen's 1000 frames
DOWN_QUEUE_FRAMES = 128   # ...and the download queue (the switch's port buffer) at least 128 frames
MIN_BURST_FRAMES = 2


def tbf_params(rate, mtu: int = 1500, *, queue_frames: int = DOWN_QUEUE_FRAMES,
               burst_time: float = BURST_TIME, queue_time: float = QUEUE_TIME) -> TbfParams:
    """Token bucket for a link of ``rate``: burst and queue are derived from the rate.

    * burst: ``max(2 frames, burst_time * rate)``. The bucket must cover the qdisc watchdog's
      wake-up latency: tokens that arrive while a full bucket waits for a late timer are lost.
      0.1 ms of tokens holds only ~60% of 1 gbit, 1 ms ~97% on a loaded 2-core machine, 2 ms
      99%. A larger bucket lets a sender run faster than the link for longer after an idle
      period (up to ``burst`` bytes pass at once).
    * limit: ``burst + max(queue_frames frames, queue_time * rate)`` bytes. Upload queues use
      ``UP_QUEUE_FRAMES`` (a Linux NIC's txqueuelen): a local sender is then held back by its
      socket buffer, as on a real host, instead of losing datagrams in its own queue. Download
      queues use ``DOWN_QUEUE_FRAMES``: a switch-port-sized buffer that TCP can fill without
      starving the link and that absorbs a pool's worth of INA packets.
    """
    rate_bps = parse_rate(rate)
    if rate_bps is None:
        raise RateError("tbf_params needs a finite rate")
    if not 68 <= int(mtu) <= 65535:
        raise RateError(f"mtu {mtu}: must be between 68 and 65535")
    if burst_time <= 0 or queue_time <= 0 or queue_frames < 1:
        raise RateError(f"burst_time {burst_time}, queue_time {queue_time} and queue_frames "
                        f"{queue_frames} must be positive")
    frame = int(mtu) + ETH_HLEN
    rate_bytes = rate_bps / 8
    burst = max(MIN_BURST_FRAMES * frame, math.ceil(rate_bytes * burst_time))
    limit = burst + max(int(queue_frames) * frame, math.ceil(rate_bytes * queue_time))
    return TbfParams(rate_bps=rate_bps, burst=int(burst), limit=int(limit))
