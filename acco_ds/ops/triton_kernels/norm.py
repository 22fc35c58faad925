"""The Triton sum-of-squares kernel behind ``acco_ds.ops.norm``'s "triton" backend.

``sum_of_squares_partials`` writes one fp64 partial sum per program: program ``p`` takes the ``PER_PROGRAM``
elements from ``p * PER_PROGRAM`` (the last program fewer), walks them in tiles of ``TILE``, squares each value in
fp64 (exact: the square of an fp32, bf16 or fp16 value fits in fp64) and accumulates lane by lane in fp64, then sums its
lanes. The caller adds the partials (``acco_ds.ops.norm``): two launches whatever the length, x read once (2 or 4
bytes per element), no temporary of x's size, the same bits from run to run (a fixed summation order, no atomics).
"""

from __future__ import annotations

import triton
import triton.language as tl

from acco_ds.ops.triton_kernels.bf16 import to_f32


@triton.jit
def sum_of_squares_partials(
    x_ptr,
    out_ptr,
    n,
    PER_PROGRAM: tl.constexpr,
    TILE: tl.constexpr,
    X_DT: tl.constexpr,
):
    """``out[p] = sum of x[i]**2`` (fp64) over program p's ``PER_PROGRAM`` elements (a multiple of TILE); x has the dtype
    code X_DT (0 fp32, 1 bf16, 2 fp16); n: x's length."""
    start = tl.program_id(0).to(tl.int64) * PER_PROGRAM
    lanes = tl.arange(0, TILE)
    acc = tl.zeros([TILE], dtype=tl.float64)
    for k in range(0, PER_PROGRAM, TILE):
        idx = start + k + lanes
        w = to_f32(tl.load(x_ptr + idx, mask=idx < n, other=0), X_DT).to(tl.float64)
        acc += w * w
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))
