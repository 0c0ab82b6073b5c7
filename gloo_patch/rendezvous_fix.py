"""``horovodrun`` with a fix for Horovod 0.28.1's Gloo rendezvous server, for jobs that re-initialize.

Horovod's rendezvous server (``horovod.runner.http.http_server.RendezvousHandler.do_DELETE``) clears a
scope's keys once every rank has finished its rendezvous there, but then empties the finished lists of
*every* scope, not only that one. When the ranks' finish messages for the ``global``, ``local`` and
``cross`` scopes interleave (a matter of timing; on a loaded 2-core machine it happens within a few
``hvd.shutdown(); hvd.init()`` cycles), another scope is never cleared, and the next ``hvd.init()`` reads
a rank's stale address from it: ``gloo::IoException ... connect [127.0.0.1]:P: Connection refused`` and
the process aborts. Horovod's own test_torch.py (an init/shutdown per test) hits it with plain Gloo too.

:func:`apply` replaces ``do_DELETE`` with the same logic, emptying only the finished scope's list. It runs
in the ``horovodrun`` process (the rendezvous server lives there)::

    python -m gloo_patch.rendezvous_fix -np 2 -H localhost:2 --gloo python train.py   # = horovodrun ...

``python -m gloo_patch.horovodrun`` uses it, and ``gloo_patch.autopatch`` applies it in any process that
imports Horovod's runner while ``INA_SWITCH`` is set (so plain ``horovodrun`` gets it through the hook).
"""
from __future__ import annotations

import sys


def apply() -> bool:
    """Patch the rendezvous handler (idempotent). Returns True if patched now."""
    from horovod.runner.http import http_server as hs  # noqa: PLC0415

    handler = hs.RendezvousHandler
    if getattr(handler.do_DELETE, "ina_fixed", False):
        return False

    def do_DELETE(self):  # noqa: N802 - http.server's method name
        paths = self.path.split("/")
        if len(paths) < 3:
            self.send_status_code(hs.BAD_REQUEST)
            return
        _, scope, key = paths
        if scope in self.server.scope_size:
            with self.server.finished_list_lock:
                finished = self.server.finished_list[scope]
                finished.append(key)
                if self.server.scope_size[scope] == len(finished):
                    with self.server.cache_lock:
                        self.server.cache.get(scope, {}).clear()
                    finished.clear()          # Horovod 0.28.1 clears every scope's list here
        else:   # an ad-hoc scope added by a client: delete the key
            with self.server.cache_lock:
                scope_dict = self.server.cache.get(scope)
                if scope_dict is not None:
                    scope_dict.pop(key, None)
                    if not scope_dict:
                        del self.server.cache[scope]
        self.send_status_code(hs.OK)

    do_DELETE.ina_fixed = True
    handler.do_DELETE = do_DELETE
    return True


def main(argv: list[str] | None = None) -> int:
    apply()
    from horovod.runner.launch import run_commandline  # noqa: PLC0415

    sys.argv = ["horovodrun", *(sys.argv[1:] if argv is None else argv)]
    run_commandline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
