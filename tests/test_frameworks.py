"""Framework integrations with real processes: horovodrun (Horovod 0.28.1 built by `make install`) and
torchrun / multi-process DDP against a real `ina-switch`.

What a user relies on:
* after one step the reduced gradients equal Gloo's within the codec's error; for block floating
  point (bfp32) they are bit-identical to the integer reference arithmetic computed here in numpy;
* 200 steps on scikit-learn's digits reach a full-data loss within a stated tolerance of the Gloo run
  (LOSS_TOL below), on every rank the same model;
* every allreduce entry point is offloaded, and what is not offloadable falls back to Gloo with a
  correct result and one log line per reason;
* a switch killed mid-training makes every rank exit with a clear error within the INA timeout.
"""
from __future__ import annotations

import functools
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from switch_model.launch import SwitchService, free_port, start_switch

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
BIN = Path(sys.executable).parent
EXAMPLES = ROOT / "examples"
TESTS = ROOT / "tests"
INT32_MAX = 2**31 - 1

# final full-data loss after 200 steps: |INA - Gloo| <= LOSS_TOL[codec]; Gloo reaches ~0.44 from 2.30
LOSS_TOL = {"bfp32": 0.01, "nc": 0.1, "3lc": 0.2}
LEARNED = 0.8          # both runs must get below this (initial loss is ~2.30)
RUN_TIMEOUT = 300      # bound on one launcher run
INA_TIMEOUT = 20       # INA_TIMEOUT of the ranks (bounds every switch wait)


# ---- helpers -------------------------------------------------------------------------------------------
def start_test_switch(log_path: Path, *options: str, port: int | None = None, **kw) -> SwitchService:
    """A real `python -m switch_model serve` process (switch_model.launch), on a free port by default."""
    return start_switch(port, "--stats-interval", "0", *options, log_path=log_path, **kw)


@pytest.fixture(scope="module")
def switch(tmp_path_factory):
    sw = start_test_switch(tmp_path_factory.mktemp("switch") / "switch.log")
    yield sw
    sw.stop(timeout=10)


