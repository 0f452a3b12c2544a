// paged_attention: one decode query per row against that row's keys in a pool of fixed-size KV blocks,
// reading only the keys the row has written (its length is data: seq_lens), as flash-decoding does.
// Shared by the CPU and CUDA kernels: argument checks, the plan (shapes and strides), and the algorithm
// itself, written once over a *block policy* so that both kernels run the same code in the same order:
//
//   A task is (row, KV head, chunk of up to kHeads of its query heads, partition of kPartition keys). The
//   CUDA kernel runs one task per thread block of kPartition threads; the CPU kernel runs tasks under
//   at::parallel_for with SerialBlock, which executes a phase's threads one after another. A task:
//     1. loads its query heads into float scratch;
//     2. scores key `base + i` with thread i: scale * q.k (the dot in kLanes interleaved partial sums,
//        summed pairwise: `dot`), then capped (softcap * tanh(s / softcap)) when softcap > 0; a key the
//        query does not see scores -inf (`visible`);
//     3. per head, the partition's max and the sum of exp(s - max) by one tree over the partition's
//        keys (stride kPartition / 2 down to 1: `tree_reduce`);
//     4. per (head, d), the sum over the partition's keys, in key order, of exp(s - max) * v[d];
//     5. writes (max, sum, unnormalized output) for each head: a partial attention.
//   A second pass (`merge_partitions`) merges each (row, head)'s partitions in order: lse = M + log(sum of
//   e^(max_p - M) sum_p), out = (sum of e^(max_p - M) acc_p) / (sum of e^(max_p - M) sum_p).
//
// So the CPU tests run the CUDA kernel's per-row logic: the two agree to the last bit except where a
// result depends on exp, log or tanh (device_math.h: 1-2 ulp apart). Every float product and sum goes
// through device_math's mul_rn / add_rn (no fused multiply-add on the device).
//
// A row reads keys [seq_starts[row], seq_lens[row]) of its block table (without seq_starts: from 0; the
// keys before a row's start are never read: a left-padded prompt's padding): key t lies in block
// block_tables[row][t / block_size] at slot t % block_size. Its query sits at position query_positions[row][head]
// (without them: seq_lens[row] - 1) and sees key t when t <= position and, with window > 0, position - t < window
// (transformers' sliding window; partitions wholly before every query's window are not read, so that a
// windowed layer's work follows its window). A row that sees no key gets out = 0 and lse = -inf (what
// merge_attention_states takes as an empty part). Lengths past the table's capacity and block ids outside
// the pool are errors the CPU kernel raises; the CUDA kernel cannot check data without a host sync, so it
// clamps them into range (the values read are then garbage, never memory outside the pool).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "device_math.h"
#include "macros.h"

// Runs __VA_ARGS__ with scalar_t = the C++ type of TYPE, one of the dtypes the op takes.
#define TORCHKVOPS_DISPATCH_PAGED_TYPES(TYPE, NAME, ...)                                                \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                                                        \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace torchkvops {
namespace paged {

constexpr const char* kOp = "paged_attention";
constexpr int kPartition = 256;  // keys per partition: one CUDA thread per key
constexpr int kHeads = 8;        // query heads of one KV head per task
constexpr int kLanes = 8;        // partial sums of a dot product
constexpr int kMaxHeadDim = 256;

// Shapes, strides (elements) and settings of one call. Passed by value to the CUDA kernels.
struct Plan {
  int64_t rows, heads, kv_heads, head_dim, num_blocks, block_size, max_blocks, partitions, chunks;
  int64_t q_row, q_head;                // query [rows, heads, head_dim], head_dim contiguous
  int64_t k_block, k_head, k_slot;      // key_cache [num_blocks, kv_heads, block_size, head_dim]
  int64_t v_block, v_head, v_slot;      // value_cache, the same shape
  int64_t table_row, table_col;         // block_tables [rows, max_blocks] int32
  int64_t len_row;                      // seq_lens [rows] int32
  int64_t start_row;                    // seq_starts [rows] int32, when has_starts
  int64_t pos_row, pos_head;            // query_positions [rows, heads] int64, when has_positions
  int64_t part_row, part_head, part_p;  // partial max / sum, [rows, heads, partitions] strides, float32
  float scale, softcap;
  int64_t window;
  bool has_positions, has_starts;

