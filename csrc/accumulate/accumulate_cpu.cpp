// CPU launcher of the gradient accumulation / cast-copy into a flat buffer (acco_ds.ops.accumulate's "cpp"
// backend).
//
// buffer[off_i : off_i + numel_i] = cast(float(buffer) + float(grad_i) * scale) for every i (accumulate), or
// buffer = cast(float(grad) * scale) (copy): the fp32 product rounded, then the sum rounded, cast with
// csrc/common/bf16.h's rule (bf16 or fp16). The tensors are cut in chunks of kChunk elements, run over OpenMP threads (at most
// `num_threads`, fewer for small inputs); each chunk's loop is compiled once per instruction-set variant
// (csrc/common/cpu.h) with -ffp-contract=off, so every variant gives the same bits.
#include "accumulate/accumulate_cpu.h"

#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "common/bf16.h"
#include "common/cpu.h"
#include "common/dtype.h"

namespace acco {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per work item

using AccRange = void (*)(void*, const void*, int64_t, float);

template <typename B, typename G, bool ACC>
inline __attribute__((always_inline)) void acc_impl(void* buf, const void* grad, int64_t len, float s) {
  B* __restrict x = static_cast<B*>(buf);
  const G* __restrict g = static_cast<const G*>(grad);
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const float gi = to_f32(g[i]) * s;
    x[i] = from_f32<B>(ACC ? to_f32(x[i]) + gi : gi);
  }
}
template <typename B, typename G, bool ACC>
void acc_base(void* buf, const void* grad, int64_t len, float s) {
  acc_impl<B, G, ACC>(buf, grad, len, s);
}
#if ACCO_HAVE_ISA_VARIANTS
template <typename B, typename G, bool ACC>
ACCO_TARGET_AVX2 void acc_avx2(void* buf, const void* grad, int64_t len, float s) {
  acc_impl<B, G, ACC>(buf, grad, len, s);
}
template <typename B, typename G, bool ACC>
ACCO_TARGET_AVX512 void acc_avx512(void* buf, const void* grad, int64_t len, float s) {
  acc_impl<B, G, ACC>(buf, grad, len, s);
}
#endif

template <typename B, typename G, bool ACC>
AccRange pick_acc3() {
#if ACCO_HAVE_ISA_VARIANTS
  if (kIsa == Isa::kAvx512) return &acc_avx512<B, G, ACC>;
  if (kIsa == Isa::kAvx2) return &acc_avx2<B, G, ACC>;
#endif
  return &acc_base<B, G, ACC>;
}

template <bool ACC>
AccRange pick_acc(int buf_dtype, int grad_dtype) {
  return with_elem(buf_dtype, [&](auto b) {
    return with_elem(grad_dtype, [&](auto g) {
      return pick_acc3<typename decltype(b)::type, typename decltype(g)::type, ACC>();
    });
  });
}

}  // namespace

void accumulate_cpu(uintptr_t buf, int buf_dtype, const int64_t* grad_ptrs, const int* grad_dtypes,
                    const int64_t* offsets, const int64_t* numels, int64_t count, float scale, bool accumulate,
                    int num_threads) {
  struct Item {
    int64_t tensor, start, len;
  };
  std::vector<Item> items;
  int64_t total = 0;
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t s = 0; s < numels[t]; s += kChunk) items.push_back({t, s, std::min(kChunk, numels[t] - s)});
    total += numels[t];
  }
  const int64_t nitems = static_cast<int64_t>(items.size());
  auto run = [&](int64_t k) {
    const Item& it = items[k];
    const AccRange fn = accumulate ? pick_acc<true>(buf_dtype, grad_dtypes[it.tensor])
                                   : pick_acc<false>(buf_dtype, grad_dtypes[it.tensor]);
    char* dst = reinterpret_cast<char*>(buf) + (offsets[it.tensor] + it.start) * elem_size(buf_dtype);
    const char* src = reinterpret_cast<const char*>(grad_ptrs[it.tensor]) + it.start * elem_size(grad_dtypes[it.tensor]);
    fn(dst, src, it.len, scale);
  };
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, total / kGrain)));
  if (nt <= 1) {
    for (int64_t k = 0; k < nitems; ++k) run(k);
    return;
  }
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t k = 0; k < nitems; ++k) run(k);
}

}  // namespace acco
