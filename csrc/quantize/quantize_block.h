// The blockwise quantizer's per-block rules on the CPU, shared by the quantize launchers (quantize_cpu.cpp), the
// fused round end (fold_quantize_cpu.cpp: the last accumulation with its quantization), the fused AdamW + parameter
// difference (csrc/adamw/adamw_difference_cpu.cpp) and the AdamW step on the quantized
// rows' sum (csrc/adamw/adamw_quantized_sum_cpu.cpp). Inline functions of plain C++; each
// translation unit compiles them inside its own instruction-set variants (csrc/common/cpu.h) with
// -ffp-contract=off, so every variant and every caller gives the same bits (acco_ds/ops/quantize.py states the
// rules; its torch reference is the oracle).
#pragma once

#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "common/bf16.h"
#include "common/cpu.h"

namespace acco {
namespace quant {

constexpr int64_t kChunk = 1 << 16;  // elements per work item (whole blocks, at least one)
constexpr int32_t kQmax = 127;  // 8 bits; the 4-bit rule is the same with 7 (the QMAX template parameters)
// What a block quantizes: v = x (kPlain), v = x + residual with the residual rewritten (kResidual), v = x - base
// with the base only read (kDifference: a parameter difference).
constexpr int kPlain = 0, kResidual = 1, kDifference = 2;
constexpr uint32_t kInfBits = 0x7F800000u;  // the bits of +inf

// absmax / QMAX rounded up to fp32 (QMAX: 127 for 8 bits, 7 for 4 bits): the division in double, rounded to
// nearest, then one fp32 step up where that went below the double quotient (the reference's torch.nextafter).
template <int32_t QMAX = kQmax>
inline float scale_of(float absmax) {
  static_assert(QMAX == 127 || QMAX == 7, "the quantizer's qmax is 127 (8 bits) or 7 (4 bits)");
  const double wide = static_cast<double>(absmax) / static_cast<double>(QMAX);
  const float s = static_cast<float>(wide);
  return static_cast<double>(s) < wide ? nextafterf(s, std::numeric_limits<float>::infinity()) : s;
}

template <typename X, typename R, int OP>
inline __attribute__((always_inline)) float value(const X* __restrict x, const R* __restrict r, int64_t i) {
  return OP == kResidual ? to_f32(x[i]) + to_f32(r[i]) : OP == kDifference ? to_f32(x[i]) - to_f32(r[i]) : to_f32(x[i]);
}

// q (and the residual, when RES) of one block of `len` elements, which holds an inf or a NaN: scale NaN, q 0,
// residual 0.
template <typename R, bool RES>
inline __attribute__((always_inline)) void non_finite_block(R* r, int8_t* __restrict q, float* scale, int64_t len) {
  *scale = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 0; i < len; ++i) {
    q[i] = 0;
    if (RES) r[i] = from_f32<R>(0.0f);
  }
}

// The block rule on the values v_i = value(i) (fp32), i in [0, len): scale (*scale), q and, when RES, the residual
// r[i] <- v_i - q_i * scale rounded to R (r may be read by value(i): element i is read before it is written).
// value(i) is evaluated twice per element (the absmax sweep, then the q sweep; the block is in cache by then), so
// it must be plain fp32 arithmetic of what it reads (the same bits both times). QMAX: 127 (8 bits) or 7 (4 bits).
template <typename R, bool RES, int32_t QMAX, typename V>
inline __attribute__((always_inline)) void quant_values(const V& value, R* r, int8_t* __restrict q, float* scale,
                                                        int64_t len) {
  // |v| as bits: their integer order is the order of the values, and an inf or a NaN is >= kInfBits, so one
  // integer max gives absmax and whether the block is finite (exact in any order: no rounding involved)
  uint32_t top = 0;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t a = f32_bits(value(i)) & 0x7FFFFFFFu;
    top = a > top ? a : top;
  }
  if (top >= kInfBits) {
    non_finite_block<R, RES>(r, q, scale, len);
    return;
  }
  const float s = scale_of<QMAX>(bits_f32(top));
  *scale = s;
  // an all-zero block (s == 0) divides its +-0 by 1: q = 0, residual = v, as the reference gives
  const float div = s > 0.0f ? s : 1.0f;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const float v = value(i);
    // |v / div| <= QMAX (div >= absmax / QMAX), so clamping the integer is the reference's clamp of the float
    // (an integer clamp vectorises where GCC keeps the float one as branches)
    const int32_t t = static_cast<int32_t>(rintf(v / div));
    const int32_t qi = t < -QMAX ? -QMAX : t > QMAX ? QMAX : t;
    q[i] = static_cast<int8_t>(qi);
    // float(qi), not the rounded quotient: a -0.0 quotient is the integer 0, whose product with s is +0.0
    if (RES) r[i] = from_f32<R>(v - static_cast<float>(qi) * s);
  }
}

