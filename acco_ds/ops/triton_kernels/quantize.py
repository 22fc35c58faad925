"""The Triton blockwise quantize / dequantize kernels behind ``acco_ds.ops.quantize``'s "triton" backend.

Blocks of at most 1024 elements (the default is 256): ``quantize_rows`` / ``dequantize_rows``, several blocks per
program, one a row of a [ROWS, TILE] tile, each value loaded once. Longer blocks: ``quantize_blocks`` /
``dequantize_blocks``, one program per quantization block (``block_size`` consecutive elements, the last block
short), in tiles of ``TILE`` elements (a power of two), walked tile by tile twice: the block's absmax and finiteness
first, then its values. The rules are ``acco_ds.ops.quantize``'s (docs/ALGORITHM.md, "Compressed
rounds"), bit for bit:

- ``scale = absmax / qmax`` divided in fp64, rounded to the nearest fp32 and moved one fp32 step up where that went
  below the fp64 quotient; NaN for a block holding an inf or a NaN;
- ``q = clamp(rne(v / scale), -qmax, qmax)``: an IEEE fp32 division (``div_rn``, not the fast approximate one),
  rounded half to even by adding and subtracting 1.5 * 2**23 (exact for |v / scale| <= 2**22, and the quotient is at
  most qmax here); 0 where the scale is 0 or NaN;
- dequantized ``q * scale`` (one fp32 product), added into fp32 ``out`` with one more rounding; the owner's sum
  of every rank's chunk (``dequantize_sum_rows``) does that row after row in registers and stores the total once;
- error feedback: ``v = x + residual`` (one fp32 sum), the residual rewritten as ``v - q * scale`` (each operation
  rounded to fp32), cast to its dtype with :mod:`.bf16`'s rule (bf16 or fp16), zeroed in a non-finite block.

Dtypes are constexpr codes (``*_DT``: 0 fp32, 1 bf16, 2 fp16; acco_ds.ops._dtypes.DTYPE_CODE).

Launch with ``enable_fp_fusion=False`` (no FMA: the product and the sum round separately, as the reference does).
"""

from __future__ import annotations

import triton
import triton.language as tl

from acco_ds.ops.triton_kernels.bf16 import from_f32, to_f32

_RNE_SHIFT = tl.constexpr(
    12582912.0
)  # 1.5 * 2**23: x + this - this rounds x to an integer, ties to even (fp32)


@triton.jit
def _load_f32(ptr, idx, mask, DT: tl.constexpr):
    """fp32 values of a tensor of dtype code DT (0 where masked off)."""
    return to_f32(tl.load(ptr + idx, mask=mask, other=0), DT)


@triton.jit
def _load_v(
    x_ptr,
    res_ptr,
    idx,
    mask,
    X_DT: tl.constexpr,
    HAS_RES: tl.constexpr,
    RES_DT: tl.constexpr,
    SUB: tl.constexpr = False,
):
    """fp32 ``v = x`` (+ the residual when HAS_RES, one fp32 sum; - the base at res_ptr when SUB, one fp32
    difference): what a block quantizes."""
    v = _load_f32(x_ptr, idx, mask, X_DT)
    if HAS_RES:
        v = v + _load_f32(res_ptr, idx, mask, RES_DT)
    if SUB:
        v = v - _load_f32(res_ptr, idx, mask, RES_DT)
    return v


@triton.jit
def _store_as(ptr, idx, v, mask, DT: tl.constexpr):
    """Stores the fp32 ``v`` into a tensor of dtype code DT (rounded to nearest even) where ``mask``."""
    tl.store(ptr + idx, from_f32(v, DT), mask=mask)


@triton.jit
def _nonfinite(v):
    """1 where the fp32 ``v`` is an inf or a NaN (exponent bits all ones), else 0 (int32)."""
    return ((v.to(tl.uint32, bitcast=True) & 0x7F800000) == 0x7F800000).to(tl.int32)


@triton.jit
def _block_scale(absmax, finite, QMAX: tl.constexpr):
    """(scale, usable, divisor, stored) of blocks with these absmax (finite part) and finiteness: ``absmax / QMAX``
    divided in fp64, rounded to the nearest fp32 and moved one fp32 step up where that went below the quotient;
    usable where the scale is > 0 and the block finite; the divisor 1 elsewhere; stored: the scale, or torch's NaN
    for a non-finite block."""
    wide = absmax.to(tl.float64) / QMAX
    scale = wide.to(tl.float32)
    up = (scale.to(tl.uint32, bitcast=True) + 1).to(
        tl.float32, bitcast=True
    )  # next fp32 above a positive scale
    scale = tl.where(scale.to(tl.float64) < wide, up, scale)
    usable = (scale > 0) & finite
    div = tl.where(usable, scale, 1.0)
    nan = tl.full(scale.shape, 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)  # torch's NaN bits
    return scale, usable, div, tl.where(finite, scale, nan)


