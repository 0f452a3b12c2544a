"""Token sampling without host syncs: greedy, temperature, top-k and top-p.

Randomness comes from a counter-based hash of (seed, row, step, token id) rather than a generator's
state, so that each row's draws are its own, reproducible from the seed, identical on every device
and under CUDA graphs, and independent of how the prefill was batched. A draw is Gumbel-max:
argmax(logits / temperature + Gumbel noise) samples from softmax(logits / temperature).

`sample` is one call of the `torchkvops::sample_tokens` operator (CPU and CUDA kernels, one pass over
the logits, thresholds by selection rather than sorting); `torchkvops.reference.sample_tokens` is the
pure-PyTorch oracle it matches. `sample_with_logprobs` calls `sample_tokens_with_logprobs`, which also
returns each drawn token's log-probability. The hash is defined once, in torchkvops.reference, for both.
"""

from __future__ import annotations

from torch import Tensor

from .. import ops
from ..reference import MASK32, hash32

__all__ = ["SamplingParams", "sample", "sample_with_logprobs", "row_keys"]


def row_keys(seed: int, row_ids: Tensor) -> Tensor:
    """One 32-bit key per row, from the seed and each row's index (`row_ids`, int64, on the device the
    keys are wanted on): [rows] int64. A row's key depends on its index alone, so a row keeps its
    samples when other rows are added before or after it (another shard, another prompt)."""
    seed_mix = hash32(seed & MASK32) ^ hash32(((seed >> 32) & MASK32) + 0x3C6EF372)  # Python ints
    return hash32(hash32(row_ids + 0x1B873593) ^ seed_mix)


class SamplingParams:
    def __init__(self, temperature: float, top_k: int, top_p: float):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: Tensor, params: SamplingParams, keys: Tensor, step: Tensor) -> Tensor:
    """Next token per row: logits [rows, vocab] -> [rows] int64 (keys [rows] int64, step a 1-element
    int64 tensor, both on logits' device)."""
    return ops.sample_tokens(logits, keys, step, params.temperature, params.top_k, params.top_p)


def sample_with_logprobs(logits: Tensor, params: SamplingParams, keys: Tensor, step: Tensor) -> tuple[Tensor, Tensor]:
    """`sample`'s tokens and their log-probabilities under the distribution they were drawn from
    ([rows] int64, [rows] float32; see ops.sample_tokens_with_logprobs)."""
    return ops.sample_tokens_with_logprobs(logits, keys, step, params.temperature, params.top_k, params.top_p)
