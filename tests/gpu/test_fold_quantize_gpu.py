"""``acco_ds.ops.fold_quantize`` on a CUDA GPU: the Triton kernels (the default for CUDA tensors) against the torch
reference on the CPU, bit for bit (a NaN matching any NaN), after every call of a fused round end: each parameter's
gradient folded, then the leftover blocks listed. A 10M-element bf16 buffer (W = 2, bf16 gradients, fp32 residual),
mixed dtypes at 4 bits on three odd-sized chunks, blocks longer than a tile without a residual, fp16 buffers (with
fp16 and fp32 gradients and residuals); offsets that are
and are not 16-divisible, a parameter spanning a chunk end, one smaller than a block, an inf and a NaN; the host
never waits. Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from acco_ds.ops.fold_quantize import fold_quantize, quantize_listed_blocks
from acco_ds.ops.quantize import num_blocks
from tests.ops.test_fold_quantize_triton import (
    BF16,
    F16,
    F32,
    Q_UNSET,
    SCALE_UNSET,
    gradient,
    leftover_blocks,
    state,
)
from tests.ops.triton_interpreter import assert_same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (world, chunk, block size, buffer, gradient, residual dtype, bits, 16-divisible offsets only): 7 Triton
# compilations and more (a fold kernel per dtype combination and offset alignment, a listed kernel per dtype
# combination)
CASES = [
    (2, 5_000_016, 256, BF16, BF16, F32, 8, False),
    (3, 100_003, 64, F32, BF16, BF16, 4, True),
    (2, 40_000, 2048, BF16, F32, None, 8, True),
    (2, 100_003, 256, F16, F16, F32, 8, False),
    (1, 40_000, 64, F16, F32, F16, 4, True),
]


def big_layout(world: int, chunk: int, bs: int, aligned: bool) -> list:
    """[(offset, numel)]: large parameters and small ones, one spanning a chunk end, one smaller than a block, odd
    offsets (16-divisible ones only when ``aligned``); a padding at the end."""
    total = world * chunk
    sizes = [chunk // 2 + 16, 5, bs - 1, 3 * bs + 7, chunk // 2 + 1000, 1, bs * 4 + 11]
    if aligned:
        sizes = [-(-n // 16) * 16 for n in sizes]
    params, offset = [], 0
    for n in sizes:
        if offset + n >= total - 16:
            break
        params.append((offset, n))
        offset += n
    params.append((offset, total - 16 - offset))
    return params


def _lockstep(world, chunk, bs, bdt, gdt, rdt, bits, aligned, seed) -> None:
    """The fused round on the GPU (triton) and on the CPU (ref), compared after every call."""
    params = big_layout(world, chunk, bs, aligned)
    nb = num_blocks(chunk, bs)
    skipped = {1}  # a parameter that got no gradient: its blocks listed
    buf, res = state(world, chunk, bdt, rdt, seed)
    dev = {"buf": buf.cuda(), "res": None if res is None else res.cuda()}
    q, scales = (
        torch.full((world * chunk,), Q_UNSET, dtype=torch.int8),
        torch.full((world * nb,), SCALE_UNSET),
    )
    dq, dscales = q.cuda(), scales.cuda()

    def compare(what):
        pairs = [(dq, q, "q"), (dscales, scales, "scales"), (dev["buf"], buf, "buffer")]
        if res is not None:
            pairs.append((dev["res"], res, "residual"))
        for a, b, name in pairs:
            assert_same_bits(a, b, (name, what, world, chunk, bs, bdt, gdt, rdt, bits))

    order = [i for i in (4, 0, 6, 2, 3, 5, 7) if i < len(params) and i not in skipped]
    for i in order:
        offset, n = params[i]
        special = (n // 2, float("inf")) if i == 0 else (n - 1, float("nan")) if i == 3 else None
        g = gradient(offset, n, gdt, seed, special=special)
        fold_quantize(buf, g, offset, chunk, res, q, scales, bs, bits, backend="ref")
        fold_quantize(
            dev["buf"], g.cuda(), offset, chunk, dev["res"], dq, dscales, bs, bits
        )  # the default: triton
        compare(("fold", i, offset, n))
    leftover = torch.tensor(leftover_blocks(world, chunk, bs, [params[i] for i in order]), dtype=torch.int64)
    quantize_listed_blocks(buf, chunk, res, q, scales, bs, leftover, bits, backend="ref")
    quantize_listed_blocks(
        dev["buf"], chunk, dev["res"], dq, dscales, bs, leftover.cuda(), bits, backend="triton"
    )
    compare("listed")
    assert (q != Q_UNSET).all() and (scales != SCALE_UNSET).all()
    assert scales.isnan().sum() >= 2  # the inf's block (fused) and the NaN's (accumulated, then listed)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"W{c[0]}_chunk{c[1]}_bs{c[2]}")
def test_triton_is_the_reference_on_the_gpu(case):
    _lockstep(*case, seed=case[1])


def test_no_host_sync():
    world, chunk, bs = 2, 1_000_016, 256
    nb = num_blocks(chunk, bs)
    buf = torch.randn(world * chunk, device="cuda").to(BF16)
    res = torch.zeros(world * chunk, device="cuda")
    q = torch.empty(world * chunk, dtype=torch.int8, device="cuda")
    scales = torch.empty(world * nb, device="cuda")
    grads = [torch.randn(n, device="cuda").to(BF16) for n in (700_000, 1_000_003)]
    blocks = torch.arange(0, world * nb, 7, device="cuda")
    fold_quantize(buf, grads[0], 0, chunk, res, q, scales, bs)  # compiled before the check
    quantize_listed_blocks(buf, chunk, res, q, scales, bs, blocks)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fold_quantize(buf, grads[0], 16, chunk, res, q, scales, bs)
        fold_quantize(buf, grads[1], 700_016, chunk, res, q, scales, bs)
        quantize_listed_blocks(buf, chunk, res, q, scales, bs, blocks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
