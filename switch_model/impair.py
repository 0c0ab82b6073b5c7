"""User-space link impairments (this kernel has no netem): loss, duplication, reordering, delay.

One :class:`Impairment` per direction (ingress: workers -> switch, egress: switch -> workers).
Seeded, so a run with the same seed and the same traffic drops the same packets. When every
probability and the delay are zero the stage is a pass-through and costs nothing.

A burst is impaired as arrays, never packet by packet: three uniforms per packet from the direction's
seeded generator decide loss, duplication and reordering. They are drawn ahead in blocks of
``DRAW_BLOCK`` packets, with the positions of the packets something happens to, so that a burst
nothing happens to (no loss, no copy, nothing held back or due: nearly every burst at a low loss
rate) costs a comparison and is handed on untouched. A burst that only lost packets (loss alone
configured, nothing held) costs no copy of the survivors: at the egress the sent rows leave the lost
ones out; at the ingress (whose stages read rows 0..k-1) the survivors close the gaps in place, moving
the fewer rows of the two directions, each only by its own bytes (``close_gaps``). Held packets (delay,
reordering) wait in a pool of rows with their release times; only the bytes a packet has are copied.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numba
import numpy as np

DRAW_BLOCK = 4096         # packets whose uniforms are drawn at once (the same stream as one draw per burst)
NEVER = 1 << 62           # no packet drawn so far is impaired
LATE_S = 0.002            # a held packet released more than this after its release time counts as late


@dataclass
class ImpairmentConfig:
    loss: float = 0.0        # probability a packet is dropped
    duplicate: float = 0.0   # probability a packet is delivered twice
    reorder: float = 0.0     # probability a packet is held back and delivered after later ones
    delay_ms: float = 0.0    # fixed one-way delay added to every packet
    reorder_ms: float = 1.0  # how long a reordered packet is held back (on top of the delay)
    seed: int = 0

    def __post_init__(self):
        for name in ("loss", "duplicate", "reorder", "delay_ms", "reorder_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"impairment {name}={v!r}: expected a finite number")
        for name in ("loss", "duplicate", "reorder"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"impairment {name}={p} is not a probability in [0, 1]")
        for name in ("delay_ms", "reorder_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"impairment {name}={getattr(self, name)} must be >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"impairment seed={self.seed!r}: expected an integer >= 0")

    def updated(self, changes: dict | None, where: str = "impairments") -> "ImpairmentConfig":
        """This configuration with the fields ``changes`` names set (None: itself). ``where`` names
        what ``changes`` came as (e.g. "ingress") in the error a malformed one raises."""
        if changes is None:
            return self
        names = [f.name for f in fields(self)]
        if not isinstance(changes, dict):
            raise ValueError(f"{where}: expected an object of impairment fields ({', '.join(names)}), "
                             f"got {type(changes).__name__} {changes!r}")
        unknown = [k for k in changes if k not in names]
        if unknown:
            raise ValueError(f"{where}: unknown impairment field(s) {', '.join(map(repr, unknown))} "
                             f"(fields: {', '.join(names)})")
        try:
            return ImpairmentConfig(**{**self.to_dict(), **changes})
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @property
    def active(self) -> bool:
        return bool(self.loss or self.duplicate or self.reorder or self.delay_ms)

    @property
    def loss_only(self) -> bool:
        """Only loss: a burst's packets are dropped or go on, none is copied or held."""
        return not (self.duplicate or self.reorder or self.delay_ms)

    def to_dict(self) -> dict:
        return asdict(self)


@numba.njit(cache=True, inline="always")
def _move_row(buf, lens, tags, i, j):
    """Row i's bytes, length and tag to row j (a byte loop: numba's slice assignment is 25x slower)."""
    for b in range(min(lens[i], buf.shape[1])):
        buf[j, b] = buf[i, b]
    lens[j], tags[j] = lens[i], tags[i]


