// The CPU AdamW's element loops (commit / peek / noop over a range), shared by its launcher (adamw_cpu.cpp) and
// the fused AdamW + parameter difference (adamw_difference_cpu.cpp). Inline functions: each translation unit
// compiles them inside its own instruction-set variants (csrc/common/cpu.h) with -ffp-contract=off and without
// -ffast-math: IEEE fp32 operations in adamw_update's order, the same bits whatever the ISA or the caller.
// The AVX2 variant of the launcher runs the bf16-out steps as adamw_range_avx2_bf16 (below): the same operations
// written with AVX2 intrinsics and software-pipelined, the same bits.
#pragma once

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ACCO_HAVE_AVX2_ADAMW 1
#else
#define ACCO_HAVE_AVX2_ADAMW 0
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

#if ACCO_HAVE_AVX2_ADAMW
// The commit / peek with bf16 `out` for the AVX2 variant (fp32 or bf16 gradient), written with intrinsics: the
// same IEEE fp32 operations as adamw_update, in its order (separate multiplies and adds, no FMA), and
// f32_to_bf16's rounding, so the bits of adamw_range_impl (tests/ops/test_adamw_cpu_pipelined.py: against the
// baseline variant and the CUDA body's harness; where two NaNs meet in one commutative operation the fp32 state
// keeps either payload, as the plain loops' variants already did).
//
// Why not the plain loops: on an AVX2 core the step is bound less by memory than by its chain of dependent
// long-latency operations (sqrt, two divisions) and the work around it; the plain loops run it tile by tile (the
// gradient cast, the step, the cast of `out`), so the out-of-order window sees one kind of work at a time. Here
// each block of 16 elements does its step, then casts and stores the previous block's new parameters: independent
// work beside the divider chain. Measured on 2 Zen 3 cores, 10M and 100M parameters, calls interleaved with the
// plain loops' build: the peek, which writes only `out`, 7-10% faster; the commit, bound by memory there, the
// same within 2%; 10-15% less CPU time per step (a loaded core's cost).
#define ACCO_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

struct Avx2Hyper {
  __m256 s, decay, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, step_size;
};

ACCO_AVX2_INLINE Avx2Hyper avx2_hyper(const AdamWHyper& h, float s) {
  return {_mm256_set1_ps(s),
          _mm256_set1_ps(h.decay),
          _mm256_set1_ps(h.one_minus_beta1),
          _mm256_set1_ps(h.beta2),
          _mm256_set1_ps(h.one_minus_beta2),
          _mm256_set1_ps(h.bc2_sqrt),
          _mm256_set1_ps(h.eps),
          _mm256_set1_ps(h.step_size)};
}

// 8 gradient elements in fp32 (to_f32: exact), times the gradient scale.
ACCO_AVX2_INLINE __m256 avx2_grad8(const float* g, const Avx2Hyper& k) {
  return _mm256_mul_ps(_mm256_loadu_ps(g), k.s);
}
ACCO_AVX2_INLINE __m256 avx2_grad8(const uint16_t* g, const Avx2Hyper& k) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), k.s);
}

// adamw_update on 8 elements at p, m, v (written back by a commit); returns the new parameters.
template <bool COMMIT>
ACCO_AVX2_INLINE __m256 avx2_step8(float* p, float* m, float* v, __m256 g, const Avx2Hyper& k) {
  __m256 pp = _mm256_loadu_ps(p), mm = _mm256_loadu_ps(m), vv = _mm256_loadu_ps(v);
  pp = _mm256_mul_ps(pp, k.decay);                                                 // p * decay
  mm = _mm256_add_ps(mm, _mm256_mul_ps(k.one_minus_beta1, _mm256_sub_ps(g, mm)));  // m + (1-b1) * (g - m)
  // b2 * v + ((1-b2) * g) * g
  vv = _mm256_add_ps(_mm256_mul_ps(k.beta2, vv), _mm256_mul_ps(_mm256_mul_ps(k.one_minus_beta2, g), g));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), k.bc2_sqrt), k.eps);  // sqrt(v) / bc2 + eps
  pp = _mm256_sub_ps(pp, _mm256_mul_ps(k.step_size, _mm256_div_ps(mm, denom)));  // p - step * (m / denom)
  if (COMMIT) {
    _mm256_storeu_ps(p, pp);
    _mm256_storeu_ps(m, mm);
    _mm256_storeu_ps(v, vv);
  }
  return pp;
}

// f32_to_bf16 of 8 lanes, in the low 16 bits of each 32-bit lane: (b + 0x7FFF + ((b >> 16) & 1)) >> 16, every NaN
// 0x7FC0 (selected before the shift; no non-NaN sum wraps: b <= 0xFF800000).
ACCO_AVX2_INLINE __m256i avx2_bf16_bits8(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_srli_epi32(_mm256_blendv_epi8(sum, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(nan)), 16);
}

// The bf16 of 16 fp32 (lo: elements 0-7, hi: 8-15) stored at dst; non-temporal when nt (dst 32-byte aligned).
ACCO_AVX2_INLINE void avx2_store_bf16x16(uint16_t* dst, __m256 lo, __m256 hi, bool nt) {
  // packus: each lane holds a value <= 0xFFFF, no saturation; it packs per 128-bit half, the permute restores order
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(avx2_bf16_bits8(lo), avx2_bf16_bits8(hi)), 0xD8);
  if (nt)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), w);
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), w);
}

// adamw_range_impl<G, bf16, COMMIT, true> on [b, e): blocks of 16 software-pipelined (block j's step, then block
// j-1's cast and store), the rest (< 16 elements) by adamw_range_impl. `out` may be the gradient itself: a block's
// gradient is read one block before its `out` is written. stream_out: non-temporal stores where `out` is 32-byte
// aligned.
template <typename G, bool COMMIT>
ACCO_AVX2_INLINE void adamw_range_avx2_bf16(const AdamWKernelArgs& a, float s, int64_t b, int64_t e,
                                            bool stream_out) {
  float* p = a.p;
  float* m = a.m;
  float* v = a.v;
  const G* g = static_cast<const G*>(a.g);
  uint16_t* out = static_cast<uint16_t*>(a.out);
  const Avx2Hyper k = avx2_hyper(a.h, s);
  const int64_t blocks = (e - b) / 16;
  const bool nt = stream_out && reinterpret_cast<uintptr_t>(out + b) % 32 == 0;
  __m256 lo = _mm256_setzero_ps(), hi = lo;
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t i = b + 16 * j;
    const __m256 nlo = avx2_step8<COMMIT>(p + i, m + i, v + i, avx2_grad8(g + i, k), k);
    const __m256 nhi = avx2_step8<COMMIT>(p + i + 8, m + i + 8, v + i + 8, avx2_grad8(g + i + 8, k), k);
    if (j > 0) avx2_store_bf16x16(out + i - 16, lo, hi, nt);
    lo = nlo;
    hi = nhi;
  }
  if (blocks > 0) avx2_store_bf16x16(out + b + 16 * (blocks - 1), lo, hi, nt);
  if (nt) stream_fence();
  if (b + 16 * blocks < e) adamw_range_impl<G, uint16_t, COMMIT, true>(a, s, b + 16 * blocks, e, false);
}
#undef ACCO_AVX2_INLINE
#endif

}  // namespace range
}  // namespace acco
