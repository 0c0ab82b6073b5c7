"""The switch's user-space impairments, as arrays over a burst (switch_model/impair.py).

Statistical properties with fixed seeds: the drop, duplication and reordering counts of 64 000
packets are within 5 standard deviations of the configured rates, and every delivered packet is an
intact copy of a sent one with its own tag (the bytes and the tag travel together).
"""
from __future__ import annotations

import numpy as np
import pytest

from switch_model.impair import Impairment, ImpairmentConfig

WIDTH = 40
BURST = 64


def _bursts(count: int):
    """``count`` bursts of ``BURST`` distinct packets: row i of the whole stream starts with i."""
    for b in range(count):
        ids = np.arange(b * BURST, (b + 1) * BURST, dtype=np.int64)
        buf = np.zeros((BURST, WIDTH), np.uint8)
        buf[:, :8] = ids.view(np.uint8).reshape(BURST, 8)
        yield buf, np.arange(BURST), np.full(BURST, 30 + b % 7, np.int64), ids * 3 + 1


def _run(cfg: ImpairmentConfig, bursts: int, step: float = 1e-4, limit: int = 1 << 30, gather: bool = True):
    """Push the bursts ``step`` seconds apart, then drain the held pool; returns the impairment and
    the delivered (id, length, tag) triples in delivery order."""
    imp = Impairment(cfg, width=WIDTH)
    got = []
    now = 0.0

    def take(out):
        buf, rows, lens, tags = out
        ids = buf[rows, :8].copy().view(np.int64)[:, 0]
        got.extend(zip(ids.tolist(), lens.tolist(), tags.tolist()))

    for buf, rows, lens, tags in _bursts(bursts):
        take(imp.apply(buf, rows, lens, tags, now, limit, gather))
        now += step
    while imp.holding:
        now += 1e-3
        empty = np.zeros((0, WIDTH), np.uint8)
        take(imp.apply(empty, np.arange(0), np.zeros(0, np.int64), np.zeros(0, np.int64), now, limit))
    return imp, got


def _within(count: int, n: int, p: float) -> bool:
    sd = np.sqrt(n * p * (1 - p))
    return abs(count - n * p) <= 5 * sd + 1


