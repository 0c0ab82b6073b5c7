"""Put on PYTHONPATH by ``python -m gloo_patch.horovodrun``: applies the INA Horovod patch in every rank
(when INA_SWITCH is set) without the venv's .pth hook, then runs any other sitecustomize on sys.path."""
import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("INA_SWITCH"):
    import gloo_patch.autopatch  # noqa: F401 - installs the horovod.torch import hook

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
