"""Response lengths of a bench run (`--length-profile`): how long the model's responses are.

  fixed      no EOS at all: every row generates exactly R tokens (what bench measured before; the
             default, for per-step timings over a fixed amount of work)
  geometric  realistic, spread lengths: at every step, every row samples EOS with probability
             p = min(4 / R, 1/2) whatever its context, so lengths are geometric with mean R/4 (one row
             in e^4 ~ 55 runs to R without an EOS): most rows end early, a few run long, and the
             longest decides how many steps a static batch decodes

How geometric is made, deterministically and the same for every mode (the rollout's and Hugging Face
generate): the random-weight model's LM head is wrapped (`GeometricEOSHead`) so that the EOS logit it
returns is T * (logsumexp over the other logits / T + log(p / (1 - p))), with T the sampling
temperature: softmax(logits / T) then gives EOS exactly probability p, and the other tokens their
relative probabilities. Under top-k / top-p the EOS may be cut from the kept set, so the profile is
defined for plain sampling (top_k=0, top_p=1; the bench's default); greedy decoding would pick EOS
never or always, so geometric needs a temperature > 0. p is set per case from its R
(`set_response_length`), through a buffer updated in place, so compiled and CUDA-graphed decode read
it without recompiling or re-capturing. Which tokens the rows sample depends on the sampler's
random stream: the rollout's modes sample the same lengths (same keys), Hugging Face generate other
lengths of the same distribution.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["LENGTH_PROFILES", "GeometricEOSHead", "install", "eos_id", "set_response_length", "describe"]

LENGTH_PROFILES = ("fixed", "geometric")
# The mean response length, as a fraction of R.
MEAN_FRACTION = 0.25


class GeometricEOSHead(nn.Module):
    """An LM head whose EOS token has probability p at every position (see the module docstring)."""

    def __init__(self, head: nn.Module, eos: int, vocab: int, temperature: float):
        super().__init__()
        self.head = head
        self.eos = eos
        self.temperature = float(temperature)
        self.out_features = vocab  # what torchkvops.hf reads as the output vocabulary
        is_eos = torch.zeros(vocab, dtype=torch.bool, device=head.weight.device)
        is_eos[eos] = True
        self.register_buffer("is_eos", is_eos, persistent=False)
        self.register_buffer(
            "log_odds", torch.zeros((), dtype=torch.float32, device=head.weight.device), persistent=False
        )

    @property
    def weight(self) -> Tensor:
        return self.head.weight

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.head(hidden)
        scaled = logits.float().masked_fill(self.is_eos, float("-inf")) / self.temperature
        eos = self.temperature * (torch.logsumexp(scaled, dim=-1, keepdim=True) + self.log_odds)
        return torch.where(self.is_eos, eos.to(logits.dtype), logits)


def install(model: nn.Module, profile: str, eos: int | None, temperature: float) -> None:
    """Give `model` the response lengths of `profile` (LENGTH_PROFILES): for "geometric", wrap its LM
    head (the EOS id `eos`, sampled at `temperature`); "fixed" changes nothing."""
    if profile not in LENGTH_PROFILES:
        raise ValueError(f"length profile must be one of {', '.join(LENGTH_PROFILES)}, got {profile!r}")
    if profile == "fixed":
        return
    if eos is None:
        raise ValueError("the geometric length profile needs an EOS token id, and the model has none")
    if not temperature > 0:
        raise ValueError(
            "the geometric length profile needs sampling (a temperature > 0): greedy decoding picks EOS never or always"
        )
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    model.set_output_embeddings(GeometricEOSHead(head, eos, vocab, temperature))


def eos_id(model: nn.Module) -> int | None:
    """The EOS id responses end with under the model's length profile; None: no EOS (fixed lengths)."""
    head = model.get_output_embeddings()
    return head.eos if isinstance(head, GeometricEOSHead) else None


def eos_probability(response_length: int) -> float:
    return min(1 / (MEAN_FRACTION * response_length), 0.5)


def set_response_length(model: nn.Module, response_length: int) -> None:
    """Make the mean response length a quarter of `response_length` (a no-op for fixed lengths)."""
    head = model.get_output_embeddings()
    if isinstance(head, GeometricEOSHead):
        p = eos_probability(response_length)
        head.log_odds.fill_(math.log(p / (1 - p)))


def describe(profile: str) -> str:
    if profile == "fixed":
        return "fixed: no EOS, every row generates exactly R tokens"
    return (
        "geometric: every row samples EOS with probability min(4/R, 1/2) at every step (the LM head's EOS logit "
        "set to T * (logsumexp(other logits / T) + log(p / (1 - p)))), so response lengths are geometric with "
        "mean R/4, capped at R"
    )
