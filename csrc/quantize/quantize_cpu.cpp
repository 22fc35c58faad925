// CPU launchers of the blockwise int8 quantization (acco_ds.ops.quantize's "cpp" backend).
//
// Per block, in one pass over memory: a first sweep of the block finds absmax and whether it holds an inf or a
// NaN, a second sweep (the block is in cache by then) writes q and, with error feedback, the residual. The
// arithmetic is the torch reference's, operation for operation: v = x + residual in fp32, the scale in double
// rounded up to fp32, q = rint(v / scale) with an fp32 division (round half to even, the default rounding
// mode), the residual v - float(q) * scale rounded to its dtype with csrc/common/bf16.h's rule. Each block loop
// is compiled once per instruction-set variant (csrc/common/cpu.h) with -ffp-contract=off, so every variant
// gives the same bits.
#include "quantize/quantize_cpu.h"

#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "common/bf16.h"
#include "common/cpu.h"
#include "common/dtype.h"
#include "quantize/quantize_block.h"

namespace acco {
namespace {
using namespace quant;  // the per-block rules (quantize_block.h)

template <typename X, typename R, int OP>
inline __attribute__((always_inline)) void quant_impl(const void* xv, void* rv, int8_t* q, float* scales, int64_t len,
                                                      int64_t bs) {
  const X* x = static_cast<const X*>(xv);
  R* r = static_cast<R*>(rv);
  for (int64_t lo = 0, b = 0; lo < len; lo += bs, ++b)
    quant_block<X, R, OP>(x + lo, OP != kPlain ? r + lo : r, q + lo, scales + b, std::min(bs, len - lo));
}

template <bool ACC>
inline __attribute__((always_inline)) void deq_impl(const int8_t* __restrict q, const float* scales,
                                                    float* __restrict out, int64_t len, int64_t bs) {
  for (int64_t lo = 0, b = 0; lo < len; lo += bs, ++b) {
    const float s = scales[b];
    const int64_t end = std::min(bs, len - lo);
#pragma omp simd
    for (int64_t i = lo; i < lo + end; ++i) {
      const float d = static_cast<float>(q[i]) * s;
      out[i] = ACC ? out[i] + d : d;
    }
  }
}

// The fp64 sum of squares of the rows' sum (+ tilde), block by block through a scratch block of S; tilde_out
// (when given) receives the sum. Eight fixed fp64 lanes, added in lane order at the end: the same bits whatever the
// instruction set (no reassociation left to the compiler).
constexpr int kSqLanes = 8;
template <typename S>
inline __attribute__((always_inline)) double sq_sum_impl(const int8_t* const* q, const float* const* scales,
                                                         int64_t rows, int64_t first, int64_t len, int64_t bs,
                                                         const void* tildev, void* tilde_outv, void* scratchv) {
  const S* tilde = static_cast<const S*>(tildev);
  S* tilde_out = static_cast<S*>(tilde_outv);
  S* __restrict s = static_cast<S*>(scratchv);
  double lanes[kSqLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t blo = 0; blo < len; blo += bs) {
    const int64_t m = std::min(bs, len - blo);
    deq_sum_impl<S>(q, scales, rows, first + blo, s, m, bs);
    if (tilde != nullptr) add_tilde<S>(s, tilde + first + blo, m);
    if (tilde_out != nullptr) std::copy(s, s + m, tilde_out + first + blo);
    int64_t i = 0;
    for (; i + kSqLanes <= m; i += kSqLanes) {
#pragma omp simd
      for (int k = 0; k < kSqLanes; ++k) {
        const double x = to_f32(s[i + k]);
        lanes[k] += x * x;
      }
    }
    for (int k = 0; i < m; ++i, ++k) {
      const double x = to_f32(s[i]);
      lanes[k] += x * x;
    }
  }
  double total = 0.0;
  for (int k = 0; k < kSqLanes; ++k) total += lanes[k];
  return total;
}

using SqItem = double (*)(const int8_t* const*, const float* const*, int64_t, int64_t, int64_t, int64_t, const void*,
                          void*, void*);
template <typename S>
double sq_sum_base(const int8_t* const* q, const float* const* s, int64_t rows, int64_t first, int64_t len, int64_t bs,
                   const void* t, void* to, void* scratch) {
  return sq_sum_impl<S>(q, s, rows, first, len, bs, t, to, scratch);
}
#if ACCO_HAVE_ISA_VARIANTS
template <typename S>
ACCO_TARGET_AVX2 double sq_sum_avx2(const int8_t* const* q, const float* const* s, int64_t rows, int64_t first,
                                    int64_t len, int64_t bs, const void* t, void* to, void* scratch) {
  return sq_sum_impl<S>(q, s, rows, first, len, bs, t, to, scratch);
}
template <typename S>
ACCO_TARGET_AVX512 double sq_sum_avx512(const int8_t* const* q, const float* const* s, int64_t rows, int64_t first,
                                        int64_t len, int64_t bs, const void* t, void* to, void* scratch) {
  return sq_sum_impl<S>(q, s, rows, first, len, bs, t, to, scratch);
}
#endif

template <typename S>
SqItem pick_sq_sum1() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &sq_sum_avx512<S>;
  if (kIsa == Isa::kAvx2) return &sq_sum_avx2<S>;
#endif
  return &sq_sum_base<S>;
}

// One work item: `len` elements from its first block on (pointers already offset), blocks of `bs`.
using QuantItem = void (*)(const void*, void*, int8_t*, float*, int64_t, int64_t);
using DeqItem = void (*)(const int8_t*, const float*, float*, int64_t, int64_t);

template <typename X, typename R, int OP>
void quant_base(const void* x, void* r, int8_t* q, float* s, int64_t len, int64_t bs) {
  quant_impl<X, R, OP>(x, r, q, s, len, bs);
}
template <bool ACC>
void deq_base(const int8_t* q, const float* s, float* out, int64_t len, int64_t bs) {
  deq_impl<ACC>(q, s, out, len, bs);
}
using DeqSumItem = void (*)(const int8_t* const*, const float* const*, int64_t, int64_t, void*, int64_t, int64_t);
template <typename O>
void deq_sum_base(const int8_t* const* q, const float* const* s, int64_t rows, int64_t first, void* out, int64_t len,
                  int64_t bs) {
  deq_sum_impl<O>(q, s, rows, first, static_cast<O*>(out), len, bs);
}
#if ACCO_HAVE_ISA_VARIANTS
template <typename O>
ACCO_TARGET_AVX2 void deq_sum_avx2(const int8_t* const* q, const float* const* s, int64_t rows, int64_t first,
                                   void* out, int64_t len, int64_t bs) {
  deq_sum_impl<O>(q, s, rows, first, static_cast<O*>(out), len, bs);
}
template <typename O>
ACCO_TARGET_AVX512 void deq_sum_avx512(const int8_t* const* q, const float* const* s, int64_t rows, int64_t first,
                                       void* out, int64_t len, int64_t bs) {
  deq_sum_impl<O>(q, s, rows, first, static_cast<O*>(out), len, bs);
}
#endif

template <typename O>
DeqSumItem pick_deq_sum1() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &deq_sum_avx512<O>;
  if (kIsa == Isa::kAvx2) return &deq_sum_avx2<O>;
#endif
  return &deq_sum_base<O>;
}

