// CUDA launcher of the fused AdamW: the __global__ wrapper around adamw_kernel_body (adamw_kernel_body.h),
// enqueued on the caller's stream. No libtorch; cudart is linked statically into the module.
//
// Stream contract: the kernel runs on `stream` of the current device (the Python front passes
// torch.cuda.current_stream(master.device) and makes master's device current); the caller keeps every buffer
// alive and unmodified by other streams until that stream has run it. The noop flag, the scale and (when
// hyper_ptr is set) the AdamW scalars are read on the device, so deciding to skip a step, to clip, or which
// step count and learning rate apply never synchronises the host.
#include <cuda_runtime.h>

#include "adamw/adamw_launch.h"

namespace acco {
namespace {

template <typename G, typename O, bool COMMIT>
__global__ void __launch_bounds__(kBlock) adamw_kernel(const AdamWKernelArgs a) {
  adamw_kernel_body<G, O, COMMIT>(blockIdx.x, threadIdx.x, blockDim.x, gridDim.x, a);
}

template <typename G, typename O>
void launch_commit(const AdamWKernelArgs& a, bool commit, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(adamw_grid(a.n))), block(kBlock);
  if (commit)
    adamw_kernel<G, O, true><<<grid, block, 0, stream>>>(a);
  else
    adamw_kernel<G, O, false><<<grid, block, 0, stream>>>(a);
}

template <typename G>
void launch_out(const AdamWKernelArgs& a, int out_dtype, bool commit, cudaStream_t stream) {
  with_elem(out_dtype, [&](auto o) { launch_commit<G, typename decltype(o)::type>(a, commit, stream); });
}

}  // namespace

int adamw_cuda(const AdamWKernelArgs& a, int g_dtype, int out_dtype, bool commit, void* stream) {
  cudaGetLastError();  // clear a stale error so the one returned belongs to this launch
  if (a.n <= 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  with_elem(g_dtype, [&](auto g) { launch_out<typename decltype(g)::type>(a, out_dtype, commit, s); });
  return static_cast<int>(cudaGetLastError());
}

int cuda_versions(int* driver, int* runtime) {
  *driver = 0;
  *runtime = 0;
  // cudaRuntimeGetVersion reports the statically linked runtime (the nvcc that built this module);
  // cudaDriverGetVersion the CUDA version the installed driver supports (0 when no driver is loaded).
  const cudaError_t r = cudaRuntimeGetVersion(runtime);
  if (r != cudaSuccess) return static_cast<int>(r);
  return static_cast<int>(cudaDriverGetVersion(driver));
}

std::string cuda_error_string(int code) {
  return std::string(cudaGetErrorName(static_cast<cudaError_t>(code))) + ": " +
         cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace acco
