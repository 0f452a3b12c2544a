// The host/device qualifiers of the functions that the CPU and CUDA kernels share, defined once for
// every header here. Under nvcc (__CUDACC__) they make a function callable from host and device code;
// in a plain C++ compile (the CPU kernels) they add nothing but `inline` where stated.
//   TORCHKVOPS_HOST_DEVICE         `__host__ __device__` / nothing; write `inline` after it where
//                                  the function is defined in a header.
//   TORCHKVOPS_HOST_DEVICE_INLINE  `__host__ __device__ __forceinline__` / `inline`: for the small
//                                  per-element helpers of a kernel's inner loop, which nvcc must inline.
#pragma once

#if defined(__CUDACC__)
#define TORCHKVOPS_HOST_DEVICE __host__ __device__
#define TORCHKVOPS_HOST_DEVICE_INLINE __host__ __device__ __forceinline__
#else
#define TORCHKVOPS_HOST_DEVICE
#define TORCHKVOPS_HOST_DEVICE_INLINE inline
#endif
