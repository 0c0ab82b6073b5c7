"""The time-to-accuracy workloads (experiments/tta_workloads.py), bench_tta's summary and statistics over seeds
(experiments/tta_report.py), and a short bench_tta run through torchrun."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.tta_report import seed_statistics, seed_table, summarise, time_to
from experiments.tta_workloads import ColourDigits, TopicCorpus, make

ROOT = Path(__file__).resolve().parent.parent


def test_workload_data_are_deterministic_per_seed_and_rank():
    for workload in ("resnet", "embedding"):
        _, a, test_a = make(workload, 0, 0)
        _, b, test_b = make(workload, 0, 0)
        _, other_rank, test_c = make(workload, 0, 1)
        xa, ya = a.sample(8)
        xb, yb = b.sample(8)
        assert torch.equal(xa, xb) and torch.equal(ya, yb), workload
        assert not torch.equal(other_rank.sample(8)[0], xa), f"{workload}: ranks draw the same batches"
        assert torch.equal(test_a[0], test_c[0]), f"{workload}: the test set depends on the rank"


def test_digit_images_train_and_test_use_disjoint_scans():
    train, test = ColourDigits("train", 0), ColourDigits("test", 0)
    assert len(train.labels) == 1437 and len(test.labels) == 360
    flat_train = train.base.flatten(1)
    for img in test.base.flatten(1)[:50]:
        assert not torch.any(torch.all(flat_train == img, dim=1)), "a test scan is also a training scan"
    x, y = train.sample(4)
    assert x.shape == (4, 3, 32, 32) and y.shape == (4,)


def test_topic_corpus_labels_follow_the_topics():
    """A document's tokens come from its class's topic far more often than chance (the task is learnable):
    with unrelated labels about 4 % of the tokens would fall in the class's 300 topic words."""
    tokens, y = TopicCorpus(3, label_noise=0.0).sample(2000)
    corpus = TopicCorpus(3)
    topic_hits = (corpus.topics[y].gather(1, tokens) > 0).float().mean()
    assert topic_hits > 0.3, topic_hits     # topic words: 30 % drawn from the topic, plus background hits


def test_time_to_target_and_ratios_against_the_gloo_run():
    curve = lambda accs: [{"step": 50 * (i + 1), "seconds": 10.0 * (i + 1), "accuracy": a} for i, a in enumerate(accs)]
    base = {"workload": "w", "framework": "ddp", "rate": "100mbit", "method": "gloo", "curve": curve([0.5, 0.9, 0.95]),
            "final_accuracy": 0.95, "train_s": 30.0}
    fast = {**base, "method": "nc", "curve": [dict(c, seconds=c["seconds"] / 2) for c in curve([0.6, 0.946, 0.944])],
            "final_accuracy": 0.944, "train_s": 15.0}
    slow = {**base, "method": "bfp32", "curve": curve([0.5, 0.8, 0.9]), "final_accuracy": 0.9, "train_s": 30.0}
    assert time_to(base["curve"], 0.95) == 30.0 and time_to(base["curve"], 0.99) is None
    summarise([base, fast, slow], margin=0.5)
    assert fast["time_to_target_s"] == 10.0                 # first checkpoint >= 94.5 %
    assert abs(fast["accuracy_vs_gloo_points"] + 0.6) < 1e-9 and fast["speedup_vs_gloo"] == 2.0
    assert slow["time_to_target_s"] is None and slow["tta_speedup_vs_gloo"] is None


def fake_run(method, seed, accuracy, framework="ddp", train_s=30.0):
    return {"workload": "w", "framework": framework, "rate": "100mbit", "ranks": 2, "seed": seed, "method": method,
            "final_accuracy": accuracy, "train_s": train_s,
            "curve": [{"step": 50, "seconds": train_s, "accuracy": accuracy}]}


def test_runs_pair_with_the_gloo_run_of_their_own_seed():
    runs = [fake_run("gloo", 0, 0.90), fake_run("gloo", 1, 0.95), fake_run("nc", 0, 0.90), fake_run("nc", 1, 0.95)]
    summarise(runs, margin=0.5)
    assert [r["accuracy_vs_gloo_points"] for r in runs[2:]] == [0.0, 0.0]   # not 0.90 - 0.95 across seeds


