// CPU kernels of sample_tokens and sample_tokens_with_logprobs: rows in parallel (at::parallel_for),
// each row sampled by one thread. Temperature-only rows take one pass over the logits, greedy rows a
// vectorized max and a scan to the first maximum (and each one more pass for the log-probability's
// maximum or sum). With top-k or top-p the row's
// scaled logits go to a per-thread scratch buffer once, each threshold is found by radix selection
// (one pass over the row for the first digit, the other three over the shrinking bucket that holds
// the threshold), and a last pass draws the token. What a row computes: see sample_tokens.h.
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "../sample_tokens.h"

namespace torchkvops {
namespace {

using namespace sampling;

constexpr float kInf = std::numeric_limits<float>::infinity();
// Each parallel task samples rows holding at least this many logits, so that small calls run on the
// calling thread instead of paying for waking the others.
constexpr int64_t kMinLogitsPerTask = 64 * 1024;

struct Candidate {
  uint32_t key;     // order_key of the token's l
  uint64_t weight;  // 1 (top-k) or its fixed-point mass (top-p)
};

// Per-thread buffers, reused across the rows of one parallel task.
struct Scratch {
  std::vector<float> values;      // the row's l, [vocab]
  std::vector<Candidate> bucket;  // the candidates that share the digits chosen so far
};

// Walks the digits from the largest down, summing the buckets' weights, to the digit that
// digit_qualifies (the CUDA kernel's rule, tested there for all 256 digits at once); returns it, and
// adds to `above` the weight of the buckets above it. Digit 0 when none qualifies (the target exceeds
// every weight left: see sample_tokens_row.h's select_threshold).
int walk_digits(const uint64_t* hist, uint64_t target, uint64_t& above) {
  uint64_t strictly_above = 0;  // S[d + 1]: the weight of the buckets above d
  for (int d = 255; d > 0; --d) {
    const uint64_t at_or_above = strictly_above + hist[d];
    if (digit_qualifies(above, at_or_above, strictly_above, target)) {
      above += strictly_above;
      return d;
    }
    strictly_above = at_or_above;
  }
  above += strictly_above;
  return 0;
}

// The largest key t such that the tokens with key >= t (among those with key >= lower) weigh at
// least target_of(their total weight): the threshold's key, found 8 bits at a time.
template <typename WeightFn, typename TargetFn>
uint32_t select_threshold(const float* values, int64_t vocab, uint32_t lower, WeightFn weight, TargetFn target_of,
                          std::vector<Candidate>& bucket) {
  // Four interleaved histograms: most tokens fall in a few bins (sign and exponent), and increments
  // of one bin in consecutive iterations would wait on each other through memory.
  uint64_t hists[4][256] = {};
  for (int64_t i = 0; i < vocab; ++i) {
    const uint32_t key = order_key(values[i]);
    if (key >= lower) hists[i & 3][key >> 24] += weight(values[i]);
  }
  uint64_t hist[256];
  uint64_t total = 0;
  for (int d = 0; d < 256; ++d) {
    hist[d] = hists[0][d] + hists[1][d] + hists[2][d] + hists[3][d];
    total += hist[d];
  }
  const uint64_t target = target_of(total);
  uint64_t above = 0;
  const uint32_t top = static_cast<uint32_t>(walk_digits(hist, target, above));
  uint32_t prefix = top << 24;

  bucket.clear();
  for (int64_t i = 0; i < vocab; ++i) {
    const uint32_t key = order_key(values[i]);
    if (key < lower || (key >> 24) != top) continue;
    const uint64_t w = weight(values[i]);
    if (w != 0) bucket.push_back({key, w});  // weightless candidates change no sum
  }
  for (int shift = 16; shift >= 0; shift -= 8) {
    std::fill(std::begin(hist), std::end(hist), uint64_t{0});
    for (const Candidate& c : bucket) hist[(c.key >> shift) & 0xFF] += c.weight;
    const uint32_t d = static_cast<uint32_t>(walk_digits(hist, target, above));
    prefix |= d << shift;
    if (shift > 0) {
      bucket.erase(std::remove_if(bucket.begin(), bucket.end(),
                                  [&](const Candidate& c) { return ((c.key >> shift) & 0xFF) != d; }),
                   bucket.end());
    }
  }
  return prefix;
}

// Tokens are drawn in blocks: the scaled logits, high words and candidate flags of a whole block are
// computed by loops the compiler vectorizes, and only the candidates go through the exact test.
constexpr int kDrawBlock = 256;

// The running Gumbel-max draw of one row. Blocks must be offered in increasing token order.
class Draw {
 public:
  explicit Draw(NoiseKey key) : key_(key), reach_(host_noise_reach()) {}

