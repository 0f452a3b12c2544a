// Shared by the CPU and CUDA kernels of write_kv_ and write_kv_slots_: the argument checks (all made before
// anything is written) and the description of one write as two strided 4-D copies.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#include "macros.h"

namespace torchkvops {

// key/value [rows, kv_heads, tokens, head_dim] go to cache[layer, 0/1, r, :, start[r]:start[r]+tokens] for
// each row r < rows, where `start` holds one position for every row (1 element) or one per row (rows
// elements) (write_kv_); or, with `slot_mode` (write_kv_slots_), token t of row r goes to the slot
// s = slots[r * tokens + t] of a pool of blocks: cache[layer, 0/1, s / block_size, :, s % block_size]. The
// same copies either way: only where each head_dim run lands differs. Strides in elements; passed by
// value to CUDA.
struct KVWritePlan {
  int64_t rows = 0, heads = 0, tokens = 0, head_dim = 0;
  bool slot_mode = false;          // the index is a slot per token (write_kv_slots_), not a start per row
  int64_t start_stride = 0;        // start mode: 0, one start for every row; 1, start[r] is row r's
  int64_t src_strides[2][4] = {};  // [key, value][row, head, token, dim]
  int64_t dst_strides[4] = {};     // cache strides at dims 2..5 (row or block, head, token, dim)
  int64_t dst_kv_stride = 0;       // cache.stride(1): K -> V
  int64_t max_tokens = 0;          // cache.size(4): `start + tokens` may not exceed it (slot mode: block_size)
  int64_t num_slots = 0;           // slot mode: cache.size(2) * block_size, the slots a pool holds

  // Run `run` of 2 * rows * heads * tokens (one head_dim vector: K runs first, then V): whether it
  // is K (0) or V (1), its first element's offset in key/value and in the layer's cache, in elements, and
  // the index it was placed by (`*placed_by`: its row's start, or its slot), which `fits` must accept
  // before anything is written there.
  TORCHKVOPS_HOST_DEVICE inline int64_t run_offsets(int64_t run, const int64_t* index, int64_t* src_off,
                                                    int64_t* dst_off, int64_t* placed_by) const {
    const int64_t t = run % tokens;
    run /= tokens;
    const int64_t h = run % heads;
    run /= heads;
    const int64_t r = run % rows;
    const int64_t kv = run / rows;
    const int64_t* ss = src_strides[kv];
    *src_off = r * ss[0] + h * ss[1] + t * ss[2];
    int64_t dst_row, dst_column;
    if (slot_mode) {
      const int64_t slot = index[r * tokens + t];
      *placed_by = slot;
      dst_row = slot / max_tokens;
      dst_column = slot % max_tokens;
    } else {
      const int64_t first = index[r * start_stride];
      *placed_by = first;
      dst_row = r;
      dst_column = first + t;
    }
    *dst_off = kv * dst_kv_stride + dst_row * dst_strides[0] + h * dst_strides[1] + dst_column * dst_strides[2];
    return kv;
  }

  // Whether a start position leaves room for the write's tokens.
  TORCHKVOPS_HOST_DEVICE inline bool start_fits(int64_t first) const {
    return first >= 0 && first <= max_tokens - tokens;
  }

