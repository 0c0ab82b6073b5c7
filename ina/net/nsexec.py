"""Entering a host's network namespace: privileges, setns, and processes started inside a host.

A process started by :func:`popen_in_netns` behaves like one started by ``ip netns exec``:
it joins the namespace with ``setns(CLONE_NEWNET)`` between fork and exec, gets a private mount
namespace and a fresh ``/sys`` so that ``/sys/class/net`` shows the host's own interfaces.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import subprocess

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC = 16384
MS_SLAVE = 1 << 19
MNT_DETACH = 2
NETNS_RUN_DIR = "/var/run/netns"

CAP_SYS_ADMIN = 21
CAP_NET_ADMIN = 12
REQUIRED_CAPS = {"CAP_NET_ADMIN": CAP_NET_ADMIN, "CAP_SYS_ADMIN": CAP_SYS_ADMIN}

_libc = None


class PrivilegeError(PermissionError):
    """The caller lacks a capability that namespaces, links or qdiscs need."""


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def effective_caps() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def missing_caps() -> list[str]:
    caps = effective_caps()
    return [name for name, bit in REQUIRED_CAPS.items() if not caps & (1 << bit)]


def require_privileges(what: str = "build or change emulated links") -> None:
    """Raise :class:`PrivilegeError` naming the missing capabilities."""
    missing = missing_caps()
    if missing:
        raise PrivilegeError(
            f"ina-net needs {' and '.join(missing)} to {what} (network namespaces, veth links and "
            f"tc qdiscs are kernel objects only a privileged process may create); running as uid "
            f"{os.geteuid()} without {', '.join(missing)}. Run as root (e.g. `sudo ina-net ...`) "
            f"or grant the capabilities: CAP_NET_ADMIN for links/qdiscs, CAP_SYS_ADMIN for "
            f"creating and entering namespaces.")


def netns_path(name: str) -> str:
    return os.path.join(NETNS_RUN_DIR, name)


def setns(fd: int, nstype: int = CLONE_NEWNET) -> None:
    if hasattr(os, "setns"):          # Python >= 3.12
        os.setns(fd, nstype)
        return
    if _lib().setns(fd, nstype) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns failed: {os.strerror(e)}")


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def remount_sys() -> None:
    """Private mount namespace with a sysfs of the current network namespace (as ip netns exec)."""
    libc = _lib()
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
    if libc.umount2(b"/sys", MNT_DETACH) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
        e = ctypes.get_errno()
        raise OSError(e, f"umount /sys: {os.strerror(e)}")
    _check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs /sys")


def enter_netns(name: str, sysfs: bool = True) -> None:
    """Move the calling process (single-threaded!) into the named network namespace."""
    fd = os.open(netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(fd, CLONE_NEWNET)
    finally:
        os.close(fd)
    if sysfs:
        remount_sys()


def popen_in_netns(name: str, argv, *, sysfs: bool = True, **kw) -> subprocess.Popen:
    """``subprocess.Popen(argv, **kw)`` with the child inside network namespace ``name``."""
    if kw.get("preexec_fn") is not None:
        raise ValueError("popen_in_netns sets its own preexec_fn; wrap your code in the command")
    try:
        fd = os.open(netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"network namespace {name!r} does not exist "
                                f"(is the topology up?)", netns_path(name)) from None

    def _enter():
        setns(fd, CLONE_NEWNET)
        if sysfs:
            remount_sys()

    try:
        return subprocess.Popen(argv, preexec_fn=_enter, **kw)
    finally:
        os.close(fd)
