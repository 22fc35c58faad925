// CPU launchers of the fused round end (acco_ds.ops.fold_quantize's "cpp" backend): the round's last gradient
// folded into the flat buffer with the quantization of the blocks it covers whole, and the quantization of listed
// blocks (those no fold covered whole).
//
// The buffer is W chunks of `chunk` elements, each cut into blocks of block_size (the last one of a chunk short);
// block j of chunk c is global block c * nb + j (nb = ceil(chunk / block_size)), its scale at scales[c * nb + j],
// its q at the buffer's own positions. A fused block reads buffer, gradient and residual once from memory and
// writes q, its scale and the residual, never the buffer: v_i = float(cast_B(float(buffer_i) + float(grad_i)))
// (+ float(residual_i)) computed once into an fp32 scratch block (L1/L2), then quantize_block.h's rule
// (quant_values: an absmax sweep and a q / residual sweep of the scratch) with qmax 127 or 7; computing v once
// rather than in each sweep (as quant_block does) makes the fused pass faster than the accumulation and
// quantize_with_residual together even where they are compute-bound (bf16). The blocks the gradient's range covers only in part
// get accumulate_grads' rule, buffer_i = cast_B(float(buffer_i) + float(grad_i)) (accumulate_cpu.cpp with scale
// 1: the product by 1 is exact, so it is left out). Every loop is compiled once per instruction-set variant
// (csrc/common/cpu.h) with -ffp-contract=off: every variant gives the torch reference's bits
// (acco_ds/ops/fold_quantize.py's fold_quantize_ref / quantize_listed_blocks_ref).
//
// Threads: OpenMP over work items (whole blocks, about kChunk elements; the accumulated ends in pieces of at most
// kChunk), at most num_threads and at least kGrain elements per thread.
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/cpu.h"
#include "common/dtype.h"
#include "quantize/quantize_block.h"
#include "quantize/quantize_cpu.h"

namespace acco {
namespace {
using namespace quant;  // the per-block rules (quantize_block.h)

// v_i of a fused block: the accumulated value in the buffer's dtype, back in fp32, plus the residual (RES).
template <typename B, typename G, typename R, bool RES>
inline __attribute__((always_inline)) float folded(const B* __restrict buf, const G* __restrict grad, const R* r,
                                                   int64_t i) {
  const float sum = to_f32(from_f32<B>(to_f32(buf[i]) + to_f32(grad[i])));
  return RES ? sum + to_f32(r[i]) : sum;
}

// Work items: `len` elements from their first element on (every pointer already offset there).
//  FoldItem: whole blocks of bs (the last one may be short: a chunk's end), their scales from scales[0] on; a
//  scratch of min(bs, len) fp32 holds a block's v (computed once: the absmax and q sweeps read it in cache).
//  AccItem: the plain accumulation of len elements.
//  ListItem: whole blocks of the buffer (+ residual) quantized, as FoldItem without the gradient.
using FoldItem = void (*)(const void*, const void*, void*, int8_t*, float*, int64_t, int64_t, float*);
using AccItem = void (*)(void*, const void*, int64_t);
using ListItem = void (*)(const void*, void*, int8_t*, float*, int64_t, int64_t);

template <typename B, typename G, typename R, bool RES, int32_t QMAX>
inline __attribute__((always_inline)) void fold_impl(const void* bufv, const void* gradv, void* rv, int8_t* q,
                                                     float* scales, int64_t len, int64_t bs, float* scratch) {
  const B* buf = static_cast<const B*>(bufv);
  const G* grad = static_cast<const G*>(gradv);
  R* r = static_cast<R*>(rv);
  float* __restrict v = scratch;
  for (int64_t lo = 0, b = 0; lo < len; lo += bs, ++b) {
    const int64_t m = std::min(bs, len - lo);
    const B* __restrict xb = buf + lo;
    const G* __restrict gb = grad + lo;
    R* rb = RES ? r + lo : r;
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) v[i] = folded<B, G, R, RES>(xb, gb, rb, i);
    quant_values<R, RES, QMAX>([&](int64_t i) { return v[i]; }, rb, q + lo, scales + b, m);
  }
}

template <typename B, typename G>
inline __attribute__((always_inline)) void acc_impl(void* bufv, const void* gradv, int64_t len) {
  B* __restrict x = static_cast<B*>(bufv);
  const G* __restrict g = static_cast<const G*>(gradv);
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) x[i] = from_f32<B>(to_f32(x[i]) + to_f32(g[i]));
}

