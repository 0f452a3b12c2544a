// CUDA kernels of sample_tokens and sample_tokens_with_logprobs: one thread block per row, on the
// current stream, with no host sync and no allocation but the outputs (so they can be captured in a
// CUDA graph). Greedy and temperature-only rows read their logits once. With top-k or top-p each
// threshold is found by radix selection over the order-preserving keys of l: 4 passes of 8-bit
// digits, each a histogram in shared memory (counts for top-k, fixed-point probability mass for
// top-p) and a block-wide suffix scan of its 256 bins; a last pass draws the token. The
// log-probability takes one more pass at most: the row's largest l (a pass top-p makes anyway), or
// for greedy the sum of exp(x - max) after the argmax. Rows are read with 16-byte vector loads when
// the row is contiguous and aligned. What a row computes: see sample_tokens.h.
#include <ATen/Dispatch_v2.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <math_constants.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "../sample_tokens.h"

namespace torchkvops {
namespace {

using namespace sampling;
namespace cg = cooperative_groups;

constexpr int kThreads = 512;  // one block per row
constexpr int kBins = 256;     // 8-bit digits
constexpr float kInf = std::numeric_limits<float>::infinity();

// The best (score, token) seen, under torch.argmax's rules (see `beats`).
struct ArgBest {
  float score;
  int token;
};

struct ArgBestOp {
  __device__ __forceinline__ ArgBest operator()(const ArgBest& a, const ArgBest& b) const {
    return beats(b.score, b.token, a.score, a.token) ? b : a;
  }
};

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return b > a ? b : a; }
};

using ArgBestReduce = cub::BlockReduce<ArgBest, kThreads>;
using MaxReduce = cub::BlockReduce<float, kThreads>;
using SumReduce = cub::BlockReduce<float, kThreads>;
using BinScan = cub::BlockScan<unsigned long long, kThreads>;

struct SharedStorage {
  union {
    typename ArgBestReduce::TempStorage arg_best;
    typename MaxReduce::TempStorage max;
    typename SumReduce::TempStorage sum;
    typename BinScan::TempStorage scan;
  } cub;
  unsigned long long hist[kBins];  // one radix pass's histogram, then its suffix sums
  unsigned long long above;        // broadcast: the weight of the digits above the chosen one
  unsigned int digit;              // broadcast: the chosen digit
  float max_value;                 // broadcast: the row's largest l
  float sum;                       // broadcast: block_sum's result
  int token;                       // broadcast: the drawn token
  uint32_t reach[kNoiseSteps];     // noise_reach_threshold(0..46)
};

// Reads one row of logits as float: thread t visits tokens t, t + blockDim.x, ... (in vectors of 16
// bytes when `vectorized`, then the tail), in increasing order.
template <typename scalar_t>
struct RowReader {
  const scalar_t* row;  // [vocab], stride col_stride (elements)
  int64_t col_stride;
  int vocab;
  bool vectorized;  // col_stride == 1 and row 16-byte aligned

  template <typename Fn>
  __device__ __forceinline__ void for_each(Fn&& fn) const {
    if (vectorized) {
      constexpr int kVec = 16 / sizeof(scalar_t);
      struct alignas(16) Vec {
        scalar_t v[kVec];
      };
      const Vec* vecs = reinterpret_cast<const Vec*>(row);
      const int num_vecs = vocab / kVec;
      for (int j = threadIdx.x; j < num_vecs; j += blockDim.x) {
        const Vec x = vecs[j];
#pragma unroll
        for (int e = 0; e < kVec; ++e) fn(j * kVec + e, static_cast<float>(x.v[e]));
      }
      for (int i = num_vecs * kVec + threadIdx.x; i < vocab; i += blockDim.x) fn(i, static_cast<float>(row[i]));
    } else {
      for (int i = threadIdx.x; i < vocab; i += blockDim.x) fn(i, static_cast<float>(row[i * col_stride]));
    }
  }
};

