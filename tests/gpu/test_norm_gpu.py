"""``acco_ds.ops.norm.sum_of_squares`` on a CUDA GPU: both backends agree with an fp64 reference on a shard where
an fp32 accumulator fails, never make the host wait (the round job queues them on the communication stream), and
allocate nothing of the shard's size; the default on CUDA is the Triton kernel (two launches whatever the length:
the chunked path's ~3 launches per 4M elements kept the host from feeding the compute stream). Skipped without a
CUDA GPU."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from acco_ds.ops.norm import NORM_CHUNK, PER_PROGRAM, sum_of_squares
from tests.ops.test_norm import REL, fp64_reference, swamping_shard

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

N = NORM_CHUNK["cuda"] * 3 + 7  # several chunks of the torch path, a short last program of the Triton one


@pytest.mark.parametrize("backend", ["torch", "triton", None])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_cuda_fp64_without_host_sync_or_shard_copy(dtype, backend):
    x = swamping_shard(N, 8192, dtype, device="cuda")
    want = fp64_reference(x.cpu())
    sum_of_squares(x, backend=backend)  # the Triton compile, outside the measured call
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sum_of_squares(x, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    peak = torch.cuda.max_memory_allocated() - base
    assert got.device.type == "cuda" and got.dtype == torch.float64 and got.shape == (1,)
    assert got.item() == pytest.approx(want, rel=REL)
    bound = NORM_CHUNK["cuda"] * 8 if backend == "torch" else (N // PER_PROGRAM + 1) * 8
    assert peak <= bound + (1 << 20), peak


def test_backends_agree_and_the_default_is_two_launches():
    x = swamping_shard(N, 8192, torch.float32, device="cuda")
    by_torch = sum_of_squares(x, backend="torch").item()
    by_triton = sum_of_squares(x, backend="triton").item()
    assert by_triton == pytest.approx(by_torch, rel=1e-13, abs=0.0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sum_of_squares(x)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert 1 <= len(kernels) <= 3, [e.name for e in kernels]
    assert any("sum_of_squares_partials" in e.name for e in kernels), [e.name for e in kernels]


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_stays_non_finite_on_the_gpu(bad):
    x = swamping_shard(PER_PROGRAM * 5 + 3, 10, torch.float32, device="cuda")
    x[PER_PROGRAM * 2 + 1] = bad
    assert not torch.isfinite(sum_of_squares(x)).all()
