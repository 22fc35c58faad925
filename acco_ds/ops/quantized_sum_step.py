"""The owner's half of a compressed round without the sum in memory: the W ranks' quantized chunks of this
rank's shard go straight into the gradient norm and into the AdamW step.

The sum these functions read is the one :func:`acco_ds.ops.quantize.dequantize_sum` would store, element by
element::

    s[i] = cast_dtype(sum over r in order of q[r, i] * scales[r, i // block_size])  # fp32, rows in order
    s[i] = cast_dtype(float(s[i]) + float(tilde[i]))                               # only when tilde is given

(``dtype``: the communication dtype, fp32, bf16 or fp16; the second line is the acco commit's ``grad += tilde``, the
g~ sum its peek kept). Two passes replace "sum, store, norm, step":

- ``quantized_sum_of_squares(q, scales, block_size, order, dtype, *, tilde=None, tilde_out=None)``: fp64 [1],
  the sum of ``float64(s[i]) ** 2`` (the norm's contract, :mod:`acco_ds.ops.norm`: each square exact, the squares
  summed in fp64, in an order of the backend's); ``tilde_out`` (the acco peek's g~ shard) receives ``s``.
- ``adamw_step_quantized_sum(master, exp_avg, exp_avg_sq, q, scales, block_size, order, dtype, out, *,
  tilde=None, base=None, bits=8, **adamw_keywords)``: :func:`acco_ds.ops.adamw.adamw_step` with ``grad = s``
  (every keyword of it: scale tensor, noop flag, hyper tensor, commit), or with ``base``
  :func:`acco_ds.ops.adamw_difference.adamw_step_difference` (returns its ``(q, scales)``).

Bit for bit (parameters, moments, ``out``, the difference; a NaN's payload aside: the kernels store a bf16 NaN
as 0x7FC0, torch's ``add_`` may not) the composition: ``dequantize_sum`` into a shard of
``dtype``, ``add_`` of ``tilde``, then ``sum_of_squares`` and the step on that shard; the norm differs from
the composition's only in the order of its fp64 additions (as the norm's backends do among themselves).

Bytes per element of the shard: the composition reads the W int8 chunks once, writes the sum (2 B in bf16),
reads it for the norm and for the step: W + 6 (bf16, scales aside). These read the chunks twice: 2 W, fewer up to
W = 5, though each pass recomputes the sum (the round job reads the chunks twice up to W = 3:
``acco_ds.core.round_job.UNSTORED_SUM_MAX_WORLD``).

Arguments: ``q`` int8 ``[rows, n]`` and ``scales`` fp32 ``[rows, num_blocks(n)]``, contiguous, on master's
device; ``order``: the distinct rows to sum, in the summation order (at least one); ``tilde`` / ``tilde_out``: flat
shards of ``dtype`` and length n, contiguous, overlapping nothing else; the AdamW tensors as
:func:`adamw_step`'s (``out`` required: the new parameters' shard) and overlapping neither q nor scales; ``base``
as :func:`adamw_step_difference`'s.

Backends (``backend=``):

- ``"fused"``: the CPU extensions (``quantized_sum_squares_cpu`` in ``acco_ds._quantize_cpu``,
  ``adamw_quantized_sum_cpu`` in ``acco_ds._adamw_cpu``), block by block: the block's sum in a scratch block
  (L1/L2), then the step's or the norm's loop on it (the same inline loops as the composition's kernels). CPU
  tensors; with ``base``, 8 bits.
- ``"triton"``: ``acco_ds.ops.triton_kernels.quantized_sum_step``, the same passes on CUDA (blocks of at most
  1024 elements), queued on the current stream; CPU tensors only under ``TRITON_INTERPRET=1``.
- ``"composed"``: the composition above, each call on its own fastest backend.
- ``None``/``"auto"``: ``"fused"`` on CPU, ``"triton"`` on CUDA, where each can run; else ``"composed"``. A
  backend named explicitly raises where it cannot run.

Streams and ownership: nothing is kept; on CUDA everything is queued on the current stream (the round job's side
stream), and the caller keeps the inputs alive until that stream has run.
"""

from __future__ import annotations

from typing import Tuple

import torch

from acco_ds.ops import _build
from acco_ds.ops._dtypes import ALLOWED, FLOATS
from acco_ds.ops.adamw import _bind, _ext_args, _overlaps, adamw_step, host_threads, hyper_tensor
from acco_ds.ops.adamw_difference import _check_base, adamw_step_difference
from acco_ds.ops.norm import sum_of_squares
from acco_ds.ops.quantize import (
    _DTYPE_CODE,
    QMAX_OF,
    _check_bits,
    _check_rows,
    _new_outputs,
    _order_on,
    _rows,
    _tile,
    dequantize_sum,
    num_blocks,
)
from acco_ds.ops.quantize import _triton_obstacle as _quantize_triton_obstacle

_BACKENDS = (None, "auto", "fused", "triton", "composed")
_SUM_DTYPES = FLOATS


