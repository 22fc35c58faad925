"""The Triton kernels behind ``acco_ds.ops.fold_quantize``'s "triton" backend: one parameter's last gradient folded
into the round's buffer with the blocks it covers whole quantized in the same pass, and the leftover blocks
quantized from the buffer (the module docstring of ``acco_ds.ops.fold_quantize`` is the contract).

The blocks are cut inside each chunk of ``chunk`` elements: global block ``b`` is block ``j = b % nb`` of chunk
``c = b // nb``, the elements ``[c * chunk + j * block_size, c * chunk + min((j + 1) * block_size, chunk))``; its
scale is ``scales[b]``, its q at its own elements of ``q``. The blocks a gradient at ``[offset, end)`` touches are
the global blocks ``first .. last`` (those of ``offset`` and ``end - 1``: no chunk end cuts a block, so the blocks
of the chunks between are all of them); only ``first`` and ``last`` can be partly covered.

- A block the range covers whole: ``v = float(cast_buffer(float(buffer) + float(grad)))`` (+ ``float(residual)``,
  one fp32 sum), quantized with :mod:`.quantize`'s rules (its jit helpers: the scale, q, NaN for a non-finite
  block), the residual rewritten as ``v - q * scale`` in its dtype (0 in a non-finite block); the buffer is not
  written.
- A block it covers in part: ``buffer = cast_buffer(float(buffer) + float(grad))`` at the covered elements only
  (``accumulate_grads``' rule; the cast to bf16 or fp16 is :mod:`.bf16`'s, nearest even); nothing else is written.
- A listed block (FOLD false): ``v = float(buffer)`` (+ the residual), quantized as above.

Two kernels, the same arithmetic: ``fold_quantize_rows`` for blocks of at most 1024 elements (ROWS blocks per
program, one a row of a [ROWS, TILE] tile, each value loaded once; the partly covered blocks' accumulation only in
the launch's first and last programs) and ``fold_quantize_blocks`` for longer ones (one block per program, walked
in TILE-element tiles twice: the absmax and finiteness first, then the values, as :func:`.quantize.quantize_blocks`).

Launch with ``enable_fp_fusion=False`` (no FMA: ``v - q * scale`` rounds twice, as the reference) on the current
CUDA stream; the launchers read nothing back from the device. Triton specializes the gradient's ``offset`` (16-
divisible, 1, or neither: the 16-divisible one reads the gradient 16 bytes wide), not the range's end nor its first
and last blocks, which change with every parameter: a few compilations per dtype combination, not one per parameter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from acco_ds.ops._dtypes import DTYPE_CODE
from acco_ds.ops.quantize import _rows, _tile
from acco_ds.ops.triton_kernels.bf16 import round_to
from acco_ds.ops.triton_kernels.quantize import (
    _block_scale,
    _load_f32,
    _nonfinite,
    _quantize_tile,
    _quantize_values,
    _store_as,
    _store_tile_residual,
)


@triton.jit
def _values(
    buf_ptr,
    grad_ptr,
    res_ptr,
    idx,
    mask,
    offset,
    FOLD: tl.constexpr,
    B_DT: tl.constexpr,
    G_DT: tl.constexpr,
    HAS_RES: tl.constexpr,
    RES_DT: tl.constexpr,
):
    """fp32 ``v`` of the elements ``idx`` (0 where not ``mask``): the buffer (with FOLD + the gradient at ``idx -
    offset``, the sum rounded to the buffer's dtype), + the residual when HAS_RES."""
    v = _load_f32(buf_ptr, idx, mask, B_DT)
    if FOLD:
        # the buffer's value after accumulate_grads, as fp32
        v = round_to(v + _load_f32(grad_ptr, idx - offset, mask, G_DT), B_DT)
    if HAS_RES:
        v = v + _load_f32(res_ptr, idx, mask, RES_DT)
    return v


@triton.jit
def _accumulate(buf_ptr, grad_ptr, idx, mask, offset, B_DT: tl.constexpr, G_DT: tl.constexpr):
    """``buffer = cast(float(buffer) + float(grad))`` at ``idx`` where ``mask`` (the gradient at ``idx - offset``)."""
    s = _load_f32(buf_ptr, idx, mask, B_DT) + _load_f32(grad_ptr, idx - offset, mask, G_DT)
    _store_as(buf_ptr, idx, s, mask, B_DT)


@triton.jit(do_not_specialize=["end", "first", "last"])
def fold_quantize_rows(
    buf_ptr,
    grad_ptr,
    res_ptr,
    q_ptr,
    scale_ptr,
    blocks_ptr,
    offset,
    end,
    first,
    last,
    chunk,
    nb,
    block_size,
    QMAX: tl.constexpr,
    TILE: tl.constexpr,
    ROWS: tl.constexpr,
    FOLD: tl.constexpr,
    B_DT: tl.constexpr,
    G_DT: tl.constexpr,
    HAS_RES: tl.constexpr,
    RES_DT: tl.constexpr,
):
    """Blocks of at most TILE elements, ROWS a program (one a row of the tile). FOLD: the global blocks ``first ..
    last`` of the gradient at ``grad_ptr`` landing at ``[offset, end)`` (the whole ones quantized from buffer +
    gradient, the others accumulated); else the blocks ``blocks_ptr[first .. last]`` quantized from the buffer
    (``grad_ptr``, ``offset`` and ``end`` unused)."""
    pid = tl.program_id(0)
    k = first + pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = k <= last
    if FOLD:
        b = k
    else:
        b = tl.load(blocks_ptr + k, mask=live, other=0)
    c = b // nb
    cstart = c * chunk
    start = cstart + (b - c * nb) * block_size
    lanes = tl.arange(0, TILE)
    idx = start[:, None] + lanes[None, :]
    inblk = (lanes[None, :] < block_size) & (idx < (cstart + chunk)[:, None]) & live[:, None]
    if FOLD:
        whole = live & (start >= offset) & (tl.minimum(start + block_size, cstart + chunk) <= end)
    else:
        whole = live
    mask = inblk & whole[:, None]
    v = _values(buf_ptr, grad_ptr, res_ptr, idx, mask, offset, FOLD, B_DT, G_DT, HAS_RES, RES_DT)
    q, scale, _, finite = _quantize_tile(v, b, idx, mask, q_ptr, scale_ptr, whole, QMAX)
    if HAS_RES:
        _store_tile_residual(res_ptr, idx, v, q, scale, finite, mask, RES_DT)
    if FOLD:  # noqa: SIM102 (a compile-time branch around a runtime one)
        if (pid == 0) | (pid == tl.num_programs(0) - 1):  # only the range's end blocks can be partly covered
            part = inblk & (~whole)[:, None] & (idx >= offset) & (idx < end)
            _accumulate(buf_ptr, grad_ptr, idx, part, offset, B_DT, G_DT)


@triton.jit
def _quantize_block(
    buf_ptr,
    grad_ptr,
    res_ptr,
    q_ptr,
    scale_ptr,
    b,
    start,
    stop,
    offset,
    QMAX: tl.constexpr,
    TILE: tl.constexpr,
    FOLD: tl.constexpr,
    B_DT: tl.constexpr,
    G_DT: tl.constexpr,
    HAS_RES: tl.constexpr,
    RES_DT: tl.constexpr,
):
    """Quantizes the block ``b`` (elements ``[start, stop)``) tile by tile: the absmax and finiteness, then q, the
    residual and the scale."""
    lanes = tl.arange(0, TILE)
    amax = tl.zeros([TILE], dtype=tl.float32)
    bad = tl.zeros([TILE], dtype=tl.int32)
    for k in range(start, stop, TILE):
        idx = k + lanes
        mask = idx < stop
        v = _values(buf_ptr, grad_ptr, res_ptr, idx, mask, offset, FOLD, B_DT, G_DT, HAS_RES, RES_DT)
        nonfinite = _nonfinite(v)
        bad = tl.maximum(bad, nonfinite)
        amax = tl.maximum(amax, tl.where(nonfinite == 1, 0.0, tl.abs(v)))
    finite = tl.max(bad, axis=0) == 0
    scale, usable, div, stored = _block_scale(tl.max(amax, axis=0), finite, QMAX)
    tl.store(scale_ptr + b, stored)
    for k in range(start, stop, TILE):
        idx = k + lanes
        mask = idx < stop
        v = _values(buf_ptr, grad_ptr, res_ptr, idx, mask, offset, FOLD, B_DT, G_DT, HAS_RES, RES_DT)
        q = _quantize_values(v, div, usable, QMAX)
        tl.store(q_ptr + idx, q, mask=mask)
        if HAS_RES:
            lost = v - q.to(tl.float32) * scale
            _store_as(res_ptr, idx, tl.where(finite, lost, 0.0), mask, RES_DT)


@triton.jit(do_not_specialize=["end", "first"])
def fold_quantize_blocks(
    buf_ptr,
    grad_ptr,
    res_ptr,
    q_ptr,
    scale_ptr,
    blocks_ptr,
    offset,
    end,
    first,
    chunk,
    nb,
    block_size,
    QMAX: tl.constexpr,
    TILE: tl.constexpr,
    FOLD: tl.constexpr,
    B_DT: tl.constexpr,
    G_DT: tl.constexpr,
    HAS_RES: tl.constexpr,
    RES_DT: tl.constexpr,
):
    """One block a program, any block size (walked in TILE-element tiles). FOLD: global block ``first +
    program``, quantized from buffer + gradient when ``[offset, end)`` covers it whole, else accumulated at the
    covered elements; else the block ``blocks_ptr[first + program]``, quantized from the buffer."""
    k = first + tl.program_id(0).to(tl.int64)
    if FOLD:
        b = k
    else:
        b = tl.load(blocks_ptr + k)
    c = b // nb
    cstart = c * chunk
    start = cstart + (b - c * nb) * block_size
    stop = tl.minimum(start + block_size, cstart + chunk)
    # a listed block (FOLD false) comes with offset 0 and end the buffer's length: always whole
    if (start >= offset) & (stop <= end):
        _quantize_block(
            buf_ptr, grad_ptr, res_ptr, q_ptr, scale_ptr, b, start, stop, offset,
            QMAX, TILE, FOLD, B_DT, G_DT, HAS_RES, RES_DT,
        )  # fmt: skip
    elif FOLD:
        lo = tl.maximum(start, offset)
        hi = tl.minimum(stop, end)
        for i in range(lo, hi, TILE):
            idx = i + tl.arange(0, TILE)
            _accumulate(buf_ptr, grad_ptr, idx, idx < hi, offset, B_DT, G_DT)


# -- launchers -------------------------------------------------------------------------------------------------
def _block_of(i: int, chunk: int, nb: int, block_size: int) -> int:
    """The global block index of buffer element ``i``."""
    c, r = divmod(i, chunk)
    return c * nb + r // block_size


def _launch(buffer, grad, residual, q, scales, blocks, offset, end, first, last, chunk, nb, block_size, qmax):
    fold = grad is not None
    flags = dict(
        QMAX=qmax,
        TILE=_tile(block_size),
        FOLD=fold,
        B_DT=DTYPE_CODE[buffer.dtype],
        G_DT=DTYPE_CODE[grad.dtype] if fold else DTYPE_CODE[buffer.dtype],
        HAS_RES=residual is not None,
        RES_DT=DTYPE_CODE[buffer.dtype if residual is None else residual.dtype],
        enable_fp_fusion=False,  # v - q * scale rounded twice, as the reference (no FMA): the same bits
    )
    ptrs = (
        buffer,
        grad.reshape(-1) if fold else buffer,  # the unused operands: any tensor of the launch
        buffer if residual is None else residual,
        q,
        scales,
        scales if blocks is None else blocks,
    )
    count = last - first + 1
    rows = _rows(block_size)
    if rows:
        fold_quantize_rows[(-(-count // rows),)](
            *ptrs, offset, end, first, last, chunk, nb, block_size, ROWS=rows, **flags
        )
    else:
        fold_quantize_blocks[(count,)](*ptrs, offset, end, first, chunk, nb, block_size, **flags)


def launch_fold_quantize(buffer, grad, offset, chunk, nb, residual, q, scales, block_size, qmax) -> None:
    """Queues the fold of ``grad`` (any contiguous shape, used flat) at ``[offset, offset + grad.numel())`` of the
    flat ``buffer`` on the current CUDA stream (see the module docstring); ``residual`` or None; qmax 127 or 7."""
    n = grad.numel()
    if n == 0:
        return
    end = offset + n
    first, last = _block_of(offset, chunk, nb, block_size), _block_of(end - 1, chunk, nb, block_size)
    _launch(buffer, grad, residual, q, scales, None, offset, end, first, last, chunk, nb, block_size, qmax)


def launch_quantize_listed_blocks(buffer, chunk, nb, residual, q, scales, block_size, qmax, blocks) -> None:
    """Queues the quantization of the listed global blocks (``blocks``: int64 on the buffer's device) from the
    buffer and ``residual`` (or None) on the current CUDA stream."""
    count = blocks.numel()
    if count == 0:
        return
    _launch(
        buffer,
        None,
        residual,
        q,
        scales,
        blocks,
        0,
        buffer.numel(),
        0,
        count - 1,
        chunk,
        nb,
        block_size,
        qmax,
    )
