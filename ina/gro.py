"""UDP GRO on receive: cutting coalesced messages into their datagrams (compiled steps of
:class:`ina.burst.RxRing`).

With ``UDP_GRO`` on a socket the kernel may hand over several datagrams of one sender as one message
with a cmsg naming the segment size; these kernels cut such messages into one row per datagram,
either from landing buffers into the rows (:func:`cut_segments`) or in place, within the rows they
were received into (:func:`direct_fit`, :func:`cut_in_place`). ``copy_bytes`` is LLVM's memcpy for
numba code (numba's slice assignment is an element loop).
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


@njit(cache=True)
def segment_size(ctl, controllen, length):
    """The UDP_GRO cmsg's segment size in a message's control buffer (``length``: no such cmsg)."""
    at = 0
    while at + 20 <= controllen:
        clen = np.int64(ctl[at]) | (np.int64(ctl[at + 1]) << 8) | (np.int64(ctl[at + 2]) << 16) | \
            (np.int64(ctl[at + 3]) << 24)
        level = np.int64(ctl[at + 8]) | (np.int64(ctl[at + 9]) << 8)
        kind = np.int64(ctl[at + 12]) | (np.int64(ctl[at + 13]) << 8)
        if level == 17 and kind == 104 and clen >= 20:          # SOL_UDP, UDP_GRO: an int
            seg = np.int64(ctl[at + 16]) | (np.int64(ctl[at + 17]) << 8) | (np.int64(ctl[at + 18]) << 16)
            return seg if seg > 0 else length
        if clen < 16:
            break
        at += (clen + 7) // 8 * 8
    return length


@intrinsic
def copy_bytes(typingctx, dst, dst_at, src, src_at, count):
    """memcpy of ``count`` bytes from flat byte ``src_at`` of C-contiguous uint8 array ``src`` to
    ``dst_at`` of ``dst`` (numba's slice assignment is an element loop; this is LLVM's memcpy)."""
    def codegen(context, builder, signature, args):
        d, da, s, sa, c = args
        dp = builder.gep(context.make_array(signature.args[0])(context, builder, d).data, [da])
        sp = builder.gep(context.make_array(signature.args[2])(context, builder, s).data, [sa])
        cgutils.raw_memcpy(builder, dp, sp, c, 1)
        return context.get_dummy_value()
    return types.void(dst, dst_at, src, src_at, count), codegen


@njit(cache=True)
def cut_segments(land, msg, ctl, land_src, st, buf, lens, src, n):
    """Cut landed messages into datagrams, one row of ``buf`` each, from row ``n`` on until the rows run
    out. ``st``: (landed messages, next message, byte offset in it), kept for the next call; each
    message's msghdr is made ready for the next receive once it is cut. Returns the rows filled."""
    stride = buf.shape[1]
    while st[1] < st[0] and n < buf.shape[0]:
        q = st[1]
        length = np.int64(msg[q, 7] & np.uint64(0xFFFFFFFF))
        seg = segment_size(ctl[q], np.int64(msg[q, 5]), length)
        off = st[2]
        while n < buf.shape[0]:
            size = min(seg, length - off)
            take = min(size, stride)
            copy_bytes(buf, n * stride, land, q * land.shape[1] + off, take)
            lens[n] = size if size <= stride else stride + 1
            src[n, :] = land_src[q, :]
            off += size
            n += 1
            if off >= length:                                   # (an empty datagram is one empty row)
                break
        if off < length:
            st[2] = off
            break
        msg[q, 1] = 16                                          # namelen
        msg[q, 5] = ctl.shape[1]                                # controllen
        msg[q, 6] = 0
        st[1] += 1
        st[2] = 0
    return n


@njit(cache=True)
def datagrams(length, seg):
    """How many datagrams a message of ``length`` bytes cut at ``seg`` bytes holds (an empty one: 1)."""
    if seg <= 0 or length <= seg:
        return 1
    return (length + seg - 1) // seg


@njit(cache=True)
def direct_fit(msg, ctl, n, stride, lens, segs):
    """After a receive of ``n`` messages straight into the rows: (messages whose datagrams fit the
    rows, rows they fill). Without a coalesced message that is (n, n), and ``lens`` holds the lengths
    (``stride + 1``: truncated). ``segs``: each message's segment size. Every msghdr is made ready for
    the next receive."""
    rows = 0
    fit = n
    for i in range(n):
        length = np.int64(msg[i, 7] & np.uint64(0xFFFFFFFF))
        truncated = (msg[i, 6] & np.uint64(0x20)) != 0          # msg_flags & MSG_TRUNC
        lens[i] = stride + 1 if truncated else length
        segs[i] = stride + 1 if truncated else segment_size(ctl[i], np.int64(msg[i, 5]), length)
        k = datagrams(lens[i], segs[i])
        if fit == n and rows + k > lens.size:
            fit = i
        if fit == n:
            rows += k
        msg[i, 1] = 16                                          # namelen
        msg[i, 5] = ctl.shape[1]                                # controllen
        msg[i, 6] = 0
    return fit, rows


@njit(cache=True)
def cut_in_place(buf, segs, src, n, fit, lens, land, land_msg, land_ctl, land_src, st):
    """Cut the ``n`` messages received into rows 0.. (lengths ``lens``, segment sizes ``segs``) into
    their datagrams, one row each. Messages ``fit``.. (whose datagrams do not fit the rows) are copied
    to the landing buffers first, each with a UDP_GRO cmsg naming its segment size (``st``: the landing
    state; the next receive cuts them first); then messages ``fit - 1`` down to 0 are spread over the
    rows from the last one back: a message's datagrams go to rows at or after its own, which no
    message still to be cut occupies. Returns the rows filled."""
    stride = buf.shape[1]
    for i in range(fit, n):                                     # what does not fit: landed whole
        q = i - fit
        length = min(lens[i], stride, land.shape[1])
        copy_bytes(land, q * land.shape[1], buf, i * stride, length)
        land_msg[q, 7] = np.uint64(length)
        land_msg[q, 5] = np.uint64(24)                          # CMSG_SPACE(4)
        land_ctl[q, :] = 0
        land_ctl[q, 0] = 20                                     # CMSG_LEN(4)
        land_ctl[q, 8] = 17                                     # SOL_UDP
        land_ctl[q, 12] = 104                                   # UDP_GRO
        seg = min(segs[i], length) if length else 1
        for b in range(4):
            land_ctl[q, 16 + b] = (seg >> (8 * b)) & 0xFF
        land_src[q, :] = src[i, :]
    if n > fit:
        st[0], st[1], st[2] = n - fit, 0, 0
    pos = 0
    for i in range(fit):
        pos += datagrams(lens[i], segs[i])
    rows = pos
    for i in range(fit - 1, -1, -1):
        length, seg = lens[i], segs[i]
        k = datagrams(length, seg)
        pos -= k
        for s in range(k - 1, -1, -1):
            size = min(seg, length - s * seg) if length else 0
            if pos + s != i:
                copy_bytes(buf, (pos + s) * stride, buf, i * stride + s * seg, min(size, stride))
                src[pos + s, :] = src[i, :]
            lens[pos + s] = size
    return rows
