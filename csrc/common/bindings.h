// What every pybind11 module of acco_ds shares: the ABI version and the dtype-code check.
//
// The entry points take raw addresses (tensor.data_ptr()), sizes and a stream handle; the Python fronts
// (acco_ds/ops/*.py) have already checked dtype, device, contiguity, sizes and alignment. No libtorch.
#pragma once

#include <stdexcept>
#include <string>

#include "common/dtype.h"

namespace acco {

// Bumped whenever an entry point's arguments change; acco_ds/ops/_build.py refuses a module with another
// value (a stale build) instead of failing at the first call.
constexpr int kAbiVersion = 8;

inline void check_dtype(const char* what, int code, bool allow_none) {
  if (code == kF32 || code == kBF16 || code == kF16 || (allow_none && code == -1)) return;
  throw std::invalid_argument(std::string(what) + ": unknown dtype code " + std::to_string(code) +
                              " (0 = fp32, 1 = bf16, 2 = fp16" + (allow_none ? ", -1 = none)" : ")"));
}

}  // namespace acco
