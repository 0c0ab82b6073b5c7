"""What the ranks agree on before an allreduce goes through the switch, in one small Gloo round.

The switch only adds what arrives in the same slot: it cannot tell a float32 tensor of shape (17, 23*57)
on one rank from a (17, 23, 57) one on another, or an Average from a Sum, and a rank whose tensor is not
offloadable (int32 where the other sends float32) would wait in Gloo while the other waits at the
switch. So before a batch of allreduces goes to the switch, every rank contributes a fixed-size int64
vector to one Gloo Sum allreduce:

====================  ==============================================================================
``present``           1: the number of ranks taking part (Horovod's joined ranks contribute zeros)
``h1, h1², h2, h2²``  two independent 20-bit digests of the batch's description (names, shapes,
                      dtypes, devices, op, prescale/postscale): the ranks agree iff
                      ``k * sum(h²) == sum(h)²`` for both (Cauchy-Schwarz: equality iff all equal)
``unusable``          1 if this rank's switch client failed earlier (then everyone uses Gloo)
``nonfinite[64]``     per name bucket: 1 if a tensor of that name holds NaN or Inf on this rank
====================  ==============================================================================

After the sum every rank reads the same vector, so every rank takes the same decision: the batch goes
through the switch, or (a rank has NaN/Inf, a rank's client failed, a rank joined, the ranks disagree)
through plain Gloo, where Gloo's own semantics apply (non-finite values propagate, a mismatch raises
the framework's own error on every rank). A bucket shared by two names only sends both to Gloo.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass

import torch

BUCKETS = 64
HASH_BITS = 20
_HEAD = 6          # present, h1, h1², h2, h2², unusable
LENGTH = _HEAD + BUCKETS


def _hash(text: str, salt: bytes) -> int:
    d = hashlib.blake2b(text.encode(), digest_size=8, key=salt).digest()
    return int.from_bytes(d, "little") & ((1 << HASH_BITS) - 1)


def bucket(name: str) -> int:
    return _hash(name, b"bucket") % BUCKETS


def describe_tensors(tensors) -> str:
    """Shape, dtype and device of each tensor: what must match across ranks for one name."""
    return ";".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}@{t.device.type}" for t in tensors)


def nonfinite(tensors) -> bool:
    """True if a floating-point tensor holds NaN or Inf (integers are always finite)."""
    return any(t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()) for t in tensors)


def local_vector(entries, unusable: bool = False) -> torch.Tensor:
    """``entries``: (name, description, has_nonfinite) per allreduce of the batch, in the batch's order."""
    text = "\n".join(f"{name}|{desc}" for name, desc, _ in entries)
    v = torch.zeros(LENGTH, dtype=torch.int64)
    h1, h2 = _hash(text, b"one"), _hash(text, b"two")
    v[0], v[1], v[2], v[3], v[4], v[5] = 1, h1, h1 * h1, h2, h2 * h2, int(unusable)
    for name, _, bad in entries:
        if bad:
            v[_HEAD + bucket(name)] = 1
    return v


@dataclass
class Agreement:
    """The summed vector, read the same way on every rank."""
    present: int
    agree: bool
    unusable: bool
    nonfinite_buckets: frozenset

    def has_nonfinite(self, name: str) -> bool:
        return bucket(name) in self.nonfinite_buckets


def read(total: torch.Tensor) -> Agreement:
    t = [int(x) for x in total.tolist()]
    k = t[0]
    agree = k > 0 and k * t[2] == t[1] * t[1] and k * t[4] == t[3] * t[3]
    return Agreement(present=k, agree=agree, unusable=t[5] > 0,
                     nonfinite_buckets=frozenset(i for i in range(BUCKETS) if t[_HEAD + i] > 0))


# ---- one collective at a time (torch.distributed): a fixed-size row per rank, gathered ------------------
# torch.distributed matches collectives by issue order, not by name, so the ``ina`` process group and the
# DDP hook agree on each allreduce as it is issued: one Gloo all_gather of a row per rank. Every rank
# sees every row, so every rank raises the same error, or takes the same path.
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
           "complex64", "complex128")


