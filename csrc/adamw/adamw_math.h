// The element-wise AdamW update and its scalars: one truth for the GPU (nvcc) and the CPU (g++).
//
// Everything here is a __host__ __device__ inline function of plain values: no libtorch, no CUDA runtime.
// fp32 arithmetic in torch.optim.AdamW's order (decoupled weight decay first). The bf16 / fp16 conversions are
// csrc/common/bf16.h's.
#pragma once

#include <math.h>
#include <stdint.h>

#include "common/bf16.h"
#include "common/host_device.h"

namespace acco {

// The fp32 scalars of one step, in this order: acco_ds/ops/adamw_settings.py's KERNEL_FIELDS lists the same
// names in the same order and AdamWSettings.hyper_scalars computes them (in double on the host, rounded to
// fp32 once, as torch does with its Python-float scalars). tests/ops/test_adamw_settings.py checks that the
// lists match (this header's and the built modules' HYPER_FIELDS / HYPER_OFFSETS).
#define ACCO_ADAMW_HYPER_FIELDS(X)                       \
  X(decay)           /* 1 - lr * weight_decay */         \
  X(beta1)           /* beta1 */                         \
  X(one_minus_beta1) /* 1 - beta1 */                     \
  X(beta2)           /* beta2 */                         \
  X(one_minus_beta2) /* 1 - beta2 */                     \
  X(bc2_sqrt)        /* sqrt(1 - beta2**step) */         \
  X(eps)             /* eps */                           \
  X(step_size)       /* lr / (1 - beta1**step) */

struct AdamWHyper {
#define ACCO_HYPER_MEMBER(name) float name;
  ACCO_ADAMW_HYPER_FIELDS(ACCO_HYPER_MEMBER)
#undef ACCO_HYPER_MEMBER
};

#define ACCO_HYPER_ONE(name) +1
constexpr int kHyperFields = 0 ACCO_ADAMW_HYPER_FIELDS(ACCO_HYPER_ONE);
#undef ACCO_HYPER_ONE
static_assert(sizeof(AdamWHyper) == kHyperFields * sizeof(float), "AdamWHyper must be packed fp32 fields");

// The AdamWHyper fields from kHyperFields consecutive fp32 in memory, in the struct's order (a hyper_tensor
// of acco_ds.ops.adamw, or the scalars the bindings receive by value).
ACCO_HD AdamWHyper load_hyper(const float* x) {
  AdamWHyper h;
  int i = 0;
#define ACCO_HYPER_LOAD(name) h.name = x[i++];
  ACCO_ADAMW_HYPER_FIELDS(ACCO_HYPER_LOAD)
#undef ACCO_HYPER_LOAD
  return h;
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
