// ACCO_HD: the qualifiers of a function that nvcc compiles for the host and the device and g++ for the host.
#pragma once

#if defined(__CUDACC__)
#define ACCO_HD __host__ __device__ __forceinline__
#else
#define ACCO_HD inline __attribute__((always_inline))
#endif
