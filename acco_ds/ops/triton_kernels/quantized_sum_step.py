"""The Triton kernels behind ``acco_ds.ops.quantized_sum_step``'s "triton" backend: the owner's sum of the W
quantized rows read straight into the gradient norm and into the AdamW step (CUDA; CPU tensors under the Triton
interpreter).

Both kernels hold ROWS quantization blocks of at most TILE elements per program (one block a row of a [ROWS, TILE]
tile, as :func:`.quantize.dequantize_sum_rows`) and compute each element's sum as that kernel stores it: the first
row of ``order``'s products ``q * scale``, then each next row's added (fp32, one rounding each), rounded to the sum's
dtype (dtype code S_DT: fp32, bf16 or fp16, :mod:`.bf16`'s rule); with HAS_TILDE, ``tilde`` (the sum's dtype) added in fp32
and rounded to that dtype again (the acco commit's ``grad += tilde``).

- ``quantized_sum_squares_rows``: ``partials[program] = sum of float64(s) ** 2`` over its elements (each square
  exact, summed in fp64; the caller adds the partials); HAS_TILDE_OUT stores ``s`` into ``tilde_out``.
- ``adamw_quantized_sum_rows``: :func:`.adamw_difference.adamw_difference_rows`'s step with the gradient ``s``:
  the AdamW operations in their order (fp32, IEEE division and square root), COMMIT's and the noop flag's rules;
  with DIFF the new parameter's difference to ``base`` quantized per block (the rows' blocks) into ``dq`` /
  ``dscale`` and ``out = base + q * scale`` (``base`` may be ``out``); without DIFF ``out`` = the new parameter,
  and ``base``, ``dq`` and ``dscale`` are not touched.

Launch with ``enable_fp_fusion=False`` (no FMA: every product and sum rounds separately, as the composition does).
"""

from __future__ import annotations

import triton
import triton.language as tl

from acco_ds.ops.triton_kernels.adamw_difference import adamw_tile, apply_difference
from acco_ds.ops.triton_kernels.bf16 import round_to
from acco_ds.ops.triton_kernels.quantize import _load_f32, _row_tile, _store_as, rows_sum_fp32


@triton.jit
def _rows_sum(
    q_ptr,
    scale_ptr,
    order_ptr,
    tilde_ptr,
    rows,
    idx,
    mask,
    n,
    nb,
    nrows,
    S_DT: tl.constexpr,
    HAS_TILDE: tl.constexpr,
):
    """The tile's sums ``s`` (module docstring) as fp32 values of the sum's dtype; 0 where no element is."""
    acc = rows_sum_fp32(q_ptr, scale_ptr, order_ptr, rows, idx, mask, n, nb, nrows)
    s = round_to(acc, S_DT)
    if HAS_TILDE:
        s = round_to(s + _load_f32(tilde_ptr, idx, mask, S_DT), S_DT)
    # a NaN or inf scale times a missing element's 0 is NaN: no element there, no value
    return tl.where(mask, s, 0.0)


@triton.jit
def quantized_sum_squares_rows(
    q_ptr,
    scales_ptr,
    order_ptr,
    tilde_ptr,
    tilde_out_ptr,
    partials_ptr,
    n,
    nb,
    block_size,
    nrows,
    TILE: tl.constexpr,
    ROWS: tl.constexpr,
    S_DT: tl.constexpr,
    HAS_TILDE: tl.constexpr,
    HAS_TILDE_OUT: tl.constexpr,
):
    """``partials[program]``: the fp64 sum of the squares of its blocks' sums (module docstring). ``q`` int8
    [rows, n], ``scales`` fp32 [rows, nb], ``order`` int64 [nrows]; ``tilde`` (HAS_TILDE) and ``tilde_out``
    (HAS_TILDE_OUT): n elements of the sum's dtype."""
    rows, idx, mask = _row_tile(n, block_size, TILE, ROWS)
    s = _rows_sum(q_ptr, scales_ptr, order_ptr, tilde_ptr, rows, idx, mask, n, nb, nrows, S_DT, HAS_TILDE)
    if HAS_TILDE_OUT:
        _store_as(tilde_out_ptr, idx, s, mask, S_DT)
    w = s.to(tl.float64)
    tl.store(partials_ptr + tl.program_id(0), tl.sum(tl.sum(w * w, axis=1), axis=0))


@triton.jit
def adamw_quantized_sum_rows(
    p_ptr,
    m_ptr,
    v_ptr,
    q_ptr,
    qscale_ptr,
    order_ptr,
    tilde_ptr,
    base_ptr,
    out_ptr,
    dq_ptr,
    dscale_ptr,
    hyper_ptr,
    gscale_ptr,
    noop_ptr,
    grad_scale,
    n,
    nb,
    block_size,
    nrows,
    QMAX: tl.constexpr,
    TILE: tl.constexpr,
    ROWS: tl.constexpr,
    S_DT: tl.constexpr,
    P_DT: tl.constexpr,
    COMMIT: tl.constexpr,
    HAS_GSCALE: tl.constexpr,
    HAS_NOOP: tl.constexpr,
    HAS_TILDE: tl.constexpr,
    DIFF: tl.constexpr,
):
    """See the module docstring. ``hyper_ptr``: the 8 fp32 AdamW scalars (acco_ds.ops.adamw_settings.KERNEL_FIELDS
    order); ``gscale_ptr`` (HAS_GSCALE): 1 fp32; ``noop_ptr`` (HAS_NOOP): 1 int32, nonzero = no step; ``q`` /
    ``qscale`` / ``order`` / ``tilde``: the rows as :func:`quantized_sum_squares_rows`'s; ``dq`` int8 [n] and
    ``dscale`` fp32 [nb] (DIFF): the quantized difference."""
    rows, idx, mask = _row_tile(n, block_size, TILE, ROWS)
    g = _rows_sum(q_ptr, qscale_ptr, order_ptr, tilde_ptr, rows, idx, mask, n, nb, nrows, S_DT, HAS_TILDE)
    p = adamw_tile(
        p_ptr, m_ptr, v_ptr, g, idx, mask, hyper_ptr, gscale_ptr, noop_ptr, grad_scale, COMMIT, HAS_GSCALE, HAS_NOOP
    )  # fmt: skip
    if DIFF:
        apply_difference(p, base_ptr, out_ptr, dq_ptr, dscale_ptr, rows, idx, mask, nb, QMAX, P_DT)
    else:
        _store_as(out_ptr, idx, p, mask, P_DT)
