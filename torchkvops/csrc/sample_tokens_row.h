// The CUDA sampler's per-row algorithm, written once over a *block policy*: the CUDA kernel
// (cuda/sample_tokens.cu) runs it with CudaBlock, one 512-thread block per row; the CPU op
// _sample_tokens_cuda_emulated (cpu/sample_tokens_emulated.cpp) runs the same code with
// EmulatedBlock, which executes the 512 threads one after another, so that the CPU tests run the
// CUDA kernel's row logic. What a row computes: see sample_tokens.h.
//
// SIMT code with barriers cannot be run thread by thread, so the row is a sequence of *phases*: in
// each, every thread folds the tokens it visits (RowReader::for_each: thread t visits tokens t, t +
// kThreads, ...) into a per-thread value (`each_thread`), then one block primitive combines those
// values and hands every thread the result. Control flow between phases depends only on values every
// thread has, so a serial emulation takes the same path. The block policy provides only what differs
// between the two: the thread count, the per-thread values, the block-wide reductions (argbest, max,
// float sum, OR), the 256-bin histogram and its suffix scan, the choice of one bin, the noise
// reach table, and the barriers and broadcasts these need:
//
//   struct Block {
//     static constexpr int kThreads;
//     template <typename T> <type> PerThread;            // one T per thread (CUDA: this thread's)
//     template <typename Fn> PerThread<R> each_thread(Fn fn);     // R fn(int thread), for every thread
//     template <typename T, typename Proj> ArgBest argbest(const PerThread<T>&, Proj);  // Proj: T -> ArgBest
//     ... float max(...), float sum(...), bool any(...)  // Proj: T -> float / float / bool
//     template <typename Fn> void histogram(Fn fn);  // bins = 0, then fn(thread, add) for every thread;
//                                                    // add(bin, w) adds w to the bin
//     void suffix_scan();                            // bins[d] = bins[d] + ... + bins[255]
//     const unsigned long long* bins();
//     template <typename Fn> int select_bin(Fn qualifies);  // the d in [0, 256) with qualifies(d)
//                                                           // (at most one does), or -1
//     const uint32_t* noise_reach();                 // noise_reach_threshold(0 .. kMaxNoiseStep)
//   };
//
// Every result a primitive returns is the same on every thread. The reductions combine the
// per-thread values in an order of their choosing: argbest and OR do not depend on it; max only in
// the sign of a zero maximum; the float sum does (CudaBlock sums as cub does, and EmulatedBlock
// follows cub's order). The histogram's sums are integers: exact in any order.
//
// Nothing here branches on __CUDA_ARCH__: the operations whose rounding differs between host and
// device go through device_math.h's wrappers.
#pragma once

#include <cstdint>
#include <limits>

#include "device_math.h"
#include "macros.h"
#include "sample_tokens.h"

namespace torchkvops {
namespace sampling {

constexpr int kBins = 256;  // 8-bit digits

// Reads one row of logits as float. for_each(t, threads, fn) calls fn(token, value) for the tokens
// of thread t: t, t + threads, ..., in increasing order; in vectors of 16 bytes when `vectorized`
// (vector j holds tokens j * kVec .. j * kVec + kVec - 1, and thread t reads vectors t, t + threads,
// ...), then the tail past the last whole vector, again strided.
template <typename scalar_t>
struct RowReader {
  static constexpr int kVec = 16 / sizeof(scalar_t);
  struct alignas(16) Vec {
    scalar_t v[kVec];
  };

  const scalar_t* row;  // [vocab], stride col_stride (elements)
  int64_t col_stride;
  int vocab;
  bool vectorized;  // col_stride == 1 and row 16-byte aligned

  TORCHKVOPS_HOST_DEVICE_INLINE static RowReader make(const scalar_t* row, int64_t col_stride, int vocab) {
    return {row, col_stride, vocab, col_stride == 1 && reinterpret_cast<uintptr_t>(row) % 16 == 0};
  }

  TORCHKVOPS_HOST_DEVICE_INLINE float at(int i) const { return static_cast<float>(row[i * col_stride]); }

