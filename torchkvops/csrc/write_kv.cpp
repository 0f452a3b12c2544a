// write_kv_: store one layer's new keys and values into the whole-buffer KV cache. Built from ATen
// ops (index_copy_ on a view), so one CompositeExplicitAutograd kernel serves every device; the
// point of the op is its boundary: under torch.compile it is one in-place call on the graph's cache
// input instead of a scatter that Inductor would turn into a pass over the whole buffer.
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <torch/library.h>

namespace torchkvops {
namespace {

void write_kv_(at::Tensor& cache, const at::Tensor& key, const at::Tensor& value, int64_t layer,
               const at::Tensor& start) {
  const char* op = "write_kv_";
  TORCH_CHECK_VALUE(cache.dim() == 6 && cache.size(1) == 2, op,
                    ": cache must be [layers, 2, rows, kv_heads, max_tokens, head_dim], got shape ",
                    cache.sizes());
  TORCH_CHECK_VALUE(key.dim() == 4 && key.sizes() == value.sizes(), op,
                    ": key and value must both be [rows, kv_heads, tokens, head_dim], got ", key.sizes(),
                    " and ", value.sizes());
  TORCH_CHECK_VALUE(key.size(0) <= cache.size(2) && key.size(1) == cache.size(3) &&
                        key.size(2) <= cache.size(4) && key.size(3) == cache.size(5),
                    op, ": key ", key.sizes(), " does not fit the cache ", cache.sizes());
  TORCH_CHECK_VALUE(layer >= 0 && layer < cache.size(0), op, ": layer must be in [0, ", cache.size(0),
                    "), got ", layer);
  TORCH_CHECK_TYPE(key.scalar_type() == cache.scalar_type() && value.scalar_type() == cache.scalar_type(),
                   op, ": key and value must have the cache's dtype ", cache.scalar_type(), ", got ",
                   key.scalar_type(), " and ", value.scalar_type());
  TORCH_CHECK_VALUE(start.numel() == 1 && start.scalar_type() == at::kLong && start.device() == cache.device(),
                    op, ": start must be a 1-element int64 tensor on the cache's device, got ",
                    start.scalar_type(), " of ", start.numel(), " elements on ", start.device());
  const int64_t rows = key.size(0), tokens = key.size(2);
  // One decode token: index with `start` itself (no allocation, so CUDA-graph friendly).
  const at::Tensor positions = tokens == 1 ? start.reshape({1}) : at::arange(tokens, start.options()).add_(start);
  at::Tensor layer_kv = cache.select(0, layer).narrow(1, 0, rows);  // [2, rows, kv_heads, max_tokens, head_dim]
  layer_kv.select(0, 0).index_copy_(2, positions, key);
  layer_kv.select(0, 1).index_copy_(2, positions, value);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkvops, CompositeExplicitAutograd, m) {
  m.impl("write_kv_", &write_kv_);
}

}  // namespace torchkvops
