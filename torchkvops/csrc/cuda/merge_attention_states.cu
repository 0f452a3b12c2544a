// CUDA kernel of merge_attention_states. A group of threads (one warp at most) merges one (row,
// head) item: every thread of the group computes the item's two weights from the two lse values
// (a broadcast read), then the group walks head_dim in vectors of VEC elements, loaded and stored
// 4 to 16 bytes at a time where every address and stride allows. One launch on the current stream,
// no host sync, no allocation beyond the two outputs, so the op can be captured in a CUDA graph.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "../merge_attention_states.h"

namespace torchkvops {
namespace {

using merge::ItemPlan;

constexpr int kThreadsPerBlock = 256;

// VEC elements of T, moved as one aligned load or store.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename TA, typename TB, int VEC>
__global__ void merge_kernel(const ItemPlan plan,
                             const TA* __restrict__ out_a,     // item i at plan offset, head_dim contiguous
                             const float* __restrict__ lse_a,  // item i at plan offset
                             const TB* __restrict__ out_b,     // item i at plan offset, head_dim contiguous
                             const float* __restrict__ lse_b,  // item i at plan offset
                             TA* __restrict__ out,             // [items, head_dim] contiguous
                             float* __restrict__ lse,          // [items] contiguous
                             int64_t items, int64_t head_dim) {
  const int64_t vecs = head_dim / VEC;
  const int64_t item_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; i < items; i += item_stride) {
    int64_t off[ItemPlan::kTensors];
    plan.offsets(i, off);  // a row-major plan: off[kOut] == i
    const merge::Weights w = merge::merge_weights(lse_a[off[ItemPlan::kLseA]], lse_b[off[ItemPlan::kLseB]]);
    if (threadIdx.x == 0) lse[i] = w.lse;
    const auto* a = reinterpret_cast<const Pack<TA, VEC>*>(out_a + off[ItemPlan::kOutA]);
    const auto* b = reinterpret_cast<const Pack<TB, VEC>*>(out_b + off[ItemPlan::kOutB]);
    auto* o = reinterpret_cast<Pack<TA, VEC>*>(out + i * head_dim);
    // w.kind is the same for the whole group: no divergence inside it.
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      Pack<TA, VEC> r;
      if (w.kind == merge::kBoth) {
        const Pack<TA, VEC> pa = a[v];
        const Pack<TB, VEC> pb = b[v];
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          // Rounded step by step (no fused multiply-add), as the CPU kernel and the reference round.
          r.v[j] = static_cast<TA>(
              __fadd_rn(__fmul_rn(w.ca, static_cast<float>(pa.v[j])), __fmul_rn(w.cb, static_cast<float>(pb.v[j]))));
      } else if (w.kind == merge::kOnlyA) {
        r = a[v];
      } else if (w.kind == merge::kOnlyB) {
        const Pack<TB, VEC> pb = b[v];
#pragma unroll
        for (int j = 0; j < VEC; ++j) r.v[j] = static_cast<TA>(static_cast<float>(pb.v[j]));
      } else {  // kZero: both parts empty
#pragma unroll
        for (int j = 0; j < VEC; ++j) r.v[j] = static_cast<TA>(0.f);
      }
      o[v] = r;
    }
  }
}

// Streaming multiprocessors of the current device. A cheap driver query with no sync; ATen's
// device-properties helper would pull in the cuBLAS and cuSPARSE headers, which a minimal toolkit lacks.
int64_t multiprocessor_count() {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return count;
}

// Whether VEC-element packs of out_a and out_b are aligned for every item: head_dim, both base
// addresses and every leading stride of both inputs are multiples of the pack.
template <typename TA, typename TB>
bool packs_fit(int vec, const merge::Inputs& in, int64_t head_dim) {
  if (head_dim % vec != 0) return false;
  if (reinterpret_cast<uintptr_t>(in.out_a.const_data_ptr()) % (vec * sizeof(TA)) != 0) return false;
  if (reinterpret_cast<uintptr_t>(in.out_b.const_data_ptr()) % (vec * sizeof(TB)) != 0) return false;
  for (int d = 0; d < in.plan.ndim; ++d) {
    if (in.plan.strides[ItemPlan::kOutA][d] % vec != 0 || in.plan.strides[ItemPlan::kOutB][d] % vec != 0) return false;
  }
  return true;
}

template <typename TA, typename TB, int VEC>
void launch(const merge::Inputs& in, at::Tensor& out, at::Tensor& lse, cudaStream_t stream) {
  const int64_t items = lse.numel();
  const int64_t head_dim = out.size(-1);
  const int64_t vecs = head_dim / VEC;
  // Just enough threads to cover an item's vectors in one pass, up to a warp: a short head leaves
  // the rest of the warp to neighbouring items instead of idling.
  int tx = 1;
  while (tx < 32 && tx < vecs) tx *= 2;
  const dim3 block(tx, kThreadsPerBlock / tx);
  const int64_t wanted = (items + block.y - 1) / block.y;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(wanted, multiprocessor_count() * 32)));
  merge_kernel<TA, TB, VEC><<<grid, block, 0, stream>>>(
      in.plan, in.out_a.const_data_ptr<TA>(), in.lse_a.const_data_ptr<float>(), in.out_b.const_data_ptr<TB>(),
      in.lse_b.const_data_ptr<float>(), out.mutable_data_ptr<TA>(), lse.mutable_data_ptr<float>(), items, head_dim);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The widest pack (up to 16 bytes for the wider of the two input dtypes) that fits, then launch.
template <typename TA, typename TB>
void dispatch_vec(const merge::Inputs& in, at::Tensor& out, at::Tensor& lse, cudaStream_t stream) {
  constexpr int kMaxVec = 16 / static_cast<int>(sizeof(TA) > sizeof(TB) ? sizeof(TA) : sizeof(TB));
  const int64_t head_dim = out.size(-1);
  if constexpr (kMaxVec >= 8) {
    if (packs_fit<TA, TB>(8, in, head_dim)) return launch<TA, TB, 8>(in, out, lse, stream);
  }
  if (packs_fit<TA, TB>(4, in, head_dim)) return launch<TA, TB, 4>(in, out, lse, stream);
  if (packs_fit<TA, TB>(2, in, head_dim)) return launch<TA, TB, 2>(in, out, lse, stream);
  launch<TA, TB, 1>(in, out, lse, stream);
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cuda(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                               const at::Tensor& out_b, const at::Tensor& lse_b) {
  merge::check_args(out_a, lse_a, out_b, lse_b);
  TORCH_INTERNAL_ASSERT(out_a.device().is_cuda());
  const c10::cuda::OptionalCUDAGuard guard(out_a.device());
  at::Tensor out, lse;
  std::tie(out, lse) = merge::empty_outputs(out_a);
  if (lse.numel() == 0) return {out, lse};
  // Inputs that are already readable in place (head_dim stride 1) are not copied.
  const merge::Inputs in = merge::prepare_inputs(out_a, lse_a, out_b, lse_b);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  TORCHKVOPS_DISPATCH_MERGE_TYPES(out_a.scalar_type(), "merge_attention_states", [&] {
    using TA = scalar_t;
    TORCHKVOPS_DISPATCH_MERGE_TYPES(out_b.scalar_type(), "merge_attention_states",
                                    [&] { dispatch_vec<TA, scalar_t>(in, out, lse, stream); });
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CUDA, m) { m.impl("merge_attention_states", &merge_attention_states_cuda); }

}  // namespace torchkvops