def _dtype_code(dtype) -> int:
    name = str(dtype).replace("torch.", "")
    return _DTYPES.index(name) if name in _DTYPES else len(_DTYPES)


def row(tensors, op: int, unusable: bool = False) -> torch.Tensor:
    """This rank's row for an allreduce of ``tensors`` with reduce op code ``op``: tensor count, elements,
    dtype, op, digest of every tensor's dtype/shape/device, NaN/Inf, failed client, ndim, first 4 dims."""
    t0 = tensors[0] if tensors else torch.zeros(0)
    dims = list(t0.shape)[:4]
    v = [len(tensors), sum(t.numel() for t in tensors), _dtype_code(t0.dtype), op,
         _hash(describe_tensors(tensors), b"row"), int(nonfinite(tensors)), int(unusable), t0.dim()]
    return torch.tensor(v + dims + [0] * (4 - len(dims)), dtype=torch.int64)


def _describe_row(r: list[int], op_names: dict) -> str:
    dtype = _DTYPES[r[2]] if r[2] < len(_DTYPES) else "other"
    shape = r[8:8 + min(r[7], 4)] + (["..."] if r[7] > 4 else [])
    more = f" (first of {r[0]})" if r[0] > 1 else ""
    return f"{dtype} {shape}{more}, {r[1]} elements, {op_names.get(r[3], r[3])}"


def judge(rows, op_names: dict) -> tuple[str | None, bool, bool]:
    """(error message if the ranks disagree, any rank has NaN/Inf, any rank's client failed)."""
    rs = [[int(x) for x in r.tolist()] for r in rows]
    key = [r[:5] + r[7:] for r in rs]
    err = None
    if any(k != key[0] for k in key[1:]):
        err = ("ranks disagree on this allreduce: " + "; ".join(
            f"rank {i}: {_describe_row(r, op_names)}" for i, r in enumerate(rs)))
    return err, any(r[5] for r in rs), any(r[6] for r in rs)


# ---- Horovod: the rounds on a Gloo group of their own ------------------------------------------------------
def joined_vector() -> torch.Tensor:
    """The vector of a rank inside ``hvd.join()``: it takes no part (``present`` 0) and queues nothing."""
    return torch.zeros(LENGTH, dtype=torch.int64)


def local_address(peer_host: str) -> str:
    """The address this host uses towards ``peer_host`` (the switch): where the other ranks reach it too."""
    import socket  # noqa: PLC0415

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 9))      # UDP: no packet is sent, the kernel only picks a route and a source
        return s.getsockname()[0]


def address_ints(switch_host: str, store) -> list[int]:
    """Rank 0's store as two integers for Horovod's broadcast: its IPv4 address towards the switch, its port."""
    if store is None:
        return [0, 0]
    import ipaddress  # noqa: PLC0415

    return [int(ipaddress.IPv4Address(local_address(switch_host))), store.port]


def address_from_ints(v: list[int]) -> tuple[int, str, int]:
    """(job id, host, port) from the broadcast ``[job, address, port]``."""
    import ipaddress  # noqa: PLC0415

    return int(v[0]), str(ipaddress.IPv4Address(int(v[1]))), int(v[2])


def open_rounds(rank: int, size: int, timeout: float, switch_host: str, job: int, broadcast) -> tuple[int, "Rounds"]:
    """The agreement rounds of a job: rank 0 serves the store; ``broadcast(list_of_ints) -> list_of_ints`` hands
    rank 0's ``[job, address, port]`` to every rank (the framework's own broadcast). Returns (job, rounds). The
    group's Gloo device uses ``GLOO_SOCKET_IFNAME``, else ``HOROVOD_GLOO_IFACE``."""
    import os  # noqa: PLC0415

    store = Rounds.serve(size, timeout) if rank == 0 else None
    mine = [job, *address_ints(switch_host, store)] if rank == 0 else [0, 0, 0]
    job, host, port = address_from_ints(broadcast(mine))
    iface = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("HOROVOD_GLOO_IFACE")
    return job, Rounds(store or Rounds.reach(host, port, size, timeout), rank, size, timeout, iface)


