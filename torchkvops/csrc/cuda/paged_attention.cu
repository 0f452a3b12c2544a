// CUDA kernels of paged_attention (paged_attention.h): one thread block of kPartition threads per task
// (row and KV head, partition of the row's keys, chunk of query heads), running attend_partition with
// CudaBlock; then one block per (row, head) merging its partitions. Lengths and tables are read on the
// device: nothing depends on them on the host, so a CUDA graph captured once serves every length. Two
// launches on the current stream, no host sync; the partial results are allocated by the op (the graph's
// pool under capture), like its outputs.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "../paged_attention.h"

namespace torchkvops {
namespace {

using paged::kPartition;
using paged::Plan;

// The block policy of paged_attention.h: thread t runs fn(t), fn(t + blockDim.x), ...; sync() is a barrier.
struct CudaBlock {
  template <typename Fn>
  __device__ __forceinline__ void for_threads(int n, Fn&& fn) {
    for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) fn(i);
  }
  __device__ __forceinline__ void sync() { __syncthreads(); }

  // (paged_attention.h's contract) A thread per (h, d): neighbouring threads read neighbouring elements
  // of a value row.
  template <typename scalar_t>
  __device__ __forceinline__ void accumulate(const paged::Scratch& sc, int n, int64_t keys, int64_t dim,
                                             const scalar_t* value_cache, float* out, int64_t head_stride) {
    for_threads(n * static_cast<int>(dim), [&](int i) {
      const int h = i / static_cast<int>(dim), d = i % static_cast<int>(dim);
      float a = 0.f;
      for (int64_t t = 0; t < keys; ++t) {
        const float e = sc.s[h][t];
        if (e != 0.f) a = dmath::add_rn(a, dmath::mul_rn(e, static_cast<float>(value_cache[sc.v_off[t] + d])));
      }
      out[h * head_stride + d] = a;
    });
  }
};

template <typename scalar_t>
__global__ void __launch_bounds__(kPartition)
    partition_kernel(const Plan p,
                     const scalar_t* __restrict__ query,           // [rows, heads, head_dim]
                     const scalar_t* __restrict__ key_cache,       // [num_blocks, kv_heads, block_size, head_dim]
                     const scalar_t* __restrict__ value_cache,     // [num_blocks, kv_heads, block_size, head_dim]
                     const int32_t* __restrict__ block_tables,     // [rows, max_blocks]
                     const int32_t* __restrict__ seq_lens,         // [rows]
                     const int32_t* __restrict__ seq_starts,       // [rows] or null
                     const int64_t* __restrict__ query_positions,  // [rows, heads] or null
                     float* __restrict__ part_max,                 // [partitions, rows, heads]
                     float* __restrict__ part_sum,                 // [partitions, rows, heads]
                     float* __restrict__ acc) {                    // [partitions, rows, heads, head_dim]
  __shared__ paged::Scratch scratch;
  CudaBlock block;
  const int64_t row = blockIdx.x / p.kv_heads, kv = blockIdx.x % p.kv_heads;
  const int64_t part = blockIdx.y, chunk = blockIdx.z;
  const int64_t per_kv = p.per_kv();
  const int64_t head0 = kv * per_kv + chunk * paged::kHeads;
  const int n = static_cast<int>(paged::min_i64(paged::kHeads, per_kv - chunk * paged::kHeads));
  paged::attend_partition(block, scratch, p, query, key_cache, value_cache, block_tables, seq_lens, seq_starts,
                          query_positions, part_max, part_sum, acc, row, kv, head0, n, part);
}

template <typename scalar_t>
__global__ void merge_kernel(const Plan p,
                             const float* __restrict__ part_max,    // [partitions, rows, heads]
                             const float* __restrict__ part_sum,    // [partitions, rows, heads]
                             const float* __restrict__ acc,         // [partitions, rows, heads, head_dim]
                             const int32_t* __restrict__ seq_lens,  // [rows]
                             scalar_t* __restrict__ out,            // [rows, heads, head_dim]
                             float* __restrict__ lse) {             // [rows, heads]
  const int64_t item = blockIdx.x;                                  // row * heads + head
  const int64_t at = (item / p.heads) * p.part_row + (item % p.heads) * p.part_head;
  const int64_t live = paged::live_partitions(p, seq_lens, item / p.heads);
  const paged::Merged merged = paged::merge_partitions(p, part_max, part_sum, at, live);
  const float* acc_head = acc + item * p.head_dim;
  for (int64_t d = threadIdx.x; d < p.head_dim; d += blockDim.x)
    out[item * p.head_dim + d] =
        static_cast<scalar_t>(paged::merged_element(p, part_max, part_sum, acc_head, at, live, merged, d));
  if (threadIdx.x == 0) lse[item] = merged.lse;
}

std::tuple<at::Tensor, at::Tensor> paged_attention_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                                                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                                                        const at::Tensor& seq_lens,
                                                        const c10::optional<at::Tensor>& query_positions, double scale,
                                                        int64_t window, double softcap,
                                                        const c10::optional<at::Tensor>& seq_starts) {
  paged::check_args(query, key_cache, value_cache, block_tables, seq_lens, query_positions, scale, window, softcap,
                    seq_starts);
  TORCH_INTERNAL_ASSERT(query.device().is_cuda());
  const c10::cuda::OptionalCUDAGuard guard(query.device());
  if (query.numel() == 0) {
    const paged::Buffers b = paged::empty_buffers(query, 0);
    return {b.out, b.lse};
  }
  const int64_t partitions = paged::partitions_of(block_tables, key_cache);
  TORCH_CHECK_VALUE(partitions <= 65535, paged::kOp, ": a row's table holds ", block_tables.size(1) * key_cache.size(2),
                    " slots, more than the kernel's grid takes (65535 x ", kPartition, ")");
  paged::Buffers b = paged::empty_buffers(query, partitions);
  const Plan p = paged::make_plan(query, key_cache, value_cache, block_tables, seq_lens, query_positions, seq_starts,
                                  b.part_max, scale, window, softcap);
  const int64_t* positions = query_positions.has_value() ? query_positions->const_data_ptr<int64_t>() : nullptr;
  const int32_t* starts = seq_starts.has_value() ? seq_starts->const_data_ptr<int32_t>() : nullptr;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(p.rows * p.kv_heads), static_cast<unsigned>(partitions),
                  static_cast<unsigned>(p.chunks));
  TORCHKVOPS_DISPATCH_PAGED_TYPES(query.scalar_type(), "paged_attention", [&] {
    partition_kernel<scalar_t><<<grid, kPartition, 0, stream>>>(
        p, query.const_data_ptr<scalar_t>(), key_cache.const_data_ptr<scalar_t>(),
        value_cache.const_data_ptr<scalar_t>(), block_tables.const_data_ptr<int32_t>(),
        seq_lens.const_data_ptr<int32_t>(), starts, positions, b.part_max.mutable_data_ptr<float>(),
        b.part_sum.mutable_data_ptr<float>(), b.acc.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int threads = static_cast<int>(paged::min_i64(256, ((p.head_dim + 31) / 32) * 32));
    merge_kernel<scalar_t><<<static_cast<unsigned>(p.rows * p.heads), threads, 0, stream>>>(
        p, b.part_max.const_data_ptr<float>(), b.part_sum.const_data_ptr<float>(), b.acc.const_data_ptr<float>(),
        seq_lens.const_data_ptr<int32_t>(), b.out.mutable_data_ptr<scalar_t>(), b.lse.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {b.out, b.lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CUDA, m) { m.impl("paged_attention", &paged_attention_cuda); }

}  // namespace torchkvops
