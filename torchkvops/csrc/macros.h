// The host/device qualifiers of the functions that the CPU and CUDA kernels share, defined once for
// every header here. Under nvcc (__CUDACC__) they make a function callable from host and device code;
// in a plain C++ compile (the CPU kernels) they add nothing but `inline` where stated.
//   TORCHKVOPS_HOST_DEVICE         `__host__ __device__` / nothing; write `inline` after it where
//                                  the function is defined in a header.
//   TORCHKVOPS_HOST_DEVICE_INLINE  `__host__ __device__ __forceinline__` / `inline`: for the small
//                                  per-element helpers of a kernel's inner loop, which nvcc must inline.
//   TORCHKVOPS_NO_EXEC_CHECK       before a host/device template that calls a policy type's methods,
//                                  which are __device__ only in a CUDA policy and host only in a CPU
//                                  one: each instantiation runs on one side only, so nvcc's check of
//                                  calls across execution spaces is switched off for it (as thrust's
//                                  __thrust_exec_check_disable__ does). Nothing in plain C++.
//   TORCHKVOPS_UNROLL              `#pragma unroll` in nvcc's device pass, `#pragma GCC unroll 16` in
//                                  a plain GCC compile, nothing otherwise: for loops with a small
//                                  compile-time trip count.
#pragma once

#if defined(__CUDACC__)
#define TORCHKVOPS_HOST_DEVICE __host__ __device__
#define TORCHKVOPS_HOST_DEVICE_INLINE __host__ __device__ __forceinline__
#else
#define TORCHKVOPS_HOST_DEVICE
#define TORCHKVOPS_HOST_DEVICE_INLINE inline
#endif

#if defined(__CUDACC__)
#define TORCHKVOPS_NO_EXEC_CHECK _Pragma("nv_exec_check_disable")
#else
#define TORCHKVOPS_NO_EXEC_CHECK
#endif

#if defined(__CUDA_ARCH__)
#define TORCHKVOPS_UNROLL _Pragma("unroll")
#elif defined(__CUDACC__)  // nvcc's host pass: its front end knows no GCC pragma
#define TORCHKVOPS_UNROLL
#elif defined(__GNUC__) && !defined(__clang__)
#define TORCHKVOPS_UNROLL _Pragma("GCC unroll 16")
#else
#define TORCHKVOPS_UNROLL
#endif