def test_seeded_rates_are_within_statistical_bounds_and_packets_stay_intact():
    cfg = ImpairmentConfig(loss=0.02, duplicate=0.03, reorder=0.05, reorder_ms=0.5, seed=11)
    n = 1000 * BURST
    imp, got = _run(cfg, 1000)
    assert _within(imp.dropped, n, 0.02), imp.counters()
    assert _within(imp.duplicated, n, 0.98 * 0.03), imp.counters()
    delivered = n - imp.dropped + imp.duplicated
    assert len(got) == delivered
    assert _within(imp.reordered, delivered, 0.05), imp.counters()
    ids = np.array([g[0] for g in got])
    assert all(tag == 3 * i + 1 and ln == 30 + (i // BURST) % 7 for i, ln, tag in got)   # bytes, length, tag together
    counts = np.bincount(ids, minlength=n)
    assert np.count_nonzero(counts == 0) == imp.dropped and np.count_nonzero(counts == 2) == imp.duplicated
    assert counts.max() <= 2
    # reordering: a held packet comes after packets sent after it; the others keep their order
    overtaken = np.count_nonzero(np.diff(ids) < 0)
    assert 0.5 * imp.reordered / 2 < overtaken <= imp.reordered
    assert imp.counters()["held"] == 0


def test_the_same_seed_drops_the_same_packets_and_another_seed_others():
    cfg = ImpairmentConfig(loss=0.05, seed=4)
    _, a = _run(cfg, 50)
    _, b = _run(cfg, 50)
    _, c = _run(ImpairmentConfig(loss=0.05, seed=5), 50)
    assert a == b
    assert [g[0] for g in a] != [g[0] for g in c]


def test_each_switch_shard_draws_its_own_fates():
    """A switch sharded over cores: each shard's impairments come from a seed of its own (the same seed
    would drop each shard's n-th packet alike), and a shard's fates are the same from run to run."""
    from switch_model.pipeline import SwitchConfig
    from switch_model.shards import shard_config
    cfg = SwitchConfig(ingress=ImpairmentConfig(loss=0.05, seed=4), egress=ImpairmentConfig(loss=0.05, seed=5))
    shards = [cfg] + [shard_config(cfg, 9000, k) for k in (1, 2)]
    for d in ("ingress", "egress"):
        drops = [[g[0] for g in _run(getattr(c, d), 50)[1]] for c in shards]
        assert len({tuple(x) for x in drops}) == 3, (d, drops)
        assert drops[1] == [g[0] for g in _run(getattr(shard_config(cfg, 9000, 1), d), 50)[1]]


def test_a_seed_set_at_run_time_is_each_shards_own():
    """An impair request that sets a seed gives every shard a seed of its own, offset as at start-up
    (the same seed would drop each shard's n-th packet alike); one without a seed keeps theirs."""
    import threading
    from switch_model.pipeline import SwitchConfig, Switch
    from switch_model.shards import SHARD_SEED_STEP, ShardGroup, shard_config

    class Shard:          # a shard process behind its pipe, run in place
        def __init__(self, k):
            self.sw = Switch.__new__(Switch)
            cfg = shard_config(SwitchConfig(), 9000, k)
            self.sw.ingress, self.sw.egress = Impairment(cfg.ingress, width=WIDTH), Impairment(cfg.egress, width=WIDTH)
            self.answer = None

        def send(self, msg):
            name, args, kwargs = msg
            self.answer = ("ok", getattr(self.sw, name)(*args, **kwargs))

        def poll(self, timeout):
            return self.answer is not None

        def recv(self):
            answer, self.answer = self.answer, None
            return answer
    shards = [Shard(k) for k in range(3)]
    g = ShardGroup.__new__(ShardGroup)
    g.n, g.timeout, g._lock, g.local, g._conns = 3, 5.0, threading.RLock(), shards[0].sw, shards[1:]
    g.local.dp = lambda name, *a, **kw: getattr(g.local, name)(*a, **kw)
    g.dp("set_impairments", {"loss": 0.1, "seed": 7}, {"loss": 0.1, "seed": 8})
    assert [(s.sw.ingress.config.seed, s.sw.egress.config.seed) for s in shards] == \
        [(7 + SHARD_SEED_STEP * k, 8 + SHARD_SEED_STEP * k) for k in range(3)]
    assert all(s.sw.ingress.config.loss == 0.1 for s in shards)
    g.dp("set_impairments", {"loss": 0.2}, None)
    assert [s.sw.ingress.config.seed for s in shards] == [7 + SHARD_SEED_STEP * k for k in range(3)]


@pytest.mark.parametrize("gather", [True, False])
def test_loss_alone_delivers_the_survivors_intact_in_order(gather):
    """Loss alone takes the path without a copy (the ingress closes the gaps in the receive ring, the
    egress sends the surviving rows): every packet not counted dropped arrives once, in order, intact."""
    n = 400 * BURST
    imp, got = _run(ImpairmentConfig(loss=0.2, seed=7), 400, gather=gather)
    assert _within(imp.dropped, n, 0.2), imp.counters()
    ids = np.array([g[0] for g in got])
    assert len(ids) == n - imp.dropped and np.all(np.diff(ids) > 0)
    assert all(tag == 3 * i + 1 and ln == 30 + (i // BURST) % 7 for i, ln, tag in got)
    buf, rows, lens, tags = next(_bursts(1))
    out = Impairment(ImpairmentConfig(loss=0.2, seed=7), width=WIDTH).apply(buf, rows, lens, tags, 0.0, BURST, gather)
    assert np.shares_memory(out[0], buf) and out[1].size < BURST        # the caller's rows, not a copy


def test_an_untouched_burst_is_handed_on_without_a_copy():
    imp = Impairment(ImpairmentConfig(loss=1e-9, seed=1), width=WIDTH)
    buf, rows, lens, tags = next(_bursts(1))
    out = imp.apply(buf, rows, lens, tags, 0.0, BURST)
    assert out[0] is buf and out[1] is rows


def test_no_more_than_the_limit_goes_on_and_the_rest_follows_in_order():
    """Duplication makes a burst longer than the switch's parse scratch: the rest is held, due at once."""
    imp, got = _run(ImpairmentConfig(duplicate=1.0, seed=2), 3, limit=BURST)
    ids = [g[0] for g in got]
    assert len(ids) == 6 * BURST
    assert sorted(ids) == sorted(list(range(3 * BURST)) * 2)
    imp = Impairment(ImpairmentConfig(duplicate=1.0, seed=2), width=WIDTH)
    buf, rows, lens, tags = next(_bursts(1))
    _, r, _, _ = imp.apply(buf, rows, lens, tags, 0.0, BURST)
    assert r.size == BURST and imp.holding and imp.next_release() <= 0.0


def test_delay_holds_every_packet_until_it_is_due():
    imp = Impairment(ImpairmentConfig(delay_ms=2.0, seed=3), width=WIDTH)
    buf, rows, lens, tags = next(_bursts(1))
    _, r, _, _ = imp.apply(buf, rows, lens, tags, 1.0, BURST)
    assert r.size == 0 and imp.next_release() == pytest.approx(1.002)
    empty = np.zeros((0, WIDTH), np.uint8)
    none = (empty, np.arange(0), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert imp.apply(*none, 1.0019, BURST)[1].size == 0
    out_buf, r, _, _ = imp.apply(*none, 1.0021, BURST)
    assert r.size == BURST and np.array_equal(out_buf[r], buf) and not imp.holding


def test_a_real_switch_releases_held_packets_when_due_not_a_kernel_tick_later(tmp_path):
    """Every data packet held 1 ms at ingress, two ranks doing one-chunk allreduces: while a packet is
    held nothing else arrives, so the switch's poll must wake up when it is due. A poll that blocks on
    the socket's timeout (counted in 4 ms kernel ticks) released each one 3 to 11 ms late; the switch
    counts the held packets released more than 2 ms after their release time (``released_late``).
    Most must be on time (a tick-rounded wait makes every one late; a loaded machine's late wake-ups
    leave room: measured 1 late of 240 quiet), and the results exact."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from sw_harness import SwitchProc, bfp_reference, client_threads
    sw = SwitchProc("--slots", "64", "--elements", "64", "--ingress-delay-ms", "1", "--host-agg-port", "-1",
                    log_path=tmp_path / "switch.log")
    xs = [np.random.default_rng([r, 17]).standard_normal(64).astype(np.float32) for r in range(2)]
    ref = bfp_reference([x.copy() for x in xs])

    def body(r, cl):
        exact = 0
        for _ in range(40):
            y = xs[r].copy()
            cl.allreduce(y, codec="bfp32")
            exact += np.array_equal(y.view(np.uint32), ref.view(np.uint32))
        return exact

    try:
        exact = client_threads(sw.port, 2, 4, body, elements=64, slots=16, timeout=30)
        imp = sw.stats()["impairments"]["ingress"]
    finally:
        rc = sw.terminate()
    assert rc == 0, sw.log()[-3000:]
    assert exact == [40, 40]
    assert imp["released"] >= 2 * 2 * 40, imp          # a negotiation and a data packet per rank and allreduce
    assert imp["released_late"] < imp["released"] / 2, imp


def test_survivors_draws_the_fates_apply_would():
    """The egress keeps a group send whole when none of its per-worker copies is lost (``survivors``): the
    same seeded stream of fates as ``apply`` on the copies themselves, so a run drops the same copies."""
    cfg = ImpairmentConfig(loss=0.05, seed=9)
    a, b = Impairment(cfg, width=WIDTH), Impairment(cfg, width=WIDTH)
    whole = 0
    for buf, rows, lens, tags in _bursts(200):
        keep = a.survivors(BURST)
        out = b.apply(buf, rows, lens, tags, 0.0, 1 << 30, gather=False)
        expect = rows if keep is None else rows[keep]
        assert np.array_equal(out[1], expect)
        whole += keep is None
    assert a.dropped == b.dropped > 0 and 0 < whole < 200
    assert a.loss_only and not Impairment(ImpairmentConfig(loss=0.05, duplicate=0.01), width=WIDTH).loss_only


@pytest.mark.parametrize("cfg", [ImpairmentConfig(loss=0.01, seed=4),
                                 ImpairmentConfig(loss=0.01, duplicate=0.01, reorder=0.01, seed=5)])
def test_untouched_bursts_skip_apply_and_the_same_packets_are_impaired(cfg):
    """The switch's ingress asks ``untouched`` before ``apply`` (a burst nothing happens to skips apply's
    arrays): the same seeded fates, so the same packets are dropped, copied and held, in the same order."""
    a, b = Impairment(cfg, width=WIDTH), Impairment(cfg, width=WIDTH)
    got_a, got_b, skipped = [], [], 0
    for i, (buf, rows, lens, tags) in enumerate(_bursts(300)):
        n = 1 + i % BURST                       # bursts of every size, a draw block's end crossed
        now = i * 1e-3
        out = b.apply(buf.copy(), rows[:n], lens[:n].copy(), tags[:n].copy(), now, 1 << 30)   # (rearranges them)
        got_b.extend(out[3].tolist())
        if a.untouched(n):
            skipped += 1
            got_a.extend(tags[:n].tolist())
        else:
            got_a.extend(a.apply(buf, rows[:n], lens[:n], tags[:n], now, 1 << 30)[3].tolist())
    assert got_a == got_b and 0 < skipped < 300
    assert (a.dropped, a.duplicated, a.reordered) == (b.dropped, b.duplicated, b.reordered) and a.dropped > 0
    assert not Impairment(ImpairmentConfig(), width=WIDTH).untouched(1)       # off: apply decides (held packets)


def test_egress_loss_keeps_each_workers_results_in_the_bursts_order():
    """Egress loss on a multicasting job: a result that lost a copy goes as its surviving unicast copies, the
    others as one multicast each, and every worker still gets the burst's results in the burst's order (three
    later results ahead of one are a loss to a worker's duplicate threshold). The switch's own stage, with its
    kernel send recorded instead of made."""
    import socket
    import types

    from switch_model.dataplane import C
    from switch_model.multicast import Multicast
    from switch_model.pipeline import Switch
    from ina.wire import MAX_WORKERS

    first = 4 * MAX_WORKERS                         # the group addresses' first index
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        mc = Multicast(s, False, first, 4)
        mc.install(0, 4, 8, np.zeros(first + 4, np.int64))     # job 0: 4 workers, group `first`

        class Recording:
            _send_impaired, _send_lossy = Switch._send_impaired, Switch._send_lossy

            def __init__(self):
                self.multicast, self.egress = mc, Impairment(ImpairmentConfig(loss=0.05, seed=3), width=64)
                self.counters, self.txq, self.sent = np.zeros(len(C), np.int64), types.SimpleNamespace(gso=True), []

            def _send(self, buf, rows, lens, addr):
                self.sent.append((np.asarray(rows).copy(), np.broadcast_to(addr, np.shape(rows)).copy()))

        sw, broken = Recording(), 0
        for _ in range(200):                        # bursts of 8 results to the group
            sw.sent.clear()
            sw._send_impaired(None, np.arange(8), np.full(8, 40), np.full(8, first))
            (rows, addr), = sw.sent
            r, _, a, _ = mc.expand(rows, np.full(rows.shape, 40), addr)
            broken += bool((addr < first).any())
            for w in np.unique(a):
                assert np.all(np.diff(r[a == w]) > 0), (w, list(zip(rows.tolist(), addr.tolist())))
    assert broken >= 20, f"only {broken} bursts lost a copy: the test shows nothing"
