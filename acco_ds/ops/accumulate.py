"""Accumulate / cast gradients into the flat communication buffer, in one pass per tensor.

Semantics (every backend, the ``*_ref`` functions define them)::

    buffer[off:off+numel] = cast(float(buffer[off:off+numel]) + float(grad.flatten()) * scale)

computed in fp32 (the product rounded, then the sum rounded), cast to the buffer's dtype with
round-to-nearest-even (torch's rule). ``buffer`` is a contiguous 1-D fp32, bf16 or fp16 tensor; every gradient is a
contiguous fp32, bf16 or fp16 tensor on the buffer's device; ``None`` gradients are zero and skipped.

Backends (``backend=``):

- ``"triton"``: ``acco_ds.ops.triton_kernels.accumulate.accumulate_chunks``, one launch per gradient dtype and
  alignment class for all tensors (a chunk table: tensor, offset, chunk): the tensors whose address is 16-byte
  aligned and whose buffer offset is a multiple of 8 take the vectorised launch, the others a scalar one, so one
  odd-sized parameter does not slow every other (:func:`launch_plan`); the default for CUDA tensors. On CPU tensors it runs only under ``TRITON_INTERPRET=1``
  (the tests use it).
- ``"cpp"``: the CPU extension ``acco_ds._accumulate_cpu`` (OpenMP over chunks of all tensors, ``torch.get_num_threads()`` threads); the
  default for CPU tensors.
- ``"ref"``: pure torch (the fallback when the chosen backend is missing; the choice is logged once).

Streams: Triton kernels are enqueued on the current CUDA stream. The chunk table of a launch holds no address
(each row: the gradient's element distance from the launch's first gradient, which the kernel takes as an
argument; buffer offset; chunk start; numel), so it depends on the layout only and is built once per (stream,
layout): in pinned host memory, copied host-to-device without blocking the host, on that stream, and cached
with its pinned copy. A call with one gradient (the per-parameter fold of mixed dtypes, ``copy_flat``) hits the
cache whatever address the caching allocator gives that gradient. The cache keeps every layout in use up to
``_TABLE_CACHE_ROWS`` rows in all (least recently used first out). The caller must keep ``grads`` alive until
the stream has run (as for any CUDA op).
Triton is imported lazily (acco_ds.ops.triton_kernels, at the first Triton launch); importing this module never
imports triton nor touches ``torch.cuda``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import List, Sequence

import torch

from acco_ds.ops import _build
from acco_ds.ops._dtypes import ALLOWED, DTYPE_CODE, FLOATS

logger = logging.getLogger(__name__)

_FLOATS = FLOATS
_DTYPE_CODE = DTYPE_CODE
_BACKENDS = (None, "auto", "ref", "cpp", "triton")


def _check(fn: str, arg: str, t, device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {arg} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{fn}: {arg} has dtype {t.dtype}; allowed: {ALLOWED}.")
    if device is not None and t.device != device:
        raise ValueError(f"{fn}: {arg} is on {t.device} but buffer is on {device}; use one device.")
    if not t.is_contiguous():
        raise ValueError(
            f"{fn}: {arg} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); pass a contiguous "
            "tensor or call .contiguous() first."
        )
    if t.numel() and t.data_ptr() % t.element_size() != 0:
        raise ValueError(
            f"{fn}: {arg} data pointer 0x{t.data_ptr():x} is not aligned to its element size {t.element_size()}."
        )


def _check_buffer(fn: str, buffer) -> None:
    _check(fn, "buffer", buffer, None)
    if buffer.dim() != 1:
        raise ValueError(f"{fn}: buffer must be 1-D (the flat buffer), got shape {tuple(buffer.shape)}.")


def _validate_grads(fn: str, buffer, grads, offsets) -> List[int]:
    _check_buffer(fn, buffer)
    if len(grads) != len(offsets):
        raise ValueError(
            f"{fn}: got {len(grads)} grads but {len(offsets)} offsets; pass one offset per grad."
        )
    live = []
    for i, (g, off) in enumerate(zip(grads, offsets)):
        if g is None:
            continue
        _check(fn, f"grads[{i}]", g, buffer.device)
        off = int(off)
        if off < 0 or off + g.numel() > buffer.numel():
            raise ValueError(
                f"{fn}: grads[{i}] ({g.numel()} elements at offset {off}) does not fit in buffer of "
                f"{buffer.numel()} elements."
            )
        live.append(i)
    return live


def _pick(fn: str, device: torch.device, backend: str | None) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {_BACKENDS}, got {backend!r}.")
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{fn}: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment before triton is "
            "first imported (the Triton interpreter); use backend='cpp' or 'ref' on CPU otherwise."
        )
    if backend in ("ref", "triton"):
        return backend
    if backend == "cpp":
        if device.type != "cpu":
            raise ValueError(f"{fn}: backend='cpp' runs on CPU tensors only, got {device}.")
        if not _build.available("accumulate_cpu"):
            raise RuntimeError(f"{fn}: backend='cpp' requested but {_build.why_missing('accumulate_cpu')}")
        return "cpp"
    return _build.default_backend("accumulate", device, "accumulate_cpu", logger)


def accumulate_grads_ref(buffer, grads: Sequence[torch.Tensor | None], offsets: Sequence[int], scale=1.0):
    """Pure-torch reference of :func:`accumulate_grads` (validates the same way)."""
    live = _validate_grads("accumulate_grads_ref", buffer, grads, offsets)
    for i in live:
        g, off = grads[i], int(offsets[i])
        dst = buffer[off : off + g.numel()]
        dst.copy_(dst.float() + g.reshape(-1).float() * float(scale))


def accumulate_grads(
    buffer,
    grads: Sequence[torch.Tensor | None],
    offsets: Sequence[int],
    scale: float = 1.0,
    *,
    backend=None,
) -> None:
    """``buffer[off:off+numel] += grad.flatten().float() * scale`` (cast to buffer dtype) for every grad.

    ``grads``: fp32/bf16/fp16 contiguous tensors of any shape, or None (skipped); ``offsets[i]``: element offset of
    ``grads[i]`` in ``buffer``. Regions must not overlap. See the module docstring for backends and streams.
    """
    live = _validate_grads("accumulate_grads", buffer, grads, offsets)
    if not live:
        return
    chosen = _pick("accumulate_grads", buffer.device, backend)
    if chosen == "ref":
        accumulate_grads_ref(buffer, grads, offsets, scale)
    elif chosen == "cpp":
        ext = _build.load("accumulate_cpu")
        ext.accumulate_cpu(
            buffer.data_ptr(),
            _DTYPE_CODE[buffer.dtype],
            [grads[i].data_ptr() for i in live],
            [_DTYPE_CODE[grads[i].dtype] for i in live],
            [int(offsets[i]) for i in live],
            [grads[i].numel() for i in live],
            float(scale),
            torch.get_num_threads(),
        )
    else:
        _triton_launch(
            buffer, [grads[i] for i in live], [int(offsets[i]) for i in live], scale, accumulate=True
        )


def accumulate_flat_ref(buffer, grad_flat, scale=1.0) -> None:
    """Pure-torch reference of :func:`accumulate_flat`."""
    _check_buffer("accumulate_flat_ref", buffer)
    _check("accumulate_flat_ref", "grad_flat", grad_flat, buffer.device)
    _same_numel("accumulate_flat_ref", buffer, grad_flat)
    buffer.copy_(buffer.float() + grad_flat.reshape(-1).float() * float(scale))


def accumulate_flat(buffer, grad_flat, scale: float = 1.0, *, backend=None) -> None:
    """``buffer += grad_flat.float() * scale`` cast to buffer dtype; same numel, one pass."""
    _check_buffer("accumulate_flat", buffer)
    _check("accumulate_flat", "grad_flat", grad_flat, buffer.device)
    _same_numel("accumulate_flat", buffer, grad_flat)
    accumulate_grads(buffer, [grad_flat], [0], scale, backend=backend)


def copy_flat_ref(dst, src, scale: float = 1.0) -> None:
    """Pure-torch reference of :func:`copy_flat`."""
    _check("copy_flat_ref", "dst", dst, None)
    _check("copy_flat_ref", "src", src, dst.device)
    _same_numel("copy_flat_ref", dst, src)
    dst.view(-1).copy_(src.reshape(-1).float() * float(scale))


def copy_flat(dst, src, scale: float = 1.0, *, backend=None) -> None:
    """``dst = cast(src.float() * scale)``: same numel, both contiguous fp32/bf16/fp16, one pass.

    With ``scale == 1`` and no backend named this is ``dst.copy_(src)`` (torch's cast is round-to-nearest-even,
    one pass on every device); otherwise the cast-and-scale kernel of the chosen backend runs (Triton on CUDA,
    the CPU extension on CPU, ``copy_flat_ref`` as the fallback).
    """
    _check("copy_flat", "dst", dst, None)
    _check("copy_flat", "src", src, dst.device)
    _same_numel("copy_flat", dst, src)
    if float(scale) == 1.0 and backend in (None, "auto"):
        dst.view(-1).copy_(src.reshape(-1))
        return
    chosen = _pick("copy_flat", dst.device, backend)
    if chosen == "ref":
        copy_flat_ref(dst, src, scale)
    elif chosen == "cpp":
        _build.load("accumulate_cpu").copy_cpu(
            dst.data_ptr(),
            _DTYPE_CODE[dst.dtype],
            src.data_ptr(),
            _DTYPE_CODE[src.dtype],
            dst.numel(),
            float(scale),
            torch.get_num_threads(),
        )
    else:
        _triton_launch(dst.view(-1), [src], [0], scale, accumulate=False)


def _same_numel(fn: str, a, b) -> None:
    if a.numel() != b.numel():
        raise ValueError(f"{fn}: sizes differ ({a.numel()} vs {b.numel()} elements); they must match.")


# -- Triton ---------------------------------------------------------------------------------------------
_CHUNK = (
    16384  # elements per program (one row of the chunk table); a multiple of 1024 (the kernel relies on it)
)
_BLOCK = 1024  # elements per loop iteration of a program


def _chunk_table(grads: List[torch.Tensor], offsets: List[int]) -> torch.Tensor:
    """int64 [chunks, 4] rows (grad element offset from ``grads[0]``, buffer offset, chunk start, grad numel),
    built on the host; every grad has the same dtype (one launch). The table holds no address: the kernel adds the
    first offset to ``grads[0]``'s pointer, its argument."""
    esize = grads[0].element_size()
    base = grads[0].data_ptr()
    deltas = torch.tensor([(g.data_ptr() - base) // esize for g in grads], dtype=torch.int64)
    offs = torch.tensor(offsets, dtype=torch.int64)
    numels = torch.tensor([g.numel() for g in grads], dtype=torch.int64)
    chunks = (numels + _CHUNK - 1) // _CHUNK
    tidx = torch.repeat_interleave(torch.arange(len(grads)), chunks)
    first = torch.cumsum(chunks, 0) - chunks
    cstart = (torch.arange(int(chunks.sum())) - first[tidx]) * _CHUNK
    return torch.stack([deltas[tidx], offs[tidx], cstart, numels[tidx]], 1).contiguous()


_TABLE_CACHE_ROWS = (
    1 << 20
)  # rows kept in all (32 MiB on the device + 32 MiB pinned): ~17e9 elements' layouts
_table_cache: OrderedDict = OrderedDict()
_table_rows = 0
_table_lock = threading.Lock()


def _table_key(grads: List[torch.Tensor], offsets: List[int], device: torch.device) -> tuple:
    """The layout of a launch: device, current stream, gradient dtype, element distances from the first
    gradient, buffer offsets, sizes. Not the addresses: a gradient freed and allocated again elsewhere (every
    micro-batch) keeps its key."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    esize = grads[0].element_size()
    base = grads[0].data_ptr()
    return (
        device,
        stream,
        grads[0].dtype,
        tuple((g.data_ptr() - base) // esize for g in grads),
        tuple(offsets),
        tuple(g.numel() for g in grads),
    )


def _device_table(grads: List[torch.Tensor], offsets: List[int], device: torch.device) -> torch.Tensor:
    """The chunk table on ``device``, built once per layout (:func:`_table_key`) and cached. On CUDA the table is
    built in pinned memory and copied with ``non_blocking=True`` on the current stream (the host does not wait
    for the stream); the pinned copy is kept with the device copy in the cache entry, so it outlives the copy that
    reads it. The stream is part of the key: a table uploaded on one stream is not handed to a launch on another
    before its copy has run there. Entries leave least recently used first once the cache holds more than
    ``_TABLE_CACHE_ROWS`` rows (the newest entry always stays)."""
    global _table_rows
    key = _table_key(grads, offsets, device)
    with _table_lock:
        entry = _table_cache.get(key)
        if entry is not None:
            _table_cache.move_to_end(key)
            return entry[1]
    host = _chunk_table(grads, offsets)
    if device.type == "cuda":
        host = host.pin_memory()
        table = host.to(device, non_blocking=True)
    else:
        table = host.to(device)
    with _table_lock:
        if key not in _table_cache:
            _table_cache[key] = (host, table)
            _table_rows += table.shape[0]
        while _table_rows > _TABLE_CACHE_ROWS and len(_table_cache) > 1:
            _, (_, old) = _table_cache.popitem(last=False)
            _table_rows -= old.shape[0]
    return table


def _clear_table_cache() -> None:
    """Drop every cached chunk table (tests)."""
    global _table_rows
    with _table_lock:
        _table_cache.clear()
        _table_rows = 0


def _aligned(buffer: torch.Tensor, grad: torch.Tensor, offset: int) -> bool:
    """The vectorised kernel's precondition for one tensor: 16-byte aligned addresses (buffer and gradient) and
    a buffer offset that is a multiple of 8 elements (16 bytes for bf16 and fp16, 32 for fp32)."""
    return buffer.data_ptr() % 16 == 0 and grad.data_ptr() % 16 == 0 and offset % 8 == 0


def launch_plan(buffer, grads: List[torch.Tensor], offsets: List[int]) -> List[tuple]:
    """The Triton launches of one call: ``[(grad dtype, aligned, [indices into grads]), ...]``, at most one per
    (dtype, alignment class), skipping empty gradients. The aligned class takes the vectorised kernel; the rest
    the scalar one."""
    plan = []
    for dtype in _FLOATS:
        idx = [i for i, g in enumerate(grads) if g.numel() and g.dtype == dtype]
        vec = [i for i in idx if _aligned(buffer, grads[i], offsets[i])]
        rest = [i for i in idx if not _aligned(buffer, grads[i], offsets[i])]
        plan += [(dtype, aligned, ids) for aligned, ids in ((True, vec), (False, rest)) if ids]
    return plan


def _triton_launch(
    buffer, grads: List[torch.Tensor], offsets: List[int], scale: float, accumulate: bool
) -> None:
    """One launch per entry of :func:`launch_plan`: ``buffer[off:] (+)= grad * scale`` for every grad (validated
    before). The launches write disjoint regions of ``buffer``.

    On CPU tensors this works only under ``TRITON_INTERPRET=1`` (set before triton is first imported).
    """
    from acco_ds.ops.triton_kernels import accumulate as kernels  # imports triton: only once a launch is due

    kernel = kernels.accumulate_chunks
    for dtype, aligned, idx in launch_plan(buffer, grads, offsets):
        gs, offs = [grads[i] for i in idx], [offsets[i] for i in idx]
        table = _device_table(gs, offs, buffer.device)
        kernel[(table.shape[0],)](
            table,
            gs[0],
            buffer,
            float(scale),
            CHUNK=_CHUNK,
            BLOCK=_BLOCK,
            G_DT=_DTYPE_CODE[dtype],
            B_DT=_DTYPE_CODE[buffer.dtype],
            ACC=accumulate,
            ALIGNED=aligned,
            enable_fp_fusion=False,  # x + g*scale rounded twice, as the reference (no FMA): the same bits
        )
