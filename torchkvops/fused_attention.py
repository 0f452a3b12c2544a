"""One fused attention call, forward (with its log-sum-exp) and backward, on torch's own kernels: the
one place that dispatches them, for the rollout's decode attention (`torchkvops.attention`) and the
training forward's shared-prefix attention (`torchkvops.prefix_attention`).

- CPU: `_scaled_dot_product_flash_attention_for_cpu` and its backward (grouped-query heads natively).
- CUDA: `_scaled_dot_product_efficient_attention` and its backward, K/V heads repeated when the query
  has more heads. Called directly (torch's SDPA would pad the mask itself), it has an alignment rule:
  the additive bias's rows must start at 16-byte boundaries. A bias whose row stride breaks it is
  copied into a padded buffer here, next to the call; the rollout sizes its decode buffers so that its
  biases never need the copy (`rollout.KV_LENGTH_MULTIPLE`, `RESPONSE_KV_MULTIPLE`). Its log-sum-exp
  comes padded to a multiple of 32 queries; `attend` returns it unpadded, `attend_backward` pads it back.
- Elsewhere: matmul + softmax in float32 (forward only).

Shapes: q [X, H, M, D], k and v [X, Hkv, L, D] (H a multiple of Hkv), bias [X, 1, 1, L] additive (0 or a
large negative value), causal top-left aligned (M == L). The log-sum-exp is float32, natural log.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["attend", "attend_backward"]

_CUDA_BIAS_ALIGNMENT_BYTES = 16  # the memory-efficient kernel's rule for the bias's row starts
_CUDA_LSE_MULTIPLE = 32  # the memory-efficient kernel pads its log-sum-exp's last dim to this


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    with_lse: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Attention of q over k, v with an additive key bias: (out [X, H, M, D], lse [X, H, M] or None)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        return out, lse if with_lse else None
    if q.device.type == "cuda":
        heads, m = q.shape[1], q.shape[2]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q,
            _repeat_heads(k, heads),
            _repeat_heads(v, heads),
            _cuda_bias(bias, heads, m),
            with_lse,
            0.0,
            causal,
            scale=scale,
        )
        return out, lse[..., :m] if with_lse else None
    if causal:
        raise NotImplementedError(f"torchkvops: causal fused attention on {q.device.type} (served: cpu, cuda)")
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v)
    return out, lse if with_lse else None


def attend_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    *,
    causal: bool,
    scale: float | None,
    out: Tensor,
    lse: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of `attend` given an output and log-sum-exp ([X, H, M], float32), which may be those of a
    larger attention this one is a part of (the merged output and log-sum-exp of a split attention:
    see torchkvops.prefix_attention)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    if q.device.type != "cuda":
        raise NotImplementedError(f"torchkvops: fused attention backward on {q.device.type} (served: cpu, cuda)")
    heads, m = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    padded_lse = lse.new_zeros(*lse.shape[:-1], _round_up(max(m, 1), _CUDA_LSE_MULTIPLE))
    padded_lse[..., :m] = lse
    seed_offset = torch.zeros(2, dtype=torch.int64, device=q.device)  # unused: no dropout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad.contiguous(),
        q,
        _repeat_heads(k, heads),
        _repeat_heads(v, heads),
        _cuda_bias(bias, heads, m),
        out.contiguous(),
        padded_lse,
        seed_offset[0],
        seed_offset[1],
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, _sum_heads(dk, kv_heads), _sum_heads(dv, kv_heads)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _cuda_bias(bias: Tensor, heads: int, queries: int) -> Tensor:
    """[X, 1, 1, L] -> [X, heads, queries, L] as the memory-efficient kernel takes it: a broadcast view,
    of `bias` itself when its rows start at 16-byte boundaries, else of a padded copy."""
    x, length = bias.shape[0], bias.shape[-1]
    if (bias.stride(0) * bias.element_size()) % _CUDA_BIAS_ALIGNMENT_BYTES or bias.stride(-1) != 1:
        per_row = _CUDA_BIAS_ALIGNMENT_BYTES // bias.element_size()
        padded = bias.new_zeros(x, 1, 1, _round_up(max(length, 1), per_row))
        padded[..., :length] = bias
        bias = padded[..., :length]
    return bias.expand(x, heads, queries, length)


def _repeat_heads(t: Tensor, heads: int) -> Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_heads(grad: Tensor, kv_heads: int) -> Tensor:
    x, heads, length, dim = grad.shape
    return grad if heads == kv_heads else grad.view(x, kv_heads, heads // kv_heads, length, dim).sum(dim=2)
