// pybind11 bindings (no libtorch): raw addresses (tensor.data_ptr()), sizes and a stream handle in; the
// Python front (acco_ds/ops/adamw.py, accumulate.py) has already checked dtype, device, contiguity, sizes
// and alignment. Compiled twice:
//   -DACCO_BIND_CPU  -> module acco_ds._adamw_cpu  (adamw_cpu, accumulate_cpu, copy_cpu, harness)
//   -DACCO_BIND_CUDA -> module acco_ds._adamw_cuda (adamw_cuda)
// Every entry point releases the GIL. Dtype codes: 0 = fp32, 1 = bf16; out_dtype -1 = no out.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "adamw_launch.h"

namespace py = pybind11;

// Bumped whenever an entry point's arguments change; acco_ds/ops/_build.py refuses a module with another
// value (a stale build) instead of failing at the first call.
constexpr int kAbiVersion = 2;

namespace {

acco::AdamWHyper hyper(float decay, float beta1, float omb1, float beta2, float omb2, float bc2_sqrt, float eps,
                       float step_size) {
  return acco::AdamWHyper{decay, beta1, omb1, beta2, omb2, bc2_sqrt, eps, step_size};
}

void check_dtype(const char* what, int code, bool allow_none) {
  if (code == acco::kF32 || code == acco::kBF16 || (allow_none && code == -1)) return;
  throw std::invalid_argument(std::string(what) + ": unknown dtype code " + std::to_string(code) +
                              " (0 = fp32, 1 = bf16" + (allow_none ? ", -1 = none)" : ")"));
}

#define ACCO_ADAMW_ARGS                                                                                    \
  uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t g, int g_dtype, uintptr_t out, int out_dtype,          \
      uintptr_t scale_ptr, uintptr_t noop_ptr, uintptr_t hyper_ptr, int64_t n, float decay, float beta1,  \
      float omb1, float beta2, float omb2, float bc2_sqrt, float eps, float step_size, float grad_scale,    \
      bool commit

#define ACCO_MAKE_ARGS()                                                                            \
  check_dtype("grad dtype", g_dtype, false);                                                        \
  check_dtype("out dtype", out_dtype, true);                                                        \
  if (!commit && out == 0) throw std::invalid_argument("peek (commit=False) needs an out buffer");  \
  const acco::AdamWKernelArgs a = acco::make_adamw_args(                                            \
      p, m, v, g, g_dtype, out, out_dtype, scale_ptr, noop_ptr, hyper_ptr, n, grad_scale,          \
      hyper(decay, beta1, omb1, beta2, omb2, bc2_sqrt, eps, step_size))

const char* kAdamWDoc =
    "AdamW step on raw addresses: (master, exp_avg, exp_avg_sq, grad, grad_dtype, out, out_dtype, "
    "scale_ptr, noop_ptr, hyper_ptr, n, decay, beta1, 1-beta1, beta2, 1-beta2, sqrt(1-beta2**step), eps, "
    "lr/(1-beta1**step), grad_scale, commit, ...). hyper_ptr: 0, or the address of those 8 scalars as fp32 "
    "(then the 8 by-value scalars are ignored). Use acco_ds.ops.adamw.adamw_step instead.";

}  // namespace

#if defined(ACCO_BIND_CPU)
PYBIND11_MODULE(_adamw_cpu, mod) {
  mod.doc() = "acco_ds CPU kernels (OpenMP; no libtorch). Call them through acco_ds.ops.";
  mod.def(
      "adamw_cpu",
      [](ACCO_ADAMW_ARGS, int num_threads) {
        ACCO_MAKE_ARGS();
        acco::adamw_cpu(a, g_dtype, out_dtype, commit, num_threads);
      },
      kAdamWDoc, py::call_guard<py::gil_scoped_release>());
  mod.def(
      "adamw_cuda_body_on_cpu",
      [](ACCO_ADAMW_ARGS, int64_t grid_dim, int64_t block_dim) {
        ACCO_MAKE_ARGS();
        acco::adamw_cuda_body_on_cpu(a, g_dtype, out_dtype, commit, grid_dim, block_dim);
      },
      "Test harness: run the CUDA kernel body over its grid on CPU (host pointers). grid_dim <= 0: the "
      "launcher's grid. Raises RuntimeError on a misaligned vector access or an out-of-bounds access.",
      py::call_guard<py::gil_scoped_release>());
  mod.def(
      "accumulate_cpu",
      [](uintptr_t buf, int buf_dtype, const std::vector<int64_t>& ptrs, const std::vector<int>& dtypes,
         const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels, float scale, int num_threads) {
        check_dtype("buffer dtype", buf_dtype, false);
        if (dtypes.size() != ptrs.size() || offsets.size() != ptrs.size() || numels.size() != ptrs.size())
          throw std::invalid_argument("accumulate_cpu: ptrs, dtypes, offsets, numels must have one length");
        for (int d : dtypes) check_dtype("grad dtype", d, false);
        acco::accumulate_cpu(buf, buf_dtype, ptrs.data(), dtypes.data(), offsets.data(), numels.data(),
                             static_cast<int64_t>(ptrs.size()), scale, true, num_threads);
      },
      "buffer[off_i:off_i+numel_i] = cast(float(buffer) + float(grad_i) * scale) for every i.",
      py::call_guard<py::gil_scoped_release>());
  mod.def(
      "copy_cpu",
      [](uintptr_t dst, int dst_dtype, uintptr_t src, int src_dtype, int64_t n, float scale, int num_threads) {
        check_dtype("dst dtype", dst_dtype, false);
        check_dtype("src dtype", src_dtype, false);
        const int64_t ptr = static_cast<int64_t>(src), off = 0;
        acco::accumulate_cpu(dst, dst_dtype, &ptr, &src_dtype, &off, &n, 1, scale, false, num_threads);
      },
      "dst = cast(float(src) * scale), n elements.", py::call_guard<py::gil_scoped_release>());
  mod.attr("ABI_VERSION") = kAbiVersion;
  mod.attr("ISA") = acco::cpu_isa();
  mod.attr("VEC") = acco::kVec;
  mod.attr("BLOCK") = acco::kBlock;
}
#elif defined(ACCO_BIND_CUDA)
PYBIND11_MODULE(_adamw_cuda, mod) {
  mod.doc() = "acco_ds CUDA kernels (cudart static; no libtorch). Call them through acco_ds.ops.";
  mod.attr("ABI_VERSION") = kAbiVersion;
  mod.def(
      "adamw_cuda",
      [](ACCO_ADAMW_ARGS, uintptr_t stream) {
        ACCO_MAKE_ARGS();
        const int err = acco::adamw_cuda(a, g_dtype, out_dtype, commit, reinterpret_cast<void*>(stream));
        if (err != 0) throw std::runtime_error("acco_ds adamw_cuda launch failed: " + acco::cuda_error_string(err));
      },
      kAdamWDoc, py::call_guard<py::gil_scoped_release>());
  mod.def(
      "cuda_versions",
      []() {
        int driver = 0, runtime = 0;
        const int err = acco::cuda_versions(&driver, &runtime);
        return py::make_tuple(driver, runtime, err, err == 0 ? std::string() : acco::cuda_error_string(err));
      },
      "(driver CUDA version, linked runtime CUDA version, cudaError_t, error text): 1000*major + 10*minor; "
      "driver 0 when no driver is present. acco_ds.ops._build refuses the module when driver < runtime's major.");
}
#else
#error "define ACCO_BIND_CPU or ACCO_BIND_CUDA"
#endif
