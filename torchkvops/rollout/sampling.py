"""Token sampling without host syncs: greedy, temperature, top-k and top-p.

Randomness comes from a counter-based hash of (seed, row, step, token id) rather than a generator's
state, so that each row's draws are its own, reproducible from the seed on a given device, the same
under CUDA graphs, and independent of how the prefill was batched. A draw is Gumbel-max:
argmax(logits / temperature + Gumbel noise) samples from softmax(logits / temperature).

Across devices, exactly what holds:
- The noise's 64-bit words are integers, the same on every device. Greedy draws (argmax of the raw
  logits) are the same on every device.
- `logits / temperature` is rounded as torch rounds it on each device, as HF's temperature warper
  (`scores / temperature`) does: the CPU divides in float32, CUDA multiplies by the float32
  reciprocal of the temperature. The two round differently for some logits unless the temperature is
  a power of two (1.0 included).
- The Gumbel noise takes logs in float32: the C library's on the CPU, CUDA's `logf` / `log1pf` on the
  GPU, which may differ in the last bit.
So a sampled token can differ between CPU and CUDA where two tokens' perturbed scores are within
float32 rounding of each other, or where a token sits within rounding of the top-k / top-p cut (a tie
there keeps it on one device and not the other); elsewhere it is the same. Log-probabilities agree to
float32 rounding of a sum over the row (the CPU kernel sums in double, CUDA in float), not bit for bit.
tests/test_sample_tokens_cuda_emulated.py shows the rounding difference on a pair of logits.

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
    """Next token per row: logits [rows, vocab] -> [rows] int64 (keys [rows] int64; step int64, 1 element
    for every row or [rows], each row's own; both on logits' device)."""
    return ops.sample_tokens(logits, keys, step, params.temperature, params.top_k, params.top_p)


def sample_with_logprobs(logits: Tensor, params: SamplingParams, keys: Tensor, step: Tensor) -> tuple[Tensor, Tensor]:
    """`sample`'s tokens and their log-probabilities under the distribution they were drawn from
    ([rows] int64, [rows] float32; see ops.sample_tokens_with_logprobs)."""
    return ops.sample_tokens_with_logprobs(logits, keys, step, params.temperature, params.top_k, params.top_p)
