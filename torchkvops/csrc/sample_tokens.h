// Shared by the CPU and CUDA kernels of sample_tokens: argument checks, the counter-based hash and the
// Gumbel noise, the order-preserving key of a float, and the fixed-point probability mass used by
// the top-p selection. Everything here must stay bit-identical to torchkvops/reference.py.
//
// What one row computes (l = logits / temperature in float32, g = Gumbel noise of (key, step, token)):
//   greedy (temperature 0): argmax of the raw logits, the first index on ties, NaN counting as the
//     largest value (torch.argmax's rules).
//   otherwise: argmax over every token of score = (kept ? l : -inf) + g, with the same rules. A token
//     is kept when its l is >= the top-k threshold (the k-th largest l; every token tied with it is
//     kept, as the reference's `l < kth` masking does) and >= the top-p threshold t*: the largest
//     value among the top-k-kept tokens such that the mass of the tokens with l >= t* reaches
//     top_p * Z (mass = exp(l - max l), Z = the sum over the top-k-kept tokens). So a token is kept
//     exactly when the mass of the tokens with a STRICTLY larger l is below top_p * Z. The
//     reference ranks tied values by a sort and may drop some of the tokens tied at t*; the two can
//     differ only when the top-p threshold value is tied.
// Both thresholds are found by radix selection on the keys (4 passes of 8-bit digits), never by
// sorting the row. Masses are summed as 64-bit fixed-point integers, so every sum is exact and the
// result does not depend on the order of the additions (or on the number of threads).
//
// The uniform variate takes the hash's top 23 bits: u = (float(bits >> 9) + 0.5f) * 2^-23 is exact in
// float32 and lies in [2^-24, 1 - 2^-24], so the noise is always finite (|g| < 17). (With all 32 bits,
// (float(bits) + 0.5f) * 2^-32 rounded to exactly 1.0f for the 128 largest bit patterns: infinite
// noise, a token that won whatever its logit, even when top-k / top-p had dropped it.)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define TORCHKVOPS_HD __host__ __device__ __forceinline__
#else
#define TORCHKVOPS_HD inline
#endif

