// CPU harness of the CUDA AdamW kernel: runs adamw_kernel_body for every (block, thread) of the grid the
// CUDA launcher would use (or a given one), with alignment and bounds checks on every access
// (ACCO_KERNEL_HARNESS). Test-only: it lets CPU tests catch indexing, vector-path, alignment and tail bugs
// of the GPU kernel without a GPU. Single-threaded; blocks run in order (the kernel has no inter-thread
// communication, so the order does not matter on the GPU either).
#define ACCO_KERNEL_HARNESS 1

#include <stdexcept>

#include "adamw/adamw_launch.h"

namespace acco {
namespace {

template <typename G, typename O, bool COMMIT>
void run_grid(const AdamWKernelArgs& a, int64_t grid_dim, int64_t block_dim) {
  for (int64_t b = 0; b < grid_dim; ++b)
    for (int64_t t = 0; t < block_dim; ++t) adamw_kernel_body<G, O, COMMIT>(b, t, block_dim, grid_dim, a);
}

template <typename G, typename O>
void run_commit(const AdamWKernelArgs& a, bool commit, int64_t grid_dim, int64_t block_dim) {
  if (commit)
    run_grid<G, O, true>(a, grid_dim, block_dim);
  else
    run_grid<G, O, false>(a, grid_dim, block_dim);
}

template <typename G>
void run_out(const AdamWKernelArgs& a, int out_dtype, bool commit, int64_t grid_dim, int64_t block_dim) {
  with_elem(out_dtype, [&](auto o) { run_commit<G, typename decltype(o)::type>(a, commit, grid_dim, block_dim); });
}

}  // namespace

void adamw_cuda_body_on_cpu(const AdamWKernelArgs& a, int g_dtype, int out_dtype, bool commit, int64_t grid_dim,
                            int64_t block_dim) {
  if (grid_dim <= 0) grid_dim = adamw_grid(a.n);
  if (block_dim <= 0) block_dim = kBlock;
  with_elem(g_dtype, [&](auto g) { run_out<typename decltype(g)::type>(a, out_dtype, commit, grid_dim, block_dim); });
}

}  // namespace acco
