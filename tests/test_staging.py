"""Staging of tensors for the allreduce client (ina/staging.py): CUDA tensors go through a reused pinned
host buffer and the result comes back on their device. Without a GPU, the same code path runs for CPU
tensors with ``HostStaging(stage_cpu=True)`` (everything but the pinning and the CUDA streams); the
CUDA tests below run where torch.cuda.is_available()."""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
import torch

from ina import staging
from ina.staging import HostStaging

sys.path.insert(0, os.path.dirname(__file__))
from sw_harness import SwitchProc  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cases():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 10, generator=g)
    return {
        "float32": base.clone(),
        "float16": base.to(torch.float16),
        "bfloat16": base.to(torch.bfloat16),
        "float64": base.to(torch.float64),
        "transposed": base.clone().t(),                # non-contiguous view: strides (1, 10)
        "every other column": base.clone()[:, ::2],    # a strided slice of a bigger storage
        "0-d": torch.tensor(2.5),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_staged_round_trip_keeps_device_dtype_shape_and_strides(name):
    x = _cases()[name]
    st = HostStaging(stage_cpu=True, pin=False)
    stride, ptr, dtype, shape = x.stride(), x.data_ptr(), x.dtype, x.shape
    host = st.to_host(x)
    assert host.dtype == np.float32 and host.shape == (x.numel(),)
    np.testing.assert_array_equal(host, x.reshape(-1).float().numpy())       # values in logical (row-major) order
    out = host * 3 + 1                                                        # a result, as the client returns it
    st.write_back(x, out)
    assert (x.stride(), x.data_ptr(), x.dtype, x.shape) == (stride, ptr, dtype, shape)    # in place
    want = torch.from_numpy(out).reshape(shape).to(dtype)
    assert torch.equal(x, want), (x, want)
    assert st.staged == 1


def test_write_back_into_a_view_changes_only_the_view():
    base = torch.zeros(4, 6)
    view = base[:, ::2]
    st = HostStaging(stage_cpu=True, pin=False)
    st.write_back(view, st.to_host(view) + 1)
    assert torch.equal(base[:, ::2], torch.ones(4, 3)) and torch.equal(base[:, 1::2], torch.zeros(4, 3))


def test_one_buffer_reused_grown_on_demand():
    st = HostStaging(stage_cpu=True, pin=False)
    a, b = torch.randn(1000), torch.randn(600)
    pa = st.to_host(a).ctypes.data
    st.write_back(a, st.to_host(a) * 2)
    pb = st.to_host(b).ctypes.data
    st.write_back(b, np.ones(600, np.float32))
    assert st.allocations == 1 and pa == pb                  # smaller tensors reuse the same memory
    st.to_host(torch.randn(1500))
    assert st.allocations == 2 and st.capacity >= 2000    # grown geometrically, not to the exact size
    st.to_host(torch.randn(1900))
    assert st.allocations == 2
    assert torch.equal(b, torch.ones(600))


def test_unstaged_inputs_are_views_without_copies():
    st = HostStaging()
    arr = np.arange(10, dtype=np.float32)
    t = torch.arange(10, dtype=torch.float32)
    assert np.shares_memory(st.to_host(arr), arr)
    assert st.to_host(t).ctypes.data == t.data_ptr()
    assert st.staged == 0 and st.allocations == 0


def test_each_thread_has_its_own_staging():
    got = []
    t = threading.Thread(target=lambda: got.append(staging.staging()))
    t.start()
    t.join()
    assert got[0] is not staging.staging() and staging.staging() is staging.staging()


def test_cpu_tensors_need_no_cuda_aware_future():
    fut, ready = staging.handoff([torch.ones(3)])
    assert ready == []
    fut.set_result([torch.ones(3)])
    assert fut.wait()[0].sum() == 3


def _allreduce_in_threads(port, inputs, stage_cpu, codec="bfp32"):
    """One Client per thread (rank), each thread with its own staging; returns every rank's tensor after."""
    from ina import Client
    errors = []

    def rank(r):
        try:
            if stage_cpu:
                staging.use(HostStaging(stage_cpu=True, pin=False))
            with Client(("127.0.0.1", port), rank=r, world_size=len(inputs), job=77 + stage_cpu,
                        elements=64, slots=8, timeout=20) as cl:
                cl.allreduce(inputs[r], codec=codec)
                cl.allreduce(inputs[r], codec=codec, average=True)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(len(inputs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    return inputs


@pytest.fixture(scope="module")
def switch(tmp_path_factory):
    sw = SwitchProc("--slots", "64", "--elements", "64", log_path=tmp_path_factory.mktemp("sw") / "switch.log")
    yield sw
    assert sw.terminate() == 0, sw.log()


@pytest.mark.parametrize("stage_cpu", [False, True])
def test_client_allreduce_through_the_staging_path(switch, stage_cpu):
    """Integers: bfp32 sums them exactly, so staged and unstaged results are the exact sum (then mean)."""
    xs = [torch.arange(300, dtype=torch.float32).reshape(20, 15).t() * (r + 1) for r in range(2)]   # strided
    xs[1] = xs[1].to(torch.float16)
    out = _allreduce_in_threads(switch.port, xs, stage_cpu)
    want = torch.arange(300, dtype=torch.float32).reshape(20, 15).t() * 3      # 1x + 2x, then the mean of 3x and 3x
    for x in out:
        assert x.shape == (15, 20) and torch.equal(x.float(), want)
    assert out[1].dtype == torch.float16


# ---- where CUDA exists ---------------------------------------------------------------------------------
@cuda
def test_cuda_round_trip_pinned_and_on_the_device():
    st = HostStaging()
    x = torch.randn(1000, device="cuda", dtype=torch.float16)
    host = st.to_host(x)
    assert st.pinned
    np.testing.assert_array_equal(host, x.float().cpu().numpy())
    st.write_back(x, host * 2)
    torch.cuda.current_stream().synchronize()
    assert x.device.type == "cuda" and x.dtype == torch.float16
    assert torch.equal(x.cpu(), torch.from_numpy(host * 2).half())


@cuda
def test_cuda_buffer_is_not_refilled_before_its_copy_to_the_device_is_done():
    st = HostStaging()
    xs = [torch.zeros(1 << 20, device="cuda") for _ in range(4)]
    for i, x in enumerate(xs):            # back to back: each refill must wait for the previous upload
        st.write_back(x, np.full(x.numel(), i + 1, np.float32))
    torch.cuda.synchronize()
    assert [float(x.mean()) for x in xs] == [1.0, 2.0, 3.0, 4.0]
    assert st.allocations == 1


@cuda
def test_cuda_client_allreduce(switch):
    xs = [torch.arange(300, dtype=torch.float32, device="cuda") * (r + 1) for r in range(2)]
    out = _allreduce_in_threads(switch.port, xs, stage_cpu=False)
    for x in out:
        assert x.device.type == "cuda"
        assert torch.equal(x.cpu(), torch.arange(300, dtype=torch.float32) * 3)


@cuda
def test_cuda_future_carries_cuda_tensors():
    t = torch.ones(3, device="cuda")
    fut, ready = staging.handoff([t])
    assert len(ready) == 1
    staging.wait_ready(ready)
    fut.set_result([t])
    assert fut.wait()[0].device.type == "cuda"
