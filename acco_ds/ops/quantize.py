"""Blockwise int8 quantization of a flat gradient, with an optional error-feedback residual.

A flat tensor ``x`` (fp32 or bf16, 1-D, any length n >= 0) is cut into blocks of ``block_size``
consecutive elements; the last block is short when ``block_size`` does not divide n. Per block b:

    scale_b = absmax_b / 127, rounded UP to fp32 (so |x_i| / scale_b <= 127 holds exactly)
    q_i     = clamp(round_half_to_even(x_i / scale_b), -127, 127)      (int8; computed in fp32)
    deq_i   = q_i * scale_b                                             (fp32)

so that ``|x_i - deq_i| <= scale_b / 2`` per element (up to the fp32 rounding of the quotient, a few
units in 2**-24 of a step). An all-zero block has ``scale_b = 0`` and ``q = 0``. Rounding the scale up
(rather than to nearest) matters only where absmax / 127 is not an fp32 value (tiny, subnormal
magnitudes): a scale rounded down could make ``|x_i| / scale_b`` exceed 127 and the clamp break the bound.

Non-finite input never hides inside a scale: a block holding an inf or a NaN gets ``scale_b = NaN``
(its q are 0), so whatever dequantizes it is NaN there and the global gradient norm of the round is
non-finite: the round job's skip path (``acco_ds.core.round_job``) skips the step on every rank.

:func:`quantize_with_residual` is the error-feedback form: it quantizes ``v = x + residual`` (in fp32)
and writes what quantization lost, ``v - deq``, into ``residual`` (in place, in residual's dtype); a
block whose ``v`` is non-finite gets its residual zeroed (that round is skipped; a NaN kept there would
poison every later round).

Implementation: pure torch (any device; no host read of device values). Fused CPU C++ / Triton / CUDA
kernels are NOT built yet: these functions define the semantics such kernels must reproduce bit for bit.
"""

from __future__ import annotations

from typing import Tuple

import torch

QMAX = 127
"""Largest |q|: the int8 range is symmetric, [-127, 127] (-128 is never produced)."""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks of a flat tensor of ``numel`` elements (the last one short when block_size does not divide it)."""
    return -(-numel // block_size)


def _check(x: torch.Tensor, block_size: int, name: str = "x") -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be a flat (1-D) tensor, got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32 or bfloat16, got {x.dtype}")


def _blocks(v: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 ``v`` padded with zeros to whole blocks, as [blocks, block_size] (a view when no padding)."""
    n = v.numel()
    nb = num_blocks(n, block_size)
    if nb * block_size != n:
        v = torch.nn.functional.pad(v, (0, nb * block_size - n))
    return v.view(nb, block_size)


def _scales(blocks: torch.Tensor) -> torch.Tensor:
    """fp32 [blocks]: absmax / 127 rounded up to fp32; NaN for a block with a non-finite value."""
    absmax = blocks.abs().amax(dim=1)
    wide = absmax.double() / QMAX
    scale = wide.float()
    # round up: the next fp32 above where rounding to nearest went below (a no-op where exact)
    scale = torch.where(
        scale.double() < wide, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale
    )
    finite = torch.isfinite(blocks).all(dim=1)
    return torch.where(finite, scale, torch.full_like(scale, float("nan")))


def _quantize_fp32(v: torch.Tensor, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [n], scales fp32 [blocks]) of an fp32 flat ``v``."""
    n = v.numel()
    blocks = _blocks(v, block_size)
    scale = _scales(blocks)
    usable = (scale > 0) & torch.isfinite(scale)
    div = torch.where(usable, scale, torch.ones_like(scale)).unsqueeze(1)
    q = torch.round(blocks / div).clamp_(-QMAX, QMAX)
    q = torch.where(usable.unsqueeze(1), q, torch.zeros_like(q))
    return q.to(torch.int8).reshape(-1)[:n], scale


def quantize(x: torch.Tensor, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize the flat fp32/bf16 tensor ``x``: returns ``(q, scales)``, q int8 of x's length, scales
    fp32 of ``num_blocks(len(x), block_size)``, both new tensors on x's device (see the module docstring)."""
    _check(x, block_size)
    return _quantize_fp32(x.float(), block_size)


def dequantize(q: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 ``q * scale`` of its block, per element (a new tensor of q's length)."""
    if q.dtype != torch.int8 or q.dim() != 1:
        raise TypeError(f"q must be a flat int8 tensor, got {q.dtype} of shape {tuple(q.shape)}")
    if scales.dtype != torch.float32 or scales.numel() != num_blocks(q.numel(), block_size):
        raise ValueError(
            f"scales must be fp32 with {num_blocks(q.numel(), block_size)} elements for {q.numel()} values in "
            f"blocks of {block_size}, got {scales.dtype} with {scales.numel()}"
        )
    n = q.numel()
    blocks = _blocks(q.float(), block_size)
    return (blocks * scales.unsqueeze(1)).reshape(-1)[:n]


def quantize_with_residual(
    x: torch.Tensor, residual: torch.Tensor, block_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Error feedback: quantize ``v = x + residual`` (fp32 arithmetic) and set ``residual`` to ``v -
    dequantize(q, scales)`` in place (rounded to residual's dtype); a block with a non-finite ``v`` gets
    scale NaN and its residual zeroed. ``residual``: same length and device as x, fp32 or bf16, not
    aliasing x. Returns ``(q, scales)`` as :func:`quantize`."""
    _check(x, block_size)
    _check(residual, block_size, "residual")
    if residual.numel() != x.numel() or residual.device != x.device:
        raise ValueError(
            f"residual must match x: {residual.numel()} elements on {residual.device} vs {x.numel()} on {x.device}"
        )
    v = x.float() + residual.float()
    q, scale = _quantize_fp32(v, block_size)
    lost = v - dequantize(q, scale, block_size)
    finite = torch.isfinite(scale).repeat_interleave(block_size)[: x.numel()]
    residual.copy_(torch.where(finite, lost, torch.zeros_like(lost)))
    return q, scale