  // Offers tokens first .. first + n - 1 (n <= kDrawBlock) with scaled logits l[0 .. n). With
  // kMasked, kept[j] says whether top-k / top-p kept token first + j (num_kept of them): a dropped
  // token scores -inf + g = -inf, which never beats the (-inf, 0) start or a lower index: skipped.
  // A token is a candidate unless noise_bound rules it out against the best score at the block's
  // start (the best only grows, so that stays true); candidates take the exact test.
  template <bool kMasked>
  void offer_block(int64_t first, const float* l, const uint8_t* kept, int n, int num_kept = 0) {
    const uint32_t first_token = static_cast<uint32_t>(first);
    if (kMasked) {
      if (4 * num_kept < n) {  // cheaper to hash the few kept tokens one by one
        for (int j = 0; j < n; ++j) {
          if (kept[j]) offer(first + j, l[j], noise_high(key_, first_token + static_cast<uint32_t>(j)));
        }
        return;
      }
    }
    uint32_t high[kDrawBlock];
    uint8_t candidate[kDrawBlock + 8] = {};  // read 8 at a time, past n as zeros
    const float best = best_.score;
    for (int j = 0; j < n; ++j) {
      const uint32_t h = noise_high(key_, first_token + static_cast<uint32_t>(j));
      high[j] = h;
      // (best - l) shrunk by 2^-23 is at most the exact gap (see cannot_beat); NaN: a candidate.
      uint8_t c = !((best - l[j]) * 0.99999988079071044921875f >= noise_bound(h));
      if (kMasked) c &= kept[j];
      candidate[j] = c;
    }
    for (int j0 = 0; j0 < n; j0 += 8) {  // 8 flags at a time: nearly all are 0
      uint64_t flags;
      __builtin_memcpy(&flags, candidate + j0, sizeof(flags));
      if (flags == 0) continue;
      for (int j = j0; j < std::min(j0 + 8, n); ++j) {
        if (candidate[j]) offer(first + j, l[j], high[j]);
      }
    }
  }

  int64_t token() const { return best_.token; }

 private:
  C10_ALWAYS_INLINE void offer(int64_t token, float l, uint32_t high) {
    offer_token(best_, key_, reach_, static_cast<int>(token), l, high);
  }

  NoiseKey key_;
  const uint32_t* reach_;
  // Every token scores at least -inf, so (-inf, 0) is what argmax returns when nothing beats it.
  ArgBest best_{-kInf, 0};
};

// Greedy works on the logits' raw bits, in their own width (no conversion to float, which float16
// does not vectorize): a sign-magnitude float becomes a signed integer with the same order (-0.0 and
// +0.0 both 0), and integer maxima vectorize where float ones would not.
template <typename scalar_t>
struct RawFloat;
template <>
struct RawFloat<float> {
  using Bits = uint32_t;
  using Key = int32_t;
  static constexpr Bits kInfBits = 0x7F800000u;
};
template <>
struct RawFloat<c10::Half> {
  using Bits = uint16_t;
  using Key = int16_t;
  static constexpr Bits kInfBits = 0x7C00u;
};
template <>
struct RawFloat<c10::BFloat16> {
  using Bits = uint16_t;
  using Key = int16_t;
  static constexpr Bits kInfBits = 0x7F80u;
};

template <typename scalar_t>
struct RawOrder {
  using Bits = typename RawFloat<scalar_t>::Bits;
  using Key = typename RawFloat<scalar_t>::Key;
  static constexpr int kSignShift = 8 * sizeof(Bits) - 1;
  static constexpr Bits kAbs = static_cast<Bits>(~(Bits{1} << kSignShift));

