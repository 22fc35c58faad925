// CPU launcher of the fused AdamW (commit / peek / noop).
//
// Loops are plain element loops over acco::adamw_update (adamw_math.h) that the compiler vectorises, compiled
// once per instruction-set variant (csrc/common/cpu.h; the best the running CPU supports is used). Threads:
// OpenMP, at most `num_threads` (the caller passes torch.get_num_threads()), and fewer for small inputs.
// Built with -ffp-contract=off and without -ffast-math: IEEE fp32 operations in adamw_update's order, so
// results do not depend on the ISA picked.
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <algorithm>

#include "adamw/adamw_launch.h"
#include "common/cpu.h"

namespace acco {
namespace {

// (args, gradient scale, begin, end, stream_out): stream_out = write `out` with non-temporal stores.
using AdamWRange = void (*)(const AdamWKernelArgs&, float, int64_t, int64_t, bool);

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
// bf16 <-> fp32 conversion inside the math loop makes GCC pick half-width vectors for everything.
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

template <typename G, typename O, bool COMMIT, bool HAS_OUT>
void adamw_range_base(const AdamWKernelArgs& a, float s, int64_t b, int64_t e, bool st) {
  adamw_range_impl<G, O, COMMIT, HAS_OUT>(a, s, b, e, st);
}
template <typename O>
void cast_range_base(const AdamWKernelArgs& a, float s, int64_t b, int64_t e, bool st) {
  cast_range_impl<O>(a, s, b, e, st);
}
#if ACCO_HAVE_ISA_VARIANTS
template <typename G, typename O, bool COMMIT, bool HAS_OUT>
ACCO_TARGET_AVX2 void adamw_range_avx2(const AdamWKernelArgs& a, float s, int64_t b, int64_t e, bool st) {
  adamw_range_impl<G, O, COMMIT, HAS_OUT>(a, s, b, e, st);
}
template <typename G, typename O, bool COMMIT, bool HAS_OUT>
ACCO_TARGET_AVX512 void adamw_range_avx512(const AdamWKernelArgs& a, float s, int64_t b, int64_t e, bool st) {
  adamw_range_impl<G, O, COMMIT, HAS_OUT>(a, s, b, e, st);
}
template <typename O>
ACCO_TARGET_AVX2 void cast_range_avx2(const AdamWKernelArgs& a, float s, int64_t b, int64_t e, bool st) {
  cast_range_impl<O>(a, s, b, e, st);
}
template <typename O>
ACCO_TARGET_AVX512 void cast_range_avx512(const AdamWKernelArgs& a, float s, int64_t b, int64_t e, bool st) {
  cast_range_impl<O>(a, s, b, e, st);
}
#endif

template <typename G, typename O, bool COMMIT, bool HAS_OUT>
AdamWRange pick_adamw() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &adamw_range_avx512<G, O, COMMIT, HAS_OUT>;
  if (kIsa == Isa::kAvx2) return &adamw_range_avx2<G, O, COMMIT, HAS_OUT>;
#endif
  return &adamw_range_base<G, O, COMMIT, HAS_OUT>;
}

template <typename O>
AdamWRange pick_cast() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &cast_range_avx512<O>;
  if (kIsa == Isa::kAvx2) return &cast_range_avx2<O>;
#endif
  return &cast_range_base<O>;
}

template <typename G>
AdamWRange pick_adamw_out(int out_dtype, bool commit) {
  if (out_dtype < 0) return commit ? pick_adamw<G, float, true, false>() : nullptr;
  if (out_dtype == kBF16)
    return commit ? pick_adamw<G, uint16_t, true, true>() : pick_adamw<G, uint16_t, false, true>();
  return commit ? pick_adamw<G, float, true, true>() : pick_adamw<G, float, false, true>();
}

// Runs f(begin, end) over [0, n) on at most num_threads OpenMP threads, in contiguous slices of whole tiles.
template <typename F>
void parallel_range(int64_t n, int num_threads, const F& f) {
  const int64_t want = (n + kGrain - 1) / kGrain;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, want)));
  if (nt <= 1) {
    f(int64_t(0), n);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t per = (((n + threads - 1) / threads) + kTile - 1) / kTile * kTile;
    const int64_t b = std::min(n, t * per), e = std::min(n, b + per);
    if (b < e) f(b, e);
  }
}

}  // namespace

void adamw_cpu(const AdamWKernelArgs& args, int g_dtype, int out_dtype, bool commit, int num_threads) {
  AdamWKernelArgs a = args;
  if (a.hyper_ptr != nullptr) a.h = load_hyper(a.hyper_ptr);  // host memory here: read once, by value
  const bool noop = a.noop_ptr != nullptr && *a.noop_ptr != 0;
  const float s = a.scale_ptr != nullptr ? a.grad_scale * *a.scale_ptr : a.grad_scale;
  AdamWRange fn;
  if (noop) {
    if (out_dtype < 0) return;
    fn = out_dtype == kBF16 ? pick_cast<uint16_t>() : pick_cast<float>();
  } else {
    fn = g_dtype == kBF16 ? pick_adamw_out<uint16_t>(out_dtype, commit) : pick_adamw_out<float>(out_dtype, commit);
  }
  if (fn == nullptr) return;  // peek without out: nothing to write (the Python front forbids it)
  const bool stream_out = out_dtype >= 0 && a.n * elem_size(out_dtype) >= kStreamOutBytes;
  parallel_range(a.n, num_threads, [&](int64_t b, int64_t e) { fn(a, s, b, e, stream_out); });
}

}  // namespace acco