def _check_shard(who: str, name: str, t, n: int, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: {name} must be a tensor, got {type(t).__name__}.")
    if t.dtype != dtype or t.dim() != 1 or t.numel() != n or t.device != device or not t.is_contiguous():
        raise ValueError(
            f"{who}: {name} must be a contiguous flat {dtype} shard of {n} elements on {device}, got {t.dtype} of "
            f"shape {tuple(t.shape)} on {t.device}, contiguous={t.is_contiguous()}."
        )


def _check_sum_args(who: str, q, scales, block_size: int, order, dtype, shards: dict, others: dict) -> list:
    """Validate the quantized rows, the sum's dtype and the flat shards beside them; returns the order."""
    if dtype not in _SUM_DTYPES:
        raise TypeError(f"{who}: dtype (the sum's) must be {ALLOWED}, got {dtype!r}.")
    if not isinstance(q, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise TypeError(f"{who}: q and scales must be tensors.")
    order = _check_rows(q, scales, block_size, order)
    n = q.shape[1]
    if scales.device != q.device:
        raise ValueError(f"{who}: scales are on {scales.device} but q is on {q.device}; use one device.")
    if not q.is_contiguous() or not scales.is_contiguous():
        raise ValueError(
            f"{who}: q and scales must be contiguous, got strides {q.stride()} and {scales.stride()}."
        )
    named = {"q": q, "scales": scales}
    for name, t in shards.items():
        if t is not None:
            _check_shard(who, name, t, n, dtype, q.device)
            named[name] = t
    named.update({k: v for k, v in others.items() if v is not None})
    keys = list(named)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            if n and named[a].numel() and named[b].numel() and _overlaps(named[a], named[b]):
                raise ValueError(f"{who}: {a} and {b} overlap in memory; pass buffers of their own.")
    return order


def _obstacle(how: str, device: torch.device, tensors: dict, block_size: int, base_bits: int | None) -> str:
    """Why backend ``how`` ("fused" or "triton") cannot run; "" when it can."""
    if how == "fused":
        if device.type != "cpu":
            return f"it runs on CPU tensors, got {device}"
        if base_bits not in (None, 8):
            return f"its parameter difference is 8 bits, got bits={base_bits}"
        for module in ("quantize_cpu", "adamw_cpu"):
            if not _build.available(module):
                return _build.why_missing(module)
        return ""
    if not _rows(block_size):
        return f"its programs hold blocks of at most 1024 elements, got block_size={block_size}"
    return _quantize_triton_obstacle(tensors)


def _pick(who: str, backend, device: torch.device, tensors: dict, block_size: int, base_bits=None) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"{who}: backend must be one of {_BACKENDS[1:]} or None, got {backend!r}.")
    if backend in ("fused", "triton"):
        why = _obstacle(backend, device, tensors, block_size, base_bits)
        if why:
            raise ValueError(f"{who}: backend={backend!r} cannot run: {why}.")
        return backend
    if backend == "composed":
        return backend
    kernel = "fused" if device.type == "cpu" else "triton"
    return "composed" if _obstacle(kernel, device, tensors, block_size, base_bits) else kernel


def _composed_sum(q, scales, block_size: int, order: list, dtype, tilde) -> torch.Tensor:
    s = torch.empty(q.shape[1], dtype=dtype, device=q.device)
    dequantize_sum(s, q, scales, block_size, order)
    if tilde is not None:
        s.add_(tilde)
    return s


def quantized_sum_of_squares(
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    order,
    dtype: torch.dtype,
    *,
    tilde: torch.Tensor | None = None,
    tilde_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """fp64 [1]: the sum of squares of the quantized rows' sum (module docstring); ``tilde_out`` receives the sum."""
    who = "quantized_sum_of_squares"
    order = _check_sum_args(
        who, q, scales, block_size, order, dtype, {"tilde": tilde, "tilde_out": tilde_out}, {}
    )
    tensors = {
        k: v
        for k, v in (("q", q), ("scales", scales), ("tilde", tilde), ("tilde_out", tilde_out))
        if v is not None
    }
    how = _pick(who, backend, q.device, tensors, block_size)
    n = q.shape[1]
    if how == "composed":
        s = _composed_sum(q, scales, block_size, order, dtype, tilde)
        if tilde_out is not None:
            tilde_out.copy_(s)
        return sum_of_squares(s)
    if how == "fused":
        total = 0.0
        if n:
            total = _build.load("quantize_cpu").quantized_sum_squares_cpu(
                [q[r].data_ptr() for r in order],
                [scales[r].data_ptr() for r in order],
                n,
                block_size,
                _DTYPE_CODE[dtype],
                0 if tilde is None else tilde.data_ptr(),
                0 if tilde_out is None else tilde_out.data_ptr(),
                host_threads(),
            )
        return torch.tensor([total], dtype=torch.float64)
    from acco_ds.ops.triton_kernels import quantized_sum_step as kernels  # imports triton: only at a launch

    nb = num_blocks(n, block_size)
    if not nb:
        return torch.zeros(1, dtype=torch.float64, device=q.device)
    rows = _rows(block_size)
    programs = -(-nb // rows)
    partials = torch.empty(programs, dtype=torch.float64, device=q.device)
    kernels.quantized_sum_squares_rows[(programs,)](
        q, scales, _order_on(order, q.device),
        q if tilde is None else tilde, q if tilde_out is None else tilde_out, partials,
        n, nb, block_size, len(order),
        TILE=_tile(block_size), ROWS=rows, S_DT=_DTYPE_CODE[dtype],
        HAS_TILDE=tilde is not None, HAS_TILDE_OUT=tilde_out is not None,
        enable_fp_fusion=False,
    )  # fmt: skip
    return partials.sum().reshape(1)


def adamw_step_quantized_sum(
    master,
    exp_avg,
    exp_avg_sq,
    q,
    scales,
    block_size: int,
    order,
    dtype: torch.dtype,
    out,
    *,
    tilde: torch.Tensor | None = None,
    base: torch.Tensor | None = None,
    bits: int = 8,
    backend: str | None = None,
    **keywords,
) -> Tuple[torch.Tensor, torch.Tensor] | None:
    """The AdamW step on the quantized rows' sum (module docstring); with ``base``, also the quantized
    difference of its new parameters (returns ``(q, scales)`` of it, else None)."""
    who = "adamw_step_quantized_sum"
    if out is None:
        raise ValueError(f"{who}: out (the new parameters' shard) is required, got None.")
    # the step's own checks, with out standing in for the gradient (the sum is never in memory)
    a = _bind(who, master, exp_avg, exp_avg_sq, out, out, keywords)
    if base is not None:
        _check_base(a, base)
        _check_bits(bits)
    state = {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "out": out}
    order = _check_sum_args(who, q, scales, block_size, order, dtype, {"tilde": tilde}, state)
    if q.shape[1] != master.numel():
        raise ValueError(
            f"{who}: q has rows of {q.shape[1]} elements but master has {master.numel()}; they must match (the "
            "rows' sum is the shard's gradient)."
        )
    if q.device != master.device:
        raise ValueError(f"{who}: q is on {q.device} but master is on {master.device}; use one device.")
    tensors = {"q": q, "scales": scales, **state, **({} if tilde is None else {"tilde": tilde})}
    how = _pick(who, backend, master.device, tensors, block_size, None if base is None else bits)
    if how == "composed":
        s = _composed_sum(q, scales, block_size, order, dtype, tilde)
        if base is None:
            adamw_step(master, exp_avg, exp_avg_sq, s, out, **keywords)
            return None
        return adamw_step_difference(
            master, exp_avg, exp_avg_sq, s, out, base, block_size, bits=bits, **keywords
        )
    n = out.numel()
    dq, dscales = _new_outputs(out, block_size) if base is not None else (None, None)
    if how == "fused":
        if n:
            ext = list(_ext_args(a))
            ext[3], ext[4] = 0, _DTYPE_CODE[dtype]  # the gradient: the sum of the rows, in the sum's dtype
            _build.load("adamw_cpu").adamw_quantized_sum_cpu(
                *ext,
                [q[r].data_ptr() for r in order],
                [scales[r].data_ptr() for r in order],
                0 if tilde is None else tilde.data_ptr(),
                block_size,
                0 if base is None else base.data_ptr(),
                0 if dq is None else dq.data_ptr(),
                0 if dscales is None else dscales.data_ptr(),
                host_threads(),
            )
        return None if base is None else (dq, dscales)
    if n:
        _launch_triton(a, q, scales, block_size, order, dtype, tilde, base, dq, dscales, bits)
    return None if base is None else (dq, dscales)


def _launch_triton(a, q, scales, block_size, order, dtype, tilde, base, dq, dscales, bits) -> None:
    from acco_ds.ops.triton_kernels import quantized_sum_step as kernels  # imports triton: only at a launch

    out, n = a.out, a.out.numel()
    nb = num_blocks(n, block_size)
    hyper = a.hyper_tensor
    if hyper is None:
        hyper = hyper_tensor(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step, device=out.device)
    rows = _rows(block_size)
    diff = base is not None
    kernels.adamw_quantized_sum_rows[(-(-nb // rows),)](
        a.master, a.exp_avg, a.exp_avg_sq, q, scales, _order_on(order, out.device),
        q if tilde is None else tilde, base if diff else out, out,
        dq if diff else q, dscales if diff else scales, hyper,
        a.master if a.scale_tensor is None else a.scale_tensor,
        a.master if a.noop_flag is None else a.noop_flag,
        float(a.grad_scale), n, nb, block_size, len(order),
        QMAX=QMAX_OF[bits], TILE=_tile(block_size), ROWS=rows,
        S_DT=_DTYPE_CODE[dtype], P_DT=_DTYPE_CODE[out.dtype], COMMIT=bool(a.commit),
        HAS_GSCALE=a.scale_tensor is not None, HAS_NOOP=a.noop_flag is not None,
        HAS_TILDE=tilde is not None, DIFF=diff,
        enable_fp_fusion=False,
    )  # fmt: skip
