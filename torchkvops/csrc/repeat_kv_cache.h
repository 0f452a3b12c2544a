// Shared by the CPU and CUDA kernels of repeat_kv_cache_ / repeat_kv_cache: argument checks, the
// description of one row copy as byte runs, and the level order of the in-place expansion.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include <cstdint>
#include <limits>
#include <string>

#include "macros.h"

namespace torchkvops {

// Rows (the batch) sit at dim -4, token positions at dim -2.
constexpr int64_t kRowDim = -4;
constexpr int64_t kTokenDim = -2;

// After dims are merged, a row copy may still need this many strided dims; beyond it we refuse
// rather than silently copy. Any tensor viewed from one buffer of [layers, 2, rows, heads, tokens,
// head_dim] needs at most 4.
constexpr int kMaxRunDims = 6;

// Copying one source row into one destination row, described as `runs_per_row` contiguous runs of
// `run_bytes` bytes. Run k starts at sum_d(index_d(k) * stride_d) bytes from the row's start, with
// index_d the mixed-radix digits of k over `sizes` (innermost dim last). Passed by value to CUDA.
struct RowCopyPlan {
  int64_t run_bytes = 0;
  int64_t runs_per_row = 0;
  int ndim = 0;
  int64_t sizes[kMaxRunDims] = {};
  int64_t src_strides[kMaxRunDims] = {};  // bytes
  int64_t dst_strides[kMaxRunDims] = {};  // bytes
  int64_t src_row_stride = 0;             // bytes between consecutive rows of src
  int64_t dst_row_stride = 0;             // bytes between consecutive rows of dst

  TORCHKVOPS_HOST_DEVICE inline void run_offsets(int64_t run, int64_t* src_off, int64_t* dst_off) const {
    int64_t s = 0, d = 0;
    for (int i = ndim - 1; i >= 0; --i) {
      const int64_t idx = run % sizes[i];
      run /= sizes[i];
      s += idx * src_strides[i];
      d += idx * dst_strides[i];
    }
    *src_off = s;
    *dst_off = d;
  }
};

inline bool is_supported_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Double:  // for gradcheck
    case c10::ScalarType::Float:
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Byte:
    case c10::ScalarType::Char:
    case c10::ScalarType::Float8_e4m3fn:
    case c10::ScalarType::Float8_e5m2:
      return true;
    default:
      return false;
  }
}

inline void check_cache(const at::Tensor& cache, const char* op) {
  TORCH_CHECK_VALUE(cache.dim() >= 4, op,
                    ": cache must have at least 4 dims [..., rows, kv_heads, tokens, head_dim], got shape ",
                    cache.sizes());
  TORCH_CHECK_TYPE(is_supported_dtype(cache.scalar_type()), op, ": cache dtype ", cache.scalar_type(),
                   " is not supported; use float32, float16, bfloat16, float64, uint8, int8, "
                   "float8_e4m3fn or float8_e5m2");
}

inline void check_repeat_args(const at::Tensor& cache, int64_t batch, int64_t repeats, int64_t num_tokens) {
  const char* op = "repeat_kv_cache_";
  check_cache(cache, op);
  const int64_t rows = cache.size(kRowDim);
  const int64_t max_tokens = cache.size(kTokenDim);
  TORCH_CHECK_VALUE(batch >= 1, op, ": batch must be >= 1, got ", batch);
  TORCH_CHECK_VALUE(repeats >= 1, op, ": repeats must be >= 1, got ", repeats);
  // batch <= rows / repeats avoids overflowing batch * repeats.
  TORCH_CHECK_VALUE(batch <= rows / repeats, op, ": batch * repeats must be <= the cache's rows (dim -4 = ", rows,
                    "), got batch=", batch, ", repeats=", repeats);
  TORCH_CHECK_VALUE(num_tokens >= 1 && num_tokens <= max_tokens, op,
                    ": num_tokens must be in [1, max_tokens=", max_tokens, "] (dim -2), got ", num_tokens);
  TORCH_CHECK_VALUE(at::has_internal_overlap(cache) != at::MemOverlap::Yes, op,
                    ": cache must not have overlapping memory (an expanded or stride-0 tensor), got strides ",
                    cache.strides());
}

inline void check_functional_args(const at::Tensor& cache, int64_t repeats) {
  check_cache(cache, "repeat_kv_cache");
  TORCH_CHECK_VALUE(repeats >= 1, "repeat_kv_cache: repeats must be >= 1, got ", repeats);
  // The output holds numel * repeats elements: that product (and its bytes) must fit in int64.
  uint64_t bytes = 0;
  const bool overflows =
      c10::mul_overflows(static_cast<uint64_t>(cache.numel()), static_cast<uint64_t>(repeats), &bytes) ||
      c10::mul_overflows(bytes, static_cast<uint64_t>(cache.element_size()), &bytes) ||
      bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  TORCH_CHECK_VALUE(!overflows, "repeat_kv_cache: repeats=", repeats, " makes an output of ", cache.size(kRowDim),
                    " x ", repeats, " rows of shape ", cache.sizes(), ", more bytes than int64 can count");
}

