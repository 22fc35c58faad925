// What the CPU launchers share: the instruction-set variant in use and the work per OpenMP thread.
//
// Each CPU loop is compiled three times (AVX-512, AVX2, baseline x86-64 / whatever the target is; the
// ACCO_TARGET_* attributes) and the best variant the running CPU supports is picked once, when the module
// loads (kIsa), so the wheel stays portable (no -march=native). Built with -ffp-contract=off and without
// -ffast-math: the variants do the same IEEE fp32 operations, so results do not depend on the ISA picked.
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace acco {

constexpr int64_t kGrain = 1 << 15;  // minimum elements per OpenMP thread

enum class Isa { kBase, kAvx2, kAvx512 };

inline Isa best_isa() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kBase;
}

// The best variant the CPU runs, or a lower one named by ACCO_DS_CPU_ISA=avx2|base (tests use it to run
// every variant on one machine); a higher one than the CPU supports is never picked.
inline Isa detect_isa() {
  const Isa best = best_isa();
  const char* env = getenv("ACCO_DS_CPU_ISA");
  if (env == nullptr) return best;
  const Isa want = strcmp(env, "base") == 0 ? Isa::kBase : strcmp(env, "avx2") == 0 ? Isa::kAvx2 : best;
  return static_cast<int>(want) < static_cast<int>(best) ? want : best;
}

// The variant of this module, read once when it loads.
inline const Isa kIsa = detect_isa();

// Its name ("avx512", "avx2" or "base"): the modules' ISA attribute.
inline const char* isa_name() {
  return kIsa == Isa::kAvx512 ? "avx512" : kIsa == Isa::kAvx2 ? "avx2" : "base";
}

}  // namespace acco

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ACCO_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512")))
#define ACCO_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define ACCO_HAVE_ISA_VARIANTS 1
#else
#define ACCO_HAVE_ISA_VARIANTS 0
#endif
