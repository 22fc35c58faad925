"""Fused sharded AdamW on flat fp32 shards: commit (update the state) and peek (ACCO's estimate).

Contract (both :func:`adamw_step` and :func:`adamw_step_ref`):

- ``master``, ``exp_avg``, ``exp_avg_sq``: fp32, contiguous, 1-D, the same numel ``n``, one device.
- ``grad``: fp32 or bf16, contiguous, numel ``n`` (any shape), same device. Read only.
- ``out``: ``None`` or a contiguous bf16/fp32 tensor of numel ``n`` (typically a slice of the all-gather
  buffer); receives the updated parameter cast to its dtype (round-to-nearest-even for bf16).
- ``g = grad.float() * (grad_scale * scale_tensor[0])``; ``scale_tensor`` is a 1-element fp32 tensor on the
  device (a value computed on the device, e.g. 1/count times the clip coefficient, read without a host sync).
- ``step``: the 1-based index of the step being computed; bias corrections ``1 - beta**step``.
- ``commit=True`` updates master/exp_avg/exp_avg_sq in place and writes ``out`` (if given) = new master.
  ``commit=False`` (peek) writes only ``out`` (required) = what the commit would produce; the state is not
  written at all (bit-identical afterwards).
- ``noop_flag``: 1-element int32 tensor on the device; nonzero means: state untouched, ``out`` = master cast
  (the all-gather buffer stays valid). Decided on the device by the CUDA kernel (no host sync).

Per element, in fp32, in torch.optim.AdamW's order::

    p = master * (1 - lr*wd); m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g
    p = p - (lr / (1 - b1**step)) * m / (sqrt(v) / sqrt(1 - b2**step) + eps)

Streams: on CUDA the kernel is enqueued on ``torch.cuda.current_stream()`` of ``master``'s device; the caller
owns every buffer for the duration of that stream's work (no copy is kept).
"""

from __future__ import annotations

import logging
import math

import torch

from acco_ds.ops import _build

logger = logging.getLogger(__name__)

_FP32 = torch.float32
_BF16 = torch.bfloat16
_DTYPE_CODE = {_FP32: 0, _BF16: 1}
_logged_backends: set = set()


def _name(t: torch.Tensor) -> str:
    return f"{t.dtype}, shape {tuple(t.shape)}, device {t.device}, contiguous={t.is_contiguous()}"


