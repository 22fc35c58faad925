"""bf16 / fp16 <-> fp32 in Triton, with csrc/common/bf16.h's rules (one definition for every Triton kernel).

bf16 -> fp32 is exact (the bf16 bits are the high half of the fp32 bits); fp32 -> bf16 rounds to nearest, ties
to even, and every NaN becomes 0x7FC0, exactly like c10::BFloat16 (torch's cast) and the C/CUDA kernels.

fp16 -> fp32 is exact (a NaN made quiet, its sign and payload kept); fp32 -> fp16 rounds to nearest, ties to
even, with fp16 subnormals, ``|y| >= 65520`` (and inf) to inf and a NaN to a quiet NaN keeping its sign and the
payload's top 10 bits: the bits of torch's CPU cast ``y.to(torch.float16)`` and of the C/CUDA kernels.

All are written with integer operations so the GPU and the interpreter (whose own fp32 -> bf16 cast truncates)
give the same bits. Kernels name a tensor's dtype by its code (``DT``: 0 fp32, 1 bf16, 2 fp16, the codes of
csrc/common/dtype.h and acco_ds.ops._dtypes) and convert with :func:`to_f32` / :func:`from_f32`.
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


@triton.jit
def f16_to_f32(x):
    """fp16 values -> fp32, exact; a NaN made quiet."""
    h = x.to(tl.uint16, bitcast=True).to(tl.uint32)
    sign = (h & 0x8000) << 16
    em = h & 0x7FFF
    normal = (em << 13) + 0x38000000  # the exponent rebiased (15 -> 127)
    quiet = tl.where(em > 0x7C00, 0x400000, 0).to(tl.uint32)
    special = 0x7F800000 | ((em & 0x3FF) << 13) | quiet  # inf or NaN
    # a subnormal: mantissa * 2**-24, the exact fp32 of the mantissa with 24 taken off its exponent; zero stays zero
    scaled = em.to(tl.int32).to(tl.float32).to(tl.uint32, bitcast=True) - (24 << 23)
    sub = tl.where(em != 0, scaled, 0)
    mag = tl.where(em >= 0x7C00, special, tl.where(em >= 0x400, normal, sub))
    return (sign | mag).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_f16(y):
    """fp32 values -> fp16, round to nearest even (torch's CPU cast, bit for bit)."""
    b = y.to(tl.uint32, bitcast=True)
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    r = a - 0x38000000  # |y| >= 2**-14: the exponent rebiased (127 -> 15), 13 mantissa bits rounded off
    normal = (r + 0xFFF + ((r >> 13) & 1)) >> 13
    # |y| < 2**-14: a subnormal in units of 2**-24, the significand shifted right by 126 - exponent (14 to 31)
    e = (a >> 23).to(tl.int32)
    sh = tl.minimum(tl.maximum(126 - e, 14), 31).to(tl.uint32)
    m = (a & 0x7FFFFF) | 0x800000
    one = tl.full(m.shape, 1, tl.uint32)
    sub = (m + ((one << (sh - 1)) - 1) + ((m >> sh) & 1)) >> sh
    h = tl.where(a >= 0x38800000, normal, sub)
    h = tl.where(a >= 0x477FF000, 0x7C00, h)  # 65520 (the tie above the largest finite, 65504) and up: inf
    h = tl.where(a > 0x7F800000, 0x7E00 | ((a >> 13) & 0x3FF), h)  # NaN: quiet, the payload's top bits
    return (sign | h).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def to_f32(x, DT: tl.constexpr):
    """Values of dtype code DT (0 fp32, 1 bf16, 2 fp16) -> fp32, exact."""
    if DT == 1:
        x = bf16_to_f32(x)
    elif DT == 2:
        x = f16_to_f32(x)
    return x


@triton.jit
def from_f32(y, DT: tl.constexpr):
    """fp32 values -> dtype code DT (0 fp32: unchanged, 1 bf16, 2 fp16), rounded to nearest even."""
    if DT == 1:
        y = f32_to_bf16(y)
    elif DT == 2:
        y = f32_to_f16(y)
    return y


@triton.jit
def round_to(y, DT: tl.constexpr):
    """fp32 values rounded to dtype code DT and back: what a tensor of that dtype holds, as fp32."""
    if DT != 0:
        y = to_f32(from_f32(y, DT), DT)
    return y
