"""A real transport fault for the agreement-group tests: the TCP connections a process opened during a call,
shut down as a network failure or a crashed peer would close them (used by _fw_hvd_rounds.py, _fw_ddp_contract.py)."""
import os
import socket


def established() -> dict:
    """fd -> inode of this process's established TCP connections (/proc)."""
    state = {}
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        if os.path.exists(path):
            for line in open(path).read().splitlines()[1:]:
                f = line.split()
                state[f[9]] = f[3]
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and state.get(link[8:-1]) == "01":
            out[int(fd)] = link[8:-1]
    return out


def opened_by(fn) -> tuple[object, list[int]]:
    """(fn(), the fds of the TCP connections established during it)."""
    before = established()
    res = fn()
    return res, sorted(set(established()) - set(before))


def cut(fds) -> None:
    """Shut both directions of each connection down (the peer reads end-of-stream, this side's reads fail)."""
    for fd in fds:
        s = socket.socket(fileno=os.dup(fd))
        s.shutdown(socket.SHUT_RDWR)
        s.close()
