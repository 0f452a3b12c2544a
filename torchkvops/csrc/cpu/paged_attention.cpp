// CPU kernel of paged_attention: the CUDA kernel's tasks (paged_attention.h) under at::parallel_for, each
// run by SerialBlock (a phase's threads one after another, the same order of every float operation), then
// each (row, head)'s partitions merged. Checks what the CUDA kernel cannot without a host sync: every
// length within the table's capacity, every start within [0, length], and every block id in use inside
// the pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <tuple>

#include "../paged_attention.h"

namespace torchkvops {
namespace {

using paged::kHeads;
using paged::Plan;

// The block policy of paged_attention.h on one CPU thread: fn(i) for i = 0, 1, ... in order; nothing to
// wait for.
struct SerialBlock {
  template <typename Fn>
  void for_threads(int n, Fn&& fn) {
    for (int i = 0; i < n; ++i) fn(i);
  }
  void sync() {}

  // (paged_attention.h's contract) Keys in the outer loop, head_dim innermost: each value row is read
  // once per head from contiguous memory and the d loop vectorizes; every out[h][d] still sums its
  // terms in increasing t.
  template <typename scalar_t>
  void accumulate(const paged::Scratch& sc, int n, int64_t keys, int64_t dim, const scalar_t* value_cache, float* out,
                  int64_t head_stride) {
    for (int h = 0; h < n; ++h) {
      float* __restrict__ o = out + h * head_stride;
      for (int64_t d = 0; d < dim; ++d) o[d] = 0.f;
      for (int64_t t = 0; t < keys; ++t) {
        const float e = sc.s[h][t];
        if (e == 0.f) continue;
        const scalar_t* __restrict__ v = value_cache + sc.v_off[t];
        for (int64_t d = 0; d < dim; ++d) o[d] = dmath::add_rn(o[d], dmath::mul_rn(e, static_cast<float>(v[d])));
      }
    }
  }
};

// Each row's length within its table's capacity, its start within [0, length], and the ids of the blocks
// it reads inside the pool.
void check_values(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  const c10::optional<at::Tensor>& seq_starts, int64_t num_blocks, int64_t block_size) {
  const auto lens = seq_lens.accessor<int32_t, 1>();
  const auto tables = block_tables.accessor<int32_t, 2>();
  const int64_t capacity = block_tables.size(1) * block_size;
  for (int64_t r = 0; r < seq_lens.size(0); ++r) {
    const int64_t length = lens[r];
    TORCH_CHECK_VALUE(length >= 0 && length <= capacity, paged::kOp, ": seq_lens[", r, "] = ", length,
                      " is outside [0, ", capacity, "] (max_blocks x block_size)");
    const int64_t start = seq_starts.has_value() ? seq_starts->accessor<int32_t, 1>()[r] : 0;
    TORCH_CHECK_VALUE(start >= 0 && start <= length, paged::kOp, ": seq_starts[", r, "] = ", start,
                      " is outside [0, seq_lens[", r, "] = ", length, "]");
    for (int64_t b = start / block_size; b * block_size < length; ++b) {
      TORCH_CHECK_VALUE(tables[r][b] >= 0 && tables[r][b] < num_blocks, paged::kOp, ": block_tables[", r, "][", b,
                        "] = ", tables[r][b], " is not a block of the pool [0, ", num_blocks, ")");
    }
  }
}

template <typename scalar_t>
void attend_cpu(const Plan& p, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, const int32_t* starts,
                const int64_t* positions, at::Tensor& part_max, at::Tensor& part_sum, at::Tensor& acc, at::Tensor& out,
                at::Tensor& lse) {
  const scalar_t* q = query.const_data_ptr<scalar_t>();
  const scalar_t* k = key_cache.const_data_ptr<scalar_t>();
  const scalar_t* v = value_cache.const_data_ptr<scalar_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  float* pmax = part_max.mutable_data_ptr<float>();
  float* psum = part_sum.mutable_data_ptr<float>();
  float* a = acc.mutable_data_ptr<float>();
  const int64_t per_kv = p.per_kv();
  // A task per (row, KV head, chunk), its row's live partitions one after another (the CUDA kernel's
  // blocks for the partitions past a row's length exit at once; here they are not run at all).
  const int64_t tasks = p.rows * p.kv_heads * p.chunks;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    auto scratch = std::make_unique<paged::Scratch>();  // (about 40 KB: not on the stack)
    SerialBlock block;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task % p.chunks;
      const int64_t kv = (task / p.chunks) % p.kv_heads;
      const int64_t row = task / p.chunks / p.kv_heads;
      const int64_t head0 = kv * per_kv + chunk * kHeads;
      const int n = static_cast<int>(std::min<int64_t>(kHeads, per_kv - chunk * kHeads));
      const int64_t live = paged::live_partitions(p, lens, row);
      for (int64_t part = 0; part < live; ++part)
        paged::attend_partition(block, *scratch, p, q, k, v, tables, lens, starts, positions, pmax, psum, a, row, kv,
                                head0, n, part);
    }
  });
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  float* l = lse.mutable_data_ptr<float>();
  at::parallel_for(0, p.rows * p.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / p.heads, head = item % p.heads;
      const int64_t at = row * p.part_row + head * p.part_head;
      const int64_t live = paged::live_partitions(p, lens, row);
      const paged::Merged merged = paged::merge_partitions(p, pmax, psum, at, live);
      float row_out[paged::kMaxHeadDim];
      paged::merged_row(p, pmax, psum, a + item * p.head_dim, at, live, merged, row_out);
      for (int64_t d = 0; d < p.head_dim; ++d) o[item * p.head_dim + d] = static_cast<scalar_t>(row_out[d]);
      l[item] = merged.lse;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                                                       const at::Tensor& seq_lens,
                                                       const c10::optional<at::Tensor>& query_positions, double scale,
                                                       int64_t window, double softcap,
                                                       const c10::optional<at::Tensor>& seq_starts) {
  paged::check_args(query, key_cache, value_cache, block_tables, seq_lens, query_positions, scale, window, softcap,
                    seq_starts);
  TORCH_INTERNAL_ASSERT(query.device().is_cpu());
  if (query.numel() == 0) {
    const paged::Buffers b = paged::empty_buffers(query, 0);
    return {b.out, b.lse};
  }
  check_values(block_tables, seq_lens, seq_starts, key_cache.size(0), key_cache.size(2));
  paged::Buffers b = paged::empty_buffers(query, paged::partitions_of(block_tables, key_cache));
  const Plan p = paged::make_plan(query, key_cache, value_cache, block_tables, seq_lens, query_positions, seq_starts,
                                  b.part_max, scale, window, softcap);
  const int64_t* positions = query_positions.has_value() ? query_positions->const_data_ptr<int64_t>() : nullptr;
  const int32_t* starts = seq_starts.has_value() ? seq_starts->const_data_ptr<int32_t>() : nullptr;
  TORCHKVOPS_DISPATCH_PAGED_TYPES(query.scalar_type(), "paged_attention", [&] {
    attend_cpu<scalar_t>(p, query, key_cache, value_cache, block_tables, seq_lens, starts, positions, b.part_max,
                         b.part_sum, b.acc, b.out, b.lse);
  });
  return {b.out, b.lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CPU, m) { m.impl("paged_attention", &paged_attention_cpu); }

}  // namespace torchkvops