  static Bits bits(const scalar_t& v) {
    Bits b;
    __builtin_memcpy(&b, &v, sizeof(b));
    return b;
  }
  static Key key(Bits b) {  // NaNs get keys beyond the infinities': callers test is_nan apart
    const Key magnitude = static_cast<Key>(b & kAbs);
    return (b >> kSignShift) ? static_cast<Key>(-magnitude) : magnitude;
  }
  static bool is_nan(Bits b) { return (b & kAbs) > RawFloat<scalar_t>::kInfBits; }
};

// The first index of a contiguous row whose raw bits satisfy `hit`: blocks of 16 tested at once (a
// loop the compiler vectorizes), then the block that holds it one by one. `vocab` if none does.
template <typename scalar_t, typename HitFn>
int64_t find_first(const scalar_t* row, int64_t vocab, HitFn hit) {
  using R = RawOrder<scalar_t>;
  constexpr int kBlock = 16;
  int64_t i = 0;
  for (; i + kBlock <= vocab; i += kBlock) {
    int any = 0;
    for (int j = 0; j < kBlock; ++j) any |= hit(R::bits(row[i + j]));
    if (any) break;
  }
  for (; i < vocab; ++i) {
    if (hit(R::bits(row[i]))) return i;
  }
  return vocab;
}

// The largest value of a row (NaN aside) and whether it holds a NaN.
struct RowMax {
  float value;
  bool has_nan;
};

// A contiguous row: one vectorized loop over the raw keys; `key` gets the largest key.
template <typename scalar_t>
RowMax contiguous_row_max(const scalar_t* row, int64_t vocab, typename RawOrder<scalar_t>::Key& key) {
  using R = RawOrder<scalar_t>;
  using Key = typename R::Key;
  Key best = std::numeric_limits<Key>::min();
  int has_nan = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    const auto b = R::bits(row[i]);
    const Key k = R::key(b);
    best = k > best ? k : best;  // a NaN's key may win here: has_nan says to ignore it
    has_nan |= R::is_nan(b);
  }
  key = best;
  // The value back from its key (an involution on the magnitude, the sign apart).
  using Bits = typename R::Bits;
  const Bits bits =
      best < 0 ? static_cast<Bits>(static_cast<Bits>(-best) | (Bits{1} << R::kSignShift)) : static_cast<Bits>(best);
  scalar_t v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return {static_cast<float>(v), has_nan != 0};
}

template <typename scalar_t>
RowMax row_max(const scalar_t* row, int64_t col_stride, int64_t vocab) {
  if (col_stride == 1) {
    typename RawOrder<scalar_t>::Key key;
    return contiguous_row_max(row, vocab, key);
  }
  float best = -kInf;
  bool has_nan = false;
  for (int64_t i = 0; i < vocab; ++i) {
    const float v = static_cast<float>(row[i * col_stride]);
    best = v > best ? v : best;
    has_nan |= v != v;
  }
  return {best, has_nan};
}

// Greedy, under torch.argmax's rules (the first index of the largest value, NaN above everything).
// A contiguous row takes two vectorized loops: the largest key (and whether a NaN is present), then
// the first index holding it, which stops early.
template <typename scalar_t>
int64_t argmax_row(const scalar_t* row, int64_t col_stride, int64_t vocab) {
  if (col_stride != 1) {
    float best = -kInf;
    int64_t best_i = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      const float v = static_cast<float>(row[i * col_stride]);
      if (beats(v, i, best, best_i)) {
        best = v;
        best_i = i;
      }
    }
    return best_i;
  }
  using R = RawOrder<scalar_t>;
  typename R::Key best;
  if (contiguous_row_max(row, vocab, best).has_nan) return find_first(row, vocab, [](auto b) { return R::is_nan(b); });
  return find_first(row, vocab, [best](auto b) { return R::key(b) == best; });
}

