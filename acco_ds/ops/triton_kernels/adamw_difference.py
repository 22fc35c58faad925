"""The Triton AdamW step fused with the quantized parameter difference: ``acco_ds.ops.adamw_difference``'s
"triton" backend (CUDA; CPU tensors under the Triton interpreter).

``adamw_difference_rows``: ROWS quantization blocks of at most TILE elements per program (one block a row of a
[ROWS, TILE] tile, as ``quantize_rows``). Per element, the CUDA/CPU AdamW's operations in their order
(csrc/adamw/adamw_math.h's ``adamw_update``, fp32, IEEE division and square root, no FMA: launch with
``enable_fp_fusion=False``), the scaled gradient ``float(g) * s`` with ``s = grad_scale * scale_tensor[0]``; the
new parameter cast to the parameter dtype (:mod:`.bf16`'s rule; dtype codes G_DT, P_DT: 0 fp32, 1 bf16, 2 fp16); its fp32 difference to ``base`` quantized per
block (:mod:`.quantize`'s rules: scale rounded up, IEEE quotient rounded half to even, NaN scale and zero q in a
non-finite block); ``out = base + q * scale`` stored in the parameter dtype. COMMIT writes master, exp_avg and
exp_avg_sq unless the device's noop flag is set (then the new parameter is the master, cast). ``base`` may be
``out`` (each element's base is loaded before its output is stored); ``grad`` may be ``out`` likewise.

Its two halves are jit functions of their own, which :mod:`.quantized_sum_step` shares: ``adamw_tile`` (the step
of one tile from an fp32 gradient) and ``apply_difference`` (the quantized difference and its application).
"""

from __future__ import annotations

import triton
import triton.language as tl

from acco_ds.ops.triton_kernels.bf16 import round_to, to_f32
from acco_ds.ops.triton_kernels.quantize import _load_f32, _quantize_tile, _row_tile, _store_as


@triton.jit
def adamw_difference_rows(
    p_ptr,
    m_ptr,
    v_ptr,
    g_ptr,
    base_ptr,
    out_ptr,
    q_ptr,
    qscale_ptr,
    hyper_ptr,
    gscale_ptr,
    noop_ptr,
    grad_scale,
    n,
    nb,
    block_size,
    QMAX: tl.constexpr,
    TILE: tl.constexpr,
    ROWS: tl.constexpr,
    G_DT: tl.constexpr,
    P_DT: tl.constexpr,
    COMMIT: tl.constexpr,
    HAS_GSCALE: tl.constexpr,
    HAS_NOOP: tl.constexpr,
):
    """See the module docstring. ``hyper_ptr``: the 8 fp32 AdamW scalars (acco_ds.ops.adamw_settings.KERNEL_FIELDS
    order); ``gscale_ptr`` (HAS_GSCALE): 1 fp32; ``noop_ptr`` (HAS_NOOP): 1 int32, nonzero = no step."""
    rows, idx, mask = _row_tile(n, block_size, TILE, ROWS)
    g = to_f32(tl.load(g_ptr + idx, mask=mask, other=0), G_DT)
    p = adamw_tile(
        p_ptr, m_ptr, v_ptr, g, idx, mask, hyper_ptr, gscale_ptr, noop_ptr, grad_scale, COMMIT, HAS_GSCALE, HAS_NOOP
    )  # fmt: skip
    apply_difference(p, base_ptr, out_ptr, q_ptr, qscale_ptr, rows, idx, mask, nb, QMAX, P_DT)


@triton.jit
def adamw_tile(
    p_ptr,
    m_ptr,
    v_ptr,
    g,
    idx,
    mask,
    hyper_ptr,
    gscale_ptr,
    noop_ptr,
    grad_scale,
    COMMIT: tl.constexpr,
    HAS_GSCALE: tl.constexpr,
    HAS_NOOP: tl.constexpr,
):
    """The AdamW step of one tile with the fp32 gradient ``g`` (unscaled): csrc/adamw/adamw_math.h's operations in
    their order, the gradient times ``grad_scale * gscale[0]`` (HAS_GSCALE); COMMIT stores master, exp_avg and
    exp_avg_sq unless the device's noop flag is set (HAS_NOOP). Returns the new parameters (the master where the flag
    is set), fp32."""
    decay = tl.load(hyper_ptr + 0)
    one_minus_beta1 = tl.load(hyper_ptr + 2)
    beta2 = tl.load(hyper_ptr + 3)
    one_minus_beta2 = tl.load(hyper_ptr + 4)
    bc2_sqrt = tl.load(hyper_ptr + 5)
    eps = tl.load(hyper_ptr + 6)
    step_size = tl.load(hyper_ptr + 7)
    s = grad_scale
    if HAS_GSCALE:
        s = grad_scale * tl.load(gscale_ptr)
    p0 = tl.load(p_ptr + idx, mask=mask, other=0.0)
    m = tl.load(m_ptr + idx, mask=mask, other=0.0)
    v = tl.load(v_ptr + idx, mask=mask, other=0.0)
    g = g * s
    p = p0 * decay
    m = m + one_minus_beta1 * (g - m)
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.math.div_rn(m, denom)
    live = mask
    if HAS_NOOP:
        stepping = (idx * 0 + tl.load(noop_ptr)) == 0  # the device's flag, as a tensor of the tile's shape
        p = tl.where(stepping, p, p0)
        live = mask & stepping
    if COMMIT:
        tl.store(p_ptr + idx, p, mask=live)
        tl.store(m_ptr + idx, m, mask=live)
        tl.store(v_ptr + idx, v, mask=live)
    return p


@triton.jit
def apply_difference(
    p, base_ptr, out_ptr, q_ptr, qscale_ptr, rows, idx, mask, nb, QMAX: tl.constexpr, P_DT: tl.constexpr
):
    """The new parameters ``p`` (fp32) as the replicas will hold them: their difference to ``base`` (cast to the
    parameter dtype first) quantized per block into ``q`` / ``qscale``, and ``out = base + q * scale`` stored in the
    parameter dtype (``base`` is loaded before ``out`` is stored: it may be ``out``)."""
    base = _load_f32(base_ptr, idx, mask, P_DT)
    p = round_to(p, P_DT)  # the new parameter as the parameter buffer would hold it
    q, _, stored, _ = _quantize_tile(p - base, rows, idx, mask, q_ptr, qscale_ptr, rows < nb, QMAX)
    _store_as(out_ptr, idx, base + q.to(tl.float32) * stored[:, None], mask, P_DT)
