// Body of the CUDA AdamW kernel as a __host__ __device__ function of (block, thread, block_dim, grid_dim, args).
//
// The __global__ wrapper in adamw_cuda.cu calls it with blockIdx/threadIdx; the CPU harness
// (cuda_body_harness.cpp) calls it for every (block, thread) of the same grid, so the indexing, the vector
// path, the alignment decisions and the tails run on CPU in the tests. With ACCO_KERNEL_HARNESS defined,
// every vector access checks its alignment and every access its bounds (a GPU would fault or corrupt).
//
// Work split: the shard is cut in groups of kVec = 4 elements; thread t of block b handles groups
// b*block_dim + t, then + grid_dim*block_dim (grid-stride). A full group moves each array with one vector
// access (fp32x4 = 16 B, bf16x4 / fp16x4 = 8 B) when that array's base pointer is aligned for it, else with 4 scalar
// accesses; the last, partial group (n % 4 elements) is scalar. 16-bit types (bf16, fp16) move 8 B per vector.
#pragma once

#include <stdint.h>

#include "adamw/adamw_math.h"

#if defined(ACCO_KERNEL_HARNESS) && !defined(__CUDA_ARCH__)
#include <stdexcept>
#define ACCO_KERNEL_CHECK(cond, msg)                  \
  do {                                                \
    if (!(cond)) throw std::runtime_error(msg);       \
  } while (0)
#else
#define ACCO_KERNEL_CHECK(cond, msg) \
  do {                               \
  } while (0)
#endif

#if defined(__CUDACC__)
#define ACCO_UNROLL _Pragma("unroll")
#elif defined(__clang__)
#define ACCO_UNROLL _Pragma("clang loop unroll(full)")
#elif defined(__GNUC__)
#define ACCO_UNROLL _Pragma("GCC unroll 4")
#else
#define ACCO_UNROLL
#endif

