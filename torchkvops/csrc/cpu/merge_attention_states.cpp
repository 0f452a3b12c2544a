// CPU kernel of merge_attention_states: (row, head) items, enumerated in the inputs' memory order,
// spread over threads with at::parallel_for; each item's head_dim elements are merged in one flat
// loop over contiguous memory, which the compiler vectorizes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "../merge_attention_states.h"

namespace torchkvops {
namespace {

using merge::ItemPlan;

// Conversions to and from float in the inner loops. c10::Half's (the FP16 library's bit tricks, when
// built without F16C) compare unsigned words and select between float results, and GCC leaves those
// loops scalar. half_to_float and float_to_half are the same algorithms written with signed compares
// of the sign-cleared word and mask selects, so every dtype pair's loop vectorizes (float16 at
// 512x32x128 on one thread: 7.9 -> 3.7 ms). Same bits, checked by the tests on every half and on the
// float rounding boundaries; a NaN becomes 0x7E00 with its sign, like c10::Half(float) (the payload
// is not kept). float and c10::BFloat16 keep their own conversions, which vectorize as they are.
inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// All ones when c, else 0. Selecting with masks, not `?:`, because GCC turns a `?:` between two
// float results into a branch (it won't compute a float op the source did not, under trapping math).
inline uint32_t select_mask(bool c) { return 0u - static_cast<uint32_t>(c); }

// c10::detail::fp16_ieee_to_fp32_value.
inline float half_to_float(c10::Half h) {
  const uint32_t w = static_cast<uint32_t>(h.x) << 16;
  const uint32_t m = w & 0x7FFFFFFFu;  // exponent and mantissa at bits 26..16; the original's two_w = m << 1
  const float normalized = float_of((m >> 3) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = float_of((m >> 16) | (126u << 23)) - 0.5f;
  const uint32_t denormal = select_mask(static_cast<int32_t>(m) < (1 << 26));  // two_w < 2^27
  return float_of((w & 0x80000000u) | (bits_of(denormalized) & denormal) | (bits_of(normalized) & ~denormal));
}

// c10::detail::fp16_ieee_from_fp32_value: round to nearest even, NaN -> 0x7E00 with the sign kept.
inline c10::Half float_to_half(float f) {
  const uint32_t w = bits_of(f);
  const uint32_t m = w & 0x7FFFFFFFu;  // the original's shl1_w = m << 1
  // The original's bias >> 1, at least 0x71000000 >> 1.
  int32_t half_bias = static_cast<int32_t>(m & 0x7F800000u);
  half_bias = half_bias < 0x38800000 ? 0x38800000 : half_bias;
  const float base =
      float_of(static_cast<uint32_t>(half_bias) + 0x07800000u) + (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t bits = bits_of(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  const uint32_t nan = select_mask(static_cast<int32_t>(m) > 0x7F800000);  // shl1_w > 0xFF000000
  return c10::Half(static_cast<uint16_t>(((w & 0x80000000u) >> 16) | (0x7E00u & nan) | (nonsign & ~nan)),
                   c10::Half::from_bits());
}

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}
template <>
inline float to_float<c10::Half>(c10::Half x) {
  return half_to_float(x);
}

template <typename T>
inline T from_float(float f) {
  return static_cast<T>(f);
}
template <>
inline c10::Half from_float<c10::Half>(float f) {
  return float_to_half(f);
}

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
  const ItemPlan plan = merge::in_input_order(in.plan);
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(1, head_dim));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      int64_t off[ItemPlan::kTensors];
      plan.offsets(k, off);
      const int64_t i = off[ItemPlan::kOut];
      const merge::Weights w = merge::merge_weights(la[off[ItemPlan::kLseA]], lb[off[ItemPlan::kLseB]]);
      l[i] = w.lse;
      const TA* __restrict__ ai = a + off[ItemPlan::kOutA];
      const TB* __restrict__ bi = b + off[ItemPlan::kOutB];
      TA* __restrict__ oi = o + i * head_dim;
      const float ca = w.ca, cb = w.cb;
      switch (w.kind) {
        case merge::kBoth:
          for (int64_t d = 0; d < head_dim; ++d) oi[d] = from_float<TA>(ca * to_float(ai[d]) + cb * to_float(bi[d]));
          break;
        case merge::kOnlyA:
          std::copy(ai, ai + head_dim, oi);
          break;
        case merge::kOnlyB:
          for (int64_t d = 0; d < head_dim; ++d) oi[d] = from_float<TA>(to_float(bi[d]));
          break;
        default:  // kZero: both parts empty
          std::fill(oi, oi + head_dim, from_float<TA>(0.f));
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

TORCH_LIBRARY_IMPL(torchkvops, CPU, m) { m.impl("merge_attention_states", &merge_attention_states_cpu); }

}  // namespace torchkvops