class RoundError(RuntimeError):
    """An agreement round that did not complete: it names the round, its allreduces and the ranks missing."""


@dataclass
class Round:
    """One agreement round of this rank: ``vector`` (this rank's, summed in place by the round) in round ``index``
    of the agreement group of generation ``gen``; ``names``: the allreduces it decides (for error messages)."""
    vector: torch.Tensor
    local: torch.Tensor          # this rank's vector as contributed (a relaunch in a new group adds it again)
    names: tuple
    owner: "Rounds"
    gen: int = -1
    index: int = -1
    work: object = None          # the Gloo allreduce; None until the group of ``gen`` exists
    error: str | None = None      # why it failed (a message: an exception kept here would keep its frames alive)

    def describe(self) -> str:
        what = ", ".join(repr(n) for n in self.names[:5]) + (f" and {len(self.names) - 5} more" if len(self.names) > 5
                                                             else "")
        return (f"agreement round {self.index} of group generation {self.gen}"
                + (f" (allreduce {what})" if self.names else " (no allreduce of this rank: hvd.join())"))


class Rounds:
    """The agreement rounds of one Horovod job, on a Gloo process group of their own, rendezvoused through a
    ``TCPStore`` that rank 0 serves (:meth:`serve`; the caller hands its address and port to the others through
    Horovod's broadcast). A round is started when a bucket is sealed and read when the worker reaches that
    bucket, so its latency hides behind the buckets before it; Horovod's own allreduce would go through its
    background cycle (negotiation, then the op) every time. Rounds pair up across ranks in the order they are
    started, as Gloo collectives do: round ``i`` of one rank is summed with round ``i`` of every other rank.

    When a round cannot complete, the pairing would stay off by one: a rank that waited ``timeout`` seconds for a
    round another rank never started has its own contribution still pending in Gloo, where the other rank's next
    round would meet it (Gloo cannot cancel one collective), and a Gloo error (a pair closed) leaves the group
    unusable. So the group has generations. The rank that gives up on round ``i`` of generation ``g`` (it waited
    ``timeout``, or Gloo raised) writes a record into the store (the first record of a generation wins:
    ``compare_set``): the round, why, its allreduces' names, and how many rounds each rank had started in ``g``
    (every rank publishes that count as it starts a round). Every rank reads the record of its generation when a
    round completes or fails, and every few hundred ms while it waits, and then, the same way on every rank:

    * rounds before ``i`` stand (they completed with every rank's vector);
    * round ``i`` fails (:class:`RoundError`, naming it, its allreduces and the ranks that had not started it) on
      every rank that started it before the record; a round started later, which Gloo paired with the abandoned
      contribution, is not the same round: it goes into the next generation with the rounds after ``i``. After a
      Gloo error (the ranks were in step, the group broke) round ``i`` fails on every rank;
    * rounds after ``i`` are started again, in order, in generation ``g + 1``: a new Gloo group, rendezvoused
      (bounded by ``timeout``) when the first of them is waited for; a round of allreduces the record names (a
      rank that reached the abandoned allreduce late) fails at once instead.

    The cost when nothing fails: one store write per round started (the count) and one store check per round
    completed (the record), each about 30 us on loopback."""

    POLL = 0.25     # seconds between the record checks of a rank waiting for a round

    def __init__(self, store, rank: int, size: int, timeout: float, iface: str | None):
        self.store, self.rank, self.size, self.timeout, self.iface = store, rank, size, timeout, iface
        self.lock = threading.RLock()
        self.building = threading.Lock()      # one rendezvous of a new generation at a time
        self.gen, self.index, self.resets = 0, 0, 0
        self.live: list[Round] = []           # started in this generation and not consumed, in start order
        self.records: dict[int, dict] = {}
        self.retired: list = []               # groups of earlier generations (their abandoned rounds stay pending)
        self._publish()
        self.group = self._make_group(0)

    # -- the store: rendezvous, records, counts ---------------------------------------------------------------
    @staticmethod
    def serve(size: int, timeout: float):
        """Rank 0: the store, on a free port of every interface (``store.port``)."""
        import datetime  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        return dist.TCPStore("0.0.0.0", 0, size, True, timeout=datetime.timedelta(seconds=timeout),
                             wait_for_workers=False)

    @staticmethod
    def reach(host: str, port: int, size: int, timeout: float):
        """The other ranks: rank 0's store."""
        import datetime  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        return dist.TCPStore(host, port, size, False, timeout=datetime.timedelta(seconds=timeout))

    def _make_group(self, gen: int):
        import datetime  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=self.iface) if self.iface
                         else dist.ProcessGroupGloo.create_default_device()]
        # Gloo's own bound on one round, above every wait of the callers (hvd.join() waits 3 x timeout for a
        # round while the others train): our waits give up first, with a record, not Gloo with a closed pair
        opts._timeout, opts._threads = datetime.timedelta(seconds=4 * self.timeout), 2
        prefix = "ina.agree" if gen == 0 else f"ina.agree.g{gen}"
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, self.store), self.rank, self.size, opts)

    def _publish(self) -> None:
        """This rank's progress: generation and rounds started in it (read by a rank that gives up on a round)."""
        self.store.set(f"ina.agree.started.{self.rank}", f"{self.gen} {self.index}")

    def _progress(self) -> dict[int, tuple[int, int]]:
        out = {}
        for r in range(self.size):
            key = f"ina.agree.started.{r}"
            if self.store.check([key]):
                g, n = self.store.get(key).decode().split()
                out[r] = (int(g), int(n))
        return out

    def _record(self, gen: int) -> dict | None:
        if gen not in self.records:
            key = f"ina.agree.reset.{gen}"
            if not self.store.check([key]):
                return None
            self.records[gen] = json.loads(self.store.get(key).decode())
        return self.records[gen]

    # -- rounds -------------------------------------------------------------------------------------------------
    def start(self, vector: torch.Tensor, names=()) -> Round:
        """Add ``vector`` into the next round (not waited for): the round, for :meth:`wait`."""
        r = Round(vector, vector.clone(), tuple(names), self)
        with self.lock:
            self._launch(r)
            self.live.append(r)
        return r

    def _launch(self, r: Round) -> None:
        """Give ``r`` the next index of this generation and start it if the group exists (lock held)."""
        r.gen, r.index, r.work = self.gen, self.index, None
        self.index += 1
        self._publish()
        if self.group is not None:
            r.work = self.group.allreduce([r.vector])

    @staticmethod
    def wait(handle: Round, timeout: float) -> torch.Tensor:
        """The summed vector of round ``handle``, within ``timeout`` seconds; else :class:`RoundError` naming the
        round, its allreduces and the ranks that did not reach it (the round is given up on every rank, the
        pairing of the next rounds restored, see the class)."""
        return handle.owner.result(handle, timeout)

    def result(self, r: Round, timeout: float) -> torch.Tensor:
        import datetime  # noqa: PLC0415

        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if r.error is not None:
                    self._consume(r)
                    raise RoundError(r.error)
                work, gen = r.work, r.gen
            if work is None:
                record = self._record(gen)      # a rank that could not rebuild this generation gave up on it
                if record is not None and self._follow(gen, record, r):
                    continue
                self._build(gen)
                if time.monotonic() >= deadline and r.work is None and r.gen == gen and r.error is None:
                    self._give_up(r, f"the agreement group of generation {gen} was not rebuilt within "
                                     f"{timeout:g} s")
                continue
            left = deadline - time.monotonic()
            try:
                done = work.wait(datetime.timedelta(seconds=max(0.001, min(left, self.POLL))))
            except RuntimeError as e:
                if work.is_completed():          # Gloo raised: the group of this generation is broken
                    self._give_up(r, f"Gloo failed in it: {e}", in_step=True)
                    continue
                done = False                     # "Operation timed out!": still pending
            record = self._record(gen)
            if record is not None and self._follow(gen, record, r):
                continue                        # r failed, or moved to the next generation
            if done:
                with self.lock:
                    self._consume(r)
                return r.vector
            if time.monotonic() >= deadline:
                self._give_up(r, f"it did not complete within {timeout:g} s")

    def _consume(self, r: Round) -> None:
        r.work = None            # a Gloo work keeps its group (and the group's threads) alive
        if r in self.live:
            self.live.remove(r)

    def _give_up(self, r: Round, why: str, in_step: bool = False) -> None:
        """Write the record of ``r``'s generation (unless another rank's is there: the first wins), then follow it."""
        progress = self._progress()
        missing = [q for q, (g, n) in sorted(progress.items()) if g < r.gen or (g == r.gen and n <= r.index)]
        who = (f"rank(s) {', '.join(map(str, missing))} had not started it ("
               + "; ".join(f"rank {q}: {progress[q][1]} round(s) of generation {progress[q][0]}" for q in missing)
               + ")" if missing else "every rank had started it")
        mine = {"by": self.rank, "index": r.index, "names": list(r.names), "in_step": in_step, "started": {str(q): n for q, (g, n) in
                progress.items() if g == r.gen}, "why": f"rank {self.rank} gave up on {r.describe()}: {why}; "
                f"{who}"}
        key = f"ina.agree.reset.{r.gen}"
        won = self.store.compare_set(key, "", json.dumps(mine))
        self.records[r.gen] = json.loads(won.decode() if isinstance(won, bytes) else won)
        gen = r.gen
        self._follow(gen, self.records[gen], r)
        with self.lock:
            if r.error is None and r.gen == gen:      # a round of an earlier generation that never completed
                r.error = (f"INA backend: {r.describe()}: {why}; the agreement group was rebuilt "
                           f"meanwhile ({self.records[gen]['why']})")

    def _follow(self, gen: int, record: dict, r: Round) -> bool:
        """Apply the record of generation ``gen`` (once per rank; see the class). True if ``r`` is no longer a
        round of ``gen`` waiting to be read: it failed, or it was started again in the next generation."""
        with self.lock:
            if self.gen == gen:
                self._retire(gen, record)
            return r.error is not None or r.gen != gen

    def _retire(self, gen: int, record: dict) -> None:
        """Lock held: generation ``gen`` ends at the record's round; the rounds after it go into ``gen + 1``."""
        k, before = record["index"], int(record["started"].get(str(self.rank), 0))
        names = set(record["names"])
        self.retired.append(self.group)
        self.gen, self.index, self.group, self.resets = gen + 1, 0, None, self.resets + 1
        again, keep = [], []
        for r in self.live:
            if r.gen != gen or r.index < k:
                keep.append(r)                         # completed with every rank's vector: it stands
            elif r.index == k and (r.index < before or record["in_step"]):
                r.error = (f"INA backend: {record['why']}. The allreduces after it go to a new agreement "
                           f"group (generation {gen + 1})")
            elif names & set(r.names):
                r.error = (f"INA backend: {r.describe()} came after the other ranks had given up on these "
                           f"allreduces ({record['why']})")
            else:
                r.vector.copy_(r.local)
                again.append(r)
        self.live = keep + again
        for r in again:
            self._launch(r)

    def _build(self, gen: int) -> None:
        """Rendezvous the group of generation ``gen`` (every rank comes here when it first waits for one of its
        rounds) and start its rounds in order; bounded by ``timeout`` (the store's)."""
        with self.building:
            with self.lock:
                if self.gen != gen or self.group is not None:
                    return
            try:
                group = self._make_group(gen)
            except RuntimeError as e:
                with self.lock:
                    head = next((r for r in self.live if r.gen == gen), None)
                if head is not None:
                    self._give_up(head, f"the agreement group of generation {gen} could not be rebuilt: {e}")
                return
            with self.lock:
                if self.gen != gen:
                    self.retired.append(group)
                    return
                self.group = group
                for r in self.live:
                    if r.gen == gen and r.work is None:
                        r.work = group.allreduce([r.vector])

    def close(self) -> None:
        for g in [self.group, *self.retired]:
            if g is None:
                continue
            try:
                g.abort()       # rounds still pending (a rank that never came) end now, not at Gloo's bound
            except RuntimeError:
                pass
        with self.lock:      # drop every reference to the groups now (rounds refer back here): their threads end
            for r in self.live:
                r.work = None
            self.group, self.retired, self.live, self.store = None, [], [], None
