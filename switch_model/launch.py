"""Start an ina-switch service as a subprocess and wait (bounded) until its control plane answers."""
from __future__ import annotations

import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_switch(port: int, *options: str, timeout: float = 60.0, **popen_kw) -> subprocess.Popen:
    """``python -m switch_model serve --port PORT OPTIONS...``; returns once it accepts control
    connections, or raises RuntimeError naming what went wrong within ``timeout`` seconds."""
    proc = subprocess.Popen([sys.executable, "-m", "switch_model", "serve", "--port", str(port), *options], **popen_kw)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"ina-switch on port {port} exited with code {proc.returncode} before serving")
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"ina-switch on port {port} did not accept control connections within {timeout:g} s")
            time.sleep(0.05)