@triton.jit
def _quantize_values(v, div, usable, QMAX: tl.constexpr):
    """int8 ``q = clamp(rne(v / div), -QMAX, QMAX)`` where usable, else 0 (fp32 ``v``, IEEE division).

    A zero ``v`` is divided as a 1 and its quotient dropped (its q is 0 either way): the GPU's IEEE division leaves
    its fast path for a zero numerator, and a parameter difference is mostly zeros (bf16 weights that did not
    move by half an ulp)."""
    zero = v == 0.0
    t = tl.math.div_rn(tl.where(zero, 1.0, v), div)
    t = tl.minimum(tl.maximum(t, -QMAX), QMAX)  # a no-op (the scale is rounded up); rne and clamp commute
    t = (t + _RNE_SHIFT) - _RNE_SHIFT
    return tl.where(usable, tl.where(zero, 0.0, t), 0.0).to(tl.int8)


@triton.jit
def _row_tile(n, block_size, TILE: tl.constexpr, ROWS: tl.constexpr):
    """This program's [ROWS, TILE] tile of the row kernels: (the blocks it holds, one a row; every element's index;
    which elements exist: inside its block and below n)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    lanes = tl.arange(0, TILE)
    idx = rows[:, None] * block_size + lanes[None, :]
    return rows, idx, (lanes[None, :] < block_size) & (idx < n)


@triton.jit
def _quantize_tile(v, rows, idx, mask, q_ptr, scale_ptr, row_mask, QMAX: tl.constexpr):
    """Quantizes a row tile's fp32 values ``v`` (one block a row, ``rows`` the blocks' indices), stores q where
    ``mask`` and each row's scale (NaN for a non-finite block) where ``row_mask``, returns (q, each row's scale, each
    row's scale as stored, whether each row is finite)."""
    bad = _nonfinite(v)
    absmax = tl.max(tl.where(bad == 1, 0.0, tl.abs(v)), axis=1)
    finite = tl.max(bad, axis=1) == 0
    scale, usable, div, stored = _block_scale(absmax, finite, QMAX)
    tl.store(scale_ptr + rows, stored, mask=row_mask)
    q = _quantize_values(v, div[:, None], usable[:, None], QMAX)
    tl.store(q_ptr + idx, q, mask=mask)
    return q, scale, stored, finite


@triton.jit
def _store_tile_residual(res_ptr, idx, v, q, scale, finite, mask, RES_DT: tl.constexpr):
    """Error feedback of a row tile :func:`_quantize_tile` quantized: ``v - q * scale`` (from the int8 value, as the
    reference: no -0.0 from q), 0 in a non-finite row, stored in the residual's dtype where ``mask``."""
    lost = v - q.to(tl.float32) * scale[:, None]
    _store_as(res_ptr, idx, tl.where(finite[:, None], lost, 0.0), mask, RES_DT)


@triton.jit
def quantize_rows(
    x_ptr,
    res_ptr,
    q_ptr,
    scale_ptr,
    n,
    nb,
    block_size,
    QMAX: tl.constexpr,
    TILE: tl.constexpr,
    ROWS: tl.constexpr,
    X_DT: tl.constexpr,
    HAS_RES: tl.constexpr,
    RES_DT: tl.constexpr,
    SUB: tl.constexpr = False,
):
    """:func:`quantize_blocks` for blocks of at most TILE elements, ROWS blocks per program (a [ROWS, TILE] tile,
    one block a row): each value is loaded once and kept in registers between the block's absmax and its
    quantization, and a program moves ROWS * TILE elements in wide loads instead of one block's few."""
    rows, idx, mask = _row_tile(n, block_size, TILE, ROWS)
    v = _load_v(x_ptr, res_ptr, idx, mask, X_DT, HAS_RES, RES_DT, SUB)
    q, scale, _, finite = _quantize_tile(v, rows, idx, mask, q_ptr, scale_ptr, rows < nb, QMAX)
    if HAS_RES:
        _store_tile_residual(res_ptr, idx, v, q, scale, finite, mask, RES_DT)


@triton.jit
def dequantize_rows(
    q_ptr,
    scale_ptr,
    base_ptr,
    out_ptr,
    n,
    nb,
    block_size,
    TILE: tl.constexpr,
    ROWS: tl.constexpr,
    ADD: tl.constexpr,
    DT: tl.constexpr,
):
    """:func:`dequantize_blocks` for blocks of at most TILE elements, ROWS blocks per program (one a row): ``out =
    q * scale``, or with ADD ``out = base + q * scale`` (fp32: the product, then the sum, one rounding each), out and
    base in fp32, or both of dtype code DT (bf16 or fp16: the parameter path; ``base`` may be ``out``: dequantize_add)."""
    rows, idx, mask = _row_tile(n, block_size, TILE, ROWS)
    scale = tl.load(scale_ptr + rows, mask=rows < nb, other=0.0)
    d = tl.load(q_ptr + idx, mask=mask, other=0).to(tl.float32) * scale[:, None]
    if ADD:
        d = _load_f32(base_ptr, idx, mask, DT) + d
    _store_as(out_ptr, idx, d, mask, DT)


