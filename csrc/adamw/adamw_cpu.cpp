// CPU launcher of the fused AdamW (commit / peek / noop).
//
// Loops are plain element loops over acco::adamw_update (adamw_math.h) that the compiler vectorises, compiled
// once per instruction-set variant (csrc/common/cpu.h; the best the running CPU supports is used); the AVX2
// variant runs the steps with bf16 `out` (fp32 or bf16 gradient) as adamw_range_avx2_bf16 instead, the same
// operations written with intrinsics and software-pipelined (adamw_cpu_range.h), the same bits. Threads:
// OpenMP, at most `num_threads` (the caller passes torch.get_num_threads()), and fewer for small inputs.
// Built with -ffp-contract=off and without -ffast-math: IEEE fp32 operations in adamw_update's order, so
// results do not depend on the ISA picked.
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>

#include "adamw/adamw_cpu_range.h"
#include "adamw/adamw_launch.h"
#include "common/cpu.h"

namespace acco {
namespace {

// (args, gradient scale, begin, end, stream_out): stream_out = write `out` with non-temporal stores.
using AdamWRange = void (*)(const AdamWKernelArgs&, float, int64_t, int64_t, bool);

using namespace range;  // the element loops (adamw_cpu_range.h)

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
#if ACCO_HAVE_AVX2_ADAMW
  // bf16 out from an fp32 or bf16 gradient: the intrinsics' software-pipelined loop (adamw_cpu_range.h), same bits
  if constexpr (HAS_OUT && std::is_same_v<O, uint16_t> && (std::is_same_v<G, float> || std::is_same_v<G, uint16_t>)) {
    adamw_range_avx2_bf16<G, COMMIT>(a, s, b, e, st);
    return;
  }
#endif
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
  return with_elem(out_dtype, [&](auto o) {
    using O = typename decltype(o)::type;
    return commit ? pick_adamw<G, O, true, true>() : pick_adamw<G, O, false, true>();
  });
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
    fn = with_elem(out_dtype, [](auto o) { return pick_cast<typename decltype(o)::type>(); });
  } else {
    fn = with_elem(g_dtype, [&](auto g) { return pick_adamw_out<typename decltype(g)::type>(out_dtype, commit); });
  }
  if (fn == nullptr) return;  // peek without out: nothing to write (the Python front forbids it)
  const bool stream_out = out_dtype >= 0 && a.n * elem_size(out_dtype) >= kStreamOutBytes;
  parallel_range(a.n, num_threads, [&](int64_t b, int64_t e) { fn(a, s, b, e, stream_out); });
}

}  // namespace acco
