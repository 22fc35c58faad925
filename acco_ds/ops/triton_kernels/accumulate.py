"""The Triton accumulate / cast-copy kernel behind ``acco_ds.ops.accumulate``'s "triton" backend.

``accumulate_chunks`` computes, for every row of a chunk table, ``buf[off + i] = cast(float(buf[off + i]) +
float(grad[i]) * scale)`` (ACC) or ``cast(float(grad[i]) * scale)`` over one chunk of one gradient, the gradient
at ``grad_ptr + delta`` (``delta``: the row's element distance from the launch's first gradient, so the table
holds no address and one table serves every call with the same layout): the fp32 product rounded, then the sum
rounded (launch it with ``enable_fp_fusion=False``: no FMA, the bits of the ``*_ref`` functions), cast with
:mod:`.bf16`'s rule (bf16 or fp16). The table, the launch plan and the launch itself are
``acco_ds.ops.accumulate``'s (``_chunk_table``, ``launch_plan``, ``_triton_launch``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from acco_ds.ops.triton_kernels.bf16 import from_f32, to_f32


@triton.jit
def accumulate_chunks(
    meta_ptr,
    grad_ptr,
    buf_ptr,
    scale,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    G_DT: tl.constexpr,
    B_DT: tl.constexpr,
    ACC: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """One program = one row of the int64 chunk table ``meta_ptr``: (gradient element offset from ``grad_ptr``,
    offset in the buffer, chunk start, grad numel). ``grad_ptr``: the launch's first gradient (of dtype code
    G_DT: 0 fp32, 1 bf16, 2 fp16); CHUNK: elements per row, a multiple of 1024; BLOCK: elements per loop step;
    B_DT: the buffer's dtype code; ACC: add into the buffer (else overwrite it); ALIGNED: every
    gradient address of the table and the buffer are 16-byte aligned and every offset a multiple of 8 (the
    vectorised path)."""
    row = meta_ptr + tl.program_id(0).to(tl.int64) * 4
    gdelta = tl.load(row)
    boff = tl.load(row + 1)
    start = tl.load(row + 2)
    n = tl.load(row + 3)
    gp = grad_ptr + gdelta
    if ALIGNED:  # every address 16-byte aligned, every offset a multiple of 8: vector loads/stores
        gp = tl.multiple_of(gp, 16)
        boff = tl.multiple_of(boff, 8)
    start = tl.multiple_of(start, 1024)  # chunk starts are multiples of CHUNK (a multiple of 1024)
    bp = buf_ptr + boff
    # Pass 0 runs for a full chunk without masks (so loads/stores can be vectorised: a mask against a runtime n
    # defeats that), pass 1 for the last, partial chunk of a tensor, masked.
    for tail in tl.static_range(2):
        if tail == 0:
            run = start + CHUNK <= n
        else:
            run = start + CHUNK > n
        if run:
            for k in tl.static_range(0, CHUNK, BLOCK):
                idx = start + k + tl.arange(0, BLOCK)
                if tail == 0:
                    mask = None
                else:
                    mask = idx < n
                g = to_f32(tl.load(gp + idx, mask=mask), G_DT)
                if ACC:
                    y = to_f32(tl.load(bp + idx, mask=mask), B_DT) + g * scale
                else:
                    y = g * scale
                tl.store(bp + idx, from_f32(y, B_DT), mask=mask)
