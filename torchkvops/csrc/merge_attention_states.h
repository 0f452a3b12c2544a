// Shared by the CPU and CUDA kernels of merge_attention_states: argument checks, the merge weights
// of one (row, head) with their edge cases, and the description of the inputs' strided layouts.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "macros.h"

// Runs __VA_ARGS__ with scalar_t = the C++ type of TYPE, one of the output dtypes we support.
#define TORCHKVOPS_DISPATCH_MERGE_TYPES(TYPE, NAME, ...)                                                \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                                                        \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace torchkvops {
namespace merge {

constexpr const char* kOp = "merge_attention_states";

inline bool is_supported_out_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16;
}

inline void check_out(const at::Tensor& out, const char* name) {
  TORCH_CHECK_VALUE(out.dim() >= 2, kOp, ": ", name, " must have at least 2 dims [..., heads, head_dim], got shape ",
                    out.sizes());
  TORCH_CHECK_TYPE(is_supported_out_dtype(out.scalar_type()), kOp, ": ", name, " dtype ", out.scalar_type(),
                   " is not supported; use float32, float16 or bfloat16");
}

inline void check_lse(const at::Tensor& lse, const at::Tensor& out_a, const char* name) {
  const auto want = out_a.sizes().slice(0, out_a.dim() - 1);
  TORCH_CHECK_VALUE(lse.sizes() == want, kOp, ": ", name, " must have shape out_a.shape[:-1] = ", want, ", got ",
                    lse.sizes());
  TORCH_CHECK_TYPE(lse.scalar_type() == c10::ScalarType::Float, kOp, ": ", name,
                   " must be float32 (natural-log log-sum-exp), got ", lse.scalar_type());
}

inline void check_args(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                       const at::Tensor& lse_b) {
  check_out(out_a, "out_a");
  check_out(out_b, "out_b");
  TORCH_CHECK_VALUE(out_b.sizes() == out_a.sizes(), kOp, ": out_b must have out_a's shape ", out_a.sizes(), ", got ",
                    out_b.sizes());
  check_lse(lse_a, out_a, "lse_a");
  check_lse(lse_b, out_a, "lse_b");
  const auto device = out_a.device();
  TORCH_CHECK_VALUE(lse_a.device() == device, kOp, ": lse_a must be on out_a's device ", device, ", got ",
                    lse_a.device());
  TORCH_CHECK_VALUE(out_b.device() == device, kOp, ": out_b must be on out_a's device ", device, ", got ",
                    out_b.device());
  TORCH_CHECK_VALUE(lse_b.device() == device, kOp, ": lse_b must be on out_a's device ", device, ", got ",
                    lse_b.device());
}

// The outputs: out_a's shape and dtype, contiguous; float32 lse of shape out_a.shape[:-1], contiguous.
inline std::tuple<at::Tensor, at::Tensor> empty_outputs(const at::Tensor& out_a) {
  at::Tensor out = at::empty(out_a.sizes(), out_a.options());
  at::Tensor lse = at::empty(out_a.sizes().slice(0, out_a.dim() - 1), out_a.options().dtype(at::kFloat));
  return {out, lse};
}

// How one (row, head) is merged: out = ca * out_a + cb * out_b, and its lse. `kind` says which terms
// take part, so that a part with weight 0 is never read (its output may be garbage, e.g. NaN from an
// attention over no keys) and a lone part is copied exactly.
enum Kind : int { kBoth = 0, kOnlyA = 1, kOnlyB = 2, kZero = 3 };

struct Weights {
  float ca, cb, lse;
  int kind;
};

// Natural-log lse. Both -inf: out = 0, lse = -inf. A NaN or +inf lse on either side: out = NaN and
// lse = NaN (the same as attention over scores that hold a NaN or +inf). Otherwise, with
// m = max(la, lb), wa = exp(la - m), wb = exp(lb - m): ca = wa / (wa + wb), cb = wb / (wa + wb),
// lse = m + log(wa + wb); a weight that is exactly 0 (lse -inf, or so far below the other that exp
// underflows) drops its term, and then the other weight is exactly 1.
TORCHKVOPS_HOST_DEVICE inline Weights merge_weights(float la, float lb) {
  // INFINITY and NAN (not std::numeric_limits) so the same code compiles for the device.
  if (la != la || lb != lb || la == INFINITY || lb == INFINITY) return {NAN, NAN, NAN, kBoth};
  const float m = la > lb ? la : lb;
  if (m == -INFINITY) return {0.f, 0.f, -INFINITY, kZero};
  const float wa = expf(la - m);
  const float wb = expf(lb - m);
  const float s = wa + wb;  // in [1, 2]
  const float ca = wa / s, cb = wb / s;
  const int kind = ca == 0.f ? kOnlyB : (cb == 0.f ? kOnlyA : kBoth);
  return {ca, cb, m + logf(s), kind};
}

// After dims are merged, the leading dims ([..., heads]) of the four inputs may still need this many
// strided dims; beyond it the inputs are made contiguous first.
constexpr int kMaxDims = 6;