@numba.njit(cache=True)
def close_gaps(buf, lens, tags, keep, n):
    """Close the gaps the dropped packets (``keep[i]`` False) leave in rows 0..n-1 of ``buf`` (and in
    ``lens``, ``tags``), keeping the survivors' order: they end up in rows s..s+k-1; returns s. The survivors
    before the last gap move towards the end, or those after the first gap towards the front, whichever
    are fewer; a row moves only its own ``lens[i]`` bytes."""
    first, last, k = n, -1, 0
    for i in range(n):
        if keep[i]:
            k += 1
        else:
            first, last = min(first, i), i
    if k == n:
        return 0
    before_last = 0                   # survivors before the last gap: what moving towards the end copies
    for i in range(last):
        before_last += keep[i]
    after_first = k - first           # survivors after the first gap: what moving towards the front copies
    if after_first <= before_last:
        j = first
        for i in range(first + 1, n):
            if keep[i]:
                _move_row(buf, lens, tags, i, j)
                j += 1
        return 0
    j = last
    for i in range(last - 1, -1, -1):
        if keep[i]:
            _move_row(buf, lens, tags, i, j)
            j -= 1
    return j + 1


class HeldPackets:
    """Packets held back until their release time: rows of bytes, lengths, tags, release times, in
    arrival order (``seq``). Grows by doubling; a handful of rows in steady state."""

    def __init__(self, width: int, capacity: int = 64):
        self.buf = np.zeros((capacity, width), np.uint8)
        self.lens = np.zeros(capacity, np.int64)
        self.tags = np.zeros(capacity, np.int64)
        self.at = np.zeros(capacity)
        self.seq = np.zeros(capacity, np.int64)
        self.n = 0
        self._next_seq = 0

    def push(self, buf, rows, lens, tags, at) -> None:
        k = len(rows)
        if not k:
            return
        if self.n + k > len(self.at):
            self._grow(self.n + k)
        s = slice(self.n, self.n + k)
        w = min(buf.shape[1], self.buf.shape[1], int(np.max(lens)))
        self.buf[s, :w] = buf[rows, :w]
        self.lens[s], self.tags[s], self.at[s] = lens, tags, at
        self.seq[s] = np.arange(self._next_seq, self._next_seq + k)
        self._next_seq += k
        self.n += k

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * len(self.at))
        for name in ("buf", "lens", "tags", "at", "seq"):
            old = getattr(self, name)
            new = np.zeros((cap, *old.shape[1:]), old.dtype)
            new[: self.n] = old[: self.n]
            setattr(self, name, new)

    def due(self, now: float) -> np.ndarray:
        """Rows whose release time has come, in release order (ties: arrival order)."""
        rows = np.flatnonzero(self.at[: self.n] <= now)
        return rows[np.lexsort((self.seq[rows], self.at[rows]))] if rows.size > 1 else rows

    def remove(self, rows: np.ndarray) -> None:
        keep = np.ones(self.n, bool)
        keep[rows] = False
        k = int(keep.sum())
        for a in (self.buf, self.lens, self.tags, self.at, self.seq):
            a[:k] = a[: self.n][keep]
        self.n = k

    def next_release(self) -> float | None:
        return float(self.at[: self.n].min()) if self.n else None


