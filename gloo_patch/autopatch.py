"""Apply the INA Horovod patch to unmodified scripts: an import hook for ``horovod.torch``.

Importing this module (done at interpreter start by a ``.pth`` line, only when ``INA_SWITCH`` is set)
adds a meta-path finder: when ``horovod.torch`` finishes importing, :func:`gloo_patch.horovod.install`
runs; when Horovod's rendezvous server (``horovod.runner.http.http_server``, imported by ``horovodrun``)
finishes importing, :func:`gloo_patch.rendezvous_fix.apply` fixes its re-initialization race. Nothing else is imported, so processes that never touch Horovod (``horovodrun`` itself, pip,
pytest) pay only for this file.

    python -m gloo_patch.autopatch --install-hook    # write the .pth line into this venv (make install does)
    python -m gloo_patch.autopatch --remove-hook
    python -m gloo_patch.autopatch --status
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import sysconfig
from pathlib import Path

TARGET = "horovod.torch"
RENDEZVOUS = "horovod.runner.http.http_server"
PTH_NAME = "ina_emu_horovod_autopatch.pth"
PTH_LINE = "import os; os.environ.get('INA_SWITCH') and __import__('gloo_patch.autopatch')\n"


def _apply(module) -> None:
    try:
        from gloo_patch import horovod as patch
        patch.install()
    except Exception as e:  # noqa: BLE001 - a bad setting must stop the job with its message, loudly
        print(f"[ina] INA_SWITCH={os.environ.get('INA_SWITCH')!r} is set but the Horovod INA patch failed: {e}",
              file=sys.stderr, flush=True)
        raise


def _apply_rendezvous(module) -> None:
    from gloo_patch import rendezvous_fix
    rendezvous_fix.apply()


_HOOKS = {TARGET: _apply, RENDEZVOUS: _apply_rendezvous}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, hook):
        self.inner, self.hook = inner, hook

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.hook(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _HOOKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, _HOOKS[fullname])
        return spec


def enable() -> None:
    """Install the finder (idempotent); patch right away if horovod.torch is already imported."""
    if TARGET in sys.modules:
        _apply(sys.modules[TARGET])
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


if os.environ.get("INA_SWITCH"):
    enable()


# ---- the .pth hook -------------------------------------------------------------------------------------
def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def install_hook() -> Path:
    p = pth_path()
    if not p.exists() or p.read_text() != PTH_LINE:
        p.write_text(PTH_LINE)
    return p


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m gloo_patch.autopatch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--install-hook", action="store_true")
    g.add_argument("--remove-hook", action="store_true")
    g.add_argument("--status", action="store_true")
    a = ap.parse_args(argv)
    p = pth_path()
    if a.install_hook:
        print(f"[autopatch] hook installed: {install_hook()}")
    elif a.remove_hook:
        p.unlink(missing_ok=True)
        print(f"[autopatch] hook removed: {p}")
    else:
        ok = p.exists() and p.read_text() == PTH_LINE
        print(f"[autopatch] hook {'installed' if ok else 'NOT installed'}: {p}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
