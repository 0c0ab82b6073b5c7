"""The agreement rounds on rank 0's TCPStore (``gloo_patch.agreement.Rounds``), with a real store and one
``Rounds`` per rank (ranks as threads of this process: the store's clients are real TCP connections).

What the Horovod backend relies on: the k-th round a rank starts pairs with the k-th round of every other
rank, whatever the order and timing of the starts and reads; each rank reads the sum of every rank's vector;
a round not every rank started raises within the bound (no hang); the store keeps only the rounds in flight,
not one key per round ever started; a closed ``Rounds`` refuses to read; a connection to the store that breaks
is opened again and the rounds go on, and a store that cannot be reached again fails the round within the bound,
naming the store. (A round given up and how the next
rounds pair up again: ``tests/_fw_hvd_rounds.py`` through real ``horovodrun``.)
"""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from gloo_patch import agreement

TIMEOUT = 30.0     # generous: every wait below returns as soon as the rounds complete


def make_ranks(size: int) -> list[agreement.Rounds]:
    store = agreement.Rounds.serve(size, TIMEOUT)
    others = [agreement.Rounds.reach("127.0.0.1", store.port, size, TIMEOUT) for _ in range(size - 1)]
    return [agreement.Rounds(s, r, size, TIMEOUT) for r, s in enumerate([store, *others])]


def run_ranks(ranks: list[agreement.Rounds], run) -> None:
    """``run(rank, rounds)`` on a thread per rank; every thread ends within the bound, without an error."""
    errors: list = []

    def guarded(r: int, x: agreement.Rounds) -> None:
        try:
            run(r, x)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(r, x)) for r, x in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT)
    assert not errors and not any(t.is_alive() for t in threads), errors


def keys_left(ranks: list[agreement.Rounds]) -> int:
    """The keys in the store once every rank's writer thread made the deletes its reads queued (the writers end)."""
    for x in ranks:
        x.outbox.put(None)
        x.writer.join(TIMEOUT)
        assert not x.writer.is_alive()
    return ranks[0].store.num_keys()


def vector(rank: int, k: int) -> torch.Tensor:
    v = torch.zeros(agreement.LENGTH, dtype=torch.int64)
    v[0], v[1], v[2] = 1, 1000 * k + rank, rank * rank
    return v


def test_rounds_pair_by_number_and_sum_every_rank():
    ranks = make_ranks(3)
    rounds = 40
    sums: dict = {r: [] for r in range(3)}

    def run(r: int, rounds_obj: agreement.Rounds):
        # start several rounds before reading any (as buckets are sealed while the worker streams),
        # each rank with its own lag between starts and reads
        pending = []
        for k in range(1, rounds + 1):
            pending.append(rounds_obj.start(vector(r, k)))
            if len(pending) > r + 1:
                sums[r].append(agreement.Rounds.wait(pending.pop(0), TIMEOUT))
        sums[r].extend(agreement.Rounds.wait(h, TIMEOUT) for h in pending)

    run_ranks(ranks, run)
    for r in range(3):
        assert len(sums[r]) == rounds
        for k, total in enumerate(sums[r], start=1):
            assert total.tolist()[:3] == [3, 3000 * k + 3, 5]     # ranks 0+1+2 of round k, nothing else
    # a rank's key goes once every rank has read its round (as each rank's next start says): the store holds
    # keys for the rounds in flight (here a rank lags up to 3 rounds; the bound allows twice that, plus the
    # last rounds), not one per rank for each of the 41 rounds started
    assert keys_left(ranks) <= 3 * (2 * 3 + 2)
    for x in ranks:
        x.close()


def test_a_round_not_every_rank_starts_raises_within_the_bound():
    ranks = make_ranks(2)
    mine = ranks[0].start(vector(0, 1), ["grad.w"])
    with pytest.raises(agreement.RoundError, match="grad.w"):      # rank 1 never started round 1
        agreement.Rounds.wait(mine, 0.5)
    for x in ranks:
        x.close()
    with pytest.raises(RuntimeError, match="closed"):
        agreement.Rounds.wait(mine, TIMEOUT)


def test_vectors_keep_int64_range():
    ranks = make_ranks(2)
    big = torch.full((agreement.LENGTH,), (1 << 40) - 1, dtype=torch.int64)
    hs = [x.start(big) for x in ranks]
    assert np.array_equal(agreement.Rounds.wait(hs[0], TIMEOUT).numpy(), (big * 2).numpy())
    for x in ranks:
        x.close()


def test_a_start_that_lost_its_claim_raises_at_wait_and_the_next_rounds_pair_up():
    """The claim of a round's slot is made off the starting thread; ``wait`` still sees its outcome: a rank that
    starts the allreduces another rank has given up on gets that rank's error, and the next rounds of both ranks
    pair with each other (not off by one)."""
    ranks = make_ranks(2)
    early = ranks[0].start(vector(0, 1), ["grad.w"])
    with pytest.raises(agreement.RoundError, match="grad.w"):      # rank 1 has not started round 1
        agreement.Rounds.wait(early, 0.5)
    late = ranks[1].start(vector(1, 1), ["grad.w"])                 # its slot was claimed by rank 0's record
    with pytest.raises(agreement.RoundError, match="came after the other ranks had given up"):
        agreement.Rounds.wait(late, TIMEOUT)
    hs = [x.start(vector(r, 2)) for r, x in enumerate(ranks)]
    want = (vector(0, 2) + vector(1, 2)).numpy()
    for h in hs:
        assert np.array_equal(agreement.Rounds.wait(h, TIMEOUT).numpy(), want)
    assert [x.given_up for x in ranks] == [1, 1]
    for x in ranks:
        x.close()