class Impairment:
    """Applies one direction's impairments to a burst of packets: rows of a buffer, their lengths and
    a tag each (the source key at ingress, the destination address index at egress). ``width``: the
    bytes of a row the switch's buffers hold."""

    def __init__(self, config: ImpairmentConfig | None = None, width: int = 2048):
        self.set(config or ImpairmentConfig())
        self.dropped = 0
        self.duplicated = 0
        self.reordered = 0
        self.delayed = 0
        self.released = 0         # held packets (delayed, reordered) released when due
        self.released_late = 0    # ... more than LATE_S after their release time (a poll that overslept)
        self.held = HeldPackets(width)
        self.out = np.zeros((64, width), np.uint8)       # the rows of an impaired burst
        self.out_lens = np.zeros(64, np.int64)
        self.out_tags = np.zeros(64, np.int64)
        one = np.zeros(1, np.int64)         # load close_gaps now (numba's cache: about 0.1 s), not at the first loss
        close_gaps(self.out[:1], one, one.copy(), np.zeros(1, bool), 1)

    def set(self, config: ImpairmentConfig) -> None:
        self.config = config
        self._on = config.active
        self._rng = np.random.default_rng(config.seed)
        self._u = np.zeros((0, 3))      # the drawn uniforms, a row per packet; _u[_at:] not used yet
        self._hit_at = np.zeros(0, np.int64)    # the rows of _u of packets something happens to
        self._next = NEVER              # the first of them at or after _at (a Python int: cheap to compare)
        self._at = 0

    def update(self, changes: dict | None) -> None:
        """Set the fields ``changes`` names (None: none), keeping the others."""
        if changes is not None:
            self.set(self.config.updated(changes))

    def _draw(self, n: int) -> np.ndarray | None:
        """The next ``n`` packets' uniforms if something happens to one of them, else None."""
        i, j = self._at, self._at + n
        if j > len(self._u):
            cfg = self.config
            u = np.concatenate([self._u[i:], self._rng.random((max(DRAW_BLOCK, n), 3))])
            touched = (u[:, 0] < cfg.loss) | (u[:, 1] < cfg.duplicate) | (u[:, 2] < cfg.reorder) | (cfg.delay_ms > 0)
            self._u, self._hit_at = u, np.flatnonzero(touched)
            self._next = int(self._hit_at[0]) if self._hit_at.size else NEVER
            i, j = 0, n
        self._at = j
        if self._next >= j:
            return None
        k = int(np.searchsorted(self._hit_at, j))
        self._next = int(self._hit_at[k]) if k < self._hit_at.size else NEVER
        return self._u[i:j]

    @property
    def active(self) -> bool:
        return self._on or self.held.n > 0

    def untouched(self, n: int) -> bool:
        """Whether the next ``n`` packets go on as they are, nothing held: then their draws are taken (as
        :meth:`apply` would) and the caller skips :meth:`apply` and its arrays (a burst's fixed cost, about
        3 us, on every burst while the impairments are on). False: call :meth:`apply`, nothing drawn yet."""
        j = self._at + n
        if not self._on or self.held.n or j > len(self._u) or self._next < j:
            return False
        self._at = j
        return True

    @property
    def holding(self) -> bool:
        """Packets are held back (delay, reordering, or more than a burst's worth was due)."""
        return self.held.n > 0

    def next_release(self) -> float | None:
        return self.held.next_release()

    def apply(self, buf: np.ndarray, rows: np.ndarray, lens: np.ndarray, tags: np.ndarray, now: float,
              limit: int, gather: bool = True) -> tuple:
        """Impair the burst ``buf[rows]`` (lengths ``lens``, tags ``tags``) arriving at ``now``.

        Returns ``(buf, rows, lens, tags)`` of the packets to deliver now, at most ``limit``: held
        packets that are due first (in release order), then this burst's survivors in their order.
        When nothing happened to the burst and nothing is due, these are the arguments themselves.
        ``gather`` False (a caller that sends ``buf[rows]`` as they are, the egress): when no held
        packet is due, the survivors are ``rows`` of ``buf`` itself (a dropped or duplicated packet
        costs no copy of the burst); otherwise the packets are copied into rows 0..k-1 of a pool. ``gather``
        True wants ``rows`` = 0..n-1 and may rearrange ``buf``, ``lens`` and ``tags`` in place (a receive
        ring's, which the next receive overwrites): a burst that only lost packets comes back as rows
        0..k-1 of a view of ``buf``'s rows."""
        n = len(rows)
        u = self._draw(n) if n and self._on else None
        if u is None and not self.held.n and n <= limit:
            return buf, rows, lens, tags                # nothing happens to this burst (the common case)
        cfg, touched = self.config, u is not None       # a packet of the burst was dropped, copied or held
        if touched and cfg.loss_only and not self.held.n:
            out = self._drop(buf, rows, lens, tags, u[:, 0] >= cfg.loss, limit, gather)
            if out is not None:
                return out
        go = np.arange(n)
        if touched:
            copies = (u[:, 0] >= cfg.loss).astype(np.int64) * (1 + (u[:, 1] < cfg.duplicate))
            self.dropped += int(np.count_nonzero(copies == 0))
            self.duplicated += int(np.count_nonzero(copies == 2))
            touched = bool((copies != 1).any())
            go = np.repeat(go, copies)
            late = u[go, 2] < cfg.reorder
            hold = np.where(late, cfg.reorder_ms / 1e3, 0.0) + cfg.delay_ms / 1e3
            self.reordered += int(np.count_nonzero(late))
            held = hold > 0
            if held.any():
                touched = True
                self.delayed += int(np.count_nonzero(held))
                h = go[held]
                self.held.push(buf, rows[h], lens[h], tags[h], now + hold[held])
                go = go[~held]
        due = self.held.due(now) if self.held.n else go[:0]
        if not (due.size or touched) and n <= limit:
            return buf, rows, lens, tags                # nothing happened to this burst
        if not (gather or due.size) and go.size <= limit:
            return buf, rows[go], lens[go], tags[go]    # drops and duplicates: the same rows, no copy
        return self._assemble(buf, rows[go], lens[go], tags[go], due, limit, now)

    @property
    def loss_only(self) -> bool:
        """Loss alone is configured and nothing is held: a packet is dropped or goes on now (:meth:`survivors`)."""
        return self._on and self.config.loss_only and not self.held.n

    def survivors(self, n: int) -> np.ndarray | None:
        """Draw the fates of the next ``n`` packets, as :meth:`apply` would (the same stream of uniforms), when
        :attr:`loss_only`: the mask of those that go on, None when all do; the dropped ones are counted. For a
        caller that sends something other than the packets themselves when none is lost (the egress: a group
        send in place of its per-worker copies)."""
        u = self._draw(n) if n else None
        if u is None:
            return None
        keep = u[:, 0] >= self.config.loss
        k = int(np.count_nonzero(keep))
        self.dropped += n - k
        return None if k == n else keep

    def _drop(self, buf, rows, lens, tags, keep, limit: int, gather: bool) -> tuple | None:
        """Loss alone, nothing held: the survivors (``keep``) without a copy of them. ``gather``: the burst
        is rows 0..n-1 of ``buf``, whose gaps close in place (``close_gaps``), the result a view of its
        rows. None (the general path) when more than ``limit`` survive or ``rows`` are not 0..n-1."""
        n = len(rows)
        k = int(np.count_nonzero(keep))
        if k > limit or (gather and (rows[0] != 0 or rows[-1] != n - 1)):
            return None
        self.dropped += n - k
        if not gather:
            return buf, rows[keep], lens[keep], tags[keep]
        s = close_gaps(buf, lens, tags, keep, n)
        return buf[s:s + k], np.arange(k), lens[s:s + k], tags[s:s + k]

    def _assemble(self, buf, rows, lens, tags, due, limit: int, now: float) -> tuple:
        """Copy the due held packets, then ``buf[rows]``, into ``self.out``; anything past ``limit``
        goes back to the held pool, due at once (delivered by the next call, before newer packets)."""
        hd = self.held
        k = due.size + rows.size
        if k > limit:
            cut = max(0, limit - due.size)
            hd.push(buf, rows[cut:], lens[cut:], tags[cut:], np.zeros(rows.size - cut))
            rows, lens, tags = rows[:cut], lens[:cut], tags[:cut]
            k = limit
        if k > len(self.out_lens):
            self._grow(k)
        a = min(due.size, k)
        w = min(buf.shape[1], self.out.shape[1], int(lens.max()) if lens.size else 0)
        self.out[:a] = hd.buf[due[:a]]
        self.out_lens[:a], self.out_tags[:a] = hd.lens[due[:a]], hd.tags[due[:a]]
        self.out[a:k, :w] = buf[rows, :w]
        self.out_lens[a:k], self.out_tags[a:k] = lens, tags
        if due.size:
            self._count_released(hd.at[due[:a]], now)
            hd.remove(due[:a])
        return self.out, np.arange(k), self.out_lens[:k], self.out_tags[:k]

    def _count_released(self, at: np.ndarray, now: float) -> None:
        """Count released held packets and the late ones (those put back for the limit, due at once
        with release time 0, count in neither)."""
        timed = at[at > 0]
        self.released += timed.size
        self.released_late += int(np.count_nonzero(now - timed > LATE_S))

    def _grow(self, k: int) -> None:
        cap = max(k, 2 * len(self.out_lens))
        self.out = np.zeros((cap, self.out.shape[1]), np.uint8)
        self.out_lens = np.zeros(cap, np.int64)
        self.out_tags = np.zeros(cap, np.int64)

    def stats(self) -> dict:
        """The configuration and the counters, as the switch's stats show them."""
        return {**self.config.to_dict(), **self.counters()}

    def counters(self) -> dict:
        return {"dropped": self.dropped, "duplicated": self.duplicated, "reordered": self.reordered,
                "delayed": self.delayed, "held": self.held.n, "released": self.released,
                "released_late": self.released_late}