  TORCHKVOPS_HOST_DEVICE_INLINE int64_t per_kv() const { return heads / kv_heads; }
};

TORCHKVOPS_HOST_DEVICE_INLINE int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }
TORCHKVOPS_HOST_DEVICE_INLINE int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

// Row `row`'s length, clamped into its table's capacity (the CPU kernel checks it first; see the file comment).
TORCHKVOPS_HOST_DEVICE_INLINE int64_t row_length(const Plan& p, const int32_t* seq_lens, int64_t row) {
  return min_i64(max_i64(seq_lens[row * p.len_row], 0), p.max_blocks * p.block_size);
}

// Row `row`'s first key, clamped into [0, length] (0 without seq_starts; the CPU kernel checks it first).
TORCHKVOPS_HOST_DEVICE_INLINE int64_t row_start(const Plan& p, const int32_t* seq_starts, int64_t row, int64_t length) {
  return p.has_starts ? min_i64(max_i64(seq_starts[row * p.start_row], 0), length) : 0;
}

// Whether a query at `position` sees key t of a row whose keys are [start, length).
TORCHKVOPS_HOST_DEVICE_INLINE bool visible(int64_t t, int64_t start, int64_t length, int64_t position, int64_t window) {
  return t >= start && t < length && t <= position && (window <= 0 || position - t < window);
}

// softcap * tanh(s / softcap), as transformers' eager attention caps scores; s itself when softcap <= 0.
TORCHKVOPS_HOST_DEVICE_INLINE float capped(float s, float softcap) {
  return softcap > 0.f ? dmath::mul_rn(softcap, dmath::tanh_f(s / softcap)) : s;
}

// q . k over head_dim: kLanes interleaved partial sums (lane j: d = j, j + kLanes, ..., in order), then
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). The same order on both devices; the CPU compiler
// vectorizes the lanes.
template <typename scalar_t>
TORCHKVOPS_HOST_DEVICE_INLINE float dot(const float* q, const scalar_t* k, int64_t head_dim) {
  float lane[kLanes];
  TORCHKVOPS_UNROLL
  for (int j = 0; j < kLanes; ++j) lane[j] = 0.f;
  int64_t d = 0;
  for (; d + kLanes <= head_dim; d += kLanes) {
    TORCHKVOPS_UNROLL
    for (int j = 0; j < kLanes; ++j)
      lane[j] = dmath::add_rn(lane[j], dmath::mul_rn(q[d + j], static_cast<float>(k[d + j])));
  }
  for (int j = 0; d + j < head_dim; ++j)
    lane[j] = dmath::add_rn(lane[j], dmath::mul_rn(q[d + j], static_cast<float>(k[d + j])));
  return dmath::add_rn(dmath::add_rn(dmath::add_rn(lane[0], lane[1]), dmath::add_rn(lane[2], lane[3])),
                       dmath::add_rn(dmath::add_rn(lane[4], lane[5]), dmath::add_rn(lane[6], lane[7])));
}

// The element offset of key t's slot in a cache of the given block and slot strides, for a row's table.
TORCHKVOPS_HOST_DEVICE_INLINE int64_t slot_offset(const Plan& p, const int32_t* table, int64_t t, int64_t block_stride,
                                                  int64_t slot_stride) {
  int64_t block = table[(t / p.block_size) * p.table_col];
  block = min_i64(max_i64(block, 0), p.num_blocks - 1);  // (checked on the CPU; see the file comment)
  return block * block_stride + (t % p.block_size) * slot_stride;
}

