"""``horovodrun`` with the INA backend on: a thin wrapper.

    python -m gloo_patch.horovodrun --switch 127.0.0.1:9999 -- -np 4 -H localhost:4 --gloo python train.py
    python -m gloo_patch.horovodrun --start-switch --codec bfp32 -- -np 2 -H localhost:2 --gloo python train.py

It sets ``INA_SWITCH`` (and ``INA_CODEC``/``INA_TIMEOUT`` if given), puts a ``sitecustomize`` on
``PYTHONPATH`` that applies the patch in every rank (so it works even without the venv's ``.pth``
hook that ``make install`` writes), optionally starts an ``ina-switch`` for the run and stops it
afterwards, and runs the real ``horovodrun`` with the remaining arguments. The exit code is
horovodrun's. Plain ``INA_SWITCH=host:port horovodrun ...`` works too when the hook is installed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from switch_model.launch import start_switch, wait_ready

from .common import check_codec, parse_switch

INJECT_DIR = Path(__file__).resolve().parent / "_inject"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gloo_patch.horovodrun", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--switch", help="host:port of a running ina-switch (default: $INA_SWITCH)")
    g.add_argument("--start-switch", action="store_true", help="start an ina-switch for this run")
    ap.add_argument("--switch-port", type=int, default=9999, help="port of the switch --start-switch starts")
    ap.add_argument("--switch-arg", action="append", default=[], help="extra argument for the started switch")
    ap.add_argument("--codec", help="INA_CODEC for the ranks (nc, nc-det, bfp32, nd, rd)")
    ap.add_argument("--timeout", type=float, help="INA_TIMEOUT for the ranks (seconds)")
    ap.add_argument("horovodrun_args", nargs=argparse.REMAINDER, help="arguments for horovodrun (after --)")
    a = ap.parse_args(argv)
    rest = a.horovodrun_args[1:] if a.horovodrun_args[:1] == ["--"] else a.horovodrun_args
    if not rest:
        ap.error("no horovodrun arguments given (e.g. -- -np 2 -H localhost:2 --gloo python train.py)")

    env = dict(os.environ)
    if a.codec:
        env["INA_CODEC"] = check_codec(a.codec, "--codec")
    if a.timeout:
        env["INA_TIMEOUT"] = str(a.timeout)
    env["PYTHONPATH"] = os.pathsep.join([str(INJECT_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    switch = None
    try:
        if a.start_switch:
            log_path = Path(tempfile.gettempdir()) / f"ina-switch-{a.switch_port}.log"
            print(f"[ina-horovodrun] starting switch on port {a.switch_port} with {a.switch_arg} (log: {log_path})",
                  file=sys.stderr, flush=True)
            switch = start_switch(a.switch_port, *a.switch_arg, log_path=log_path, timeout=30.0)
            env["INA_SWITCH"] = switch.addr
        else:
            spec = a.switch or env.get("INA_SWITCH")
            if not spec:
                ap.error("give --switch host:port, --start-switch, or set INA_SWITCH")
            host, port = parse_switch(spec, "--switch")
            wait_ready(host, port, 10.0)
            env["INA_SWITCH"] = f"{host}:{port}"
        print(f"[ina-horovodrun] INA_SWITCH={env['INA_SWITCH']} INA_CODEC={env.get('INA_CODEC', 'nc')}",
              file=sys.stderr, flush=True)
        # horovodrun, with Horovod's rendezvous server fixed for jobs that re-initialize (gloo_patch.rendezvous_fix)
        return subprocess.call([sys.executable, "-m", "gloo_patch.rendezvous_fix", *rest], env=env)
    finally:
        if switch is not None:
            switch.stop(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
