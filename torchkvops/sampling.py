"""Token sampling without host syncs: greedy, temperature, top-k and top-p.

Randomness comes from a counter-based hash of (seed, row, step, token id) rather than a generator's
state, so that each row's draws are its own, reproducible from the seed, identical on every device
and under CUDA graphs, and independent of how the prefill was batched. A draw is Gumbel-max:
argmax(logits / temperature + Gumbel noise) samples from softmax(logits / temperature).

`sample` is one call of the `torchkvops::sample_tokens` operator (CPU and CUDA kernels, one pass over
the logits, thresholds by selection rather than sorting); `torchkvops.reference.sample_tokens` is the
pure-PyTorch oracle it matches. `sample_with_logprobs` calls `sample_tokens_with_logprobs`, which also
returns each drawn token's log-probability. The hash lives here, once, for both.
"""

from __future__ import annotations

from torch import Tensor

from . import ops

__all__ = ["SamplingParams", "sample", "sample_with_logprobs", "row_keys"]

_MASK32 = 0xFFFFFFFF
# The salts of the per-step and per-token hashes; the C++ kernels use the same (csrc/sample_tokens.h).
STEP_SALT = 0x5BD1E995
TOKEN_SALT = 0x27D4EB2F
LOW_SALT = 0x165667B1


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
