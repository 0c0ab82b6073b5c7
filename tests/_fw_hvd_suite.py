"""Run by tests/test_frameworks.py under one real `horovodrun -np 2`: Horovod 0.28.1's own test_torch.py
(argv[1]: its directory) in every rank, each rank writing its pytest outcomes to argv[2]/suite<rank>.json.
Extra arguments go to pytest (e.g. -k).

Upstream's timing tests (TIMING_TESTS) measure one rank's wall time against a sleep of the other rank's,
so a rank the scheduler runs late on a loaded machine fails them whatever the backend. Every rank runs
them a second time after the suite (unconditionally, so the ranks stay in step); their second outcomes
are recorded apart ("rerun"), and the caller decides what a second outcome may excuse."""
import json
import os
import sys

import pytest

suite, out = sys.argv[1], sys.argv[2]
rank = int(os.environ.get("HOROVOD_RANK", "0"))
TIMING_TESTS = ["test_global_barrier_op"]
outcomes: dict[str, str] = {}
messages: dict[str, str] = {}


class Recorder:
    def __init__(self, outcomes: dict, messages: dict):
        self.outcomes, self.messages = outcomes, messages

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::")[-1]
        if report.when == "call" or report.outcome != "passed":
            if report.skipped:
                self.outcomes.setdefault(name, "skipped")
            else:
                self.outcomes[name] = report.outcome
                if report.failed:
                    self.messages[name] = str(report.longrepr)[-1500:]


os.chdir(suite)
sys.path.insert(0, suite)
code = pytest.main(["-q", "-p", "no:cacheprovider", "-x" if os.environ.get("SUITE_EXITFIRST") else "-rN",
                    "test_torch.py", *sys.argv[3:]], plugins=[Recorder(outcomes, messages)])
rerun: dict[str, str] = {}
rerun_messages: dict[str, str] = {}
if not sys.argv[3:]:
    pytest.main(["-q", "-p", "no:cacheprovider", "test_torch.py", "-k", " or ".join(TIMING_TESTS)],
                plugins=[Recorder(rerun, rerun_messages)])
with open(os.path.join(out, f"suite{rank}.json"), "w") as f:
    json.dump({"exit": int(code), "outcomes": outcomes, "messages": messages, "timing_tests": TIMING_TESTS,
               "rerun": rerun, "rerun_messages": rerun_messages}, f, indent=1)
print(f"[suite] rank {rank}: {sum(v == 'passed' for v in outcomes.values())} passed, "
      f"{sum(v == 'failed' for v in outcomes.values())} failed, {sum(v == 'skipped' for v in outcomes.values())} "
      "skipped", flush=True)
sys.exit(0)