// Where (row, head) item k of each input starts, and which item of the outputs it is. The offset of
// item k in tensor t is sum_d(index_d(k) * strides[t][d]) elements, with index_d the mixed-radix
// digits of k over `sizes` (innermost dim last). As built by make_item_plan the items are numbered
// row-major over out_a.shape[:-1], so the output item (kOut: an element of the merged lse, the
// head_dim elements from index * head_dim of the merged out) is k itself; a plan whose dims were
// permuted (in_input_order) enumerates the same items in another order. Passed by value to CUDA.
struct ItemPlan {
  enum { kOutA = 0, kOutB = 1, kLseA = 2, kLseB = 3, kOut = 4, kTensors = 5 };
  int ndim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kTensors][kMaxDims] = {};  // elements (items for kOut)

  TORCHKVOPS_HOST_DEVICE inline void offsets(int64_t item, int64_t (&off)[kTensors]) const {
    for (int t = 0; t < kTensors; ++t) off[t] = 0;
    for (int i = ndim - 1; i >= 0; --i) {
      int64_t idx = item;
      if (i > 0) {
        idx = item % sizes[i];
        item /= sizes[i];
      }
      for (int t = 0; t < kTensors; ++t) off[t] += idx * strides[t][i];
    }
  }
};

// The plan of the four inputs' leading dims: dims of size 1 are dropped and neighbouring dims that
// are dense relative to each other in all four tensors are merged. Returns false when more than
// kMaxDims dims remain.
inline bool make_item_plan(const at::Tensor& out_a, const at::Tensor& out_b, const at::Tensor& lse_a,
                           const at::Tensor& lse_b, ItemPlan* plan) {
  constexpr int kInputs = 4;  // kOutA .. kLseB; the outputs are contiguous and merge with anything
  const at::Tensor* ts[kInputs] = {&out_a, &out_b, &lse_a, &lse_b};
  std::vector<int64_t> sizes;
  std::vector<std::vector<int64_t>> strides(kInputs);
  for (int64_t d = 0; d < out_a.dim() - 1; ++d) {
    const int64_t size = out_a.size(d);
    if (size == 1) continue;
    const size_t prev = sizes.size() - 1;
    bool mergeable = !sizes.empty();
    for (int t = 0; t < kInputs && mergeable; ++t) mergeable = strides[t][prev] == ts[t]->stride(d) * size;
    if (mergeable) {  // stepping the previous dim once is stepping this one `size` times
      sizes[prev] *= size;
      for (int t = 0; t < kInputs; ++t) strides[t][prev] = ts[t]->stride(d);
    } else {
      sizes.push_back(size);
      for (int t = 0; t < kInputs; ++t) strides[t].push_back(ts[t]->stride(d));
    }
  }
  if (sizes.size() > static_cast<size_t>(kMaxDims)) return false;
  *plan = ItemPlan();
  plan->ndim = static_cast<int>(sizes.size());
  int64_t items_inside = 1;  // the output's (contiguous) item stride of dim i
  for (int i = plan->ndim - 1; i >= 0; --i) {
    plan->sizes[i] = sizes[i];
    for (int t = 0; t < kInputs; ++t) plan->strides[t][i] = strides[t][i];
    plan->strides[ItemPlan::kOut][i] = items_inside;
    items_inside *= sizes[i];
  }
  return true;
}

// The same items, enumerated in the inputs' memory order: dims sorted by out_a's plus out_b's
// stride, largest outermost. For the CPU kernel: with SDPA's [B, L, H, D] views of [B, H, L, D]
// buffers, row-major order jumps L*D elements between neighbouring items and streams from H places
// at once (at 512x32x128 on one thread: 2-8x the time of contiguous inputs); in input order
// neighbouring items are neighbours in memory, only the writes are strided (each a run of head_dim
// elements), and such views take within 15% of the time of contiguous inputs.
inline ItemPlan in_input_order(const ItemPlan& plan) {
  int order[kMaxDims];
  for (int i = 0; i < plan.ndim; ++i) order[i] = i;
  auto key = [&](int d) { return plan.strides[ItemPlan::kOutA][d] + plan.strides[ItemPlan::kOutB][d]; };
  std::stable_sort(order, order + plan.ndim, [&](int x, int y) { return key(x) > key(y); });
  ItemPlan permuted = plan;
  for (int i = 0; i < plan.ndim; ++i) {
    permuted.sizes[i] = plan.sizes[order[i]];
    for (int t = 0; t < ItemPlan::kTensors; ++t) permuted.strides[t][i] = plan.strides[t][order[i]];
  }
  return permuted;
}

// The inputs as the kernels read them: head_dim contiguous (stride 1) in out_a and out_b, and an item
// plan for the leading dims. Inputs that already qualify are used as they are (no copy); an input
// whose head_dim is strided is made contiguous, and all four are when their leading dims need more
// than kMaxDims strided dims.
struct Inputs {
  at::Tensor out_a, lse_a, out_b, lse_b;
  ItemPlan plan;
};

inline Inputs prepare_inputs(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                             const at::Tensor& lse_b) {
  auto head_dim_dense = [](const at::Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1; };
  Inputs in{head_dim_dense(out_a) ? out_a : out_a.contiguous(), lse_a,
            head_dim_dense(out_b) ? out_b : out_b.contiguous(), lse_b, ItemPlan()};
  if (!make_item_plan(in.out_a, in.out_b, in.lse_a, in.lse_b, &in.plan)) {
    in.out_a = in.out_a.contiguous();
    in.out_b = in.out_b.contiguous();
    in.lse_a = in.lse_a.contiguous();
    in.lse_b = in.lse_b.contiguous();
    const bool ok = make_item_plan(in.out_a, in.out_b, in.lse_a, in.lse_b, &in.plan);
    TORCH_INTERNAL_ASSERT(ok && in.plan.ndim <= 1);
  }
  return in;
}

}  // namespace merge
}  // namespace torchkvops