// hist[bin] += w, with one shared-memory atomic per distinct bin among the warp's active threads:
// the first radix pass puts most tokens in a handful of bins (sign and exponent), and plain atomics
// would serialize on them. Integer adds, so the sums do not depend on the order.
__device__ __forceinline__ void add_to_bin(unsigned long long* hist, unsigned int bin, unsigned long long w) {
  const cg::coalesced_group active = cg::coalesced_threads();
  const cg::coalesced_group peers = cg::labeled_partition(active, bin);
  const unsigned long long sum = cg::reduce(peers, w, cg::plus<unsigned long long>());
  if (peers.thread_rank() == 0) atomicAdd(hist + bin, sum);
}

// The largest key t such that the tokens with key >= t (among those with key >= lower) weigh at
// least target_of(their total weight), 8 bits at a time. `value` maps a raw logit to l, `weight` l
// to its weight. Every thread of the block calls this and gets the same result.
template <typename scalar_t, typename ValueFn, typename WeightFn, typename TargetFn>
__device__ uint32_t select_threshold(const RowReader<scalar_t>& reader, SharedStorage& smem, ValueFn value,
                                     uint32_t lower, WeightFn weight, TargetFn target_of) {
  uint32_t prefix = 0, prefix_mask = 0;
  unsigned long long above = 0, target = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    __syncthreads();  // the previous user of smem is done
    for (int b = threadIdx.x; b < kBins; b += blockDim.x) smem.hist[b] = 0;
    __syncthreads();
    reader.for_each([&](int, float x) {
      const float l = value(x);
      const uint32_t key = order_key(l);
      if (key < lower || (key & prefix_mask) != prefix) return;
      const unsigned long long w = weight(l);
      if (w != 0) add_to_bin(smem.hist, (key >> shift) & 0xFFu, w);
    });
    __syncthreads();
    // Suffix sums S[d] = hist[d] + ... + hist[255], as an inclusive scan over the reversed bins.
    const unsigned long long h = threadIdx.x < kBins ? smem.hist[kBins - 1 - threadIdx.x] : 0ull;
    unsigned long long suffix;
    BinScan(smem.cub.scan).InclusiveSum(h, suffix);
    __syncthreads();
    if (threadIdx.x < kBins) smem.hist[kBins - 1 - threadIdx.x] = suffix;
    if (threadIdx.x == 0) {  // only kept if no digit qualifies, which exact sums rule out
      smem.digit = 0;
      smem.above = above;
    }
    __syncthreads();
    if (shift == 24) target = target_of(smem.hist[0]);
    // The digit d whose tokens reach the target: above + S[d] >= target > above + S[d + 1]. S falls
    // as d grows, so exactly one digit qualifies.
    if (threadIdx.x < kBins) {
      const int d = threadIdx.x;
      const unsigned long long at_or_above = above + smem.hist[d];
      const unsigned long long strictly_above = above + (d + 1 < kBins ? smem.hist[d + 1] : 0ull);
      if (at_or_above >= target && strictly_above < target) {
        smem.digit = d;
        smem.above = strictly_above;
      }
    }
    __syncthreads();
    const uint32_t d = smem.digit;
    above = smem.above;
    prefix |= d << shift;
    prefix_mask |= 0xFFu << shift;
  }
  __syncthreads();
  return prefix;
}

// The block's sum of `v` (every thread gets it), after the previous user of smem.cub is done.
__device__ __forceinline__ float block_sum(SharedStorage& smem, float v) {
  __syncthreads();
  v = SumReduce(smem.cub.sum).Sum(v);
  if (threadIdx.x == 0) smem.sum = v;
  __syncthreads();
  return smem.sum;
}

