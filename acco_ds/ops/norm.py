"""The gradient norm's accumulation: ``sum_of_squares(x)``, fp64 like DeepSpeed's ZeRO norm (``get_norm_dtype``).

Contract (every backend): an fp64 tensor of shape [1] on x's device, the sum of the squares of ``x`` (fp32,
bf16 or fp16, any shape, contiguous or not), each square exact in fp64 and the squares summed in fp64; no temporary of x's
size; a non-finite value gives a non-finite sum; no host read of a device value (the round job enqueues it on the
communication side's CUDA stream, the current stream at the call). Backends differ only in the order of the fp64
additions (within about 1e-15 relative of each other).

An fp32 accumulator is not enough: on a shard of millions of small values (rarely used embedding rows) beside a
few large ones, the small squares are swamped (3.2M values of 1e-5 and 8k of 1e-2: fp32 ``vector_norm`` on the CPU
is off by 3.7e-4).

Backends (``backend=``):

- ``"triton"`` (CUDA): ``acco_ds.ops.triton_kernels.norm``, one fp64 partial per ``PER_PROGRAM`` elements, then
  their sum: two launches, x read once. ``torch.linalg.vector_norm(x, dtype=torch.float64)`` would cast the whole
  of x first, and the chunked torch path launches three kernels per chunk (at 168M parameters its ~120 launches kept
  the host from feeding the compute stream for 6-10 ms per round on an H200).
- ``"torch"``: chunks of ``NORM_CHUNK`` elements, each cast to fp64 (the only temporary) and its squares summed by
  ``torch.dot``, the partial sums added in fp64 (any device; the CPU's path, where the round job runs on a worker
  thread and a 2 MiB chunk stays in cache).
- ``None``/``"auto"``: ``"triton"`` for a contiguous CUDA tensor where triton imports, else ``"torch"``. A
  backend named explicitly raises where it cannot run (the "triton" backend takes CPU tensors only under
  ``TRITON_INTERPRET=1``, the Triton interpreter, where tests/ops/test_norm.py checks it).
"""

from __future__ import annotations

import torch

from acco_ds.ops._dtypes import ALLOWED, DTYPE_CODE, FLOATS
from acco_ds.ops.quantize import _triton_obstacle as _kernel_obstacle

NORM_CHUNK = {"cpu": 1 << 18, "cuda": 1 << 22}
"""Elements per fp64 partial sum of the "torch" backend, per device type (others: the CUDA value). The fp64
temporary is one chunk (2 MiB on the CPU, where larger chunks leave the cache and run slower; 32 MiB on CUDA)."""

PER_PROGRAM = 1 << 15
"""Elements per fp64 partial of the "triton" backend (168M elements: about 5k partials, 40 KiB)."""

_TILE = 1024
_BACKENDS = (None, "auto", "torch", "triton")


def _triton_obstacle(x: torch.Tensor) -> str:
    """Why the "triton" backend cannot take x; "" when it can (the Triton kernels' common conditions)."""
    return _kernel_obstacle({"x": x})


def _pick(x: torch.Tensor, backend) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"sum_of_squares: backend must be one of {_BACKENDS[1:]} or None, got {backend!r}")
    if backend in (None, "auto"):
        return "triton" if x.device.type == "cuda" and not _triton_obstacle(x) else "torch"
    if backend == "triton":
        why = _triton_obstacle(x)
        if why:
            raise ValueError(f"sum_of_squares: backend='triton' cannot run here: {why}")
    return backend


def _torch_sum_of_squares(flat: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(1, dtype=torch.float64, device=flat.device)
    for chunk in flat.split(NORM_CHUNK.get(flat.device.type, NORM_CHUNK["cuda"])):
        wide = chunk.to(torch.float64)
        out += torch.dot(wide, wide)
        del wide  # freed before the next chunk's cast: one chunk's temporary at a time
    return out


def _triton_sum_of_squares(flat: torch.Tensor) -> torch.Tensor:
    from acco_ds.ops.triton_kernels import norm as kernels  # imports triton: only once a launch is due

    if not flat.numel():
        return torch.zeros(1, dtype=torch.float64, device=flat.device)
    programs = -(-flat.numel() // PER_PROGRAM)
    partials = torch.empty(programs, dtype=torch.float64, device=flat.device)
    kernels.sum_of_squares_partials[(programs,)](
        flat, partials, flat.numel(), PER_PROGRAM=PER_PROGRAM, TILE=_TILE, X_DT=DTYPE_CODE[flat.dtype]
    )
    return partials.sum().reshape(1)


def sum_of_squares(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """fp64 [1] on x's device: the sum of the squares of ``x`` (module docstring: the contract, the backends)."""
    if x.dtype not in FLOATS:
        raise TypeError(f"sum_of_squares: x must be {ALLOWED}, got {x.dtype}")
    how = _pick(x, backend)
    if how == "triton":
        return _triton_sum_of_squares(x.reshape(-1))
    return _torch_sum_of_squares(x.reshape(-1))
