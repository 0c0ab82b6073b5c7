"""Switch hardware profiles: what a real device imposes on the software switch.

A profile names the limits of one class of switch: elements per packet (registers a packet's
values pass through), register width, slot pool size, jobs at a time, workers per job, the payload
types its ALUs can sum and whether it can re-encode natural-compression sums. ``ina-switch serve
--profile NAME`` runs under one; the control plane refuses at join time what the profile cannot do,
with an error naming the profile and the limit; each codec states under which profiles it is
feasible (:meth:`ina.compression.base.Codec.feasible_under`).

The profiles live in ``ina`` (not ``switch_model``) because both sides read them: the switch
enforces them, clients and the sweep size their packets and choose their codecs by them.

``software`` (the default) is the software switch as it is without a profile: nothing is limited
beyond ``ina-switch serve``'s own flags. ``tofino`` is SwitchML's published design on a Tofino
(P4): 64 int32 values per 256-byte payload, 32-bit registers, 8192 slots (each with its shadow
set), at most 32 workers (a 32-bit worker bitmap), integer adds only. ``tofino-recirc`` is the same
with recirculation: 256 values per 1 KB payload. Natural-compression (NC8) codes can be turned into
integers by a table lookup and summed, but re-encoding a sum back into NC8 needs a leading-one
search per element that the design does not do (seed 004 ran that on CPU aggregators), so NC8 is
feasible there only with raw sums. One job at a time is an assumption (SwitchML's evaluation runs
one job that owns the pool), not a documented hardware limit; ``--profile`` plus ``ina-switch``'s
flags cannot raise a profile's limits.
"""
from __future__ import annotations

from dataclasses import dataclass

from ina.wire import PayloadType

_INTEGER_ADDS = frozenset({PayloadType.NONE, PayloadType.INT32, PayloadType.INT8, PayloadType.INT8_NARROW,
                           PayloadType.NC8})


class ProfileError(ValueError):
    """A request a switch profile cannot serve (the message names the profile and the limit)."""


@dataclass(frozen=True)
class SwitchProfile:
    name: str
    description: str
    elements: int | None = None          # most elements per packet (registers per slot); None: no limit
    register_bits: int | None = None     # the registers' width; None: as --register-bits says
    slots: int | None = None             # slot pool size (each slot with its shadow set)
    jobs: int | None = None              # jobs installed at a time
    workers: int | None = None           # workers per job (the worker bitmap's width)
    payload_types: frozenset = _INTEGER_ADDS | {PayloadType.INT64}
    nc8_reencode: bool = True            # can it re-encode NC8 sums (else NC8 only with raw sums)?
    host_aggregator: bool = True         # may the service run the host aggregator (NOT switch-feasible)?

    @property
    def hardware(self) -> bool:
        return self.name != "software"

    def defaults(self) -> dict:
        """``ina-switch serve`` settings this profile fixes (slots, elements, register_bits)."""
        return {k: v for k, v in (("slots", self.slots), ("elements", self.elements),
                                  ("register_bits", self.register_bits)) if v is not None}

    def refuse(self, what: str, limit: str) -> ProfileError:
        return ProfileError(f"switch profile {self.name!r} cannot {what}: {limit}")

    def check_settings(self, slots: int, elements: int, register_bits: int) -> None:
        """Refuse switch settings beyond the profile (an explicit --slots/--elements/--register-bits)."""
        if self.slots is not None and slots > self.slots:
            raise self.refuse(f"hold {slots} slots", f"its slot pool has {self.slots}")
        if self.elements is not None and elements > self.elements:
            raise self.refuse(f"take {elements} elements per packet", f"at most {self.elements} per packet")
        if self.register_bits is not None and register_bits != self.register_bits:
            raise self.refuse(f"use {register_bits}-bit registers", f"its registers are {self.register_bits}-bit")

    def check_join(self, world_size: int, elements: int, raw: bool, jobs_running: int, codecs=()) -> None:
        """Refuse a job this profile cannot run: too many workers, elements per packet or jobs, or a
        codec not feasible under it (``codecs``: the names the workers declared at join)."""
        if self.workers is not None and world_size > self.workers:
            raise self.refuse(f"run a job of {world_size} workers", f"at most {self.workers} workers per job")
        if self.elements is not None and elements > self.elements:
            raise self.refuse(f"take {elements} elements per packet", f"at most {self.elements} per packet")
        if self.jobs is not None and jobs_running >= self.jobs:
            raise self.refuse(f"install another job ({jobs_running} running)", f"at most {self.jobs} at a time")
        from ina import compression
        for name in codecs:
            ok, why = compression.get(name).feasible_under(self, raw=raw)
            if not ok:
                raise self.refuse(f"aggregate codec {name!r}", why)

    def describe(self) -> str:
        """One line naming the limits, for logs and reports."""
        parts = [f"{self.elements} elements/packet" if self.elements else None,
                 f"{self.register_bits}-bit registers" if self.register_bits else None,
                 f"{self.slots} slots" if self.slots else None,
                 f"{self.jobs} job(s)" if self.jobs else None,
                 f"{self.workers} workers/job" if self.workers else None]
        limits = ", ".join(p for p in parts if p)
        return f"{self.name} ({limits or 'no hardware limits'})"


_TOFINO = dict(register_bits=32, slots=8192, jobs=1, workers=32, payload_types=_INTEGER_ADDS,
               nc8_reencode=False, host_aggregator=False)

PROFILES = {p.name: p for p in (
    SwitchProfile("software", "the software switch, limited only by its own flags"),
    SwitchProfile("tofino", "SwitchML on a Tofino: 64 int32 values per 256-byte payload", elements=64, **_TOFINO),
    SwitchProfile("tofino-recirc", "SwitchML on a Tofino with recirculation: 256 int32 values per 1 KB payload",
                  elements=256, **_TOFINO),
)}
DEFAULT_PROFILE = "software"


def get_profile(name: str | None) -> SwitchProfile:
    """The profile called ``name`` (None: the default); a clear error for an unknown name."""
    name = name or DEFAULT_PROFILE
    if name not in PROFILES:
        raise ProfileError(f"unknown switch profile {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]
