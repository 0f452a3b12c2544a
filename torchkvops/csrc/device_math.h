// The float operations whose rounding the CPU and CUDA kernels must agree on, as thin wrappers: the
// only place in the shared headers where host and device code differ (the one `__CUDA_ARCH__` block
// below). Shared code calls these instead of writing `a * b + c` or `logf(x)`:
//   mul_rn, add_rn   one IEEE float32 product or sum, rounded to nearest. nvcc contracts `a * b + c`
//                    into a fused multiply-add by default, which rounds once where the reference (and
//                    a plain C++ compile for x86-64) rounds twice; __fmul_rn / __fadd_rn are never
//                    contracted. On the host a plain product or sum (no FMA without -mfma).
//   u32_to_float     a uint32_t to float32, rounded to nearest.
//   log_f, log1p_f, exp_f, tanh_f   CUDA's logf / log1pf / expf / tanhf on the device (at most 1-2 ulp from the
//                    correctly rounded value), the C library's on the host (glibc's: correctly
//                    rounded in nearly all cases). These can differ in the last bit: a CPU emulation
//                    of a CUDA kernel matches it bit for bit except where a result depends on them.
//   log_f(double)    the double log, for the CPU kernel's double sums.
// Bit casts need no split: __builtin_memcpy compiles to a register move in host and device code.
#pragma once

#include <cmath>
#include <cstdint>

#include "macros.h"

namespace torchkvops {
namespace dmath {

#if defined(__CUDA_ARCH__)
TORCHKVOPS_HOST_DEVICE_INLINE float mul_rn(float a, float b) { return __fmul_rn(a, b); }
TORCHKVOPS_HOST_DEVICE_INLINE float add_rn(float a, float b) { return __fadd_rn(a, b); }
TORCHKVOPS_HOST_DEVICE_INLINE float u32_to_float(uint32_t x) { return __uint2float_rn(x); }
TORCHKVOPS_HOST_DEVICE_INLINE float log_f(float x) { return logf(x); }
TORCHKVOPS_HOST_DEVICE_INLINE float log1p_f(float x) { return log1pf(x); }
TORCHKVOPS_HOST_DEVICE_INLINE float exp_f(float x) { return expf(x); }
TORCHKVOPS_HOST_DEVICE_INLINE float tanh_f(float x) { return tanhf(x); }
TORCHKVOPS_HOST_DEVICE_INLINE double log_f(double x) { return log(x); }
#else
TORCHKVOPS_HOST_DEVICE_INLINE float mul_rn(float a, float b) { return a * b; }
TORCHKVOPS_HOST_DEVICE_INLINE float add_rn(float a, float b) { return a + b; }
TORCHKVOPS_HOST_DEVICE_INLINE float u32_to_float(uint32_t x) { return static_cast<float>(x); }
TORCHKVOPS_HOST_DEVICE_INLINE float log_f(float x) { return std::log(x); }
TORCHKVOPS_HOST_DEVICE_INLINE float log1p_f(float x) { return std::log1p(x); }
TORCHKVOPS_HOST_DEVICE_INLINE float exp_f(float x) { return std::exp(x); }
TORCHKVOPS_HOST_DEVICE_INLINE float tanh_f(float x) { return std::tanh(x); }
TORCHKVOPS_HOST_DEVICE_INLINE double log_f(double x) { return std::log(x); }
#endif

TORCHKVOPS_HOST_DEVICE_INLINE uint32_t float_bits(float v) {
  static_assert(sizeof(float) == sizeof(uint32_t), "float must be 32 bits");
  uint32_t bits;
  __builtin_memcpy(&bits, &v, sizeof(bits));
  return bits;
}

TORCHKVOPS_HOST_DEVICE_INLINE float bits_float(uint32_t bits) {
  float v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v;
}

// Neither infinite nor NaN (fabsf(v) < inf), from the exponent bits.
TORCHKVOPS_HOST_DEVICE_INLINE bool is_finite(float v) { return (float_bits(v) & 0x7F800000u) != 0x7F800000u; }

// The quiet NaN of std::numeric_limits<float>::quiet_NaN() (CUDA's CUDART_NAN_F is 0x7FFFFFFF: also a
// quiet NaN; the sampler's kernels return this one on both devices).
TORCHKVOPS_HOST_DEVICE_INLINE float nan_f() { return bits_float(0x7FC00000u); }

}  // namespace dmath
}  // namespace torchkvops
