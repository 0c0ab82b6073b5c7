"""Run this rank inside its own emulated host: a launcher shim for horovodrun and torchrun.

    ina-net up --workers 4 --rate 100mbit --prefix hv
    ina-net exec sw --prefix hv -- ina-switch serve --port 9999 &          # the switch in its own host
    INA_SWITCH=10.213.X.1:9999 horovodrun -np 4 -H localhost:4 --gloo \\
        python -m gloo_patch.netns_rank --prefix hv -- python examples/train_horovod.py
    INA_SWITCH=10.213.X.1:9999 torchrun --nproc-per-node 4 --no-python \\
        python -m gloo_patch.netns_rank --prefix hv -- python examples/train_ddp.py --backend ina

The launcher starts every rank in the root namespace; this shim reads the rank (HOROVOD_RANK, or
RANK for torchrun), enters host ``w<rank>`` of topology ``--prefix`` and execs the command there with
``GLOO_SOCKET_IFNAME`` / ``HOROVOD_GLOO_IFACE`` = the host's link (inside a namespace the hostname
resolves to 127.0.0.1, so Gloo must be told the interface). Rendezvous addresses that point at the
root namespace's loopback (HOROVOD_GLOO_RENDEZVOUS_ADDR, MASTER_ADDR, INA_SWITCH) are rewritten to the
root namespace's address on the topology (its ``P-root`` link), which both launchers' rendezvous servers
listen on. So the rank's Gloo traffic and its INA traffic both cross its shaped link.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import socket
import sys

REWRITE = ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "MASTER_ADDR")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def rank_from_env() -> int:
    for k in ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK"):
        v = os.environ.get(k)
        if v is not None and v.isdigit():
            return int(v)
    raise SystemExit("[netns_rank] error: no rank in the environment (HOROVOD_RANK or RANK); "
                     "run me under horovodrun or torchrun")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gloo_patch.netns_rank", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", required=True, help="topology prefix (ina-net up --prefix)")
    ap.add_argument("--host-of-rank", default="w{rank}", help="host name pattern (default w{rank})")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command given (… -- python train.py)")
    from ina.net import Topology  # noqa: PLC0415
    from ina.net.nsexec import enter_netns  # noqa: PLC0415

    rank = rank_from_env()
    topo = Topology.attach(a.prefix)
    name = a.host_of_rank.format(rank=rank)
    if rank >= len([h for h in topo.hosts if h.role == "worker"]):
        raise SystemExit(f"[netns_rank] error: rank {rank} has no host in topology {a.prefix} "
                         f"({topo.workers_count} workers): bring it up with --workers >= the number of ranks")
    h = topo.host(name)
    root_ip = topo.root_ip
    topo.close_handles()
    env = dict(os.environ)
    for k in REWRITE:
        if env.get(k) and _is_loopback(env[k]):
            env[k] = root_ip
    sw = env.get("INA_SWITCH")
    if sw and ":" in sw and _is_loopback(sw.rsplit(":", 1)[0]):
        env["INA_SWITCH"] = f"{root_ip}:{sw.rsplit(':', 1)[1]}"
    env.update(h.env())
    exe = shutil.which(cmd[0], path=env.get("PATH"))
    if exe is None:
        raise SystemExit(f"[netns_rank] error: command not found: {cmd[0]}")
    print(f"[netns_rank] rank {rank} -> host {h.name} ({h.ip} on {h.ifname}, netns {h.netns})",
          file=sys.stderr, flush=True)
    enter_netns(h.netns)
    os.execve(exe, cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