// The scratch a task needs: on the CUDA kernel's shared memory, on the CPU a stack frame.
struct Scratch {
  float q[kHeads][kMaxHeadDim];
  float s[kHeads][kPartition];  // scores, then exp(s - max)
  float tree[kPartition];       // a reduction's values
  float max[kHeads], sum[kHeads];
  int64_t k_off[kPartition], v_off[kPartition];  // each key's slot in key_cache / value_cache
};

// x[0] = op over x[0 .. kPartition), where x[i] for i >= `count` is op's identity (not read): at each
// stride (kPartition / 2 down to 1) thread i < stride sets x[i] = op(x[i], x[i + stride]), skipping the
// steps whose right operand is an identity (exact: op(a, identity) = a), so that a partition of few keys
// costs few steps.
TORCHKVOPS_NO_EXEC_CHECK
template <typename Block, typename Op>
TORCHKVOPS_HOST_DEVICE inline float tree_reduce(Block& block, float* x, int count, Op op) {
  for (int stride = kPartition / 2; stride > 0; stride /= 2) {
    const int steps = count - stride;  // x[i + stride] holds a value for i < count - stride
    if (steps > 0) {
      block.for_threads(steps, [&](int i) { x[i] = op(x[i], x[i + stride]); });
      block.sync();
    }
    count = count < stride ? count : stride;
  }
  return x[0];
}

TORCHKVOPS_HOST_DEVICE_INLINE float max_op(float a, float b) { return b > a || b != b ? b : a; }  // NaN wins
TORCHKVOPS_HOST_DEVICE_INLINE float add_op(float a, float b) { return dmath::add_rn(a, b); }

