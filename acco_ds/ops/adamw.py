"""Fused sharded AdamW on flat fp32 shards: commit (update the state) and peek (ACCO's estimate).

Contract (both :func:`adamw_step` and :func:`adamw_step_ref`):

- ``master``, ``exp_avg``, ``exp_avg_sq``: fp32, contiguous, 1-D, the same numel ``n``, one device.
- ``grad``: fp32, bf16 or fp16, contiguous, numel ``n`` (any shape), same device. Read only.
- ``out``: ``None`` or a contiguous fp32/bf16/fp16 tensor of numel ``n`` (typically a slice of the all-gather
  buffer); receives the updated parameter cast to its dtype (round-to-nearest-even for bf16 and fp16). ``out`` may be
  ``grad`` itself (the same memory, dtype and numel: every element's gradient is read before its output is
  written, which is how ACCO's job updates its buffer in place); any other overlap is rejected.
- ``g = grad.float() * (grad_scale * scale_tensor[0])``; ``scale_tensor`` is a 1-element fp32 tensor on the
  device (a value computed on the device, e.g. 1/count times the clip coefficient, read without a host sync).
- ``step``: the 1-based index of the step being computed; bias corrections ``1 - beta**step``.
- ``lr, beta1, beta2, eps, weight_decay``: the fields of :class:`~acco_ds.ops.adamw_settings.AdamWSettings`.
- ``hyper_tensor`` instead of ``lr, beta1, beta2, eps, weight_decay, step`` (exactly one of the two forms):
  a contiguous fp32 tensor of exactly 8 elements on master's device holding the scalars the kernels use
  (``KERNEL_FIELDS``), ``AdamWSettings.hyper_scalars(step)`` rounded to fp32 (build it with :func:`hyper_tensor`). Every backend reads the scalars
  from it (the CUDA kernel on the device, once per thread: a value selected on the device, e.g. by whether the
  previous commit was skipped, needs no host sync). With the same fp32 values the compiled backends give the
  bits of the host-scalar call; the torch fallback uses tensor arithmetic (no host read), bits within an ulp.
  Its values are not validated (that would read them on the host).
- ``commit=True`` updates master/exp_avg/exp_avg_sq in place and writes ``out`` (if given) = new master.
  ``commit=False`` (peek) writes only ``out`` (required) = what the commit would produce; the state is not
  written at all (bit-identical afterwards).
- ``noop_flag``: 1-element int32 tensor on the device; nonzero means: state untouched, ``out`` = master cast
  (the all-gather buffer stays valid). Decided on the device (no host sync) by the CUDA kernel and by the torch
  fallback of :func:`adamw_step`; only the test oracle :func:`adamw_step_ref` reads it on the host.

Per element, in fp32, in torch.optim.AdamW's order::

    p = master * (1 - lr*wd); m = m + (1-b1)*(g-m)  [torch's lerp_]; v = b2*v + (1-b2)*g*g
    p = p - (lr / (1 - b1**step)) * m / (sqrt(v) / sqrt(1 - b2**step) + eps)

Streams: on CUDA the kernel is enqueued on ``torch.cuda.current_stream()`` of ``master``'s device; the caller
owns every buffer for the duration of that stream's work (no copy is kept).

Threads: the CPU kernel runs on at most :func:`host_threads` OpenMP threads, the calling thread's setting
(:func:`set_host_threads`; the kernels of ``ops.quantize`` and ``ops.quantized_sum_step`` read the same one). The
pipeline's communication worker thread gets the configured ``host_threads`` (``acco_ds.config``), so the host
step leaves cores to the training thread; every other thread keeps ``torch.get_num_threads()``. The kernels'
bits do not depend on the count (work split in fixed items, partial sums added in item order).
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import warnings
from typing import NamedTuple

import torch

from acco_ds.ops import _build
from acco_ds.ops._dtypes import DTYPE_CODE, FLOATS
from acco_ds.ops.adamw_settings import KERNEL_FIELDS, SETTING_FIELDS, AdamWSettings, check_finite_nonneg

logger = logging.getLogger(__name__)

_FP32 = torch.float32
_DTYPE_CODE = DTYPE_CODE
_logged_backends: set = set()
NO_KERNEL_IMAGE = "cudaErrorNoKernelImageForDevice"
"""The CUDA error of a launch on a GPU the module was not compiled for (e.g. a V100 and a CUDA 13 build, which
cannot target sm_70)."""
_no_kernel_image: set = set()  # the devices where that happened: the torch form runs there from then on


def _name(t: torch.Tensor) -> str:
    return f"{t.dtype}, shape {tuple(t.shape)}, device {t.device}, contiguous={t.is_contiguous()}"


_SETTINGS = (*SETTING_FIELDS, "step")  # the settings form of a call


def _check_tensor(arg: str, t, dtypes, n: int | None, device: torch.device | None) -> None:
    """Raise TypeError/ValueError naming ``arg``, the value seen and what is allowed."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"adamw_step: {arg} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in dtypes:
        allowed = " or ".join(filter(None, (", ".join(str(d) for d in dtypes[:-1]), str(dtypes[-1]))))
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


