// Dtype codes of the raw-address entry points: 0 = fp32, 1 = bf16, 2 = fp16 (the Python fronts' _DTYPE_CODE);
// -1 = no tensor where an output is optional. Element types: float (fp32), uint16_t (bf16), fp16_t (fp16).
#pragma once

#include <stdint.h>

#include "common/bf16.h"

namespace acco {

enum DtypeCode : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline int64_t elem_size(int dtype) { return dtype == kBF16 || dtype == kF16 ? 2 : 4; }

template <typename T>
struct TypeTag {
  using type = T;
};

// f(TypeTag<T>{}) with T the element type of the dtype code (fp32 for any code but bf16 and fp16: the bindings
// have checked it). The launchers pick their template instance with it:
//   with_elem(code, [&](auto t) { using T = typename decltype(t)::type; return &kernel<T>; })
template <typename F>
auto with_elem(int dtype, F&& f) {
  if (dtype == kBF16) return f(TypeTag<uint16_t>{});
  if (dtype == kF16) return f(TypeTag<fp16_t>{});
  return f(TypeTag<float>{});
}

}  // namespace acco