  TORCHKVOPS_NO_EXEC_CHECK
  template <typename Fn>
  TORCHKVOPS_HOST_DEVICE_INLINE void for_each(int thread, int threads, Fn&& fn) const {
    if (vectorized) {
      const Vec* vecs = reinterpret_cast<const Vec*>(row);
      const int num_vecs = vocab / kVec;
      for (int j = thread; j < num_vecs; j += threads) {
        const Vec x = vecs[j];
        TORCHKVOPS_UNROLL
        for (int e = 0; e < kVec; ++e) fn(j * kVec + e, static_cast<float>(x.v[e]));
      }
      for (int i = num_vecs * kVec + thread; i < vocab; i += threads) fn(i, static_cast<float>(row[i]));
    } else {
      for (int i = thread; i < vocab; i += threads) fn(i, static_cast<float>(row[i * col_stride]));
    }
  }
};

// What the reductions combine, as the CUDA kernel's cub operators do: op(this thread's, another's).
TORCHKVOPS_HOST_DEVICE_INLINE float max_of(float a, float b) { return b > a ? b : a; }  // NaN b: a

// One thread's share of the row's largest l (NaN aside) and whether it holds a NaN.
struct MaxPart {
  float max;
  bool has_nan;
};

// One thread's share of the draw: its best kept token, and the sum of exp(l - max) over its kept tokens.
struct DrawPart {
  ArgBest best;
  float sum;
};

struct RowResult {
  int token;
  float log_prob;  // when asked for
};

// The largest key t such that the tokens with key >= t (among those with key >= lower) weigh at
// least target_of(their total weight), 8 bits at a time: a histogram of the next digit over the
// tokens that share the digits chosen so far, its suffix sums S, and the digit that digit_qualifies.
// `value` maps a raw logit to l, `weight` l to its weight (unsigned long long).
TORCHKVOPS_NO_EXEC_CHECK
template <typename Block, typename scalar_t, typename ValueFn, typename WeightFn, typename TargetFn>
TORCHKVOPS_HOST_DEVICE inline uint32_t select_threshold(Block& block, const RowReader<scalar_t>& reader, ValueFn value,
                                                        uint32_t lower, WeightFn weight, TargetFn target_of) {
  uint32_t prefix = 0, prefix_mask = 0;
  unsigned long long above = 0, target = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    block.histogram([&](int t, auto add) {
      reader.for_each(t, Block::kThreads, [&](int, float x) {
        const float l = value(x);
        const uint32_t key = order_key(l);
        if (key < lower || (key & prefix_mask) != prefix) return;
        const unsigned long long w = weight(l);
        if (w != 0) add((key >> shift) & 0xFFu, w);
      });
    });
    block.suffix_scan();
    const unsigned long long* suffix = block.bins();
    if (shift == 24) target = target_of(suffix[0]);
    const int chosen = block.select_bin(
        [&](int d) { return digit_qualifies(above, suffix[d], d + 1 < kBins ? suffix[d + 1] : 0ull, target); });
    // No digit qualifies only when the target exceeds every weight left: top-p after a top-k that
    // kept NaNs alone (their masses are 0). Then digit 0, as before: the threshold keeps every token
    // and the first NaN wins the draw anyway.
    if (chosen >= 0) above += chosen + 1 < kBins ? suffix[chosen + 1] : 0ull;
    const uint32_t d = chosen < 0 ? 0u : static_cast<uint32_t>(chosen);
    prefix |= d << shift;
    prefix_mask |= 0xFFu << shift;
  }
  return prefix;
}

// One row: the drawn token and, with kLogProb, its log-probability (see sample_tokens.h). `key` and
// `step` are the row's noise key and step; every thread gets the same result.
TORCHKVOPS_NO_EXEC_CHECK
template <bool kLogProb, typename Block, typename scalar_t>
TORCHKVOPS_HOST_DEVICE inline RowResult sample_row(Block& block, const RowReader<scalar_t>& reader, int64_t key,
                                                   int64_t step, const SampleParams& p) {
  constexpr int kThreads = Block::kThreads;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  RowResult result{0, 0.0f};

  if (p.greedy) {
    // Every token scores at least -inf, so (-inf, 0) is what argmax returns when nothing beats it.
    const auto firsts = block.each_thread([&](int t) {
      ArgBest best{-kInf, 0};
      reader.for_each(t, kThreads, [&](int i, float x) {
        if (beats(x, i, best.score, best.token)) best = {x, i};
      });
      return best;
    });
    const ArgBest best = block.argbest(firsts, [](const ArgBest& b) { return b; });
    result.token = best.token;
    if (kLogProb) {                // log_softmax(x)[token] = -log(sum of exp(x - max)): one more pass
      const float m = best.score;  // NaN when the row holds one (argmax's rules)
      const auto sums = block.each_thread([&](int t) {
        float sum = 0.0f;
        if (dmath::is_finite(m)) reader.for_each(t, kThreads, [&](int, float x) { sum += dmath::exp_f(x - m); });
        return sum;
      });
      result.log_prob = greedy_log_prob(m, block.sum(sums, [](float s) { return s; }));
    }
    return result;
  }

  const uint32_t* reach = block.noise_reach();
  // torch's CUDA division by a CPU scalar multiplies by its reciprocal; mul_rn keeps the product from
  // being fused into a later add (an FMA would round differently from the reference).
  const float inv_t = p.inv_temperature;
  auto scaled = [inv_t](float x) { return dmath::mul_rn(x, inv_t); };

  // The largest l and whether a NaN is present, for top-p and the log-probability: the kept tokens'
  // too (the largest is always kept, a NaN too: its key is the largest).
  float m = -kInf;
  bool has_nan = false;
  if (p.use_top_p || kLogProb) {
    const auto parts = block.each_thread([&](int t) {
      MaxPart part{-kInf, false};
      reader.for_each(t, kThreads, [&](int, float x) {
        const float l = scaled(x);
        part.max = max_of(part.max, l);
        part.has_nan |= l != l;
      });
      return part;
    });
    m = block.max(parts, [](const MaxPart& part) { return part.max; });
    has_nan = block.any(parts, [](const MaxPart& part) { return part.has_nan; });
  }

  uint32_t threshold = 0;  // keep the tokens with order_key(l) >= threshold
  if (p.top_k > 0) {
    const unsigned long long k = static_cast<unsigned long long>(p.top_k);
    threshold =
        select_threshold(block, reader, scaled, 0u, [](float) { return 1ull; }, [k](unsigned long long) { return k; });
  }
  // With an infinite maximum the masses are undefined (the reference's softmax gives NaN and drops
  // nothing): keep what top-k kept.
  if (p.use_top_p && dmath::is_finite(m)) {
    const float top_p = p.top_p;
    threshold = select_threshold(
        block, reader, scaled, threshold, [m](float l) { return static_cast<unsigned long long>(fixed_mass(l - m)); },
        [top_p](unsigned long long total) { return static_cast<unsigned long long>(top_p_target(top_p, total)); });
  }

  const NoiseKey nk = noise_key(key, step);
  const auto draws = block.each_thread([&](int t) {
    DrawPart part{{-kInf, 0}, 0.0f};
    reader.for_each(t, kThreads, [&](int i, float x) {
      const float l = scaled(x);
      // A token top-k / top-p dropped scores -inf + g = -inf: it never beats (-inf, 0) or a lower index.
      if (order_key(l) < threshold) return;
      if (kLogProb) part.sum += dmath::exp_f(l - m);
      offer_token(part.best, nk, reach, i, l, noise_high(nk, static_cast<uint32_t>(i)));
    });
    return part;
  });
  const ArgBest best = block.argbest(draws, [](const DrawPart& part) { return part.best; });
  result.token = best.token;
  if (kLogProb) {
    const float sum = block.sum(draws, [](const DrawPart& part) { return part.sum; });
    result.log_prob = sampled_log_prob(scaled(reader.at(best.token)), m, sum, has_nan);
  }
  return result;
}

}  // namespace sampling
}  // namespace torchkvops
