"""How the streaming client (:mod:`ina.client`) writes a new chunk's codes into its packet ring.

One interface, ``load(pkts, pv, rows, chunks)``: the codes of ``chunks`` (positions in the tensor's
chunks) into the payloads of ring ``rows`` (``pkts``: the ring, ``pv``: its payload view in wire
byte order), in wire byte order, the tensor's last chunk zero-padded. Two ways:

* :class:`RowEncoder`, for codecs with ``encodes_rows`` (nc, nc-det): each chunk is encoded straight
  into its ring row when it is loaded (``Codec.encode_rows``), a burst of chunks in one compiled
  call: no encoded copy of the tensor, no copy into the ring;
* :class:`BlockEncoder`, for the others: a block of chunks is encoded at a time
  (``Codec.encode_shared`` with the block's random stream, ``ScaleContext.from_element``) just
  before its first chunk is sent, and each chunk's codes are copied into its row. Codecs with error
  feedback encode the whole tensor as one block (their residual is kept per key for the whole tensor).

Both give the same bytes: every codec's random stream is positioned by element.
"""
from __future__ import annotations

import math
import time

import numpy as np

from . import stream_kernels as SK
from .wire import HEADER_SIZE, VERSION, MsgType, header_view, packet_size


def encode_block_fn(c, x32: np.ndarray, ctx, kw: dict, elements: int, block: int, timeline=None):
    """``encode_block(b)``: the codes of chunks ``b * block ..`` of ``x32`` as a (rows, elements)
    array, the last chunk zero-padded (``kw``: the codec's key argument)."""
    n, E = x32.size, elements

    def encode_block(b: int) -> np.ndarray:
        t = time.perf_counter()
        lo, hi = b * block * E, min(n, (b + 1) * block * E)
        codes = c.encode_shared(x32[lo:hi], ctx.from_element(lo), **kw)
        rows = math.ceil((hi - lo) / E)
        if codes.size != rows * E:                     # the last chunk is zero-padded
            codes = np.concatenate([codes, np.zeros(rows * E - codes.size, codes.dtype)])
        if timeline:
            timeline.encode_s += time.perf_counter() - t
        return codes.reshape(rows, E)
    return encode_block


class RowEncoder:
    """Chunks encoded straight into their ring rows (``Codec.encode_rows``). ``ready``: chunks
    0 .. ready - 1 are in their rows already (:class:`FirstWindow`) and are not encoded again."""

    def __init__(self, c, x32: np.ndarray, ctx, elements: int, timeline=None, ready: int = 0):
        self.c, self.x32, self.ctx, self.E, self.tl = c, x32, ctx, elements, timeline
        self.ready = self.left = ready

    def load(self, pkts: np.ndarray, pv, rows: np.ndarray, chunks: np.ndarray) -> None:
        if self.left:                      # each chunk is loaded once: skip the ready ones, then stop looking
            new = chunks >= self.ready
            self.left -= chunks.size - int(np.count_nonzero(new))
            rows, chunks = rows[new], chunks[new]
            if not chunks.size:
                return
        t = time.perf_counter() if self.tl else 0.0
        self.c.encode_rows(self.x32, self.ctx, pkts, rows, chunks, HEADER_SIZE, self.E)
        if self.tl:
            self.tl.encode_s += time.perf_counter() - t


class BlockEncoder:
    """Blocks of ``block`` chunks encoded by ``encode_block(b)`` (see :func:`encode_block_fn`), each
    when its first chunk is loaded and kept until its last one is in the ring."""

    def __init__(self, encode_block, block: int, first: np.ndarray | None = None):
        self.encode_block, self.block = encode_block, block
        self.blocks: dict[int, np.ndarray] = {}
        self.left_in_block: dict[int, int] = {}
        if first is not None:                   # block 0 encoded already (:class:`FirstWindow`)
            self.blocks[0], self.left_in_block[0] = first, first.shape[0]

    def load(self, pkts: np.ndarray, pv, rows: np.ndarray, chunks: np.ndarray) -> None:
        bs = chunks // self.block
        lo, hi = int(bs.min()), int(bs.max())
        for b in range(lo, hi + 1) if hi > lo else (lo,):
            sel = slice(None) if hi == lo else bs == b       # one block: no mask
            here = chunks[sel]
            if not here.size:
                continue
            if b not in self.blocks:
                self.blocks[b] = self.encode_block(b)
                self.left_in_block[b] = self.blocks[b].shape[0]
            codes = self.blocks[b]
            if codes.dtype.itemsize == 1 and codes.flags.c_contiguous:    # a memcpy a row, no temporary
                SK.copy_rows(pkts, rows[sel], HEADER_SIZE, codes.view(np.uint8), here - b * self.block)
            else:                                  # byte order of the wire
                pv[rows[sel]] = codes[here - b * self.block]
            self.left_in_block[b] -= here.size
            if self.left_in_block[b] == 0:          # every chunk of the block is in the ring
                del self.blocks[b], self.left_in_block[b]


