// CPU kernels of write_kv_ and write_kv_slots_: every (K/V, row, head, token) is one head_dim run, copied with memcpy
// when head_dim is contiguous on both sides (always, for the rollout), element by element otherwise.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>

#include "../write_kv.h"

namespace torchkvops {
namespace {

// Each parallel task copies at least this many runs, so a decode step's small write stays on one thread.
constexpr int64_t kMinRunsPerTask = 512;

// Both ops' copies, once `index` (the starts or the slots) was checked.
void copy_runs(const KVWritePlan& p, at::Tensor& cache, const at::Tensor& key, const at::Tensor& value, int64_t layer,
               const int64_t* index) {
  const int64_t elem = static_cast<int64_t>(cache.element_size());
  char* dst_base = static_cast<char*>(cache.data_ptr()) + layer * cache.stride(0) * elem;
  const char* src_base[2] = {static_cast<const char*>(key.data_ptr()), static_cast<const char*>(value.data_ptr())};
  const bool dense = p.dst_strides[3] == 1 && p.src_strides[0][3] == 1 && p.src_strides[1][3] == 1;
  const int64_t runs = 2 * p.rows * p.heads * p.tokens;
  at::parallel_for(0, runs, kMinRunsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t run = begin; run < end; ++run) {
      int64_t src_off, dst_off, placed_by;
      const int64_t kv = p.run_offsets(run, index, &src_off, &dst_off, &placed_by);
      const int64_t* ss = p.src_strides[kv];
      const char* src = src_base[kv] + src_off * elem;
      char* dst = dst_base + dst_off * elem;
      if (dense) {
        std::memcpy(dst, src, p.head_dim * elem);
      } else {
        for (int64_t d = 0; d < p.head_dim; ++d)
          std::memcpy(dst + d * p.dst_strides[3] * elem, src + d * ss[3] * elem, elem);
      }
    }
  });
}

void write_kv_cpu_(at::Tensor& cache, const at::Tensor& key, const at::Tensor& value, int64_t layer,
                   const at::Tensor& start) {
  const KVWritePlan p = check_write_kv_args(cache, key, value, layer, start);
  const int64_t* first = start.data_ptr<int64_t>();
  check_write_kv_start(first, start.numel(), p);
  copy_runs(p, cache, key, value, layer, first);
}

void write_kv_slots_cpu_(at::Tensor& cache, const at::Tensor& key, const at::Tensor& value, int64_t layer,
                         const at::Tensor& slots) {
  const KVWritePlan p = check_write_kv_slots_args(cache, key, value, layer, slots);
  const int64_t* index = slots.data_ptr<int64_t>();
  check_write_kv_slots(index, p);
  copy_runs(p, cache, key, value, layer, index);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CPU, m) {
  m.impl("write_kv_", &write_kv_cpu_);
  m.impl("write_kv_slots_", &write_kv_slots_cpu_);
}

}  // namespace torchkvops
