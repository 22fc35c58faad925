"""bf16 <-> fp32 in Triton, with csrc/common/bf16.h's rule (one definition for every Triton kernel).

bf16 -> fp32 is exact (the bf16 bits are the high half of the fp32 bits); fp32 -> bf16 rounds to nearest, ties
to even, and every NaN becomes 0x7FC0, exactly like c10::BFloat16 (torch's cast) and the C/CUDA kernels. Both are
written with integer operations so the GPU and the interpreter (whose own fp32 -> bf16 cast truncates) give the
same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bf16_to_f32(x):
    """bf16 values -> fp32, exact."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16(y):
    """fp32 values -> bf16, round to nearest even; NaN -> 0x7FC0."""
    b = y.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