class FirstWindow:
    """The first window's codes, encoded while the exponent negotiation is out (:meth:`encode`, run by
    the client between sending its proposals and receiving the maxima: an early rank waits there for the
    start skew, the last one for the round trip, and the first data packets then go out the moment the
    maxima are back).

    Encoding needs the agreed context, which comes with the maxima; the worker guesses that its own
    proposals are the maxima (``guess``: the context they give, with the allreduce's seed). When the
    tensors' exponents agree, as gradients' usually do, every rank guesses right. :meth:`take` hands
    the work over only if the agreed context is the guess, so the codes are the agreed context's, bit
    for bit; otherwise the window is encoded again after the negotiation, as without a guess.

    Two forms, as the encoders: for codecs with ``encodes_rows`` the first ``slots`` chunks are
    encoded straight into their rows of the stream's packet ring (``ring``: its first rows; chunk j
    of a stream is in row j for j below the window), a piece of about PIECE_ELEMENTS at a time, until
    ``arrived()`` says the maxima are back (the last rank's round trip can be shorter than the
    window's encoding: the rest is encoded when it is sent, as without a guess); ``ready`` chunks, a
    prefix, are then in their rows. For the others block 0 (``slots`` chunks) is encoded as
    :class:`BlockEncoder` would, whole. Not for codecs with error feedback (encoding updates their
    residual) nor for sparse streams (which encode the whole tensor first)."""

    PIECE_ELEMENTS = 65536       # elements encoded between two looks for the maxima (about 35 us for nc)

    def __init__(self, c, x32: np.ndarray, guess, elements: int, slots: int, ring: np.ndarray | None = None,
                 timeline=None):
        self.c, self.x32, self.guess, self.E, self.ring, self.tl = c, x32, guess, elements, ring, timeline
        self.chunks = self.window_chunks(x32.size, elements, slots)
        self.codes: np.ndarray | None = None
        self.ready = 0              # ring form: chunks 0 .. ready - 1 are encoded in their rows
        self.encoded = False

    @staticmethod
    def window_chunks(n: int, elements: int, slots: int) -> int:
        """How many chunks the first window of an ``n``-element stream has (the ring rows it needs)."""
        return min(slots, max(1, math.ceil(n / elements)))

    def encode(self, arrived=None) -> None:
        """Encode the window under the guess, the ring form in pieces until ``arrived()`` (None: all of it).
        A failure leaves it to the encode after the negotiation, which raises if the agreed context
        fails too."""
        try:
            if self.ring is not None:
                enc = RowEncoder(self.c, self.x32, self.guess, self.E, self.tl)
                step = max(1, self.PIECE_ELEMENTS // self.E)
                while self.ready < self.chunks:
                    chunks = np.arange(self.ready, min(self.chunks, self.ready + step))
                    enc.load(self.ring, None, chunks, chunks)
                    self.ready = int(chunks[-1]) + 1
                    if arrived is not None and arrived():
                        break
            else:
                self.codes = encode_block_fn(self.c, self.x32, self.guess, {}, self.E, self.chunks, self.tl)(0)
        except Exception:  # noqa: BLE001 - a guess that fails is dropped: the agreed context's encode raises if it fails too
            self.ready, self.codes = 0, None
            return
        self.encoded = True
        if self.tl:
            self.tl.mark("prepared")

    def take(self, ctx) -> bool:
        """Whether the window was encoded under ``ctx`` (the agreed context): the encoders may use it."""
        held = self.encoded and ctx == self.guess
        if self.tl:
            self.tl.guess_held = held
        return held


class ChunkOutput:
    """Where the streaming client decodes results: straight into the tensor's flat float32 host array
    ``x32`` (the caller's own memory for a contiguous float32 array or CPU tensor, else its host copy),
    so that no result array is written back afterwards. Chunk j's elements are read (encoded) before
    chunk j is first sent, so its result may overwrite them; the tensor's last chunk, when partial,
    goes through a one-row scratch. A read-only ``x32`` gets a result array of its own."""

    def __init__(self, x32: np.ndarray, elements: int, n_chunks: int):
        E, n = elements, x32.size
        self.flat = x32 if x32.flags.writeable else np.empty(n, np.float32)
        self.full = n // E                              # whole chunks
        self.rows = self.flat[:self.full * E].reshape(self.full, E)
        self.tail = np.empty((1, E), np.float32) if self.full < n_chunks else None

    def decode(self, decode_into, chunks: np.ndarray, payload: np.ndarray, which: np.ndarray | None) -> None:
        """``decode_into(payload, out_rows, chunks, which)`` (Codec.decode_sum_into's order) of ``chunks``
        (ascending, as a receive burst's fresh results come: only the last one may be the tail)."""
        if self.tail is None or chunks[chunks.size - 1] != self.full:
            return decode_into(payload, self.rows, chunks, which)
        last = chunks == self.full
        if not last.any():
            return decode_into(payload, self.rows, chunks, which)
        at = np.flatnonzero(last)
        keep = ~last
        which = np.arange(chunks.size) if which is None else which
        if keep.any():
            decode_into(payload, self.rows, chunks[keep], which[keep])
        decode_into(payload, self.tail, np.zeros(1, np.int64), which[at[:1]])
        self._tail_out()

    def fill(self, chunks: np.ndarray, value: np.ndarray) -> None:
        """Chunks ``chunks`` get the decoded sum ``value`` (a row: sparse streaming's all-zero chunk)."""
        last = chunks == self.full
        self.rows[chunks[~last]] = value
        if last.any():
            self.tail[0] = value
            self._tail_out()

    def _tail_out(self) -> None:
        lo = self.full * self.rows.shape[1] if self.full else 0
        self.flat[lo:] = self.tail[0, :self.flat.size - lo]


class PacketRings:
    """The packet rings of a client's streams: ``get(rows, width, header)`` gives ``rows`` (at most
    ``max_rows``) rows of ``width`` bytes, each row's header set to ``header`` (:meth:`header`: a stream's
    fixed fields). Dense streams reuse one ring per packet width (its first rows) from allreduce to
    allreduce instead of a fresh zeroed megabyte each. Every byte of a row is written before the row is
    first sent (the header by ``header`` and ``fill_headers``, the whole payload by the encoder, the last
    chunk zero-padded), so what a previous stream left is never sent. A sparse stream (per-row payload
    types and trailers) gets a zeroed ring of its own."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.rings: dict[int, np.ndarray] = {}
        self.headers: dict[tuple, np.ndarray] = {}

    def header(self, job: int, rank: int, codec_id: int, ptype: int) -> np.ndarray:
        """A data packet's header (HEADER_SIZE bytes) with its fixed fields set, the others 0 (kept per stream kind)."""
        key = (job, rank, codec_id, int(ptype))
        h = self.headers.get(key)
        if h is None:
            h = np.zeros((1, HEADER_SIZE), np.uint8)
            hv = header_view(h)
            hv["version"], hv["msg_type"], hv["job"], hv["rank"] = VERSION, int(MsgType.DATA), job, rank
            hv["codec"], hv["payload_type"] = codec_id, int(ptype)
            h = self.headers[key] = h[0]
        return h

    def stream(self, rows: int, job: int, rank: int, codec_id: int, ptype: int, elements: int,
               sparse=None) -> np.ndarray:
        """The packet ring of a stream of ``ptype`` packets with ``elements`` elements (sparse: with trailers)."""
        return self.get(rows, packet_size(ptype, elements, bool(sparse)), self.header(job, rank, codec_id, ptype),
                        sparse)

    def get(self, rows: int, width: int, header: np.ndarray, sparse=None) -> np.ndarray:
        if sparse:
            ring = np.zeros((rows, width), np.uint8)
        else:
            ring = self.rings.get(width)
            if ring is None or ring.shape[0] < rows:
                ring = self.rings[width] = np.zeros((max(rows, self.max_rows), width), np.uint8)
            ring = ring[:rows]
        ring[:, :HEADER_SIZE] = header
        return ring