// One block of `len` elements of v = x (kPlain), x + r (kResidual: r rewritten) or x - r (kDifference: r only
// read), quantized with QMAX (127: 8 bits, the default; 7: 4 bits).
template <typename X, typename R, int OP, int32_t QMAX = kQmax>
inline __attribute__((always_inline)) void quant_block(const X* __restrict x, R* __restrict r, int8_t* __restrict q,
                                                       float* scale, int64_t len) {
  quant_values<R, OP == kResidual, QMAX>([&](int64_t i) { return value<X, R, OP>(x, r, i); }, r, q, scale, len);
}

// out[i] = base[i] + q[i] * scale (fp32: the product rounded, then the sum), stored in O (out may be base).
template <typename O>
inline __attribute__((always_inline)) void add_deq_impl(const int8_t* __restrict q, const float* scales,
                                                        const O* base, O* out, int64_t len, int64_t bs) {
  for (int64_t lo = 0, b = 0; lo < len; lo += bs, ++b) {
    const float s = scales[b];
    const int64_t end = std::min(bs, len - lo);
#pragma omp simd
    for (int64_t i = lo; i < lo + end; ++i) out[i] = from_f32<O>(to_f32(base[i]) + static_cast<float>(q[i]) * s);
  }
}

// W ranks' quantized rows as the launchers take them (their addresses), as pointers in summation order.
struct QuantRows {
  std::vector<const int8_t*> q;
  std::vector<const float*> scales;
  QuantRows(const std::vector<uintptr_t>& q_rows, const std::vector<uintptr_t>& scale_rows) {
    for (size_t r = 0; r < q_rows.size(); ++r) {
      q.push_back(reinterpret_cast<const int8_t*>(q_rows[r]));
      scales.push_back(reinterpret_cast<const float*>(scale_rows[r]));
    }
  }
  int64_t size() const { return static_cast<int64_t>(q.size()); }
};

// The owner's sum of W ranks' quantized chunks, one block at a time in pieces of kSumTile elements: an fp32
// accumulator starts at the first row's q * scale and adds each further row's q * scale in `rows` order (the
// product rounded, then the sum: dequantize + dequantize_add, W - 1 times), then is stored in out's dtype.
constexpr int64_t kSumTile = 256;
template <typename O>
inline __attribute__((always_inline)) void deq_sum_impl(const int8_t* const* q, const float* const* scales,
                                                        int64_t rows, int64_t first, O* __restrict out,
                                                        int64_t len, int64_t bs) {
  alignas(64) float acc[kSumTile];
  for (int64_t blo = 0; blo < len; blo += bs) {  // a work item starts on a block boundary (for_items)
    const int64_t b = (first + blo) / bs;
    const int64_t block_len = std::min(bs, len - blo);
    for (int64_t lo = blo; lo < blo + block_len; lo += kSumTile) {
      const int64_t m = std::min(kSumTile, blo + block_len - lo);
      const int8_t* __restrict q0 = q[0] + first + lo;
      const float s0 = scales[0][b];
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) acc[i] = static_cast<float>(q0[i]) * s0;
      int64_t r = 1;
      for (; r + 1 < rows; r += 2) {  // two rows a sweep of acc (the same operations, in the same order)
        const int8_t* __restrict qa = q[r] + first + lo;
        const int8_t* __restrict qb = q[r + 1] + first + lo;
        const float sa = scales[r][b], sb = scales[r + 1][b];
#pragma omp simd
        for (int64_t i = 0; i < m; ++i) {
          const float a = acc[i] + static_cast<float>(qa[i]) * sa;
          acc[i] = a + static_cast<float>(qb[i]) * sb;
        }
      }
      if (r < rows) {
        const int8_t* __restrict qr = q[r] + first + lo;
        const float sr = scales[r][b];
#pragma omp simd
        for (int64_t i = 0; i < m; ++i) acc[i] = acc[i] + static_cast<float>(qr[i]) * sr;
      }
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) out[lo + i] = from_f32<O>(acc[i]);
    }
  }
}

// s[i] = s[i] + tilde[i] in fp32, stored in S: the acco commit's `grad += tilde` on a block of the rows' sum.
template <typename S>
inline __attribute__((always_inline)) void add_tilde(S* __restrict s, const S* __restrict tilde, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) s[i] = from_f32<S>(to_f32(s[i]) + to_f32(tilde[i]));
}

// Calls run(first element, elements) for every work item (whole blocks, about kChunk elements), over at most
// `num_threads` OpenMP threads and at least kGrain elements per thread.
template <typename F>
void for_items(int64_t n, int64_t bs, int num_threads, const F& run) {
  const int64_t per_item = std::max<int64_t>(1, kChunk / bs) * bs;
  const int64_t items = (n + per_item - 1) / per_item;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, n / kGrain)));
  auto one = [&](int64_t k) { run(k * per_item, std::min(per_item, n - k * per_item), k * per_item / bs); };
  if (nt <= 1 || items <= 1) {
    for (int64_t k = 0; k < items; ++k) one(k);
    return;
  }
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t k = 0; k < items; ++k) one(k);
}


}  // namespace quant
}  // namespace acco
