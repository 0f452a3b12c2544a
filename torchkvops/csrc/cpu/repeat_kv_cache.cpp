// CPU kernels of repeat_kv_cache_ and repeat_kv_cache: each destination row's contiguous byte runs
// are copied with memcpy, spread over threads with at::parallel_for.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../repeat_kv_cache.h"

namespace torchkvops {
namespace {

// Each parallel task copies at least this many bytes, so small copies don't pay for thread wake-ups.
constexpr int64_t kMinBytesPerTask = 256 * 1024;

// Items (destination row, run) are ordered tile by tile: a tile is up to kTileBytes of consecutive
// runs, and every destination row of the call is written from it before the next tile. So each
// source tile is read from memory once and served from the core's L2 for its other repeats - 1
// destinations. Row by row, a source row bigger than the last-level cache was read again from
// memory for each of its destinations (0.8x of a Tensor.copy_'s bandwidth at a 1 GiB cache).
constexpr int64_t kTileBytes = 256 * 1024;

// Destination rows [d0, d1) of `dst` receive source row d / repeats of `src`.
void copy_rows(const RowCopyPlan& plan, const char* src, char* dst, int64_t d0, int64_t d1, int64_t repeats) {
  const int64_t rows = d1 - d0;
  const int64_t items = rows * plan.runs_per_row;
  if (items <= 0 || plan.run_bytes == 0) return;
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / plan.run_bytes);
  const int64_t tile = std::clamp<int64_t>(kTileBytes / plan.run_bytes, 1, plan.runs_per_row);  // runs
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      // Every tile but the last holds `tile` runs, so tile t's items start at t * rows * tile.
      const int64_t t = item / (rows * tile);
      const int64_t first_run = t * tile;
      const int64_t runs_in_tile = std::min(tile, plan.runs_per_row - first_run);
      const int64_t k = item - t * rows * tile;
      const int64_t d = d0 + k / runs_in_tile;
      int64_t src_off, dst_off;
      plan.run_offsets(first_run + k % runs_in_tile, &src_off, &dst_off);
      std::memcpy(dst + d * plan.dst_row_stride + dst_off, src + (d / repeats) * plan.src_row_stride + src_off,
                  plan.run_bytes);
    }
  });
}

void repeat_kv_cache_cpu_(at::Tensor& cache, int64_t batch, int64_t repeats, int64_t num_tokens) {
  check_repeat_args(cache, batch, repeats, num_tokens);
  TORCH_INTERNAL_ASSERT(cache.device().is_cpu());
  const RowCopyPlan plan = make_row_copy_plan(cache, cache, num_tokens, "repeat_kv_cache_");
  char* base = static_cast<char*>(cache.data_ptr());
  for_each_level(batch, repeats, [&](int64_t lo, int64_t hi) {
    // Row 0 is its own first destination: skip it.
    copy_rows(plan, base, base, lo == 0 ? 1 : lo * repeats, hi * repeats, repeats);
  });
}

at::Tensor repeat_kv_cache_cpu(const at::Tensor& cache, int64_t repeats) {
  check_functional_args(cache, repeats);
  TORCH_INTERNAL_ASSERT(cache.device().is_cpu());
  at::Tensor out = empty_repeated(cache, repeats);
  const RowCopyPlan plan = make_row_copy_plan(cache, out, cache.size(kTokenDim), "repeat_kv_cache");
  copy_rows(plan, static_cast<const char*>(cache.data_ptr()), static_cast<char*>(out.data_ptr()), 0, out.size(kRowDim),
            repeats);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CPU, m) {
  m.impl("repeat_kv_cache_", &repeat_kv_cache_cpu_);
  m.impl("repeat_kv_cache", &repeat_kv_cache_cpu);
}

}  // namespace torchkvops
