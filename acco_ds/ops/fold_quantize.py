"""The round's last accumulation with its quantization, in one pass: the fused round end of a compressed round.

The buffer is a round's flat gradient buffer (fp32, bf16 or fp16, 1-D, ``W * chunk`` elements), quantized as
``acco_ds.core.compressed_comm`` does: blocks of ``block_size`` elements cut inside each rank's ``chunk``-sized
slice, the last block of a chunk short. Block ``j`` of chunk ``c`` covers ``[c * chunk + j * block_size,
c * chunk + min((j + 1) * block_size, chunk))``; its global index is ``c * nb + j`` with ``nb = num_blocks(chunk,
block_size)``, which is also where its scale lies in the flat ``scales`` (``W * nb`` fp32) and ``q`` (int8, the
buffer's length) is the int8 values at the buffer's own positions: the ``[W, chunk]`` rows the exchange sends.

:func:`fold_quantize` takes ONE parameter's gradient of the round's last micro-batch (``grad``, fp32, bf16 or fp16,
contiguous, landing at ``[offset, offset + numel)`` of the buffer). For every block that lies wholly inside that
range it computes

    v_i = float(cast_buffer(float(buffer_i) + float(grad_i))) + float(residual_i)     (residual: when given)

and quantizes the block as ``acco_ds.ops.quantize.quantize_with_residual`` (or ``quantize`` without a residual)
would quantize ``buffer`` after ``accumulate_grads`` added the gradient into it: q, the block's scale and the
residual (``v - q * scale`` in residual's dtype, 0 in a non-finite block) bit for bit the same. The buffer is NOT
written there: its accumulated value is dead once quantized (the exchange sends q). Blocks the range only partly
covers (a parameter's ends; the chunk ends inside a parameter do not cut blocks apart) get the plain accumulation,
``buffer_i = cast_buffer(float(buffer_i) + float(grad_i))`` (``accumulate_grads``' rule), and are quantized later
by :func:`quantize_listed_blocks`, once every parameter sharing them has folded its gradient.

:func:`quantize_listed_blocks` quantizes the listed blocks (an int64 tensor of global block indices, on the
buffer's device) from the buffer and the residual, as ``quantize_with_residual`` of each block would: the blocks
no fused fold quantized (shared by two parameters or a parameter and the padding, padding only, or of a parameter
that received no gradient in the last micro-batch).

Together, the folds of every parameter of the last micro-batch then :func:`quantize_listed_blocks` of the rest give
exactly the q, scales and residual of ``accumulate_grads`` of every gradient followed by ``quantize_with_residual``
of each chunk (tests/ops/test_fold_quantize.py), reading the buffer's accumulated value and the gradient once and
never writing the buffer where a block is fused: 4 of the 7 bytes per bf16 element of the separate quantize pass
(the accumulation's write and the quantization's read of the buffer) are saved.

Backends (``backend=``; the ``*_ref`` functions are the torch reference and the oracle):

- ``"cpp"``: the CPU extension ``acco_ds._quantize_cpu`` (``fold_quantize_cpu``, ``quantize_listed_blocks_cpu``;
  OpenMP over blocks, ``torch.get_num_threads()`` threads), 8 and 4 bits, bit for bit the reference; the default
  for CPU tensors.
- ``"triton"``: ``acco_ds.ops.triton_kernels.fold_quantize`` (one program per block, queued on the current CUDA
  stream); the default for CUDA tensors. On CPU tensors only under ``TRITON_INTERPRET=1``.
- ``"ref"``: pure torch (any device).

Streams and ownership: the caller's stream (the compute stream: the fused round end runs inside the last
backward, in the gradient hooks, ``acco_ds.core.fused_round_end``); the caller owns every tensor and keeps
``grad`` alive until the stream has run. ``residual`` must not be touched by another stream meanwhile (the
pipeline waits for the previous job's release of it first).
"""

from __future__ import annotations

import logging
import os
from typing import List, Tuple

import torch