@pytest.fixture(scope="module")
def horovod_ready():
    p = subprocess.run([PY, "-m", "gloo_patch.install_horovod", "--check"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    if p.returncode != 0:
        pytest.fail("Horovod is not installed for this venv: run `make install` "
                    f"(python -m gloo_patch.install_horovod): {p.stdout}{p.stderr}")
    p = subprocess.run([PY, "-m", "gloo_patch.autopatch", "--status"], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    if p.returncode != 0:
        pytest.fail(f"the INA_SWITCH autopatch hook is not installed: run `make install`: {p.stdout}")


def ina_env(switch: SwitchService | None, codec: str | None, **extra) -> dict:
    env = dict(os.environ)
    for k in ("INA_SWITCH", "INA_CODEC", "INA_JOB", "INA_SEED", "INA_TIMEOUT", "INA_BUCKET_BYTES"):
        env.pop(k, None)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    if switch is not None:
        env.update(INA_SWITCH=switch.addr, INA_CODEC=codec, INA_SEED="7", INA_TIMEOUT=str(INA_TIMEOUT))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd: list[str], env: dict, what: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what} did not finish within {timeout} s:\n{(e.stdout or '')[-3000:]}\n{(e.stderr or '')[-3000:]}")
    if p.returncode != 0:
        pytest.fail(f"{what} exited with {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def horovodrun(np_: int, script: list[str], env: dict, what: str) -> subprocess.CompletedProcess:
    return run([str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", PY, *script], env, what)


def torchrun(np_: int, script: list[str], env: dict, what: str) -> subprocess.CompletedProcess:
    # --standalone: the agent binds its rendezvous store to a port of its own choosing (port 0), so no
    # other job on the machine can take the port between choosing it and binding it
    return run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(np_), *script], env, what)


def load_run(out: Path, np_: int) -> tuple[list[dict], list[dict]]:
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(np_)]
    grads = [torch.load(out / f"grads_rank{r}.pt") for r in range(np_)]
    return results, grads


def bfp_reference(arrays: list[np.ndarray], average: bool) -> tuple[np.ndarray, float]:
    """SwitchML block floating point in plain numpy: the shared exponent, int32 codes rounded half to
    even, an int32 sum (what the switch's registers hold), the decode, the division for a mean."""
    n = len(arrays)
    xs = [np.asarray(a, np.float32).ravel() for a in arrays]
    e = max(int(np.frexp(np.float32(np.abs(x).max()))[1]) for x in xs)   # floor(log2 max|x|) + 1
    scale = INT32_MAX / (n * 2.0**e)
    codes = [np.rint(x.astype(np.float64) * scale).astype(np.int64) for x in xs]
    assert all(np.abs(c).max() <= INT32_MAX // n for c in codes)
    total = np.sum(codes, axis=0)
    assert np.abs(total).max() <= INT32_MAX, "int32 register overflow in the reference"
    out = (total.astype(np.int32).astype(np.float64) * (1.0 / scale)).astype(np.float32)
    if average:
        out = out / np.float32(n)
    return out, scale


def check_bfp_step(grads: list[dict], gloo_grads: list[dict], flatten: bool, by_name: bool = False) -> None:
    """INA gradients after one step == the integer reference, bit for bit; and == Gloo's within bfp's error.
    ``flatten``: one buffer at the switch (DDP's bucket; Horovod's fusion buffer, in name order: ``by_name``)."""
    n = len(grads)
    names = sorted(grads[0]["local"]) if by_name else list(grads[0]["local"])
    groups = [names] if flatten else [[k] for k in names]
    for group in groups:
        local = [np.concatenate([g["local"][k].float().numpy().ravel() for k in group]) for g in grads]
        ref, scale = bfp_reference(local, average=True)
        got = np.concatenate([grads[0]["reduced"][k].float().numpy().ravel() for k in group])
        assert np.array_equal(got, ref), (f"{group}: not bit-identical to the integer reference; max diff "
                                          f"{np.abs(got - ref).max():.3g}")
        gloo = np.concatenate([gloo_grads[0]["reduced"][k].float().numpy().ravel() for k in group])
        tol = 0.5 / scale + 4 * np.spacing(np.abs(gloo).astype(np.float32))   # n codes each within half a step, / n
        assert np.all(np.abs(got - gloo) <= tol), f"{group}: further from Gloo than bfp's rounding allows"


def check_nc_step(grads: list[dict], gloo_grads: list[dict]) -> None:
    """Natural compression rounds every value to a neighbouring power of two (each rank, then the sum
    at the switch): |result - mean| <= 3 * mean(|x_i|) element-wise; unbiased, so over a whole tensor
    the relative L2 error stays near its expected ~0.4 (the bound 0.75 is a 5-sigma margin at n >= 2)."""
    for k in grads[0]["local"]:
        local = torch.stack([g["local"][k].float() for g in grads])
        gloo = gloo_grads[0]["reduced"][k].float()
        assert torch.allclose(gloo, local.mean(0), rtol=1e-5, atol=1e-7), f"{k}: Gloo baseline != local mean"
        got = grads[0]["reduced"][k].float()
        bound = 3 * local.abs().mean(0) + 1e-12
        assert torch.all((got - gloo).abs() <= bound), f"{k}: an element is outside natural compression's range"
        rel = float((got - gloo).norm() / gloo.norm())
        assert rel < 0.75, f"{k}: relative error {rel:.3f} vs Gloo too large for natural compression"


def check_training(results: list[dict], gloo_results: list[dict], codec: str) -> None:
    finals = {r["final_loss"] for r in results}
    sums = {r["checksum"] for r in results}
    assert len(finals) == 1 and len(sums) == 1, f"ranks diverged: losses {finals}, checksums {sums}"
    ina, gloo = results[0]["final_loss"], gloo_results[0]["final_loss"]
    assert gloo < LEARNED and ina < LEARNED, f"did not learn: gloo {gloo:.4f}, ina {ina:.4f}"
    assert abs(ina - gloo) <= LOSS_TOL[codec], f"{codec}: loss {ina:.4f} vs Gloo {gloo:.4f} (tol {LOSS_TOL[codec]})"


def check_grads_agree(grads: list[dict]) -> None:
    for k in grads[0]["reduced"]:
        for g in grads[1:]:
            assert torch.equal(g["reduced"][k], grads[0]["reduced"][k]), f"{k}: ranks got different results"


_gloo_runs: dict = {}


def gloo_baseline(kind: str, np_: int, tmp_root: Path) -> tuple[list[dict], list[dict]]:
    key = (kind, np_)
    if key not in _gloo_runs:
        out = tmp_root / f"gloo_{kind}_{np_}"
        if kind == "horovod":
            horovodrun(np_, [str(EXAMPLES / "train_horovod.py"), "--out-dir", str(out)], ina_env(None, None),
                       f"horovodrun -np {np_} (Gloo)")
        else:
            torchrun(np_, [str(EXAMPLES / "train_ddp.py"), "--backend", "gloo", "--out-dir", str(out)],
                     ina_env(None, None), f"torchrun -np {np_} (gloo)")
        _gloo_runs[key] = load_run(out, np_)
    return _gloo_runs[key]


# ---- configuration errors (in process) ----------------------------------------------------------------
def test_bad_settings_are_named(monkeypatch):
    from gloo_patch.common import InaConfig, InaConfigError

    monkeypatch.delenv("INA_SWITCH", raising=False)
    with pytest.raises(InaConfigError, match="INA_SWITCH is not set"):
        InaConfig.from_env()
    monkeypatch.setenv("INA_SWITCH", "localhost")
    with pytest.raises(InaConfigError, match="INA_SWITCH='localhost': expected host:port"):
        InaConfig.from_env()
    monkeypatch.setenv("INA_SWITCH", "127.0.0.1:9999")
    monkeypatch.setenv("INA_CODEC", "nope")
    with pytest.raises(InaConfigError, match="INA_CODEC='nope': unknown codec"):
        InaConfig.from_env()
    monkeypatch.setenv("INA_CODEC", "bfp32")
    monkeypatch.setenv("INA_JOB", "70000")
    with pytest.raises(InaConfigError, match="INA_JOB='70000': must be in 1..65535"):
        InaConfig.from_env()
    monkeypatch.setenv("INA_JOB", "12")
    cfg = InaConfig.from_env()
    assert (cfg.switch, cfg.codec, cfg.job) == (("127.0.0.1", 9999), "bfp32", 12)


def test_source_patches_are_all_or_nothing(tmp_path):
    from gloo_patch import install_horovod as ih

    def tree(broken: str | None):
        for rel, old, _new, _n, _why in ih.PATCHES:
            f = tmp_path / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            if not f.exists() or rel == broken:
                f.write_text("# header\n")
        for rel, old, _new, _n, _why in ih.PATCHES:
            if rel != broken:
                f = tmp_path / rel
                f.write_text(f.read_text() + old + "\n")

    broken = ih.PATCHES[-1][0]
    tree(broken)
    before = {rel: (tmp_path / rel).read_text() for rel, *_ in ih.PATCHES}
    with pytest.raises(SystemExit, match=broken):
        ih.patch_sources(tmp_path)
    assert before == {rel: (tmp_path / rel).read_text() for rel, *_ in ih.PATCHES}, "a file was written"
    (tmp_path / broken).write_text("# header\n" + ih.PATCHES[-1][1] + "\n")
    ih.patch_sources(tmp_path)
    assert (tmp_path / "CMakeLists.txt").read_text().count("set(CMAKE_CXX_STANDARD 17)") == 1
    assert "set(CMAKE_CXX_STANDARD 14)" not in (tmp_path / "horovod/torch/CMakeLists.txt").read_text()
    assert "gloo_iface_ = global_context.gloo_iface_;" in (tmp_path / broken).read_text()


# ---- Horovod ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("np_,codec", [(2, "bfp32"), (4, "nc")])
def test_horovod_training_matches_gloo(np_, codec, switch, horovod_ready, tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    gloo_results, gloo_grads = gloo_baseline("horovod", np_, root)
    out = tmp_path_factory.mktemp(f"hvd_{codec}_{np_}")
    p = horovodrun(np_, [str(EXAMPLES / "train_horovod.py"), "--out-dir", str(out)], ina_env(switch, codec),
                   f"horovodrun -np {np_} with INA ({codec})")
    assert "INA backend on" in p.stdout + p.stderr
    results, grads = load_run(out, np_)
    check_grads_agree(grads)
    if codec == "bfp32":
        check_bfp_step(grads, gloo_grads, flatten=True, by_name=True)   # the 6 gradients fused, in name order
    else:
        check_nc_step(grads, gloo_grads)
    check_training(results, gloo_results, codec)
    st = results[0]["ina"]
    assert st["fallback_calls"] == 0, st["fallback_reasons"]
    assert st["offloaded_tensors"] == 200 * 6   # 6 parameter tensors per step, all through the switch
    assert st["client"]["allreduces"] == 200   # fused: one buffer per step (HOROVOD_FUSION_THRESHOLD)


def test_horovod_buckets_stream_during_backward(switch, horovod_ready, tmp_path_factory):
    """INA_BUCKET_BYTES=1: every gradient is sealed into its own bucket as its hook fires, and the worker
    thread sends it while backward goes on. The ranks seal the same buckets (one agreement round each, no
    disagreement), every gradient goes through the switch on its own, the values are bfp32's exactly."""
    root = tmp_path_factory.getbasetemp()
    gloo_results, gloo_grads = gloo_baseline("horovod", 2, root)
    out = tmp_path_factory.mktemp("hvd_buckets")
    horovodrun(2, [str(EXAMPLES / "train_horovod.py"), "--out-dir", str(out)],
               ina_env(switch, "bfp32", INA_BUCKET_BYTES=1), "horovodrun -np 2 with INA (bfp32, a bucket a tensor)")
    results, grads = load_run(out, 2)
    check_grads_agree(grads)
    check_bfp_step(grads, gloo_grads, flatten=False)   # each gradient its own buffer at the switch
    check_training(results, gloo_results, "bfp32")
    for r in range(2):
        st = results[r]["ina"]
        assert st["fallback_calls"] == 0, st["fallback_reasons"]
        assert st["client"]["allreduces"] == 200 * 6, st   # a buffer per gradient
        assert st["agreement_rounds"] == 200 * 6, st       # a round per bucket: the ranks' buckets matched


def test_horovod_entry_points_dtypes_and_fallbacks(switch, horovod_ready, tmp_path):
    p = horovodrun(2, [str(TESTS / "_fw_hvd_ops.py"), str(tmp_path)], ina_env(switch, "bfp32"),
                   "horovodrun ops script")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(d["installed"] for d in ranks)
    ins = [d["inputs"] for d in ranks]
    for r in range(2):
        o = ranks[r]["outputs"]
        # offloaded: bit-identical to the reference, in the caller's dtype
        for name, avg in [("avg_f32", True), ("sum_f16", False), ("async_a", False), ("async_b", True)]:
            ref, _ = bfp_reference([i[name].float().numpy() for i in ins], avg)
            want = torch.from_numpy(ref).reshape(ins[0][name].shape).to(ins[0][name].dtype)
            assert o[name].dtype == ins[0][name].dtype and o[name].shape == ins[0][name].shape, name
            assert torch.equal(o[name], want), f"rank {r} {name}: not the integer reference"
        # a grouped allreduce is one fused buffer at the switch: one shared exponent for both tensors
        ref, _ = bfp_reference([torch.cat([i["grouped_0"], i["grouped_1"]]).numpy() for i in ins], False)
        assert torch.equal(torch.cat([o["grouped_0"], o["grouped_1"]]), torch.from_numpy(ref)), "grouped"
        assert o["cpu_bf16"] == "ValueError: Tensor type torch.BFloat16Tensor is not supported.", o["cpu_bf16"]
        assert o["non_contiguous"] == "ValueError: Tensor is required to be contiguous.", o["non_contiguous"]
        ref, _ = bfp_reference([(i["scaled"] * 0.5).numpy() for i in ins], False)
        assert torch.equal(o["scaled"], torch.from_numpy(ref) * 4.0), "prescale/postscale"
        # fallbacks: Gloo's exact results
        assert torch.equal(o["f64"], ins[0]["f64"] + ins[1]["f64"])
        assert torch.equal(o["i32"], ins[0]["i32"] + ins[1]["i32"])
        assert torch.equal(o["max"], torch.maximum(ins[0]["max"], ins[1]["max"]))
        assert torch.equal(o["bcast"], torch.full((4,), 1.0))
        assert torch.equal(o["gather"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert torch.equal(ranks[0]["outputs"]["ps0"], ins[0]["ps0"])
    st = ranks[0]["stats"]
    assert st["offloaded_tensors"] == 7 and st["client"]["allreduces"] == 6   # the grouped pair is fused
    reasons = st["fallback_reasons"]
    assert reasons == {"allreduce: dtype float64 (offloaded: float32, float16, bfloat16)": 2,
                       "allreduce: dtype int32 (offloaded: float32, float16, bfloat16)": 1,
                       "allreduce: op Max (the switch only adds)": 1,
                       "allreduce: process set 1 (only the global process set is offloaded)": 1}
    # one log line per reason, from rank 0 only
    err = p.stdout + p.stderr
    assert err.count("falls back to Gloo: dtype float64") == 1
    for why in ("dtype int32", "op Max", "process set 1"):
        assert err.count(f"[0]<stderr>:[ina horovod rank 0] allreduce falls back to Gloo: {why}") == 1, why
    assert "[ina horovod rank 1] allreduce falls back" not in err


CONTRACT_BOUND = 10.0  # seconds a mismatch may take to raise on every rank (Horovod's own takes ~0.02 s): half
                       # of INA_TIMEOUT, so that a rank waiting for the others' data still fails it; room for load


def test_horovod_contract(switch, horovod_ready, tmp_path):
    """Horovod's contract with INA on (bfp32): mismatches raise Horovod's own error on every rank at once,
    int32-vs-float cannot hang, Horovod's argument checks, NaN/Inf reach every rank exactly as with Gloo,
    the backend keeps working after every error and after shutdown/init, hvd.join() gives zeros."""
    horovodrun(2, [str(TESTS / "_fw_hvd_contract.py"), str(tmp_path)], ina_env(switch, "bfp32"),
               "horovodrun contract script")
    res = [json.loads((tmp_path / f"contract{r}.json").read_text()) for r in range(2)]
    ts = [torch.load(tmp_path / f"contract{r}.pt") for r in range(2)]
    # Horovod's messages (which rank's value comes first depends on arrival order at its coordinator)
    mismatch = {"shape": ("Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape ", "[17, 1311]",
                          "[17, 23, 57]"),
                "dims": ("Mismatched ALLREDUCE tensor shapes", "[17, 17, 17]", "[18, 18, 18]"),
                "dtype_int_vs_float": ("Mismatched data types: One rank had type ", "int32", "float32"),
                "op_sum_vs_average": ("Mismatched reduction operation",),
                "prescale": ("Mismatched prescale and/or postscale factors", "(1, 1)", "(2, 1)")}
    for r in range(2):
        c = res[r]["cases"]
        for name, msg in mismatch.items():
            assert not c[name]["ok"], f"rank {r} {name}: no error"
            assert "HorovodInternalError" in c[name]["types"] and "RuntimeError" in c[name]["types"], c[name]
            assert all(part in c[name]["message"] for part in msg), (name, c[name]["message"])
            assert c[name]["seconds"] < CONTRACT_BOUND, (name, c[name]["seconds"])
        assert (c["non_contiguous"]["type"], c["non_contiguous"]["message"]) == (
            "ValueError", "Tensor is required to be contiguous.")
        assert (c["cpu_bfloat16"]["type"], c["cpu_bfloat16"]["message"]) == (
            "ValueError", "Tensor type torch.BFloat16Tensor is not supported.")
        dup = c["duplicate_name"]["result"]
        assert dup["second"].startswith("ValueError: Requested to allreduce, allgather, or broadcast a tensor with "
                                        "the same name"), dup
        assert dup["first"] == [2.0] * 5 and dup["again"] is None
        # after each kind of error, an allreduce goes through the switch again with the right sum
        want = (torch.arange(12, dtype=torch.float32) * 3 - 6).tolist()
        for after in ("after_mismatches", "after_checks", "after_nonfinite", "reinit", "after_join"):
            assert c[after]["ok"], c[after]
            assert c[after]["result"]["through_switch"] == 1 and c[after]["result"]["sum"] == want, (after, c[after])
        # NaN/Inf: Gloo's exact result on every rank (NaN where NaN or -Inf + Inf met, Inf where Inf met)
        gloo = ts[0]["nf.in"] + ts[1]["nf.in"]
        torch.testing.assert_close(ts[r]["nf.x"], gloo, rtol=0, atol=0, equal_nan=True)
        assert torch.isnan(ts[r]["nf.x"][[3, 7]]).all() and torch.isinf(ts[r]["nf.x"][[5, 2500]]).all()
        assert torch.equal(ts[r]["nf.y"], torch.full((100,), 3.0))
        reasons = c["nonfinite"]["result"]["reasons"]
        assert reasons.get("allreduce: NaN/Inf on some rank (Gloo propagates them)", 0) >= 1, reasons
        # calls in different orders (the ranks' buckets differ): what both queue runs, with the right sums; b of
        # another shape gets Horovod's mismatch error; different names (each rank waiting for one the other never
        # queues) an error on every rank at once, naming what each waits for
        for tag in ("order_same", "order_shape", "order_name"):
            assert torch.equal(ts[r][f"{tag}.a"], torch.arange(6, dtype=torch.float32) * 2 + 1), (tag, ts[r])
        assert c["order_same"]["ok"] and c["order_same"]["result"] == [2.0] * 5, c["order_same"]
        for tag, parts in (("order_shape", ("Mismatched ALLREDUCE tensor shapes", "[5]", "[6]")),
                           ("order_name", ("the ranks wait for different allreduces", "rank 0: 'order_name.b'",
                                           "rank 1: 'order_name.c'"))):
            assert not c[tag]["ok"] and "HorovodInternalError" in c[tag]["types"], (tag, c[tag])
            assert all(part in c[tag]["message"] for part in parts), (tag, c[tag]["message"])
            assert c[tag]["seconds"] < CONTRACT_BOUND, (tag, c[tag]["seconds"])
        assert c["after_order"]["ok"] and c["after_order"]["result"]["through_switch"] == 1, c["after_order"]
        assert c["after_order"]["result"]["sum"] == want, c["after_order"]
    # join: rank 1 joined, rank 0's allreduces got zeros from it (Average divides by the world size)
    assert torch.equal(ts[0]["join.a"], ts[0]["join.a_in"] / 2) and torch.equal(ts[0]["join.b"], ts[0]["join.b_in"])
    assert res[0]["cases"]["join"]["result"]["ret"] == res[1]["cases"]["join"]["result"]["ret"]


ROUNDS_TIMEOUT = 8     # INA_TIMEOUT of the rounds test: each of its two give-ups waits this long


def test_horovod_agreement_rounds_recover(switch, horovod_ready, tmp_path):
    """The agreement rounds after a round that cannot complete (tests/_fw_hvd_rounds.py, horovodrun -np 2): a rank
    that never reaches a round, or reaches it after the other gave up, gives a HorovodInternalError naming the
    allreduce and the rank missing, on the waiting rank within INA_TIMEOUT (on the late rank at once), and the
    next allreduces go through the switch with the right sums on both ranks (the rounds paired again);
    shutdown/init starts afresh."""
    horovodrun(2, [str(TESTS / "_fw_hvd_rounds.py"), str(tmp_path)],
               ina_env(switch, "bfp32", INA_TIMEOUT=ROUNDS_TIMEOUT), "horovodrun agreement rounds script")
    res = [json.loads((tmp_path / f"rounds{r}.json").read_text()) for r in range(2)]
    c0, c1 = res[0]["cases"], res[1]["cases"]
    # rank 0 waited for 'lonely' and got an error naming it and rank 1 (rank 1 never queued it: no case there)
    e = c0["never_reached"]
    assert not e["ok"] and "HorovodInternalError" in e["types"], e
    assert all(p in e["message"] for p in ("rank 0 gave up on agreement round", "'lonely'",
                                           "did not complete within 8 s", "rank(s) 1 had not started it")), e
    assert "never_reached" not in c1
    # 'late': rank 0 gave up on it; rank 1 reached it afterwards and got an error at once, naming rank 0's give-up
    assert not c0["late"]["ok"] and "'late'" in c0["late"]["message"], c0["late"]
    assert "rank(s) 1 had not started it" in c0["late"]["message"], c0["late"]
    assert not c1["late"]["ok"] and "HorovodInternalError" in c1["late"]["types"], c1["late"]
    assert "came after the other ranks had given up on these allreduces" in c1["late"]["message"], c1["late"]
    assert c1["late"]["seconds"] < ROUNDS_TIMEOUT, c1["late"]      # it did not wait out another INA_TIMEOUT
    # after each error both ranks' next two allreduces went through the switch with the right sums; each rank
    # counts the rounds given up or skipped (one per error); shutdown/init: none
    want = [(torch.arange(12, dtype=torch.float32) * 3 - 6 + 2 * i).tolist() for i in range(2)]
    for c in (c0, c1):
        for after, given_up in (("after_never_reached", 1), ("after_late", 2), ("reinit", 0)):
            assert c[after]["ok"], (after, c[after])
            got = c[after]["result"]
            assert got["runs"] == [{"through_switch": 1, "sum": w} for w in want], (after, got)
            assert got["given_up"] == given_up, (after, got)


def test_horovod_wrapper_starts_a_switch(horovod_ready, tmp_path):
    port = free_port()
    env = ina_env(None, None)
    p = run([PY, "-m", "gloo_patch.horovodrun", "--start-switch", "--switch-port", str(port), "--codec", "bfp32", "--",
             "-np", "2", "-H", "localhost:2", "--gloo", PY, str(EXAMPLES / "train_horovod.py"), "--steps", "20",
             "--out-dir", str(tmp_path)], env, "python -m gloo_patch.horovodrun --start-switch")
    res = json.loads((tmp_path / "rank0.json").read_text())
    assert res["ina"]["offloaded_tensors"] == 20 * 6 and res["ina"]["fallback_calls"] == 0
    assert f"INA_SWITCH=127.0.0.1:{port}" in p.stderr
    with pytest.raises(OSError):   # the wrapper stopped its switch
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


# ---- Horovod's own test suite ----------------------------------------------------------------------------
def _horovod_suite() -> Path:
    """Horovod's own tests: ``INA_HOROVOD_TESTS`` if set, else ``shared/horovod-tests`` beside the repo or
    beside one of its parent directories (a git worktree of the repo may sit deeper than the repo)."""
    if os.environ.get("INA_HOROVOD_TESTS"):
        return Path(os.environ["INA_HOROVOD_TESTS"])
    found = [d / "shared" / "horovod-tests" for d in ROOT.parents if (d / "shared" / "horovod-tests").is_dir()]
    return found[0] if found else ROOT.parent / "shared" / "horovod-tests"


SUITE = _horovod_suite()
SUITE_TIMEOUT = 900
# Tests whose tolerance is below bfp32's rounding (docs/frameworks.md lists the error measured): with the
# INA backend on and bfp32 they fail only in their value check, everything else passes as with Gloo.
BFP32_BELOW_ROUNDING = {"test_horovod_allreduce_prescale"}
GLOO_SKIPS = 10      # GPU, MPI and timeline tests Horovod skips on 2 CPU ranks with Gloo (the suite's README)


def test_horovod_own_suite_with_bfp32(switch, horovod_ready, tmp_path):
    """Horovod 0.28.1's test_torch.py in ONE horovodrun -np 2 with INA on (bfp32): every test plain Gloo
    passes passes, except BFP32_BELOW_ROUNDING, which fail only in their value comparison. Upstream's timing
    test of the barrier (rank 1's wall time against rank 0's 5 s sleep) runs a second time: it passes if
    either run passed on that rank. About 2.5 min."""
    if not (SUITE / "test_torch.py").exists():
        pytest.fail(f"Horovod's suite not found at {SUITE} (expected shared/horovod-tests beside the repo "
                    f"or one of its parents, or INA_HOROVOD_TESTS)")
    run([PY, "-m", "gloo_patch.rendezvous_fix", "-np", "2", "-H", "localhost:2", "--gloo", PY,
         str(TESTS / "_fw_hvd_suite.py"), str(SUITE), str(tmp_path)], ina_env(switch, "bfp32"),
        "horovodrun -np 2 test_torch.py with INA (bfp32)", timeout=SUITE_TIMEOUT)
    for r in range(2):
        res = json.loads((tmp_path / f"suite{r}.json").read_text())
        out = res["outcomes"]
        # upstream's timing tests (one rank's wall time against the other's sleep) ran twice: a first
        # failure counts as the scheduler's, not the backend's, only if the second run passed
        passed_second = {k for k, v in out.items() if v == "failed"
                         and k in res["timing_tests"] and res["rerun"].get(k) == "passed"}
        failed = {k for k, v in out.items() if v == "failed"} - passed_second
        assert failed <= BFP32_BELOW_ROUNDING, {k: res["messages"][k][-800:] for k in failed - BFP32_BELOW_ROUNDING}
        for k in failed:
            assert "hvd.allreduce produces incorrect results" in res["messages"][k], res["messages"][k][-800:]
        assert sum(v == "skipped" for v in out.values()) == GLOO_SKIPS, out
        passed = sum(v == "passed" for v in out.values()) + len(passed_second)
        assert passed >= 105 - len(BFP32_BELOW_ROUNDING), out


# ---- torch.distributed -------------------------------------------------------------------------------------
@pytest.mark.parametrize("np_,codec,mode", [(2, "bfp32", "ina"), (2, "bfp32", "hook"), (4, "nc", "ina")])
def test_ddp_training_matches_gloo(np_, codec, mode, switch, tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    gloo_results, gloo_grads = gloo_baseline("ddp", np_, root)
    out = tmp_path_factory.mktemp(f"ddp_{mode}_{codec}_{np_}")
    how = ["--backend", "ina"] if mode == "ina" else ["--backend", "gloo", "--ina-hook"]
    torchrun(np_, [str(EXAMPLES / "train_ddp.py"), *how, "--out-dir", str(out)], ina_env(switch, codec),
             f"torchrun -np {np_} {mode} ({codec})")
    results, grads = load_run(out, np_)
    check_grads_agree(grads)
    if codec == "bfp32":
        # one DDP bucket; n is a power of two, so DDP's divide-by-n before (backend) or after (hook) the
        # sum is exact and the reference's sum-then-divide is bit-identical for both
        check_bfp_step(grads, gloo_grads, flatten=True)
    else:
        check_nc_step(grads, gloo_grads)
    check_training(results, gloo_results, codec)
    st = results[0]["ina"]
    assert st["fallback_calls"] == 0, st["fallback_reasons"]
    assert st["offloaded_calls"] >= 200     # one bucket per step (plus nothing else for DDP)


def test_ddp_hook_with_a_variable_length_codec_uses_the_host_aggregator(switch, tmp_path_factory):
    """INA_CODEC=3lc (not switch-summable): the DDP hook's buckets go to the service's host aggregator,
    with error feedback per bucket; the ranks stay identical and the model learns like Gloo's."""
    from ina.control import request
    root = tmp_path_factory.getbasetemp()
    gloo_results, _ = gloo_baseline("ddp", 2, root)
    out = tmp_path_factory.mktemp("ddp_hook_3lc_2")
    host, port = switch.addr.rsplit(":", 1)
    before = request(host, int(port), {"op": "stats"})["stats"]["host_aggregator"]
    torchrun(2, [str(EXAMPLES / "train_ddp.py"), "--backend", "gloo", "--ina-hook", "--out-dir", str(out)],
             ina_env(switch, "3lc"), "torchrun -np 2 hook (3lc)")
    results, grads = load_run(out, 2)
    check_grads_agree(grads)
    check_training(results, gloo_results, "3lc")
    after = request(host, int(port), {"op": "stats"})["stats"]["host_aggregator"]
    assert "NOT switch-feasible" in after["label"]
    assert after["counters"]["rounds"] - before["counters"]["rounds"] >= 200, (before, after)   # a bucket per step


def launch_ranks(n: int, cmd: list[str], env: dict, logs: Path) -> list[subprocess.Popen]:
    """n real processes with an env:// rendezvous (what torchrun/mp.spawn set up), each with its own logs."""
    port = free_port()
    procs = []
    for r in range(n):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=e, cwd=ROOT, stdout=open(logs / f"out{r}.txt", "w"),
                                      stderr=open(logs / f"err{r}.txt", "w")))
    return procs


def assert_gloo_threads_joined(logs: Path, n: int) -> None:
    """Every rank's DDP script ended through tests/ddp_exit.py with no Gloo worker thread left (one
    left could abort the process at exit)."""
    from ddp_exit import LEFT
    for r in range(n):
        out = (logs / f"out{r}.txt").read_text()
        assert f"{LEFT} 0" in out, (r, out[-2000:])


def wait_all(procs: list[subprocess.Popen], timeout: float, what: str) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{what}: a rank was still running after {timeout:g} s (hang)")
    return codes


def test_ddp_collectives_offloaded_and_delegated(switch, tmp_path):
    procs = launch_ranks(2, [PY, str(TESTS / "_fw_ddp_ops.py"), str(tmp_path)], ina_env(switch, "bfp32"), tmp_path)
    codes = wait_all(procs, RUN_TIMEOUT, "ddp ops script")
    assert codes == [0, 0], [(tmp_path / f"err{r}.txt").read_text()[-3000:] for r in range(2)]
    assert_gloo_threads_joined(tmp_path, 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ins = [d["inputs"] for d in ranks]
    for r in range(2):
        d = ranks[r]
        assert d["backend"] == "ina"
        o = d["outputs"]
        for name, avg in [("sum_f32", False), ("avg_f32", True), ("sum_f16", False), ("avg_bf16", True),
                          ("async", False)]:
            ref, _ = bfp_reference([i[name].float().numpy() for i in ins], avg)
            assert torch.equal(o[name], torch.from_numpy(ref).to(ins[0][name].dtype)), f"rank {r} {name}"
        assert torch.equal(o["f64"], ins[0]["f64"] + ins[1]["f64"])
        assert torch.equal(o["avg_f64"], (ins[0]["avg_f64"] + ins[1]["avg_f64"]) / 2)
        assert torch.equal(o["max"], torch.maximum(ins[0]["max"], ins[1]["max"]))
        assert torch.equal(o["i64"], ins[0]["i64"] + ins[1]["i64"])
        assert torch.equal(o["broadcast"], torch.full((3,), 1.0))
        assert torch.equal(o["all_gather"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
        assert torch.equal(o["all_to_all"], torch.tensor([float(r), 10.0 + r]))
        assert torch.equal(o["reduce_scatter"], torch.tensor([3.0 * r]))
    assert torch.equal(ranks[0]["outputs"]["reduce"], torch.full((2,), 3.0))
    st = ranks[0]["stats"]
    assert st["offloaded_tensors"] == 5 and st["client"]["allreduces"] == 5
    assert st["fallback_reasons"] == {
        "allreduce: dtype float64 (offloaded: float32, float16, bfloat16)": 2,
        "allreduce: reduce op MAX (the switch only adds)": 1,
        "allreduce: dtype int64 (offloaded: float32, float16, bfloat16)": 1}
    err0 = (tmp_path / "err0.txt").read_text()
    assert err0.count("falls back to Gloo: dtype float64") == 1
    assert "falls back" not in (tmp_path / "err1.txt").read_text()


def test_ddp_buckets_queued_on_the_lane_keep_their_outcomes_and_a_failed_one_frees_the_group(switch, tmp_path):
    """Buckets queued on the hook's lane at once: the sums are exact, a bucket with NaN on one rank gets Gloo's
    result, one whose shapes differ raises on both ranks, the buckets after them go through the switch, exact; and
    the process group ends with no Gloo thread left (the failed bucket's future kept its traceback, whose frames
    held the hook's closures and through them the group)."""
    procs = launch_ranks(2, [PY, str(TESTS / "_fw_ddp_lane.py"), str(tmp_path)], ina_env(switch, "bfp32"), tmp_path)
    codes = wait_all(procs, RUN_TIMEOUT, "ddp lane script")
    assert codes == [0, 0], [(tmp_path / f"err{r}.txt").read_text()[-3000:] for r in range(2)]
    assert_gloo_threads_joined(tmp_path, 2)
    res = [json.loads((tmp_path / f"lane{r}.json").read_text()) for r in range(2)]
    ts = [torch.load(tmp_path / f"lane{r}.pt") for r in range(2)]
    for r in range(2):
        out = res[r]["outcomes"]
        assert [o["ok"] for o in out] == [True, True, True, False, True, True], out
        assert "ranks disagree on this allreduce" in out[3]["message"], out[3]
        for i in (0, 1, 4, 5):      # through the switch: the average of the ranks' inputs, exactly
            want = (ts[0]["inputs"][i] + ts[1]["inputs"][i]) / 2
            assert torch.equal(ts[r]["bufs"][i], want), (r, i)
        gloo = (ts[0]["inputs"][2] + ts[1]["inputs"][2]) / 2
        torch.testing.assert_close(ts[r]["bufs"][2], gloo, rtol=0, atol=0, equal_nan=True)
        assert torch.isnan(ts[r]["bufs"][2][7])
        hook = res[r]["hook"]
        assert hook["offloaded_calls"] == 4 and hook["fallback_reasons"] == {
            "DDP bucket: NaN/Inf on some rank (Gloo propagates them)": 1}, hook


def test_ddp_contract(switch, tmp_path):
    """Backend 'ina' and the DDP hook: a mismatch (shape, int32 vs float32, SUM vs AVG) raises a RuntimeError
    naming every rank's tensor on every rank at once; NaN/Inf propagate exactly as with Gloo; the group keeps
    going through the switch afterwards."""
    procs = launch_ranks(2, [PY, str(TESTS / "_fw_ddp_contract.py"), str(tmp_path)],
                         ina_env(switch, "bfp32", HOOK_TIMEOUT=ROUNDS_TIMEOUT), tmp_path)
    codes = wait_all(procs, RUN_TIMEOUT, "ddp contract script")
    assert codes == [0, 0], [(tmp_path / f"err{r}.txt").read_text()[-3000:] for r in range(2)]
    assert_gloo_threads_joined(tmp_path, 2)
    res = [json.loads((tmp_path / f"contract{r}.json").read_text())["cases"] for r in range(2)]
    ts = [torch.load(tmp_path / f"contract{r}.pt") for r in range(2)]
    want = (torch.arange(12, dtype=torch.float32) * 3 - 6).tolist()
    for r, c in enumerate(res):
        for name, detail in [("shape", "rank 0: float32 [17, 1311], 22287 elements, SUM; rank 1: float32 [17, 23, 57]"),
                             ("dtype_int_vs_float", "rank 0: int32 [17, 17], 289 elements, SUM; rank 1: float32"),
                             ("op_sum_vs_avg", "rank 0: float32 [8], 8 elements, SUM; rank 1: float32 [8], 8 elements, AVG")]:
            assert not c[name]["ok"] and c[name]["type"] == "RuntimeError", (r, name, c[name])
            assert f"[ina rank {r}] allreduce: ranks disagree on this allreduce: {detail}" in c[name]["message"], c[name]
            assert c[name]["seconds"] < CONTRACT_BOUND
        for after in ("after_mismatches", "after_nonfinite"):
            assert c[after]["ok"] and c[after]["result"] == {"through_switch": 1, "sum": want}, (r, after, c[after])
        torch.testing.assert_close(ts[r]["nf.x"], ts[0]["nf.in"] + ts[1]["nf.in"], rtol=0, atol=0, equal_nan=True)
        assert torch.isnan(ts[r]["nf.x"][[3, 7]]).all() and torch.isinf(ts[r]["nf.x"][5])
        hook = c["hook"]["result"]
        assert hook["offloaded_calls"] == 1 and hook["fallback_reasons"] == {
            "DDP bucket: NaN/Inf on some rank (Gloo propagates them)": 1}, hook
        assert torch.isfinite(ts[r]["hook.finite"]).all() and torch.isinf(ts[r]["hook.inf"]).all()
    assert torch.equal(ts[0]["hook.inf"], ts[1]["hook.inf"]) and torch.equal(ts[0]["hook.finite"], ts[1]["hook.finite"])
    # find_unused_parameters: DDP's used-parameter map and the lane's Gloo fallbacks on groups of their own
    unused = [c["hook_unused"] for c in res]
    assert all(u["ok"] for u in unused), unused
    assert all(u["result"]["fallback_calls"] >= 6 and u["result"]["offloaded_calls"] >= 6 for u in unused), unused
    torch.testing.assert_close(ts[0]["hook_unused"], ts[1]["hook_unused"], rtol=0, atol=0, equal_nan=True)
    steps = ts[0]["hook_unused"]
    assert torch.isfinite(steps[0::2]).all() and (~torch.isfinite(steps[1::2])).any(dim=1).all(), steps
    # the hook's agreement rounds: a round rank 1 never reaches fails on rank 0 naming rank 1; after it, DDP steps
    # go through the switch with the right average (weights: mean of 2 and 4 per element; bias: 2)
    rounds = [c["hook_rounds"] for c in res]
    assert all(x["ok"] for x in rounds), rounds
    lonely = rounds[0]["result"]["never_reached"]
    assert not lonely["ok"] and all(p in lonely["message"] for p in (
        "bucket lonely", "did not complete within 8 s", "rank(s) 1 had not started it")), lonely
    assert "never_reached" not in rounds[1]["result"]
    for x in rounds:
        assert x["result"]["after_never_reached"] == [{"weight": [[3.0] * 4] * 3, "bias": [2.0] * 3,
                                                       "through_switch": 1, "given_up": 1}] * 2, x["result"]


# ---- the switch dies mid-training ---------------------------------------------------------------------------
def _reader(stream, q: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        q.put(line)
    q.put(None)


def _wait_for_line(q: queue.Queue, needle: str, timeout: float, seen: list[str]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = q.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"no {needle!r} within {timeout:g} s:\n{''.join(seen[-40:])}")
        if line is None:
            pytest.fail(f"output ended before {needle!r}:\n{''.join(seen[-60:])}")
        seen.append(line)
        if needle in line:
            return


KILL_TIMEOUT = 5   # INA_TIMEOUT in the failure tests


def test_horovod_switch_killed_mid_training(horovod_ready, tmp_path):
    sw = start_test_switch(tmp_path / "switch.log")
    try:
        env = ina_env(sw, "nc", INA_TIMEOUT=KILL_TIMEOUT)
        p = subprocess.Popen([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", PY,
                              str(EXAMPLES / "train_horovod.py"), "--steps", "1000000", "--progress-every", "10"],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(p.stdout, q), daemon=True).start()
        seen: list[str] = []
        _wait_for_line(q, "[train_horovod] step 30 ", RUN_TIMEOUT, seen)
        sw.kill()
        t_kill = time.monotonic()
        try:
            rc = p.wait(timeout=KILL_TIMEOUT + 60)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail("horovodrun still running 65 s after the switch was killed (hang)")
        elapsed = time.monotonic() - t_kill
        while (line := q.get(timeout=30)) is not None:
            seen.append(line)
        text = "".join(seen)
        assert rc != 0
        for r in range(2):
            assert f"[{r}]<stderr>:[ina horovod rank {r}] allreduce through switch {sw.addr}" in text, text[-4000:]
        assert "no progress for 5 s" in text
        assert elapsed < KILL_TIMEOUT + 60
    finally:
        sw.stop(timeout=10)


def test_ddp_switch_killed_mid_training(tmp_path):
    sw = start_test_switch(tmp_path / "switch.log")
    try:
        env = ina_env(sw, "nc", INA_TIMEOUT=KILL_TIMEOUT)
        cmd = [PY, "-u", str(EXAMPLES / "train_ddp.py"), "--backend", "ina", "--steps", "1000000",
               "--progress-every", "10"]
        port = free_port()
        procs = []
        for r in range(2):
            e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen(cmd, env=e, cwd=ROOT, stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                                          stderr=open(tmp_path / f"err{r}.txt", "w"), text=True))
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(procs[0].stdout, q), daemon=True).start()
        _wait_for_line(q, "[train_ddp] step 30 ", RUN_TIMEOUT, [])
        sw.kill()
        codes = wait_all(procs, KILL_TIMEOUT + 60, "DDP ranks after the switch was killed")
        assert all(c != 0 for c in codes), codes
        for r in range(2):
            err = (tmp_path / f"err{r}.txt").read_text()
            assert f"[ina rank {r}] allreduce through switch {sw.addr} failed" in err, err[-3000:]
            assert "AllreduceError" in err or "no progress" in err, err[-3000:]
    finally:
        sw.stop(timeout=10)


# ---- each rank in its own emulated host ---------------------------------------------------------------------
def test_horovod_ranks_in_emulated_hosts(horovod_ready, tmp_path):
    """horovodrun + gloo_patch.netns_rank: rank r runs in host w<r> of an ina.net topology, the switch in
    host sw; Horovod's Gloo and the INA traffic both cross the ranks' shaped links."""
    from ina.net import Topology, missing_caps

    if missing_caps():
        pytest.skip(f"building network namespaces needs {missing_caps()}")
    with Topology(workers=2, rate="200mbit") as topo:
        sw_host = topo.host("sw")
        port = 9999
        sw = start_test_switch(tmp_path / "switch.log", port=port, popen=functools.partial(topo.popen, "sw"),
                               host="0.0.0.0", control_host=sw_host.ip, timeout=30)
        try:
            before = topo.counters()
            env = ina_env(None, None, INA_SWITCH=f"{sw_host.ip}:{port}", INA_CODEC="bfp32", INA_SEED=7,
                          INA_TIMEOUT=INA_TIMEOUT)
            p = horovodrun(2, ["-m", "gloo_patch.netns_rank", "--prefix", topo.prefix, "--", PY,
                               str(EXAMPLES / "train_horovod.py"), "--steps", "20", "--out-dir", str(tmp_path)],
                           env, "horovodrun with ranks in emulated hosts")
            after = topo.counters()
        finally:
            sw.stop(timeout=10)
    for r in range(2):
        assert f"[netns_rank] rank {r} -> host w{r}" in p.stderr + p.stdout
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["ina"]["offloaded_tensors"] == 20 * 6
        sent = res["ina"]["client"]["bytes_sent"]
        up = after[f"w{r}"].tx_bytes - before[f"w{r}"].tx_bytes
        assert up >= sent, f"w{r}: link carried {up} B, the INA client alone sent {sent} B"
    # Gloo traffic crossed the links too: the parameter broadcast from rank 0 (~36 kB) reached w1
    down1 = after["w1"].rx_bytes - before["w1"].rx_bytes
    res1 = json.loads((tmp_path / "rank1.json").read_text())
    assert down1 >= res1["ina"]["client"]["bytes_received"] + 30_000


def test_torchrun_two_nodes_in_emulated_hosts(tmp_path):
    """Multi-node: two ``torchrun --nnodes 2`` agents (c10d rendezvous), each in its own emulated host
    (network namespace w0, w1), train with backend ``ina`` against the switch in host sw: the way to run
    on several real machines. Both nodes' ranks end with the same model; the INA traffic and the
    rendezvous/Gloo traffic cross the hosts' links."""
    from ina.net import Topology, missing_caps

    if missing_caps():
        pytest.skip(f"building network namespaces needs {missing_caps()}")
    with Topology(workers=2, rate="1gbit") as topo:
        sw_host, w0 = topo.host("sw"), topo.host("w0")
        sw = start_test_switch(tmp_path / "switch.log", port=9999, popen=functools.partial(topo.popen, "sw"),
                               host="0.0.0.0", control_host=sw_host.ip, timeout=30)
        try:
            env = ina_env(None, None, INA_SWITCH=f"{sw_host.ip}:9999", INA_CODEC="bfp32", INA_SEED=7,
                          INA_TIMEOUT=INA_TIMEOUT)
            agents = []
            for node in range(2):
                cmd = [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{w0.ip}:29400", "--rdzv-id", "ina-two-nodes",
                       # inside a namespace the hostname resolves to 127.0.0.1: each agent is told its address
                       # (which its workers use as MASTER_ADDR) and whether it serves the rendezvous store
                       "--local-addr", topo.host(f"w{node}").ip, "--rdzv-conf", f"is_host={str(node == 0).lower()}",
                       "--max-restarts", "0", str(EXAMPLES / "train_ddp.py"), "--backend", "ina", "--steps", "200",
                       "--out-dir", str(tmp_path)]
                e = {**env, **topo.host(f"w{node}").env()}
                agents.append(topo.popen(f"w{node}", cmd, env=e, cwd=ROOT, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True))
            outs = []
            for p in agents:
                try:
                    outs.append(p.communicate(timeout=RUN_TIMEOUT)[0])
                except subprocess.TimeoutExpired:
                    for q in agents:
                        q.kill()
                    pytest.fail(f"torchrun --nnodes 2 did not finish within {RUN_TIMEOUT} s")
            after = topo.counters()
        finally:
            sw.stop(timeout=10)
    assert [p.returncode for p in agents] == [0, 0], "\n".join(o[-3000:] for o in outs)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["checksum"] == results[1]["checksum"], "the two nodes' models differ"
    assert results[0]["final_loss"] < LEARNED, results[0]["final_loss"]
    for res in results:
        assert res["ina"]["offloaded_tensors"] == 200, res["ina"]     # one DDP bucket per step, through the switch
        assert res["ina"]["client"]["bytes_sent"] > 0
    # each node's traffic left through its own link (which rank c10d gave which node is not fixed)
    least = min(res["ina"]["client"]["bytes_sent"] for res in results)
    assert all(after[f"w{n}"].tx_bytes >= least for n in range(2)), (after, least)