#if ACCO_HAVE_ISA_VARIANTS
template <typename X, typename R, int OP>
ACCO_TARGET_AVX2 void quant_avx2(const void* x, void* r, int8_t* q, float* s, int64_t len, int64_t bs) {
  quant_impl<X, R, OP>(x, r, q, s, len, bs);
}
template <typename X, typename R, int OP>
ACCO_TARGET_AVX512 void quant_avx512(const void* x, void* r, int8_t* q, float* s, int64_t len, int64_t bs) {
  quant_impl<X, R, OP>(x, r, q, s, len, bs);
}
template <bool ACC>
ACCO_TARGET_AVX2 void deq_avx2(const int8_t* q, const float* s, float* out, int64_t len, int64_t bs) {
  deq_impl<ACC>(q, s, out, len, bs);
}
template <bool ACC>
ACCO_TARGET_AVX512 void deq_avx512(const int8_t* q, const float* s, float* out, int64_t len, int64_t bs) {
  deq_impl<ACC>(q, s, out, len, bs);
}
#endif

template <typename X, typename R, int OP>
QuantItem pick_quant3() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &quant_avx512<X, R, OP>;
  if (kIsa == Isa::kAvx2) return &quant_avx2<X, R, OP>;
#endif
  return &quant_base<X, R, OP>;
}

