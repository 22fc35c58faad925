// The element-wise AdamW update and the bf16 conversions: one truth for the GPU (nvcc) and the CPU (g++).
//
// Everything here is a __host__ __device__ inline function of plain values: no libtorch, no CUDA runtime.
// fp32 arithmetic in torch.optim.AdamW's order (decoupled weight decay first); bf16 is stored as uint16_t
// and rounded to nearest even exactly like c10::BFloat16 (NaN -> 0x7FC0).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define ACCO_HD __host__ __device__ __forceinline__
#else
#define ACCO_HD inline __attribute__((always_inline))
#endif

namespace acco {

// fp32 scalars of one step, computed in double on the host (acco_ds.ops.adamw.hyper_scalars) and rounded
// to fp32 once, as torch does with its Python-float scalars.
struct AdamWHyper {
  float decay;            // 1 - lr * weight_decay
  float beta1;            // beta1
  float one_minus_beta1;  // 1 - beta1
  float beta2;            // beta2
  float one_minus_beta2;  // 1 - beta2
  float bc2_sqrt;         // sqrt(1 - beta2**step)
  float eps;              // eps
  float step_size;        // lr / (1 - beta1**step)
};

// The AdamWHyper fields from 8 consecutive fp32 in memory, in the struct's order (a hyper_tensor of
// acco_ds.ops.adamw: decay, beta1, 1-beta1, beta2, 1-beta2, sqrt(1-beta2**step), eps, step_size).
ACCO_HD AdamWHyper load_hyper(const float* x) {
  return AdamWHyper{x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]};
}

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

// One AdamW step on one element, torch.optim.AdamW's operations in its order:
//   p.mul_(decay); m.lerp_(g, 1-b1); v.mul_(b2).addcmul_(g, g, value=1-b2)
//   denom = (v.sqrt() / bc2_sqrt).add_(eps); p.addcdiv_(m, denom, value=-step_size)
// g is the already scaled fp32 gradient. Compiled without -ffast-math (IEEE division and sqrt).
// m uses torch's lerp form m + (1-b1)*(g-m), not b1*m + (1-b1)*g: fp32(b1) + fp32(1-b1) != 1, so the latter
// drifts by ~1e-8 relative per step, which over 100 steps is several times torch's own rounding error.
ACCO_HD void adamw_update(float& p, float& m, float& v, float g, const AdamWHyper& h) {
  p = p * h.decay;
  m = m + h.one_minus_beta1 * (g - m);
  v = h.beta2 * v + h.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / h.bc2_sqrt + h.eps;
  p = p - h.step_size * (m / denom);
}

}  // namespace acco
