"""Typed Python face of the torchkvops operators, plus their fake kernels and autograd formulas."""

import torch
from torch import Tensor

__all__ = ["repeat_kv_cache_", "repeat_kv_cache", "write_kv_"]


def repeat_kv_cache_(cache: Tensor, batch: int, repeats: int, num_tokens: int) -> None:
    """Expand the prompt KV of `batch` rows to `batch * repeats` rows, in place.

    `cache` holds rows at dim -4 and token positions at dim -2, with any leading dims: a whole buffer
    `[layers, 2, rows, kv_heads, max_tokens, head_dim]` or one layer's `[rows, kv_heads, max_tokens,
    head_dim]`. Before the call rows `[0, batch)` hold the prompts at positions `[0, num_tokens)`;
    afterwards row `r < batch * repeats` holds old row `r // repeats` there (repeat_interleave
    order). Nothing else changes, and no temporary copy of the cache is made.
    """
    torch.ops.torchkvops.repeat_kv_cache_.default(cache, batch, repeats, num_tokens)


def repeat_kv_cache(cache: Tensor, repeats: int) -> Tensor:
    """Return `cache.repeat_interleave(repeats, dim=-4)` as a new contiguous tensor (differentiable)."""
    return torch.ops.torchkvops.repeat_kv_cache.default(cache, repeats)


@torch.library.register_fake("torchkvops::repeat_kv_cache")
def _repeat_kv_cache_fake(cache: Tensor, repeats: int) -> Tensor:
    torch._check(cache.dim() >= 4, lambda: f"repeat_kv_cache: cache must have at least 4 dims, got {cache.dim()}")
    torch._check(repeats >= 1, lambda: f"repeat_kv_cache: repeats must be >= 1, got {repeats}")
    torch._check_value(cache.numel() * repeats * cache.element_size() < 2**63,
                 lambda: f"repeat_kv_cache: repeats={repeats} makes an output of {cache.shape[-4]} x {repeats} rows "
                         f"of shape {tuple(cache.shape)}, more bytes than int64 can count")
    shape = list(cache.shape)
    shape[-4] = shape[-4] * repeats
    return cache.new_empty(shape)


def _setup_context(ctx, inputs, output) -> None:
    _, ctx.repeats = inputs


def _backward(ctx, grad: Tensor):
    # Output row r came from input row r // repeats: sum each group of `repeats` rows.
    rows = grad.shape[-4] // ctx.repeats
    return grad.unflatten(-4, (rows, ctx.repeats)).sum(dim=-4), None


torch.library.register_autograd("torchkvops::repeat_kv_cache", _backward, setup_context=_setup_context)


def write_kv_(cache: Tensor, key: Tensor, value: Tensor, layer: int, start: Tensor) -> None:
    """Store one layer's keys and values in a whole KV buffer, in place.

    `cache` is `[layers, 2, rows, kv_heads, max_tokens, head_dim]`; `key` and `value` are
    `[r, kv_heads, q, head_dim]` with r <= rows; `start` is a 1-element int64 tensor on the cache's
    device. Afterwards `cache[layer, 0, :r, :, start:start+q] == key` (index 1 for `value`). Pass the
    whole buffer: under torch.compile the write stays one in-place call on it. Every argument is
    checked before anything is written; on CUDA, `start` stays on the device and the kernel checks its
    range (an out-of-range start writes nothing and raises a device-side assert, as torch's own
    indexing kernels do) instead of syncing with the host on every call.
    """
    torch.ops.torchkvops.write_kv_.default(cache, key, value, layer, start)
