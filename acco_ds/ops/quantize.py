"""Blockwise int8 quantization of a flat gradient, with an optional error-feedback residual.

A flat tensor ``x`` (fp32, bf16 or fp16, 1-D, any length n >= 0) is cut into blocks of ``block_size``
consecutive elements; the last block is short when ``block_size`` does not divide n. Per block b:

    scale_b = absmax_b / 127, rounded UP to fp32 (so |x_i| / scale_b <= 127 holds exactly)
    q_i     = clamp(round_half_to_even(x_i / scale_b), -127, 127)      (int8; computed in fp32)
    deq_i   = q_i * scale_b                                             (fp32)

so that ``|x_i - deq_i| <= scale_b / 2`` per element (up to the fp32 rounding of the quotient, a few
units in 2**-24 of a step). An all-zero block has ``scale_b = 0`` and ``q = 0``. Rounding the scale up
(rather than to nearest) matters only where absmax / 127 is not an fp32 value (tiny, subnormal
magnitudes): a scale rounded down could make ``|x_i| / scale_b`` exceed 127 and the clamp break the bound.
Precisely: ``absmax_b / 127`` is divided in double, rounded to the nearest fp32, and moved one fp32 step
up where that rounding went below the double quotient.

Four bits (``bits=4``): the same rule with 7 in place of 127 (q in [-7, 7]); the values travel two per byte
(:func:`pack_int4` / :func:`unpack_int4`); the torch reference computes them (the C++ kernel serves 8 bits).

Non-finite input never hides inside a scale: a block holding an inf or a NaN gets ``scale_b = NaN``
(its q are 0), so whatever dequantizes it is NaN there and the global gradient norm of the round is
non-finite: the round job's skip path (``acco_ds.core.round_job``) skips the step on every rank.

:func:`quantize_with_residual` is the error-feedback form: it quantizes ``v = x + residual`` (in fp32)
and writes what quantization lost, ``v - deq``, into ``residual`` (in place, in residual's dtype, rounded
to nearest even); a block whose ``v`` is non-finite gets its residual zeroed (that round is skipped; a NaN
kept there would poison every later round). :func:`dequantize_add` adds ``deq`` into an fp32 accumulator
(``out + deq``, each product and each sum rounded to fp32): the owner of a chunk sums every rank's
dequantized chunk that way; :func:`dequantize_sum` does that whole sum in one pass once every chunk is there
(the same bits), and stores it in the gradient buffer's dtype. The parameter path's two passes:
:func:`quantize_difference` quantizes ``new - base`` (the fp32 difference of two parameter-dtype tensors, never
materialised) and :func:`add_dequantized` writes ``base + deq`` in the parameter dtype (in place allowed), the
same bits as :func:`quantize` of the difference and :func:`dequantize_add` into an fp32 copy of the base.

Backends (``backend=`` of every public function; the ``*_ref`` functions are the torch reference):

- ``"cpp"``: the CPU extension ``acco_ds._quantize_cpu`` (csrc/quantize; OpenMP over blocks,
  ``acco_ds.ops.adamw.host_threads()`` threads: the calling thread's setting, by default
  ``torch.get_num_threads()``; the call returns when done), for CPU tensors that are contiguous,
  aligned to their element size and do not overlap one another; 8 bits (4 bits take the reference, the same
  bits). It reproduces the reference bit for bit (q, scales, residual, dequantized values, NaN bits included):
  tests/ops/test_quantize_kernel.py.
- ``"triton"``: ``acco_ds.ops.triton_kernels.quantize`` (several blocks per program up to 1024 elements a
  block, one per program beyond; 8 and 4 bits), for contiguous
  tensors that do not overlap one another; the default for CUDA tensors, launched on the current CUDA stream
  (the call returns once queued). On CPU tensors it runs only under ``TRITON_INTERPRET=1``, where
  tests/ops/test_quantize_triton.py checks it bit for bit against the reference.
- ``"ref"``: pure torch (any device; no host read of device values).
- ``None``/``"auto"``: on CPU ``"cpp"``, on CUDA ``"triton"``, where its conditions hold and it is there (the
  extension loads, triton is installed), else ``"ref"`` (the choice is logged once per device type and
  backend). A backend named explicitly raises instead of falling back.

Outputs are new tensors on x's (q's) device; ``residual`` and ``out`` are the caller's, written in place.
"""

