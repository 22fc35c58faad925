// pybind11 bindings of the CPU blockwise int8 quantize / dequantize launchers (no libtorch): module
// acco_ds._quantize_cpu.
//
// Raw addresses (tensor.data_ptr()) and sizes in; the Python fronts (acco_ds/ops/quantize.py,
// acco_ds/ops/fold_quantize.py) have already checked dtypes, device, contiguity, sizes, alignment and that the
// buffers do not overlap, and allocated the outputs; the entry points check what they need to stay in bounds
// (sizes, dtype codes, the fused round end's geometry) and raise ValueError otherwise. Every entry point releases
// the GIL. Dtype codes: csrc/common/dtype.h (-1: no residual).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "common/bindings.h"
#include "common/cpu.h"
#include "quantize/quantize_cpu.h"

namespace py = pybind11;

namespace {

void check_sizes(const char* fn, int64_t n, int64_t block_size) {
  if (n < 0 || block_size < 1)
    throw std::invalid_argument(std::string(fn) + ": need n >= 0 and block_size >= 1, got n = " +
                                std::to_string(n) + ", block_size = " + std::to_string(block_size));
}

// The fused round end's geometry: a flat buffer of world chunks of `chunk` elements, blocks of block_size, qmax
// 127 (8 bits) or 7 (4 bits), and a residual address given exactly when its dtype code is not -1.
void check_rows(const char* fn, int64_t chunk, int64_t world, int64_t block_size, int qmax, uintptr_t residual,
                int residual_dtype) {
  const std::string f(fn);
  if (chunk < 1 || world < 1)
    throw std::invalid_argument(f + ": need chunk >= 1 and world >= 1, got chunk = " + std::to_string(chunk) +
                                ", world = " + std::to_string(world));
  check_sizes(fn, chunk, block_size);
  if (qmax != 127 && qmax != 7)
    throw std::invalid_argument(f + ": qmax must be 127 (8 bits) or 7 (4 bits), got " + std::to_string(qmax));
  if ((residual == 0) != (residual_dtype == -1))
    throw std::invalid_argument(f + ": residual's address and dtype code disagree (address " +
                                std::to_string(residual) + ", dtype code " + std::to_string(residual_dtype) +
                                "): give both, or 0 and -1 for no residual");
}

}  // namespace