namespace torchkvops {
namespace sampling {

// The hash constants of torchkvops/sampling.py and reference.py.
constexpr uint32_t kStepSalt = 0x5BD1E995u;
constexpr uint32_t kTokenSalt = 0x27D4EB2Fu;

// Masses exp(l - max) in [0, 1] are summed as integers in units of 2^-kMassFracBits. The largest row
// (kMaxVocab tokens of mass 1) sums to 2^63, so a 64-bit sum never overflows.
constexpr int kMassFracBits = 40;
constexpr int64_t kMaxVocab = int64_t{1} << 23;
// exp(d) * 2^40 < 1 for d < -28 (e^-28 = 6.9e-13 < 2^-40 = 9.1e-13): such a token's fixed-point mass
// is 0 and its exp need not be computed.
constexpr float kMassCutoff = -28.0f;
// The largest finite Gumbel noise is -log(-log(1 - 2^-24)) = 16.64 < 17.
constexpr int kMaxFiniteNoise = 17;

// A 32-bit integer mix (sampling.py's _hash32).
TORCHKVOPS_HD uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x68E31DA5u;
  x ^= x >> 16;
  return x;
}

// The per-(row, step) part of the hash; only the low 32 bits of key and step count, as in Python.
TORCHKVOPS_HD uint32_t step_key(int64_t key, int64_t step) {
  return hash32(static_cast<uint32_t>(key) ^ hash32(static_cast<uint32_t>(step) + kStepSalt));
}

// The uniform variate of one token: (float(bits >> 9) + 0.5) * 2^-23 in float32, exact, in
// [2^-24, 1 - 2^-24].
TORCHKVOPS_HD float uniform(uint32_t step_key, int64_t token) {
  const uint32_t bits = hash32(step_key ^ hash32(static_cast<uint32_t>(token) + kTokenSalt));
  return (static_cast<float>(bits >> 9) + 0.5f) * 1.1920928955078125e-07f;  // 2^-23, exact
}

// Gumbel noise -log(-log(u)), in float32 as the reference computes it; finite, below 16.64.
TORCHKVOPS_HD float gumbel(float u) {
#if defined(__CUDA_ARCH__)
  return -logf(-logf(u));
#else
  return -std::log(-std::log(u));
#endif
}

// An unsigned key with the order of the float values: k(a) < k(b) iff a < b, for all non-NaN values.
// -0.0 and +0.0 get the same key (they compare equal); every NaN gets the largest key. Branch-free,
// so that the CPU loops over a row vectorize.
TORCHKVOPS_HD uint32_t order_key(float v) {
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(v);
#else
  static_assert(sizeof(float) == sizeof(uint32_t), "float must be 32 bits");
  __builtin_memcpy(&bits, &v, sizeof(bits));
#endif
  bits = bits == 0x80000000u ? 0u : bits;                             // -0.0 -> +0.0
  const uint32_t flip = (bits >> 31) ? 0xFFFFFFFFu : 0x80000000u;     // negative: reverse the order
  return v != v ? 0xFFFFFFFFu : bits ^ flip;
}

// Skipping the noise of tokens that cannot win. A token D below the best score so far needs noise
// g >= D to beat it, i.e. u >= exp(-exp(-D)): most tokens fail that test on u alone, and their two
// logs are never computed. noise_reach_threshold(D), D = 0..17, is the smallest float at or above
// exp(-exp(-(D - 0.01))): for u below it the exact noise is below D - 0.01, and the computed one
// (log's error is ~1e-6) below D. (D = 17 gives 1.0f, which u never reaches: no noise gains 17.)
constexpr int kNoiseSteps = kMaxFiniteNoise + 1;

TORCHKVOPS_HD float noise_reach_threshold(int d) {
  const double t = exp(-exp(-(static_cast<double>(d) - 0.01)));
  float f = static_cast<float>(t);
  if (static_cast<double>(f) < t) f = nextafterf(f, 2.0f);
  return f;
}

// True when a kept token (scaled logit l, uniform u) certainly does not beat `best`, the score of a
// token with a lower index: with D the largest whole number <= 17 such that fl(l + D) <= best and
// u < reach[D], the computed noise is below D, so fl(l + g) <= fl(l + D) <= best (rounding is
// monotone) and a tie goes to the lower index. False whenever l, best or the gap is NaN.
TORCHKVOPS_HD bool cannot_beat(float l, float u, float best, const float* reach) {
  const float gap = best - l;
  if (!(gap >= 0.0f)) return false;  // l > best, or NaN
  int d = gap >= static_cast<float>(kMaxFiniteNoise) ? kMaxFiniteNoise : static_cast<int>(gap);
  while (d > 0 && !(l + static_cast<float>(d) <= best)) --d;  // the rounded gap may overshoot
  return l + static_cast<float>(d) <= best && u < reach[d];
}

// The fixed-point mass of a token d = l - max below the row's maximum (d <= 0).
TORCHKVOPS_HD uint64_t fixed_mass(float d) {
  if (!(d >= kMassCutoff)) return 0;  // also NaN
#if defined(__CUDA_ARCH__)
  const float m = expf(d);
#else
  const float m = std::exp(d);
#endif
  // m * 2^40 is exact in float; the conversion truncates. m > 1 only with NaN or inf logits.
  return m <= 1.0f ? static_cast<uint64_t>(m * 1099511627776.0f) : (uint64_t{1} << kMassFracBits);
}

// The number of top-mass units the top-p threshold must reach: ceil(top_p * total), at least 1 (the
// most likely token always stays) and at most total. top_p is the float32 value the reference compares
// against.
TORCHKVOPS_HD uint64_t top_p_target(float top_p, uint64_t total) {
  const double t = ceil(static_cast<double>(top_p) * static_cast<double>(total));
  if (!(t >= 1.0)) return 1;
  if (t >= static_cast<double>(total)) return total;
  return static_cast<uint64_t>(t);
}

// True when (score a, index ia) beats (score b, index ib) under torch.argmax's rules: NaN is the
// largest value, and the lower index wins a tie.
TORCHKVOPS_HD bool beats(float a, int64_t ia, float b, int64_t ib) {
  if (a != a) return b == b || ia < ib;
  if (b != b) return false;
  return a > b || (a == b && ia < ib);
}

}  // namespace sampling