template <typename X, typename R, int OP, int32_t QMAX>
inline __attribute__((always_inline)) void list_impl(const void* xv, void* rv, int8_t* q, float* scales, int64_t len,
                                                     int64_t bs) {
  const X* x = static_cast<const X*>(xv);
  R* r = static_cast<R*>(rv);
  for (int64_t lo = 0, b = 0; lo < len; lo += bs, ++b)
    quant_block<X, R, OP, QMAX>(x + lo, OP != kPlain ? r + lo : r, q + lo, scales + b, std::min(bs, len - lo));
}

// The instruction-set variants of each item (csrc/common/cpu.h).
template <typename B, typename G, typename R, bool RES, int32_t QMAX>
void fold_base(const void* x, const void* g, void* r, int8_t* q, float* s, int64_t len, int64_t bs, float* v) {
  fold_impl<B, G, R, RES, QMAX>(x, g, r, q, s, len, bs, v);
}
template <typename B, typename G>
void acc_base(void* x, const void* g, int64_t len) {
  acc_impl<B, G>(x, g, len);
}
template <typename X, typename R, int OP, int32_t QMAX>
void list_base(const void* x, void* r, int8_t* q, float* s, int64_t len, int64_t bs) {
  list_impl<X, R, OP, QMAX>(x, r, q, s, len, bs);
}
#if ACCO_HAVE_ISA_VARIANTS
template <typename B, typename G, typename R, bool RES, int32_t QMAX>
ACCO_TARGET_AVX2 void fold_avx2(const void* x, const void* g, void* r, int8_t* q, float* s, int64_t len, int64_t bs,
                                 float* v) {
  fold_impl<B, G, R, RES, QMAX>(x, g, r, q, s, len, bs, v);
}
template <typename B, typename G, typename R, bool RES, int32_t QMAX>
ACCO_TARGET_AVX512 void fold_avx512(const void* x, const void* g, void* r, int8_t* q, float* s, int64_t len,
                                    int64_t bs, float* v) {
  fold_impl<B, G, R, RES, QMAX>(x, g, r, q, s, len, bs, v);
}
template <typename B, typename G>
ACCO_TARGET_AVX2 void acc_avx2(void* x, const void* g, int64_t len) {
  acc_impl<B, G>(x, g, len);
}
template <typename B, typename G>
ACCO_TARGET_AVX512 void acc_avx512(void* x, const void* g, int64_t len) {
  acc_impl<B, G>(x, g, len);
}
template <typename X, typename R, int OP, int32_t QMAX>
ACCO_TARGET_AVX2 void list_avx2(const void* x, void* r, int8_t* q, float* s, int64_t len, int64_t bs) {
  list_impl<X, R, OP, QMAX>(x, r, q, s, len, bs);
}
template <typename X, typename R, int OP, int32_t QMAX>
ACCO_TARGET_AVX512 void list_avx512(const void* x, void* r, int8_t* q, float* s, int64_t len, int64_t bs) {
  list_impl<X, R, OP, QMAX>(x, r, q, s, len, bs);
}
#endif

template <typename B, typename G, typename R, bool RES, int32_t QMAX>
FoldItem pick_fold5() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &fold_avx512<B, G, R, RES, QMAX>;
  if (kIsa == Isa::kAvx2) return &fold_avx2<B, G, R, RES, QMAX>;
#endif
  return &fold_base<B, G, R, RES, QMAX>;
}
template <typename B, typename G, int32_t QMAX>
FoldItem pick_fold3(int residual_dtype) {
  if (residual_dtype == -1) return pick_fold5<B, G, float, false, QMAX>();
  return with_elem(residual_dtype, [](auto r) { return pick_fold5<B, G, typename decltype(r)::type, true, QMAX>(); });
}
template <int32_t QMAX>
FoldItem pick_fold2(int buffer_dtype, int grad_dtype, int residual_dtype) {
  return with_elem(buffer_dtype, [&](auto b) {
    return with_elem(grad_dtype, [&](auto g) {
      return pick_fold3<typename decltype(b)::type, typename decltype(g)::type, QMAX>(residual_dtype);
    });
  });
}
FoldItem pick_fold(int buffer_dtype, int grad_dtype, int residual_dtype, int qmax) {
  return qmax == 7 ? pick_fold2<7>(buffer_dtype, grad_dtype, residual_dtype)
                   : pick_fold2<kQmax>(buffer_dtype, grad_dtype, residual_dtype);
}

