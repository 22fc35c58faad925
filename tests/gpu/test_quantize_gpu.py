"""GPU checks of the Triton quantize kernels (``acco_ds.ops.quantize``, CUDA tensors take ``backend="triton"`` by
default); skipped without a CUDA GPU.

The CPU tests' inputs (tests/ops/test_quantize_kernel.py: short last blocks, zero and negative-zero blocks, huge
and subnormal magnitudes, +-inf and NaN, ties) on the GPU, compared bit for bit with the torch reference run on
the CPU (a NaN matching any NaN): q, scales, the error-feedback residual (fp32 and bf16), dequantized values and sums, 8 and 4 bits, and
many rounds of error feedback. Also: the kernels run on the current CUDA stream (the communication side queues
them on its side stream).
"""

from __future__ import annotations

import pytest
import torch

from acco_ds.ops.quantize import (
    add_dequantized,
    add_dequantized_ref,
    dequantize,
    dequantize_add,
    dequantize_add_ref,
    dequantize_ref,
    dequantize_sum,
    dequantize_sum_ref,
    quantize,
    quantize_difference,
    quantize_difference_ref,
    quantize_ref,
    quantize_with_residual,
    quantize_with_residual_ref,
)
from tests.ops.test_quantize_kernel import DTYPES, deq_case, diff_case, gen, small, special, sum_case
from tests.ops.test_quantize_kernel import assert_same as assert_same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# Each (dtype, bits, residual dtype, tile) is a Triton compile on a fresh machine: few block sizes, one per tile
# width (7 -> 16, 256, 4096 -> 1024 walked in 4 tiles), 4 bits at one of them.
SIZES = [0, 7, 257, 100_003, 3_000_017]
BLOCKS = [7, 256, 4096]


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit for bit, any NaN matching any NaN (the GPU makes other NaN bits than the CPU reference)."""
    assert_same_bits(a, b, what, any_nan=True)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


# 4 bits at one block size: the same code as 8 bits but the bound
BLOCKS_AND_BITS = [(block, 8) for block in BLOCKS] + [(256, 4)]


@pytest.mark.parametrize(("block_size", "nbits"), BLOCKS_AND_BITS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_on_the_gpu_matches_the_reference(dtype, n, block_size, nbits):
    x = special(n, block_size, DTYPES[dtype], "gpu")
    q, s = quantize(x.cuda(), block_size, bits=nbits)
    q_ref, s_ref = quantize_ref(x, block_size, nbits)
    assert_same(_cpu(q), q_ref, "q")
    assert_same(_cpu(s), s_ref, "scales")
    for rdtype in DTYPES.values():
        residual = small(n, rdtype, "gpu")
        residual_ref = residual.clone()
        on_gpu = residual.cuda()
        q, s = quantize_with_residual(x.cuda(), on_gpu, block_size, bits=nbits)
        q_ref, s_ref = quantize_with_residual_ref(x, residual_ref, block_size, nbits)
        assert_same(_cpu(q), q_ref, "q with residual")
        assert_same(_cpu(s), s_ref, "scales with residual")
        assert_same(_cpu(on_gpu), residual_ref, f"residual ({rdtype})")


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
def test_dequantize_sum_on_the_gpu_matches_the_reference(n, block_size, out_dtype):
    """The owner's one-pass sum of 3 ranks' chunks (the fused row kernel; blocks over 1024 row by row)."""
    q, s = sum_case(3, n, block_size, "gpu-sum")
    out = torch.empty(n, dtype=DTYPES[out_dtype], device="cuda")
    out_ref = torch.empty(n, dtype=DTYPES[out_dtype])
    dequantize_sum(out, q.cuda(), s.cuda(), block_size, [2, 0, 1])
    dequantize_sum_ref(out_ref, q, s, block_size, [2, 0, 1])
    assert_same(_cpu(out), out_ref, "dequantize_sum")


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_difference_kernels_on_the_gpu_match_the_reference(dtype, n, block_size):
    """The parameter path: the difference quantized, then applied onto the base (into another buffer, in place)."""
    new, base = diff_case(n, block_size, DTYPES[dtype], "gpu")
    q, s = quantize_difference(new.cuda(), base.cuda(), block_size)
    q_ref, s_ref = quantize_difference_ref(new, base, block_size)
    assert_same(_cpu(q), q_ref, "difference q")
    assert_same(_cpu(s), s_ref, "difference scales")
    out_ref = torch.empty_like(base)
    add_dequantized_ref(out_ref, base, q_ref, s_ref, block_size)
    on_gpu = base.cuda()
    add_dequantized(on_gpu, on_gpu, q_ref.cuda(), s_ref.cuda(), block_size)
    assert_same(_cpu(on_gpu), out_ref, "base + deq in place")


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
def test_dequantize_on_the_gpu_matches_the_reference(n, block_size):
    q, s = deq_case(n, block_size, "gpu-deq")
    out = special(n, 64, torch.float32, "gpu-acc")
    out_ref = out.clone()
    on_gpu = out.cuda()
    dequantize_add(on_gpu, q.cuda(), s.cuda(), block_size)
    dequantize_add_ref(out_ref, q, s, block_size)
    assert_same(_cpu(on_gpu), out_ref, "dequantize_add")
    assert_same(_cpu(dequantize(q.cuda(), s.cuda(), block_size)), dequantize_ref(q, s, block_size), "deq")


@pytest.mark.parametrize("rdtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rounds_of_error_feedback_on_the_gpu(dtype, rdtype):
    n, block_size = 1_000_003, 256
    residual_ref = torch.zeros(n, dtype=DTYPES[rdtype])
    residual = residual_ref.cuda()
    total, total_ref = torch.zeros(n, device="cuda"), torch.zeros(n)
    for step in range(12):
        g = gen("gpu-round", step, dtype, rdtype)
        x = (torch.randn(n, generator=g) * float(torch.rand(1, generator=g)) * 10).to(DTYPES[dtype])
        if step % 7 == 3:
            x = special(n, block_size, DTYPES[dtype], step)
        q, s = quantize_with_residual(x.cuda(), residual, block_size)
        q_ref, s_ref = quantize_with_residual_ref(x, residual_ref, block_size)
        assert_same(_cpu(q), q_ref, f"q, round {step}")
        assert_same(_cpu(residual), residual_ref, f"residual, round {step}")
        dequantize_add(total, q, s, block_size)
        dequantize_add_ref(total_ref, q_ref, s_ref, block_size)
        assert_same(_cpu(total), total_ref, f"sum, round {step}")
        total.nan_to_num_(0.0)
        total_ref.nan_to_num_(0.0)


def test_kernels_run_on_the_current_stream():
    """Queued on a side stream behind a long matmul: read on that stream after it, the results are the
    reference's (a kernel launched on the default stream would have read x before the side stream wrote it)."""
    n, block_size = 4_000_037, 256
    x_cpu = special(n, block_size, torch.float32, "gpu-stream")
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    x = torch.zeros(n, device="cuda")
    residual = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(4):
            a = a @ a / 64.0  # keeps the side stream busy before the copy below
        x.copy_(x_cpu.cuda(non_blocking=False))
        q, s = quantize_with_residual(x, residual, block_size)
    side.synchronize()
    q_ref, s_ref = quantize_with_residual_ref(x_cpu, torch.zeros(n), block_size)
    assert_same(_cpu(q), q_ref, "q")
    assert_same(_cpu(s), s_ref, "scales")
