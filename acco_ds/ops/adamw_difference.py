"""The AdamW step with its quantized parameter difference: what a compressed all-gather sends, in one pass.

``adamw_step_difference(master, exp_avg, exp_avg_sq, grad, out, base, block_size, *, bits=8, backend=None,
**adamw_keywords) -> (q, scales)`` is, bit for bit, the composition::

    adamw_step(master, exp_avg, exp_avg_sq, grad, out, **adamw_keywords)   # out = the new parameters
    q, scales = quantize_difference(out, base, block_size, bits=bits)      # what this rank sends
    add_dequantized(out, base, q, scales, block_size)                      # what every replica will hold

with ``base`` read before anything is written (the composition's ``base`` is a copy when it is ``out`` itself).
Arguments: :func:`acco_ds.ops.adamw.adamw_step`'s (``out`` required: the new parameters' shard, fp32, bf16 or fp16);
``base``: what every replica holds for this shard, ``out``'s dtype and length, contiguous, either ``out`` itself
(the same elements) or overlapping none of the other tensors; ``block_size`` and ``bits`` as
:func:`acco_ds.ops.quantize.quantize_difference`. Returns ``q`` (int8, out's length) and ``scales`` (fp32, one per
block), new tensors on out's device. Afterwards ``out`` holds ``base + dequantize(q, scales)`` in its dtype and the
AdamW state what :func:`adamw_step` leaves (commit, peek or noop alike).

Backends (``backend=``):

- ``"fused"``: the CPU extension's ``adamw_difference_cpu`` (csrc/adamw/adamw_difference_cpu.cpp), block by block:
  the step's new parameters stay in a scratch block (cache) while their difference is quantized and ``out``
  written once. Per bf16 parameter it saves the composition's write and re-read of the new parameters, the copy of
  ``base`` and the second read of q and ``base`` (31 bytes per parameter of a bf16-gradient commit instead of
  the composition's 42, the copy of the base included).
  CPU tensors, 8 bits.
- ``"triton"``: ``acco_ds.ops.triton_kernels.adamw_difference.adamw_difference_rows``, the same pass on CUDA (several
  blocks of at most 1024 elements per program, 8 or 4 bits), queued on the current stream; CPU tensors only under
  ``TRITON_INTERPRET=1`` (where tests/ops/test_adamw_difference.py checks it against the composition).
- ``"composed"``: the three calls above (each on its own fastest backend: on CUDA the CUDA AdamW and the Triton
  quantize kernels, queued on the current stream).
- ``None``/``"auto"``: ``"fused"`` for CPU tensors where it can run (8 bits, the CPU extension built), ``"triton"``
  for CUDA tensors where it can run (triton installed, blocks of at most 1024), else ``"composed"``. A backend
  named explicitly raises where it cannot run.
"""

from __future__ import annotations

from typing import Tuple

import torch

from acco_ds.ops import _build
from acco_ds.ops._dtypes import DTYPE_CODE
from acco_ds.ops.adamw import _bind, _ext_args, _overlaps, _same, adamw_step, host_threads, hyper_tensor
from acco_ds.ops.quantize import (
    QMAX_OF,
    _check_bits,
    _check_block_size,
    _new_outputs,
    _rows,
    _tile,
    add_dequantized,
    num_blocks,
    quantize_difference,
)
from acco_ds.ops.quantize import _triton_obstacle as _quantize_triton_obstacle

_BACKENDS = (None, "auto", "fused", "triton", "composed")
WHO = "adamw_step_difference"


def _check_base(a, base: torch.Tensor) -> None:
    out = a.out
    if not isinstance(base, torch.Tensor):
        raise TypeError(f"{WHO}: base must be a tensor, got {type(base).__name__}.")
    if base.dtype != out.dtype or base.numel() != out.numel() or base.device != out.device:
        raise ValueError(
            f"{WHO}: base must have out's dtype, length and device ({out.dtype}, {out.numel()}, {out.device}), "
            f"got {base.dtype}, {base.numel()}, {base.device}."
        )
    if not base.is_contiguous():
        raise ValueError(f"{WHO}: base must be contiguous, got stride {base.stride()}.")
    if not base.numel() or _same(base, out):
        return
    for name, t in (("out", out), ("master", a.master), ("exp_avg", a.exp_avg), ("exp_avg_sq", a.exp_avg_sq)):
        if _overlaps(base, t):
            raise ValueError(
                f"{WHO}: base overlaps {name}; base must be out itself or a buffer of its own (it is read while "
                "they are written)."
            )