template <typename B, typename G>
AccItem pick_acc2() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &acc_avx512<B, G>;
  if (kIsa == Isa::kAvx2) return &acc_avx2<B, G>;
#endif
  return &acc_base<B, G>;
}
AccItem pick_acc(int buffer_dtype, int grad_dtype) {
  return with_elem(buffer_dtype, [&](auto b) {
    return with_elem(grad_dtype, [](auto g) { return pick_acc2<typename decltype(b)::type, typename decltype(g)::type>(); });
  });
}

template <typename X, typename R, int OP, int32_t QMAX>
ListItem pick_list4() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &list_avx512<X, R, OP, QMAX>;
  if (kIsa == Isa::kAvx2) return &list_avx2<X, R, OP, QMAX>;
#endif
  return &list_base<X, R, OP, QMAX>;
}
template <typename X, int32_t QMAX>
ListItem pick_list2(int residual_dtype) {
  if (residual_dtype == -1) return pick_list4<X, float, kPlain, QMAX>();
  return with_elem(residual_dtype, [](auto r) { return pick_list4<X, typename decltype(r)::type, kResidual, QMAX>(); });
}
ListItem pick_list(int x_dtype, int residual_dtype, int qmax) {
  return with_elem(x_dtype, [&](auto x) {
    using X = typename decltype(x)::type;
    return qmax == 7 ? pick_list2<X, 7>(residual_dtype) : pick_list2<X, kQmax>(residual_dtype);
  });
}

// A work item: `len` elements from buffer position `pos`; `block` is the global index of its first block (fused
// or listed items), or -1 for a plain accumulation.
struct Item {
  int64_t pos, len, block;
};

// Runs run(item) for every item over at most num_threads OpenMP threads, at least kGrain elements per thread
// (`total` elements in all).
template <typename F>
void run_items(const std::vector<Item>& items, int64_t total, int num_threads, const F& run) {
  const int64_t n = static_cast<int64_t>(items.size());
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, total / kGrain)));
  if (nt <= 1 || n <= 1) {
    for (int64_t k = 0; k < n; ++k) run(items[k]);
    return;
  }
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t k = 0; k < n; ++k) run(items[k]);
}

// Whole blocks j0 .. j1 - 1 of chunk c as items of about kChunk elements.
void add_blocks(std::vector<Item>& items, int64_t c, int64_t j0, int64_t j1, int64_t chunk, int64_t nb, int64_t bs) {
  const int64_t per_item = std::max<int64_t>(1, kChunk / bs);  // blocks
  for (int64_t j = j0; j < j1; j += per_item) {
    const int64_t stop = std::min(j1, j + per_item);
    items.push_back({c * chunk + j * bs, std::min(stop * bs, chunk) - j * bs, c * nb + j});
  }
}

}  // namespace

