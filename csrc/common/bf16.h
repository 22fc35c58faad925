// bf16 <-> fp32, the one rule every kernel (CPU, CUDA, the CPU harness) uses. The Triton kernels mirror it in
// acco_ds/ops/triton_kernels/bf16.py (same integer operations, so the same bits).
//
// bf16 is stored as uint16_t: the high half of the fp32 bits. bf16 -> fp32 is exact; fp32 -> bf16 rounds to
// nearest, ties to even, and every NaN becomes 0x7FC0, exactly like c10::BFloat16 (torch's cast).
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

// Element-type traits: float is fp32, uint16_t is bf16.
ACCO_HD float to_f32(float x) { return x; }
ACCO_HD float to_f32(uint16_t x) { return bf16_to_f32(x); }
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

}  // namespace acco