class _Step(NamedTuple):
    """The arguments of one call: the signature of :func:`adamw_step`, :func:`adamw_step_ref` and
    :func:`adamw_step_cuda_body_on_cpu`, written once (``master`` .. ``out`` positional, the rest keyword-only)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    out: torch.Tensor | None = None
    lr: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    step: int | None = None
    grad_scale: float = 1.0
    scale_tensor: torch.Tensor | None = None
    noop_flag: torch.Tensor | None = None
    commit: bool = True
    hyper_tensor: torch.Tensor | None = None

    @property
    def settings(self) -> AdamWSettings:
        """The settings form's values (meaningful when ``hyper_tensor`` is None)."""
        return AdamWSettings(self.lr, self.beta1, self.beta2, self.eps, self.weight_decay)


_POSITIONAL = ("master", "exp_avg", "exp_avg_sq", "grad", "out")
_KEYWORDS = frozenset(_Step._fields[len(_POSITIONAL) :])


def _bind(who: str, master, exp_avg, exp_avg_sq, grad, out, keywords: dict) -> _Step:
    """The validated :class:`_Step` of a call to ``who``; TypeError for a keyword it does not take."""
    for k in keywords:
        if k not in _KEYWORDS:
            raise TypeError(f"{who}() got an unexpected keyword argument {k!r}")
    a = _Step(master, exp_avg, exp_avg_sq, grad, out, **keywords)
    _validate(a)
    return a


def _signature(**extra) -> inspect.Signature:
    """The signature the public functions accept (:class:`_Step`'s fields, then ``extra`` keyword-only
    defaults), for ``help()`` and ``inspect``: they are written ``(master, ..., out=None, **keywords)``."""
    P, defaults = inspect.Parameter, _Step._field_defaults
    params = [P(f, P.POSITIONAL_OR_KEYWORD, default=defaults.get(f, P.empty)) for f in _POSITIONAL]
    params += [P(f, P.KEYWORD_ONLY, default=defaults[f]) for f in _Step._fields if f not in _POSITIONAL]
    params += [P(k, P.KEYWORD_ONLY, default=v) for k, v in extra.items()]
    return inspect.Signature(params, return_annotation=None)


def _validate(a: _Step) -> None:
    _check_tensor("master", a.master, (_FP32,), None, None)
    if a.master.dim() != 1:
        raise ValueError(f"adamw_step: master must be 1-D (a flat shard), got shape {tuple(a.master.shape)}.")
    n, dev = a.master.numel(), a.master.device
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"adamw_step: master is on {dev}; supported devices: cpu, cuda.")
    _check_tensor("exp_avg", a.exp_avg, (_FP32,), n, dev)
    _check_tensor("exp_avg_sq", a.exp_avg_sq, (_FP32,), n, dev)
    _check_tensor("grad", a.grad, FLOATS, n, dev)
    if a.out is not None:
        _check_tensor("out", a.out, FLOATS, n, dev)
    elif not a.commit:
        raise ValueError(
            "adamw_step: commit=False (peek) writes only `out`, so out must be a tensor, got None."
        )
    named = [("master", a.master), ("exp_avg", a.exp_avg), ("exp_avg_sq", a.exp_avg_sq), ("grad", a.grad)]
    named += [("out", a.out)] if a.out is not None else []
    if a.hyper_tensor is not None:
        _check_hyper_tensor(a.hyper_tensor, dev)
        named.append(("hyper_tensor", a.hyper_tensor))
    for i, (name_i, t_i) in enumerate(named):
        for name_j, t_j in named[i + 1 :]:
            if n and _overlaps(t_i, t_j) and not (name_i == "grad" and name_j == "out" and _same(t_i, t_j)):
                raise ValueError(
                    f"adamw_step: {name_i} and {name_j} overlap in memory; the kernels read and write them "
                    "element by element as distinct buffers (pass separate tensors)."
                )
    for arg, t, dt in (("scale_tensor", a.scale_tensor, _FP32), ("noop_flag", a.noop_flag, torch.int32)):
        if t is None:
            continue
        _check_tensor(arg, t, (dt,), None, dev)
        if t.numel() != 1:
            raise ValueError(f"adamw_step: {arg} must have exactly 1 element, got shape {tuple(t.shape)}.")
    check_finite_nonneg("adamw_step", "grad_scale", a.grad_scale)
    given = [k for k in _SETTINGS if getattr(a, k) is not None]
    if a.hyper_tensor is not None:
        if given:
            raise ValueError(
                f"adamw_step: give either the AdamW settings ({', '.join(_SETTINGS)}) or "
                f"hyper_tensor, not both; got hyper_tensor and {', '.join(given)}."
            )
        return
    missing = [k for k in _SETTINGS if getattr(a, k) is None]
    if missing:
        raise ValueError(
            f"adamw_step: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required: pass all of "
            f"{', '.join(_SETTINGS)}, or instead hyper_tensor (the {len(KERNEL_FIELDS)} AdamW scalars as an fp32 "
            "tensor on master's device, see hyper_tensor())."
        )
    a.settings.check("adamw_step", a.step)