from acco_ds.ops import _build
from acco_ds.ops._dtypes import ALLOWED, DTYPE_CODE, FLOATS
from acco_ds.ops.quantize import (
    QMAX_OF,
    _check_bits,
    _check_block_size,
    _overlap,
    num_blocks,
    quantize_ref,
    quantize_with_residual_ref,
)

logger = logging.getLogger(__name__)

_FLOATS = FLOATS
_DTYPE_CODE = DTYPE_CODE
_NO_RESIDUAL = -1
_BACKENDS = (None, "auto", "ref", "cpp", "triton")


# -- geometry --------------------------------------------------------------------------------------------------
def covered_blocks(offset: int, numel: int, chunk: int, block_size: int) -> List[Tuple[int, int, int, int]]:
    """The blocks ``[offset, offset + numel)`` lies over, chunk by chunk: a list of ``(first, stop, inner_first,
    inner_stop)`` global block indices, one entry per chunk the range touches: the blocks it touches are ``first ..
    stop - 1``, those it covers whole ``inner_first .. inner_stop - 1`` (an empty range when none)."""
    nb = num_blocks(chunk, block_size)
    out = []
    end = offset + numel
    c = offset // chunk
    while numel > 0 and c * chunk < end:
        lo = max(offset, c * chunk) - c * chunk
        hi = min(end, (c + 1) * chunk) - c * chunk
        first, stop = lo // block_size, -(-hi // block_size)
        inner_first = -(-lo // block_size)
        inner_stop = nb if hi == chunk else hi // block_size
        inner_stop = max(inner_stop, inner_first)
        out.append((c * nb + first, c * nb + stop, c * nb + inner_first, c * nb + inner_stop))
        c += 1
    return out


def block_span(block: int, chunk: int, block_size: int) -> Tuple[int, int]:
    """``[start, stop)`` in the buffer of global block ``block``."""
    nb = num_blocks(chunk, block_size)
    c, j = divmod(block, nb)
    return c * chunk + j * block_size, c * chunk + min((j + 1) * block_size, chunk)


# -- checks ----------------------------------------------------------------------------------------------------
def _check_float(fn: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{fn}: {name} has dtype {t.dtype}; allowed: {ALLOWED}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (stride {t.stride()})")


def _check_rows(fn: str, buffer, chunk: int, residual, q, scales, block_size: int, bits: int) -> int:
    """Validate the buffer and its quantized rows; returns the blocks per chunk."""
    _check_block_size(block_size)
    _check_bits(bits)
    _check_float(fn, "buffer", buffer)
    if buffer.dim() != 1:
        raise ValueError(f"{fn}: buffer must be flat (1-D), got shape {tuple(buffer.shape)}")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1 or buffer.numel() % chunk:
        raise ValueError(
            f"{fn}: chunk must be an integer >= 1 dividing the buffer's {buffer.numel()} elements, got {chunk!r}"
        )
    nb = num_blocks(chunk, block_size)
    world = buffer.numel() // chunk
    if residual is not None:
        _check_float(fn, "residual", residual)
        if residual.dim() != 1 or residual.numel() != buffer.numel() or residual.device != buffer.device:
            raise ValueError(
                f"{fn}: residual must be flat like the buffer ({buffer.numel()} elements on {buffer.device}), got "
                f"shape {tuple(residual.shape)} on {residual.device}"
            )
    if q.dtype != torch.int8 or q.dim() != 1 or q.numel() != buffer.numel() or not q.is_contiguous():
        raise ValueError(
            f"{fn}: q must be a contiguous flat int8 tensor of the buffer's {buffer.numel()} elements, got "
            f"{q.dtype} of shape {tuple(q.shape)}"
        )
    if (
        scales.dtype != torch.float32
        or scales.dim() != 1
        or scales.numel() != world * nb
        or not scales.is_contiguous()
    ):
        raise ValueError(
            f"{fn}: scales must be a contiguous flat fp32 tensor of {world * nb} elements ({world} chunks of {nb} "
            f"blocks), got {scales.dtype} of shape {tuple(scales.shape)}"
        )
    if q.device != buffer.device or scales.device != buffer.device:
        raise ValueError(f"{fn}: q and scales must be on the buffer's device {buffer.device}")
    named = {"buffer": buffer, "q": q, "scales": scales}
    if residual is not None:
        named["residual"] = residual
    names = list(named)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if _overlap(named[a], named[b]):
                raise ValueError(f"{fn}: {a} and {b} overlap in memory")
    return nb


def _spans(**tensors) -> list:
    """``(name, first byte, end byte)`` of each given non-empty tensor: what a gradient must not overlap."""
    return [
        (name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for name, t in tensors.items()
        if t is not None and t.numel()
    ]


def _check_grad(fn: str, grad, offset, buffer, spans: list) -> None:
    """The gradient of a fold: fp32/bf16/fp16, contiguous, on the buffer's device, fitting at ``offset``, overlapping none
    of ``spans`` (:func:`_spans` of the buffer and the rows). The common case costs a few attribute reads."""
    if not isinstance(grad, torch.Tensor) or grad.dtype not in _FLOATS or not grad.is_contiguous():
        _check_float(fn, "grad", grad)
    if grad.device != buffer.device:
        raise ValueError(f"{fn}: grad is on {grad.device}, the buffer on {buffer.device}; use one device")
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise TypeError(f"{fn}: offset must be an int, got {type(offset).__name__}")
    if offset < 0 or offset + grad.numel() > buffer.numel():
        raise ValueError(
            f"{fn}: grad ({grad.numel()} elements at offset {offset}) does not fit in the buffer of "
            f"{buffer.numel()} elements"
        )
    if grad.numel():
        lo = grad.data_ptr()
        hi = lo + grad.numel() * grad.element_size()
        for name, a, b in spans:
            if lo < b and a < hi:
                raise ValueError(f"{fn}: grad and {name} overlap in memory")


def _check_fold(fn: str, buffer, grad, offset, chunk, residual, q, scales, block_size, bits) -> int:
    nb = _check_rows(fn, buffer, chunk, residual, q, scales, block_size, bits)
    _check_grad(fn, grad, offset, buffer, _spans(buffer=buffer, q=q, scales=scales, residual=residual))
    return nb


def _row_args(buffer, chunk: int, residual, q, scales, block_size: int, bits: int) -> tuple:
    """The CPU extension's arguments describing a round's buffer and rows, in its entry points' order (after which
    ``fold_quantize_cpu`` takes its gradient and ``quantize_listed_blocks_cpu`` its blocks)."""
    return (
        buffer.data_ptr(),
        _DTYPE_CODE[buffer.dtype],
        chunk,
        buffer.numel() // chunk,
        0 if residual is None else residual.data_ptr(),
        _NO_RESIDUAL if residual is None else _DTYPE_CODE[residual.dtype],
        q.data_ptr(),
        scales.data_ptr(),
        block_size,
        QMAX_OF[bits],
    )


def _check_blocks(fn: str, blocks, buffer, nb: int) -> None:
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.int64 or blocks.dim() != 1:
        raise TypeError(f"{fn}: blocks must be a flat int64 tensor of block indices, got {blocks!r:.80}")
    if blocks.device != buffer.device or not blocks.is_contiguous():
        raise ValueError(f"{fn}: blocks must be contiguous and on the buffer's device {buffer.device}")


# -- the torch reference ---------------------------------------------------------------------------------------
def _quantize_span(
    x, residual, q, scales, s0: int, s1: int, lo: int, hi: int, block_size: int, bits: int
) -> None:
    """Blocks ``s0 .. s1 - 1`` (elements ``lo .. hi - 1``, block-aligned in one chunk) of the fp32/buffer-dtype
    values ``x`` (the span's own values): q, scales and the residual written as quantize_with_residual_ref would."""
    if residual is None:
        got_q, got_s = quantize_ref(x, block_size, bits)
    else:
        got_q, got_s = quantize_with_residual_ref(x, residual[lo:hi], block_size, bits)
    q[lo:hi].copy_(got_q)
    scales[s0:s1].copy_(got_s)


def fold_quantize_ref(
    buffer, grad, offset: int, chunk: int, residual, q, scales, block_size: int, bits: int = 8
) -> None:
    """Pure-torch reference of :func:`fold_quantize` (validates the same way)."""
    _check_fold("fold_quantize_ref", buffer, grad, offset, chunk, residual, q, scales, block_size, bits)
    g = grad.reshape(-1)
    for first, stop, inner_first, inner_stop in covered_blocks(offset, g.numel(), chunk, block_size):
        lo = max(offset, block_span(first, chunk, block_size)[0])
        hi = min(offset + g.numel(), block_span(stop - 1, chunk, block_size)[1])
        a = block_span(inner_first, chunk, block_size)[0] if inner_stop > inner_first else hi
        b = block_span(inner_stop - 1, chunk, block_size)[1] if inner_stop > inner_first else hi
        for e0, e1 in ((lo, a), (b, hi)):  # the ends: accumulated, quantized later
            if e1 > e0:
                dst = buffer[e0:e1]
                dst.copy_(dst.float() + g[e0 - offset : e1 - offset].float())
        if b > a:
            x = (buffer[a:b].float() + g[a - offset : b - offset].float()).to(buffer.dtype)
            _quantize_span(x, residual, q, scales, inner_first, inner_stop, a, b, block_size, bits)


def quantize_listed_blocks_ref(
    buffer, chunk: int, residual, q, scales, block_size: int, blocks, bits: int = 8
) -> None:
    """Pure-torch reference of :func:`quantize_listed_blocks` (validates the same way)."""
    nb = _check_rows("quantize_listed_blocks_ref", buffer, chunk, residual, q, scales, block_size, bits)
    _check_blocks("quantize_listed_blocks_ref", blocks, buffer, nb)
    for s0, s1 in _runs(blocks.tolist(), nb, scales.numel()):
        lo, hi = block_span(s0, chunk, block_size)[0], block_span(s1 - 1, chunk, block_size)[1]
        _quantize_span(buffer[lo:hi], residual, q, scales, s0, s1, lo, hi, block_size, bits)


def _runs(blocks: list, nb: int, total: int) -> List[Tuple[int, int]]:
    """Consecutive block indices merged into ``(first, stop)`` runs that stay inside one chunk."""
    runs: List[Tuple[int, int]] = []
    for b in blocks:
        if not 0 <= b < total:
            raise ValueError(f"quantize_listed_blocks: block index {b} is outside 0 .. {total - 1}")
        if runs and runs[-1][1] == b and b % nb:
            runs[-1] = (runs[-1][0], b + 1)
        elif runs and b < runs[-1][1]:
            raise ValueError("quantize_listed_blocks: blocks must be sorted and distinct")
        else:
            runs.append((b, b + 1))
    return runs


# -- dispatch --------------------------------------------------------------------------------------------------
def _pick(fn: str, backend, device: torch.device) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "ref":
        return "ref"
    if backend == "triton":
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"{fn}: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment before triton "
                "is first imported"
            )
        if not _build.triton_available():
            raise RuntimeError(f"{fn}: backend='triton' requested but triton is not installed")
        return "triton"
    if backend == "cpp":
        if device.type != "cpu":
            raise ValueError(f"{fn}: backend='cpp' runs on CPU tensors only, got {device}")
        if not _build.available("quantize_cpu"):
            raise RuntimeError(f"{fn}: backend='cpp' requested but {_build.why_missing('quantize_cpu')}")
        return "cpp"
    return _build.default_backend("fold_quantize", device, "quantize_cpu", logger)


class FoldTarget:
    """A round's buffer, residual and q / scales rows, checked once, into which :meth:`fold` folds one parameter's
    gradient after another (what :func:`fold_quantize` does per call; the fused round end calls it once per
    parameter, so each call checks only the gradient). The caller keeps the tensors alive and unchanged."""

    def __init__(
        self,
        buffer,
        chunk: int,
        residual,
        q,
        scales,
        block_size: int,
        bits: int = 8,
        *,
        backend: str | None = None,
    ):
        self.nb = _check_rows("fold_quantize", buffer, chunk, residual, q, scales, block_size, bits)
        self.buffer, self.chunk, self.residual, self.q, self.scales = buffer, chunk, residual, q, scales
        self.block_size, self.bits = block_size, bits
        self.how = _pick("fold_quantize", backend, buffer.device)
        self._spans = _spans(buffer=buffer, q=q, scales=scales, residual=residual)
        if self.how == "cpp":
            self._ext = _build.load("quantize_cpu")
            rows = _row_args(buffer, chunk, residual, q, scales, block_size, bits)
            self._head, self._tail = rows[:2], rows[2:]

    def fold(self, grad, offset: int) -> None:
        """Fold ``grad`` (fp32/bf16/fp16, contiguous) landing at ``[offset, offset + numel)``: see the module docstring."""
        _check_grad("fold_quantize", grad, offset, self.buffer, self._spans)
        if grad.numel() == 0:
            return
        if self.how == "cpp":
            self._ext.fold_quantize_cpu(
                *self._head,
                grad.data_ptr(),
                _DTYPE_CODE[grad.dtype],
                offset,
                grad.numel(),
                *self._tail,
                torch.get_num_threads(),
            )
        elif self.how == "ref":
            fold_quantize_ref(
                self.buffer,
                grad,
                offset,
                self.chunk,
                self.residual,
                self.q,
                self.scales,
                self.block_size,
                self.bits,
            )
        else:
            from acco_ds.ops.triton_kernels import fold_quantize as kernels  # triton: only when launched

            kernels.launch_fold_quantize(
                self.buffer, grad, offset, self.chunk, self.nb, self.residual, self.q, self.scales, self.block_size,
                QMAX_OF[self.bits],
            )  # fmt: skip


def fold_quantize(
    buffer,
    grad,
    offset: int,
    chunk: int,
    residual,
    q,
    scales,
    block_size: int,
    bits: int = 8,
    *,
    backend: str | None = None,
) -> None:
    """Fold one parameter's last gradient into the round's buffer and quantize the blocks it covers whole, in one
    pass (see the module docstring): ``grad`` lands at ``[offset, offset + numel)``; ``residual`` (the buffer's
    length, fp32, bf16 or fp16) or None (no error feedback); ``q`` / ``scales`` the round's flat rows, written for the
    whole blocks only; the buffer written at the partly covered blocks only."""
    FoldTarget(buffer, chunk, residual, q, scales, block_size, bits, backend=backend).fold(grad, offset)


def quantize_listed_blocks(
    buffer,
    chunk: int,
    residual,
    q,
    scales,
    block_size: int,
    blocks,
    bits: int = 8,
    *,
    backend: str | None = None,
) -> None:
    """Quantize the listed blocks of the buffer (``blocks``: sorted, distinct int64 global block indices on the
    buffer's device) with the residual (or None), into their places in ``q`` / ``scales``; see the module
    docstring."""
    nb = _check_rows("quantize_listed_blocks", buffer, chunk, residual, q, scales, block_size, bits)
    _check_blocks("quantize_listed_blocks", blocks, buffer, nb)
    if blocks.numel() == 0:
        return
    how = _pick("quantize_listed_blocks", backend, buffer.device)
    if how == "ref":
        quantize_listed_blocks_ref(buffer, chunk, residual, q, scales, block_size, blocks, bits)
    elif how == "cpp":
        _build.load("quantize_cpu").quantize_listed_blocks_cpu(
            *_row_args(buffer, chunk, residual, q, scales, block_size, bits),
            blocks.data_ptr(),
            blocks.numel(),
            torch.get_num_threads(),
        )
    else:
        from acco_ds.ops.triton_kernels import fold_quantize as kernels

        kernels.launch_quantize_listed_blocks(
            buffer, chunk, nb, residual, q, scales, block_size, QMAX_OF[bits], blocks
        )
