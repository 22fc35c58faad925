// The CPU AdamW's element loops (commit / peek / noop over a range), shared by its launcher (adamw_cpu.cpp) and
// the fused AdamW + parameter difference (adamw_difference_cpu.cpp). Inline functions: each translation unit
// compiles them inside its own instruction-set variants (csrc/common/cpu.h) with -ffp-contract=off and without
// -ffast-math: IEEE fp32 operations in adamw_update's order, the same bits whatever the ISA or the caller.
#pragma once

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <algorithm>

#include "adamw/adamw_kernel_body.h"

namespace acco {
namespace range {

constexpr int64_t kTile = 256;  // elements staged in fp32 on the stack (L1) per inner step
// `out` is written with non-temporal stores when it is at least this large: it would not stay in cache, and
// streaming it saves the read-for-ownership of its lines (2 of the 16 bytes per parameter a peek moves).
constexpr int64_t kStreamOutBytes = 16 << 20;

// Copies `bytes` (a multiple of 16) from the 16-byte aligned `src` to the 16-byte aligned `dst` with
// non-temporal stores (SSE2, in every x86-64); a plain copy elsewhere. Callers end with stream_fence().
inline __attribute__((always_inline)) void stream_copy(void* dst, const void* src, int64_t bytes) {
#if defined(__x86_64__)
  for (int64_t o = 0; o < bytes; o += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<char*>(dst) + o),
                     _mm_load_si128(reinterpret_cast<const __m128i*>(static_cast<const char*>(src) + o)));
#else
  memcpy(dst, src, bytes);
#endif
}

inline void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// The loop is split in tiles so that the compiler vectorises the fp32 math at the full vector width: a
// 16-bit <-> fp32 conversion inside the math loop makes GCC pick half-width vectors for everything.
template <typename G, typename O, bool COMMIT, bool HAS_OUT>
inline __attribute__((always_inline)) void adamw_range_impl(const AdamWKernelArgs& a, float s, int64_t b,
                                                              int64_t e, bool stream_out) {
  float* __restrict p = a.p;
  float* __restrict m = a.m;
  float* __restrict v = a.v;
  const G* __restrict g = static_cast<const G*>(a.g);
  O* __restrict out = static_cast<O*>(a.out);
  const AdamWHyper h = a.h;
  alignas(64) float gt[kTile];
  alignas(64) float pt[kTile];
  for (int64_t t0 = b; t0 < e; t0 += kTile) {
    const int64_t len = std::min(kTile, e - t0);
#pragma omp simd
    for (int64_t k = 0; k < len; ++k) gt[k] = to_f32(g[t0 + k]) * s;
#pragma omp simd
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = t0 + k;
      float pi = p[i], mi = m[i], vi = v[i];
      adamw_update(pi, mi, vi, gt[k], h);
      if (COMMIT) {
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
      }
      pt[k] = pi;
    }
    if (HAS_OUT) {
      if (stream_out && len == kTile && reinterpret_cast<uintptr_t>(out + t0) % 16 == 0) {
        alignas(64) O ot[kTile];
#pragma omp simd
        for (int64_t k = 0; k < kTile; ++k) ot[k] = from_f32<O>(pt[k]);
        stream_copy(out + t0, ot, kTile * sizeof(O));
      } else {
#pragma omp simd
        for (int64_t k = 0; k < len; ++k) out[t0 + k] = from_f32<O>(pt[k]);
      }
    }
  }
  if (HAS_OUT && stream_out) stream_fence();
}

// noop step: out = cast(master), state untouched.
template <typename O>
inline __attribute__((always_inline)) void cast_range_impl(const AdamWKernelArgs& a, float, int64_t b,
                                                             int64_t e, bool) {
  const float* __restrict p = a.p;
  O* __restrict out = static_cast<O*>(a.out);
#pragma omp simd
  for (int64_t i = b; i < e; ++i) out[i] = from_f32<O>(p[i]);
}

}  // namespace range
}  // namespace acco
