"""Response lengths of a bench run (`--length-profile`): how long the model's responses are.

  fixed      no EOS at all: every row generates exactly R tokens (what bench measured before; the
             default, for per-step timings over a fixed amount of work)
  geometric  realistic, spread lengths: at every step, every row samples EOS with probability
             p = min(4 / R, 1/2) whatever its context, so lengths are geometric with mean R/4 (one row
             in e^4 ~ 55 runs to R without an EOS): most rows end early, a few run long, and the
             longest decides how many steps a static batch decodes
  eos-rate   the same spread, but its mean M (`--mean-length`) does not follow R: EOS probability
             p = min(1 / M, 1/2) at every step, so a generous budget R >> M only caps the few longest
             rows, and the same rows sample the same tokens at every budget that holds them (what RL
             users run: budgets of 1k-16k tokens, most responses far shorter); what a rollout then costs
             at a small and a large budget shows what follows the budget rather than the rows

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

LENGTH_PROFILES = ("fixed", "geometric", "eos-rate")
# The mean response length, as a fraction of R.
MEAN_FRACTION = 0.25


class GeometricEOSHead(nn.Module):
    """An LM head whose EOS token has probability p at every position (see the module docstring)."""

    def __init__(self, head: nn.Module, eos: int, vocab: int, temperature: float, mean_length: int | None = None):
        super().__init__()
        self.head = head
        self.eos = eos
        self.mean_length = mean_length  # eos-rate: the mean, whatever R; None: geometric (R / 4)
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


def install(
    model: nn.Module, profile: str, eos: int | None, temperature: float, mean_length: int | None = None
) -> None:
    """Give `model` the response lengths of `profile` (LENGTH_PROFILES): for "geometric" and "eos-rate"
    (whose mean is `mean_length`), wrap its LM head (the EOS id `eos`, sampled at `temperature`); "fixed"
    changes nothing."""
    if profile not in LENGTH_PROFILES:
        raise ValueError(f"length profile must be one of {', '.join(LENGTH_PROFILES)}, got {profile!r}")
    if profile == "fixed":
        return
    if profile == "eos-rate" and not (isinstance(mean_length, int) and mean_length >= 1):
        raise ValueError(f"the eos-rate length profile needs a mean length >= 1, got {mean_length!r}")
    if eos is None:
        raise ValueError(f"the {profile} length profile needs an EOS token id, and the model has none")
    if not temperature > 0:
        raise ValueError(
            f"the {profile} length profile needs sampling (a temperature > 0): greedy decoding picks EOS never or always"
        )
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    mean = mean_length if profile == "eos-rate" else None
    model.set_output_embeddings(GeometricEOSHead(head, eos, vocab, temperature, mean))


def eos_id(model: nn.Module) -> int | None:
    """The EOS id responses end with under the model's length profile; None: no EOS (fixed lengths)."""
    head = model.get_output_embeddings()
    return head.eos if isinstance(head, GeometricEOSHead) else None


def eos_probability(response_length: int) -> float:
    return min(1 / (MEAN_FRACTION * response_length), 0.5)


def set_response_length(model: nn.Module, response_length: int) -> None:
    """Set the EOS probability for a case of `response_length` (R): geometric's mean is a quarter of R,
    eos-rate's its own mean whatever R; a no-op for fixed lengths."""
    head = model.get_output_embeddings()
    if isinstance(head, GeometricEOSHead):
        p = eos_probability(response_length) if head.mean_length is None else min(1 / head.mean_length, 0.5)
        head.log_odds.fill_(math.log(p / (1 - p)))


def describe(profile: str, mean_length: int | None = None) -> str:
    if profile == "fixed":
        return "fixed: no EOS, every row generates exactly R tokens"
    if profile == "eos-rate":
        return (
            f"eos-rate: every row samples EOS with probability min(1/{mean_length}, 1/2) at every step, so response "
            f"lengths are geometric with mean {mean_length} whatever R, capped at R"
        )
    return (
        "geometric: every row samples EOS with probability min(4/R, 1/2) at every step (the LM head's EOS logit "
        "set to T * (logsumexp(other logits / T) + log(p / (1 - p)))), so response lengths are geometric with "
        "mean R/4, capped at R"
    )
