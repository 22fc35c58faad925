// The AdamW step on the owner's sum of W ranks' quantized chunks, never stored in full (CPU; the "fused" backend
// of acco_ds.ops.quantized_sum_step).
//
// Per quantization block of the shard: the rows' sum (quantize_block.h's deq_sum_impl: fp32, rows in the given
// order, stored in the gradient dtype G) into a scratch block of G, plus tilde when given (add_tilde), then the
// AdamW step of the block on it (adamw_cpu_range.h; the noop cast of the master when the flag is set), its new
// parameters into `out`, or with a `base` into a scratch block whose difference to base is quantized and applied
// (adamw_difference_cpu.cpp's rule). Bit for bit the composition dequantize_sum -> (+= tilde) -> adamw_step or
// adamw_step_difference: the same inline loops in the same order of fp32 operations. Memory per element: the W int8
// values (and their scales) read, where the composition writes the sum and reads it back. Threads: OpenMP over
// work items of whole blocks (quantize_block.h's for_items).
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

struct SumSource {
  const int8_t* const* q;  // the rows' int8 values, in summation order
  const float* const* scales;
  int64_t rows;
  const void* tilde;  // G, or nullptr
};

struct Difference {
  const void* base;  // O, or nullptr: no difference, out written directly
  int8_t* q;
  float* scales;
};

// (args, gradient scale, noop, rows' sum, difference, first element, elements, block size, scratch of G, scratch
// of O; each scratch >= min(block size, elements))
using SumItem = void (*)(const AdamWKernelArgs&, float, bool, const SumSource&, const Difference&, int64_t, int64_t,
                         int64_t, void*, void*);

template <typename G, typename O, bool COMMIT, bool DIFF>
inline __attribute__((always_inline)) void sum_step_impl(const AdamWKernelArgs& a, float s, bool noop,
                                                         const SumSource& src, const Difference& d, int64_t first,
                                                         int64_t len, int64_t bs, void* g_scratch,
                                                         void* o_scratch) {
  G* gs = static_cast<G*>(g_scratch);
  O* out = static_cast<O*>(a.out);
  const O* base = static_cast<const O*>(d.base);
  const G* tilde = static_cast<const G*>(src.tilde);
  for (int64_t lo = first, b = first / bs; lo < first + len; lo += bs, ++b) {
    const int64_t n = std::min(bs, first + len - lo);
    quant::deq_sum_impl<G>(src.q, src.scales, src.rows, lo, gs, n, bs);
    if (tilde != nullptr) quant::add_tilde<G>(gs, tilde + lo, n);
    AdamWKernelArgs block = a;  // the block's slices, its gradient the scratch block
    block.p = a.p + lo;
    block.m = a.m + lo;
    block.v = a.v + lo;
    block.g = gs;
    block.out = DIFF ? o_scratch : static_cast<void*>(out + lo);
    if (noop)
      range::cast_range_impl<O>(block, s, 0, n, false);
    else
      range::adamw_range_impl<G, O, COMMIT, true>(block, s, 0, n, false);
    if (DIFF) {
      const O* fresh = static_cast<const O*>(o_scratch);
      quant::quant_block<O, O, quant::kDifference>(fresh, const_cast<O*>(base + lo), d.q + lo, d.scales + b, n);
      quant::add_deq_impl<O>(d.q + lo, d.scales + b, base + lo, out + lo, n, n);
    }
  }
}

template <typename G, typename O, bool COMMIT, bool DIFF>
void sum_step_base(const AdamWKernelArgs& a, float s, bool noop, const SumSource& src, const Difference& d,
                   int64_t first, int64_t len, int64_t bs, void* gsc, void* osc) {
  sum_step_impl<G, O, COMMIT, DIFF>(a, s, noop, src, d, first, len, bs, gsc, osc);
}
#if ACCO_HAVE_ISA_VARIANTS
template <typename G, typename O, bool COMMIT, bool DIFF>
ACCO_TARGET_AVX2 void sum_step_avx2(const AdamWKernelArgs& a, float s, bool noop, const SumSource& src,
                                    const Difference& d, int64_t first, int64_t len, int64_t bs, void* gsc,
                                    void* osc) {
  sum_step_impl<G, O, COMMIT, DIFF>(a, s, noop, src, d, first, len, bs, gsc, osc);
}
template <typename G, typename O, bool COMMIT, bool DIFF>
ACCO_TARGET_AVX512 void sum_step_avx512(const AdamWKernelArgs& a, float s, bool noop, const SumSource& src,
                                        const Difference& d, int64_t first, int64_t len, int64_t bs, void* gsc,
                                        void* osc) {
  sum_step_impl<G, O, COMMIT, DIFF>(a, s, noop, src, d, first, len, bs, gsc, osc);
}
#endif

template <typename G, typename O, bool COMMIT, bool DIFF>
SumItem pick4() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &sum_step_avx512<G, O, COMMIT, DIFF>;
  if (kIsa == Isa::kAvx2) return &sum_step_avx2<G, O, COMMIT, DIFF>;
#endif
  return &sum_step_base<G, O, COMMIT, DIFF>;
}

template <typename G, typename O>
SumItem pick2(bool commit, bool diff) {
  if (commit) return diff ? pick4<G, O, true, true>() : pick4<G, O, true, false>();
  return diff ? pick4<G, O, false, true>() : pick4<G, O, false, false>();
}

template <typename G>
SumItem pick1(int out_dtype, bool commit, bool diff) {
  return with_elem(out_dtype, [&](auto o) { return pick2<G, typename decltype(o)::type>(commit, diff); });
}

}  // namespace

void adamw_quantized_sum_cpu(const AdamWKernelArgs& args, int g_dtype, int out_dtype, bool commit,
                             const std::vector<uintptr_t>& q_rows, const std::vector<uintptr_t>& scale_rows,
                             uintptr_t tilde, int64_t block_size, uintptr_t base, uintptr_t dq, uintptr_t dscales,
                             int num_threads) {
  AdamWKernelArgs a = args;
  if (a.hyper_ptr != nullptr) a.h = load_hyper(a.hyper_ptr);  // host memory here: read once, by value
  const bool noop = a.noop_ptr != nullptr && *a.noop_ptr != 0;
  const float s = a.scale_ptr != nullptr ? a.grad_scale * *a.scale_ptr : a.grad_scale;
  const quant::QuantRows rows(q_rows, scale_rows);
  const SumSource src{rows.q.data(), rows.scales.data(), rows.size(), reinterpret_cast<const void*>(tilde)};
  const bool diff = base != 0;
  const Difference d{reinterpret_cast<const void*>(base), reinterpret_cast<int8_t*>(dq),
                     reinterpret_cast<float*>(dscales)};
  const SumItem fn =
      with_elem(g_dtype, [&](auto g) { return pick1<typename decltype(g)::type>(out_dtype, commit, diff); });
  const int64_t gs = elem_size(g_dtype), os = elem_size(out_dtype);
  quant::for_items(a.n, block_size, num_threads, [&](int64_t first, int64_t len, int64_t) {
    const int64_t m = std::min(block_size, len);
    std::vector<char> g_scratch(static_cast<size_t>(m * gs)), o_scratch(static_cast<size_t>(diff ? m * os : 0));
    fn(a, s, noop, src, d, first, len, block_size, g_scratch.data(), o_scratch.data());
  });
}

}  // namespace acco
