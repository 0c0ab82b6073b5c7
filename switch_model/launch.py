"""The one launcher of the switch service: start ``python -m switch_model serve``, wait until its
control plane answers a stats request, stop it.

    from switch_model.launch import start_switch
    with start_switch(None, "--slots", "64", log_path="switch.log") as sw:    # a free port of 127.0.0.1
        ... sw.port, sw.addr, sw.stats(), sw.log()

Inside an emulated host (``ina.net``), start it through the topology, bound beyond loopback (which
needs a shared token: one is made and exported as INA_TOKEN when none is set), and ask it at the
host's address:

    start_switch(9999, popen=functools.partial(topo.popen, topo.switch), host="0.0.0.0",
                 control_host=topo.switch.ip)

Used by the Horovod wrapper, the sweep, the demo, the benchmarks and the tests.
"""
from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ina.control import ControlError, request

log = logging.getLogger("ina.switch.launch")

PACKAGE_ROOT = Path(__file__).resolve().parent.parent     # the child imports the same switch_model
PORT_TRIES = 3                                             # free ports tried when one is taken meanwhile


class SwitchStartError(RuntimeError):
    """The switch service exited, or did not answer, before it was ready; the message says which."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free for both UDP and TCP on ``host`` (the switch uses one number for both planes)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind((host, 0))
            port = u.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                try:
                    t.bind((host, port))
                except OSError:
                    continue
        return port
    raise SwitchStartError(f"no port free for both UDP and TCP on {host}")


def wait_ready(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None,
               log_tail=lambda: "") -> dict:
    """Ask the control plane at tcp ``host:port`` for its stats until it answers (at most ``timeout``
    seconds); return them. With ``proc``, fail as soon as that process exits."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        if proc is not None:
            try:
                proc.wait(timeout=0.05)            # returns early only if the switch died
            except subprocess.TimeoutExpired:
                pass
            if proc.returncode is not None:
                raise SwitchStartError(f"ina-switch for port {port} exited with code {proc.returncode} before its "
                                       f"control plane answered{log_tail()}")
        try:
            return request(host, port, {"op": "stats"}, timeout=2.0)["stats"]
        except (ControlError, ValueError) as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise SwitchStartError(f"no ina-switch control plane answered at tcp {host}:{port} within {timeout:g} s "
                                   f"({last}){log_tail()}")
        if proc is None:
            time.sleep(0.05)                       # a bounded poll interval (nothing to wait on)


class SwitchService:
    """A running ``ina-switch serve`` process (see :func:`start_switch`)."""

    def __init__(self, proc: subprocess.Popen, port: int, control_host: str, log_path: Path, own_log: bool):
        self.proc = proc
        self.port = port
        self.control_host = control_host
        self.log_path = log_path
        self._own_log = own_log             # a temporary log this object removes after a clean stop
        self.killed = False                 # stop() had to SIGKILL it

    @property
    def addr(self) -> str:
        """host:port of its control plane (what INA_SWITCH and --switch take)."""
        return f"{self.control_host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, chars: int = 3000) -> str:
        text = self.log()
        return f"; its log ({self.log_path}) ends:\n{text[-chars:]}" if text else ""

    def stats(self, timeout: float = 10.0) -> dict:
        return request(self.control_host, self.port, {"op": "stats"}, timeout=timeout)["stats"]

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds; its exit code
        (0 after a clean shutdown, -9 if it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.killed = True
                self.kill()
        if self._own_log and self.proc.returncode == 0:
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> "SwitchService":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _ensure_token(host: str | None, options) -> None:
    """A switch bound beyond loopback needs a shared token (docs/switch.md, "Control plane"): without
    one in the options or in INA_TOKEN, make one and put it into this process's environment, which
    the switch and the workers this process starts inherit (emulated topologies, the sweep)."""
    from .cli import is_loopback
    if host is None or is_loopback(host) or os.environ.get("INA_TOKEN") or "--token" in options \
            or "--token-file" in options:
        return
    os.environ["INA_TOKEN"] = secrets.token_hex(16)
    log.info("switch on %s: made a shared token, exported as INA_TOKEN to this process's children", host)


def start_switch(port: int | None, *options: str, host: str | None = None, control_host: str | None = None,
                 log_path: str | os.PathLike | None = None, popen=subprocess.Popen, timeout: float = 60.0,
                 **popen_kw) -> SwitchService:
    """``python -m switch_model serve --port PORT [--host HOST] OPTIONS...``, ready to use.

    ``port`` None picks a free port (and another one if it is taken before the switch binds it).
    ``control_host`` is where readiness and stats are asked (default ``host``, or 127.0.0.1).
    The output goes to ``log_path`` (default a temporary file, removed after a clean stop).
    ``popen(argv, **kw)`` starts the process (e.g. ``functools.partial(topo.popen, host)`` inside an
    emulated host). Raises :class:`SwitchStartError` naming what went wrong within ``timeout`` s.
    """
    ask = control_host or (host if host not in (None, "0.0.0.0") else "127.0.0.1")
    _ensure_token(host, options)
    tries = PORT_TRIES if port is None else 1
    for attempt in range(1, tries + 1):
        p = free_port() if port is None else port
        own = log_path is None
        if own:
            fd, name = tempfile.mkstemp(prefix=f"ina-switch-{p}-", suffix=".log")
            os.close(fd)
        path = Path(name) if own else Path(log_path)
        argv = [sys.executable, "-m", "switch_model", "serve", "--port", str(p), *(["--host", host] if host else []),
                *options]
        with open(path, "wb") as logf:
            proc = popen(argv, stdout=logf, stderr=subprocess.STDOUT, **{"cwd": str(PACKAGE_ROOT), **popen_kw})
        sw = SwitchService(proc, p, ask, path, own)
        try:
            wait_ready(ask, p, timeout, proc, sw.log_tail)
            return sw
        except SwitchStartError:
            sw.kill()
            if attempt < tries and "Address already in use" in sw.log():
                continue
            raise
