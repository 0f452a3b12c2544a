// CUDA kernel of write_kv_ and write_kv_slots_: one launch writes a layer's K and V (as vLLM's
// reshape_and_cache does; write_kv_slots_ by slot, into a pool of blocks),
// on the current stream, with no host sync and no allocation, so a decode step can be captured in a
// CUDA graph. `start` (one position, or one per row) stays on the device: each thread reads its row's and
// checks the range before writing, so an out-of-range start writes nothing of its row and raises a
// device-side assert, as torch's own indexing kernels do with device-resident indices (a host-side check
// would cost a sync per call).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../write_kv.h"

namespace torchkvops {
namespace {

constexpr int kThreadsPerBlock = 256;

// An item is one Vec of one (K/V, row, head, token) run of head_dim elements. With Vec wider than an
// element, head_dim is contiguous on both sides and `vecs_per_run` Vecs make a run; otherwise Vec is
// one element and the strides at dim 3 are used.
template <typename Vec>
__global__ void write_kv_kernel(
    const KVWritePlan p,
    const char* __restrict__ key,       // [rows, heads, tokens, head_dim]
    const char* __restrict__ value,     // same shape as key
    char* __restrict__ layer_cache,     // cache[layer]: [2, rows' (or blocks), heads, max_tokens, head_dim]
    const int64_t* __restrict__ start,  // [1] or [rows]; slot mode: [rows * tokens], the slots
    int64_t elem, int64_t vecs_per_run, int64_t items) {
  // (Slot mode: each item checks its own slot below; with nothing to write there is no slot to check.)
  if (!p.slot_mode && p.start_stride == 0) {  // one start for every row: checked once, before anything is written
    const bool in_range = p.start_fits(*start);
    CUDA_KERNEL_ASSERT(in_range && "write_kv_: start + tokens must fit the cache's max_tokens");
    if (!in_range) return;
  } else if (!p.slot_mode && items == 0) {  // nothing to write: each row's start is still checked, as on the CPU
    for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < p.rows;
         r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      CUDA_KERNEL_ASSERT(p.start_fits(start[r]) && "write_kv_: start + tokens must fit the cache's max_tokens");
    }
    return;
  }
  const int64_t elems_per_vec = static_cast<int64_t>(sizeof(Vec)) / elem;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
       item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = item % vecs_per_run;
    int64_t src_off, dst_off, placed_by;
    const int64_t kv = p.run_offsets(item / vecs_per_run, start, &src_off, &dst_off, &placed_by);
    if (p.slot_mode || p.start_stride != 0) {
      const bool in_range = p.fits(placed_by);
      CUDA_KERNEL_ASSERT(in_range && "write_kv_ / write_kv_slots_: a start or slot outside the cache");
      if (!in_range) continue;
    }
    const int64_t d = v * elems_per_vec;  // first element of this Vec within head_dim
    const char* src = (kv == 0 ? key : value) + (src_off + d * p.src_strides[kv][3]) * elem;
    char* dst = layer_cache + (dst_off + d * p.dst_strides[3]) * elem;
    *reinterpret_cast<Vec*>(dst) = *reinterpret_cast<const Vec*>(src);
  }
}

template <typename Vec>
void launch(const KVWritePlan& p, const at::Tensor& key, const at::Tensor& value, char* layer_cache,
            const at::Tensor& start, int64_t elem) {
  const int64_t vecs_per_run = p.head_dim * elem / static_cast<int64_t>(sizeof(Vec));
  const int64_t items = 2 * p.rows * p.heads * p.tokens * vecs_per_run;
  // At least one block even with nothing to write: the kernel also checks `start`, and an empty write
  // must reject a bad start on CUDA as it does on CPU.
  const int64_t blocks = std::clamp<int64_t>((items + kThreadsPerBlock - 1) / kThreadsPerBlock, 1, 65535);
  write_kv_kernel<Vec><<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
      p, static_cast<const char*>(key.data_ptr()), static_cast<const char*>(value.data_ptr()), layer_cache,
      start.data_ptr<int64_t>(), elem, vecs_per_run, items);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The widest Vec (16 bytes down to one element) that a contiguous head_dim run allows, given every
// address and stride in bytes.
int vector_bytes(const KVWritePlan& p, const void* key, const void* value, const void* cache, int64_t elem) {
  const bool dense = p.dst_strides[3] == 1 && p.src_strides[0][3] == 1 && p.src_strides[1][3] == 1;
  if (!dense) return static_cast<int>(elem);
  uint64_t bits = 16 | reinterpret_cast<uintptr_t>(key) | reinterpret_cast<uintptr_t>(value) |
                  reinterpret_cast<uintptr_t>(cache) | static_cast<uint64_t>(p.head_dim * elem) |
                  static_cast<uint64_t>(p.dst_kv_stride * elem);
  for (int d = 0; d < 3; ++d) {
    bits |= static_cast<uint64_t>(p.src_strides[0][d] * elem) | static_cast<uint64_t>(p.src_strides[1][d] * elem) |
            static_cast<uint64_t>(p.dst_strides[d] * elem);
  }
  return static_cast<int>(bits & (~bits + 1));  // lowest set bit
}

// Both ops, once their arguments were checked (`index`: the starts or the slots, on the device).
void write_runs(const KVWritePlan& p, at::Tensor& cache, const at::Tensor& key, const at::Tensor& value, int64_t layer,
                const at::Tensor& start) {
  const c10::cuda::OptionalCUDAGuard guard(cache.device());
  const int64_t elem = static_cast<int64_t>(cache.element_size());
  char* layer_cache = static_cast<char*>(cache.data_ptr()) + layer * cache.stride(0) * elem;
  switch (vector_bytes(p, key.data_ptr(), value.data_ptr(), layer_cache, elem)) {
    case 16:
      return launch<uint4>(p, key, value, layer_cache, start, elem);
    case 8:
      return launch<uint2>(p, key, value, layer_cache, start, elem);
    case 4:
      return launch<uint32_t>(p, key, value, layer_cache, start, elem);
    case 2:
      return launch<uint16_t>(p, key, value, layer_cache, start, elem);
    default:
      return launch<uint8_t>(p, key, value, layer_cache, start, elem);
  }
}

void write_kv_cuda_(at::Tensor& cache, const at::Tensor& key, const at::Tensor& value, int64_t layer,
                    const at::Tensor& start) {
  write_runs(check_write_kv_args(cache, key, value, layer, start), cache, key, value, layer, start);
}

void write_kv_slots_cuda_(at::Tensor& cache, const at::Tensor& key, const at::Tensor& value, int64_t layer,
                          const at::Tensor& slots) {
  write_runs(check_write_kv_slots_args(cache, key, value, layer, slots), cache, key, value, layer, slots);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CUDA, m) {
  m.impl("write_kv_", &write_kv_cuda_);
  m.impl("write_kv_slots_", &write_kv_slots_cuda_);
}

}  // namespace torchkvops
