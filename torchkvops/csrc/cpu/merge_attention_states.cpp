// CPU kernel of merge_attention_states: (row, head) items spread over threads with at::parallel_for;
// each item's head_dim elements are merged in one flat loop over contiguous memory, which the
// compiler vectorizes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "../merge_attention_states.h"

namespace torchkvops {
namespace {

using merge::ItemPlan;

// Each parallel task merges at least this many elements, so small calls don't pay for thread wake-ups.
constexpr int64_t kMinElementsPerTask = 16 * 1024;

template <typename TA, typename TB>
void merge_cpu(const merge::Inputs& in, at::Tensor& out, at::Tensor& lse) {
  const int64_t items = lse.numel();
  const int64_t head_dim = out.size(-1);
  const TA* a = in.out_a.const_data_ptr<TA>();
  const TB* b = in.out_b.const_data_ptr<TB>();
  const float* la = in.lse_a.const_data_ptr<float>();
  const float* lb = in.lse_b.const_data_ptr<float>();
  TA* o = out.mutable_data_ptr<TA>();
  float* l = lse.mutable_data_ptr<float>();
  const ItemPlan plan = in.plan;
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(1, head_dim));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t oa, ob, ola, olb;
      plan.offsets(i, &oa, &ob, &ola, &olb);
      const merge::Weights w = merge::merge_weights(la[ola], lb[olb]);
      l[i] = w.lse;
      const TA* __restrict__ ai = a + oa;
      const TB* __restrict__ bi = b + ob;
      TA* __restrict__ oi = o + i * head_dim;
      const float ca = w.ca, cb = w.cb;
      switch (w.kind) {
        case merge::kBoth:
          for (int64_t d = 0; d < head_dim; ++d)
            oi[d] = static_cast<TA>(ca * static_cast<float>(ai[d]) + cb * static_cast<float>(bi[d]));
          break;
        case merge::kOnlyA:
          std::copy(ai, ai + head_dim, oi);
          break;
        case merge::kOnlyB:
          for (int64_t d = 0; d < head_dim; ++d) oi[d] = static_cast<TA>(static_cast<float>(bi[d]));
          break;
        default:  // kZero: both parts empty
          std::fill(oi, oi + head_dim, static_cast<TA>(0.f));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cpu(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                              const at::Tensor& out_b, const at::Tensor& lse_b) {
  merge::check_args(out_a, lse_a, out_b, lse_b);
  TORCH_INTERNAL_ASSERT(out_a.device().is_cpu());
  at::Tensor out, lse;
  std::tie(out, lse) = merge::empty_outputs(out_a);
  if (lse.numel() == 0) return {out, lse};
  const merge::Inputs in = merge::prepare_inputs(out_a, lse_a, out_b, lse_b);
  TORCHKVOPS_DISPATCH_MERGE_TYPES(out_a.scalar_type(), "merge_attention_states", [&] {
    using TA = scalar_t;
    TORCHKVOPS_DISPATCH_MERGE_TYPES(out_b.scalar_type(), "merge_attention_states",
                                    [&] { merge_cpu<TA, scalar_t>(in, out, lse); });
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CPU, m) {
  m.impl("merge_attention_states", &merge_attention_states_cpu);
}

}  // namespace torchkvops
