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
import shutil
import subprocess
import sys

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


# Runs as `python -S -c _ENTER NSPATH SYSFS ARGV...`: joins the namespace, then execs ARGV (same pid).
# A wrapper rather than a preexec_fn, because preexec_fn may deadlock in a multi-threaded parent
# (torch, launchers with helper threads).
_ENTER = r"""
import ctypes, ctypes.util, os, sys
path, sysfs, argv = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
def check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        sys.stderr.write("ina-net: entering %s: %s: %s\n" % (path, what, os.strerror(e)))
        sys.exit(126)
fd = os.open(path, os.O_RDONLY)
check(libc.setns(fd, 0x40000000), "setns(CLONE_NEWNET)")
os.close(fd)
if sysfs:
    check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, (1 << 14) | (1 << 19), None), "mount --make-rslave /")
    libc.umount2(b"/sys", 2)
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs /sys")
try:
    os.execvp(argv[0], argv)
except OSError as e:
    sys.stderr.write("ina-net: cannot run %s: %s\n" % (argv[0], e.strerror))
    sys.exit(127)
"""


def popen_in_netns(name: str, argv, *, sysfs: bool = True, **kw) -> subprocess.Popen:
    """``subprocess.Popen(argv, **kw)`` with the child inside network namespace ``name``.

    Safe in multi-threaded parents (no preexec_fn): a small wrapper joins the namespace and execs
    ``argv``, so ``Popen.pid`` is the pid of ``argv`` itself.
    """
    argv = [os.fspath(a) for a in ([argv] if isinstance(argv, (str, bytes, os.PathLike)) else argv)]
    if not argv:
        raise ValueError("empty command")
    if kw.get("shell"):
        raise ValueError("shell=True is not supported: pass ['sh', '-c', CMD] instead")
    if kw.get("executable") is not None:
        raise ValueError("executable= is not supported: put the program in argv[0]")
    path = netns_path(name)
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, f"network namespace {name!r} does not exist "
                                f"(is the topology up?)", path)
    env = kw.get("env")
    search = env.get("PATH") if env is not None and "PATH" in env else None
    cwd = kw.get("cwd")
    prog = argv[0]
    if os.sep not in prog:
        if shutil.which(prog, path=search) is None:
            raise FileNotFoundError(errno.ENOENT, f"command not found: {prog}", prog)
    elif not os.access(os.path.join(os.fspath(cwd), prog) if cwd else prog, os.X_OK):
        raise FileNotFoundError(errno.ENOENT, f"not an executable: {prog}", prog)
    return subprocess.Popen([sys.executable, "-S", "-c", _ENTER, path, "1" if sysfs else "0", *argv], **kw)
