"""``ina-net``: bring emulated links up and down, inspect them, run commands inside a host.

::

    ina-net up --workers 4 --rate 100mbit [--rate-down 1gbit] [--switch-rate R] [--prefix ina]
    ina-net status [--prefix P] [--json]
    ina-net exec w0 [--prefix P] -- python train.py
    ina-net set-rate all 1gbit [--direction up|down|both] [--prefix P]
    ina-net down [--prefix P | --all]
    ina-net netem            # does this kernel have netem? (else: delay/loss live in the switch)
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import sys

from pyroute2.netlink.exceptions import NetlinkError

from .nsexec import PrivilegeError, enter_netns, require_privileges
from .shaping import RateError, format_rate
from .kernel import MAX_WORKERS, TopologyError, list_topologies, probe_netem, teardown
from .topology import Topology, host_key

DEFAULT_PREFIX = "ina"
log = logging.getLogger("ina.net")


def _duration(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a duration like '5ms', '200us', '0.01s'")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]


def _loss(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a loss like '1%' or '0.01'")
    v = float(m.group(1)) / (100 if m.group(2) else 1)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: loss must be between 0 and 1 (0%..100%)")
    return v


def _resolve_prefix(prefix: str | None) -> str:
    if prefix:
        return prefix
    found = list_topologies()
    if len(found) == 1:
        return found[0]
    if not found:
        raise TopologyError("no topology is up (bring one up with `ina-net up`)")
    raise TopologyError(f"{len(found)} topologies are up ({', '.join(found)}): choose one with --prefix")


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def _print_status(st: dict) -> None:
    print(f"topology {st['prefix']}: subnet {st['subnet']}, root namespace reaches it via "
          f"{st['root_ifname']} {st['root_ip']}, mtu {st['mtu']}, fabric {st['fabric_netns']}")
    print(f"netem: {'available' if st['netem']['available'] else 'NOT available'}: {st['netem']['detail']}")
    if st.get("delay") or st.get("loss"):
        print(f"delay/loss on every worker link, both directions (netem): delay {(st['delay'] or 0) * 1e3:g} ms, "
              f"loss {(st['loss'] or 0) * 100:g}%")
    else:
        print("delay/loss: none on the links" + ("" if st["netem"]["available"] else
              " (the switch's impairment stage emulates them: `ina-switch stats` shows its settings)"))
    cols = ("host", "ip", "netns", "upload", "download", "up bytes", "down bytes", "up drops", "down drops")
    rows = []
    for h in st["hosts"]:
        c = h["counters"]
        def shaped(d):
            p = h[d]
            return "unlimited" if p is None else format_rate(p["rate_bps"])
        # shaped directions: what the token bucket charged; unshaped: the device counter
        up_b = c["up_bytes"] if h["up"] else c["tx_bytes"]
        down_b = c["down_bytes"] if h["down"] else c["rx_bytes"]
        rows.append((f"{h['name']} ({h['role']})", f"{h['ip']} {h['ifname']}", h["netns"], shaped("up"),
                     shaped("down"), _bytes(up_b), _bytes(down_b), str(c["up_drops"]), str(c["down_drops"])))
    widths = [max(len(r[i]) for r in rows + [cols]) for i in range(len(cols))]
    for r in [cols] + rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    shaped = [(h["name"], d, h[d]) for h in st["hosts"] for d in ("up", "down") if h[d]]
    if shaped:
        print("token buckets: " + "; ".join(sorted({f"{format_rate(p['rate_bps'])} {d}: burst {_bytes(p['burst'])}, "
                                                    f"queue {_bytes(p['limit'])}" for _, d, p in shaped})))


def cmd_up(a) -> int:
    topo = Topology(workers=a.workers, rate=a.rate, rate_down=a.rate_down, prefix=a.prefix,
                    switch_rate=a.switch_rate, mtu=a.mtu, subnet=a.subnet, delay=a.delay, loss=a.loss,
                    keep=True)
    existed = topo.prefix in list_topologies()
    try:
        topo.up()
    except BaseException:
        if not existed and topo.prefix in list_topologies():   # never remove a topology we did not build
            log.error("bring-up of %s failed: removing what was built", topo.prefix)
            teardown(topo.prefix)
        raise
    st = topo.status()
    topo.close_handles()
    if a.json:
        print(json.dumps(st, indent=2))
    else:
        _print_status(st)
        print(f"run a command in a host: ina-net exec w0 --prefix {topo.prefix} -- CMD; "
              f"tear down: ina-net down --prefix {topo.prefix}")
    return 0


def cmd_down(a) -> int:
    if a.all:
        prefixes = list_topologies()
    else:
        prefixes = [_resolve_prefix(a.prefix)] if a.prefix or list_topologies() else []
    if not prefixes:
        print("no topology to tear down")
        return 0
    for p in prefixes:
        r = teardown(p)
        print(f"{p}: removed {len(r['namespaces'])} namespace(s), {len(r['links'])} link(s)"
              + (f", terminated {len(r['killed'])} process(es)" if r["killed"] else ""))
    return 0


def cmd_status(a) -> int:
    require_privileges("inspect emulated links")
    if not a.prefix and not list_topologies():
        print(json.dumps([]) if a.json else "no topology is up")
        return 0
    topo = Topology.attach(_resolve_prefix(a.prefix))
    st = topo.status()
    topo.close_handles()
    print(json.dumps(st, indent=2)) if a.json else _print_status(st)
    return 0


def cmd_set_rate(a) -> int:
    topo = Topology.attach(_resolve_prefix(a.prefix))
    target = a.host if a.host in ("all", "workers") else topo.host(a.host)
    topo.set_rate(target, a.rate, direction=a.direction)
    topo.close_handles()
    return 0


def cmd_exec(a) -> int:
    argv = a.command
    if not argv:
        raise TopologyError("exec: no command given (usage: ina-net exec HOST -- CMD [ARGS...])")
    topo = Topology.attach(_resolve_prefix(a.prefix))
    h = topo.host(host_key(a.host))
    topo.close_handles()
    exe = shutil.which(argv[0])
    if exe is None:
        print(f"ina-net: exec: command not found: {argv[0]}", file=sys.stderr)
        return 127
    enter_netns(h.netns)
    os.environ.update(h.env())
    os.execv(exe, argv)
    return 0  # not reached


def cmd_netem(a) -> int:
    p = probe_netem()
    print(p.detail)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ina-net", description="Emulated links for the INA emulator: one network "
                                "namespace per host, veth links into a bridge, per-direction tc shaping.")
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="build (or converge) a topology and leave it up")
    up.add_argument("--workers", type=int, default=4, help=f"worker hosts, 1..{MAX_WORKERS} (default 4)")
    up.add_argument("--rate", default="100mbit", help="worker link upload rate, e.g. 100mbit, 1gbit, unlimited")
    up.add_argument("--rate-down", default=None, help="worker link download rate (default: same as --rate)")
    up.add_argument("--switch-rate", default=None, help="switch host link rate (default: unlimited)")
    up.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"name of the topology (default {DEFAULT_PREFIX!r})")
    up.add_argument("--mtu", type=int, default=1500)
    up.add_argument("--subnet", default=None, help="private IPv4 /24 (default: 10.213.X.0/24 derived from the prefix)")
    up.add_argument("--delay", type=_duration, default=None, help="one-way delay per worker link (needs netem)")
    up.add_argument("--loss", type=_loss, default=None, help="loss per worker link, e.g. 1%% (needs netem)")
    up.add_argument("--json", action="store_true")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="remove a topology (also leftovers of a crashed builder)")
    g = down.add_mutually_exclusive_group()
    g.add_argument("--prefix", default=None)
    g.add_argument("--all", action="store_true", help="every topology on this machine")
    down.set_defaults(func=cmd_down)

    st = sub.add_parser("status", help="hosts, addresses, rates and byte counters per link")
    st.add_argument("--prefix", default=None)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    sr = sub.add_parser("set-rate", help="change the rate of live links")
    sr.add_argument("host", help="w0, w1, ..., sw, 'workers' or 'all'")
    sr.add_argument("rate", help="e.g. 10mbit, 1gbit, unlimited")
    sr.add_argument("--direction", choices=("up", "down", "both"), default="both")
    sr.add_argument("--prefix", default=None)
    sr.set_defaults(func=cmd_set_rate)

    ex = sub.add_parser("exec", help="run a command inside a host: ina-net exec w0 -- CMD")
    ex.add_argument("host", help="w0, w1, ... or sw")
    ex.add_argument("--prefix", default=None)
    ex.add_argument("command", nargs="*", help="the command; put it after -- if it has options")
    ex.set_defaults(func=cmd_exec)

    nm = sub.add_parser("netem", help="probe whether the kernel can emulate delay/loss (netem)")
    nm.set_defaults(func=cmd_netem)
    return p


def main(argv=None) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)   # `ina-net status | head` ends quietly
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    tail = None
    if "--" in argv:   # `ina-net exec w0 --prefix P -- CMD ...`: everything after -- is the command
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1:]
    a = parser.parse_args(argv)
    if tail is not None:
        if a.cmd != "exec":
            parser.error(f"unexpected arguments after '--': {' '.join(tail)}")
        a.command = a.command + tail
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO,
                        format="[ina-net] %(message)s", stream=sys.stderr)
    try:
        return a.func(a)
    except PrivilegeError as e:
        print(f"ina-net: error: {e}", file=sys.stderr)
        return 1
    except (TopologyError, RateError) as e:
        print(f"ina-net: error: {e}", file=sys.stderr)
        return 1
    except NetlinkError as e:
        print(f"ina-net: error: the kernel refused a request: {os.strerror(e.code)} ({e}); "
              f"`ina-net down` removes a half-built topology", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
