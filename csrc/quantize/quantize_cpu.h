// The CPU blockwise int8 quantize / dequantize launchers (quantize_cpu.cpp). Plain C++: no libtorch.
//
// Blocks of `block_size` consecutive elements (the last one short when block_size does not divide n), one fp32
// scale per block; acco_ds/ops/quantize.py states the rule and its torch reference, which these reproduce bit
// for bit. Dtype codes: csrc/common/dtype.h. Pointers are raw addresses of contiguous, non-overlapping buffers
// the caller owns and keeps alive until the call returns (it returns when done). Threads: OpenMP over groups of
// whole blocks, at most `num_threads`, fewer for small inputs.
#pragma once

#include <stdint.h>

namespace acco {

// q[i] (int8, n) and scales[b] (fp32, ceil(n / block_size)) of v = x (+ residual when residual_dtype != -1),
// v in fp32. With a residual, residual[i] <- v[i] - q[i] * scales[b], rounded to residual's dtype (0 in a block
// whose v holds an inf or a NaN: its scale is NaN and its q are 0).
void quantize_cpu(uintptr_t x, int x_dtype, uintptr_t residual, int residual_dtype, int64_t n, int64_t block_size,
                  uintptr_t q, uintptr_t scales, int num_threads);

// out[i] = q[i] * scales[b] (fp32), or out[i] += q[i] * scales[b] when accumulate (the product rounded, then
// the sum).
void dequantize_cpu(uintptr_t q, uintptr_t scales, int64_t n, int64_t block_size, uintptr_t out, bool accumulate,
                    int num_threads);

}  // namespace acco