  // Whether an index (run_offsets' `placed_by`) names a place in the cache: a start that fits, or a slot
  // of the pool.
  TORCHKVOPS_HOST_DEVICE inline bool fits(int64_t placed_by) const {
    return slot_mode ? placed_by >= 0 && placed_by < num_slots : start_fits(placed_by);
  }
};

// The checks both ops make of cache, key, value and layer (`op` names the op in the messages), and the
// plan's shapes and strides.
inline KVWritePlan check_kv_write(const char* op, const char* cache_shape, const at::Tensor& cache,
                                  const at::Tensor& key, const at::Tensor& value, int64_t layer) {
  TORCH_CHECK_VALUE(cache.dim() == 6 && cache.size(1) == 2, op, ": cache must be ", cache_shape, ", got shape ",
                    cache.sizes());
  TORCH_CHECK_VALUE(key.dim() == 4 && key.sizes() == value.sizes(), op,
                    ": key and value must both be [rows, kv_heads, tokens, head_dim], got ", key.sizes(), " and ",
                    value.sizes());
  TORCH_CHECK_VALUE(layer >= 0 && layer < cache.size(0), op, ": layer must be in [0, ", cache.size(0), "), got ",
                    layer);
  TORCH_CHECK_TYPE(key.scalar_type() == cache.scalar_type() && value.scalar_type() == cache.scalar_type(), op,
                   ": key and value must have the cache's dtype ", cache.scalar_type(), ", got ", key.scalar_type(),
                   " and ", value.scalar_type());
  TORCH_CHECK_VALUE(key.device() == cache.device() && value.device() == cache.device(), op,
                    ": key and value must be on the cache's device ", cache.device(), ", got ", key.device(), " and ",
                    value.device());
  KVWritePlan plan;
  plan.rows = key.size(0);
  plan.heads = key.size(1);
  plan.tokens = key.size(2);
  plan.head_dim = key.size(3);
  for (int d = 0; d < 4; ++d) {
    plan.src_strides[0][d] = key.stride(d);
    plan.src_strides[1][d] = value.stride(d);
    plan.dst_strides[d] = cache.stride(d + 2);
  }
  plan.dst_kv_stride = cache.stride(1);
  plan.max_tokens = cache.size(4);
  return plan;
}

inline KVWritePlan check_write_kv_args(const at::Tensor& cache, const at::Tensor& key, const at::Tensor& value,
                                       int64_t layer, const at::Tensor& start) {
  const char* op = "write_kv_";
  KVWritePlan plan = check_kv_write(op, "[layers, 2, rows, kv_heads, max_tokens, head_dim]", cache, key, value, layer);
  TORCH_CHECK_VALUE(key.size(0) <= cache.size(2) && key.size(1) == cache.size(3) && key.size(2) <= cache.size(4) &&
                        key.size(3) == cache.size(5),
                    op, ": key ", key.sizes(), " does not fit the cache ", cache.sizes());
  TORCH_CHECK_VALUE((start.numel() == 1 || (start.dim() == 1 && start.numel() == key.size(0))) &&
                        start.scalar_type() == at::kLong && start.device() == cache.device(),
                    op, ": start must be an int64 tensor on the cache's device of 1 element (every row) or of ",
                    key.size(0), " elements (one per row of key), got ", start.scalar_type(), " of shape ",
                    start.sizes(), " on ", start.device());
  TORCH_CHECK_VALUE(start.numel() == 1 || start.is_contiguous(), op, ": a per-row start must be contiguous");
  plan.start_stride = start.numel() == 1 ? 0 : 1;
  return plan;
}

inline KVWritePlan check_write_kv_slots_args(const at::Tensor& cache, const at::Tensor& key, const at::Tensor& value,
                                             int64_t layer, const at::Tensor& slots) {
  const char* op = "write_kv_slots_";
  KVWritePlan plan =
      check_kv_write(op, "[layers, 2, blocks, kv_heads, block_size, head_dim]", cache, key, value, layer);
  TORCH_CHECK_VALUE(key.size(1) == cache.size(3) && key.size(3) == cache.size(5), op, ": key ", key.sizes(),
                    " does not fit the cache ", cache.sizes(), " (kv_heads and head_dim differ)");
  const bool shaped = (slots.dim() == 2 && slots.size(0) == key.size(0) && slots.size(1) == key.size(2)) ||
                      (slots.dim() == 1 && key.size(2) == 1 && slots.size(0) == key.size(0));
  TORCH_CHECK_VALUE(
      shaped && slots.scalar_type() == at::kLong && slots.device() == cache.device() && slots.is_contiguous(), op,
      ": slots must be a contiguous int64 tensor on the cache's device of shape [", key.size(0), ", ", key.size(2),
      "] (one slot per token of key; [", key.size(0), "] for one token a row), got ", slots.scalar_type(), " of shape ",
      slots.sizes(), " on ", slots.device());
  plan.slot_mode = true;
  plan.num_slots = cache.size(2) * cache.size(4);
  return plan;
}

// The start positions' range (write_kv_), for kernels that can read them on the host (the CPU one). On CUDA they live
// on the device and the kernel checks them instead (reading them here would cost a sync per call).
inline void check_write_kv_start(const int64_t* start, int64_t count, const KVWritePlan& plan) {
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK_VALUE(plan.start_fits(start[i]), "write_kv_: start must be in [0, ", plan.max_tokens - plan.tokens,
                      "] so that its ", plan.tokens, " token(s) fit the cache's ", plan.max_tokens, " positions, got ",
                      start[i], count > 1 ? " (row " + std::to_string(i) + ")" : std::string());
  }
}

// The slots' range (write_kv_slots_), on the host (the CPU kernel), before anything is written.
inline void check_write_kv_slots(const int64_t* slots, const KVWritePlan& plan) {
  for (int64_t i = 0; i < plan.rows * plan.tokens; ++i) {
    TORCH_CHECK_VALUE(plan.fits(slots[i]), "write_kv_slots_: slots must be in [0, ", plan.num_slots,
                      ") (blocks x block_size), got ", slots[i], " (row ", i / plan.tokens, ", token ", i % plan.tokens,
                      ")");
  }
}

}  // namespace torchkvops