// exp(x) in float32 for x <= 0 (about 1 ulp; 0 below -87, where float32 would go subnormal), without
// branches or library calls, so that loops over it vectorize: x = n ln 2 + r, |r| <= ln 2 / 2, and
// Cephes' expf polynomial for e^r scaled by 2^n. NaN in, unspecified out: callers flag NaN apart.
inline float exp_nonpositive(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2); 1.5 * 2^23
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;            // ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.0f;
  const int32_t scale_bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float scale;
  __builtin_memcpy(&scale, &scale_bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// Sum of exp(l - max) over a row's kept tokens, block by block: float lanes that the compiler
// vectorizes (a plain float sum would not be, its order being fixed), added up in double per block.
class ExpSum {
 public:
  explicit ExpSum(float max) : max_(max) {}

  // l[0 .. n) (n <= kDrawBlock); with kMasked only the tokens with kept[j].
  template <bool kMasked>
  void add_block(const float* l, const uint8_t* kept, int n) {
    constexpr int kLanes = 16;
    float lanes[kLanes] = {};
    int j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const float e = exp_nonpositive(l[j + k] - max_);
        lanes[k] += (!kMasked || kept[j + k]) ? e : 0.0f;
      }
    }
    double total = 0.0;
    for (; j < n; ++j) {
      if (!kMasked || kept[j]) total += exp_nonpositive(l[j] - max_);
    }
    for (int k = 0; k < kLanes; ++k) total += lanes[k];
    sum_ += total;
  }

  void add(float l) { sum_ += exp_nonpositive(l - max_); }

  // log_softmax of a kept token: l - max - log(sum), NaN rules and all, by the CUDA kernel's finish
  // (sample_tokens.h), from a double sum.
  float log_prob(float l, bool has_nan) const { return sampled_log_prob(l, max_, sum_, has_nan); }

  // Greedy's, max being the argmax's value: -log(sum).
  float greedy_log_prob() const { return sampling::greedy_log_prob(max_, sum_); }

 private:
  float max_;
  double sum_ = 0.0;
};

// Greedy with its log-probability: log_softmax(raw logits)[token] = -log(sum of exp(x - max)), one
// more pass over the row. The argmax's value is the row's maximum, and a NaN exactly when the row holds
// one (NaN wins the argmax), as the CUDA kernel takes it too.
template <typename scalar_t>
int64_t greedy_row(const scalar_t* row, int64_t col_stride, int64_t vocab, float* log_prob) {
  const int64_t token = argmax_row(row, col_stride, vocab);
  if (log_prob == nullptr) return token;
  const float top = static_cast<float>(row[token * col_stride]);
  ExpSum sum(top);
  float x[kDrawBlock];
  for (int64_t first = 0; first < vocab; first += kDrawBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kDrawBlock, vocab - first));
    for (int j = 0; j < n; ++j) x[j] = static_cast<float>(row[(first + j) * col_stride]);
    sum.add_block<false>(x, nullptr, n);
  }
  *log_prob = sum.greedy_log_prob();
  return token;
}

// One row: the drawn token, and with log_prob != nullptr its log-probability under the distribution
// it was drawn from (see sample_tokens.h).
template <typename scalar_t>
int64_t sample_row(const scalar_t* row, int64_t col_stride, int64_t vocab, int64_t key, int64_t step,
                   const SampleParams& p, Scratch& scratch, float* log_prob) {
  auto logit = [&](int64_t i) { return static_cast<float>(row[i * col_stride]); };
  if (p.greedy) return greedy_row(row, col_stride, vocab, log_prob);

  Draw draw(noise_key(key, step));
  if (p.top_k == 0 && !p.use_top_p) {
    // With log_prob: the largest l first (one more pass; l = x / T is monotone in x, so it is the
    // largest x divided), then the sum rides along with the draw.
    const RowMax m = log_prob ? row_max(row, col_stride, vocab) : RowMax{0.0f, false};
    ExpSum sum(m.value / p.temperature);
    float l[kDrawBlock];
    for (int64_t first = 0; first < vocab; first += kDrawBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kDrawBlock, vocab - first));
      if (col_stride == 1) {  // a loop the compiler vectorizes
        for (int j = 0; j < n; ++j) l[j] = static_cast<float>(row[first + j]) / p.temperature;
      } else {
        for (int j = 0; j < n; ++j) l[j] = logit(first + j) / p.temperature;
      }
      draw.offer_block<false>(first, l, nullptr, n);
      if (log_prob) sum.add_block<false>(l, nullptr, n);
    }
    if (log_prob) *log_prob = sum.log_prob(logit(draw.token()) / p.temperature, m.has_nan);
    return draw.token();
  }

  scratch.values.resize(vocab);
  float* values = scratch.values.data();
  if (col_stride == 1) {  // a loop the compiler vectorizes
    for (int64_t i = 0; i < vocab; ++i) values[i] = static_cast<float>(row[i]) / p.temperature;
  } else {
    for (int64_t i = 0; i < vocab; ++i) values[i] = logit(i) / p.temperature;
  }
  float max_value = -kInf;
  bool has_nan = false;
  for (int64_t i = 0; i < vocab; ++i) {
    max_value = values[i] > max_value ? values[i] : max_value;  // skips NaN
    has_nan |= values[i] != values[i];
  }
  uint32_t threshold = 0;  // keep the tokens with order_key(l) >= threshold
  if (p.top_k > 0) {
    threshold = select_threshold(
        values, vocab, 0, [](float) { return uint64_t{1}; }, [&](uint64_t) { return static_cast<uint64_t>(p.top_k); },
        scratch.bucket);
  }
  // With an infinite maximum the masses are undefined (the reference's softmax gives NaN and drops
  // nothing): keep what top-k kept.
  if (p.use_top_p && std::isfinite(max_value)) {
    threshold = select_threshold(
        values, vocab, threshold, [&](float l) { return fixed_mass(l - max_value); },
        [&](uint64_t total) { return top_p_target(p.top_p, total); }, scratch.bucket);
  }
  // The largest value is always kept (top-k keeps >= 1 token, top-p the most likely), and a NaN too
  // (its key is the largest): the kept tokens' maximum and NaN flag are the row's.
  ExpSum sum(max_value);
  uint8_t kept[kDrawBlock];
  for (int64_t first = 0; first < vocab; first += kDrawBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kDrawBlock, vocab - first));
    int num_kept = 0;
    for (int j = 0; j < n; ++j) {
      kept[j] = order_key(values[first + j]) >= threshold;
      num_kept += kept[j];
    }
    draw.offer_block<true>(first, values + first, kept, n, num_kept);
    if (!log_prob || num_kept == 0) continue;
    if (4 * num_kept < n) {
      for (int j = 0; j < n; ++j) {
        if (kept[j]) sum.add(values[first + j]);
      }
    } else {
      sum.add_block<true>(values + first, kept, n);
    }
  }
  if (log_prob) *log_prob = sum.log_prob(values[draw.token()], has_nan);
  return draw.token();
}

