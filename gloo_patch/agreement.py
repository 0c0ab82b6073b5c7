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

import hashlib
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


class Rounds:
    """The agreement rounds of one Horovod job, on a ``TCPStore`` that rank 0 serves (:meth:`serve`; the caller
    hands its address and port to the others through Horovod's broadcast). Round k is one key per rank,
    ``r<k>/<rank>``: a rank starts it by writing its vector there (one request, from the thread that seals the
    bucket) and reads it by fetching every rank's key (one request that waits until all are written, from the
    worker) and adding them up. A round is started when a bucket is sealed and read when the worker reaches that
    bucket, so its latency hides behind the buckets before it. Rounds pair up across ranks by their number: the
    k-th round each rank starts. Each value also carries how many rounds its writer had read (all of them, in
    order); a rank deletes its own key of a round once every rank has said it read that round, so the store
    holds only the rounds in flight.

    Why not a Gloo group: a round of a 70-element vector cost its Gloo threads about 1 ms of CPU per rank (a
    wake-up per message on the group's transport thread and its worker thread) and 2.7 ms from start to sum
    under load; through the store about 0.1 to 0.2 ms of CPU per rank and 0.5 to 0.9 ms (measured side by side,
    2 ranks on loopback, load average about 10). On two cores that CPU is taken from backward."""

    def __init__(self, store, rank: int, size: int, timeout: float):
        import threading  # noqa: PLC0415

        self.rank, self.size, self.timeout = rank, size, timeout
        self.store = store                # starts: a set, from the sealing thread (under the caller's lock)
        # reads wait in the store; a client blocked in a wait holds its connection, so the reads get their own
        self.reader = store.clone()
        self.lock = threading.Lock()      # the counters
        self.reading = threading.Lock()   # the reader (a read may wait: starts must not wait behind it)
        self.started = 0                  # rounds started here
        self.read_up_to = 0               # every round <= this one has been read (or given up) here
        self.finished: set[int] = set()   # rounds read here beyond read_up_to
        self.deleted_up_to = 0            # this rank's keys of the rounds <= this one are deleted

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

    def start(self, vector: torch.Tensor):
        """Add ``vector`` into the next round (not waited for): the round's handle for :meth:`wait`."""
        import numpy as np  # noqa: PLC0415

        with self.lock:
            self.started += 1
            k, read = self.started, self.read_up_to
        self.store.set(self.key(k, self.rank), np.concatenate([[read], vector.numpy()]).astype(np.int64).tobytes())
        return self, k

    @staticmethod
    def wait(handle, timeout: float) -> torch.Tensor | None:
        """The summed vector, or None if the round did not complete within ``timeout`` seconds (then this rank
        gives it up: the callers raise)."""
        rounds, k = handle
        return rounds.read(k, timeout)

    def read(self, k: int, timeout: float) -> torch.Tensor | None:
        import datetime  # noqa: PLC0415
        import numpy as np  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        with self.reading:
            reader = self.reader
            if reader is None:
                raise RuntimeError("the agreement rounds are closed (Horovod was shut down)")
            reader.set_timeout(datetime.timedelta(seconds=timeout))
            try:
                values = reader.multi_get([self.key(k, r) for r in range(self.size)])   # waits for every rank
                rows = np.stack([np.frombuffer(v, dtype=np.int64) for v in values])
            except dist.DistStoreError:     # not every rank wrote it in time (DistNetworkError: the store is gone)
                rows = None
            with self.lock:
                self.finished.add(k)
                while self.read_up_to + 1 in self.finished:
                    self.finished.discard(self.read_up_to + 1)
                    self.read_up_to += 1
            if rows is None:
                return None
            # every rank had read the rounds up to min(rows[:, 0]) when it started this one: this rank's keys of
            # those rounds are read by all, so they go
            done = int(rows[:, 0].min())
            for j in range(self.deleted_up_to + 1, done + 1):
                reader.delete_key(self.key(j, self.rank))
            self.deleted_up_to = max(self.deleted_up_to, done)
        return torch.from_numpy(rows[:, 1:].sum(axis=0))

    def close(self) -> None:
        self.store = self.reader = None     # rank 0: the server goes with it, and the other ranks' reads end
