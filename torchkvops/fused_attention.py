"""One fused attention call, forward (with its log-sum-exp) and backward, on torch's own kernels: the
one place that dispatches them, for the rollout's decode attention (`torchkvops.rollout.attention`) and the
training forward's shared-prefix attention (`torchkvops.training.prefix_attention`).

- CPU: `_scaled_dot_product_flash_attention_for_cpu` and its backward (grouped-query heads natively).
- CUDA: torch's memory-efficient kernels (`_scaled_dot_product_efficient_attention` and its backward),
  K/V heads repeated when the query has more heads. Called directly (torch's SDPA would pad the mask
  itself), their contract is ours to keep (read in `aten/src/ATen/native/transformers/cuda/
  mem_eff_attention/kernel_forward.h`, `kernel_backward.h` and `attention_backward.cu`):
  - the additive bias's start and its row stride are 16-byte aligned (the bias is read with 128-bit
    loads): a bias that breaks either is copied into a padded buffer here (`_cuda_bias`); the rollout
    sizes its decode buffers and prompt biases so that they never need the copy
    (`rollout.KV_LENGTH_MULTIPLE`, the pool's blocks of 16 tokens);
  - the forward's log-sum-exp comes padded to a multiple of 32 queries with +inf, and the backward
    reads it unguarded up to that multiple (a padded row then has P = exp(s - inf) = 0): `attend`
    returns it unpadded, `attend_backward` pads it back with +inf;
  - the backward takes `out`'s batch and head strides from the tensor but assumes its query stride is
    heads * head_dim, the forward's [X, M, H, D] memory layout (fp16/bf16 kernels compute
    rowsum(dO * O) from it): `attend_backward` hands over `out` in that layout;
  - scores are computed in float32 as (q.k * scale + bias) * log2(e): a bias below about -2.4e38
    overflows to -inf, and a query whose every key is -inf gets a non-finite log-sum-exp, whose
    backward is NaN. Masks use `MASKED_KEY_BIAS`, which keeps such a query finite.
  The branch calls the kernels through `MemoryEfficientKernels`, which tests replace with a CPU
  emulator of this contract (tests/mem_eff_emulator.py: `memory_efficient_kernels`), so that the
  branch's argument preparation, layouts and masking run in the CPU suite.
- Elsewhere: matmul + softmax in float32 (forward only).

Shapes: q [X, H, M, D], k and v [X, Hkv, L, D] (H a multiple of Hkv), bias [X, 1, 1, L] or, where it
depends on the query (a sliding window), [X, 1, M, L], additive (0 or `MASKED_KEY_BIAS`), causal
top-left aligned (M == L). The log-sum-exp is float32, natural log.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

__all__ = [
    "attend",
    "merge_sinks",
    "applied_softcap",
    "attend_backward",
    "MASKED_KEY_BIAS",
    "MemoryEfficientKernels",
    "TORCH_MEMORY_EFFICIENT",
    "memory_efficient_kernels",
]

_CUDA_BIAS_ALIGNMENT_BYTES = 16  # the memory-efficient kernels read the bias with 128-bit loads
_CUDA_LSE_MULTIPLE = 32  # the memory-efficient kernels pad their log-sum-exp's last dim to this
# The bias of a masked key: float16's most negative finite value, in every dtype (bfloat16 rounds it to
# -65536). Far enough below any real score that exp() of the difference is exactly 0, and small enough
# that float32 resolves it to 2^-7: a query whose every key is masked (a left-padding position) gets
# scores and a log-sum-exp that agree to ~0.01, so the backward's exp(s - lse) stays near 1. (At -1e30
# they would agree only to float32's step there, 7.6e22: exp(s - lse) is 0 or inf. At float32's minimum
# the CUDA kernels' (q.k * scale + bias) * log2(e) overflows to -inf: NaN output and gradients.)
MASKED_KEY_BIAS = -65504.0


@dataclasses.dataclass(frozen=True)
class MemoryEfficientKernels:
    """The two entry points the memory-efficient branch calls, with the signatures of
    `aten._scaled_dot_product_efficient_attention` and `aten._scaled_dot_product_efficient_attention_backward`."""

    forward: Callable
    backward: Callable


TORCH_MEMORY_EFFICIENT = MemoryEfficientKernels(
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward,
)
# Device type -> the kernels its tensors go through the memory-efficient branch with.
_memory_efficient: dict[str, MemoryEfficientKernels] = {"cuda": TORCH_MEMORY_EFFICIENT}


@contextlib.contextmanager
def memory_efficient_kernels(kernels: MemoryEfficientKernels, device_type: str = "cuda") -> Iterator[None]:
    """Within the block, tensors on `device_type` take the memory-efficient branch with `kernels`:
    the CPU suite routes CPU tensors through the CUDA branch to an emulator of the kernels' contract.
    Not thread-safe (a test tool)."""
    previous = _memory_efficient.get(device_type)
    _memory_efficient[device_type] = kernels
    try:
        yield
    finally:
        if previous is None:
            del _memory_efficient[device_type]
        else:
            _memory_efficient[device_type] = previous


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    with_lse: bool = True,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention of q over k, v with an additive key bias: (out [X, H, M, D], lse [X, H, M] or None).
    `softcap`: scores capped, softcap * tanh(s / softcap) before the bias (Gemma 2's attn_logit_softcapping),
    which no fused kernel takes: matmuls and softmax in float32 on any device, differentiable by autograd
    (the training forward's backward too)."""
    if softcap is not None:
        return _attend_capped(q, k, v, bias, softcap, causal, scale, with_lse)
    kernels = _memory_efficient.get(q.device.type)
    if kernels is not None:
        heads, m = q.shape[1], q.shape[2]
        out, lse, _, _ = kernels.forward(
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
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        return out, lse if with_lse else None
    if causal:
        raise NotImplementedError(f"torchkvops: causal fused attention on {q.device.type} (served: cpu, cuda)")
    k, v = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v)
    return out, lse if with_lse else None