from __future__ import annotations

import logging
import os
from typing import Tuple

import torch

from acco_ds.ops import _build
from acco_ds.ops._dtypes import ALLOWED, DTYPE_CODE, FLOATS, store_as_kernels
from acco_ds.ops.adamw import host_threads

logger = logging.getLogger(__name__)

QMAX = 127
"""Largest |q|: the int8 range is symmetric, [-127, 127] (-128 is never produced)."""

QMAX_OF = {8: QMAX, 4: 7}
"""Largest |q| per number of bits: 8 bits [-127, 127], 4 bits [-7, 7] (symmetric, -8 never produced)."""


def _check_bits(bits) -> None:
    if bits not in QMAX_OF or isinstance(bits, bool):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")


SUPPORTED_DTYPES = FLOATS

_DTYPE_CODE = DTYPE_CODE
_NO_RESIDUAL = -1
_BACKENDS = (None, "auto", "ref", "cpp", "triton")
_logged: set = set()


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks of a flat tensor of ``numel`` elements (the last one short when block_size does not divide it)."""
    return -(-numel // block_size)


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")


def _check(x: torch.Tensor, block_size: int, name: str = "x") -> None:
    _check_block_size(block_size)
    if x.dim() != 1:
        raise ValueError(f"{name} must be a flat (1-D) tensor, got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be {ALLOWED}, got {x.dtype}")


def _check_residual(x: torch.Tensor, residual: torch.Tensor, block_size: int) -> None:
    _check(x, block_size)
    _check(residual, block_size, "residual")
    if residual.numel() != x.numel() or residual.device != x.device:
        raise ValueError(
            f"residual must match x: {residual.numel()} elements on {residual.device} vs {x.numel()} on {x.device}"
        )


def _check_q(q: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    _check_block_size(block_size)
    if q.dtype != torch.int8 or q.dim() != 1:
        raise TypeError(f"q must be a flat int8 tensor, got {q.dtype} of shape {tuple(q.shape)}")
    if scales.dtype != torch.float32 or scales.numel() != num_blocks(q.numel(), block_size):
        raise ValueError(
            f"scales must be fp32 with {num_blocks(q.numel(), block_size)} elements for {q.numel()} values in "
            f"blocks of {block_size}, got {scales.dtype} with {scales.numel()}"
        )


def _check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    if out.dtype != torch.float32 or out.dim() != 1 or out.numel() != q.numel() or out.device != q.device:
        raise ValueError(
            f"out must be a flat fp32 tensor of q's length and device ({q.numel()} on {q.device}), got "
            f"{out.dtype} of shape {tuple(out.shape)} on {out.device}"
        )


# -- the torch reference ----------------------------------------------------------------------------------
def _blocks(v: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 ``v`` padded with zeros to whole blocks, as [blocks, block_size] (a view when no padding)."""
    n = v.numel()
    nb = num_blocks(n, block_size)
    if nb * block_size != n:
        v = torch.nn.functional.pad(v, (0, nb * block_size - n))
    return v.view(nb, block_size)


def _scales(blocks: torch.Tensor, qmax: int = QMAX) -> torch.Tensor:
    """fp32 [blocks]: absmax / qmax rounded up to fp32; NaN for a block with a non-finite value."""
    absmax = blocks.abs().amax(dim=1)
    wide = absmax.double() / qmax
    scale = wide.float()
    # round up: the next fp32 above where rounding to nearest went below (a no-op where exact)
    scale = torch.where(
        scale.double() < wide, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale
    )
    finite = torch.isfinite(blocks).all(dim=1)
    return torch.where(finite, scale, torch.full_like(scale, float("nan")))


def _quantize_fp32(v: torch.Tensor, block_size: int, bits: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [n], scales fp32 [blocks]) of an fp32 flat ``v``, q in [-qmax, qmax] of ``bits``."""
    n = v.numel()
    qmax = QMAX_OF[bits]
    blocks = _blocks(v, block_size)
    scale = _scales(blocks, qmax)
    usable = (scale > 0) & torch.isfinite(scale)
    div = torch.where(usable, scale, torch.ones_like(scale)).unsqueeze(1)
    q = torch.round(blocks / div).clamp_(-qmax, qmax)
    q = torch.where(usable.unsqueeze(1), q, torch.zeros_like(q))
    return q.to(torch.int8).reshape(-1)[:n], scale


def quantize_ref(x: torch.Tensor, block_size: int, bits: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`quantize` (validates the same way)."""
    _check(x, block_size)
    _check_bits(bits)
    return _quantize_fp32(x.float(), block_size, bits)


