// pybind11 bindings of the AdamW launchers (no libtorch): raw addresses (tensor.data_ptr()), sizes, the
// AdamW scalars and a stream handle in; the Python front (acco_ds/ops/adamw.py) has already checked dtype,
// device, contiguity, sizes and alignment. Compiled twice:
//   -DACCO_BIND_CPU  -> module acco_ds._adamw_cpu  (adamw_cpu, adamw_cuda_body_on_cpu: the CUDA body's harness)
//   -DACCO_BIND_CUDA -> module acco_ds._adamw_cuda (adamw_cuda, cuda_versions)
// Every entry point releases the GIL. Dtype codes: csrc/common/dtype.h; out_dtype -1 = no out.
//
// Both modules expose HYPER_FIELDS (the AdamWHyper field names, in order) and HYPER_OFFSETS (their byte
// offsets), so a test can check them against acco_ds/ops/adamw_settings.py's KERNEL_FIELDS.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "adamw/adamw_launch.h"
#include "common/bindings.h"
#if defined(ACCO_BIND_CPU)
#include "common/cpu.h"
#endif

namespace py = pybind11;

namespace {

using HyperScalars = std::array<float, acco::kHyperFields>;

// The arguments every AdamW entry point takes first, in this order: master, exp_avg, exp_avg_sq, grad,
// grad dtype, out (0 = none), out dtype (-1 = none), scale_ptr, noop_ptr, hyper_ptr (0 = use `hyper`), n,
// hyper (the kHyperFields scalars by value, in AdamWHyper's order), grad_scale, commit.
#define ACCO_ADAMW_ARGS                                                                                     \
  uintptr_t p, uintptr_t m, uintptr_t v, uintptr_t g, int g_dtype, uintptr_t out, int out_dtype,           \
      uintptr_t scale_ptr, uintptr_t noop_ptr, uintptr_t hyper_ptr, int64_t n, const HyperScalars &hyper, \
      float grad_scale, bool commit

#define ACCO_MAKE_ARGS()                                                                            \
  acco::check_dtype("grad dtype", g_dtype, false);                                                  \
  acco::check_dtype("out dtype", out_dtype, true);                                                  \
  if (!commit && out == 0) throw std::invalid_argument("peek (commit=False) needs an out buffer");  \
  const acco::AdamWKernelArgs a = acco::make_adamw_args(p, m, v, g, g_dtype, out, out_dtype, scale_ptr, \
                                                        noop_ptr, hyper_ptr, n, grad_scale,             \
                                                        acco::load_hyper(hyper.data()))

const char* kAdamWDoc =
    "AdamW step on raw addresses: (master, exp_avg, exp_avg_sq, grad, grad_dtype, out, out_dtype, "
    "scale_ptr, noop_ptr, hyper_ptr, n, hyper, grad_scale, commit, ...). hyper: the AdamW scalars in "
    "HYPER_FIELDS order; hyper_ptr: 0, or the address of those scalars as fp32 (then `hyper` is ignored). "
    "Use acco_ds.ops.adamw.adamw_step instead.";

void add_hyper_layout(py::module_& mod) {
  std::vector<std::string> names;
  std::vector<size_t> offsets;
#define ACCO_HYPER_LAYOUT(name)  \
  names.push_back(#name);        \
  offsets.push_back(offsetof(acco::AdamWHyper, name));
  ACCO_ADAMW_HYPER_FIELDS(ACCO_HYPER_LAYOUT)
#undef ACCO_HYPER_LAYOUT
  mod.attr("HYPER_FIELDS") = py::tuple(py::cast(names));
  mod.attr("HYPER_OFFSETS") = py::tuple(py::cast(offsets));
}

}  // namespace

#if defined(ACCO_BIND_CPU)
PYBIND11_MODULE(_adamw_cpu, mod) {
  mod.doc() = "acco_ds CPU AdamW (OpenMP; no libtorch) and the CPU harness of the CUDA kernel body. Call them "
              "through acco_ds.ops.adamw.";
  mod.def(
      "adamw_cpu",
      [](ACCO_ADAMW_ARGS, int num_threads) {
        ACCO_MAKE_ARGS();
        acco::adamw_cpu(a, g_dtype, out_dtype, commit, num_threads);
      },
      kAdamWDoc, py::call_guard<py::gil_scoped_release>());
  mod.def(
      "adamw_difference_cpu",
      [](ACCO_ADAMW_ARGS, uintptr_t base, uintptr_t q, uintptr_t scales, int64_t block_size, int num_threads) {
        ACCO_MAKE_ARGS();
        if (out == 0 || out_dtype < 0) throw std::invalid_argument("adamw_difference_cpu needs an out buffer");
        if (block_size < 1) throw std::invalid_argument("adamw_difference_cpu: block_size must be >= 1");
        acco::adamw_difference_cpu(a, g_dtype, out_dtype, commit, base, q, scales, block_size, num_threads);
      },
      "The AdamW step fused with the int8 quantized difference of its new parameters to `base`: the "
      "AdamW arguments, then base, q, scales, block_size, num_threads. Use acco_ds.ops.adamw_difference.",
      py::call_guard<py::gil_scoped_release>());
  mod.def(
      "adamw_quantized_sum_cpu",
      [](ACCO_ADAMW_ARGS, const std::vector<uintptr_t>& q_rows, const std::vector<uintptr_t>& scale_rows,
         uintptr_t tilde, int64_t block_size, uintptr_t base, uintptr_t dq, uintptr_t dscales, int num_threads) {
        ACCO_MAKE_ARGS();
        if (out == 0 || out_dtype < 0) throw std::invalid_argument("adamw_quantized_sum_cpu needs an out buffer");
        if (block_size < 1) throw std::invalid_argument("adamw_quantized_sum_cpu: block_size must be >= 1");
        if (q_rows.empty() || q_rows.size() != scale_rows.size())
          throw std::invalid_argument("adamw_quantized_sum_cpu: need as many scale rows as q rows, at least one");
        if (base != 0 && (dq == 0 || dscales == 0))
          throw std::invalid_argument("adamw_quantized_sum_cpu: a base needs the difference's q and scales");
        acco::adamw_quantized_sum_cpu(a, g_dtype, out_dtype, commit, q_rows, scale_rows, tilde, block_size, base, dq,
                                      dscales, num_threads);
      },
      "The AdamW step on the sum of W quantized rows (+ tilde), never stored: the AdamW arguments (grad 0, grad "
      "dtype = the sum's), then q_rows, scale_rows, tilde, block_size, base, dq, dscales, num_threads. Use "
      "acco_ds.ops.quantized_sum_step.",
      py::call_guard<py::gil_scoped_release>());
  mod.def(
      "adamw_cuda_body_on_cpu",
      [](ACCO_ADAMW_ARGS, int64_t grid_dim, int64_t block_dim) {
        ACCO_MAKE_ARGS();
        acco::adamw_cuda_body_on_cpu(a, g_dtype, out_dtype, commit, grid_dim, block_dim);
      },
      "Test harness: run the CUDA kernel body over its grid on CPU (host pointers). grid_dim <= 0: the "
      "launcher's grid. Raises RuntimeError on a misaligned vector access or an out-of-bounds access.",
      py::call_guard<py::gil_scoped_release>());
  mod.attr("ABI_VERSION") = acco::kAbiVersion;
  mod.attr("ISA") = acco::isa_name();
  mod.attr("VEC") = acco::kVec;
  mod.attr("BLOCK") = acco::kBlock;
  add_hyper_layout(mod);
}
#elif defined(ACCO_BIND_CUDA)
PYBIND11_MODULE(_adamw_cuda, mod) {
  mod.doc() = "acco_ds CUDA AdamW (cudart static; no libtorch). Call it through acco_ds.ops.adamw.";
  mod.attr("ABI_VERSION") = acco::kAbiVersion;
  add_hyper_layout(mod);
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