// One task (file comment): partition `part` of `row`'s keys for query heads [head0, head0 + n) of KV head
// `kv`. Writes their partial max and sum (part_max, part_sum at [row, head, part] through the plan's
// strides) and unnormalized output (acc [partitions, rows, heads, head_dim] contiguous: the first
// partitions of every row, the ones most rows use, lie together). The Block policy provides
//   for_threads(n, fn)   fn(i) for every i < n, spread over the block's threads;
//   sync()               a barrier;
//   accumulate(sc, n, keys, dim, value_cache, out, head_stride)
//                        out[h * head_stride + d] = the sum over t < keys, in increasing t, of
//                        add_rn(sum, mul_rn(sc.s[h][t], value of key t at d)) for every term with
//                        sc.s[h][t] != 0 (value of key t: value_cache[sc.v_off[t] + d]), for h < n and
//                        d < dim: the same sums in the same order, each policy in the loop order that
//                        suits it (a thread per (h, d) on CUDA; d innermost, vectorized, on the CPU).
TORCHKVOPS_NO_EXEC_CHECK
template <typename Block, typename scalar_t>
TORCHKVOPS_HOST_DEVICE inline void attend_partition(Block& block, Scratch& sc, const Plan& p, const scalar_t* query,
                                                    const scalar_t* key_cache, const scalar_t* value_cache,
                                                    const int32_t* block_tables, const int32_t* seq_lens,
                                                    const int32_t* seq_starts, const int64_t* query_positions,
                                                    float* part_max, float* part_sum, float* acc, int64_t row,
                                                    int64_t kv, int64_t head0, int n, int64_t part) {
  const int64_t length = row_length(p, seq_lens, row);
  const int64_t start = row_start(p, seq_starts, row, length);
  const int32_t* table = block_tables + row * p.table_row;
  const int64_t dim = p.head_dim;
  int64_t position[kHeads];
  int64_t lowest = length;  // the task's lowest query position
  for (int h = 0; h < n; ++h) {
    position[h] = p.has_positions ? query_positions[row * p.pos_row + (head0 + h) * p.pos_head] : length - 1;
    lowest = min_i64(lowest, position[h]);
  }
  // The first key any of the task's queries sees: the row's start, or under a window the lowest query's
  // window's first key, so that the work follows the window, not the row's length.
  const int64_t first = p.window > 0 ? max_i64(start, lowest - p.window + 1) : start;
  const int64_t base = part * kPartition;
  // This partition's keys up to the row's length; none when it lies wholly before the first key seen.
  const int64_t keys = base + kPartition <= first ? 0 : min_i64(max_i64(length - base, 0), kPartition);

  if (keys == 0) {  // outside the row's keys (the same for every thread): a partition that takes no part
    block.for_threads(n, [&](int h) {
      const int64_t at = row * p.part_row + (head0 + h) * p.part_head + part * p.part_p;
      part_max[at] = -INFINITY;
      part_sum[at] = 0.f;
    });
    return;
  }
  block.for_threads(n * static_cast<int>(dim), [&](int i) {
    const int h = i / static_cast<int>(dim), d = i % static_cast<int>(dim);
    sc.q[h][d] = static_cast<float>(query[row * p.q_row + (head0 + h) * p.q_head + d]);
  });
  block.for_threads(static_cast<int>(keys), [&](int i) {
    sc.k_off[i] = slot_offset(p, table, base + i, p.k_block, p.k_slot) + kv * p.k_head;
    sc.v_off[i] = slot_offset(p, table, base + i, p.v_block, p.v_slot) + kv * p.v_head;
  });
  block.sync();
  const int count = static_cast<int>(keys);  // (the scratch past it is neither written nor read)
  block.for_threads(count, [&](int i) {
    for (int h = 0; h < n; ++h) {
      float s = -INFINITY;
      if (visible(base + i, start, length, position[h], p.window))
        s = capped(dmath::mul_rn(dot(sc.q[h], key_cache + sc.k_off[i], dim), p.scale), p.softcap);
      sc.s[h][i] = s;
    }
  });
  block.sync();
  for (int h = 0; h < n; ++h) {
    block.for_threads(count, [&](int i) { sc.tree[i] = sc.s[h][i]; });
    block.sync();
    const float m = tree_reduce(block, sc.tree, count, max_op);
    block.for_threads(count, [&](int i) {
      const float s = sc.s[h][i];
      const float e = s == -INFINITY ? 0.f : dmath::exp_f(s - m);  // (m is -inf only when every s is)
      sc.s[h][i] = e;
      sc.tree[i] = e;
    });
    block.sync();
    const float total = tree_reduce(block, sc.tree, count, add_op);
    block.for_threads(1, [&](int) {
      sc.max[h] = m;
      sc.sum[h] = total;
    });
    block.sync();
  }
  block.accumulate(sc, n, keys, dim, value_cache, acc + ((part * p.rows + row) * p.heads + head0) * dim, dim);
  block.for_threads(n, [&](int h) {
    const int64_t at = row * p.part_row + (head0 + h) * p.part_head + part * p.part_p;
    part_max[at] = sc.max[h];
    part_sum[at] = sc.sum[h];
  });
}

// A (row, head)'s partitions merged in order (file comment): M, the largest partition max; 1 / L, L the
// sum of e^(max_p - M) sum_p; and the lse. A partition whose sum is 0 (no key seen) takes no part; none:
// lse -inf (and the output is 0).
struct Merged {
  float max, inv_total, lse;
};

TORCHKVOPS_HOST_DEVICE_INLINE float partition_weight(float part_max, float part_sum, float m) {
  return part_sum == 0.f ? 0.f : dmath::exp_f(part_max - m);
}

// The partitions that hold some of a row's keys: the others take no part (their sum is 0), and the merge
// stops before them (exact: their weight is 0), so that its cost follows the row's length, not the
// table's capacity.
TORCHKVOPS_HOST_DEVICE_INLINE int64_t live_partitions(const Plan& p, const int32_t* seq_lens, int64_t row) {
  return min_i64((row_length(p, seq_lens, row) + kPartition - 1) / kPartition, p.partitions);
}

