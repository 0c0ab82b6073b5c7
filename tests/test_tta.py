"""The time-to-accuracy workloads (experiments/tta_workloads.py) and bench_tta's summary."""
import torch

from experiments.bench_tta import summarise, time_to
from experiments.tta_workloads import ColourDigits, TopicCorpus, make


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
