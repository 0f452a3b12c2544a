"""Typed Python face of the torchkvops operators, plus their fake kernels and autograd formulas."""

import torch
from torch import Tensor

__all__ = ["repeat_kv_cache_", "repeat_kv_cache", "write_kv_", "sample_tokens"]


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
    whole buffer: under torch.compile the write stays one in-place call on it.
    """
    torch.ops.torchkvops.write_kv_.default(cache, key, value, layer, start)


def sample_tokens(logits: Tensor, keys: Tensor, step: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """The next token of each row, by Gumbel-max sampling with counter-based noise: [rows] int64.

    `logits` is `[rows, vocab]` float32, float16 or bfloat16 with any strides (a row-strided view such
    as `hidden[:, -1, :]` is read in place); `keys` is `[rows]` int64 (one 32-bit key per row, see
    `sampling.row_keys`) and `step` a 1-element int64 tensor, both on logits' device. `temperature ==
    0` is greedy (`logits.argmax(-1)`; keys and step are not used); otherwise the result is
    `argmax(logits / temperature + noise)` over the tokens kept by `top_k` (0 or >= vocab: off; ties
    with the k-th largest value are kept) and then `top_p` (1: off; a token is dropped when the tokens
    with a larger value already hold top_p of the probability), with Gumbel noise hashed from (key,
    step, token). Equals `torchkvops.reference.sample_tokens` except for near-ties of the perturbed
    scores (the kernels' log may differ from torch's in the last bit) and tokens tied at the top-p
    threshold value (all kept here). No host sync, nothing allocated but the output. Not
    differentiable: the output is an integer tensor.
    """
    return torch.ops.torchkvops.sample_tokens.default(logits, keys, step, temperature, top_k, top_p)


@torch.library.register_fake("torchkvops::sample_tokens")
def _sample_tokens_fake(logits: Tensor, keys: Tensor, step: Tensor, temperature: float, top_k: int,
                        top_p: float) -> Tensor:
    torch._check(logits.dim() == 2, lambda: f"sample_tokens: logits must be 2-D [rows, vocab], got {logits.dim()} dims")
    torch._check(keys.dim() == 1, lambda: f"sample_tokens: keys must be 1-D, got {keys.dim()} dims")
    torch._check(keys.shape[0] == logits.shape[0],
                 lambda: f"sample_tokens: keys must have one key per row ({logits.shape[0]}), got {keys.shape[0]}")
    torch._check(step.numel() == 1, lambda: f"sample_tokens: step must be a 1-element int64 tensor, got {step.numel()}")
    return logits.new_empty((logits.shape[0],), dtype=torch.long)
