"""A process that builds a topology and then waits to be killed (for the crash-cleanup tests).

Usage: net_builder.py PREFIX WORKERS. Logs its progress on stderr (the test may kill it
mid-build on a given log line); when the topology is up, starts a process inside w0 that never
exits, prints ``READY <pid of that process>`` and blocks on stdin.
"""
import logging
import subprocess
import sys

from ina.net import Topology


def main():
    prefix, workers = sys.argv[1], int(sys.argv[2])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[builder] %(message)s")
    topo = Topology(workers=workers, rate="100mbit", prefix=prefix, keep=True)
    topo.up()
    inner = topo.popen(topo.workers[0], [sys.executable, "-c", "import signal; signal.pause()"],
                       stdin=subprocess.DEVNULL)
    print(f"READY {inner.pid}", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
