// Shared by the CPU and CUDA kernels of sample_tokens: argument checks, the counter-based hash and the
// Gumbel noise, the order-preserving key of a float, the fixed-point probability mass used by the
// top-p selection, the radix selection's digit rule, the draw of one token (prune, noise, compare) and
// the log-probability's finish. Everything here must stay bit-identical to torchkvops/reference.py.
// The CUDA kernel's whole row (its loops, reductions and scans) is sample_tokens_row.h, which the CPU
// op _sample_tokens_cuda_emulated also runs; the CPU kernel keeps its own loops and calls these.
//
// What one row computes (l = logits / temperature in float32, g = Gumbel noise of (key, step, token)):
//   greedy (temperature 0): argmax of the raw logits, the first index on ties, NaN counting as the
//     largest value (torch.argmax's rules).
//   otherwise: argmax over every token of score = (kept ? l : -inf) + g, with the same rules. A token
//     is kept when its l is >= the top-k threshold (the k-th largest l; every token tied with it is
//     kept, as the reference's `l < kth` masking does) and >= the top-p threshold t*: the largest
//     value among the top-k-kept tokens such that the mass of the tokens with l >= t* reaches
//     top_p * Z (mass = exp(l - max l), Z = the sum over the top-k-kept tokens). So a token is kept
//     exactly when the mass of the tokens with a STRICTLY larger l is below top_p * Z (every token
//     tied at t* is kept; the reference keeps them too).
// sample_tokens_with_logprobs also returns the log-probability of the drawn token under the
// distribution it was drawn from (vLLM's "processed" logprobs): greedy, log_softmax(raw
// logits)[token]; otherwise the log_softmax over the kept tokens' l: l[token] - max - log(sum over
// kept of exp(l - max)), in float32 (the sum in double on the CPU; in float on CUDA, per thread,
// then across the block). NaN when the kept values hold a NaN or their maximum is infinite (+inf, or
// -inf: nothing finite is kept), as torch's log_softmax gives.
//
// What is the same on every device, exactly (rollout/sampling.py says it to users):
//   - the noise words (integer hashes) and the greedy token (argmax of the raw logits);
//   - not always l: each kernel rounds logits / temperature as torch does on its device (the
//     reference's `logits.float() / temperature`, and HF's temperature warper): the CPU kernel
//     divides by the float32 temperature, the CUDA kernel multiplies by its float32 reciprocal
//     (SampleParams). They agree at power-of-two temperatures, and differ for some logits otherwise;
//   - not always g: the noise's logs are glibc's on the CPU and CUDA's logf / log1pf on the GPU
//     (device_math.h), which may differ in the last bit;
//   - not the log-probability's last bits: the CPU sums in double with its own exp, CUDA in float
//     with expf.
// So CPU and CUDA draw the same token except at float32 near-ties of the perturbed scores and at
// tokens within rounding of the top-k / top-p cut. tests/test_sample_tokens_cuda_emulated.py shows
// the temperature's rounding on both sides.
// Both thresholds are found by radix selection on the keys (4 passes of 8-bit digits), never by
// sorting the row. Masses are summed as 64-bit fixed-point integers, so every sum is exact and the
// result does not depend on the order of the additions (or on the number of threads).
//
// The noise (the same in the reference): each token gets a 64-bit word x = (high, low), uniform in
// [0, 2^64): high = hash32(row_high ^ hash32((token + kTokenSalt) ^ row_low)), low = hash32(row_low ^
// high), where (row_high, row_low) is a bijective hash of the low 32 bits of (key, step) (noise_key).
// For one token the map from (key, step) to x is a bijection, so over keys and steps x is exactly
// uniform on 2^64 values. With u = (x + 1/2) 2^-64, the exponential variate e = -log(u) is computed
// from whichever of u and its complement 1 - u = (~x + 1/2) 2^-64 (exact as an integer) is below 1/2,
// taken to float32 at its own relative precision: -log(u) when u < 1/2, -log1p(-(1 - u)) otherwise.
// So both tails are exact to float32 rounding, and the Gumbel noise g = -log(e) lies in [-3.81,
// 45.06]: a token can win down to a probability of about e^-45 (~1e-19) of the best one's. (The
// earlier noise took a 23-bit uniform and capped g at 16.64: tokens below ~1e-7 were drawn too
// rarely.) Noise that cannot matter is never computed: see cannot_beat and noise_bound.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>