// `at`: the (row, head)'s first partition in part_max / part_sum; `live`: live_partitions of its row.
TORCHKVOPS_HOST_DEVICE_INLINE Merged merge_partitions(const Plan& p, const float* part_max, const float* part_sum,
                                                      int64_t at, int64_t live) {
  float m = -INFINITY;
  for (int64_t q = 0; q < live; ++q) {
    if (part_sum[at + q * p.part_p] != 0.f) m = max_op(m, part_max[at + q * p.part_p]);
  }
  if (m == -INFINITY) return {m, 0.f, -INFINITY};
  float total = 0.f;
  for (int64_t q = 0; q < live; ++q) {
    const float w = partition_weight(part_max[at + q * p.part_p], part_sum[at + q * p.part_p], m);
    total = dmath::add_rn(total, dmath::mul_rn(w, part_sum[at + q * p.part_p]));
  }
  return {m, 1.f / total, dmath::add_rn(m, dmath::log_f(total))};
}

// The (row, head)'s whole output into out[0, head_dim): merged_element for every d, the partitions in the
// outer loop (each weight computed once; every element's sum in the same order).
TORCHKVOPS_HOST_DEVICE_INLINE void merged_row(const Plan& p, const float* part_max, const float* part_sum,
                                              const float* acc_head, int64_t at, int64_t live, const Merged& merged,
                                              float* out) {
  for (int64_t d = 0; d < p.head_dim; ++d) out[d] = 0.f;
  if (merged.lse == -INFINITY) return;
  for (int64_t q = 0; q < live; ++q) {
    const float w = partition_weight(part_max[at + q * p.part_p], part_sum[at + q * p.part_p], merged.max);
    if (w == 0.f) continue;
    const float* a = acc_head + q * p.rows * p.heads * p.head_dim;
    for (int64_t d = 0; d < p.head_dim; ++d) out[d] = dmath::add_rn(out[d], dmath::mul_rn(w, a[d]));
  }
  for (int64_t d = 0; d < p.head_dim; ++d) out[d] = dmath::mul_rn(out[d], merged.inv_total);
}

// Element d of the (row, head)'s output: sum over partitions, in order, of e^(max_p - M) acc_p[d], over L.
// `acc_head`: its first partition's unnormalized output in acc [partitions, rows, heads, head_dim].
TORCHKVOPS_HOST_DEVICE_INLINE float merged_element(const Plan& p, const float* part_max, const float* part_sum,
                                                   const float* acc_head, int64_t at, int64_t live,
                                                   const Merged& merged, int64_t d) {
  if (merged.lse == -INFINITY) return 0.f;
  float out = 0.f;
  for (int64_t q = 0; q < live; ++q) {
    const float w = partition_weight(part_max[at + q * p.part_p], part_sum[at + q * p.part_p], merged.max);
    if (w != 0.f) out = dmath::add_rn(out, dmath::mul_rn(w, acc_head[q * p.rows * p.heads * p.head_dim + d]));
  }
  return dmath::mul_rn(out, merged.inv_total);
}

// --- host side: checks and the plan ---------------------------------------------------------------
inline bool is_supported_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16;
}

inline void check_cache(const at::Tensor& cache, const at::Tensor& query, const char* name) {
  TORCH_CHECK_VALUE(cache.dim() == 4, kOp, ": ", name,
                    " must be 4-D [num_blocks, kv_heads, block_size, head_dim], got shape ", cache.sizes());
  TORCH_CHECK_TYPE(cache.scalar_type() == query.scalar_type(), kOp, ": ", name, " must have query's dtype ",
                   query.scalar_type(), ", got ", cache.scalar_type());
  TORCH_CHECK_VALUE(cache.device() == query.device(), kOp, ": ", name, " must be on query's device ", query.device(),
                    ", got ", cache.device());
  TORCH_CHECK_VALUE(cache.size(3) == query.size(2), kOp, ": ", name, "'s head_dim must be query's ", query.size(2),
                    ", got ", cache.size(3));
  TORCH_CHECK_VALUE(cache.size(3) <= 1 || cache.stride(3) == 1, kOp, ": ", name,
                    " must have a contiguous head_dim (stride 1), got strides ", cache.strides());
  TORCH_CHECK_VALUE(cache.size(0) >= 1 && cache.size(2) >= 1, kOp, ": ", name,
                    " must hold at least one block of at least one slot, got shape ", cache.sizes());
}

