"""One worker of the bandwidth sweep: a long-lived process inside an emulated host.

Started by ``experiments.sweep`` (``topo.popen(worker, [python, -m, experiments.sweep_worker, ...])``).
It joins a Gloo process group (torch.distributed, TCP rendezvous at worker 0) and then serves
JSON-line commands on stdin, answering JSON lines on stdout:

``{"op": "bench", "id", "method", "elements", "warmup", "reps", "job"}``
    warm-up allreduces (numba caches, socket buffers, TCP windows), then ``{"ready": id}``; waits
    for the line ``go`` (the launcher reads the link counters in between), then ``reps`` timed
    allreduces, each after a Gloo barrier, and answers ``{"done": id, "times": [...], ...}``.
``{"op": "train", "id", "method", "steps", "eval_every", "job", "seed", "lr", "batch"}``
    data-parallel SGD of a small MLP on scikit-learn's digits; answers the accuracy curve.
``{"op": "throughput", "id", "method", "elements", "steps", "warmup", "job", "batch", "bucket_bytes"}``
    data-parallel SGD, on synthetic data, of a ResNet with about ``elements`` parameters (see
    :func:`layout_model`), its gradients allreduced per bucket (:func:`gradient_buckets`); answers
    per-step wall and compute times.
``{"op": "quit"}``

``method`` is ``"gloo"`` (torch.distributed all_reduce of fp32, Gloo's ring), ``"ina:<codec>"``
(ina.Client through the switch) or a baseline of :mod:`experiments.baselines` (``gloo-fp16``,
``powersgd``). Everything that waits has a bound (``--timeout``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import numpy as np


def _out(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def ina_elements(codec: str, mtu: int, world: int = 2) -> int:
    """Elements per packet so that both the INA datagram and its result fit one frame (no IP
    fragmentation): results are NC8 (1 byte) for NC8 codes, int8 for narrow int8 sums and INT32
    (4 bytes) otherwise, so such an INT8 codec's 1-byte upload needs 4-byte-sized chunks."""
    from ina import compression
    from ina.wire import HEADER_SIZE, PAYLOAD_WIDTH, TRAILER_SIZE
    c = compression.get(codec)
    # results in any state the codec can reach (MQGrad's bits grow during training: int32 sums)
    width = max(1, PAYLOAD_WIDTH[c.payload_type], c.result_width(world, any_state=True))
    fit = (mtu - 28 - HEADER_SIZE - TRAILER_SIZE) // width     # sparse streaming's trailer too
    e = 1
    while e * 2 <= fit:
        e *= 2
    return min(e, 8192)


