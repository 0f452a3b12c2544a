// _sample_tokens_cuda_emulated: the CUDA sampler's row body (sample_tokens_row.h's `sample_row`, the
// code cuda/sample_tokens.cu runs) executed on the CPU over EmulatedBlock, a block policy that runs the
// 512 threads of a CUDA block one after another. It exists so that the CPU tests execute the CUDA
// kernel's per-row logic: its strided loops (the same vectorized / strided split of RowReader, by the
// same rule), its radix selection over 256-bin histograms and their suffix scans, its draw, its
// reductions in cub's order, and its log-probability finish in float. The temperature is applied as
// CUDA applies it (multiplication by the float32 reciprocal).
//
// What it computes is the GPU's result bit for bit, except where a value goes through the math
// library: CUDA's logf / log1pf / expf (and the double exp / expm1 of the noise reach table) may differ
// from glibc's in the last bit (device_math.h), which can flip a near-tie of the draw or move the
// log-probability by an ulp or so.
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <tuple>

#include "../sample_tokens.h"
#include "../sample_tokens_row.h"

namespace torchkvops {
namespace {

using namespace sampling;

// The block policy of sample_tokens_row.h, serially: each_thread runs thread 0, 1, ..., 511 in turn,
// and the block primitives combine their values afterwards. No barrier is needed: a primitive runs
// once every thread's value exists.
struct EmulatedBlock {
  static constexpr int kThreads = 512;  // cuda/sample_tokens.cu's block
  static constexpr int kWarp = 32;

  template <typename T>
  using PerThread = std::array<T, kThreads>;

  template <typename Fn>
  auto each_thread(Fn&& fn) -> PerThread<decltype(fn(0))> {
    PerThread<decltype(fn(0))> values;
    for (int t = 0; t < kThreads; ++t) values[t] = fn(t);
    return values;
  }

  template <typename T, typename Proj>
  ArgBest argbest(const PerThread<T>& v, Proj proj) {
    return reduce(v, proj, [](const ArgBest& a, const ArgBest& b) { return better(a, b); });
  }

  template <typename T, typename Proj>
  float max(const PerThread<T>& v, Proj proj) {
    return reduce(v, proj, [](float a, float b) { return max_of(a, b); });
  }

  template <typename T, typename Proj>
  float sum(const PerThread<T>& v, Proj proj) {
    return reduce(v, proj, [](float a, float b) { return a + b; });
  }

  template <typename T, typename Proj>
  bool any(const PerThread<T>& v, Proj proj) {
    bool result = false;
    for (int t = 0; t < kThreads; ++t) result |= static_cast<bool>(proj(v[t]));
    return result;
  }

  // Integer sums: the order of the adds (CUDA's atomics) does not matter.
  template <typename Fn>
  void histogram(Fn&& fn) {
    std::fill(std::begin(hist_), std::end(hist_), 0ull);
    auto add = [this](unsigned int bin, unsigned long long w) { hist_[bin] += w; };
    for (int t = 0; t < kThreads; ++t) fn(t, add);
  }

  void suffix_scan() {
    unsigned long long suffix = 0;
    for (int d = kBins - 1; d >= 0; --d) hist_[d] = suffix += hist_[d];
  }

  const unsigned long long* bins() const { return hist_; }

  // CUDA's thread d tests bin d; at most one qualifies, so the order of the tests does not matter.
  template <typename Fn>
  int select_bin(Fn&& qualifies) {
    int chosen = -1;
    for (int d = 0; d < kBins; ++d) {
      if (qualifies(d)) chosen = d;
    }
    return chosen;
  }

  const uint32_t* noise_reach() { return host_noise_reach(); }

 private:
  // cub::BlockReduce's order (BLOCK_REDUCE_WARP_REDUCTIONS, cub/block/specializations/
  // block_reduce_warp_reductions.cuh): in each warp of 32 a shuffle-down tree, lane l taking
  // op(its value, lane l + offset's) for offset 1, 2, 4, 8, 16 (warp_reduce_shfl.cuh); then thread 0
  // combines warp 0's result with warp 1's, 2's, ... in turn. For a float sum this fixes the rounding.
  template <typename T, typename Proj, typename Op>
  static auto reduce(const PerThread<T>& v, Proj proj, Op op) -> decltype(proj(v[0])) {
    using R = decltype(proj(v[0]));
    R total{};
    for (int w = 0; w < kThreads / kWarp; ++w) {
      std::array<R, kWarp> lanes;
      for (int l = 0; l < kWarp; ++l) lanes[l] = proj(v[w * kWarp + l]);
      for (int offset = 1; offset < kWarp; offset *= 2) {
        // Ascending lanes read lane l + offset before it is updated: the shuffle's simultaneous read.
        for (int l = 0; l + offset < kWarp; ++l) lanes[l] = op(lanes[l], lanes[l + offset]);
      }
      total = w == 0 ? lanes[0] : op(total, lanes[0]);
    }
    return total;
  }

  unsigned long long hist_[kBins];
};

std::tuple<at::Tensor, at::Tensor> sample_tokens_cuda_emulated_cpu(const at::Tensor& logits, const at::Tensor& keys,
                                                                   const at::Tensor& step, double temperature,
                                                                   int64_t top_k, double top_p, bool with_logprobs) {
  const char* op = "_sample_tokens_cuda_emulated";
  check_sample_args(logits, keys, step, temperature, top_k, top_p, op);
  TORCH_INTERNAL_ASSERT(logits.device().is_cpu());
  TORCH_CHECK_VALUE(logits.size(0) <= std::numeric_limits<int32_t>::max(), op, ": logits must have at most ",
                    std::numeric_limits<int32_t>::max(), " rows (one CUDA block each), got ", logits.size(0));
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor log_probs = at::empty({with_logprobs ? rows : 0}, logits.options().dtype(at::kFloat));
  if (rows == 0) return {out, log_probs};
  const SampleParams params = make_sample_params(vocab, temperature, top_k, top_p);
  const int64_t* key_ptr = keys.data_ptr<int64_t>();
  const int64_t* step_ptr = step.data_ptr<int64_t>();
  const int64_t key_stride = keys.stride(0), steps_stride = step_stride(step);
  int64_t* out_ptr = out.data_ptr<int64_t>();
  float* log_prob_ptr = with_logprobs ? log_probs.data_ptr<float>() : nullptr;
  const int64_t row_stride = logits.stride(0), col_stride = logits.stride(1);
  AT_DISPATCH_V2(logits.scalar_type(), "_sample_tokens_cuda_emulated", AT_WRAP([&] {
                   const scalar_t* base = logits.data_ptr<scalar_t>();
                   at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
                     EmulatedBlock block;
                     for (int64_t r = begin; r < end; ++r) {
                       const auto reader =
                           RowReader<scalar_t>::make(base + r * row_stride, col_stride, static_cast<int>(vocab));
                       const int64_t key = key_ptr[r * key_stride], row_step = step_ptr[r * steps_stride];
                       if (with_logprobs) {
                         const RowResult result = sample_row<true>(block, reader, key, row_step, params);
                         out_ptr[r] = result.token;
                         log_prob_ptr[r] = result.log_prob;
                       } else {
                         out_ptr[r] = sample_row<false>(block, reader, key, row_step, params).token;
                       }
                     }
                   });
                 }),
                 at::kFloat, at::kHalf, at::kBFloat16);
  return {out, log_probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CPU, m) { m.impl("_sample_tokens_cuda_emulated", &sample_tokens_cuda_emulated_cpu); }

}  // namespace torchkvops