inline void check_args(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens,
                       const c10::optional<at::Tensor>& query_positions, double scale, int64_t window, double softcap,
                       const c10::optional<at::Tensor>& seq_starts) {
  TORCH_CHECK_VALUE(query.dim() == 3, kOp, ": query must be 3-D [rows, heads, head_dim], got shape ", query.sizes());
  TORCH_CHECK_TYPE(is_supported_dtype(query.scalar_type()), kOp, ": query dtype ", query.scalar_type(),
                   " is not supported; use float32, float16 or bfloat16");
  TORCH_CHECK_VALUE(query.size(2) >= 1 && query.size(2) <= kMaxHeadDim, kOp, ": head_dim must be in [1, ", kMaxHeadDim,
                    "], got ", query.size(2));
  TORCH_CHECK_VALUE(query.size(2) <= 1 || query.stride(2) == 1, kOp,
                    ": query must have a contiguous head_dim (stride 1), got strides ", query.strides());
  check_cache(key_cache, query, "key_cache");
  check_cache(value_cache, query, "value_cache");
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), kOp, ": value_cache must have key_cache's shape ",
                    key_cache.sizes(), ", got ", value_cache.sizes());
  const int64_t kv_heads = key_cache.size(1);
  TORCH_CHECK_VALUE(kv_heads >= 1 && query.size(1) % kv_heads == 0, kOp, ": query's heads (", query.size(1),
                    ") must be a multiple of the caches' kv_heads (", kv_heads, ")");
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) && block_tables.size(1) >= 1, kOp,
                    ": block_tables must be [rows, max_blocks] with rows = query's ", query.size(0),
                    " and max_blocks >= 1, got shape ", block_tables.sizes());
  TORCH_CHECK_TYPE(block_tables.scalar_type() == c10::ScalarType::Int, kOp, ": block_tables must be int32, got ",
                   block_tables.scalar_type());
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) == query.size(0), kOp,
                    ": seq_lens must be [rows] with rows = query's ", query.size(0), ", got shape ", seq_lens.sizes());
  TORCH_CHECK_TYPE(seq_lens.scalar_type() == c10::ScalarType::Int, kOp, ": seq_lens must be int32, got ",
                   seq_lens.scalar_type());
  for (const at::Tensor* t : {&block_tables, &seq_lens}) {
    TORCH_CHECK_VALUE(t->device() == query.device(), kOp, ": block_tables and seq_lens must be on query's device ",
                      query.device(), ", got ", t->device());
  }
  if (query_positions.has_value()) {
    const at::Tensor& pos = *query_positions;
    TORCH_CHECK_VALUE(pos.dim() == 2 && pos.size(0) == query.size(0) && pos.size(1) == query.size(1), kOp,
                      ": query_positions must be [rows, heads] = ", query.sizes().slice(0, 2), ", got shape ",
                      pos.sizes());
    TORCH_CHECK_TYPE(pos.scalar_type() == c10::ScalarType::Long, kOp, ": query_positions must be int64, got ",
                     pos.scalar_type());
    TORCH_CHECK_VALUE(pos.device() == query.device(), kOp, ": query_positions must be on query's device ",
                      query.device(), ", got ", pos.device());
  }
  if (seq_starts.has_value()) {
    const at::Tensor& starts = *seq_starts;
    TORCH_CHECK_VALUE(starts.dim() == 1 && starts.size(0) == query.size(0), kOp,
                      ": seq_starts must be [rows] with rows = query's ", query.size(0), ", got shape ",
                      starts.sizes());
    TORCH_CHECK_TYPE(starts.scalar_type() == c10::ScalarType::Int, kOp, ": seq_starts must be int32, got ",
                     starts.scalar_type());
    TORCH_CHECK_VALUE(starts.device() == query.device(), kOp, ": seq_starts must be on query's device ", query.device(),
                      ", got ", starts.device());
  }
  TORCH_CHECK_VALUE(std::isfinite(scale), kOp, ": scale must be finite, got ", scale);
  TORCH_CHECK_VALUE(window >= 0, kOp, ": window must be >= 0 (0: no window), got ", window);
  TORCH_CHECK_VALUE(softcap >= 0 && std::isfinite(softcap), kOp, ": softcap must be >= 0 (0: none), got ", softcap);
}

