// CUDA kernels of sample_tokens and sample_tokens_with_logprobs: one thread block per row, on the
// current stream, with no host sync and no allocation but the outputs (so they can be captured in a
// CUDA graph). The row's algorithm is sample_tokens_row.h's `sample_row`, shared with the CPU op
// _sample_tokens_cuda_emulated that the CPU tests run; this file holds only what is CUDA's: the block
// policy CudaBlock (cub reductions and scan, shared-memory histograms with warp-aggregated atomics,
// barriers and broadcasts), the kernel, the launch and the registration.
// Greedy and temperature-only rows read their logits once. With top-k or top-p each threshold is
// found by radix selection over the order-preserving keys of l: 4 passes of 8-bit digits, each a
// histogram in shared memory (counts for top-k, fixed-point probability mass for top-p) and a
// block-wide suffix scan of its 256 bins; a last pass draws the token. The log-probability takes one
// more pass at most: the row's largest l (a pass top-p makes anyway), or for greedy the sum of exp(x -
// max) after the argmax. Rows are read with 16-byte vector loads when the row is contiguous and
// aligned. What a row computes: see sample_tokens.h.
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

#include <cstdint>
#include <limits>
#include <tuple>

#include "../sample_tokens.h"
#include "../sample_tokens_row.h"

namespace torchkvops {
namespace {

using namespace sampling;
namespace cg = cooperative_groups;

constexpr int kBlockThreads = 512;  // one block per row

struct ArgBestOp {
  __device__ __forceinline__ ArgBest operator()(const ArgBest& a, const ArgBest& b) const { return better(a, b); }
};

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return max_of(a, b); }
};

using ArgBestReduce = cub::BlockReduce<ArgBest, kBlockThreads>;
using MaxReduce = cub::BlockReduce<float, kBlockThreads>;
using SumReduce = cub::BlockReduce<float, kBlockThreads>;
using BinScan = cub::BlockScan<unsigned long long, kBlockThreads>;

struct SharedStorage {
  union {
    typename ArgBestReduce::TempStorage arg_best;
    typename MaxReduce::TempStorage max;
    typename SumReduce::TempStorage sum;
    typename BinScan::TempStorage scan;
  } cub;
  unsigned long long hist[kBins];  // one radix pass's histogram, then its suffix sums
  ArgBest best;                    // broadcast: argbest's result
  float value;                     // broadcast: max's or sum's result
  int bin;                         // broadcast: select_bin's result
  uint32_t reach[kNoiseSteps];     // noise_reach_threshold(0..46)
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

// The block policy of sample_tokens_row.h for a CUDA block of kThreads threads, one row per block:
// each primitive starts with a barrier when it reuses shared memory (the previous user is done) and
// ends with one after its broadcast.
struct CudaBlock {
  static constexpr int kThreads = kBlockThreads;

  template <typename T>
  struct PerThread {
    T value;  // this thread's
  };

  SharedStorage& smem;

  template <typename Fn>
  __device__ __forceinline__ auto each_thread(Fn&& fn) -> PerThread<decltype(fn(0))> {
    return {fn(static_cast<int>(threadIdx.x))};
  }

  template <typename T, typename Proj>
  __device__ __forceinline__ ArgBest argbest(const PerThread<T>& v, Proj proj) {
    __syncthreads();
    const ArgBest best = ArgBestReduce(smem.cub.arg_best).Reduce(proj(v.value), ArgBestOp());
    if (threadIdx.x == 0) smem.best = best;
    __syncthreads();
    return smem.best;
  }

  template <typename T, typename Proj>
  __device__ __forceinline__ float max(const PerThread<T>& v, Proj proj) {
    __syncthreads();
    const float m = MaxReduce(smem.cub.max).Reduce(proj(v.value), MaxOp());
    return broadcast(m);
  }

  template <typename T, typename Proj>
  __device__ __forceinline__ float sum(const PerThread<T>& v, Proj proj) {
    __syncthreads();
    const float s = SumReduce(smem.cub.sum).Sum(proj(v.value));
    return broadcast(s);
  }

  template <typename T, typename Proj>
  __device__ __forceinline__ bool any(const PerThread<T>& v, Proj proj) {
    return __syncthreads_or(proj(v.value)) != 0;
  }

  template <typename Fn>
  __device__ __forceinline__ void histogram(Fn&& fn) {
    __syncthreads();  // the previous pass's readers of hist are done
    for (int b = threadIdx.x; b < kBins; b += kThreads) smem.hist[b] = 0;
    __syncthreads();
    unsigned long long* hist = smem.hist;
    fn(static_cast<int>(threadIdx.x), [hist](unsigned int bin, unsigned long long w) { add_to_bin(hist, bin, w); });
    __syncthreads();
  }

  // Suffix sums S[d] = hist[d] + ... + hist[255], as an inclusive scan over the reversed bins.
  __device__ __forceinline__ void suffix_scan() {
    static_assert(kBins <= kThreads, "one bin per thread");
    const unsigned long long h = threadIdx.x < kBins ? smem.hist[kBins - 1 - threadIdx.x] : 0ull;
    unsigned long long suffix;
    BinScan(smem.cub.scan).InclusiveSum(h, suffix);
    __syncthreads();
    if (threadIdx.x < kBins) smem.hist[kBins - 1 - threadIdx.x] = suffix;
    __syncthreads();
  }

  __device__ __forceinline__ const unsigned long long* bins() const { return smem.hist; }

  // Thread d tests bin d.
  template <typename Fn>
  __device__ __forceinline__ int select_bin(Fn&& qualifies) {
    if (threadIdx.x == 0) smem.bin = -1;
    __syncthreads();
    if (threadIdx.x < kBins && qualifies(static_cast<int>(threadIdx.x))) smem.bin = threadIdx.x;
    __syncthreads();
    return smem.bin;
  }

  __device__ __forceinline__ const uint32_t* noise_reach() {
    if (threadIdx.x < kNoiseSteps) smem.reach[threadIdx.x] = noise_reach_threshold(threadIdx.x);
    __syncthreads();
    return smem.reach;
  }

 private:
  // Thread 0's value (what cub's block reductions return) to every thread.
  __device__ __forceinline__ float broadcast(float v) {
    if (threadIdx.x == 0) smem.value = v;
    __syncthreads();
    return smem.value;
  }
};

// kLogProb: also write log_probs[r], the drawn token's log-probability (see sample_tokens.h).
template <typename scalar_t, bool kLogProb>
__global__ void __launch_bounds__(kBlockThreads) sample_tokens_kernel(
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
  CudaBlock block{smem};
  const auto reader = RowReader<scalar_t>::make(logits + r * row_stride, col_stride, vocab);
  const RowResult result = sample_row<kLogProb>(block, reader, keys[r * key_stride], step[r * step_stride], p);
  if (threadIdx.x == 0) {
    out[r] = result.token;
    if (kLogProb) log_probs[r] = result.log_prob;
  }
}

template <bool kLogProb>
void launch(const at::Tensor& logits, const at::Tensor& keys, const at::Tensor& step, const SampleParams& params,
            const at::Tensor& out, float* log_probs) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_V2(logits.scalar_type(), "sample_tokens_cuda", AT_WRAP([&] {
                   sample_tokens_kernel<scalar_t, kLogProb>
                       <<<static_cast<unsigned int>(rows), kBlockThreads, 0, stream>>>(
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