// kLogProb: also write log_probs[r], the drawn token's log-probability (see sample_tokens.h).
template <typename scalar_t, bool kLogProb>
__global__ void __launch_bounds__(kThreads) sample_tokens_kernel(
    const scalar_t* __restrict__ logits,  // [rows, vocab], strides (row_stride, col_stride) in elements
    int64_t row_stride, int64_t col_stride, int vocab,
    const int64_t* __restrict__ keys,  // [rows], stride key_stride
    int64_t key_stride,
    const int64_t* __restrict__ step,  // [1] (step_stride 0) or [rows]
    int64_t step_stride,
    int64_t* __restrict__ out,      // [rows]
    float* __restrict__ log_probs,  // [rows] when kLogProb
    const SampleParams p) {
  __shared__ SharedStorage smem;
  const int64_t r = blockIdx.x;
  const scalar_t* row = logits + r * row_stride;
  const RowReader<scalar_t> reader{row, col_stride, vocab,
                                   col_stride == 1 && reinterpret_cast<uintptr_t>(row) % 16 == 0};

  // Every token scores at least -inf, so (-inf, 0) is what argmax returns when nothing beats it.
  ArgBest best{-kInf, 0};
  if (p.greedy) {
    reader.for_each([&](int i, float x) {
      if (beats(x, i, best.score, best.token)) best = {x, i};
    });
    best = ArgBestReduce(smem.cub.arg_best).Reduce(best, ArgBestOp());
    if (threadIdx.x == 0) {
      out[r] = best.token;
      smem.max_value = best.score;  // NaN when the row holds one (argmax's rules)
    }
    if (kLogProb) {  // log_softmax(x)[token] = -log(sum of exp(x - max)): one more pass
      __syncthreads();
      const float m = smem.max_value;
      float sum = 0.0f;
      if (fabsf(m) < kInf) reader.for_each([&](int, float x) { sum += expf(x - m); });
      sum = block_sum(smem, sum);
      if (threadIdx.x == 0) log_probs[r] = fabsf(m) < kInf ? -logf(sum) : CUDART_NAN_F;
    }
    return;
  }

  if (threadIdx.x < kNoiseSteps) smem.reach[threadIdx.x] = noise_reach_threshold(threadIdx.x);
  __syncthreads();

  // torch's CUDA division by a CPU scalar multiplies by its reciprocal; __fmul_rn keeps the product
  // from being fused into a later add (an FMA would round differently from the reference).
  const float inv_t = p.inv_temperature;
  auto scaled = [inv_t](float x) { return __fmul_rn(x, inv_t); };

  // The largest l and whether a NaN is present, for top-p and the log-probability: the kept tokens'
  // too (the largest is always kept, a NaN too: its key is the largest).
  float m = -kInf;
  bool has_nan = false;
  if (p.use_top_p || kLogProb) {
    reader.for_each([&](int, float x) {
      const float l = scaled(x);
      m = MaxOp()(m, l);
      has_nan |= l != l;
    });
    m = MaxReduce(smem.cub.max).Reduce(m, MaxOp());
    if (threadIdx.x == 0) smem.max_value = m;
    has_nan = __syncthreads_or(has_nan);
    m = smem.max_value;
  }

  uint32_t threshold = 0;  // keep the tokens with order_key(l) >= threshold
  if (p.top_k > 0) {
    const unsigned long long k = static_cast<unsigned long long>(p.top_k);
    threshold =
        select_threshold(reader, smem, scaled, 0u, [](float) { return 1ull; }, [k](unsigned long long) { return k; });
  }
  // With an infinite maximum the masses are undefined (the reference's softmax gives NaN and drops
  // nothing): keep what top-k kept.
  if (p.use_top_p && fabsf(m) < kInf) {
    const float top_p = p.top_p;
    threshold = select_threshold(
        reader, smem, scaled, threshold, [m](float l) { return static_cast<unsigned long long>(fixed_mass(l - m)); },
        [top_p](unsigned long long total) { return static_cast<unsigned long long>(top_p_target(top_p, total)); });
  }

  const NoiseKey nk = noise_key(keys[r * key_stride], step[r * step_stride]);
  float sum = 0.0f;  // of exp(l - m) over the kept tokens, when kLogProb
  reader.for_each([&](int i, float x) {
    const float l = scaled(x);
    // A token top-k / top-p dropped scores -inf + g = -inf: it never beats (-inf, 0) or a lower index.
    if (order_key(l) < threshold) return;
    if (kLogProb) sum += expf(l - m);
    const uint32_t high = noise_high(nk, static_cast<uint32_t>(i));
    if (cannot_beat(l, high, best.score, smem.reach)) return;
    const float score = __fadd_rn(l, gumbel(nk, high));
    if (beats(score, i, best.score, best.token)) best = {score, i};
  });
  __syncthreads();  // smem.cub may still be in use by the selections
  best = ArgBestReduce(smem.cub.arg_best).Reduce(best, ArgBestOp());
  if (threadIdx.x == 0) {
    out[r] = best.token;
    smem.token = best.token;
  }
  if (kLogProb) {
    sum = block_sum(smem, sum);  // also makes smem.token visible
    if (threadIdx.x == 0) {
      const float l = scaled(static_cast<float>(row[static_cast<int64_t>(smem.token) * col_stride]));
      log_probs[r] = has_nan || !(fabsf(m) < kInf) ? CUDART_NAN_F : (l - m) - logf(sum);
    }
  }
}

