"""A client's departure from its job: leave cleanly even without ``close()``, and say why a job ended.

A script that creates ``ina.Client(...)`` without ``with`` or ``close()`` and simply exits would close
its control connection without leaving; the switch cannot tell that from a crash. :func:`leave_at_exit`
makes such a client leave its job when the interpreter exits or the client is garbage-collected
(``weakref.finalize``: runs once, at exit too; ``close()`` detaches it).

:func:`abort_reason` asks the switch why it aborted a job (a rank that disconnected without leaving,
after the switch's grace period for replays), for the error the other ranks raise.
"""
from __future__ import annotations

import logging
import weakref

from .control import ControlError

log = logging.getLogger("ina.client")


def _leave(ctl, sock, rank: int, job: int) -> None:
    try:
        ctl.request({"op": "leave"}, timeout=5.0)
        log.info("rank %d left job %d at exit (the client was not closed)", rank, job)
    except (ControlError, OSError) as e:
        log.warning("rank %d: leaving job %d at exit: %s", rank, job, e)
    finally:
        ctl.close()
        sock.close()


def leave_at_exit(client) -> weakref.finalize:
    """Leave ``client``'s job at interpreter exit or when it is collected, unless it was closed first
    (``close()`` calls ``detach()`` on the returned finalizer)."""
    return weakref.finalize(client, _leave, client.ctl, client.sock, client.rank, client.job)


def abort_reason(ctl, job: int, rank: int) -> str:
    """Why the switch aborted ``job`` (its control plane keeps the reason of jobs it tore down);
    the ABORT packet alone only names ``rank``."""
    fallback = f"rank {rank} left the job"
    if ctl is None:
        return fallback
    try:
        st = ctl.request({"op": "status", "job": job}, timeout=2.0)["status"]
    except (ControlError, OSError):
        return fallback
    return st.get("ended") or fallback
