"""ina-switch: run the software switch as a service, read its counters, change impairments."""
from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from ina.host_wire import MAX_BODY
from ina.wire import DEFAULT_PORT

from .control import DISCONNECT_GRACE, IDLE_S, MAX_CONNECTIONS, MAX_JOIN_WAIT, MAX_LINE


def _impair_args(p, prefix: str, help_dir: str) -> None:
    p.add_argument(f"--{prefix}loss", type=float, help=f"{help_dir}: packet loss probability")
    p.add_argument(f"--{prefix}duplicate", type=float, help=f"{help_dir}: duplication probability")
    p.add_argument(f"--{prefix}reorder", type=float, help=f"{help_dir}: reordering probability")
    p.add_argument(f"--{prefix}delay-ms", type=float, help=f"{help_dir}: fixed one-way delay (ms)")


_SERVE_DEFAULTS = {"slots": 512, "elements": 1024, "register_bits": 64}


def _apply_profile(args):
    """The switch profile of ``serve``; fills in --slots/--elements/--register-bits from it (or the
    defaults) and refuses explicit values beyond it (ProfileError, a ValueError)."""
    from ina.profiles import get_profile
    prof = get_profile(args.profile)
    for k, v in {**_SERVE_DEFAULTS, **prof.defaults()}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    prof.check_settings(args.slots, args.elements, args.register_bits)
    if not prof.host_aggregator and args.host_agg_port is None:
        args.host_agg_port = -1
    return prof


def _check_limits(args) -> None:
    """The control plane's and the host aggregator's limits must be positive (ValueError naming the flag)."""
    for flag in ("max_line", "max_connections", "idle_timeout", "max_join_wait", "host_agg_max_body"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")


def _collect(args, prefix: str) -> dict:
    out = {}
    for k in ("loss", "duplicate", "reorder", "delay_ms"):
        v = getattr(args, f"{prefix}{k}", None)
        if v is not None:
            out[k] = v
    return out


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except where the default is None (set by the profile: the help
    text says which value applies)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ina-switch", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the switch service (UDP data plane + TCP control plane on --port)",
                       formatter_class=_DefaultsHelp)
    s.add_argument("--host", default="127.0.0.1",
                   help="address of the data plane, the control plane and the host aggregator; beyond loopback "
                        "(e.g. 0.0.0.0) a shared token is required")
    s.add_argument("--token", default=None,
                   help="shared token that join and impair requests must carry (if not given: $INA_TOKEN)")
    s.add_argument("--token-file", default=None, help="read the shared token from this file (first line)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="UDP port of the data plane = TCP port of the "
                   "control plane")
    s.add_argument("--profile", default=None,
                   help="switch hardware profile: what a real device imposes (software [default], tofino, "
                        "tofino-recirc); it sets --slots/--elements/--register-bits and refuses what it cannot do")
    s.add_argument("--slots", type=int, default=None,
                   help=f"aggregator slots in the pool (each with a shadow copy; default {_SERVE_DEFAULTS['slots']} "
                        f"or the profile's)")
    s.add_argument("--elements", type=int, default=None,
                   help=f"registers per slot (max elements per packet; default {_SERVE_DEFAULTS['elements']} or the "
                        f"profile's)")
    s.add_argument("--register-bits", type=int, default=None, choices=(32, 64),
                   help=f"register width (default {_SERVE_DEFAULTS['register_bits']} or the profile's)")
    s.add_argument("--sram-mb", type=float, default=64.0, help="register memory budget in MiB")
    s.add_argument("--burst", type=int, default=64, help="packets per receive burst")
    s.add_argument("--cores", default="auto",
                   help="shard the slot pool over N processes on UDP ports PORT..PORT+N-1 (pool index p -> shard "
                        "p %% N); 'auto' (default): 1 below 8 available CPUs, else one per 4 CPUs, at most 4 (docs/performance.md)")
    s.add_argument("--seed", type=int, default=0, help="seed of the switch's stochastic re-encoding and impairments")
    _impair_args(s, "", "both directions")
    _impair_args(s, "ingress-", "worker->switch")
    _impair_args(s, "egress-", "switch->worker")
    s.add_argument("--host-agg-port", type=int, default=None,
                   help="TCP port of the host aggregator for variable-length codecs (3lc, eaq, wgt; NOT "
                        "switch-feasible): default PORT+100 (a free port if that is taken), 0: a free port, -1: off")
    s.add_argument("--disconnect-grace", type=float, default=DISCONNECT_GRACE,
                   help="seconds a job keeps answering replays after a rank disconnects without leaving, before "
                        "the other ranks are aborted")
    s.add_argument("--max-line", type=int, default=MAX_LINE,
                   help="longest control-plane request line (bytes); a longer one is refused and its connection closed")
    s.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help="control-plane connections open at once (each worker of each job holds one); more are refused")
    s.add_argument("--idle-timeout", type=float, default=IDLE_S,
                   help="seconds a control connection that has not joined a job may wait between requests")
    s.add_argument("--max-join-wait", type=float, default=MAX_JOIN_WAIT,
                   help="longest rendezvous (seconds) a join may ask to wait for the other ranks")
    s.add_argument("--host-agg-max-body", type=int, default=MAX_BODY,
                   help="largest frame body (bytes) the host aggregator accepts; a larger declared body_len is "
                        "refused from the frame header, before anything is allocated")
    s.add_argument("--no-multicast", action="store_true",
                   help="send each worker its own copy of every result (default: one IP multicast to the job's group "
                        "where every worker joined it; docs/switch.md)")
    s.add_argument("--stats-interval", type=float, default=10.0, help="seconds between rate log lines (0: off)")
    s.add_argument("--log-level", default="INFO", help="logging level")
    st = sub.add_parser("stats", help="print the counters of a running switch (JSON)")
    im = sub.add_parser("impair", help="change a running switch's impairments")
    w = sub.add_parser("wait", help="wait until a switch's control plane answers (for scripts that start one)")
    w.add_argument("--timeout", type=float, default=30.0, help="seconds to wait at most (exit status 1 after)")
    for p in (st, im, w):
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=DEFAULT_PORT)
        p.add_argument("--token", default=None, help="the switch's shared token (if not given: $INA_TOKEN)")
    _impair_args(im, "", "both directions")
    _impair_args(im, "ingress-", "worker->switch")
    _impair_args(im, "egress-", "switch->worker")
    return ap


