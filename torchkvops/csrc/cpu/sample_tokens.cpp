// CPU kernel of sample_tokens: rows in parallel (at::parallel_for), each row sampled by one thread.
// Greedy and temperature-only rows take one pass over the logits. With top-k or top-p the row's
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
  std::vector<float> values;         // the row's l, [vocab]
  std::vector<Candidate> bucket;     // the candidates that share the digits chosen so far
};

// Walks the digits from the largest down, adding each bucket's weight to `above` until the
// candidates at or above the bucket reach `target`; returns that bucket. `above` ends as the
// weight of the buckets above it.
int walk_digits(const uint64_t* hist, uint64_t target, uint64_t& above) {
  int d = 255;
  while (d > 0 && above + hist[d] < target) above += hist[d--];
  return d;
}

// The largest key t such that the tokens with key >= t (among those with key >= lower) weigh at
// least target_of(their total weight): the threshold's key, found 8 bits at a time.
template <typename WeightFn, typename TargetFn>
uint32_t select_threshold(const float* values, int64_t vocab, uint32_t lower, WeightFn weight,
                          TargetFn target_of, std::vector<Candidate>& bucket) {
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

// noise_reach_threshold(0..17), computed once.
const float* noise_reach() {
  static const auto table = [] {
    std::array<float, kNoiseSteps> t{};
    for (int d = 0; d < kNoiseSteps; ++d) t[d] = noise_reach_threshold(d);
    return t;
  }();
  return table.data();
}

// The running Gumbel-max draw of one row. Tokens must be offered in increasing index order.
class Draw {
 public:
  explicit Draw(uint32_t step_key) : step_key_(step_key), reach_(noise_reach()) {}

  void offer(int64_t token, float l, bool kept) {
    const float u = uniform(step_key_, token);
    // u == 1 gives infinite noise: that token scores +inf (or NaN when not kept) and must be seen.
    if (u < 1.0f && (!kept || cannot_beat(l, u, best_, reach_))) return;
    const float score = (kept ? l : -kInf) + gumbel(u);
    if (beats(score, token, best_, best_token_)) {
      best_ = score;
      best_token_ = token;
    }
  }

  int64_t token() const { return best_token_; }

 private:
  uint32_t step_key_;
  const float* reach_;
  // Every token scores at least -inf, so (-inf, 0) is what argmax returns when nothing beats it.
  float best_ = -kInf;
  int64_t best_token_ = 0;
};

template <typename scalar_t>
int64_t sample_row(const scalar_t* row, int64_t col_stride, int64_t vocab, int64_t key, int64_t step,
                   const SampleParams& p, Scratch& scratch) {
  auto logit = [&](int64_t i) { return static_cast<float>(row[i * col_stride]); };
  if (p.greedy) {
    float best = -kInf;
    int64_t best_i = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      const float v = logit(i);
      if (beats(v, i, best, best_i)) {
        best = v;
        best_i = i;
      }
    }
    return best_i;
  }

  Draw draw(step_key(key, step));
  if (p.top_k == 0 && !p.use_top_p) {
    for (int64_t i = 0; i < vocab; ++i) draw.offer(i, logit(i) / p.temperature, true);
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
  for (int64_t i = 0; i < vocab; ++i) max_value = values[i] > max_value ? values[i] : max_value;  // skips NaN
  uint32_t threshold = 0;  // keep the tokens with order_key(l) >= threshold
  if (p.top_k > 0) {
    threshold = select_threshold(
        values, vocab, 0, [](float) { return uint64_t{1}; },
        [&](uint64_t) { return static_cast<uint64_t>(p.top_k); }, scratch.bucket);
  }
  // With an infinite maximum the masses are undefined (the reference's softmax gives NaN and drops
  // nothing): keep what top-k kept.
  if (p.use_top_p && std::isfinite(max_value)) {
    threshold = select_threshold(
        values, vocab, threshold, [&](float l) { return fixed_mass(l - max_value); },
        [&](uint64_t total) { return top_p_target(p.top_p, total); }, scratch.bucket);
  }
  for (int64_t i = 0; i < vocab; ++i) draw.offer(i, values[i], order_key(values[i]) >= threshold);
  return draw.token();
}

at::Tensor sample_tokens_cpu(const at::Tensor& logits, const at::Tensor& keys, const at::Tensor& step,
                             double temperature, int64_t top_k, double top_p) {
  check_sample_args(logits, keys, step, temperature, top_k, top_p);
  TORCH_INTERNAL_ASSERT(logits.device().is_cpu());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  if (rows == 0) return out;
  const SampleParams params = make_sample_params(vocab, temperature, top_k, top_p);
  const int64_t step_value = step.data_ptr<int64_t>()[0];
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
        out_ptr[r] = sample_row(base + r * row_stride, col_stride, vocab, key_ptr[r * key_stride], step_value,
                                params, scratch);
      }
    });
  }), at::kFloat, at::kHalf, at::kBFloat16);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CPU, m) {
  m.impl("sample_tokens", &sample_tokens_cpu);
}

}  // namespace torchkvops
