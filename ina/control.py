"""Client side of the switch's control plane: JSON lines over TCP on the switch's port number.

Requests are one JSON object per line with an "op" field; every reply is one JSON object with
"ok": true/false (and "error": "..." when false). Operations: join, leave, status, stats, impair.
A switch with a shared token wants it in "join" and "impair": the channel adds ``token`` (default:
the environment variable INA_TOKEN) to every request.
"""
from __future__ import annotations

import json
import os
import socket


class ControlError(RuntimeError):
    """The switch's control plane refused a request or could not be reached."""


class ControlChannel:
    def __init__(self, host: str, port: int, timeout: float = 10.0, token: str | None = None):
        self.addr = (host, port)
        self.token = token or os.environ.get("INA_TOKEN") or None
        try:
            self.sock = socket.create_connection(self.addr, timeout=timeout)
        except OSError as e:
            raise ControlError(f"cannot reach the switch's control plane at tcp {host}:{port}: {e}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rfile = self.sock.makefile("rb")

    def request(self, msg: dict, timeout: float = 10.0) -> dict:
        self.sock.settimeout(timeout)
        try:
            if self.token is not None:
                msg = {**msg, "token": self.token}
            self.sock.sendall(json.dumps(msg).encode() + b"\n")
            line = self._rfile.readline()
        except socket.timeout:
            raise ControlError(f"switch at tcp {self.addr[0]}:{self.addr[1]} did not answer {msg.get('op')!r} "
                               f"within {timeout:g} s") from None
        except OSError as e:
            raise ControlError(f"control connection to {self.addr[0]}:{self.addr[1]} failed during "
                               f"{msg.get('op')!r}: {e}") from None
        if not line:
            raise ControlError(f"switch at tcp {self.addr[0]}:{self.addr[1]} closed the control connection "
                               f"during {msg.get('op')!r}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise ControlError(f"switch refused {msg.get('op')!r}: {reply.get('error', 'no reason given')}")
        return reply

    def close(self) -> None:
        try:
            self._rfile.close()
            self.sock.close()
        except OSError:
            pass


def request(host: str, port: int, msg: dict, timeout: float = 10.0, token: str | None = None) -> dict:
    """One request on a fresh connection (stats, impair, status)."""
    ch = ControlChannel(host, port, timeout, token)
    try:
        return ch.request(msg, timeout)
    finally:
        ch.close()