// Everything the kernels need besides the tensors.
struct SampleParams {
  bool greedy = false;
  // l = logit / temperature, in float32 and rounded as torch rounds `logits.float() / temperature`:
  // its CPU kernel divides, its CUDA kernel multiplies by the float32 reciprocal of a CPU scalar.
  float temperature = 1.0f;      // CPU
  float inv_temperature = 1.0f;  // CUDA
  int64_t top_k = 0;             // 0 = off; 0 < top_k < vocab otherwise
  bool use_top_p = false;        // top_p < 1, decided in double as the reference decides it
  float top_p = 1.0f;            // float32, the value the reference compares against
};

inline void check_sample_args(const at::Tensor& logits, const at::Tensor& keys, const at::Tensor& step,
                              double temperature, int64_t top_k, double top_p) {
  const char* op = "sample_tokens";
  TORCH_CHECK_VALUE(logits.dim() == 2, op, ": logits must be 2-D [rows, vocab], got shape ", logits.sizes());
  const auto dtype = logits.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
                   ": logits must be float32, float16 or bfloat16, got ", dtype);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK_VALUE(rows == 0 || vocab >= 1, op, ": logits must have vocab >= 1 (dim 1), got shape ",
                    logits.sizes());
  TORCH_CHECK_VALUE(vocab <= sampling::kMaxVocab, op, ": logits' vocab (dim 1) must be <= ", sampling::kMaxVocab,
                    ", got ", vocab);
  TORCH_CHECK_TYPE(keys.scalar_type() == at::kLong, op, ": keys must be int64, got ", keys.scalar_type());
  TORCH_CHECK_VALUE(keys.dim() == 1 && keys.size(0) == rows, op, ": keys must be 1-D with one key per row (",
                    rows, "), got shape ", keys.sizes());
  TORCH_CHECK_VALUE(keys.device() == logits.device(), op, ": keys must be on logits' device ", logits.device(),
                    ", got ", keys.device());
  TORCH_CHECK_TYPE(step.scalar_type() == at::kLong, op, ": step must be a 1-element int64 tensor, got ",
                   step.scalar_type());
  TORCH_CHECK_VALUE(step.numel() == 1, op, ": step must be a 1-element int64 tensor, got ", step.numel(),
                    " elements");
  TORCH_CHECK_VALUE(step.device() == logits.device(), op, ": step must be on logits' device ", logits.device(),
                    ", got ", step.device());
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature >= 0.0, op,
                    ": temperature must be finite and >= 0 (0 = greedy), got ", temperature);
  TORCH_CHECK_VALUE(top_k >= 0, op, ": top_k must be >= 0 (0 = off), got ", top_k);
  TORCH_CHECK_VALUE(top_p > 0.0 && top_p <= 1.0, op, ": top_p must be in (0, 1] (1 = off), got ", top_p);
}

inline SampleParams make_sample_params(int64_t vocab, double temperature, int64_t top_k, double top_p) {
  SampleParams p;
  p.greedy = temperature == 0.0;
  p.temperature = static_cast<float>(temperature);
  p.inv_temperature = 1.0f / p.temperature;  // unused when greedy
  p.top_k = top_k < vocab ? top_k : 0;
  p.use_top_p = top_p < 1.0;
  p.top_p = static_cast<float>(top_p);
  return p;
}

}  // namespace torchkvops