// The functional op's output: `cache`'s shape with rows * repeats rows, contiguous.
inline at::Tensor empty_repeated(const at::Tensor& cache, int64_t repeats) {
  auto sizes = cache.sizes().vec();
  sizes[static_cast<int64_t>(sizes.size()) + kRowDim] *= repeats;
  return at::empty(sizes, cache.options());
}

// Describes copying positions [0, num_tokens) of one row of `src` into one row of `dst`. Both have
// the same shape except at the row dim. Dims of size 1 are dropped, the innermost dims that are
// dense in both tensors become the run, and neighbouring dims that are dense relative to each other
// in both tensors are merged.
inline RowCopyPlan make_row_copy_plan(const at::Tensor& src, const at::Tensor& dst, int64_t num_tokens,
                                      const char* op) {
  const int64_t nd = src.dim();
  const int64_t row_dim = nd + kRowDim;
  const int64_t token_dim = nd + kTokenDim;
  const int64_t elem = static_cast<int64_t>(src.element_size());
  TORCH_INTERNAL_ASSERT(dst.dim() == nd && dst.element_size() == src.element_size());

  // Non-row dims with size > 1, outermost first, strides in bytes.
  std::vector<int64_t> sizes, ss, ds;
  int64_t runs_times_run = 1;
  for (int64_t d = 0; d < nd; ++d) {
    if (d == row_dim) continue;
    const int64_t size = d == token_dim ? num_tokens : src.size(d);
    runs_times_run *= size;
    if (size == 1) continue;
    sizes.push_back(size);
    ss.push_back(src.stride(d) * elem);
    ds.push_back(dst.stride(d) * elem);
  }

  RowCopyPlan plan;
  plan.src_row_stride = src.stride(row_dim) * elem;
  plan.dst_row_stride = dst.stride(row_dim) * elem;
  if (runs_times_run == 0) return plan;  // an empty row: nothing to copy

  int64_t run = elem;
  while (!sizes.empty() && ss.back() == run && ds.back() == run) {
    run *= sizes.back();
    sizes.pop_back();
    ss.pop_back();
    ds.pop_back();
  }
  // Merge dim i into dim i+1 when stepping i is the same as stepping i+1 size[i+1] times.
  std::vector<int64_t> ms, mss, mds;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!ms.empty() && mss.back() == ss[i] * sizes[i] && mds.back() == ds[i] * sizes[i]) {
      ms.back() *= sizes[i];
      mss.back() = ss[i];
      mds.back() = ds[i];
    } else {
      ms.push_back(sizes[i]);
      mss.push_back(ss[i]);
      mds.push_back(ds[i]);
    }
  }
  TORCH_CHECK_VALUE(static_cast<int>(ms.size()) <= kMaxRunDims, op, ": cache layout needs ", ms.size(),
                    " strided dims per row, at most ", kMaxRunDims,
                    " are supported; make head_dim and the leading dims contiguous (strides ", src.strides(), ")");
  plan.run_bytes = run;
  plan.ndim = static_cast<int>(ms.size());
  plan.runs_per_row = 1;
  for (int i = 0; i < plan.ndim; ++i) {
    plan.sizes[i] = ms[i];
    plan.src_strides[i] = mss[i];
    plan.dst_strides[i] = mds[i];
    plan.runs_per_row *= ms[i];
  }
  return plan;
}

// The in-place expansion reads its sources from the same rows it writes. Source row i goes to
// destination rows [i*N, (i+1)*N). We copy in levels, from the top rows down:
//
//   hi = B; while hi > 1: lo = ceil(hi / N); copy sources [lo, hi); hi = lo.   Then source 0.
//
// Why each level is safe to run fully in parallel, and the levels in this order are correct:
//  (1) Inside a level, destinations [lo*N, hi*N) start at lo*N >= hi (because lo = ceil(hi/N)), so
//      they lie above every source still to be read, in this level ([lo, hi)) or a later one ([0, lo)).
//      No copy in the level overwrites a row that anything reads afterwards.
//  (2) A destination row d >= hi either was >= B (never held a prompt) or was a source of an earlier
//      level, which has finished (levels run one after another, on one stream), so nothing is lost.
//  (3) Levels write disjoint ranges: [lo*N, hi*N) for successive (lo, hi) tile [N, B*N) from the top
//      down, and the final level (source 0) writes [1, N) (row 0 is already in place). So no level
//      overwrites a finished destination, and every row in [0, B*N) is written exactly once.
//  (4) lo < hi whenever hi > 1 and N >= 2, so the loop ends after about log_N(B) + 1 levels.
// With N == 1 there is nothing to do. `fn(lo, hi)` is called for each level in order.
template <typename Fn>
inline void for_each_level(int64_t batch, int64_t repeats, Fn fn) {
  if (repeats == 1) return;
  int64_t hi = batch;
  while (hi > 1) {
    const int64_t lo = (hi + repeats - 1) / repeats;
    fn(lo, hi);
    hi = lo;
  }
  fn(0, 1);
}

}  // namespace torchkvops
