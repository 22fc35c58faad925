// The CPU accumulate / copy launcher (accumulate_cpu.cpp). Plain C++: no libtorch.
//
// Dtype codes: csrc/common/dtype.h. Pointers are raw addresses of contiguous buffers the caller keeps alive
// until the call returns (it returns when done).
#pragma once

#include <stdint.h>

namespace acco {

// buffer[off_i : off_i + numel_i] = cast(float(buffer) + float(grad_i) * scale) for every i (accumulate),
// or buffer = cast(float(grad) * scale) (copy, one tensor at offset 0).
void accumulate_cpu(uintptr_t buf, int buf_dtype, const int64_t* grad_ptrs, const int* grad_dtypes,
                    const int64_t* offsets, const int64_t* numels, int64_t count, float scale, bool accumulate,
                    int num_threads);

}  // namespace acco