template <typename X>
QuantItem pick_quant2(int residual_dtype, bool difference) {
  if (residual_dtype == -1) return pick_quant3<X, float, kPlain>();
  return with_elem(residual_dtype, [&](auto r) {
    using R = typename decltype(r)::type;
    return difference ? pick_quant3<X, R, kDifference>() : pick_quant3<X, R, kResidual>();
  });
}

QuantItem pick_quant(int x_dtype, int residual_dtype, bool difference) {
  return with_elem(x_dtype, [&](auto x) { return pick_quant2<typename decltype(x)::type>(residual_dtype, difference); });
}

using AddDeqItem = void (*)(const int8_t*, const float*, const void*, void*, int64_t, int64_t);
template <typename O>
void add_deq_base(const int8_t* q, const float* s, const void* base, void* out, int64_t len, int64_t bs) {
  add_deq_impl<O>(q, s, static_cast<const O*>(base), static_cast<O*>(out), len, bs);
}
#if ACCO_HAVE_ISA_VARIANTS
template <typename O>
ACCO_TARGET_AVX2 void add_deq_avx2(const int8_t* q, const float* s, const void* base, void* out, int64_t len,
                                   int64_t bs) {
  add_deq_impl<O>(q, s, static_cast<const O*>(base), static_cast<O*>(out), len, bs);
}
template <typename O>
ACCO_TARGET_AVX512 void add_deq_avx512(const int8_t* q, const float* s, const void* base, void* out, int64_t len,
                                       int64_t bs) {
  add_deq_impl<O>(q, s, static_cast<const O*>(base), static_cast<O*>(out), len, bs);
}
#endif
template <typename O>
AddDeqItem pick_add_deq1() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &add_deq_avx512<O>;
  if (kIsa == Isa::kAvx2) return &add_deq_avx2<O>;
#endif
  return &add_deq_base<O>;
}

template <bool ACC>
DeqItem pick_deq() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &deq_avx512<ACC>;
  if (kIsa == Isa::kAvx2) return &deq_avx2<ACC>;
#endif
  return &deq_base<ACC>;
}

}  // namespace

void quantize_cpu(uintptr_t x, int x_dtype, uintptr_t residual, int residual_dtype, int64_t n, int64_t block_size,
                  uintptr_t q, uintptr_t scales, int num_threads) {
  const QuantItem fn = pick_quant(x_dtype, residual_dtype, false);
  const int64_t xs = elem_size(x_dtype), rs = residual_dtype == -1 ? 0 : elem_size(residual_dtype);
  for_items(n, block_size, num_threads, [&](int64_t first, int64_t len, int64_t block) {
    fn(reinterpret_cast<const char*>(x) + first * xs, reinterpret_cast<char*>(residual) + first * rs,
       reinterpret_cast<int8_t*>(q) + first, reinterpret_cast<float*>(scales) + block, len, block_size);
  });
}