class TcpRelay:
    """A real TCP relay between a rank and rank 0's store (one pair of sockets per connection): ``cut()`` breaks
    every connection through it (as a reset link or a restarted middlebox would); ``close()`` also stops
    accepting, so the store cannot be reached through it again."""

    def __init__(self, port: int):
        self.target = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:          # closed
                return
            far = socket.create_connection(self.target, timeout=TIMEOUT)
            far.settimeout(None)
            with self.lock:
                self.sockets += [near, far]
                self.accepted += 1
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for x in (a, b):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        with self.lock:
            socks, self.sockets = self.sockets, []
        for x in socks:
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            x.close()

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)     # wakes the accepting thread: nothing is accepted any more
        except OSError:
            pass
        self.listener.close()
        self.cut()


def ranks_with_a_relay(timeout: float = TIMEOUT) -> tuple[list[agreement.Rounds], TcpRelay]:
    """Rank 0 serves the store; rank 1 reaches it through a :class:`TcpRelay`."""
    store = agreement.Rounds.serve(2, timeout)
    relay = TcpRelay(store.port)
    far = agreement.Rounds.reach("127.0.0.1", relay.port, 2, timeout)
    return [agreement.Rounds(store, 0, 2, timeout), agreement.Rounds(far, 1, 2, timeout)], relay


def run_round(ranks, k: int, timeout: float = TIMEOUT) -> list:
    hs = [x.start(vector(r, k), [f"grad.{k}"]) for r, x in enumerate(ranks)]
    return [agreement.Rounds.wait(h, timeout) for h in hs]


def test_a_broken_connection_to_the_store_is_opened_again_and_the_rounds_go_on():
    ranks, relay = ranks_with_a_relay()
    want = lambda k: (vector(0, k) + vector(1, k)).numpy()   # noqa: E731
    for total in run_round(ranks, 1):
        assert np.array_equal(total.numpy(), want(1))
    assert relay.accepted == 2                  # rank 1's two connections: its claims and its reads
    relay.cut()                                 # both break; rank 1 finds out at its next request on each
    for k in (2, 3, 4):
        for total in run_round(ranks, k):
            assert np.array_equal(total.numpy(), want(k)), k
    assert ranks[1].reopened == 2 and relay.accepted == 4, (ranks[1].reopened, relay.accepted)
    assert ranks[0].reopened == 0 and [x.given_up for x in ranks] == [0, 0]
    for x in ranks:
        x.close()
    relay.close()


def test_a_store_that_cannot_be_reached_again_fails_the_round_within_the_bound_naming_it():
    bound = 2.0
    ranks, relay = ranks_with_a_relay(bound)
    run_round(ranks, 1, bound)
    relay.close()                               # rank 1 can no longer reach rank 0's store
    t0 = time.monotonic()
    mine = ranks[1].start(vector(1, 2), ["grad.w"])
    # the claim's request broke at once; its re-open is refused until it gives up (about ``bound``, TCPStore's
    # retries may overrun it); the wait for the claim's outcome is bounded by ``bound`` either way
    with pytest.raises(agreement.RoundError, match=rf"rank 0's store at 127\.0\.0\.1:{relay.port}") as e:
        agreement.Rounds.wait(mine, bound)
    assert time.monotonic() - t0 < bound + 1.0
    assert "grad.w" in str(e.value) or "could not be opened again" in str(e.value), e.value
    for x in ranks:
        x.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_nonfinite_flags_find_nan_and_inf_per_group(dtype):
    """What the agreement vector's NaN/Inf flags rely on (by each tensor's sum): any NaN, +Inf or -Inf anywhere in a
    group's floating-point tensors flags that group and no other; a half-precision tensor whose values are finite
    but whose sum exceeds float16's range is not flagged (summed in float32); integer tensors never are."""
    rng = np.random.default_rng(5)
    groups = [[torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype) for n in (700, 3, 4096)]
              for _ in range(4)]
    groups[1][2][4000] = float("nan")
    groups[2][0][0] = float("inf")
    groups[3][1][2] = float("-inf")
    groups.append([torch.full((4000,), 60000.0, dtype=dtype), torch.arange(5, dtype=torch.int32)])
    groups.append([torch.tensor([], dtype=dtype)])
    assert agreement.nonfinite_flags(groups) == [False, True, True, True, False, False]
    assert [agreement.nonfinite(g) for g in groups] == [False, True, True, True, False, False]


def test_starts_claimed_here_between_the_writers_claims_and_deletes_keep_the_rounds_paired():
    """The DDP hook claims its last bucket's round on the starting thread (``here``) between starts the writer
    thread claims, while the writer also makes the deletes the reads queued: the rounds still pair by number on
    every rank, and the store holds only the rounds in flight."""
    ranks = make_ranks(2)
    rounds = 30
    sums: dict = {r: [] for r in range(2)}

    def run(r: int, rounds_obj: agreement.Rounds):
        pending = []
        for k in range(1, rounds + 1):
            here = k % 3 == 0                     # every third start: claimed by this thread, now
            pending.append(rounds_obj.start(vector(r, k), [f"b{k}"], here=here))
            if here or len(pending) > r + 1:
                sums[r].append(agreement.Rounds.wait(pending.pop(0), TIMEOUT))
        sums[r].extend(agreement.Rounds.wait(h, TIMEOUT) for h in pending)

    run_ranks(ranks, run)
    for r in range(2):
        assert [s.tolist()[:3] for s in sums[r]] == [[2, 2000 * k + 1, 1] for k in range(1, rounds + 1)]
    assert keys_left(ranks) <= 2 * (2 * 2 + 2)
    for x in ranks:
        x.close()