#include "device_math.h"
#include "macros.h"

namespace torchkvops {
namespace sampling {

// The hash constants of torchkvops/reference.py.
constexpr uint32_t kStepSalt = 0x5BD1E995u;
constexpr uint32_t kTokenSalt = 0x27D4EB2Fu;
constexpr uint32_t kLowSalt = 0x165667B1u;

// Masses exp(l - max) in [0, 1] are summed as integers in units of 2^-kMassFracBits. The largest row
// (kMaxVocab tokens of mass 1) sums to 2^63, so a 64-bit sum never overflows.
constexpr int kMassFracBits = 40;
constexpr int64_t kMaxVocab = int64_t{1} << 23;
// exp(d) * 2^40 < 1 for d < -28 (e^-28 = 6.9e-13 < 2^-40 = 9.1e-13): such a token's fixed-point mass
// is 0 and its exp need not be computed.
constexpr float kMassCutoff = -28.0f;
// No Gumbel noise reaches 46: the largest is -log(2^-65) = 45.05 (x = 2^64 - 1).
constexpr int kMaxNoiseStep = 46;

// A 32-bit integer mix (reference.py's hash32). A bijection of 32-bit words.
TORCHKVOPS_HOST_DEVICE_INLINE uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x68E31DA5u;
  x ^= x >> 16;
  return x;
}

// The per-(row, step) part of the hash: a bijection of (low 32 bits of key, low 32 bits of step), as
// in Python.
struct NoiseKey {
  uint32_t high;  // feeds every token's high word
  uint32_t low;   // feeds the low words
};

TORCHKVOPS_HOST_DEVICE_INLINE NoiseKey noise_key(int64_t key, int64_t step) {
  const uint32_t s = static_cast<uint32_t>(step);
  const uint32_t high = hash32(static_cast<uint32_t>(key) ^ hash32(s + kStepSalt));
  return {high, hash32(s ^ hash32(high + kLowSalt))};
}

// The high 32 bits of a token's word (its index's low 32 bits): all the hot loops compute (see
// cannot_beat). Both halves of the row's key enter it, so that two tokens' words are not tied to each
// other through 32 bits of row key: given one token's high word, another's still varies with k.low.
TORCHKVOPS_HOST_DEVICE_INLINE uint32_t noise_high(NoiseKey k, uint32_t token) {
  return hash32(k.high ^ hash32((token + kTokenSalt) ^ k.low));
}

// The Gumbel noise of the word (high, low = hash32(k.low ^ high)), in float32 as the reference
// computes it: in [-3.81, 45.06].
TORCHKVOPS_HOST_DEVICE_INLINE float gumbel(NoiseKey k, uint32_t high) {
  const uint32_t low = hash32(k.low ^ high);
  const bool upper = (high >> 31) != 0;  // u > 1/2: take the complement 1 - u
  const uint32_t yh = upper ? ~high : high, yl = upper ? ~low : low;
  // v = (y + 1/2) 2^-64 to float32: yh < 2^31 so the product is exact, and the scaling by 2^-64 too.
  // Each product and sum rounded on its own (mul_rn / add_rn: no fused multiply-add), as the reference.
  const float v = dmath::mul_rn(dmath::add_rn(dmath::mul_rn(dmath::u32_to_float(yh), 4294967296.0f),
                                              dmath::add_rn(dmath::u32_to_float(yl), 0.5f)),
                                5.42101086242752217e-20f);         // 2^-64
  const float e = upper ? -dmath::log1p_f(-v) : -dmath::log_f(v);  // -log(u), in [2^-65, 45.05]
  return -dmath::log_f(e);
}

// An unsigned key with the order of the float values: k(a) < k(b) iff a < b, for all non-NaN values.
// -0.0 and +0.0 get the same key (they compare equal); every NaN gets the largest key. Branch-free,
// so that the CPU loops over a row vectorize.
TORCHKVOPS_HOST_DEVICE_INLINE uint32_t order_key(float v) {
  uint32_t bits = dmath::float_bits(v);
  bits = bits == 0x80000000u ? 0u : bits;                          // -0.0 -> +0.0
  const uint32_t flip = (bits >> 31) ? 0xFFFFFFFFu : 0x80000000u;  // negative: reverse the order
  return v != v ? 0xFFFFFFFFu : bits ^ flip;
}

// Skipping the noise of tokens that cannot win, from the high word alone. A token D below the best
// score so far needs noise g >= D, i.e. a complement 1 - u <= 1 - exp(-exp(-D)) (about e^-D): a high
// word below 2^32 (1 - that) rules it out, and most tokens fail on that integer comparison alone; their
// low word and their logs are never computed. noise_reach_threshold(D), D = 0..46, is the largest
// high word for which 1 - u >= (2^32 - 1 - high) 2^-32 >= 1 - exp(-exp(-(D - 0.01))): the exact noise
// is then at most D - 0.01, and the computed one (float32 logs, errors ~1e-6) below D. From D = 23 on
// only high = 2^32 - 1 can reach; no word reaches D = 46.
constexpr int kNoiseSteps = kMaxNoiseStep + 1;

TORCHKVOPS_HOST_DEVICE_INLINE uint32_t noise_reach_threshold(int d) {
  const double c = -expm1(-exp(-(static_cast<double>(d) - 0.01)));  // the complement a win needs
  if (c <= 0x1p-65) return 0xFFFFFFFFu;                             // below the smallest complement, (0 + 1/2) 2^-64
  return static_cast<uint32_t>(4294967295.0 - ceil(c * 4294967296.0));
}

// noise_reach_threshold(0 .. kMaxNoiseStep), computed once: the table the CPU kernels read (the CUDA
// kernel fills one in shared memory per block).
inline const uint32_t* host_noise_reach() {
  static const auto table = [] {
    std::array<uint32_t, kNoiseSteps> t{};
    for (int d = 0; d < kNoiseSteps; ++d) t[d] = noise_reach_threshold(d);
    return t;
  }();
  return table.data();
}

// True when a kept token (scaled logit l, high word `high`) certainly does not beat `best`, the score
// of a token with a lower index: with D a whole number <= 46 and <= best - l (exactly: the rounded
// gap, shrunk by 2^-23, is below the exact one), and high <= reach[D], the computed noise is below D,
// so l + g < best exactly and fl(l + g) <= best (rounding is monotone); a tie goes to the lower index.
// False whenever l, best or the gap is NaN.
TORCHKVOPS_HOST_DEVICE_INLINE bool cannot_beat(float l, uint32_t high, float best, const uint32_t* reach) {
  const float gap = (best - l) * 0.99999988079071044921875f;  // 1 - 2^-23, exact
  if (!(gap >= 0.0f)) return false;                           // l > best, or NaN
  const int d = gap >= static_cast<float>(kMaxNoiseStep) ? kMaxNoiseStep : static_cast<int>(gap);
  return high <= reach[d];
}

// An upper bound on the noise of every word with this high half, branch-free (CPU loops vectorize
// it): 1 - u >= c = (~high) 2^-32, and g = -log(-log u) <= -log(1 - u) <= -log c <= ln 2 (32 - E)
// for any E <= floor(log2(~high)), such as the exponent of float(~high >> 1) (the conversion may
// round up to the next power of two, which is still at most ~high). ~high < 2 gives E = -127 and a
// bound of 110 > 45.06. The 0.01 covers the float32 rounding of the noise and of the bound. It is
// looser than noise_reach_threshold's (by < 1.4) but needs no table.
TORCHKVOPS_HOST_DEVICE_INLINE float noise_bound(uint32_t high) {
  const float f = static_cast<float>(static_cast<int32_t>(~high >> 1));
  const int32_t exponent = static_cast<int32_t>(dmath::float_bits(f) >> 23) - 127;  // f >= 0: no sign bit
  return dmath::add_rn(dmath::mul_rn(0.6931471805599453f, static_cast<float>(32 - exponent)), 0.01f);
}

// The fixed-point mass of a token d = l - max below the row's maximum (d <= 0).
TORCHKVOPS_HOST_DEVICE_INLINE uint64_t fixed_mass(float d) {
  if (!(d >= kMassCutoff)) return 0;  // also NaN
  const float m = dmath::exp_f(d);
  // m * 2^40 is exact in float; the conversion truncates. m > 1 only with NaN or inf logits.
  return m <= 1.0f ? static_cast<uint64_t>(m * 1099511627776.0f) : (uint64_t{1} << kMassFracBits);
}

// The number of top-mass units the top-p threshold must reach: ceil(top_p * total), at least 1 (the
// most likely token always stays) and at most total. top_p is the float32 value the reference compares
// against.
TORCHKVOPS_HOST_DEVICE_INLINE uint64_t top_p_target(float top_p, uint64_t total) {
  const double t = ceil(static_cast<double>(top_p) * static_cast<double>(total));
  if (!(t >= 1.0)) return 1;
  if (t >= static_cast<double>(total)) return total;
  return static_cast<uint64_t>(t);
}

// True when (score a, index ia) beats (score b, index ib) under torch.argmax's rules: NaN is the
// largest value, and the lower index wins a tie.
TORCHKVOPS_HOST_DEVICE_INLINE bool beats(float a, int64_t ia, float b, int64_t ib) {
  if (a != a) return b == b || ia < ib;
  if (b != b) return false;
  return a > b || (a == b && ia < ib);
}

// The best (score, token) of a draw so far, under torch.argmax's rules. A token index fits an int
// (vocab <= kMaxVocab = 2^23).
struct ArgBest {
  float score;
  int token;
};

// The winner of two partial draws (an associative, commutative choice: the result does not depend on
// the order in which partial draws are combined).
TORCHKVOPS_HOST_DEVICE_INLINE ArgBest better(const ArgBest& a, const ArgBest& b) {
  return beats(b.score, b.token, a.score, a.token) ? b : a;
}

// The draw of one kept token (scaled logit l, its word's high half): pruned when it cannot beat the
// best so far (cannot_beat, from the high word alone), else scored l + g (gumbel; one rounding, no
// fused add) and compared (beats). `best` must hold tokens of lower index only (a kernel offers its
// tokens in increasing order; partial draws are then combined with `better`).
TORCHKVOPS_HOST_DEVICE_INLINE void offer_token(ArgBest& best, NoiseKey k, const uint32_t* reach, int token, float l,
                                               uint32_t high) {
  if (cannot_beat(l, high, best.score, reach)) return;
  const float score = dmath::add_rn(l, gumbel(k, high));
  if (beats(score, token, best.score, best.token)) best = {score, token};
}

// Radix selection's rule for the digit that holds a threshold. `above`: the weight of the candidates
// whose higher digits rank above the prefix chosen so far; at_or_above = S[d] and strictly_above =
// S[d + 1], with S[d] the weight of the candidates that share the prefix and have a digit >= d. Digit d
// holds the threshold when above + S[d] >= target > above + S[d + 1]: S falls as d grows, so at most
// one digit qualifies, and exactly one when target <= above + S[0] (exact integer sums).
TORCHKVOPS_HOST_DEVICE_INLINE bool digit_qualifies(uint64_t above, uint64_t at_or_above, uint64_t strictly_above,
                                                   uint64_t target) {
  return above + at_or_above >= target && above + strictly_above < target;
}

// The log-probability of a drawn token with scaled logit l: log_softmax over the kept tokens, l - max -
// log(sum of exp(l' - max) over the kept l'). `Sum` is the type the kernel summed in (double on the
// CPU, float on CUDA); the result is rounded to float32 once. NaN when the kept values hold a NaN or
// their maximum is infinite (+inf, or -inf: nothing finite is kept), as torch's log_softmax gives.
template <typename Sum>
TORCHKVOPS_HOST_DEVICE_INLINE float sampled_log_prob(float l, float max, Sum sum, bool has_nan) {
  if (has_nan || !dmath::is_finite(max)) return dmath::nan_f();
  return static_cast<float>(static_cast<Sum>(l - max) - dmath::log_f(sum));
}

// Greedy's: log_softmax(raw logits)[argmax] = 0 - log(sum of exp(x - max)), `max` the argmax's value
// (NaN when the row holds one: NaN wins the argmax). NaN unless max is finite.
template <typename Sum>
TORCHKVOPS_HOST_DEVICE_INLINE float greedy_log_prob(float max, Sum sum) {
  if (!dmath::is_finite(max)) return dmath::nan_f();
  return static_cast<float>(static_cast<Sum>(0) - dmath::log_f(sum));
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

// A float argument as Python's repr writes it (the shortest text that reads back as the same double),
// so that an error shows the value as given: 1.0000001, not 1.
inline std::string repr_double(double v) {
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  std::string text(buf, ec == std::errc() ? end : buf);
  if (text.find_first_of(".en") == std::string::npos) text += ".0";  // 1 -> 1.0 (not 1e+16, nan, inf)
  return text;
}

// Elements between two rows' steps: 0 for one step shared by every row.
inline int64_t step_stride(const at::Tensor& step) { return step.numel() == 1 ? 0 : step.stride(0); }

inline void check_sample_args(const at::Tensor& logits, const at::Tensor& keys, const at::Tensor& step,
                              double temperature, int64_t top_k, double top_p, const char* op = "sample_tokens") {
  TORCH_CHECK_VALUE(logits.dim() == 2, op, ": logits must be 2-D [rows, vocab], got shape ", logits.sizes());
  const auto dtype = logits.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
                   ": logits must be float32, float16 or bfloat16, got ", dtype);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK_VALUE(rows == 0 || vocab >= 1, op, ": logits must have vocab >= 1 (dim 1), got shape ", logits.sizes());
  TORCH_CHECK_VALUE(vocab <= sampling::kMaxVocab, op, ": logits' vocab (dim 1) must be <= ", sampling::kMaxVocab,
                    ", got ", vocab);
  TORCH_CHECK_TYPE(keys.scalar_type() == at::kLong, op, ": keys must be int64, got ", keys.scalar_type());
  TORCH_CHECK_VALUE(keys.dim() == 1 && keys.size(0) == rows, op, ": keys must be 1-D with one key per row (", rows,
                    "), got shape ", keys.sizes());
  TORCH_CHECK_VALUE(keys.device() == logits.device(), op, ": keys must be on logits' device ", logits.device(),
                    ", got ", keys.device());
  TORCH_CHECK_TYPE(step.scalar_type() == at::kLong, op,
                   ": step must be an int64 tensor (1 element, or 1-D with one step per row), got ",
                   step.scalar_type());
  TORCH_CHECK_VALUE(step.numel() == 1 || (step.dim() == 1 && step.size(0) == rows), op,
                    ": step must be a 1-element int64 tensor or 1-D with one step per row (", rows, "), got shape ",
                    step.sizes());
  TORCH_CHECK_VALUE(step.device() == logits.device(), op, ": step must be on logits' device ", logits.device(),
                    ", got ", step.device());
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature >= 0.0, op,
                    ": temperature must be finite and >= 0 (0 = greedy), got ", repr_double(temperature));
  TORCH_CHECK_VALUE(top_k >= 0, op, ": top_k must be >= 0 (0 = off), got ", top_k);
  TORCH_CHECK_VALUE(top_p > 0.0 && top_p <= 1.0, op, ": top_p must be in (0, 1] (1 = off), got ", repr_double(top_p));
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