def bench_input(torch, n: int, rank: int, block_sparsity: float | None = None, block: int | None = None):
    """The allreduce benchmark's tensor of ``rank``: normal values times 0.01 (seed 1000 + rank); with
    ``block_sparsity``, each ``block`` of elements is zero with that probability (ranks draw their
    zero blocks independently, so their non-zero blocks differ)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(1000 + rank)) * 1e-2
    if block_sparsity:
        nb = -(-n // block)
        g = torch.Generator().manual_seed(2000 + rank)
        zero = torch.rand(nb, generator=g) < float(block_sparsity)
        x *= (~zero).repeat_interleave(block)[:n].to(x.dtype)
    return x


def layout_model(elements: int):
    """A CIFAR-style ResNet-(6n+2) (a stem, three stages of ``n`` BasicBlocks at widths w/2w/4w, global pooling, a
    linear head) with about ``elements`` parameters: the per-tensor layout of a real conv net (many small
    conv and BatchNorm tensors, a few large ones). At ResNet-110's count (1.7 M) it is ResNet-110 itself
    (n = 18, w = 16: 329 tensors); smaller counts take fewer blocks, larger ones wider stages. Its inputs
    are 3x4x4 (see :data:`LAYOUT_INPUT`): little compute per parameter, a stand-in for an accelerator's
    speed (the links, not this CPU, should dominate); the layout does not depend on the image size."""
    import math

    import torch
    from torch import nn

    def block(c_in, c_out, stride):
        body = nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
                             nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out))
        short = (nn.Identity() if stride == 1 and c_in == c_out else
                 nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)))
        return Residual(body, short)

    class Residual(nn.Module):
        def __init__(self, body, short):
            super().__init__()
            self.body, self.short = body, short

        def forward(self, x):
            return torch.relu(self.body(x) + self.short(x))

    per_block = 2 * 9 * (1 + 4 + 16)                # conv weights of one block per stage, in units of w^2
    n = max(1, min(18, round(elements / (per_block * 16 ** 2))))
    w = max(2, round(math.sqrt(elements / (per_block * n))))
    layers = [nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
    c = w
    for stage, width in enumerate((w, 2 * w, 4 * w)):
        for i in range(n):
            layers.append(block(c, width, 2 if stage and i == 0 else 1))
            c = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, LAYOUT_CLASSES))


LAYOUT_INPUT, LAYOUT_CLASSES = (3, 4, 4), 10


def gradient_buckets(params, bucket_bytes: int) -> list[list]:
    """The parameters in the order backward produces their gradients (the reverse of the model's order),
    cut into buckets of at least ``bucket_bytes`` (the last one smaller): one fused allreduce per bucket, as the
    integrations seal their buckets (``gloo_patch.horovod``: ``INA_BUCKET_BYTES``); 0: one allreduce per tensor."""
    out, cur, size = [], [], 0
    for p in reversed(list(params)):
        cur.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


class Worker:
    def __init__(self, a):
        import torch
        import torch.distributed as dist
        self.a, self.torch, self.dist = a, torch, dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.master_port}", rank=a.rank,
                                world_size=a.world, timeout=timedelta(seconds=a.timeout))
        self.clients = {}

    def client(self, codec: str, job: int):
        from ina import Client
        key = (codec, job)
        if key not in self.clients:
            if self.clients:                   # one job at a time: leave the previous one, and join the next
                for k in list(self.clients):   # only once every rank left (a switch profile may allow one job)
                    self.clients.pop(k).close()
                self.dist.barrier()
            host, port = self.a.switch.rsplit(":", 1)
            self.clients[key] = Client(switch=(host, int(port)), rank=self.a.rank, world_size=self.a.world,
                                       job=job, elements=min(ina_elements(codec, self.a.mtu, self.a.world),
                                                             self.a.max_elements),
                                       slots=self.a.slots, timeout=self.a.timeout, seed=1234, codecs=(codec,),
                                       timeline=True)
        return self.clients[key]

    def reducer(self, method: str, job: int, rto: float | None = None, shapes=None, max_rto: float | None = None,
                stretch: float = 1.0, sparse: bool = False):
        """(allreduce function, ina.Client or None) for ``method``; ``rto``: the client's minimum
        retransmission timeout for this configuration (from the launcher), ``max_rto`` its largest
        (both stretched by a dilation factor ``stretch``, which also stretches the tail probe's floor);
        ``shapes``: the model's parameter shapes (PowerSGD compresses each matrix); ``sparse``: INA's
        sparse block streaming (Client.allreduce(sparse=True))."""
        from . import baselines
        if baselines.is_baseline(method):
            return baselines.reducer(method, self.torch, self.dist, self.a.world, shapes), None
        if method == "gloo":
            dist = self.dist

            def red(t, average=False, key=None):
                dist.all_reduce(t)
                if average:
                    t /= self.a.world
                return t
            return red, None
        if not method.startswith("ina:"):
            raise ValueError(f"unknown method {method!r}: expected 'gloo', 'ina:<codec>' or one of "
                             f"{', '.join(baselines.BASELINES)}")
        cl = self.client(method[4:], job)
        if rto:                      # the timeout before the first round-trip sample (then: measured)
            cl.rto = float(rto)
            cl.max_rto = max(float(max_rto or cl.max_rto), 4 * cl.rto)
        if stretch != 1:             # the tail probe's floor: the client's default, stretched
            import inspect
            cl.min_rto = inspect.signature(type(cl)).parameters["min_rto"].default * float(stretch)
        return (lambda t, average=False, key=None: cl.allreduce(t, codec=method[4:], average=average, key=key,
                                                                sparse=sparse)), cl

    # ----------------------------------------------------------------------------------------------
    def bench(self, cmd):
        torch = self.torch
        n = int(cmd["elements"])
        red, cl = self.reducer(cmd["method"], int(cmd["job"]), cmd.get("rto"), max_rto=cmd.get("max_rto"),
                               stretch=float(cmd.get("stretch", 1.0)), sparse=bool(cmd.get("sparse")))
        x = bench_input(torch, n, self.a.rank, cmd.get("block_sparsity"), cmd.get("sparse_block"))
        ref = x.clone()
        for _ in range(int(cmd["warmup"])):
            x.copy_(ref)
            red(x, key="bench")
        self.dist.barrier()
        s0 = cl.stats.as_dict() if cl else None
        _out({"ready": cmd["id"]})
        line = sys.stdin.readline().strip()
        if line != "go":
            raise RuntimeError(f"expected 'go' from the launcher, got {line!r}")
        times, cpu, tls = [], [], []
        for _ in range(int(cmd["reps"])):
            x.copy_(ref)
            self.dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            red(x, key="bench")
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            if cl and cl.last_timeline:     # every rank's, with its start (perf_counter: one clock for all ranks)
                tls.append(dict(cl.last_timeline, start=t0, rank=self.a.rank))
        self.dist.barrier()
        # correctness check: the sum over ranks, recomputed here from the same seeds
        want = torch.zeros(n)
        for r in range(self.a.world):
            want += bench_input(torch, n, r, cmd.get("block_sparsity"), cmd.get("sparse_block"))
        rel = float((x - want).norm() / want.norm())
        res = {"done": cmd["id"], "times": times, "cpu_times": cpu, "rel_error": rel}
        if cl:
            s1 = cl.stats.as_dict()
            res["client"] = {k: s1[k] - s0[k] for k in s1}
            res["timeline"] = cl.last_timeline
            res["timelines"] = tls
        _out(res)

    # ----------------------------------------------------------------------------------------------
    def train(self, cmd):
        torch = self.torch
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
        X, y = load_digits(return_X_y=True)
        X = (X / 16.0).astype(np.float32)
        Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.3, random_state=0, stratify=y)
        Xtr, ytr = torch.from_numpy(Xtr), torch.from_numpy(ytr)
        Xte, yte = torch.from_numpy(Xte), torch.from_numpy(yte)
        seed = int(cmd.get("seed", 0))
        torch.manual_seed(seed)                          # same init on every rank
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        params = list(model.parameters())
        sizes = [p.numel() for p in params]
        opt = torch.optim.SGD(params, lr=float(cmd.get("lr", 0.1)), momentum=0.9)
        red, cl = self.reducer(cmd["method"], int(cmd["job"]), cmd.get("rto"), shapes=[p.shape for p in params])
        flat = torch.zeros(sum(sizes))
        red(flat.clone())                                # warm-up (numba caches, connections)
        mq = cl.codec(cl_codec) if cl is not None and (cl_codec := cmd["method"][4:]) == "mqgrad" else None
        rng = np.random.default_rng(seed * 100 + self.a.rank)
        batch = int(cmd.get("batch", 32))
        steps, every = int(cmd["steps"]), int(cmd["eval_every"])
        curve, comm, t_start = [], 0.0, None

        def evaluate(step):
            with torch.no_grad():
                acc = float((model(Xte).argmax(1) == yte).float().mean())
            curve.append({"step": step, "time": 0.0 if t_start is None else time.perf_counter() - t_start,
                          "comm_time": comm, "accuracy": acc})

        self.dist.barrier()
        evaluate(0)
        t_start = time.perf_counter()
        for step in range(1, steps + 1):
            idx = torch.from_numpy(rng.integers(0, len(Xtr), batch))
            loss = torch.nn.functional.cross_entropy(model(Xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            if mq is not None:      # MQGrad's agent sees the global loss (as its server does) and sets the bits
                gl = loss.detach().reshape(1).clone()
                self.dist.all_reduce(gl)
                mq.observe_loss(float(gl) / self.a.world)
            torch.cat([p.grad.reshape(-1) for p in params], out=flat)
            t0 = time.perf_counter()
            red(flat, average=True, key="grads")
            comm += time.perf_counter() - t0
            off = 0
            for p, k in zip(params, sizes):
                p.grad.copy_(flat[off:off + k].view_as(p.grad))
                off += k
            opt.step()
            if step % every == 0 or step == steps:
                evaluate(step)
        _out({"done": cmd["id"], "curve": curve, "params": sum(sizes)})

    # ----------------------------------------------------------------------------------------------
    def throughput(self, cmd):
        """Data-parallel SGD of :func:`layout_model` with ``elements`` parameters on one synthetic batch: per step
        a forward+backward, then the gradients allreduced bucket by bucket (``bucket_bytes``: the integration's
        bucket size by default, 0 per tensor; each bucket one fused buffer, in backward's order; after backward,
        not overlapped with it), an SGD step. Answers the per-step wall times."""
        torch = self.torch
        torch.manual_seed(0)                             # same init on every rank
        model = layout_model(int(cmd["elements"]))
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
        red, cl = self.reducer(cmd["method"], int(cmd["job"]), cmd.get("rto"), shapes=[p.shape for p in params])
        from gloo_patch.horovod import DEFAULT_BUCKET_BYTES
        bucket_bytes = int(cmd.get("bucket_bytes", DEFAULT_BUCKET_BYTES))
        if cmd["method"] == "powersgd":
            buckets, bucket_bytes = [params], None    # PowerSGD compresses the model's matrices: one buffer of all
        else:
            buckets = gradient_buckets(params, bucket_bytes)
        flats = [torch.zeros(sum(p.numel() for p in b)) for b in buckets]
        g = torch.Generator().manual_seed(2000 + self.a.rank)
        batch = int(cmd.get("batch", 32))
        x = torch.randn(batch, *LAYOUT_INPUT, generator=g)
        y = torch.randint(0, LAYOUT_CLASSES, (batch,), generator=g)
        step_times, compute_times = [], []

        def step():
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            t1 = time.perf_counter()
            for i, (b, flat) in enumerate(zip(buckets, flats)):
                torch.cat([p.grad.reshape(-1) for p in b], out=flat)
                red(flat, average=True, key=f"grads.{i}")
                off = 0
                for p in b:
                    p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
                    off += p.numel()
            opt.step()
            return t1 - t0

        for _ in range(int(cmd["warmup"])):
            step()
        self.dist.barrier()
        t_all = time.perf_counter()
        for _ in range(int(cmd["steps"])):
            t0 = time.perf_counter()
            compute_times.append(step())
            step_times.append(time.perf_counter() - t0)
        total = time.perf_counter() - t_all
        self.dist.barrier()
        _out({"done": cmd["id"], "step_times": step_times, "compute_times": compute_times, "total": total,
              "params": sum(p.numel() for p in params), "tensors": len(params), "buckets": len(buckets),
              "bucket_bytes": bucket_bytes})

    def serve(self):
        _out({"hello": self.a.rank})
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            cmd = json.loads(line)
            op = cmd.get("op")
            try:
                if op == "quit":
                    break
                elif op == "bench":
                    self.bench(cmd)
                elif op == "train":
                    self.train(cmd)
                elif op == "throughput":
                    self.throughput(cmd)
                else:
                    raise ValueError(f"unknown op {op!r}")
            except Exception as e:  # report, then keep serving is unsafe (collectives desync): exit
                _out({"error": f"{type(e).__name__}: {e}", "id": cmd.get("id")})
                raise
        for c in self.clients.values():
            c.close()
        self.dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--switch", required=True, help="host:port of the switch")
    ap.add_argument("--mtu", type=int, default=9000)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--max-elements", type=int, default=8192, help="most elements per packet (the switch profile's)")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    Worker(a).serve()


if __name__ == "__main__":
    main()