@triton.jit
def dequantize_sum_rows(
    q_ptr,
    scale_ptr,
    order_ptr,
    out_ptr,
    n,
    nb,
    block_size,
    num_rows,
    TILE: tl.constexpr,
    ROWS: tl.constexpr,
    OUT_DT: tl.constexpr,
):
    """``out = sum over k of q[order[k]] * scale[order[k]]`` (fp32: the first row's products, then each next row's
    added, one rounding each), stored in out's dtype: ``q`` int8 [rows, n], ``scale`` fp32 [rows, nb], blocks of at
    most TILE elements, ROWS blocks per program (one a row of the tile), each quantized value loaded once."""
    rows, idx, mask = _row_tile(n, block_size, TILE, ROWS)
    acc = rows_sum_fp32(q_ptr, scale_ptr, order_ptr, rows, idx, mask, n, nb, num_rows)
    _store_as(out_ptr, idx, acc, mask, OUT_DT)


@triton.jit
def rows_sum_fp32(q_ptr, scale_ptr, order_ptr, rows, idx, mask, n, nb, num_rows):
    """The tile's ``sum over k of q[order[k]] * scale[order[k]]`` in fp32 (the first row's products, then each next
    row's added, one rounding each; launch without FP fusion): ``q`` int8 [rows, n], ``scale`` fp32 [rows, nb]."""
    live = rows < nb
    r = tl.load(order_ptr)
    acc = (
        tl.load(q_ptr + r * n + idx, mask=mask, other=0).to(tl.float32)
        * tl.load(scale_ptr + r * nb + rows, mask=live, other=0.0)[:, None]
    )
    for k in range(1, num_rows):
        r = tl.load(order_ptr + k)
        scale = tl.load(scale_ptr + r * nb + rows, mask=live, other=0.0)
        acc = acc + tl.load(q_ptr + r * n + idx, mask=mask, other=0).to(tl.float32) * scale[:, None]
    return acc


@triton.jit
def quantize_blocks(
    x_ptr,
    res_ptr,
    q_ptr,
    scale_ptr,
    n,
    block_size,
    QMAX: tl.constexpr,
    TILE: tl.constexpr,
    X_DT: tl.constexpr,
    HAS_RES: tl.constexpr,
    RES_DT: tl.constexpr,
    SUB: tl.constexpr = False,
):
    """Program b quantizes block b of ``x`` (dtype code X_DT; n elements): ``v = x`` (+ ``residual`` at
    ``res_ptr`` when HAS_RES, dtype code RES_DT), writes int8 ``q`` and fp32 ``scale[b]``, and with HAS_RES
    rewrites the residual as what quantization lost (zero in a non-finite block). QMAX: 127 (8 bits) or 7 (4)."""
    b = tl.program_id(0).to(tl.int64)
    start = b * block_size
    end = tl.minimum(start + block_size, n)
    lanes = tl.arange(0, TILE)
    amax = tl.zeros([TILE], dtype=tl.float32)
    bad = tl.zeros([TILE], dtype=tl.int32)
    for k in range(start, end, TILE):
        idx = k + lanes
        mask = idx < end
        v = _load_v(x_ptr, res_ptr, idx, mask, X_DT, HAS_RES, RES_DT, SUB)
        bad = tl.maximum(bad, _nonfinite(v))
        amax = tl.maximum(amax, tl.where(_nonfinite(v) == 1, 0.0, tl.abs(v)))
    absmax = tl.max(amax, axis=0)
    finite = tl.max(bad, axis=0) == 0
    scale, usable, div, stored = _block_scale(absmax, finite, QMAX)
    tl.store(scale_ptr + b, stored)
    for k in range(start, end, TILE):
        idx = k + lanes
        mask = idx < end
        v = _load_v(x_ptr, res_ptr, idx, mask, X_DT, HAS_RES, RES_DT, SUB)
        q = _quantize_values(v, div, usable, QMAX)
        tl.store(q_ptr + idx, q, mask=mask)
        if HAS_RES:
            lost = v - q.to(tl.float32) * scale  # from the int8 value, as the reference (no -0.0 from q)
            _store_as(res_ptr, idx, tl.where(finite, lost, 0.0), mask, RES_DT)


@triton.jit
def dequantize_blocks(q_ptr, scale_ptr, out_ptr, n, block_size, TILE: tl.constexpr, ADD: tl.constexpr):
    """Program b writes ``q * scale[b]`` (fp32) into block b of ``out`` (fp32), or adds it there when ADD."""
    b = tl.program_id(0).to(tl.int64)
    start = b * block_size
    end = tl.minimum(start + block_size, n)
    scale = tl.load(scale_ptr + b)
    lanes = tl.arange(0, TILE)
    for k in range(start, end, TILE):
        idx = k + lanes
        mask = idx < end
        d = tl.load(q_ptr + idx, mask=mask, other=0).to(tl.float32) * scale
        if ADD:
            d = tl.load(out_ptr + idx, mask=mask, other=0.0) + d
        tl.store(out_ptr + idx, d, mask=mask)