// The partitions a row of the table's capacity spans (at least one).
inline int64_t partitions_of(const at::Tensor& block_tables, const at::Tensor& key_cache) {
  const int64_t capacity = block_tables.size(1) * key_cache.size(2);
  return capacity == 0 ? 1 : (capacity + kPartition - 1) / kPartition;
}

// What a call allocates: its outputs (out in query's dtype, float32 lse [rows, heads], contiguous) and, when
// `partitions` > 0, the partial results, partition-major (acc [partitions, rows, heads, head_dim], the partial
// max and sum [partitions, rows, heads] viewed as [rows, heads, partitions]): a call touches the first
// partitions of its rows only, which lie together, whatever the table's capacity.
struct Buffers {
  at::Tensor out, lse, part_max, part_sum, acc;
};

inline Buffers empty_buffers(const at::Tensor& query, int64_t partitions) {
  Buffers b;
  b.out = at::empty(query.sizes(), query.options());
  b.lse = at::empty(query.sizes().slice(0, 2), query.options().dtype(at::kFloat));
  if (partitions > 0) {
    const auto f32 = query.options().dtype(at::kFloat);
    b.part_max = at::empty({partitions, query.size(0), query.size(1)}, f32).permute({1, 2, 0});
    b.part_sum = at::empty({partitions, query.size(0), query.size(1)}, f32).permute({1, 2, 0});
    b.acc = at::empty({partitions, query.size(0), query.size(1), query.size(2)}, f32);
  }
  return b;
}

// The plan; `part` is the partial max / sum buffer as [rows, heads, partitions] (any strides).
inline Plan make_plan(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      const c10::optional<at::Tensor>& query_positions, const c10::optional<at::Tensor>& seq_starts,
                      const at::Tensor& part, double scale, int64_t window, double softcap) {
  Plan p{};
  p.rows = query.size(0);
  p.heads = query.size(1);
  p.head_dim = query.size(2);
  p.num_blocks = key_cache.size(0);
  p.kv_heads = key_cache.size(1);
  p.block_size = key_cache.size(2);
  p.max_blocks = block_tables.size(1);
  p.partitions = part.size(2);
  p.chunks = (p.per_kv() + kHeads - 1) / kHeads;
  p.q_row = query.stride(0);
  p.q_head = query.stride(1);
  p.k_block = key_cache.stride(0);
  p.k_head = key_cache.stride(1);
  p.k_slot = key_cache.stride(2);
  p.v_block = value_cache.stride(0);
  p.v_head = value_cache.stride(1);
  p.v_slot = value_cache.stride(2);
  p.table_row = block_tables.stride(0);
  p.table_col = block_tables.stride(1);
  p.len_row = seq_lens.stride(0);
  p.has_starts = seq_starts.has_value();
  p.start_row = p.has_starts ? seq_starts->stride(0) : 0;
  p.has_positions = query_positions.has_value();
  p.pos_row = p.has_positions ? query_positions->stride(0) : 0;
  p.pos_head = p.has_positions ? query_positions->stride(1) : 0;
  p.part_row = part.stride(0);
  p.part_head = part.stride(1);
  p.part_p = part.stride(2);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.window = window;
  return p;
}

}  // namespace paged
}  // namespace torchkvops
