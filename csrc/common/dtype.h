// Dtype codes of the raw-address entry points: 0 = fp32, 1 = bf16 (the Python fronts' _DTYPE_CODE); -1 = no
// tensor where an output is optional.
#pragma once

#include <stdint.h>

namespace acco {

enum DtypeCode : int { kF32 = 0, kBF16 = 1 };

inline int64_t elem_size(int dtype) { return dtype == kBF16 ? 2 : 4; }

}  // namespace acco
