// The CPU blockwise int8 quantize / dequantize launchers (quantize_cpu.cpp) and the fused round end's
// (fold_quantize_cpu.cpp). Plain C++: no libtorch.
//
// Blocks of `block_size` consecutive elements (the last one short when block_size does not divide n), one fp32
// scale per block; acco_ds/ops/quantize.py states the rule and its torch reference, which these reproduce bit
// for bit. Dtype codes: csrc/common/dtype.h. Pointers are raw addresses of contiguous, non-overlapping buffers
// the caller owns and keeps alive until the call returns (it returns when done). Threads: OpenMP over groups of
// whole blocks, at most `num_threads`, fewer for small inputs.
#pragma once

#include <stdint.h>

#include <vector>

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

// The owner's sum of W ranks' quantized chunks of n values: out[i] = sum over r of q_r[i] * scales_r[b] in fp32,
// rows in the given order (the first row's product, then each next one added: the products and the sums each
// rounded to fp32), stored in out's dtype (fp32, bf16 or fp16, csrc/common/bf16.h's rounding). q_rows[r] / scale_rows[r]
// are the addresses of row r's q (int8, n) and scales (fp32, one per block); at least one row.
void dequantize_sum_cpu(const std::vector<uintptr_t>& q_rows, const std::vector<uintptr_t>& scale_rows, int64_t n,
                        int64_t block_size, uintptr_t out, int out_dtype, int num_threads);

// The same sum, stored in `dtype` (fp32, bf16 or fp16), plus tilde (`dtype`, n) when tilde != 0, never stored in full: the
// fp64 sum of the squares of its n values (each square exact, the sums in an order fixed by n and block_size);
// tilde_out (`dtype`, n; when != 0) receives the values.
double quantized_sum_squares_cpu(const std::vector<uintptr_t>& q_rows, const std::vector<uintptr_t>& scale_rows,
                                 int64_t n, int64_t block_size, int dtype, uintptr_t tilde, uintptr_t tilde_out,
                                 int num_threads);

// A parameter difference: q, scales of v = x - base (both of `dtype`, n; base only read), v in fp32.
void quantize_difference_cpu(uintptr_t x, uintptr_t base, int dtype, int64_t n, int64_t block_size, uintptr_t q,
                             uintptr_t scales, int num_threads);

// Its application: out[i] = base[i] + q[i] * scales[b] (fp32: the product rounded, then the sum), stored in `dtype`
// (base's and out's; out may be base itself, no other overlap).
void add_dequantized_cpu(uintptr_t q, uintptr_t scales, uintptr_t base, uintptr_t out, int dtype, int64_t n,
                         int64_t block_size, int num_threads);

// The fused round end (fold_quantize_cpu.cpp; acco_ds/ops/fold_quantize.py states the rule, its torch reference
// fold_quantize_ref the bits). `buffer` (buffer_dtype) is `world` chunks of `chunk` elements, each cut into
// nb = ceil(chunk / block_size) blocks (the last one short); block j of chunk c is global block c * nb + j, whose
// scale is scales[c * nb + j] (fp32, world * nb) and whose q lie at the buffer's own positions in q (int8, world *
// chunk). `grad` (grad_dtype, numel elements) lands at [offset, offset + numel), which the caller keeps inside the
// buffer. For every block wholly inside that range: v_i = float(cast_buffer(float(buffer_i) + float(grad_i))),
// plus float(residual_i) when residual_dtype != -1 (residual: the buffer's length), quantized with qmax (127: 8
// bits, 7: 4 bits) as quantize_cpu quantizes v (q, scale, residual <- v - q * scale; NaN scale, q 0 and residual 0
// in a non-finite block); the buffer is not written there. Every other element of the range (the blocks it covers
// in part) gets buffer_i = cast_buffer(float(buffer_i) + float(grad_i)) only. No buffer overlaps another.
void fold_quantize_cpu(uintptr_t buffer, int buffer_dtype, uintptr_t grad, int grad_dtype, int64_t offset,
                       int64_t numel, int64_t chunk, int64_t world, uintptr_t residual, int residual_dtype,
                       uintptr_t q, uintptr_t scales, int64_t block_size, int qmax, int num_threads);

// The listed blocks of such a buffer quantized as quantize_cpu would quantize each (v = buffer (+ residual), the
// residual rewritten; qmax 127 or 7) into their places in q and scales: `blocks` is the address of num_listed
// int64 global block indices, sorted, distinct, in [0, world * nb) (std::invalid_argument naming the first bad
// entry otherwise, before anything is written).
void quantize_listed_blocks_cpu(uintptr_t buffer, int buffer_dtype, int64_t chunk, int64_t world, uintptr_t residual,
                                int residual_dtype, uintptr_t q, uintptr_t scales, int64_t block_size, int qmax,
                                uintptr_t blocks, int64_t num_listed, int num_threads);

}  // namespace acco