namespace acco {

constexpr int kVec = 4;           // elements per group (one vector access per array)
constexpr int kBlock = 256;       // threads per block
constexpr int64_t kMaxGrid = 1 << 20;  // blocks; larger shards use the grid-stride loop

// Arguments of one launch. Pointers are device pointers (host pointers in the harness).
struct AdamWKernelArgs {
  float* p;                  // fp32 master [n]
  float* m;                  // fp32 exp_avg [n]
  float* v;                  // fp32 exp_avg_sq [n]
  const void* g;             // grad [n], fp32, bf16 or fp16 (template G)
  void* out;                 // nullptr or out [n], fp32, bf16 or fp16 (template O)
  const float* scale_ptr;    // nullptr or 1 fp32 on the device: extra gradient scale
  const int32_t* noop_ptr;   // nullptr or 1 int32 on the device: nonzero = skip the step
  const float* hyper_ptr;    // nullptr = use h; else kHyperFields fp32 on the device (AdamWHyper's), used instead
  int64_t n;                 // elements
  float grad_scale;          // host gradient scale
  AdamWHyper h;              // by value from the host; ignored when hyper_ptr is set
  bool p_vec, m_vec, v_vec, g_vec, out_vec;  // base pointer aligned for the vector access of its type
};

struct alignas(16) F32x4 {
  float x[kVec];
};
struct alignas(8) Bf16x4 {
  uint16_t x[kVec];
};
template <typename T>
struct Vec4Of;
template <>
struct Vec4Of<float> {
  using type = F32x4;
};
template <>
struct Vec4Of<uint16_t> {
  using type = Bf16x4;
};
struct alignas(8) F16x4 {
  fp16_t x[kVec];
};
template <>
struct Vec4Of<fp16_t> {
  using type = F16x4;
};

// True when `ptr` may be accessed as vectors of 4 T (the launcher fills the *_vec flags with it).
template <typename T>
inline bool vec_aligned(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % sizeof(typename Vec4Of<T>::type) == 0;
}

template <typename T>
ACCO_HD void load4(const T* base, int64_t i, int64_t n, bool vec, float (&x)[kVec]) {
  ACCO_KERNEL_CHECK(i >= 0 && i + kVec <= n, "adamw kernel body: vector group read out of bounds");
  using V = typename Vec4Of<T>::type;
  if (vec) {
    ACCO_KERNEL_CHECK(reinterpret_cast<uintptr_t>(base + i) % sizeof(V) == 0,
                      "adamw kernel body: misaligned vector load");
    const V w = *reinterpret_cast<const V*>(base + i);
ACCO_UNROLL
    for (int k = 0; k < kVec; ++k) x[k] = to_f32(w.x[k]);
  } else {
ACCO_UNROLL
    for (int k = 0; k < kVec; ++k) x[k] = to_f32(base[i + k]);
  }
}

template <typename T>
ACCO_HD void store4(T* base, int64_t i, int64_t n, bool vec, const float (&x)[kVec]) {
  ACCO_KERNEL_CHECK(i >= 0 && i + kVec <= n, "adamw kernel body: vector group write out of bounds");
  using V = typename Vec4Of<T>::type;
  if (vec) {
    ACCO_KERNEL_CHECK(reinterpret_cast<uintptr_t>(base + i) % sizeof(V) == 0,
                      "adamw kernel body: misaligned vector store");
    V w;
ACCO_UNROLL
    for (int k = 0; k < kVec; ++k) w.x[k] = from_f32<T>(x[k]);
    *reinterpret_cast<V*>(base + i) = w;
  } else {
ACCO_UNROLL
    for (int k = 0; k < kVec; ++k) base[i + k] = from_f32<T>(x[k]);
  }
}

// G: grad element type, O: out element type (float = fp32, uint16_t = bf16, fp16_t = fp16); COMMIT: write
// master/m/v.
template <typename G, typename O, bool COMMIT>
ACCO_HD void adamw_kernel_body(int64_t block, int64_t thread, int64_t block_dim, int64_t grid_dim,
                               const AdamWKernelArgs& a) {
  const int64_t n = a.n;
  const int64_t groups = (n + kVec - 1) / kVec;
  const bool noop = a.noop_ptr != nullptr && *a.noop_ptr != 0;
  const float s = a.scale_ptr != nullptr ? a.grad_scale * *a.scale_ptr : a.grad_scale;
  // Selected on the device (e.g. by the step count a skipped commit left there): one load per thread.
  if (a.hyper_ptr != nullptr)
    ACCO_KERNEL_CHECK(reinterpret_cast<uintptr_t>(a.hyper_ptr) % alignof(float) == 0,
                      "adamw kernel body: misaligned hyper_ptr");
  const AdamWHyper h = a.hyper_ptr != nullptr ? load_hyper(a.hyper_ptr) : a.h;
  const G* g = static_cast<const G*>(a.g);
  O* out = static_cast<O*>(a.out);
  for (int64_t grp = block * block_dim + thread; grp < groups; grp += grid_dim * block_dim) {
    const int64_t i = grp * kVec;
    if (i + kVec <= n) {
      float p[kVec], m[kVec], v[kVec], gg[kVec];
      load4(a.p, i, n, a.p_vec, p);
      if (!noop) {
        load4(a.m, i, n, a.m_vec, m);
        load4(a.v, i, n, a.v_vec, v);
        load4(g, i, n, a.g_vec, gg);
ACCO_UNROLL
        for (int k = 0; k < kVec; ++k) adamw_update(p[k], m[k], v[k], gg[k] * s, h);
        if (COMMIT) {
          store4(a.p, i, n, a.p_vec, p);
          store4(a.m, i, n, a.m_vec, m);
          store4(a.v, i, n, a.v_vec, v);
        }
      }
      if (out != nullptr) store4(out, i, n, a.out_vec, p);
    } else {
      for (int64_t j = i; j < n; ++j) {
        float p = a.p[j];
        if (!noop) {
          float m = a.m[j], v = a.v[j];
          adamw_update(p, m, v, to_f32(g[j]) * s, h);
          if (COMMIT) {
            a.p[j] = p;
            a.m[j] = m;
            a.v[j] = v;
          }
        }
        if (out != nullptr) out[j] = from_f32<O>(p);
      }
    }
  }
}

// Grid of the launch for n elements: enough blocks for one group per thread, capped (grid-stride beyond).
inline int64_t adamw_grid(int64_t n) {
  const int64_t groups = (n + kVec - 1) / kVec;
  int64_t grid = (groups + kBlock - 1) / kBlock;
  if (grid > kMaxGrid) grid = kMaxGrid;
  return grid < 1 ? 1 : grid;
}

}  // namespace acco
