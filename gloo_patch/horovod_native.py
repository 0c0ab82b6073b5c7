"""The INA Horovod backend's paths through Horovod's own machinery: the allreduces that stay on Horovod (its
errors reach every rank), the reconciliation of batches that differ across ranks, a bounded wait on a Horovod
handle, and the pace of Horovod's background cycle while the switch carries the allreduces.

:class:`HorovodNative` is a base of ``gloo_patch.horovod``'s backend state: it uses its ``M`` (``horovod.torch.
mpi_ops``), ``orig`` (Horovod's own functions), ``config``, ``active``, ``fallbacks`` and ``stale``.
"""
from __future__ import annotations

import json
import os
import time

from .common import log

DETAIL_NAME = "ina.agree.detail"
INA_HOROVOD_CYCLE_MS = 20.0    # Horovod's cycle when the switch carries the allreduces (quieter_background_cycle)
POLL_FIRST_S, POLL_MAX_S = 0.0001, 0.001     # waiting for a Horovod handle: polls from 0.1 ms, doubling up to 1 ms


def quieter_background_cycle() -> None:
    """Horovod's background thread wakes every ``HOROVOD_CYCLE_TIME`` ms (default 1) and, even with nothing
    queued, runs one Gloo allreduce of its cache bits with every rank: its threads' CPU per second per rank on
    this machine, 2 idle ranks, was 115 to 280 ms at 1 ms, 24 to 26 at 5 ms, 14 to 17 at 20 ms, 6 at 50 ms
    (load average 3 to 5), taken from backward. With the switch
    carrying the allreduces that loop serves only what stays on Gloo (broadcast, allgather, fallbacks), so unless
    the user set the variable the INA backend starts Horovod with a cycle of ``INA_HOROVOD_CYCLE_MS``: such an op
    then waits up to that long for the next cycle (10 ms on average, where Horovod's default waits 0.5)."""
    if not os.environ.get("HOROVOD_CYCLE_TIME"):
        os.environ["HOROVOD_CYCLE_TIME"] = f"{INA_HOROVOD_CYCLE_MS:g}"


class HorovodNative:
    """Horovod's own collectives, as the backend uses them (every one bounded by INA_TIMEOUT)."""

    def _reconcile(self, batch):
        """The ranks' batches differ: exchange the descriptions. Names queued on every rank run now (through
        Horovod if their descriptions differ: Horovod raises its own mismatch error on every rank); the
        rest stay queued for a later round, each knowing the ranks that lack it. If no name is queued on every
        rank and every rank is stuck (a thread waits in ``synchronize`` with nothing else queued: no rank can
        queue what another waits for), every rank raises the same error at once, naming what each waits for."""
        import torch  # noqa: PLC0415

        mine = json.dumps({"entries": [[h.name, h.desc] for h in batch], "stuck": self.stuck()}).encode()
        h = self.M.allgather_async(torch.tensor(list(mine), dtype=torch.uint8).reshape(-1, 1), name=DETAIL_NAME)
        lens = self._native_wait(self._native_allreduce(torch.zeros(self.M.size(), dtype=torch.int64).index_fill_(
            0, torch.tensor([self.M.rank()]), len(mine)), DETAIL_NAME + ".len"), "the agreement's sizes")
        data = bytes(self._native_wait(h, "the agreement's details").reshape(-1).tolist())
        per_rank, stuck, off = [], [], 0
        for n in lens.tolist():
            detail = json.loads(data[off:off + n].decode())
            per_rank.append(dict(detail["entries"]))
            stuck.append(detail["stuck"])
            off += n
        common = set(per_rank[0]).intersection(*per_rank[1:])
        if not common and all(stuck):
            raise self.M.HorovodInternalError(
                "INA backend: the ranks wait for different allreduces and none is queued on every rank: " + "; ".join(
                    f"rank {r}: {', '.join(map(repr, sorted(names)[:5]))}" for r, names in enumerate(per_rank))
                + " (every rank waits in synchronize with nothing else queued, so none can go on; Horovod needs every "
                  "rank to allreduce the same names)")
        for h in batch:
            if h.name not in common:
                h.missing = [r for r, names in enumerate(per_rank) if h.name not in names]
        ready = [h for h in batch if h.name in common]
        native = {h.name: "ranks disagree on it (Horovod checks)" for h in ready
                  if len({d[h.name] for d in per_rank}) > 1}
        return ready, native

    def _native_allreduce(self, t, name):
        return self.orig["_allreduce_async"](t, t, name, self.M.Sum, 1.0, 1.0, self.M.global_process_set)

    def _native_wait(self, handle, what: str):
        """Horovod's synchronize, bounded by INA_TIMEOUT (a rank that never reaches the round)."""
        if self.stale is not None:
            stale, self.stale = self.stale, None
            self._native_wait(stale, "an earlier agreement round")
        if not self._poll_until(handle, time.monotonic() + self.config.timeout):
            self.stale = handle
            raise self.M.HorovodInternalError(
                f"INA backend: {what} did not complete within {self.config.timeout:g} s (INA_TIMEOUT): a rank "
                "did not reach it; queued here: " + ", ".join(list(self.active)[:10]))
        return self.orig["synchronize"](handle)

    def _poll_until(self, handle, deadline: float | None = None) -> bool:
        """Wait until Horovod's ``handle`` has finished (True), or ``deadline`` (``time.monotonic()``) passed
        (False), polling at most every ``POLL_MAX_S``. Not through Horovod's ``synchronize``: it waits in a loop
        of ``std::this_thread::yield()``, which keeps a core busy for as long as the op takes (one background
        cycle at least) on a machine where backward needs it."""
        pause = POLL_FIRST_S
        while not self.orig["poll"](handle):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        return True

    def wait_user_op(self, handle) -> None:
        """Wait for the user's own Horovod op (broadcast, allgather, ...) by polling. Unbounded as Horovod's own
        wait (a rank may legitimately reach a broadcast later), but it says what it waits for: a warning every
        INA_TIMEOUT while the op has not finished."""
        waited = 0.0
        while not self._poll_until(handle, time.monotonic() + self.config.timeout):
            waited += self.config.timeout
            log.warning("[ina horovod rank %d] still waiting for Horovod op (handle %s) after %g s: a rank has "
                        "not reached it yet", self.rank, handle, waited)

    def _run_native(self, handles, why: dict) -> None:
        started = []
        for h in handles:
            self.fallbacks.fallback("grouped_allreduce" if h.grouped else "allreduce", why[h.name], h.name)
            try:
                if h.grouped:
                    nh = self.orig["_grouped_allreduce_async"](h.tensors, h.outputs, h.name, h.op, h.prescale,
                                                               h.postscale, self.M.global_process_set)
                else:
                    nh = self.orig["_allreduce_async"](h.tensors[0], h.outputs[0], h.name, h.op, h.prescale,
                                                       h.postscale, self.M.global_process_set)
                started.append((h, nh))
            except Exception as e:  # noqa: BLE001 - the caller's synchronize raises it
                h.error = e
        for h, nh in started:     # every rank agreed to run these here: bounded as the agreement's rounds
            try:
                self._native_wait(nh, f"Horovod's allreduce {h.name!r} (run by Horovod: {why[h.name]})")
                h.done = True
            except Exception as e:  # noqa: BLE001
                h.error = e
