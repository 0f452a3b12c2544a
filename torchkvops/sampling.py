"""Token sampling without host syncs: greedy, temperature, top-k and top-p.

Randomness comes from a counter-based hash of (seed, row, step, token id) rather than a generator's
state, so that each row's draws are its own, reproducible from the seed, identical on every device
and under CUDA graphs, and independent of how the prefill was batched. A draw is Gumbel-max:
argmax(logits / temperature + Gumbel noise) samples from softmax(logits / temperature).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["SamplingParams", "sample", "row_keys"]

_MASK32 = 0xFFFFFFFF


def _hash32(x):
    """A 32-bit integer mix of a tensor or a Python int (multipliers below 2**31, so int64 products
    never overflow)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _MASK32
    x = x ^ (x >> 16)
    return x


def row_keys(seed: int, row_ids: Tensor) -> Tensor:
    """One 32-bit key per row, from the seed and each row's index (`row_ids`, int64, on the device the
    keys are wanted on): [rows] int64. A row's key depends on its index alone, so a row keeps its
    samples when other rows are added before or after it (another shard, another prompt)."""
    seed_mix = _hash32(seed & _MASK32) ^ _hash32(((seed >> 32) & _MASK32) + 0x3C6EF372)  # Python ints
    return _hash32(_hash32(row_ids + 0x1B873593) ^ seed_mix)


def _gumbel(keys: Tensor, step: Tensor, vocab: int) -> Tensor:
    """Gumbel noise [rows, vocab] for decode step `step` (a 1-element tensor)."""
    step_key = _hash32(keys ^ _hash32(step + 0x5BD1E995))  # [rows]
    token = torch.arange(vocab, dtype=torch.long, device=keys.device)
    bits = _hash32(step_key[:, None] ^ _hash32(token + 0x27D4EB2F)[None, :])
    u = (bits.to(torch.float32) + 0.5) * (1.0 / 4294967296.0)  # uniform in (0, 1)
    return -torch.log(-torch.log(u))


class SamplingParams:
    def __init__(self, temperature: float, top_k: int, top_p: float):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: Tensor, params: SamplingParams, keys: Tensor, step: Tensor) -> Tensor:
    """Next token per row: logits [rows, vocab] -> [rows] int64."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return (logits + _gumbel(keys, step, vocab)).argmax(dim=-1)