def test_seed_statistics_tell_a_real_loss_from_seed_noise():
    """Seeds with a Gloo spread of about a point: a codec whose paired differences scatter around 0 is within
    noise and within 0.5 points; one that is 2 points below on every seed fails the criterion; one seed only
    gives no verdict. (The codec names only label the synthetic numbers.)"""
    rng = np.random.default_rng(5)
    gloo = 0.94 + 0.01 * rng.standard_normal(6)
    runs = [fake_run("gloo", s, float(a)) for s, a in enumerate(gloo)]
    runs += [fake_run("nc", s, float(a + 0.0005 * rng.standard_normal())) for s, a in enumerate(gloo)]
    runs += [fake_run("terngrad", s, float(a - 0.02 + 0.001 * rng.standard_normal())) for s, a in enumerate(gloo)]
    runs += [fake_run("nd", 0, float(gloo[0]))]
    summarise(runs, margin=0.5)
    rows = {r["method"]: r for r in seed_statistics(runs, margin=0.5)}
    nc, bad, once = rows["nc"]["vs_gloo"], rows["terngrad"]["vs_gloo"], rows["nd"]["vs_gloo"]
    assert nc["verdict"] == "met" and nc["within_noise"] and nc["n"] == 6
    assert bad["verdict"] == "not met" and not bad["within_noise"] and bad["ci95"][1] < -1.5
    assert once["verdict"] == "one seed: no statistics"
    assert 0.5 < rows["gloo"]["accuracy_sd"] < 2.0          # the seeds' own spread, in points
    table = seed_table(list(rows.values()))
    assert "| w | ddp | 100mbit | terngrad | 6 |" in table and "not met" in table


def test_frameworks_pool_per_seed_so_pairs_stay_independent():
    """Both frameworks' Gloo runs of a seed are the same; pooled, a seed contributes the mean of its two
    differences, so three seeds give n = 3 (not 6)."""
    runs = []
    for fw in ("horovod", "ddp"):
        for s, a in enumerate((0.93, 0.95, 0.94)):
            runs += [fake_run("gloo", s, a, fw), fake_run("nc", s, a - (0.002 if fw == "ddp" else 0.0), fw)]
    summarise(runs, margin=0.5)
    both = next(r for r in seed_statistics(runs) if r["method"] == "nc" and r["framework"] == "both")
    assert both["vs_gloo"]["n"] == 3 and abs(both["vs_gloo"]["mean"] + 0.1) < 1e-9


@pytest.mark.timeout(600)
def test_short_run_through_torchrun_with_two_seeds(tmp_path):
    """bench_tta end to end on loopback (DDP through torchrun, the embedding model, 6 steps): every method
    trains from every seed, each run is paired with its seed's Gloo run, and the report has the statistics."""
    out = tmp_path / "tta.json"
    p = subprocess.run([sys.executable, "-m", "experiments.bench_tta", "--rates", "loopback", "--workloads", "embedding",
                        "--frameworks", "ddp", "--methods", "gloo,nc", "--seeds", "0,1", "--steps", "embedding=6",
                        "--eval-every", "3", "--json", str(out), "--plot", str(tmp_path / "tta.png"), "--timeout", "300"],
                       cwd=ROOT, capture_output=True, text=True, timeout=560)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    runs = {(r["method"], r["seed"]): r for r in data["runs"]}
    assert set(runs) == {("gloo", 0), ("gloo", 1), ("nc", 0), ("nc", 1)}
    assert runs["gloo", 0]["curve"] != runs["gloo", 1]["curve"]          # the seed changes the training
    for s in (0, 1):
        assert runs["nc", s]["gloo_final_accuracy"] == runs["gloo", s]["final_accuracy"]
        assert [c["step"] for c in runs["nc", s]["curve"]] == [3, 6]
    nc = next(r for r in data["seed_statistics"] if r["method"] == "nc")
    assert nc["seeds"] == [0, 1] and nc["vs_gloo"]["n"] == 2 and nc["vs_gloo"]["ci95"] is not None
    assert "within 0.5 pt of Gloo" in p.stdout and (tmp_path / "tta.png").read_bytes()[:4] == b"\x89PNG"