def dequantize_ref(q: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pure-torch reference of :func:`dequantize` (validates the same way)."""
    _check_q(q, scales, block_size)
    n = q.numel()
    blocks = _blocks(q.float(), block_size)
    return (blocks * scales.unsqueeze(1)).reshape(-1)[:n]


def dequantize_add_ref(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    """Pure-torch reference of :func:`dequantize_add` (validates the same way)."""
    _check_q(q, scales, block_size)
    _check_out(out, q)
    out.add_(dequantize_ref(q, scales, block_size))


def _check_rows(q: torch.Tensor, scales: torch.Tensor, block_size: int, order) -> list:
    """Validate W ranks' quantized rows (``q`` int8 ``[rows, n]``, ``scales`` fp32 ``[rows, blocks]``) and the order
    they are summed in; returns the order as a list of ints."""
    _check_block_size(block_size)
    if q.dtype != torch.int8 or q.dim() != 2:
        raise TypeError(f"q must be an int8 [rows, n] tensor, got {q.dtype} of shape {tuple(q.shape)}")
    rows, n = q.shape
    nb = num_blocks(n, block_size)
    if scales.dtype != torch.float32 or tuple(scales.shape) != (rows, nb):
        raise ValueError(
            f"scales must be fp32 of shape ({rows}, {nb}) for q of shape {tuple(q.shape)} in blocks of {block_size}, "
            f"got {scales.dtype} of shape {tuple(scales.shape)}"
        )
    order = list(range(rows)) if order is None else [int(r) for r in order]
    if not order or len(set(order)) != len(order) or not all(0 <= r < rows for r in order):
        raise ValueError(f"order must name distinct rows of q (0 to {rows - 1}), at least one; got {order}")
    return order


def _check_sum(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int, order) -> list:
    """Validate :func:`dequantize_sum`'s arguments; returns the row order as a list of ints."""
    order = _check_rows(q, scales, block_size, order)
    _check(out, block_size, "out")
    n = q.shape[1]
    if out.numel() != n or out.device != q.device or scales.device != q.device:
        raise ValueError(
            f"out must have q's row length and device ({n} on {q.device}), got {out.numel()} on {out.device}; "
            f"scales on {scales.device}"
        )
    return order


def _order_on(order: list, device: torch.device) -> torch.Tensor:
    """The summation order as an int64 tensor on ``device`` for a Triton launch (on CUDA copied from pinned memory
    without blocking the host, on the current stream)."""
    t = torch.tensor(order, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def dequantize_sum_ref(
    out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int, order=None
) -> None:
    """Pure-torch reference of :func:`dequantize_sum` (validates the same way): :func:`dequantize_ref` of the
    first row, :func:`dequantize_add_ref` of each next one, then stored into ``out`` by :func:`store_sum`."""
    order = _check_sum(out, q, scales, block_size, order)
    total = dequantize_ref(q[order[0]], scales[order[0]], block_size)
    for r in order[1:]:
        dequantize_add_ref(total, q[r], scales[r], block_size)
    store_sum(out, total)


def store_sum(out: torch.Tensor, total: torch.Tensor) -> None:
    """``out <- total`` (fp32) in out's dtype by the kernels' rule (acco_ds.ops._dtypes.store_as_kernels: round to
    nearest even; a NaN in bf16 0x7FC0, in fp16 a quiet NaN with its sign and payload's top bits): what
    :func:`dequantize_sum` stores; for a sum built by :func:`dequantize_add` as chunks arrive. No host sync."""
    store_as_kernels(out, total)


def _check_difference(new: torch.Tensor, base: torch.Tensor, block_size: int) -> None:
    _check(new, block_size, "new")
    _check(base, block_size, "base")
    if base.numel() != new.numel() or base.device != new.device or base.dtype != new.dtype:
        raise ValueError(
            f"base must match new: {base.numel()} {base.dtype} on {base.device} vs {new.numel()} {new.dtype} on "
            f"{new.device}"
        )


def quantize_difference_ref(
    new: torch.Tensor, base: torch.Tensor, block_size: int, bits: int = 8
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`quantize_difference` (validates the same way)."""
    _check_difference(new, base, block_size)
    _check_bits(bits)
    return _quantize_fp32(new.float() - base.float(), block_size, bits)


def add_dequantized_ref(
    out: torch.Tensor, base: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int
) -> None:
    """Pure-torch reference of :func:`add_dequantized` (validates the same way)."""
    _check_add(out, base, q, scales, block_size)
    total = base.to(torch.float32, copy=True)
    dequantize_add_ref(total, q, scales, block_size)
    store_sum(out, total)


def _check_add(out: torch.Tensor, base: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int):
    _check_q(q, scales, block_size)
    _check(base, block_size, "base")
    _check(out, block_size, "out")
    if base.numel() != q.numel() or out.numel() != q.numel() or out.dtype != base.dtype:
        raise ValueError(
            f"out and base must be of q's length ({q.numel()}) and one dtype, got {out.numel()} {out.dtype} and "
            f"{base.numel()} {base.dtype}"
        )
    if len({out.device, base.device, q.device, scales.device}) != 1:
        raise ValueError("out, base, q and scales must be on one device")


def quantize_with_residual_ref(
    x: torch.Tensor, residual: torch.Tensor, block_size: int, bits: int = 8
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`quantize_with_residual` (validates the same way; ``residual`` may even
    alias x here, since v is computed whole before residual is written)."""
    _check_residual(x, residual, block_size)
    _check_bits(bits)
    v = x.float() + residual.float()
    q, scale = _quantize_fp32(v, block_size, bits)
    lost = v - dequantize_ref(q, scale, block_size)
    finite = torch.isfinite(scale).repeat_interleave(block_size)[: x.numel()]
    residual.copy_(torch.where(finite, lost, torch.zeros_like(lost)))
    return q, scale


# -- dispatch ----------------------------------------------------------------------------------------------
def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of the contiguous tensors ``a`` and ``b`` overlaps."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _layout_obstacle(tensors: dict) -> str:
    """Why a kernel cannot take ``tensors`` ({argument name: tensor}) as they lie in memory; "" when it can."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            return f"{name} is not contiguous (stride {t.stride()})"
        if t.numel() and t.data_ptr() % t.element_size():
            return f"{name} is not aligned to its element size"
    names = list(tensors)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if _overlap(tensors[a], tensors[b]):
                return f"{a} and {b} overlap in memory"
    return ""


def _cpp_obstacle(tensors: dict) -> str:
    """Why the CPU extension cannot run on ``tensors``; "" when it can."""
    for name, t in tensors.items():
        if t.device.type != "cpu":
            return f"{name} is on {t.device}, the CPU extension takes CPU tensors only"
    return _layout_obstacle(tensors) or _build.why_missing("quantize_cpu")


def _triton_obstacle(tensors: dict) -> str:
    """Why the Triton kernels cannot run on ``tensors``; "" when they can."""
    device = next(iter(tensors.values())).device
    if any(t.device != device for t in tensors.values()):
        return "the tensors are on different devices"
    if device.type not in ("cuda", "cpu"):
        return f"no Triton kernel for device type {device.type}"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "CPU tensors need TRITON_INTERPRET=1 in the environment before triton is first imported (the Triton "
            "interpreter)"
        )
    if device.type == "cuda":
        why = _build.triton_obstacle(device)
        if why:
            return why
    elif not _triton_available():
        return "triton is not installed"
    return _layout_obstacle(tensors)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _pick(fn: str, backend: str | None, bits: int, **tensors: torch.Tensor) -> str:
    """The backend that runs ``fn``: "cpp", "triton" or "ref" (see the module docstring)."""
    if backend not in _BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {_BACKENDS}, got {backend!r}.")
    if backend == "ref":
        return "ref"
    if backend == "triton":
        why = _triton_obstacle(tensors)
        if why:
            raise ValueError(f"{fn}: backend='triton' cannot run: {why}.")
        return "triton"
    if backend == "cpp":
        if not _build.available("quantize_cpu"):
            raise RuntimeError(f"{fn}: backend='cpp' requested but {_build.why_missing('quantize_cpu')}")
        why = _cpp_obstacle(tensors)
        if why:
            raise ValueError(f"{fn}: backend='cpp' cannot run: {why}.")
        return "cpp" if bits == 8 else "ref"
    device = next(iter(tensors.values())).device.type
    kernel, why = (
        ("cpp", _cpp_obstacle(tensors)) if device == "cpu" else ("triton", _triton_obstacle(tensors))
    )
    chosen = "ref" if why or (kernel == "cpp" and bits != 8) else kernel
    if (device, chosen) not in _logged:
        _logged.add((device, chosen))
        missing = device == "cpu" and not _build.available("quantize_cpu")
        (logger.warning if missing else logger.info)(
            "acco_ds quantize on %s: using the %s backend%s", device, chosen, f" ({why})" if why else ""
        )
    return chosen


def _new_outputs(x: torch.Tensor, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
    return q, torch.empty(num_blocks(x.numel(), block_size), dtype=torch.float32, device=x.device)


def _check_outputs(out, x: torch.Tensor, block_size: int, *others: torch.Tensor) -> None:
    """``out`` of :func:`quantize` / :func:`quantize_with_residual`: None, or (q, scales) to write: int8 of x's
    length and fp32 of its block count, contiguous, on x's device, overlapping neither x nor ``others``."""
    if out is None:
        return
    if not (
        isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
    ):
        raise TypeError(f"out must be a (q, scales) pair of tensors, got {type(out).__name__}")
    q, scales = out
    want = (
        (q, "q", torch.int8, x.numel()),
        (scales, "scales", torch.float32, num_blocks(x.numel(), block_size)),
    )
    for t, name, dtype, n in want:
        if (
            t.dtype != dtype
            or t.dim() != 1
            or t.numel() != n
            or t.device != x.device
            or not t.is_contiguous()
        ):
            raise ValueError(
                f"out's {name} must be a contiguous flat {dtype} tensor of {n} elements on {x.device}, got "
                f"{t.dtype} of shape {tuple(t.shape)} on {t.device}"
            )
        for other in (x, *others):
            if _overlap(t, other):
                raise ValueError(f"out's {name} overlaps an input")
    if _overlap(q, scales):
        raise ValueError("out's q and scales overlap")


def _fill(out, q: torch.Tensor, scales: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scales), copied into ``out`` when given (the reference computes new tensors)."""
    if out is None:
        return q, scales
    out[0].copy_(q)
    out[1].copy_(scales)
    return out[0], out[1]


def _quantize_cpp(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    block_size: int,
    base: torch.Tensor | None = None,
    out: Tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """(q, scales) from the CPU extension, written into ``out`` when given (checked by :func:`_check_outputs`);
    ``residual`` (or None) updated in place; with ``base`` (no residual) the values quantized are ``x - base``."""
    q, scales = out if out is not None else _new_outputs(x, block_size)
    if x.numel() and base is not None:
        _build.load("quantize_cpu").quantize_difference_cpu(
            x.data_ptr(),
            base.data_ptr(),
            _DTYPE_CODE[x.dtype],
            x.numel(),
            block_size,
            q.data_ptr(),
            scales.data_ptr(),
            host_threads(),
        )
    elif x.numel():
        _build.load("quantize_cpu").quantize_cpu(
            x.data_ptr(),
            _DTYPE_CODE[x.dtype],
            0 if residual is None else residual.data_ptr(),
            _NO_RESIDUAL if residual is None else _DTYPE_CODE[residual.dtype],
            x.numel(),
            block_size,
            q.data_ptr(),
            scales.data_ptr(),
            host_threads(),
        )
    return q, scales


def _dequantize_cpp(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int, add: bool):
    """``out (+)= q * scale`` by the CPU extension (``out`` allocated or owned by the caller)."""
    if q.numel():
        _build.load("quantize_cpu").dequantize_cpu(
            q.data_ptr(),
            scales.data_ptr(),
            q.numel(),
            block_size,
            out.data_ptr(),
            add,
            host_threads(),
        )


def _tile(block_size: int) -> int:
    """Elements a Triton program handles per step: the block size rounded up to a power of two, 16 to 1024."""
    return min(1024, max(16, 1 << (block_size - 1).bit_length()))


_ROW_TILE_ELEMS = 2048  # elements a program of the row kernels handles: blocks of <= 1024, several a program


def _rows(block_size: int) -> int:
    """Blocks per program of the row kernels (a power of two), 0 for blocks longer than a tile (one a program)."""
    tile = _tile(block_size)
    return _ROW_TILE_ELEMS // tile if block_size <= tile else 0


def _quantize_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    block_size: int,
    bits: int,
    base: torch.Tensor | None = None,
    out: Tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """(q, scales) from the Triton kernel, queued on x's device, written into ``out`` when given; ``residual``
    (or None) updated in place; with ``base`` (no residual) the values quantized are ``x - base``."""
    from acco_ds.ops.triton_kernels import quantize as kernels  # imports triton: only once a launch is due

    q, scales = out if out is not None else _new_outputs(x, block_size)
    nb = num_blocks(x.numel(), block_size)
    if nb:
        second = residual if base is None else base  # the kernels' second operand: added, or subtracted
        flags = dict(
            QMAX=QMAX_OF[bits],
            TILE=_tile(block_size),
            X_DT=_DTYPE_CODE[x.dtype],
            HAS_RES=residual is not None,
            RES_DT=_DTYPE_CODE[x.dtype if second is None else second.dtype],
            SUB=base is not None,
            enable_fp_fusion=False,  # v - q * scale rounded twice, as the reference (no FMA): the same bits
        )
        args = (x, x if second is None else second, q, scales, x.numel())
        rows = _rows(block_size)
        if rows:
            kernels.quantize_rows[(-(-nb // rows),)](*args, nb, block_size, ROWS=rows, **flags)
        else:
            kernels.quantize_blocks[(nb,)](*args, block_size, **flags)
    return q, scales


def _dequantize_triton(out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int, add: bool):
    """``out (+)= q * scale`` by the Triton kernel, queued on q's device."""
    from acco_ds.ops.triton_kernels import quantize as kernels

    nb = num_blocks(q.numel(), block_size)
    if not nb:
        return
    tile, rows = _tile(block_size), _rows(block_size)
    if rows:
        kernels.dequantize_rows[(-(-nb // rows),)](
            q,
            scales,
            out,
            out,
            q.numel(),
            nb,
            block_size,
            TILE=tile,
            ROWS=rows,
            ADD=add,
            DT=0,
            enable_fp_fusion=False,
        )
    else:
        kernels.dequantize_blocks[(nb,)](
            q, scales, out, q.numel(), block_size, TILE=tile, ADD=add, enable_fp_fusion=False
        )


# -- the public functions ----------------------------------------------------------------------------------
def _dequantize_sum_triton(
    out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int, order: list
):
    """:func:`dequantize_sum` by the Triton kernel, queued on q's device."""
    from acco_ds.ops.triton_kernels import quantize as kernels

    n = q.shape[1]
    nb = num_blocks(n, block_size)
    if not nb:
        return
    rows = _rows(block_size)
    if not rows:  # blocks longer than a tile: the unfused kernels, row by row (the same operations)
        total = torch.empty(n, dtype=torch.float32, device=q.device)
        _dequantize_triton(total, q[order[0]], scales[order[0]], block_size, add=False)
        for r in order[1:]:
            _dequantize_triton(total, q[r], scales[r], block_size, add=True)
        store_sum(out, total)
        return
    kernels.dequantize_sum_rows[(-(-nb // rows),)](
        q,
        scales,
        _order_on(order, q.device),
        out,
        n,
        nb,
        block_size,
        len(order),
        TILE=_tile(block_size),
        ROWS=rows,
        OUT_DT=_DTYPE_CODE[out.dtype],
        enable_fp_fusion=False,
    )


def quantize(
    x: torch.Tensor,
    block_size: int,
    *,
    bits: int = 8,
    backend: str | None = None,
    out: Tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize the flat fp32/bf16/fp16 tensor ``x``: returns ``(q, scales)``, q int8 of x's length (values in
    [-qmax, qmax] of ``bits``: 8 or 4), scales fp32 of ``num_blocks(len(x), block_size)``, both new tensors on
    x's device (see the module docstring), or ``out``'s (a (q, scales) pair of those dtypes and lengths, e.g.
    rows of a wider buffer, written in place)."""
    _check(x, block_size)
    _check_bits(bits)
    _check_outputs(out, x, block_size)
    how = _pick("quantize", backend, bits, x=x)
    if how == "cpp":
        return _quantize_cpp(x, None, block_size, out=out)
    if how == "triton":
        return _quantize_triton(x, None, block_size, bits, out=out)
    return _fill(out, *quantize_ref(x, block_size, bits))


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, block_size: int, *, backend: str | None = None
) -> torch.Tensor:
    """fp32 ``q * scale`` of its block, per element (a new tensor of q's length, on q's device)."""
    _check_q(q, scales, block_size)
    how = _pick("dequantize", backend, 8, q=q, scales=scales)
    if how == "ref":
        return dequantize_ref(q, scales, block_size)
    out = torch.empty(q.numel(), dtype=torch.float32, device=q.device)
    if how == "cpp":
        _dequantize_cpp(out, q, scales, block_size, add=False)
    else:
        _dequantize_triton(out, q, scales, block_size, add=False)
    return out


def dequantize_add(
    out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int, *, backend: str | None = None
) -> None:
    """``out += dequantize(q, scales, block_size)`` in place, in one pass: ``out`` flat fp32 of q's length on
    q's device, not overlapping q or scales (each product and each sum rounded to fp32)."""
    _check_q(q, scales, block_size)
    _check_out(out, q)
    how = _pick("dequantize_add", backend, 8, out=out, q=q, scales=scales)
    if how == "cpp":
        _dequantize_cpp(out, q, scales, block_size, add=True)
    elif how == "triton":
        _dequantize_triton(out, q, scales, block_size, add=True)
    else:
        dequantize_add_ref(out, q, scales, block_size)


def dequantize_sum(
    out: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    order=None,
    *,
    backend: str | None = None,
) -> None:
    """The owner's sum of the ranks' quantized chunks, in one pass over them: ``out = sum over r in order of
    q[r] * scales[r]`` (per block), in fp32 (the first row's products, then each next row's added: every product
    and every sum rounded to fp32, exactly :func:`dequantize` then :func:`dequantize_add` row by row), stored in
    ``out``'s dtype (fp32, or bf16 / fp16 rounded to nearest even, NaNs by :func:`store_sum`'s rule). ``q`` int8 ``[rows, n]``, ``scales``
    fp32 ``[rows, num_blocks(n)]``, ``out`` flat of n on their device, not overlapping them; ``order``: distinct
    row indices (default every row, 0 first). It reads each quantized value once and writes ``out`` once, where
    the unfused path writes and re-reads an fp32 total per row. Triton runs blocks of at most 1024 in one kernel,
    longer blocks row by row through an fp32 total (the same bits)."""
    order = _check_sum(out, q, scales, block_size, order)
    how = _pick("dequantize_sum", backend, 8, out=out, q=q, scales=scales)
    if how == "cpp":
        if q.shape[1]:
            _build.load("quantize_cpu").dequantize_sum_cpu(
                [q[r].data_ptr() for r in order],
                [scales[r].data_ptr() for r in order],
                q.shape[1],
                block_size,
                out.data_ptr(),
                _DTYPE_CODE[out.dtype],
                host_threads(),
            )
    elif how == "triton":
        _dequantize_sum_triton(out, q, scales, block_size, order)
    else:
        dequantize_sum_ref(out, q, scales, block_size, order)


def quantize_difference(
    new: torch.Tensor, base: torch.Tensor, block_size: int, *, bits: int = 8, backend: str | None = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A parameter difference in one pass: ``(q, scales)`` of ``v = new - base`` (both flat, one dtype, fp32,
    bf16 or fp16; the difference in fp32, one rounding), as :func:`quantize` of that difference would give, without
    materialising it. ``base`` is only read and must not overlap ``new``."""
    _check_difference(new, base, block_size)
    _check_bits(bits)
    how = _pick("quantize_difference", backend, bits, new=new, base=base)
    if how == "cpp":
        return _quantize_cpp(new, None, block_size, base=base)
    if how == "triton":
        return _quantize_triton(new, None, block_size, bits, base=base)
    return quantize_difference_ref(new, base, block_size, bits)


def add_dequantized(
    out: torch.Tensor,
    base: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    *,
    backend: str | None = None,
) -> None:
    """A parameter difference applied in one pass: ``out = base + dequantize(q, scales)`` in fp32 (the product,
    then the sum, one rounding each), stored in base's dtype (fp32, or bf16 / fp16 by :func:`store_sum`'s rule). ``out``
    and ``base``: flat, q's length, one dtype; ``out`` may be ``base`` itself (in place) but overlap nothing else."""
    _check_add(out, base, q, scales, block_size)
    tensors = (
        dict(out=out, q=q, scales=scales)
        if out.data_ptr() == base.data_ptr()
        else dict(out=out, base=base, q=q, scales=scales)
    )
    how = _pick("add_dequantized", backend, 8, **tensors)
    if not q.numel():
        return
    if how == "ref":
        add_dequantized_ref(out, base, q, scales, block_size)
        return
    if how == "cpp":
        _build.load("quantize_cpu").add_dequantized_cpu(
            q.data_ptr(),
            scales.data_ptr(),
            base.data_ptr(),
            out.data_ptr(),
            _DTYPE_CODE[out.dtype],
            q.numel(),
            block_size,
            host_threads(),
        )
        return
    nb = num_blocks(q.numel(), block_size)
    rows = _rows(block_size)
    if not rows:  # blocks longer than a tile: the unfused kernels through an fp32 total (the same bits)
        total = base.to(torch.float32, copy=True)
        _dequantize_triton(total, q, scales, block_size, add=True)
        store_sum(out, total)
        return
    from acco_ds.ops.triton_kernels import quantize as kernels

    kernels.dequantize_rows[(-(-nb // rows),)](
        q,
        scales,
        base,
        out,
        q.numel(),
        nb,
        block_size,
        TILE=_tile(block_size),
        ROWS=rows,
        ADD=True,
        DT=_DTYPE_CODE[out.dtype],
        enable_fp_fusion=False,
    )


def quantize_with_residual(
    x: torch.Tensor,
    residual: torch.Tensor,
    block_size: int,
    *,
    bits: int = 8,
    backend: str | None = None,
    out: Tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Error feedback: quantize ``v = x + residual`` (fp32 arithmetic) and set ``residual`` to ``v -
    dequantize(q, scales)`` in place (rounded to residual's dtype); a block with a non-finite ``v`` gets
    scale NaN and its residual zeroed. ``residual``: same length and device as x, fp32, bf16 or fp16, not
    aliasing x (an overlap takes the torch reference). Returns ``(q, scales)`` as :func:`quantize` (``out``
    likewise)."""
    _check_residual(x, residual, block_size)
    _check_bits(bits)
    _check_outputs(out, x, block_size, residual)
    how = _pick("quantize_with_residual", backend, bits, x=x, residual=residual)
    if how == "cpp":
        return _quantize_cpp(x, residual, block_size, out=out)
    if how == "triton":
        return _quantize_triton(x, residual, block_size, bits, out=out)
    return _fill(out, *quantize_with_residual_ref(x, residual, block_size, bits))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """The 4-bit wire form of a flat int8 ``q`` with values in [-7, 7]: ``ceil(n / 2)`` uint8, element 2i in
    the low nibble and 2i + 1 in the high one, each stored as ``q + 8`` (an odd n pads a 0)."""
    if q.dtype != torch.int8 or q.dim() != 1:
        raise TypeError(f"q must be a flat int8 tensor, got {q.dtype} of shape {tuple(q.shape)}")
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8, device=u.device)])
    pairs = u.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The flat int8 ``q`` of ``n`` values that :func:`pack_int4` packed into ``packed``."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != -(-n // 2):
        raise ValueError(
            f"packed must be flat uint8 of {-(-n // 2)} bytes for {n} values, got {packed.dtype} "
            f"of shape {tuple(packed.shape)}"
        )
    pairs = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:n]
    return (pairs.to(torch.int16) - 8).to(torch.int8)


def wire_bytes(n: int, block_size: int, bits: int) -> int:
    """Bytes ``n`` values quantized to ``bits`` take on the wire: the values (int8: one byte each; 4 bits: two
    per byte) and one fp32 scale per block."""
    _check_bits(bits)
    return (n if bits == 8 else -(-n // 2)) + 4 * num_blocks(n, block_size)