void fold_quantize_cpu(uintptr_t buffer, int buffer_dtype, uintptr_t grad, int grad_dtype, int64_t offset,
                       int64_t numel, int64_t chunk, int64_t world, uintptr_t residual, int residual_dtype,
                       uintptr_t q, uintptr_t scales, int64_t block_size, int qmax, int num_threads) {
  (void)world;  // the range is within the buffer (checked by the caller); the chunks it touches are all it reads
  if (numel <= 0) return;
  const int64_t bs = block_size, nb = (chunk + bs - 1) / bs, end = offset + numel;
  std::vector<Item> items;
  auto add_accumulate = [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; p += kChunk) items.push_back({p, std::min(kChunk, hi - p), -1});
  };
  for (int64_t c = offset / chunk; c * chunk < end; ++c) {
    const int64_t base = c * chunk;
    const int64_t lo = std::max(offset, base) - base, hi = std::min(end, base + chunk) - base;  // in the chunk
    const int64_t first = (lo + bs - 1) / bs;  // the blocks wholly inside [lo, hi): first .. stop - 1
    const int64_t stop = std::max(first, hi == chunk ? nb : hi / bs);
    if (stop == first) {
      add_accumulate(base + lo, base + hi);
      continue;
    }
    const int64_t a = first * bs, b = std::min(stop * bs, chunk);
    add_accumulate(base + lo, base + a);
    add_blocks(items, c, first, stop, chunk, nb, bs);
    add_accumulate(base + b, base + hi);
  }
  const FoldItem fold = pick_fold(buffer_dtype, grad_dtype, residual_dtype, qmax);
  const AccItem acc = pick_acc(buffer_dtype, grad_dtype);
  const int64_t xs = elem_size(buffer_dtype), gs = elem_size(grad_dtype);
  const int64_t rs = residual_dtype == -1 ? 0 : elem_size(residual_dtype);
  char* x = reinterpret_cast<char*>(buffer);
  const char* g = reinterpret_cast<const char*>(grad);
  char* r = reinterpret_cast<char*>(residual);
  run_items(items, numel, num_threads, [&](const Item& it) {
    if (it.block < 0) {
      acc(x + it.pos * xs, g + (it.pos - offset) * gs, it.len);
    } else {
      std::vector<float> v(static_cast<size_t>(std::min(bs, it.len)));
      fold(x + it.pos * xs, g + (it.pos - offset) * gs, r + it.pos * rs, reinterpret_cast<int8_t*>(q) + it.pos,
           reinterpret_cast<float*>(scales) + it.block, it.len, bs, v.data());
    }
  });
}

void quantize_listed_blocks_cpu(uintptr_t buffer, int buffer_dtype, int64_t chunk, int64_t world, uintptr_t residual,
                                int residual_dtype, uintptr_t q, uintptr_t scales, int64_t block_size, int qmax,
                                uintptr_t blocks, int64_t num_listed, int num_threads) {
  const int64_t bs = block_size, nb = (chunk + bs - 1) / bs, total_blocks = world * nb;
  const int64_t* listed = reinterpret_cast<const int64_t*>(blocks);
  // every index checked before anything is written; consecutive blocks of one chunk merged into runs
  std::vector<Item> items;
  int64_t total = 0;
  for (int64_t k = 0; k < num_listed;) {
    const int64_t b0 = listed[k];
    if (b0 < 0 || b0 >= total_blocks)
      throw std::invalid_argument("quantize_listed_blocks: blocks[" + std::to_string(k) + "] = " +
                                  std::to_string(b0) + " is outside 0 .. " + std::to_string(total_blocks - 1) +
                                  " (the buffer's " + std::to_string(world) + " chunks of " + std::to_string(nb) +
                                  " blocks)");
    if (k > 0 && b0 <= listed[k - 1])
      throw std::invalid_argument("quantize_listed_blocks: blocks must be sorted and distinct, got blocks[" +
                                  std::to_string(k - 1) + "] = " + std::to_string(listed[k - 1]) + " then blocks[" +
                                  std::to_string(k) + "] = " + std::to_string(b0));
    int64_t b1 = b0 + 1;  // the run b0 .. b1 - 1, inside b0's chunk
    ++k;
    while (k < num_listed && listed[k] == b1 && b1 % nb != 0) {
      ++b1;
      ++k;
    }
    const int64_t c = b0 / nb;
    const size_t before = items.size();
    add_blocks(items, c, b0 - c * nb, b1 - c * nb, chunk, nb, bs);
    for (size_t i = before; i < items.size(); ++i) total += items[i].len;
  }
  const ListItem fn = pick_list(buffer_dtype, residual_dtype, qmax);
  const int64_t xs = elem_size(buffer_dtype), rs = residual_dtype == -1 ? 0 : elem_size(residual_dtype);
  const char* x = reinterpret_cast<const char*>(buffer);
  char* r = reinterpret_cast<char*>(residual);
  run_items(items, total, num_threads, [&](const Item& it) {
    fn(x + it.pos * xs, r + it.pos * rs, reinterpret_cast<int8_t*>(q) + it.pos,
       reinterpret_cast<float*>(scales) + it.block, it.len, bs);
  });
}

}  // namespace acco