def _fused_obstacle(a, bits: int, block_size: int) -> str:
    """Why the fused (C++) backend cannot run this call; "" when it can."""
    if a.master.device.type != "cpu":
        return f"it runs on CPU tensors, got {a.master.device}"
    if bits != 8:
        return f"it quantizes to 8 bits, got bits={bits}"
    if not _build.available("adamw_cpu"):
        return _build.why_missing("adamw_cpu")
    return ""


def _triton_obstacle(a, bits: int, block_size: int) -> str:
    """Why the Triton backend cannot run this call; "" when it can."""
    if not _rows(block_size):
        return f"its programs hold blocks of at most 1024 elements, got block_size={block_size}"
    return _quantize_triton_obstacle({"out": a.out})


_OBSTACLE = {"fused": _fused_obstacle, "triton": _triton_obstacle}


def _pick(a, bits: int, block_size: int, backend) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"{WHO}: backend must be one of {_BACKENDS[1:]} or None, got {backend!r}.")
    if backend in _OBSTACLE:
        why = _OBSTACLE[backend](a, bits, block_size)
        if why:
            raise ValueError(f"{WHO}: backend={backend!r} cannot run: {why}.")
        return backend
    if backend == "composed":
        return backend
    kernel = "fused" if a.master.device.type == "cpu" else "triton"
    return "composed" if _OBSTACLE[kernel](a, bits, block_size) else kernel


def _launch_triton(a, base: torch.Tensor, block_size: int, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    from acco_ds.ops.triton_kernels import adamw_difference as kernels  # imports triton: only at a launch

    out, n = a.out, a.out.numel()
    nb = num_blocks(n, block_size)
    q, scales = _new_outputs(out, block_size)
    if not n:
        return q, scales
    hyper = a.hyper_tensor
    if hyper is None:
        hyper = hyper_tensor(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step, device=out.device)
    rows = _rows(block_size)
    kernels.adamw_difference_rows[(-(-nb // rows),)](
        a.master, a.exp_avg, a.exp_avg_sq, a.grad, base, out, q, scales, hyper,
        a.master if a.scale_tensor is None else a.scale_tensor,
        a.master if a.noop_flag is None else a.noop_flag,
        float(a.grad_scale), n, nb, block_size,
        QMAX=QMAX_OF[bits], TILE=_tile(block_size), ROWS=rows,
        G_DT=DTYPE_CODE[a.grad.dtype], P_DT=DTYPE_CODE[out.dtype], COMMIT=bool(a.commit),
        HAS_GSCALE=a.scale_tensor is not None, HAS_NOOP=a.noop_flag is not None,
        enable_fp_fusion=False,
    )  # fmt: skip
    return q, scales


def adamw_step_difference(
    master,
    exp_avg,
    exp_avg_sq,
    grad,
    out,
    base,
    block_size: int,
    *,
    bits: int = 8,
    backend: str | None = None,
    **keywords,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The AdamW step and the quantized difference of its new parameters to ``base`` (module docstring: the
    contract and the backends). Returns ``(q, scales)``."""
    if out is None:
        raise ValueError(f"{WHO}: out (the new parameters' shard) is required, got None.")
    a = _bind(WHO, master, exp_avg, exp_avg_sq, grad, out, keywords)
    _check_base(a, base)
    _check_block_size(block_size)
    _check_bits(bits)
    how = _pick(a, bits, block_size, backend)
    n = out.numel()
    if how == "triton":
        return _launch_triton(a, base, block_size, bits)
    if how == "composed":
        own_base = base.clone() if n and _overlaps(base, out) else base
        adamw_step(master, exp_avg, exp_avg_sq, grad, out, **keywords)
        flat = out.view(-1)
        q, scales = quantize_difference(flat, own_base.view(-1), block_size, bits=bits)
        add_dequantized(flat, own_base.view(-1), q, scales, block_size)
        return q, scales
    q, scales = _new_outputs(out, block_size)
    if n:
        _build.load("adamw_cpu").adamw_difference_cpu(
            *_ext_args(a),
            base.data_ptr(),
            q.data_ptr(),
            scales.data_ptr(),
            block_size,
            host_threads(),
        )
    return q, scales
