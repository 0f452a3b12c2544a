// CUDA kernels of repeat_kv_cache_ and repeat_kv_cache. One launch per level of the in-place order
// (see repeat_kv_cache.h), on the current stream, with no host sync and no allocation, so the
// in-place op can be captured in a CUDA graph. Runs are moved in the widest vector (16 bytes down
// to 1) that every address and stride allows.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../repeat_kv_cache.h"

namespace torchkvops {
namespace {

constexpr int kThreadsPerBlock = 256;

// Destination rows [first_dst_row, first_dst_row + num_rows) of dst receive source row d / repeats of
// src. An item is one (destination row, run) pair, numbered run-major: the destinations of one run
// are neighbours, so blocks running at the same time read the same source run and it comes from L2
// for all but the first of its `repeats` copies, even when a row is larger than L2. threadIdx.y
// picks the item within the block, threadIdx.x walks the run's vectors. Sources and destinations
// never overlap within one launch (the level order guarantees it), hence __restrict__.
template <typename Vec>
__global__ void copy_rows_kernel(const RowCopyPlan plan,
                                 const char* __restrict__ src,  // row d/repeats, runs per plan
                                 char* __restrict__ dst,        // row d, runs per plan
                                 int64_t first_dst_row, int64_t num_rows, int64_t num_items, int64_t repeats) {
  const int64_t vecs_per_run = plan.run_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t item_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; item < num_items;
       item += item_stride) {
    const int64_t d = first_dst_row + item % num_rows;
    int64_t src_off, dst_off;
    plan.run_offsets(item / num_rows, &src_off, &dst_off);
    const Vec* s = reinterpret_cast<const Vec*>(src + (d / repeats) * plan.src_row_stride + src_off);
    Vec* t = reinterpret_cast<Vec*>(dst + d * plan.dst_row_stride + dst_off);
#pragma unroll 4
    for (int64_t v = threadIdx.x; v < vecs_per_run; v += blockDim.x) t[v] = s[v];
  }
}

// The widest power-of-two width, up to 16 bytes, that divides every address, stride and run length.
int vector_width(const RowCopyPlan& plan, const void* src, const void* dst) {
  uint64_t bits = 16 | reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                  static_cast<uint64_t>(plan.run_bytes) | static_cast<uint64_t>(plan.src_row_stride) |
                  static_cast<uint64_t>(plan.dst_row_stride);
  for (int i = 0; i < plan.ndim; ++i)
    bits |= static_cast<uint64_t>(plan.src_strides[i]) | static_cast<uint64_t>(plan.dst_strides[i]);
  return static_cast<int>(bits & (~bits + 1));  // lowest set bit
}

// Streaming multiprocessors of the current device. A cheap driver query with no sync; ATen's
// device-properties helper would pull in the cuBLAS and cuSPARSE headers, which a minimal toolkit lacks.
int64_t multiprocessor_count() {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return count;
}

template <typename Vec>
void launch(const RowCopyPlan& plan, const char* src, char* dst, int64_t d0, int64_t rows, int64_t items,
            int64_t repeats, cudaStream_t stream) {
  const int64_t vecs = plan.run_bytes / static_cast<int64_t>(sizeof(Vec));
  // Just enough threads to cover a run in one pass (up to the block): a short run leaves the rest of
  // the warp to neighbouring items (each still a contiguous, coalesced stretch) instead of idling.
  int tx = 1;
  while (tx < kThreadsPerBlock && tx < vecs) tx *= 2;
  const dim3 block(tx, kThreadsPerBlock / tx);
  const int64_t sms = multiprocessor_count();
  const int64_t wanted = (items + block.y - 1) / block.y;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(wanted, sms * 16)));
  copy_rows_kernel<Vec><<<grid, block, 0, stream>>>(plan, src, dst, d0, rows, items, repeats);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void copy_rows(const RowCopyPlan& plan, const char* src, char* dst, int64_t d0, int64_t d1, int64_t repeats,
               cudaStream_t stream) {
  const int64_t items = (d1 - d0) * plan.runs_per_row;
  if (items <= 0 || plan.run_bytes == 0) return;
  switch (vector_width(plan, src, dst)) {
    case 16:
      return launch<uint4>(plan, src, dst, d0, d1 - d0, items, repeats, stream);
    case 8:
      return launch<uint2>(plan, src, dst, d0, d1 - d0, items, repeats, stream);
    case 4:
      return launch<uint32_t>(plan, src, dst, d0, d1 - d0, items, repeats, stream);
    case 2:
      return launch<uint16_t>(plan, src, dst, d0, d1 - d0, items, repeats, stream);
    default:
      return launch<uint8_t>(plan, src, dst, d0, d1 - d0, items, repeats, stream);
  }
}

void repeat_kv_cache_cuda_(at::Tensor& cache, int64_t batch, int64_t repeats, int64_t num_tokens) {
  check_repeat_args(cache, batch, repeats, num_tokens);
  TORCH_INTERNAL_ASSERT(cache.device().is_cuda());
  const c10::cuda::OptionalCUDAGuard guard(cache.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const RowCopyPlan plan = make_row_copy_plan(cache, cache, num_tokens, "repeat_kv_cache_");
  char* base = static_cast<char*>(cache.data_ptr());
  for_each_level(batch, repeats, [&](int64_t lo, int64_t hi) {
    copy_rows(plan, base, base, lo == 0 ? 1 : lo * repeats, hi * repeats, repeats, stream);
  });
}

at::Tensor repeat_kv_cache_cuda(const at::Tensor& cache, int64_t repeats) {
  check_functional_args(cache, repeats);
  TORCH_INTERNAL_ASSERT(cache.device().is_cuda());
  const c10::cuda::OptionalCUDAGuard guard(cache.device());
  at::Tensor out = empty_repeated(cache, repeats);
  const RowCopyPlan plan = make_row_copy_plan(cache, out, cache.size(kTokenDim), "repeat_kv_cache");
  copy_rows(plan, static_cast<const char*>(cache.data_ptr()), static_cast<char*>(out.data_ptr()), 0, out.size(kRowDim),
            repeats, c10::cuda::getCurrentCUDAStream());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CUDA, m) {
  m.impl("repeat_kv_cache_", &repeat_kv_cache_cuda_);
  m.impl("repeat_kv_cache", &repeat_kv_cache_cuda);
}

}  // namespace torchkvops