def _ask(args) -> int:
    """stats, impair and wait: requests to a running switch's control plane."""
    from ina.control import ControlError, request
    from .launch import SwitchStartError, wait_ready
    try:
        if args.cmd == "stats":
            reply = request(args.host, args.port, {"op": "stats"}, token=args.token)["stats"]
        elif args.cmd == "wait":
            wait_ready(args.host, args.port, args.timeout)
            print(f"ina-switch at tcp {args.host}:{args.port} is ready", file=sys.stderr)
            return 0
        else:
            both = _collect(args, "")
            reply = request(args.host, args.port, {"op": "impair", "ingress": {**both, **_collect(args, "ingress_")},
                                                   "egress": {**both, **_collect(args, "egress_")}},
                            token=args.token)["impairments"]
    except (ControlError, SwitchStartError) as e:
        print(f"ina-switch {args.cmd}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(reply, indent=2))
    return 0


def _host_aggregator(args, token: str | None):
    """The host aggregator's process (started first: it imports while the switch builds its registers)."""
    if args.host_agg_port is not None and args.host_agg_port < 0:
        return None
    from ina.host_wire import HOST_AGG_PORT_OFFSET
    from .host_agg import HostAggregatorProcess
    hport = args.host_agg_port
    if hport is None:
        hport = args.port + HOST_AGG_PORT_OFFSET if 0 < args.port <= 65535 - HOST_AGG_PORT_OFFSET else 0
    return HostAggregatorProcess(args.host, hport, fallback=args.host_agg_port is None, seed=args.seed,
                                 stats_interval=args.stats_interval, log_level=args.log_level.upper(),
                                 max_body=args.host_agg_max_body, token=token)


def _switch(args):
    """(the switch's config, the data-plane object the control plane drives, the local Switch)."""
    from .impair import ImpairmentConfig
    from .pipeline import Switch, SwitchConfig
    both = _collect(args, "")
    cfg = SwitchConfig(host=args.host, port=args.port, slots=args.slots, elements=args.elements,
                       register_bits=args.register_bits, sram_mb=args.sram_mb, burst=args.burst, seed=args.seed,
                       ingress=ImpairmentConfig(**{**both, **_collect(args, "ingress_"), "seed": args.seed}),
                       egress=ImpairmentConfig(**{**both, **_collect(args, "egress_"), "seed": args.seed + 1}),
                       stats_interval=args.stats_interval, multicast=not args.no_multicast)
    if args.cores > 1:
        from .shards import ShardGroup
        if args.port == 0:
            raise ValueError("--cores N needs an explicit --port (shards use PORT..PORT+N-1)")
        group = ShardGroup(cfg, args.cores, args.log_level.upper())
        return cfg, group, group.local
    sw = Switch(cfg)
    return cfg, sw, sw


def impairments_label(cfg, shards: int = 1) -> str:
    """What the switch does to packets beyond aggregating them, as its startup line says it: each
    direction's probabilities, delay, how long a reordered packet is held, and the seeds (shard k draws
    from seed + SHARD_SEED_STEP x k: switch_model.shards.shard_config)."""
    from .shards import SHARD_SEED_STEP
    parts = []
    for where, c in (("ingress", cfg.ingress), ("egress", cfg.egress)):
        if c.active:
            what = [f"{k} {getattr(c, k):g}" for k in ("loss", "duplicate", "reorder") if getattr(c, k)]
            if c.reorder:
                what[-1] += f" (held {c.reorder_ms:g} ms)"
            if c.delay_ms:
                what.append(f"delay {c.delay_ms:g} ms")
            seed = f"seed {c.seed}" if shards <= 1 else \
                f"seeds {c.seed} + {SHARD_SEED_STEP} x shard, shards 0..{shards - 1}"
            parts.append(f"{where} {', '.join(what)} ({seed})")
    return "impairments: " + "; ".join(parts) if parts else "no impairments"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is a loopback address: nothing beyond this machine reaches it."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _token(args) -> str | None:
    """The shared token: --token, --token-file, or $INA_TOKEN. Required beyond loopback."""
    token = args.token or os.environ.get("INA_TOKEN") or None
    if args.token_file:
        token = Path(args.token_file).read_text().splitlines()[0].strip() if Path(args.token_file).exists() else ""
        if not token:
            raise ValueError(f"--token-file {args.token_file}: missing or empty")
    if token is None and not is_loopback(args.host):
        raise ValueError(f"--host {args.host} listens beyond loopback: give a shared token (--token, --token-file "
                         "or INA_TOKEN) that workers and admin commands must present")
    return token


def _cores(args) -> None:
    """--cores N or auto -> args.cores, a shard count (the rule of auto: shards.auto_shards)."""
    from .shards import available_cpus, parse_cores
    auto = str(args.cores).strip().lower() == "auto"
    args.cores = parse_cores(args.cores)
    if auto and args.cores > 1 and args.port == 0:
        args.cores = 1            # shards need consecutive known ports; a free port is one
    if auto:
        logging.getLogger("ina.switch").info("--cores auto: %d shard(s) on %d available CPUs%s", args.cores,
                                             available_cpus(), " (--port 0: one)" if args.port == 0 else "")


def _serve(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    from .control import ControlPlane
    try:
        prof = _apply_profile(args)
        _cores(args)
        _check_limits(args)
        token = _token(args)
    except ValueError as e:
        print(f"ina-switch serve: {e}", file=sys.stderr)
        return 2
    hagg = _host_aggregator(args, token)
    try:
        cfg, group, sw = _switch(args)

        def on_signal(signum, frame):
            logging.getLogger("ina.switch").info("signal %d: shutting down", signum)
            sw.stop()

        # before the control plane answers (a launcher stopping the switch as soon as it is ready must
        # not meet the default action); a stop before serve_forever makes it return at once
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if hagg is not None:
            hagg.wait_ready()
    except (ValueError, OSError, RuntimeError) as e:
        print(f"ina-switch serve: {e}", file=sys.stderr)
        if hagg is not None:
            hagg.close()
        return 2
    print(f"ina-switch: register memory {cfg.register_memory() / 2**20:.2f} MiB of {cfg.sram_mb:g} MiB "
          f"({cfg.slots} slots x 2 sets x {cfg.elements} x {cfg.register_bits}-bit)"
          + (f" in each of {args.cores} shards on udp ports {sw.port}..{sw.port + args.cores - 1}" if args.cores > 1
             else "") + f"; listening on udp+tcp {cfg.host}:{sw.port}"
          + (f"; host aggregator (NOT switch-feasible) on tcp {cfg.host}:{hagg.port}" if hagg is not None else "")
          + f"; profile {prof.describe()}; {impairments_label(cfg, args.cores)}", file=sys.stderr, flush=True)
    cp = ControlPlane(group, args.host, host_agg=hagg, token=token, grace=args.disconnect_grace, profile=prof,
                      max_line=args.max_line, max_connections=args.max_connections, idle_s=args.idle_timeout,
                      max_join_wait=args.max_join_wait)
    logging.getLogger("ina.switch").info("control plane on tcp %s:%d; shared token %s", args.host, sw.port,
                                         "required for join and impair" if token else "off (loopback only)")
    cp.start()
    try:
        sw.serve_forever()
    finally:
        cp.stop()
        if hagg is not None:
            hagg.close()
        if group is not sw:
            group.close()
        sw.sock.close()
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd != "serve":
        return _ask(args)
    rc = _serve(args)
    if argv is None:                # the process's own command line: a service process
        end_process(rc)
    return rc


def end_process(rc: int) -> None:
    """End a service process whose service is down (sockets closed, its processes joined, the last lines
    logged) at once, with exit code ``rc``, instead of tearing the interpreter down (its compiled kernels and
    modules): that took 5-8 s of a loaded machine's time after the last log line, beyond a supervisor's
    stop bound."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