PYBIND11_MODULE(_quantize_cpu, mod) {
  mod.doc() = "acco_ds CPU blockwise int8 quantization (OpenMP; no libtorch). Call it through "
              "acco_ds.ops.quantize.";
  mod.def(
      "quantize_cpu",
      [](uintptr_t x, int x_dtype, uintptr_t residual, int residual_dtype, int64_t n, int64_t block_size,
         uintptr_t q, uintptr_t scales, int num_threads) {
        acco::check_dtype("x dtype", x_dtype, false);
        acco::check_dtype("residual dtype", residual_dtype, true);
        check_sizes("quantize_cpu", n, block_size);
        acco::quantize_cpu(x, x_dtype, residual, residual_dtype, n, block_size, q, scales, num_threads);
      },
      "q (int8, n), scales (fp32, one per block) of v = x (+ residual, which becomes v - q * scale).",
      py::call_guard<py::gil_scoped_release>());
  mod.def(
      "dequantize_cpu",
      [](uintptr_t q, uintptr_t scales, int64_t n, int64_t block_size, uintptr_t out, bool accumulate,
         int num_threads) {
        check_sizes("dequantize_cpu", n, block_size);
        acco::dequantize_cpu(q, scales, n, block_size, out, accumulate, num_threads);
      },
      "out (fp32, n) = q * scale of its block, or out += q * scale when accumulate.",
      py::call_guard<py::gil_scoped_release>());
  mod.def(
      "dequantize_sum_cpu",
      [](const std::vector<uintptr_t>& q_rows, const std::vector<uintptr_t>& scale_rows, int64_t n, int64_t block_size,
         uintptr_t out, int out_dtype, int num_threads) {
        acco::check_dtype("out dtype", out_dtype, false);
        check_sizes("dequantize_sum_cpu", n, block_size);
        if (q_rows.empty() || q_rows.size() != scale_rows.size())
          throw std::invalid_argument("dequantize_sum_cpu: need as many scale rows as q rows, at least one; got " +
                                      std::to_string(q_rows.size()) + " and " + std::to_string(scale_rows.size()));
        acco::dequantize_sum_cpu(q_rows, scale_rows, n, block_size, out, out_dtype, num_threads);
      },
      "out (fp32, bf16 or fp16, n) = the sum of q_r * scale_r over the rows in their order (fp32 arithmetic).",
      py::call_guard<py::gil_scoped_release>());
  mod.def(
      "quantized_sum_squares_cpu",
      [](const std::vector<uintptr_t>& q_rows, const std::vector<uintptr_t>& scale_rows, int64_t n, int64_t block_size,
         int dtype, uintptr_t tilde, uintptr_t tilde_out, int num_threads) {
        acco::check_dtype("dtype", dtype, false);
        check_sizes("quantized_sum_squares_cpu", n, block_size);
        if (q_rows.empty() || q_rows.size() != scale_rows.size())
          throw std::invalid_argument("quantized_sum_squares_cpu: need as many scale rows as q rows, at least one; "
                                      "got " + std::to_string(q_rows.size()) + " and " +
                                      std::to_string(scale_rows.size()));
        return acco::quantized_sum_squares_cpu(q_rows, scale_rows, n, block_size, dtype, tilde, tilde_out,
                                               num_threads);
      },
      "The fp64 sum of squares of the rows' sum (as dequantize_sum_cpu stores it in dtype, plus tilde when given); "
      "tilde_out receives the sum. Use acco_ds.ops.quantized_sum_step.",
      py::call_guard<py::gil_scoped_release>());
  mod.def(
      "quantize_difference_cpu",
      [](uintptr_t x, uintptr_t base, int dtype, int64_t n, int64_t block_size, uintptr_t q, uintptr_t scales,
         int num_threads) {
        acco::check_dtype("dtype", dtype, false);
        check_sizes("quantize_difference_cpu", n, block_size);
        acco::quantize_difference_cpu(x, base, dtype, n, block_size, q, scales, num_threads);
      },
      "q (int8, n), scales (fp32, one per block) of v = x - base (fp32 arithmetic; base only read).",
      py::call_guard<py::gil_scoped_release>());
  mod.def(
      "add_dequantized_cpu",
      [](uintptr_t q, uintptr_t scales, uintptr_t base, uintptr_t out, int dtype, int64_t n, int64_t block_size,
         int num_threads) {
        acco::check_dtype("dtype", dtype, false);
        check_sizes("add_dequantized_cpu", n, block_size);
        acco::add_dequantized_cpu(q, scales, base, out, dtype, n, block_size, num_threads);
      },
      "out = base + q * scale of its block (fp32 arithmetic), stored in base's dtype; out may be base.",
      py::call_guard<py::gil_scoped_release>());
  mod.def(
      "fold_quantize_cpu",
      [](uintptr_t buffer, int buffer_dtype, uintptr_t grad, int grad_dtype, int64_t offset, int64_t numel,
         int64_t chunk, int64_t world, uintptr_t residual, int residual_dtype, uintptr_t q, uintptr_t scales,
         int64_t block_size, int qmax, int num_threads) {
        acco::check_dtype("buffer dtype", buffer_dtype, false);
        acco::check_dtype("grad dtype", grad_dtype, false);
        acco::check_dtype("residual dtype", residual_dtype, true);
        check_rows("fold_quantize_cpu", chunk, world, block_size, qmax, residual, residual_dtype);
        if (offset < 0 || numel < 0 || offset > world * chunk - numel)
          throw std::invalid_argument("fold_quantize_cpu: grad (" + std::to_string(numel) + " elements at offset " +
                                      std::to_string(offset) + ") does not fit in the buffer of " +
                                      std::to_string(world * chunk) + " elements");
        acco::fold_quantize_cpu(buffer, buffer_dtype, grad, grad_dtype, offset, numel, chunk, world, residual,
                                residual_dtype, q, scales, block_size, qmax, num_threads);
      },
      "Fold grad into buffer[offset : offset + numel]: the blocks it covers whole quantized from "
      "cast(buffer + grad) (+ residual, which becomes v - q * scale) into q and scales (the buffer not written "
      "there), the other elements accumulated into the buffer. Use acco_ds.ops.fold_quantize.",
      py::call_guard<py::gil_scoped_release>());
  mod.def(
      "quantize_listed_blocks_cpu",
      [](uintptr_t buffer, int buffer_dtype, int64_t chunk, int64_t world, uintptr_t residual, int residual_dtype,
         uintptr_t q, uintptr_t scales, int64_t block_size, int qmax, uintptr_t blocks, int64_t num_listed,
         int num_threads) {
        acco::check_dtype("buffer dtype", buffer_dtype, false);
        acco::check_dtype("residual dtype", residual_dtype, true);
        check_rows("quantize_listed_blocks_cpu", chunk, world, block_size, qmax, residual, residual_dtype);
        if (num_listed < 0 || (num_listed > 0 && blocks == 0))
          throw std::invalid_argument("quantize_listed_blocks_cpu: need the address of num_listed >= 0 block "
                                      "indices, got num_listed = " + std::to_string(num_listed));
        acco::quantize_listed_blocks_cpu(buffer, buffer_dtype, chunk, world, residual, residual_dtype, q, scales,
                                         block_size, qmax, blocks, num_listed, num_threads);
      },
      "Quantize the listed global blocks (sorted, distinct int64 indices) of buffer (+ residual, which becomes "
      "v - q * scale) into q and scales. Use acco_ds.ops.fold_quantize.",
      py::call_guard<py::gil_scoped_release>());
  mod.attr("ABI_VERSION") = acco::kAbiVersion;
  mod.attr("ISA") = acco::isa_name();
}
