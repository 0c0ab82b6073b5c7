"""The sweep's long-lived worker processes (``experiments.sweep_worker``), one group per worker count,
and its Ctrl-C latch."""
from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

log = logging.getLogger("ina.sweep")

SWITCH_PORT = 9999


class CtrlC:
    """Ctrl-C as a latch as well as an exception. CPython prints and drops an exception raised inside a
    weakref callback or ``__del__`` ("Exception ignored in ..."), so a KeyboardInterrupt landing there
    is lost and the sweep would run on to its last repetition. The handler raises as Python's own does
    and also latches; every wait for the workers re-raises a latched interrupt within its 1 s poll.
    SIGTERM (``timeout``, a batch scheduler, ``kill``) is taken as Ctrl-C: the sweep then stops its
    workers and switch and removes its emulated links instead of dying with them up. Only the first
    signal raises: a further one (a second Ctrl-C; GNU ``timeout`` signals the sweep and then its process
    group) only latches, so it cannot cut the cleanup short and leave namespaces up (the cleanup's
    waits are bounded: the workers' quit grace, then a kill). Once cleaned up, the sweep ends by the
    signal it took (:meth:`exit_by_signal`: exit status 130 for Ctrl-C, 143 for SIGTERM). A process forked
    from the sweep (pyroute2 forks helpers into namespaces and ends them by SIGTERM) inherits the
    handler: there the signal takes its default action, so a child never runs the sweep's code on."""

    hit = False
    signum = 0                  # the first signal taken (0: none)
    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    pid = 0                     # the process that installed the handler

    @classmethod
    def handler(cls, signum, frame):
        if os.getpid() != cls.pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if cls.hit:             # the cleanup of the first one runs: latched, not raised into it
            return
        cls.hit, cls.signum = True, signum
        raise KeyboardInterrupt(*(() if signum == signal.SIGINT else (f"{signal.Signals(signum).name}: "
                                                                      "stopping as on Ctrl-C",)))

    @classmethod
    def exit_by_signal(cls) -> None:
        """After the cleanup, inside ``except KeyboardInterrupt``: a SIGTERM (or any signal but SIGINT) taken by
        the handler ends the process by that signal, its traceback printed (exit status 128 + its number,
        as if the sweep had not caught it); for SIGINT it returns, and the caller re-raises (Python then
        ends by SIGINT)."""
        if not cls.hit or cls.signum in (0, signal.SIGINT) or os.getpid() != cls.pid:
            return
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(cls.signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [cls.signum])
        os.kill(os.getpid(), cls.signum)
        sys.exit(128 + cls.signum)      # (not reached: the default action ends the process)

    @classmethod
    def install(cls) -> None:
        """Latch Ctrl-C and SIGTERM from now on (once per process; from the main thread only: Python delivers
        signals there). Every worker group installs it, so each command that waits for workers has it."""
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) != cls.handler:
            cls.hit, cls.signum, cls.pid = False, 0, os.getpid()
            for sig in cls.SIGNALS:
                signal.signal(sig, cls.handler)

    @classmethod
    def check(cls) -> None:
        if cls.hit:
            raise KeyboardInterrupt("Ctrl-C (re-raised: the first one was dropped inside a callback)")


class WorkerGroup:
    """n long-lived sweep workers inside the first n worker hosts of ``topo``."""

    def __init__(self, topo, n: int, out: Path, args):
        self.topo, self.n = topo, n
        CtrlC.install()
        self.timeout = args.timeout
        self.sel = selectors.DefaultSelector()
        self.bufs = {}
        self.procs = []
        master_port = 29500 + n
        for r in range(n):
            h = topo.workers[r]
            errf = open(out / f"worker-n{n}-r{r}.log", "w")
            p = topo.popen(h, [sys.executable, "-m", "experiments.sweep_worker", "--rank", str(r), "--world", str(n),
                               "--master", topo.workers[0].ip, "--master-port", str(master_port),
                               "--switch", f"{topo.switch.ip}:{SWITCH_PORT}", "--mtu", str(topo.mtu),
                               "--slots", str(args.slots), "--timeout", str(args.worker_timeout),
                               "--max-elements", str(args.max_elements)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errf, cwd=str(Path(__file__).parent.parent),
                           text=True, bufsize=1)
            errf.close()                     # the worker has its own descriptor
            os.set_blocking(p.stdout.fileno(), False)
            self.sel.register(p.stdout, selectors.EVENT_READ, r)
            self.bufs[r] = ""
            self.procs.append(p)
        self.expect_all("hello", what=f"{n} workers to start and join the Gloo group", timeout=args.timeout + 60)

    def send(self, obj) -> None:
        line = obj if isinstance(obj, str) else json.dumps(obj)
        for p in self.procs:
            p.stdin.write(line + "\n")
            p.stdin.flush()

    def expect_all(self, field: str, what: str, timeout: float) -> list[dict]:
        """One JSON line with ``field`` from every worker, within ``timeout`` seconds."""
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.n:
            CtrlC.check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}: ranks "
                                   f"{sorted(set(range(self.n)) - set(got))} did not answer (see worker-*.log)")
            for k, _ in self.sel.select(timeout=min(left, 1.0)):
                r = k.data
                chunk = k.fileobj.read()
                if chunk == "":
                    self.sel.unregister(k.fileobj)
                    raise RuntimeError(f"worker rank {r} exited (code {self.procs[r].poll()}) while waiting for "
                                       f"{what}; see worker-n{self.n}-r{r}.log")
                self.bufs[r] += chunk
                while "\n" in self.bufs[r]:
                    line, self.bufs[r] = self.bufs[r].split("\n", 1)
                    msg = json.loads(line)
                    if "error" in msg:
                        raise RuntimeError(f"worker rank {r}: {msg['error']} (while waiting for {what})")
                    if field in msg:
                        got[r] = msg
            for r, p in enumerate(self.procs):
                if r not in got and p.poll() is not None and not self.bufs[r]:
                    raise RuntimeError(f"worker rank {r} exited with code {p.returncode} while waiting for "
                                       f"{what}; see worker-n{self.n}-r{r}.log")
        return [got[r] for r in range(self.n)]

    def close(self, grace: float = 15.0) -> None:
        """Ask every worker to quit; kill those still running after ``grace`` seconds (one deadline for all:
        a worker inside an allreduce, e.g. after Ctrl-C, reads no quit until its timeout, x K when dilated).
        The kill runs whatever interrupts the wait (a second Ctrl-C only latches: :class:`CtrlC`)."""
        for p in self.procs:
            try:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + grace
        try:
            for p in self.procs:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("sweep workers still running %g s after quit: killing them", grace)
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
            for p in self.procs:
                p.wait(timeout=5)