def applied_softcap(softcap: float | None, implementation: str | None) -> float | None:
    """The cap on attention scores (Gemma 2's attn_logit_softcapping, passed to the attention function as
    `softcap`) that the model's own attention `implementation` applies, which a torchkvops attention in its
    place must apply too: eager, flash and flex apply it; transformers' SDPA path takes none (5.17 drops it
    silently, where Gemma 2 loads with SDPA; later releases refuse to load such a model with SDPA)."""
    return None if implementation == "sdpa" else softcap


def merge_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Attention sinks (gpt-oss's `s_aux`) merged into an attention's output over its keys `out` [..., D] and
    their log-sum-exp `lse` [...]: each head's sink logit (`sinks`, broadcast to lse's shape) joins the
    softmax with no value, so `out` is scaled by the keys' share exp(lse - logaddexp(lse, sink)).
    Returns (out, the log-sum-exp over keys and sink)."""
    total = torch.logaddexp(lse, sinks.float())
    return (out.float() * torch.exp(lse - total)[..., None]).to(out.dtype), total


def _attend_capped(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, softcap: float, causal: bool, scale: float | None, with_lse: bool
) -> tuple[Tensor, Tensor | None]:
    """`attend` with capped scores (its `softcap`). bias [X, 1, 1 or M, L]."""
    heads, m, length = q.shape[1], q.shape[2], k.shape[2]
    k, v = _repeat_heads(k, heads), _repeat_heads(v, heads)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = softcap * torch.tanh(scores / softcap) + bias.float()
    if causal:  # top-left aligned (M == L)
        above = torch.ones(m, length, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype)
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
    see torchkvops.training.prefix_attention)."""
    kernels = _memory_efficient.get(q.device.type)
    if kernels is None:
        if q.device.type != "cpu":
            raise NotImplementedError(f"torchkvops: fused attention backward on {q.device.type} (served: cpu, cuda)")
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    heads, m = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    # +inf past the last query, as the forward pads it: the kernel reads the whole 32-row tile.
    padded_lse = lse.new_full((*lse.shape[:-1], _round_up(max(m, 1), _CUDA_LSE_MULTIPLE)), float("inf"))
    padded_lse[..., :m] = lse
    seed_offset = torch.zeros(2, dtype=torch.int64, device=q.device)  # unused: no dropout
    dq, dk, dv, _ = kernels.backward(
        grad.contiguous(),
        q,
        _repeat_heads(k, heads),
        _repeat_heads(v, heads),
        _cuda_bias(bias, heads, m),
        _in_forward_layout(out),
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


def _in_forward_layout(out: Tensor) -> Tensor:
    """`out` [X, H, M, D] laid out in memory as [X, M, H, D] (the forward's own output is): the backward
    kernel assumes that query stride. A copy only when `out` is laid out otherwise."""
    heads, dim = out.shape[1], out.shape[3]
    if out.shape[2] <= 1 or (out.stride(2) == heads * dim and out.stride(3) == 1):
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _cuda_bias(bias: Tensor, heads: int, queries: int) -> Tensor:
    """[X, 1, 1 or queries, L] -> [X, heads, queries, L] as the memory-efficient kernels take it: a
    broadcast view, of `bias` itself when it starts at a 16-byte boundary and so does each of its rows,
    else of a padded copy. The start is judged by the storage offset (torch's allocators align every
    storage's base to at least 64 bytes), which a compiled decode step can read where it cannot read an
    address."""
    x, rows, length = bias.shape[0], bias.shape[2], bias.shape[-1]
    aligned = lambda stride: (stride * bias.element_size()) % _CUDA_BIAS_ALIGNMENT_BYTES == 0  # noqa: E731
    misaligned = (
        not aligned(bias.storage_offset())
        or (x > 1 and not aligned(bias.stride(0)))
        or (rows > 1 and not aligned(bias.stride(2)))
    )
    if misaligned or bias.stride(-1) != 1:
        per_row = _CUDA_BIAS_ALIGNMENT_BYTES // bias.element_size()
        padded = bias.new_zeros(x, 1, rows, _round_up(max(length, 1), per_row))
        padded[..., :length] = bias
        bias = padded[..., :length]
    return bias.expand(x, heads, queries, length)


def _repeat_heads(t: Tensor, heads: int) -> Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_heads(grad: Tensor, kv_heads: int) -> Tensor:
    x, heads, length, dim = grad.shape
    return grad if heads == kv_heads else grad.view(x, kv_heads, heads // kv_heads, length, dim).sum(dim=2)
