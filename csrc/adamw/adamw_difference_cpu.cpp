// The AdamW step and the quantized parameter difference in one pass over the shard (CPU; the "fused" backend of
// acco_ds.ops.adamw_difference).
//
// Per quantization block of the shard: the AdamW step of the block's elements (commit, peek, or the noop cast of
// the master), its new parameters cast to the parameter dtype into a scratch block (L1/L2), the block's
// difference to `base` quantized (absmax, scale, q: quantize_difference's rule), and `out` written as base +
// q * scale (add_dequantized's rule). Bit for bit the composition adamw_step(out=new) -> quantize_difference(new,
// base) -> add_dequantized(out, base): the same inline loops (adamw_cpu_range.h, quantize_block.h), the same
// order of fp32 operations. `base` may be `out` itself (the block's base is read before `out` is written), no
// other overlap. Memory per element: the step's own traffic, plus base read and q written; the composition also
// writes the new parameters, reads them back with the base, and reads base and q again to apply them.
// Threads: OpenMP over work items of whole blocks (quantize_block.h's for_items).
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "adamw/adamw_cpu_range.h"
#include "adamw/adamw_launch.h"
#include "common/cpu.h"
#include "quantize/quantize_block.h"

namespace acco {
namespace {

// (args, gradient scale, noop, base, q, scales, first element, elements, block size, scratch of >= min(bs, len))
using DiffItem = void (*)(const AdamWKernelArgs&, float, bool, const void*, int8_t*, float*, int64_t, int64_t,
                          int64_t, void*);

template <typename G, typename O, bool COMMIT>
inline __attribute__((always_inline)) void diff_impl(const AdamWKernelArgs& a, float s, bool noop,
                                                     const void* basev, int8_t* q, float* scales, int64_t first,
                                                     int64_t len, int64_t bs, void* scratch) {
  const O* base = static_cast<const O*>(basev);
  O* out = static_cast<O*>(a.out);
  O* fresh = static_cast<O*>(scratch);
  for (int64_t lo = first, b = first / bs; lo < first + len; lo += bs, ++b) {
    const int64_t n = std::min(bs, first + len - lo);
    AdamWKernelArgs block = a;  // the block's slices; its new parameters into the scratch block
    block.p = a.p + lo;
    block.m = a.m + lo;
    block.v = a.v + lo;
    block.g = static_cast<const G*>(a.g) + lo;
    block.out = fresh;
    if (noop)
      range::cast_range_impl<O>(block, s, 0, n, false);
    else
      range::adamw_range_impl<G, O, COMMIT, true>(block, s, 0, n, false);
    quant::quant_block<O, O, quant::kDifference>(fresh, const_cast<O*>(base + lo), q + lo, scales + b, n);
    quant::add_deq_impl<O>(q + lo, scales + b, base + lo, out + lo, n, n);
  }
}

template <typename G, typename O, bool COMMIT>
void diff_base(const AdamWKernelArgs& a, float s, bool noop, const void* base, int8_t* q, float* scales,
               int64_t first, int64_t len, int64_t bs, void* scratch) {
  diff_impl<G, O, COMMIT>(a, s, noop, base, q, scales, first, len, bs, scratch);
}
#if ACCO_HAVE_ISA_VARIANTS
template <typename G, typename O, bool COMMIT>
ACCO_TARGET_AVX2 void diff_avx2(const AdamWKernelArgs& a, float s, bool noop, const void* base, int8_t* q,
                                float* scales, int64_t first, int64_t len, int64_t bs, void* scratch) {
  diff_impl<G, O, COMMIT>(a, s, noop, base, q, scales, first, len, bs, scratch);
}
template <typename G, typename O, bool COMMIT>
ACCO_TARGET_AVX512 void diff_avx512(const AdamWKernelArgs& a, float s, bool noop, const void* base, int8_t* q,
                                    float* scales, int64_t first, int64_t len, int64_t bs, void* scratch) {
  diff_impl<G, O, COMMIT>(a, s, noop, base, q, scales, first, len, bs, scratch);
}
#endif

template <typename G, typename O, bool COMMIT>
DiffItem pick_diff3() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &diff_avx512<G, O, COMMIT>;
  if (kIsa == Isa::kAvx2) return &diff_avx2<G, O, COMMIT>;
#endif
  return &diff_base<G, O, COMMIT>;
}

template <typename G>
DiffItem pick_diff2(int out_dtype, bool commit) {
  return with_elem(out_dtype, [&](auto o) {
    using O = typename decltype(o)::type;
    return commit ? pick_diff3<G, O, true>() : pick_diff3<G, O, false>();
  });
}

}  // namespace

void adamw_difference_cpu(const AdamWKernelArgs& args, int g_dtype, int out_dtype, bool commit, uintptr_t base,
                          uintptr_t q, uintptr_t scales, int64_t block_size, int num_threads) {
  AdamWKernelArgs a = args;
  if (a.hyper_ptr != nullptr) a.h = load_hyper(a.hyper_ptr);  // host memory here: read once, by value
  const bool noop = a.noop_ptr != nullptr && *a.noop_ptr != 0;
  const float s = a.scale_ptr != nullptr ? a.grad_scale * *a.scale_ptr : a.grad_scale;
  const DiffItem fn =
      with_elem(g_dtype, [&](auto g) { return pick_diff2<typename decltype(g)::type>(out_dtype, commit); });
  const int64_t os = elem_size(out_dtype);
  quant::for_items(a.n, block_size, num_threads, [&](int64_t first, int64_t len, int64_t) {
    std::vector<char> scratch(static_cast<size_t>(std::min(block_size, len) * os));
    fn(a, s, noop, reinterpret_cast<const void*>(base), reinterpret_cast<int8_t*>(q),
       reinterpret_cast<float*>(scales), first, len, block_size, scratch.data());
  });
}

}  // namespace acco
