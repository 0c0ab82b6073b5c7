"""What the ranks agree on before an allreduce goes through the switch, in one small round.

The switch only adds what arrives in the same slot: it cannot tell a float32 tensor of shape (17, 23*57)
on one rank from a (17, 23, 57) one on another, or an Average from a Sum, and a rank whose tensor is not
offloadable (int32 where the other sends float32) would wait in Gloo while the other waits at the
switch. So before a batch of allreduces goes to the switch, every rank contributes a fixed-size int64
vector to one sum over the ranks (Horovod: :class:`Rounds`):

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

import functools
import hashlib
import json
import time
from dataclasses import dataclass

import torch

from .common import log

BUCKETS = 64
HASH_BITS = 20
_HEAD = 6          # present, h1, h1², h2, h2², unusable
LENGTH = _HEAD + BUCKETS


def _hash(text: str, salt: bytes) -> int:
    d = hashlib.blake2b(text.encode(), digest_size=8, key=salt).digest()
    return int.from_bytes(d, "little") & ((1 << HASH_BITS) - 1)


@functools.lru_cache(maxsize=65536)
def bucket(name: str) -> int:
    """The NaN/Inf flag bucket of a name (the same names come back every step: hashed once each)."""
    return _hash(name, b"bucket") % BUCKETS


def describe_tensors(tensors) -> str:
    """Shape, dtype and device of each tensor: what must match across ranks for one name."""
    return ";".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}@{t.device.type}" for t in tensors)


def nonfinite(tensors) -> bool:
    """True if a floating-point tensor holds NaN or Inf (integers are always finite)."""
    return nonfinite_flags([tensors])[0]


def nonfinite_flags(groups) -> list[bool]:
    """For each list of tensors in ``groups``: True if one of its floating-point tensors holds NaN or Inf.

    By each tensor's sum (float32, float64 for float64 tensors): NaN and Inf survive a sum, and one vectorised
    pass costs about 1/30 of ``isfinite(t).all()`` (1.1 M elements: 0.05 against 1.9 ms on this machine), which
    ran on backward's thread for every bucket. Then one check per device for all the sums. A finite tensor whose
    sum overflows float32 (|sum| > 3.4e38) counts as non-finite: it goes through Gloo, correct and only slower."""
    sums: dict = {}                    # device -> [(group index, sum)]
    for i, ts in enumerate(groups):
        for t in ts:
            if t.is_floating_point() and t.numel():
                wide = torch.float64 if t.dtype == torch.float64 else torch.float32
                sums.setdefault(t.device, []).append((i, t.sum(dtype=wide)))     # stack promotes
    flags = [False] * len(groups)
    for pairs in sums.values():
        bad = torch.isfinite(torch.stack([s for _, s in pairs])).logical_not().tolist()
        for (i, _), b in zip(pairs, bad):
            flags[i] = flags[i] or b
    return flags


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
        return bool(self.nonfinite_buckets) and bucket(name) in self.nonfinite_buckets


def read(total: torch.Tensor) -> Agreement:
    t = total.tolist()
    k = t[0]
    agree = k > 0 and k * t[2] == t[1] * t[1] and k * t[4] == t[3] * t[3]
    return Agreement(present=k, agree=agree, unusable=t[5] > 0,
                     nonfinite_buckets=frozenset(i for i, x in enumerate(t[_HEAD:]) if x > 0))


# ---- one collective at a time (torch.distributed): a fixed-size row per rank, gathered ------------------
# torch.distributed matches collectives by issue order, not by name, so the ``ina`` process group and the
# DDP hook agree on each allreduce as it is issued: a row per rank (the ``ina`` group: one all_gather on its
# inner Gloo group; the DDP hook: a table with its own row filled, summed in a store round, see Rounds). Every
# rank sees every row, so every rank raises the same error, or takes the same path.
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


# ---- Horovod and the DDP hook: the rounds on rank 0's TCPStore ------------------------------------------------
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


GAVE_UP = b"ina.gave-up:"     # a round slot given up: this prefix and a JSON record (never an int64 vector's start)


class RoundError(RuntimeError):
    """An agreement round that did not complete: it names the round, its allreduces and the ranks missing."""


def describe_names(names) -> str:
    names = list(names)
    if not names:
        return "no allreduce of this rank (hvd.join())"
    return "allreduce " + ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5
                                                                    else "")


def open_rounds(rank: int, size: int, timeout: float, switch_host: str, job: int, broadcast) -> tuple[int, "Rounds"]:
    """The agreement rounds of a job: rank 0 serves the store; ``broadcast(list_of_ints) -> list_of_ints`` hands
    rank 0's ``[job, address, port]`` to every rank (the framework's own broadcast). Returns (job, rounds)."""
    store = Rounds.serve(size, timeout) if rank == 0 else None
    mine = [job, *address_ints(switch_host, store)] if rank == 0 else [0, 0, 0]
    job, host, port = address_from_ints(broadcast(mine))
    return job, Rounds(store or Rounds.reach(host, port, size, timeout), rank, size, timeout)


class Rounds:
    """The agreement rounds of one Horovod job, on a ``TCPStore`` that rank 0 serves (:meth:`serve`; the caller
    hands its address and port to the others through Horovod's broadcast). Round k is one key per rank,
    ``r<k>/<rank>``: a rank starts it by writing its vector there (one request, made by the writer thread for
    the thread that seals the bucket) and reads it by fetching every rank's key (one request that waits until all are written, from the
    worker) and adding them up. A round is started when a bucket is sealed and read when the worker reaches that
    bucket, so its latency hides behind the buckets before it. Rounds pair up across ranks by their number: the
    k-th round each rank starts. Each value also carries how many rounds its writer had read (all of them, in
    order); a rank deletes its own key of a round once every rank has said it read that round, so the store
    holds only the rounds in flight. The deletes are the writer thread's (queued by the read, behind the claims
    already queued): the thread that read a round goes on to the allreduce it decides, and the next bucket's
    allreduce does not wait behind a delete's request to the store (2 ms between two DDP buckets at 100 Mbit/s).

    A round that cannot complete. Round k pairs with round k of every other rank, so a rank giving up on a round
    another rank never started must not leave that slot for the other rank's next round (it would pair with the
    abandoned one, and every round after it would be off by one). So a rank starts a round by claiming its slot
    with ``compare_set`` (written only if empty), and a rank that waited ``timeout`` for round k claims the slots
    still empty with a record (:data:`GAVE_UP`, who, why, the allreduces). Either way one of the two wins,
    atomically, in the store: if every slot turns out written, the round completes after all; else every rank that
    reads round k finds the record and raises the same :class:`RoundError`, and a rank whose slot was taken skips
    to round k + 1, which pairs with the others' next round; if its own allreduces are the ones given up (it
    reached them late) they fail at once instead of waiting another ``timeout``. The claims are made by a writer
    thread, in the order of the starts (the thread that seals a bucket only queues its start; :meth:`wait` first
    waits for the claim's outcome): a claim costs one request to rank 0's store, 0.2 to 0.3 ms under load, which
    backward no longer waits for.

    A connection that breaks (a reset, a closed socket: ``DistNetworkError``) is opened again, once per request,
    and the request repeated (:meth:`_request`); the rounds go on paired as before, and ``reopened`` counts it.
    If rank 0's store cannot be reached again within ``timeout`` the round fails with a :class:`RoundError`
    naming the store.

    Why not a Gloo group: a round of a 70-element vector cost its Gloo threads about 1 ms of CPU per rank (a
    wake-up per message on the group's transport thread and its worker thread) and 2.7 ms from start to sum
    under load; through the store about 0.1 to 0.2 ms of CPU per rank and 0.5 to 0.9 ms (measured side by side,
    2 ranks on loopback, load average about 10). On two cores that CPU is taken from backward."""

    def __init__(self, store, rank: int, size: int, timeout: float):
        import queue  # noqa: PLC0415
        import threading  # noqa: PLC0415

        self.rank, self.size, self.timeout = rank, size, timeout
        self.origin = store               # rank 0: the server lives as long as this object
        # where the connections are opened again after a network error (rank 0's own: through loopback)
        self.address = ("127.0.0.1" if store.host in ("0.0.0.0", "") else store.host, store.port)
        self.store = store                # starts: a compare_set each, by the writer thread
        # reads wait in the store; a client blocked in a wait holds its connection, so the reads get their own
        self.reader = store.clone()
        self.reopened = 0                 # connections opened again after a network error (a counter)
        self.reopening = threading.Lock()  # the counter, and the connection's replacement
        self.lock = threading.Lock()      # the counters
        self.reading = threading.Lock()   # the reader (a read may wait: starts must not wait behind it)
        self.started = 0                  # rounds started here
        self.read_up_to = 0               # every round <= this one has been read (or given up) here
        self.finished: set[int] = set()   # rounds read here beyond read_up_to
        self.deleted_up_to = 0            # this rank's keys of the rounds <= this one are deleted
        self.given_up = 0                 # rounds given up here, or skipped (another rank gave up on them)
        self.last_start: Start | None = None   # the latest start (a claim made here waits for its claim)
        self.delete_due = 0               # ... and the rounds <= this one may be (the writer's :meth:`_tidy`)
        # a start's claim is a request to rank 0's store: the thread that seals a bucket (backward's) only queues
        # it, so it never waits for the store's thread to be scheduled on a busy machine; one writer, first in
        # first out, claims the slots in the order the starts were made, as the sealing thread itself would
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.writer = threading.Thread(target=self._write, name="ina-agree-writer", daemon=True)
        self.writer.start()

    def key(self, k: int, rank: int) -> str:
        return f"r{k}/{rank}"

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

    def start(self, vector: torch.Tensor, names=(), here: bool = False) -> "Start":
        """Add ``vector`` into the next round (not waited for): the round's handle for :meth:`wait`. ``names``:
        the allreduces it decides (for the errors, and to fail at once those another rank has given up on). The
        claim of the round's slot is made by the writer thread, in the order of the starts; ``here``: by this
        thread, now, after the earlier starts' claims (for a caller that would only wait next: DDP's last bucket,
        whose round is on the step's critical path; the writer's wake-up cost it 0.2 to 0.7 ms under load).
        One thread makes the starts (they are numbered in the order they are made)."""
        handle = Start(self, tuple(names), vector.numpy().astype("int64").tobytes())
        before, self.last_start = self.last_start, handle
        if not here:
            self.outbox.put(handle)
            return handle
        if before is not None and not before.claimed.wait(self.timeout):
            handle.error = (f"INA backend: agreement round ({describe_names(handle.names)}) not started: the round "
                            f"before it was not claimed within {self.timeout:g} s (rank 0's store did not answer)")
            handle.claimed.set()
            return handle
        self._claim_one(handle)
        return handle

    def _write(self) -> None:
        """The writer thread: the claims, in the order of the starts, and the deletes the reads queued (``TIDY``)."""
        while (handle := self.outbox.get()) is not None:
            if handle is TIDY:
                self._tidy()
            else:
                self._claim_one(handle)

    def _claim_one(self, handle: "Start") -> None:
        try:
            self._claim(handle)
        except Exception as e:  # noqa: BLE001 - the store is gone (shut down): this round and the next fail
            handle.error = f"INA backend: agreement round not started, rank 0's store failed: {e}"
        handle.claimed.set()

    def _claim(self, handle: "Start") -> None:
        """Claim the next round's slot for ``handle``: its round number, or the error if the allreduces it
        decides were given up by another rank before this rank started them."""
        import numpy as np  # noqa: PLC0415

        with self.lock:
            while True:
                self.started += 1
                k, read = self.started, self.read_up_to
                mine = np.int64(read).tobytes() + handle.vector
                got = self._request("store", lambda s: s.compare_set(self.key(k, self.rank), "", mine))
                handle.k = k
                if got == mine:
                    return
                # another rank gave up on round k before this rank started it: skip it (the others did too)
                self.given_up += 1
                self._finished(k)
                record = json.loads(got[len(GAVE_UP):])
                if set(handle.names) & set(record["names"]):
                    handle.error = (f"INA backend: agreement round {k} ({describe_names(handle.names)}) came after "
                                    f"the other ranks had given up on these allreduces: {record['why']}; "
                                    f"rank {self.rank} had not started it")
                    return

    @staticmethod
    def wait(handle: "Start", timeout: float) -> torch.Tensor:
        """The summed vector, within ``timeout`` seconds of the round's claim (itself bounded by ``timeout``: one
        request to the store, made by the writer thread after the earlier starts' claims); else
        :class:`RoundError` naming the round, its allreduces and the ranks that had not started it (the round is
        given up on every rank)."""
        if not handle.claimed.wait(timeout):
            host, port = handle.rounds.address
            raise RoundError(f"INA backend: agreement round ({describe_names(handle.names)}) not started within "
                             f"{timeout:g} s: rank 0's store at {host}:{port} did not answer the claim of its slot")
        if handle.error is not None:
            raise RoundError(handle.error)
        return handle.rounds.read(handle.k, timeout, handle.names)

    def _finished(self, k: int) -> None:
        """Round k was read (or given up) here (counters lock held)."""
        self.finished.add(k)
        while self.read_up_to + 1 in self.finished:
            self.finished.discard(self.read_up_to + 1)
            self.read_up_to += 1

    def read(self, k: int, timeout: float, names=()) -> torch.Tensor:
        """Round k's sum over the ranks. This rank's keys of the rounds every rank has read are then deleted by the
        writer thread (off the caller's path)."""
        import numpy as np  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        with self.reading:
            if self.reader is None:
                raise RuntimeError("the agreement rounds are closed (Horovod was shut down)")
            deadline = time.monotonic() + timeout
            try:      # waits for every rank's key, within what is left of ``timeout`` (also after a re-open)
                values = self._request("reader", lambda s: _multi_get(s, [self.key(k, r) for r in range(self.size)],
                                                                       deadline), deadline)
            except dist.DistStoreError:     # not every rank wrote it in time
                values = self._give_up(k, names, timeout)
            with self.lock:
                self._finished(k)
            slots = [q for q, v in enumerate(values) if v.startswith(GAVE_UP)]
            if slots:
                with self.lock:
                    self.given_up += 1
                record = json.loads(values[slots[0]][len(GAVE_UP):])
                why = (f"{record['why']}; rank(s) {', '.join(map(str, slots))} had not started it. The next rounds "
                       "pair up again")
                raise RoundError(f"INA backend: {why}" if record["by"] == self.rank else
                                 f"INA backend: agreement round {k} ({describe_names(names)}) was given up: {why}")
            rows = np.stack([np.frombuffer(v, dtype=np.int64) for v in values])
        # every rank had read the rounds up to min(rows[:, 0]) when it started this one: this rank's keys of
        # those rounds are read by all, so they go (the writer deletes them)
        due = int(rows[:, 0].min())
        with self.lock:
            if due > self.delete_due:
                self.delete_due = due
                self.outbox.put(TIDY)
        return torch.from_numpy(rows[:, 1:].sum(axis=0))

    def _tidy(self) -> None:
        """The writer thread: delete this rank's keys of the rounds up to ``delete_due``. A failed delete (the store
        closed or gone) leaves the key; the rounds go on without it (the next claim or read names a dead store)."""
        with self.lock:
            lo, hi = self.deleted_up_to + 1, self.delete_due
            self.deleted_up_to = max(self.deleted_up_to, hi)
        try:
            for j in range(lo, hi + 1):
                self._request("store", lambda s, j=j: s.delete_key(self.key(j, self.rank)))
        except Exception as e:  # noqa: BLE001 - housekeeping: the rounds read are complete
            log.debug("[ina rank %d] agreement rounds: deleting round keys %d..%d: %s", self.rank, lo, hi, e)

    def _give_up(self, k: int, names, timeout: float) -> list:
        """Claim the slots of round k still empty with a record, each atomically against that rank's start: the
        values of round k after that (a rank that wrote meanwhile keeps its vector)."""
        why = (f"rank {self.rank} gave up on agreement round {k} ({describe_names(names)}): it did not complete "
               f"within {timeout:g} s")
        record = GAVE_UP + json.dumps({"by": self.rank, "names": list(names), "why": why}).encode()
        return [self._request("store", lambda s, q=q: s.compare_set(self.key(k, q), "", record))
                for q in range(self.size)]

    def _request(self, which: str, call, deadline: float | None = None):
        """``call(connection)`` on this rank's connection ``which`` to rank 0's store (``store``: the claims and
        give-ups; ``reader``: the reads). A network error (the connection broke: a reset, a closed socket) opens
        that connection again, once, and repeats the request: every request here may be repeated (a compare_set
        from empty to this rank's own value, a read, a delete). A second failure is a :class:`RoundError` naming
        the store; a timeout (``DistStoreError``) is the caller's. The re-open waits at most the rounds' timeout, or
        until ``deadline`` (``time.monotonic()``) if the request has one."""
        import torch.distributed as dist  # noqa: PLC0415

        conn = getattr(self, which)
        if conn is None:
            raise RuntimeError("the agreement rounds are closed (Horovod was shut down)")
        try:
            return call(conn)
        except dist.DistNetworkError as e:
            first = _first_line(e)
        conn = self._reopen(which, first, self.timeout if deadline is None else deadline - time.monotonic())
        try:
            return call(conn)
        except dist.DistNetworkError as e:
            raise RoundError(f"INA backend: rank 0's store at {self.address[0]}:{self.address[1]} failed again "
                             f"right after its connection was opened again ({first}): {_first_line(e)}") from None

    def _reopen(self, which: str, why: str, within: float):
        """A fresh connection to rank 0's store in place of ``which``, made within ``within`` seconds."""
        import datetime  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        host, port = self.address
        log.warning("[ina rank %d] agreement rounds: the connection to rank 0's store at %s:%d broke (%s); "
                    "opening it again", self.rank, host, port, why)
        try:
            within = max(0.05, within)
            conn = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=within))
        except Exception as e:  # noqa: BLE001 - the store is gone: named in the error every waiting caller gets
            raise RoundError(f"INA backend: the connection to rank 0's store at {host}:{port} broke ({why}) and "
                             f"could not be opened again within {within:.3g} s: {_first_line(e)}") from None
        with self.reopening:                  # not self.lock: a claim holds it while it makes its request
            self.reopened += 1
            if getattr(self, which) is not None:      # not closed meanwhile
                setattr(self, which, conn)
        return conn

    def close(self) -> None:
        self.outbox.put(None)
        self.writer.join(self.timeout)      # the starts already queued are claimed first
        # rank 0: the server goes with it, and the other ranks' reads end
        self.store = self.reader = self.origin = None


def _first_line(e: BaseException) -> str:
    """The message of a c10d error without the C++ stack it carries."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _multi_get(conn, keys: list, deadline: float) -> list:
    """Every key's value, waiting for those not written yet until ``deadline`` (``time.monotonic()``)."""
    import datetime  # noqa: PLC0415

    conn.set_timeout(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
    return conn.multi_get(keys)


TIDY = object()      # a writer thread's item: delete the rounds' keys read by every rank (Rounds._tidy)


class Start:
    """A round started here: its claim is queued for the writer thread, which sets ``k`` (the round number) or
    ``error`` (the allreduces were given up by another rank first), then ``claimed``."""

    def __init__(self, rounds: Rounds, names: tuple, vector: bytes):
        import threading  # noqa: PLC0415

        self.rounds, self.names, self.vector = rounds, names, vector
        self.k: int = 0
        self.error: str | None = None
        self.claimed = threading.Event()