void dequantize_cpu(uintptr_t q, uintptr_t scales, int64_t n, int64_t block_size, uintptr_t out, bool accumulate,
                    int num_threads) {
  const DeqItem fn = accumulate ? pick_deq<true>() : pick_deq<false>();
  for_items(n, block_size, num_threads, [&](int64_t first, int64_t len, int64_t block) {
    fn(reinterpret_cast<const int8_t*>(q) + first, reinterpret_cast<const float*>(scales) + block,
       reinterpret_cast<float*>(out) + first, len, block_size);
  });
}

void dequantize_sum_cpu(const std::vector<uintptr_t>& q_rows, const std::vector<uintptr_t>& scale_rows, int64_t n,
                        int64_t block_size, uintptr_t out, int out_dtype, int num_threads) {
  const QuantRows rows(q_rows, scale_rows);
  const DeqSumItem fn = with_elem(out_dtype, [](auto o) { return pick_deq_sum1<typename decltype(o)::type>(); });
  const int64_t os = elem_size(out_dtype);
  for_items(n, block_size, num_threads, [&](int64_t first, int64_t len, int64_t) {
    fn(rows.q.data(), rows.scales.data(), rows.size(), first, reinterpret_cast<char*>(out) + first * os, len,
       block_size);
  });
}

double quantized_sum_squares_cpu(const std::vector<uintptr_t>& q_rows, const std::vector<uintptr_t>& scale_rows,
                                 int64_t n, int64_t block_size, int dtype, uintptr_t tilde, uintptr_t tilde_out,
                                 int num_threads) {
  const QuantRows rows(q_rows, scale_rows);
  const SqItem fn = with_elem(dtype, [](auto s) { return pick_sq_sum1<typename decltype(s)::type>(); });
  const int64_t es = elem_size(dtype);
  // one partial per work item, summed in item order: the same value whatever the number of threads
  const int64_t per_item = std::max<int64_t>(1, kChunk / block_size) * block_size;
  std::vector<double> partial(static_cast<size_t>((n + per_item - 1) / per_item), 0.0);
  for_items(n, block_size, num_threads, [&](int64_t first, int64_t len, int64_t) {
    std::vector<char> scratch(static_cast<size_t>(std::min(block_size, len) * es));
    partial[first / per_item] = fn(rows.q.data(), rows.scales.data(), rows.size(), first, len, block_size,
                                   reinterpret_cast<const void*>(tilde), reinterpret_cast<void*>(tilde_out),
                                   scratch.data());
  });
  double total = 0.0;
  for (const double p : partial) total += p;
  return total;
}

void quantize_difference_cpu(uintptr_t x, uintptr_t base, int dtype, int64_t n, int64_t block_size, uintptr_t q,
                             uintptr_t scales, int num_threads) {
  const QuantItem fn = pick_quant(dtype, dtype, true);
  const int64_t xs = elem_size(dtype);
  for_items(n, block_size, num_threads, [&](int64_t first, int64_t len, int64_t block) {
    fn(reinterpret_cast<const char*>(x) + first * xs, reinterpret_cast<char*>(base) + first * xs,
       reinterpret_cast<int8_t*>(q) + first, reinterpret_cast<float*>(scales) + block, len, block_size);
  });
}

void add_dequantized_cpu(uintptr_t q, uintptr_t scales, uintptr_t base, uintptr_t out, int dtype, int64_t n,
                         int64_t block_size, int num_threads) {
  const AddDeqItem fn = with_elem(dtype, [](auto o) { return pick_add_deq1<typename decltype(o)::type>(); });
  const int64_t os = elem_size(dtype);
  for_items(n, block_size, num_threads, [&](int64_t first, int64_t len, int64_t block) {
    fn(reinterpret_cast<const int8_t*>(q) + first, reinterpret_cast<const float*>(scales) + block,
       reinterpret_cast<const char*>(base) + first * os, reinterpret_cast<char*>(out) + first * os, len, block_size);
  });
}

}  // namespace acco
