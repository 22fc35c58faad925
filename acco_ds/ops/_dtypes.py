"""The floating dtypes the kernels take, their codes, and the NaN bits the kernels store: one place for every op.

``DTYPE_CODE`` maps a dtype to the code of the compiled entry points (csrc/common/dtype.h) and of the Triton
kernels' ``*_DT`` constexprs (acco_ds/ops/triton_kernels/bf16.py): 0 fp32, 1 bf16, 2 fp16. Importing this module
imports torch only.
"""

from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
"""The floating dtypes of gradients, buffers, residuals and parameter outputs."""

HALVES = (torch.bfloat16, torch.float16)
"""The 16-bit ones (rounded to nearest even from fp32)."""

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""dtype -> code of the compiled and Triton kernels."""

ALLOWED = "torch.float32, torch.bfloat16 or torch.float16"
"""The allowed dtypes, as error messages name them."""


def code(dtype: torch.dtype) -> int:
    """The kernels' code of ``dtype`` (one of :data:`FLOATS`)."""
    return DTYPE_CODE[dtype]


def store_as_kernels(out: torch.Tensor, values: torch.Tensor) -> None:
    """``out <- values`` (fp32, out's shape) in out's dtype with the kernels' rounding, NaN bits included: torch's
    cast rounds to nearest even as they do; a NaN becomes 0x7FC0 in bf16 (c10::BFloat16's rule, where torch's
    vectorised CPU cast may give 0xFFFF) and, in fp16, a quiet NaN with its sign and the payload's top 10 bits (what
    torch's CPU cast gives; its CUDA cast may not). ``torch.where``, no boolean index: no host sync on CUDA."""
    out.copy_(values)
    if out.dtype not in HALVES:
        return
    raw = out.view(torch.int16)
    nan = values.isnan()
    if out.dtype == torch.bfloat16:
        raw.copy_(torch.where(nan, 0x7FC0, raw))
        return
    b = values.view(torch.int32)
    h = 0x7E00 | ((b >> 13) & 0x3FF)
    h = torch.where(b < 0, h - 0x8000, h)  # with the sign bit: 0x8000 | h as an int16
    raw.copy_(torch.where(nan, h.to(torch.int16), raw))