// Both ops: `log_probs` is nullptr for sample_tokens.
void sample_rows(const at::Tensor& logits, const at::Tensor& keys, const at::Tensor& step, const SampleParams& params,
                 at::Tensor& out, float* log_probs) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0) return;
  const int64_t* step_ptr = step.data_ptr<int64_t>();
  const int64_t steps_stride = step_stride(step);
  const int64_t* key_ptr = keys.data_ptr<int64_t>();
  const int64_t key_stride = keys.stride(0);
  int64_t* out_ptr = out.data_ptr<int64_t>();
  const int64_t row_stride = logits.stride(0), col_stride = logits.stride(1);
  AT_DISPATCH_V2(logits.scalar_type(), "sample_tokens_cpu", AT_WRAP([&] {
                   const scalar_t* base = logits.data_ptr<scalar_t>();
                   const int64_t grain = std::max<int64_t>(1, kMinLogitsPerTask / vocab);
                   at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
                     Scratch scratch;
                     for (int64_t r = begin; r < end; ++r) {
                       out_ptr[r] =
                           sample_row(base + r * row_stride, col_stride, vocab, key_ptr[r * key_stride],
                                      step_ptr[r * steps_stride], params, scratch, log_probs ? log_probs + r : nullptr);
                     }
                   });
                 }),
                 at::kFloat, at::kHalf, at::kBFloat16);
}

at::Tensor sample_tokens_cpu(const at::Tensor& logits, const at::Tensor& keys, const at::Tensor& step,
                             double temperature, int64_t top_k, double top_p) {
  check_sample_args(logits, keys, step, temperature, top_k, top_p);
  TORCH_INTERNAL_ASSERT(logits.device().is_cpu());
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  sample_rows(logits, keys, step, make_sample_params(logits.size(1), temperature, top_k, top_p), out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> sample_tokens_with_logprobs_cpu(const at::Tensor& logits, const at::Tensor& keys,
                                                                   const at::Tensor& step, double temperature,
                                                                   int64_t top_k, double top_p) {
  check_sample_args(logits, keys, step, temperature, top_k, top_p, "sample_tokens_with_logprobs");
  TORCH_INTERNAL_ASSERT(logits.device().is_cpu());
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  at::Tensor log_probs = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  sample_rows(logits, keys, step, make_sample_params(logits.size(1), temperature, top_k, top_p), out,
              log_probs.data_ptr<float>());
  return {out, log_probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CPU, m) {
  m.impl("sample_tokens", &sample_tokens_cpu);
  m.impl("sample_tokens_with_logprobs", &sample_tokens_with_logprobs_cpu);
}

}  // namespace torchkvops