template <bool kLogProb>
void launch(const at::Tensor& logits, const at::Tensor& keys, const at::Tensor& step, const SampleParams& params,
            const at::Tensor& out, float* log_probs) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_V2(logits.scalar_type(), "sample_tokens_cuda", AT_WRAP([&] {
                   sample_tokens_kernel<scalar_t, kLogProb><<<static_cast<unsigned int>(rows), kThreads, 0, stream>>>(
                       logits.data_ptr<scalar_t>(), logits.stride(0), logits.stride(1), static_cast<int>(vocab),
                       keys.data_ptr<int64_t>(), keys.stride(0), step.data_ptr<int64_t>(), step_stride(step),
                       out.data_ptr<int64_t>(), log_probs, params);
                   C10_CUDA_KERNEL_LAUNCH_CHECK();
                 }),
                 at::kFloat, at::kHalf, at::kBFloat16);
}

void check_rows(const at::Tensor& logits, const char* op) {
  TORCH_CHECK_VALUE(logits.size(0) <= std::numeric_limits<int32_t>::max(), op, ": logits must have at most ",
                    std::numeric_limits<int32_t>::max(), " rows (one CUDA block each), got ", logits.size(0));
}

at::Tensor sample_tokens_cuda(const at::Tensor& logits, const at::Tensor& keys, const at::Tensor& step,
                              double temperature, int64_t top_k, double top_p) {
  check_sample_args(logits, keys, step, temperature, top_k, top_p);
  TORCH_INTERNAL_ASSERT(logits.device().is_cuda());
  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  check_rows(logits, "sample_tokens");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  launch<false>(logits, keys, step, make_sample_params(logits.size(1), temperature, top_k, top_p), out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> sample_tokens_with_logprobs_cuda(const at::Tensor& logits, const at::Tensor& keys,
                                                                    const at::Tensor& step, double temperature,
                                                                    int64_t top_k, double top_p) {
  check_sample_args(logits, keys, step, temperature, top_k, top_p, "sample_tokens_with_logprobs");
  TORCH_INTERNAL_ASSERT(logits.device().is_cuda());
  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  check_rows(logits, "sample_tokens_with_logprobs");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  at::Tensor log_probs = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  launch<true>(logits, keys, step, make_sample_params(logits.size(1), temperature, top_k, top_p), out,
               log_probs.data_ptr<float>());
  return {out, log_probs};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CUDA, m) {
  m.impl("sample_tokens", &sample_tokens_cuda);
  m.impl("sample_tokens_with_logprobs", &sample_tokens_with_logprobs_cuda);
}

}  // namespace torchkvops