def _check_hyper_tensor(t, dev: torch.device) -> None:
    _check_tensor("hyper_tensor", t, (_FP32,), None, dev)
    if t.numel() != len(KERNEL_FIELDS):
        raise ValueError(
            f"adamw_step: hyper_tensor must have exactly {len(KERNEL_FIELDS)} elements "
            f"({', '.join(KERNEL_FIELDS)}; build it with acco_ds.ops.adamw.hyper_tensor), got shape "
            f"{tuple(t.shape)}."
        )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements: in-place use, which an element-wise kernel supports."""
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.numel() == b.numel()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() < b.data_ptr() + b.numel() * b.element_size()
        and b.data_ptr() < a.data_ptr() + a.numel() * a.element_size()
    )


def hyper_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int):
    """``AdamWSettings(lr, beta1, beta2, eps, weight_decay).hyper_scalars(step)``: the scalars the kernels use
    (``KERNEL_FIELDS``: ``(1-lr*wd, beta1, 1-beta1, beta2, 1-beta2, sqrt(1-beta2**step), eps,
    lr/(1-beta1**step))``), computed in double on the host like torch.optim.AdamW does."""
    return AdamWSettings(lr, beta1, beta2, eps, weight_decay).hyper_scalars(step)


def hyper_tensor(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 device=None) -> torch.Tensor:  # fmt: skip
    """The ``hyper_tensor`` argument of :func:`adamw_step` for these settings: a new contiguous fp32 tensor of 8
    elements on ``device`` (default: the CPU), :func:`hyper_scalars` each rounded to fp32 (to nearest, as the
    host-scalar path rounds them). Raises ValueError naming a bad setting (the same rules as adamw_step)."""
    settings = AdamWSettings(lr, beta1, beta2, eps, weight_decay)
    settings.check("hyper_tensor", step)
    return torch.tensor(settings.hyper_scalars(step), dtype=torch.float64).to(device=device, dtype=_FP32)


def _adamw_math(a: _Step, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    """The AdamW update of the contract, in place on ``p``, ``m``, ``v`` (torch.optim.AdamW's operations)."""
    g = a.grad.reshape(-1).to(_FP32)
    if a.scale_tensor is not None:
        g = g * (a.scale_tensor.reshape(1).to(_FP32) * a.grad_scale)
    elif a.grad_scale != 1.0:
        g = g * a.grad_scale
    if a.hyper_tensor is not None:
        _adamw_math_hyper_tensor(a.hyper_tensor.reshape(-1), g, p, m, v)
        return
    s = a.settings
    bc1 = 1.0 - s.beta1**a.step
    bc2 = 1.0 - s.beta2**a.step
    p.mul_(1.0 - s.lr * s.weight_decay)
    m.lerp_(g, 1.0 - s.beta1)
    v.mul_(s.beta2).addcmul_(g, g, value=1.0 - s.beta2)
    denom = (v.sqrt() / math.sqrt(bc2)).add_(s.eps)
    p.addcdiv_(m, denom, value=-(s.lr / bc1))


def _adamw_math_hyper_tensor(h: torch.Tensor, g, p, m, v) -> None:
    """:func:`_adamw_math` with the scalars in the tensor ``h`` (KERNEL_FIELDS), never read on the host: the same
    operations with 0-dim tensor operands. addcmul_/addcdiv_ take only a number as ``value``, so the tensor
    scalar moves into the first operand (``value * t1`` is what torch's CPU kernels compute first: the same bits
    as the host-scalar path there); torch's CUDA addcdiv computes ``value * (t1 / t2)``, an ulp away."""
    k = dict(zip(KERNEL_FIELDS, h.unbind()))
    p.mul_(k["decay"])
    m.lerp_(g, k["one_minus_beta1"])
    v.mul_(k["beta2"]).addcmul_(k["one_minus_beta2"] * g, g)
    denom = (v.sqrt() / k["bc2_sqrt"]).add_(k["eps"])
    p.addcdiv_(k["step_size"] * m, denom, value=-1.0)


def _adamw_torch_host_flag(a: _Step) -> None:
    """The reference: reads ``noop_flag`` on the host (``.item()``, a device sync on CUDA)."""
    if a.noop_flag is not None and int(a.noop_flag.item()) != 0:
        if a.out is not None:
            a.out.view(-1).copy_(a.master)
        return
    if a.commit:
        p, m, v = a.master, a.exp_avg, a.exp_avg_sq
    else:
        p, m, v = a.master.clone(), a.exp_avg.clone(), a.exp_avg_sq.clone()
    _adamw_math(a, p, m, v)
    if a.out is not None:
        a.out.view(-1).copy_(p)


def _adamw_torch(a: _Step) -> None:
    """The fallback of :func:`adamw_step`: the reference's results bit for bit, with ``noop_flag`` decided on the
    device (the update is computed on copies and selected with ``torch.where``): no host sync on CUDA."""
    if a.noop_flag is None:
        _adamw_torch_host_flag(a)
        return
    p, m, v = a.master.clone(), a.exp_avg.clone(), a.exp_avg_sq.clone()
    _adamw_math(a, p, m, v)
    skip = a.noop_flag.reshape(1) != 0
    torch.where(skip, a.master, p, out=p)
    if a.commit:
        torch.where(skip, a.exp_avg, m, out=m)
        torch.where(skip, a.exp_avg_sq, v, out=v)
        a.master.copy_(p)
        a.exp_avg.copy_(m)
        a.exp_avg_sq.copy_(v)
    if a.out is not None:
        a.out.view(-1).copy_(p)


def _ext_args(a: _Step) -> tuple:
    """Positional arguments of the compiled entry points, up to and including ``commit``."""
    out, st, nf, ht = a.out, a.scale_tensor, a.noop_flag, a.hyper_tensor
    if ht is None:
        hp = a.settings.hyper_scalars(a.step)
    else:  # the kernels read hyper_ptr; NaN in the by-value copy makes a kernel that ignores it fail loudly
        hp = (math.nan,) * len(KERNEL_FIELDS)
    return (
        a.master.data_ptr(),
        a.exp_avg.data_ptr(),
        a.exp_avg_sq.data_ptr(),
        a.grad.data_ptr(),
        _DTYPE_CODE[a.grad.dtype],
        0 if out is None else out.data_ptr(),
        -1 if out is None else _DTYPE_CODE[out.dtype],
        0 if st is None else st.data_ptr(),
        0 if nf is None else nf.data_ptr(),
        0 if ht is None else ht.data_ptr(),
        a.master.numel(),
        hp,
        float(a.grad_scale),
        bool(a.commit),
    )


def _log_backend_once(device_type: str, backend: str, why: str = "") -> None:
    key = (device_type, backend)
    if key in _logged_backends:
        return
    _logged_backends.add(key)
    if why and device_type == "cuda":
        msg = (
            f"acco_ds adamw_step on cuda: the CUDA extension is missing ({why}), so CUDA tensors take {backend}: "
            "correct, but several passes over the shard and a copy of the state per call where the kernel makes "
            "one pass, on the communication stream of every round. Build the extension: "
            "`ACCO_DS_BUILD_CUDA=1 python setup.py build_ext --inplace` (or pip install with nvcc present)."
        )
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    elif why:
        logger.warning("acco_ds adamw_step on %s: using %s (%s)", device_type, backend, why)
    else:
        logger.info("acco_ds adamw_step on %s: using %s", device_type, backend)


def _launch_or_torch(device: torch.device, launch, a: _Step) -> None:
    """``launch()`` (the CUDA extension's call for ``a``); where the module holds no kernel for ``device``'s
    architecture (the launch refused with :data:`NO_KERNEL_IMAGE`: nothing ran) the torch form instead, then and
    on every later call on ``device``, with a warning once per device."""
    if device in _no_kernel_image:
        _adamw_torch(a)
        return
    try:
        launch()
    except RuntimeError as e:
        if NO_KERNEL_IMAGE not in str(e):
            raise
        _no_kernel_image.add(device)
        msg = (
            f"acco_ds adamw_step on {device}: the CUDA extension holds no kernel for this GPU's architecture "
            f"({e}); its AdamW takes the torch form there. Build the extension for this GPU: ACCO_DS_CUDA_ARCHS=<sm> "
            "`python setup.py build_ext --inplace` (a V100, sm_70, needs a CUDA 12 nvcc: CUDA 13 dropped it)."
        )
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        _adamw_torch(a)


def adamw_step_ref(master, exp_avg, exp_avg_sq, grad, out=None, **keywords) -> None:
    """Pure-torch AdamW step with this module's contract: the test oracle.

    Reads ``noop_flag`` on the host (``.item()``: a device sync on CUDA). :func:`adamw_step`'s own fallback gives
    the same bits and decides the flag on the device.
    """
    _adamw_torch_host_flag(_bind("adamw_step_ref", master, exp_avg, exp_avg_sq, grad, out, keywords))


_HOST_THREADS = threading.local()


def set_host_threads(threads: int | None) -> None:
    """The OpenMP threads the CPU kernels use when called from THIS thread (thread-local: other threads keep their
    own); ``None`` goes back to ``torch.get_num_threads()`` at each call. Raises ValueError for anything else than
    None or an integer >= 1."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"host threads={threads!r}: must be None or an integer >= 1")
    _HOST_THREADS.value = threads


def host_threads() -> int:
    """The OpenMP threads a CPU kernel called from this thread may use: :func:`set_host_threads`'s value for this
    thread, else ``torch.get_num_threads()``."""
    value = getattr(_HOST_THREADS, "value", None)
    return torch.get_num_threads() if value is None else value


def adamw_step(master, exp_avg, exp_avg_sq, grad, out=None, **keywords) -> None:
    """One fused AdamW step on flat shards (see the module docstring for the full contract).

    Dispatch: the CUDA extension for CUDA tensors, the CPU extension (OpenMP, :func:`host_threads` threads) for
    CPU tensors, :func:`adamw_step_ref` when the extension is missing or (CUDA) holds no kernel for
    the GPU's architecture (:func:`_launch_or_torch`); the choice is logged once per device type. Arguments are validated before any launch (TypeError/ValueError naming the argument).
    """
    a = _bind("adamw_step", master, exp_avg, exp_avg_sq, grad, out, keywords)
    dev = master.device.type
    kind = "adamw_cuda" if dev == "cuda" else "adamw_cpu"
    ext = _build.load(kind)
    if ext is None:
        _log_backend_once(dev, "the torch reference", _build.why_missing(kind))
        _adamw_torch(a)
        return
    if master.numel() == 0:
        return
    if dev == "cuda":
        _log_backend_once(dev, "the CUDA extension")

        def launch():
            with torch.cuda.device(master.device):
                ext.adamw_cuda(*_ext_args(a), torch.cuda.current_stream(master.device).cuda_stream)

        _launch_or_torch(master.device, launch, a)
    else:
        _log_backend_once(dev, "the CPU extension")
        ext.adamw_cpu(*_ext_args(a), host_threads())


def adamw_step_cuda_body_on_cpu(master, exp_avg, exp_avg_sq, grad, out=None, *, grid_dim: int = 0,
                                block_dim: int = 0, **keywords) -> None:  # fmt: skip
    """Test hook: run the CUDA kernel's body (indexing, vector path, alignment, tails) on CPU tensors.

    Same contract as :func:`adamw_step`; ``grid_dim``/``block_dim`` <= 0 use the CUDA launcher's launch shape.
    Raises RuntimeError (from the harness) on a misaligned vector access or an out-of-bounds access, and
    RuntimeError when the CPU extension is not built.
    """
    a = _bind("adamw_step_cuda_body_on_cpu", master, exp_avg, exp_avg_sq, grad, out, keywords)
    if master.device.type != "cpu":
        raise ValueError(f"adamw_step_cuda_body_on_cpu: tensors must be on cpu, got {master.device}.")
    ext = _build.load("adamw_cpu")
    if ext is None:
        raise RuntimeError(
            f"adamw_step_cuda_body_on_cpu needs the CPU extension: {_build.why_missing('adamw_cpu')}"
        )
    if master.numel():
        ext.adamw_cuda_body_on_cpu(*_ext_args(a), int(grid_dim), int(block_dim))


adamw_step.__signature__ = _signature()
adamw_step_ref.__signature__ = _signature()
adamw_step_cuda_body_on_cpu.__signature__ = _signature(grid_dim=0, block_dim=0)
