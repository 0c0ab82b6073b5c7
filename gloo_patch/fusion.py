"""Horovod's tensor fusion at the switch: the offloadable allreduces of one agreed bucket become buffers.

Every rank has agreed on the bucket (``gloo_patch.agreement``), so every rank fuses identically: in name
order, consecutive allreduces of one dtype, device, op and prescale/postscale share a buffer of at most
``HOROVOD_FUSION_THRESHOLD`` bytes (Horovod's variable and default; 0 sends each on its own).

Error-feedback codecs (``keeps_residuals``: 3lc-3v, bgt, qgt) keep one residual and one scale per key. A
buffer of such a codec still travels as one unit of work, but each of its tensors is its own keyed
allreduce, keyed by (name, position): the tensor's own residual and its own scale, as 3LC keeps one
compression context per tensor and as the DDP comm hook sends each parameter of a bucket (one scale for a
whole buffer rounds every tensor whose values stay below half the largest one to zero until its residual
catches up). Other codecs send the buffer as one allreduce (for ``bfp32`` one shared exponent per buffer).
"""
from __future__ import annotations

import os
import time

from .common import per_parameter

DEFAULT_FUSION_BYTES = 128 * 1024 * 1024     # Horovod's default HOROVOD_FUSION_THRESHOLD
NONAME = "ina.noname."                       # prefix of the names given to allreduces without one


def fusion_threshold() -> int:
    v = os.environ.get("HOROVOD_FUSION_THRESHOLD", "")
    try:
        return int(v) if v else DEFAULT_FUSION_BYTES
    except ValueError:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD={v!r}: expected a number of bytes") from None


def buffers(handles, limit: int) -> list[list]:
    """The handles (in name order) grouped into fused buffers: one dtype/device/op/scales, at most ``limit``
    bytes (a single larger tensor is a buffer of its own). A handle's ``nbytes``: its tensors' bytes."""
    groups, cur, cur_key, cur_bytes = [], [], None, 0
    for h in handles:
        t0 = h.tensors[0]
        key = (t0.dtype, t0.device, h.op, h.prescale, h.postscale)
        if cur and (key != cur_key or cur_bytes + h.nbytes > limit):
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(h)
        cur_key, cur_bytes = key, cur_bytes + h.nbytes
    if cur:
        groups.append(cur)
    return groups


def allreduce_buffer(client, codec: str, group, average: bool) -> float:
    """One fused buffer through the switch: fuse, prescale, allreduce, postscale, unfuse into the outputs.
    Returns the CPU seconds this thread spent inside the client (the rest is the fusion's)."""
    import torch  # noqa: PLC0415

    h0 = group[0]
    tensors = [t for h in group for t in h.tensors]
    outputs = [o for h in group for o in h.outputs]
    # Horovod scales half-precision tensors in float32 math: so do we
    wide = (h0.prescale != 1.0 or h0.postscale != 1.0) and h0.tensors[0].dtype in (torch.float16, torch.bfloat16)
    copied = len(tensors) > 1 or wide
    if not copied:
        t, buf = tensors[0], outputs[0]
        if buf is not t:
            buf.copy_(t)
    elif wide:
        buf = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
    else:
        buf = torch.cat([t.reshape(-1) for t in tensors])
    if h0.prescale != 1.0:
        buf.mul_(h0.prescale)
    # a named allreduce keeps its error-feedback residual across steps; Horovod's generated names (no name
    # given) change every call, so those go stateless
    named = not any(h.name.startswith(NONAME) for h in group)
    # float32 unfused into float32 outputs on the CPU: the average is taken in the unfuse pass (one pass over the
    # buffer instead of two). Not on CUDA, whose division by a number multiplies by its reciprocal (one bit off
    # the client's float32 division, which stays the rule there)
    divide = average and copied and h0.postscale == 1.0 and not per_parameter(codec) and \
        buf.device.type == "cpu" and all(x.dtype == torch.float32 for x in (buf, *outputs))
    cpu = time.thread_time()
    if per_parameter(codec):
        views = buf.split([t.numel() for t in tensors])
        keys = [(h.name, i) for h in group for i in range(len(h.tensors))]
        for v, key in zip(views, keys):
            client.allreduce(v, codec=codec, average=average, key=key if named else None)
    else:
        client.allreduce(buf, codec=codec, average=average and not divide,
                         key=(h0.name, len(group), group[-1].name) if named else None)
    cpu = time.thread_time() - cpu
    if h0.postscale != 1.0:
        buf.mul_(h0.postscale)
    if copied:      # one split into views, then one view and one copy (or division) per output
        for o, v in zip(outputs, buf.split([o.numel() for o in outputs])):
            if divide:
                torch.div(v.view(o.shape), client.world_size, out=o)
            else:
                o.copy_(v.view(o.shape))
    return cpu
