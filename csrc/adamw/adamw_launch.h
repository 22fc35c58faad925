// AdamW launcher declarations shared by the bindings and the launchers. Plain C++: no libtorch, no CUDA headers.
//
// Dtype codes: csrc/common/dtype.h (0 = fp32, 1 = bf16, 2 = fp16, -1 = no out). All pointers are raw addresses of
// contiguous buffers that the caller keeps alive until the work is done (the CPU calls return when done;
// the CUDA call is asynchronous on `stream`).
#pragma once

#include <stdint.h>

#include <string>
#include <vector>

#include "adamw/adamw_kernel_body.h"
#include "common/dtype.h"

namespace acco {

// Fills AdamWKernelArgs from the raw arguments (alignment flags from the pointers).
inline AdamWKernelArgs make_adamw_args(uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t g, int g_dtype,
                                       uintptr_t out, int out_dtype, uintptr_t scale_ptr, uintptr_t noop_ptr,
                                       uintptr_t hyper_ptr, int64_t n, float grad_scale, const AdamWHyper& h) {
  AdamWKernelArgs a;
  a.p = reinterpret_cast<float*>(p);
  a.m = reinterpret_cast<float*>(m);
  a.v = reinterpret_cast<float*>(v);
  a.g = reinterpret_cast<const void*>(g);
  a.out = reinterpret_cast<void*>(out);
  a.scale_ptr = reinterpret_cast<const float*>(scale_ptr);
  a.noop_ptr = reinterpret_cast<const int32_t*>(noop_ptr);
  a.hyper_ptr = reinterpret_cast<const float*>(hyper_ptr);
  a.n = n;
  a.grad_scale = grad_scale;
  a.h = h;
  a.p_vec = vec_aligned<float>(a.p);
  a.m_vec = vec_aligned<float>(a.m);
  a.v_vec = vec_aligned<float>(a.v);
  a.g_vec = with_elem(g_dtype, [&](auto t) { return vec_aligned<typename decltype(t)::type>(a.g); });
  a.out_vec = with_elem(out_dtype, [&](auto t) { return vec_aligned<typename decltype(t)::type>(a.out); });
  return a;
}

// CPU: OpenMP over `num_threads` threads; reads scale/noop/hyper from host memory. Returns when done.
void adamw_cpu(const AdamWKernelArgs& a, int g_dtype, int out_dtype, bool commit, int num_threads);

// CPU: the step (as adamw_cpu, `out` required) fused with the quantized difference of its new parameters to `base`
// (out's dtype and length; may be out itself, no other overlap): q (int8, n) and scales (fp32, one per block of
// block_size) of cast(new) - base, and out = base + q * scale (adamw_difference_cpu.cpp states the contract).
void adamw_difference_cpu(const AdamWKernelArgs& a, int g_dtype, int out_dtype, bool commit, uintptr_t base,
                          uintptr_t q, uintptr_t scales, int64_t block_size, int num_threads);

// CPU: the step (as adamw_cpu, `out` required) whose gradient is the sum of W quantized rows (q_rows[r]: int8, n;
// scale_rows[r]: fp32, one per block of block_size; summed in the vectors' order as dequantize_sum_cpu stores it in
// g_dtype) plus `tilde` (g_dtype, n) when tilde != 0; with base != 0 also adamw_difference_cpu's difference (dq,
// dscales). adamw_quantized_sum_cpu.cpp states the contract.
void adamw_quantized_sum_cpu(const AdamWKernelArgs& a, int g_dtype, int out_dtype, bool commit,
                             const std::vector<uintptr_t>& q_rows, const std::vector<uintptr_t>& scale_rows,
                             uintptr_t tilde, int64_t block_size, uintptr_t base, uintptr_t dq, uintptr_t dscales,
                             int num_threads);

// CPU harness: runs the CUDA kernel body for every (block, thread) of a grid_dim x kBlock grid.
// grid_dim <= 0 uses the launcher's grid (adamw_grid). Throws std::runtime_error on a misaligned vector
// access or an out-of-bounds access.
void adamw_cuda_body_on_cpu(const AdamWKernelArgs& a, int g_dtype, int out_dtype, bool commit, int64_t grid_dim,
                            int64_t block_dim);

// CUDA: enqueues the kernel on `stream` (a cudaStream_t) of the current device; returns the cudaError_t of
// the launch (0 = success), checked with cudaGetLastError.
int adamw_cuda(const AdamWKernelArgs& a, int g_dtype, int out_dtype, bool commit, void* stream);
std::string cuda_error_string(int code);

// CUDA: the CUDA version the driver supports and the version of the runtime linked into this module (both as
// 1000 * major + 10 * minor; driver 0 when no driver is present). Returns the cudaError_t of the queries. Loading
// code compares the two before any launch: a static runtime newer than the driver fails every call.
int cuda_versions(int* driver, int* runtime);

}  // namespace acco
