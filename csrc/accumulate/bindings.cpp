// pybind11 bindings of the CPU accumulate / copy launcher (no libtorch): module acco_ds._accumulate_cpu.
//
// Raw addresses (tensor.data_ptr()) and sizes in; the Python front (acco_ds/ops/accumulate.py) has already
// checked dtype, device, contiguity, sizes and bounds. Every entry point releases the GIL. Dtype codes:
// csrc/common/dtype.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <vector>

#include "accumulate/accumulate_cpu.h"
#include "common/bindings.h"
#include "common/cpu.h"

namespace py = pybind11;

PYBIND11_MODULE(_accumulate_cpu, mod) {
  mod.doc() = "acco_ds CPU gradient accumulation / cast-copy (OpenMP; no libtorch). Call it through "
              "acco_ds.ops.accumulate.";
  mod.def(
      "accumulate_cpu",
      [](uintptr_t buf, int buf_dtype, const std::vector<int64_t>& ptrs, const std::vector<int>& dtypes,
         const std::vector<int64_t>& offsets, const std::vector<int64_t>& numels, float scale, int num_threads) {
        acco::check_dtype("buffer dtype", buf_dtype, false);
        if (dtypes.size() != ptrs.size() || offsets.size() != ptrs.size() || numels.size() != ptrs.size())
          throw std::invalid_argument("accumulate_cpu: ptrs, dtypes, offsets, numels must have one length");
        for (int d : dtypes) acco::check_dtype("grad dtype", d, false);
        acco::accumulate_cpu(buf, buf_dtype, ptrs.data(), dtypes.data(), offsets.data(), numels.data(),
                             static_cast<int64_t>(ptrs.size()), scale, true, num_threads);
      },
      "buffer[off_i:off_i+numel_i] = cast(float(buffer) + float(grad_i) * scale) for every i.",
      py::call_guard<py::gil_scoped_release>());
  mod.def(
      "copy_cpu",
      [](uintptr_t dst, int dst_dtype, uintptr_t src, int src_dtype, int64_t n, float scale, int num_threads) {
        acco::check_dtype("dst dtype", dst_dtype, false);
        acco::check_dtype("src dtype", src_dtype, false);
        const int64_t ptr = static_cast<int64_t>(src), off = 0;
        acco::accumulate_cpu(dst, dst_dtype, &ptr, &src_dtype, &off, &n, 1, scale, false, num_threads);
      },
      "dst = cast(float(src) * scale), n elements.", py::call_guard<py::gil_scoped_release>());
  mod.attr("ABI_VERSION") = acco::kAbiVersion;
  mod.attr("ISA") = acco::isa_name();
}
