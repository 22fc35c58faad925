// bf16 and fp16 <-> fp32, the one rule every kernel (CPU, CUDA, the CPU harness) uses. The Triton kernels mirror
// it in acco_ds/ops/triton_kernels/bf16.py (the same bits).
//
// bf16 is stored as uint16_t: the high half of the fp32 bits. bf16 -> fp32 is exact; fp32 -> bf16 rounds to
// nearest, ties to even, and every NaN becomes 0x7FC0, exactly like c10::BFloat16 (torch's cast).
//
// fp16 (IEEE binary16) is stored as fp16_t, a distinct 16-bit type. fp16 -> fp32 is exact (subnormals included);
// fp32 -> fp16 rounds to nearest, ties to even, with fp16 subnormals, |x| >= 65520 (and inf) to inf, a NaN to a
// quiet NaN keeping the sign and the payload's top 10 bits: the bits of torch's CPU cast (x.to(torch.float16),
// x86's vcvtps2ph). Integer operations, one exact integer -> fp32 conversion and one exact-or-rounded-to-nearest
// fp32 addition (fp32 -> fp16 subnormals), which no flush-to-zero mode changes. The Triton mirror rounds the
// subnormals with integer shifts instead: the same bits (tests/ops/test_fp16_conversion.py checks both).
#pragma once

#include <stdint.h>
#include <string.h>

#include "common/host_device.h"

namespace acco {

ACCO_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  memcpy(&b, &x, sizeof(b));
  return b;
#endif
}

ACCO_HD float bits_f32(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x;
  memcpy(&x, &b, sizeof(x));
  return x;
#endif
}

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits.
ACCO_HD float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// fp32 -> bf16, round to nearest, ties to even; every NaN becomes 0x7FC0 (c10::round_to_nearest_even).
ACCO_HD uint16_t f32_to_bf16(float x) {
  const uint32_t b = f32_bits(x);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return (b & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

// An fp16 value: its IEEE binary16 bits.
struct alignas(2) fp16_t {
  uint16_t bits;
};
static_assert(sizeof(fp16_t) == 2, "fp16_t must be 2 bytes");

// a if c else b, as a bit mask: GCC keeps a ternary around a floating-point value as a branch (it may trap),
// which stops the loops from vectorising.
ACCO_HD uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}

// fp16 -> fp32, exact; a NaN stays a NaN with its sign and payload, made quiet (as vcvtph2ps).
ACCO_HD float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7FFFu;
  // a normal value: the exponent rebiased (15 -> 127), the 10 mantissa bits moved up
  const uint32_t normal = (em << 13) + 0x38000000u;
  // inf or NaN: exponent all ones, the mantissa moved up, a NaN made quiet
  const uint32_t special = 0x7F800000u | ((em & 0x3FFu) << 13) | select_bits(em > 0x7C00u, 0x400000u, 0u);
  // a subnormal: mantissa * 2**-24, the exact fp32 of the mantissa with 24 taken off its exponent; zero stays zero
  const uint32_t scaled = f32_bits(static_cast<float>(static_cast<int32_t>(em))) - (24u << 23);
  const uint32_t sub = select_bits(em != 0u, scaled, 0u);
  return bits_f32(sign | select_bits(em >= 0x7C00u, special, select_bits(em >= 0x0400u, normal, sub)));
}

// fp32 -> fp16, round to nearest, ties to even (torch's CPU cast, bit for bit; the header comment).
ACCO_HD uint16_t f32_to_fp16(float x) {
  const uint32_t b = f32_bits(x);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7FFFFFFFu;
  // |x| >= 2**-14: the exponent rebiased (127 -> 15), 13 mantissa bits rounded off; a carry moves into the exponent
  const uint32_t r = a - 0x38000000u;
  const uint32_t normal = (r + 0xFFFu + ((r >> 13) & 1u)) >> 13;
  // |x| < 2**-14: a subnormal in units of 2**-24. |x| + 0.5 rounds |x| to a multiple of 2**-24 (0.5's ulp), ties to
  // even, and those units are the sum's mantissa bits (1024 = the smallest normal when it rounds up). An exact IEEE
  // addition of an fp32 subnormal or normal to 0.5: no flush to zero can change it (an fp32 subnormal gives 0 either
  // way). Computed for every x and selected with masks, so the loops vectorise.
  const uint32_t sub = f32_bits(bits_f32(a) + 0.5f) - 0x3F000000u;
  uint32_t h = select_bits(a >= 0x38800000u, normal, sub);
  h = select_bits(a >= 0x477FF000u, 0x7C00u, h);  // 65520 (the tie above the largest finite, 65504) and up: inf
  h = select_bits(a > 0x7F800000u, 0x7E00u | ((a >> 13) & 0x3FFu), h);  // NaN: quiet, the payload's top bits
  return static_cast<uint16_t>(sign | h);
}

// Element-type traits: float is fp32, uint16_t is bf16, fp16_t is fp16.
ACCO_HD float to_f32(float x) { return x; }
ACCO_HD float to_f32(uint16_t x) { return bf16_to_f32(x); }
ACCO_HD float to_f32(fp16_t x) { return fp16_to_f32(x.bits); }
template <typename T>
ACCO_HD T from_f32(float x);
template <>
ACCO_HD float from_f32<float>(float x) {
  return x;
}
template <>
ACCO_HD uint16_t from_f32<uint16_t>(float x) {
  return f32_to_bf16(x);
}
template <>
ACCO_HD fp16_t from_f32<fp16_t>(float x) {
  return fp16_t{f32_to_fp16(x)};
}

}  // namespace acco