def _check_tensor(arg: str, t, dtypes, n: int | None, device: torch.device | None) -> None:
    """Raise TypeError/ValueError naming ``arg``, the value seen and what is allowed."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"adamw_step: {arg} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"adamw_step: {arg} has dtype {t.dtype}; allowed: {allowed}.")
    if device is not None and t.device != device:
        raise ValueError(
            f"adamw_step: {arg} is on {t.device} but master is on {device}; move all tensors to one device."
        )
    if not t.is_contiguous():
        raise ValueError(
            f"adamw_step: {arg} is not contiguous ({_name(t)}, stride {t.stride()}); pass a contiguous "
            "tensor (a slice of a flat buffer, or .contiguous())."
        )
    if n is not None and t.numel() != n:
        raise ValueError(f"adamw_step: {arg} has {t.numel()} elements but master has {n}; sizes must match.")
    if t.numel() and t.data_ptr() % t.element_size() != 0:
        raise ValueError(
            f"adamw_step: {arg} data pointer 0x{t.data_ptr():x} is not aligned to its element size "
            f"{t.element_size()}; allocate it with torch (or slice a torch buffer)."
        )


def _validate(
    master,
    exp_avg,
    exp_avg_sq,
    grad,
    out,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    scale_tensor,
    noop_flag,
    commit,
) -> None:
    _check_tensor("master", master, (_FP32,), None, None)
    if master.dim() != 1:
        raise ValueError(f"adamw_step: master must be 1-D (a flat shard), got shape {tuple(master.shape)}.")
    n, dev = master.numel(), master.device
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"adamw_step: master is on {dev}; supported devices: cpu, cuda.")
    _check_tensor("exp_avg", exp_avg, (_FP32,), n, dev)
    _check_tensor("exp_avg_sq", exp_avg_sq, (_FP32,), n, dev)
    _check_tensor("grad", grad, (_FP32, _BF16), n, dev)
    if out is not None:
        _check_tensor("out", out, (_FP32, _BF16), n, dev)
    elif not commit:
        raise ValueError(
            "adamw_step: commit=False (peek) writes only `out`, so out must be a tensor, got None."
        )
    for arg, t, dt in (("scale_tensor", scale_tensor, _FP32), ("noop_flag", noop_flag, torch.int32)):
        if t is None:
            continue
        _check_tensor(arg, t, (dt,), None, dev)
        if t.numel() != 1:
            raise ValueError(f"adamw_step: {arg} must have exactly 1 element, got shape {tuple(t.shape)}.")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(
            f"adamw_step: step must be an int >= 1 (the 1-based step being computed), got {step!r}."
        )
    for arg, x in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= float(x) < 1.0:
            raise ValueError(f"adamw_step: {arg} must be in [0, 1), got {x!r}.")
    for arg, x in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not (math.isfinite(float(x)) and float(x) >= 0.0):
            raise ValueError(f"adamw_step: {arg} must be finite and >= 0, got {x!r}.")


def hyper_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int):
    """The fp32 scalars the kernels use, computed in double on the host like torch.optim.AdamW does.

    Returns ``(decay, beta1, 1-beta1, beta2, 1-beta2, sqrt(1-beta2**step), eps, lr/(1-beta1**step))``.
    """
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    return (1.0 - lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, math.sqrt(bc2), eps, lr / bc1)


def adamw_step_ref(
    master,
    exp_avg,
    exp_avg_sq,
    grad,
    out=None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    scale_tensor=None,
    noop_flag=None,
    commit: bool = True,
) -> None:
    """Pure-torch AdamW step with the contract of this module: the test oracle and the fallback.

    Reads ``noop_flag`` on the host (``.item()``: a device sync on CUDA), so the extensions are preferred.
    """
    _validate(
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        out,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        scale_tensor,
        noop_flag,
        commit,
    )
    _adamw_torch(
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        out,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        grad_scale,
        scale_tensor,
        noop_flag,
        commit,
    )


def _adamw_torch(
    master,
    exp_avg,
    exp_avg_sq,
    grad,
    out,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    grad_scale,
    scale_tensor,
    noop_flag,
    commit,
) -> None:
    if noop_flag is not None and int(noop_flag.item()) != 0:
        if out is not None:
            out.copy_(master)
        return
    if commit:
        p, m, v = master, exp_avg, exp_avg_sq
    else:
        p, m, v = master.clone(), exp_avg.clone(), exp_avg_sq.clone()
    g = grad.reshape(-1).to(_FP32)
    if scale_tensor is not None:
        g = g * (scale_tensor.reshape(1).to(_FP32) * grad_scale)
    elif grad_scale != 1.0:
        g = g * grad_scale
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    p.mul_(1.0 - lr * weight_decay)
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / bc1))
    if out is not None:
        out.view(-1).copy_(p)


def _log_backend_once(device_type: str, backend: str, why: str = "") -> None:
    key = (device_type, backend)
    if key in _logged_backends:
        return
    _logged_backends.add(key)
    msg = f"acco_ds adamw_step on {device_type}: using {backend}"
    if why:
        logger.warning("%s (%s)", msg, why)
    else:
        logger.info(msg)


def adamw_step(
    master,
    exp_avg,
    exp_avg_sq,
    grad,
    out=None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    scale_tensor=None,
    noop_flag=None,
    commit: bool = True,
) -> None:
    """One fused AdamW step on flat shards (see the module docstring for the full contract).

    Dispatch: the CUDA extension for CUDA tensors, the CPU extension (OpenMP, ``torch.get_num_threads()``
    threads) for CPU tensors, :func:`adamw_step_ref` when the extension is missing; the choice is logged once
    per device type. Arguments are validated before any launch (TypeError/ValueError naming the argument).
    """
    _validate(
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        out,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        scale_tensor,
        noop_flag,
        commit,
    )
    dev = master.device.type
    ext = _build.load("cuda" if dev == "cuda" else "cpu")
    if ext is None:
        _log_backend_once(dev, "the torch reference", _build.why_missing("cuda" if dev == "cuda" else "cpu"))
        _adamw_torch(
            master,
            exp_avg,
            exp_avg_sq,
            grad,
            out,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            step,
            grad_scale,
            scale_tensor,
            noop_flag,
            commit,
        )
        return
    n = master.numel()
    if n == 0:
        return
    hp = hyper_scalars(float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(step))
    ptrs = (
        master.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        grad.data_ptr(),
        _DTYPE_CODE[grad.dtype],
        0 if out is None else out.data_ptr(),
        -1 if out is None else _DTYPE_CODE[out.dtype],
        0 if scale_tensor is None else scale_tensor.data_ptr(),
        0 if noop_flag is None else noop_flag.data_ptr(),
    )
    if dev == "cuda":
        _log_backend_once(dev, "the CUDA extension")
        with torch.cuda.device(master.device):
            stream = torch.cuda.current_stream(master.device).cuda_stream
            ext.adamw_cuda(*ptrs, n, *hp, float(grad_scale), bool(commit), stream)
    else:
        _log_backend_once(dev, "the CPU extension")
        ext.adamw_cpu(*ptrs, n, *hp, float(grad_scale), bool(commit), torch.get_num_threads())
