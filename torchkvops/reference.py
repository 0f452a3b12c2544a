"""Pure-PyTorch references of the torchkvops operators: the oracle the tests compare against."""

import torch
from torch import Tensor


def repeat_kv_cache_(cache: Tensor, batch: int, repeats: int, num_tokens: int) -> None:
    prompts = cache[..., :batch, :, :num_tokens, :].clone()
    cache[..., : batch * repeats, :, :num_tokens, :] = prompts.repeat_interleave(repeats, dim=-4)


def repeat_kv_cache(cache: Tensor, repeats: int) -> Tensor:
    return cache.repeat_interleave(repeats, dim=-4)


def write_kv_(cache: Tensor, key: Tensor, value: Tensor, layer: int, start: Tensor) -> None:
    rows, tokens, first = key.shape[0], key.shape[2], int(start.reshape(()))
    cache[layer, 0, :rows, :, first : first + tokens] = key
    cache[layer, 1, :rows, :, first : first + tokens] = value


def merge_attention_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """ops.merge_attention_states in eager PyTorch, with the same edge cases (see its docstring)."""
    a, b = out_a.float(), out_b.float()
    bad = lse_a.isnan() | lse_b.isnan() | (lse_a == float("inf")) | (lse_b == float("inf"))
    m = torch.maximum(lse_a, lse_b)
    both_empty = m == float("-inf")
    m = torch.where(both_empty | bad, 0.0, m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)  # both empty: 0 and 0
    s = wa + wb
    lse = torch.where(bad, float("nan"), m + torch.log(s))  # both empty: log(0) = -inf
    s = torch.where(both_empty, 1.0, s)
    ca, cb = torch.where(bad, float("nan"), wa / s), torch.where(bad, float("nan"), wb / s)
    ca, cb = ca.unsqueeze(-1), cb.unsqueeze(-1)
    # A zero weight drops its term: the empty part's output is never read (it may be NaN).
    out = torch.where(ca == 0, b, torch.where(cb == 0, a, ca * a + cb * b))
    out = torch.where(both_empty.unsqueeze(-1), 0.0, out)
    return out.to(out_a.dtype), lse
