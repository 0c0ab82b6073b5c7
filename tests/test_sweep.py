"""ina-sweep end to end on a real emulated topology: a tiny sweep (one rate, 2 workers, one small
size, 2 methods) writes raw results, plots and the report; a re-run with the same --out resumes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")


def sweep(out: Path, methods: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.sweep", "--out", str(out), "--rates", "100mbit",
                           "--workers", "2", "--sizes", "60000", "--methods", methods, "--reps", "2",
                           "--acc-steps", "20", "--acc-workers", "2", "--tp-sizes", "60000", "--tp-steps", "2",
                           "--timeout", "30"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_tiny_sweep_outputs_and_resume(tmp_path):
    out = tmp_path / "sweep"
    p = sweep(out, "gloo,ina:nc")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "6 configuration(s) run" in p.stderr           # allreduce, throughput, accuracy x 2 methods
    data = json.loads((out / "results.json").read_text())
    ar = {r["method"]: r for r in data["records"] if r["workload"] == "allreduce"}
    assert set(ar) == {"gloo", "ina:nc"}
    for r in ar.values():
        assert r["workers"] == 2 and r["rate"] == "100mbit" and r["elements"] == 60000
        assert len(r["times"]) == 2 and all(t > 0 for t in r["times"])
        assert r["ideal_time"] > 0
    # bytes come from the links: the ring sends 2(n-1)/n * 4 bytes per element, nc one byte per element
    assert 0.9 * 4 * 60000 < ar["gloo"]["wire_up_bytes_per_worker"] < 1.2 * 4 * 60000
    ratio = ar["ina:nc"]["wire_up_bytes_per_worker"] / ar["gloo"]["wire_up_bytes_per_worker"]
    assert 0.2 < ratio < 0.35, ratio
    assert ar["gloo"]["rel_error"] < 1e-5                      # the ring's sum is the true sum
    # the CPU floor from the measured CPU (experiments/sweep_cpu.py): the ring's 2 workers at 100 Mbit/s use a
    # small share of the cores (not CPU-bound); every row has the floor and the verdict of the rule
    from experiments.sweep_cpu import cpu_floor
    for r in ar.values():
        assert r["cpu_cores"] >= 1 and r["worker_cpu_per_allreduce"] > 0
        assert {k: r[k] for k in cpu_floor(r)} == cpu_floor(r)
    assert ar["gloo"]["cpu_bound"] is False and ar["gloo"]["cpu_floor_share"] < 0.5
    assert ar["ina:nc"]["switch_counters"]["busy_cpu_ns"] > 0
    # results multicast by default (each once, the bridge copies them), and the outputs say so
    assert data["meta"]["results_delivery"].startswith("IP multicast")
    assert ar["ina:nc"]["switch_counters"]["multicast_results"] == ar["ina:nc"]["switch_counters"]["harvested"] > 0
    acc = {r["method"]: r for r in data["records"] if r["workload"] == "accuracy"}
    assert set(acc) == {"gloo", "ina:nc"} and all(r["curve"][-1]["step"] == 20 for r in acc.values())
    tp = {r["method"]: r for r in data["records"] if r["workload"] == "throughput"}
    assert set(tp) == {"gloo", "ina:nc"}
    for r in tp.values():     # measured: 2 timed SGD steps of a 60,000-parameter model on synthetic data
        assert len(r["step_times"]) == 2 and r["samples_per_s"] == pytest.approx(
            2 * r["batch"] * 2 / (sum(r["step_times"])), rel=0.5)
        assert 0.8 * 60000 < r["params"] < 1.2 * 60000
        assert r["tensors"] == 29 and r["buckets"] >= 1     # a ResNet's layout (conv + BatchNorm tensors)
    assert tp["ina:nc"]["wire_up_bytes_per_worker"] < 0.4 * tp["gloo"]["wire_up_bytes_per_worker"]
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("workload,method,aggregation,workers") and len(csv_lines) == 1 + len(data["records"])
    png = out / "speedup_vs_bandwidth.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "accuracy.png").exists()
    # the run ends with its headline table on the terminal: speedup per rate (time vs ideal) and accuracy
    head = p.stdout[p.stdout.index("ina-sweep headline"):]
    nc_row = next(ln for ln in head.splitlines() if ln.startswith("INA nc "))
    assert f"{ar['ina:nc']['speedup_vs_gloo']:.2f}x ({ar['ina:nc']['bound_ratio']:.2f})" in nc_row
    assert f"{acc['ina:nc']['final_accuracy'] * 100:.2f}%" in nc_row
    assert "How to read it" in head and "time vs ideal" in head and str(out / "report.md") in head
    report = (out / "report.md").read_text()
    assert "Speedup over Gloo ring fp32" in report and "INA nc" in report and "](speedup_vs_bandwidth.png)" in report
    assert "| CPU floor/ideal | CPU-bound (floor/time) |" in report and "**CPU floor** (derived from measured CPU" in report
    assert f"| {ar['gloo']['cpu_floor_ratio']:.2f} | no {ar['gloo']['cpu_floor_share']:.2f} |" in report
    assert "INA results: IP multicast to the job's group" in report
    assert data["meta"]["switch_shards"] >= 1
    assert f"; {data['meta']['switch_shards']} switch process(es) (--switch-cores auto)" in report

    # resume: only the new method runs (a host-aggregated one), the completed configurations are kept
    p2 = sweep(out, "gloo,ina:nc,ina:3lc")
    assert p2.returncode == 0, p2.stderr[-3000:]
    assert "3 configuration(s) run" in p2.stderr          # 3lc allreduce + throughput + accuracy
    data2 = json.loads((out / "results.json").read_text())
    ar2 = {r["method"]: r for r in data2["records"] if r["workload"] == "allreduce"}
    assert set(ar2) == {"gloo", "ina:nc", "ina:3lc"}
    assert ar2["gloo"]["times"] == ar["gloo"]["times"] and ar2["ina:nc"]["times"] == ar["ina:nc"]["times"]
    assert ar2["ina:3lc"]["aggregation"] == "host (NOT switch-feasible)"
    assert "host-aggregated 3lc (NOT switch-feasible)" in (out / "report.md").read_text()
    p3 = sweep(out, "gloo,ina:nc,ina:3lc")
    assert p3.returncode == 0 and "already in" in p3.stderr


def test_bad_method_is_named(tmp_path):
    p = subprocess.run([sys.executable, "-m", "experiments.sweep", "--out", str(tmp_path), "--methods", "gloo,ina:nope"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "ina:nope" in p.stderr


def test_configurations_over_max_ring_time_are_named_not_dropped(tmp_path):
    """A configuration whose link-bound time exceeds --max-ring-time is left out by name (stderr, the
    results' meta, the report), and a sweep with nothing left to run says so and fails instead of
    claiming every configuration was already measured."""
    from experiments.sweep import _plan, _settings, build_parser
    from experiments.sweep_report import _md_intro
    ap = build_parser()
    args = ap.parse_args(["--rates", "10mbit", "--workers", "2", "--sizes", "vgg16,4096", "--methods", "gloo",
                          "--acc-steps", "0", "--tp-sizes", "none"])
    slow: dict = {}
    plan = _plan(args, _settings(ap, args), set(), slow)
    assert plan == [("allreduce", 2, "10mbit", 4096, "gloo")]
    assert list(slow) == ["allreduce gloo n=2 10mbit 138,000,000 elements"] and 440 < slow[next(iter(slow))] < 443
    intro = "\n".join(_md_intro({"too_slow": {"max_ring_time": 120.0, "skipped": slow}}))
    assert "Not run: 1 configuration(s)" in intro and "allreduce gloo n=2 10mbit 138,000,000 elements (442 s)" in intro
    p = subprocess.run([sys.executable, "-m", "experiments.sweep", "--out", str(tmp_path), "--rates", "10mbit",
                        "--workers", "2", "--sizes", "vgg16", "--methods", "gloo", "--acc-steps", "0",
                        "--tp-sizes", "none", "--no-plots"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "138,000,000 elements (442 s)" in p.stderr and "nothing to run" in p.stderr
    assert "already in" not in p.stderr


@pytest.mark.timeout(300)
def test_strong_baselines_and_thc_in_a_tiny_sweep(tmp_path):
    """The non-INA baselines a user could switch on (fp16 ring, PowerSGD) and THC run as sweep methods;
    their bytes on the wire come from the links."""
    out = tmp_path / "sweep"
    p = sweep(out, "gloo,gloo-fp16,powersgd,ina:thc")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "12 configuration(s) run" in p.stderr          # 3 workloads x 4 methods
    data = json.loads((out / "results.json").read_text())
    ar = {r["method"]: r for r in data["records"] if r["workload"] == "allreduce"}
    up = {m: r["wire_up_bytes_per_worker"] / ar["gloo"]["wire_up_bytes_per_worker"] for m, r in ar.items()}
    assert 0.4 < up["gloo-fp16"] < 0.6, up                 # half the ring's bytes
    assert up["powersgd"] < 0.1, up                        # rank-1 factors of a 244 x 246 matrix
    assert 0.2 < up["ina:thc"] < 0.35, up                  # int8 codes, int8 sums back (2 x 8 <= 127)
    assert ar["gloo-fp16"]["rel_error"] < 1e-3 and ar["ina:thc"]["rel_error"] < 0.5
    assert ar["gloo-fp16"]["aggregation"].startswith("Gloo ring fp16") and "PowerSGD" in ar["powersgd"]["aggregation"]
    assert ar["ina:thc"]["aggregation"] == "switch" and ar["gloo-fp16"]["ideal_time"] == pytest.approx(
        ar["gloo"]["ideal_time"] / 2)
    acc = {r["method"]: r for r in data["records"] if r["workload"] == "accuracy"}
    assert set(acc) == {"gloo", "gloo-fp16", "powersgd", "ina:thc"}
    report = (out / "report.md").read_text()
    assert "Gloo ring fp16 (Horovod Compression.fp16" in report and "PyTorch PowerSGD DDP hook" in report


def _workers_of(pid: int) -> list[int]:
    """The sweep workers among ``pid``'s children."""
    try:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return [k for k in kids if _alive(k) and b"experiments.sweep_worker" in _cmdline(k)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    """Running (a zombie, or gone, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _netns_of(pid: int) -> str | None:
    """The name of the network namespace (under /var/run/netns) process ``pid`` is in."""
    ino = os.stat(f"/proc/{pid}/ns/net").st_ino
    return next((n for n in os.listdir("/var/run/netns") if os.stat(f"/var/run/netns/{n}").st_ino == ino), None)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM", "SIGTERM twice"])
def test_ctrl_c_during_a_dilated_sweep_ends_its_workers(tmp_path, signame):
    """SIGINT (or SIGTERM, as from ``timeout`` or a batch scheduler) while the workers of a dilated sweep
    (x10: their timeouts x10) run a long allreduce configuration: the sweep exits by the signal it got
    (exit status 130 or 143), none of its worker processes keeps running, and its emulated links are
    removed. "twice": a second SIGTERM once the workers have ended (GNU ``timeout`` signals the sweep,
    then its process group), while the sweep stops its switch and removes its links: it only latches,
    so the cleanup still completes."""
    import signal

    from sw_harness import wait_until
    out, err = tmp_path / "sweep", tmp_path / "stderr.txt"
    with open(err, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "experiments.sweep", "--out", str(out), "--target-rates", "1gbit",
                              "--dilation", "10", "--workers", "2", "--sizes", "60000", "--methods", "ina:bfp32",
                              "--reps", "100000", "--timeout", "30", "--tcp-cc", "reno", "--no-plots"],
                             cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "allreduce ina:bfp32 n=2" in err.read_text(errors="replace") or p.poll() is not None,
                   240, "the sweep to start its allreduce configuration")
        assert p.poll() is None, err.read_text(errors="replace")[-3000:]
        workers = wait_until(lambda: _workers_of(p.pid), 60, "the sweep's worker processes")
        prefix = _netns_of(workers[0]).split("-")[1]          # inanet-<prefix>-w0
        sig = getattr(signal, signame.split()[0])
        p.send_signal(sig)
        if signame.endswith("twice"):
            wait_until(lambda: not [w for w in workers if _alive(w)] or p.poll() is not None, 60,
                       f"the sweep's workers {workers} to end")
            p.send_signal(sig)
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    log = err.read_text(errors="replace")
    assert rc == -sig and "KeyboardInterrupt" in log, (rc, log[-3000:])     # (130 or 143 in a shell)
    # (a killed process may take a moment to be reaped)
    wait_until(lambda: not [w for w in workers if _alive(w)], 10, f"the sweep's workers {workers} to end")
    assert not [n for n in os.listdir("/var/run/netns") if n.startswith(f"inanet-{prefix}-")], prefix


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_dropped_inside_a_weakref_callback_is_raised_at_the_next_wait():
    """CPython drops an exception raised inside a weakref callback ("Exception ignored in ..."): a Ctrl-C
    that lands there must still stop the sweep, at its next wait for the workers."""
    import signal
    import weakref

    from experiments.sweep_group import CtrlC

    class Obj:
        pass

    prev = signal.getsignal(signal.SIGINT)
    CtrlC.install()
    try:
        o = Obj()
        ref = weakref.ref(o, lambda _: signal.raise_signal(signal.SIGINT))
        del o                                   # the callback runs here; its KeyboardInterrupt is dropped
        assert ref() is None and CtrlC.hit
        with pytest.raises(KeyboardInterrupt, match="re-raised"):
            CtrlC.check()
    finally:
        signal.signal(signal.SIGINT, prev)
        CtrlC.hit = False


def test_results_page_begins_with_the_intro_it_is_regenerated_from():
    """docs/results.md is regenerated as experiments/results_intro.md + a sweep's report (its command is on
    the page): every hand-written section must be in the intro, or a regeneration would drop it."""
    intro = (ROOT / "experiments" / "results_intro.md").read_text()
    page = (ROOT / "docs" / "results.md").read_text()
    assert page.startswith(intro.rstrip()), "docs/results.md and experiments/results_intro.md have drifted apart"
    assert page[len(intro.rstrip()):].lstrip("\n").startswith("Command(s):")
