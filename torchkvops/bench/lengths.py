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
  log-normal lengths L = ceil(X), X log-normal with mean M (`--mean-length`) and shape sigma
             (`--length-sigma`, default 1): a heavier tail than eos-rate's (with sigma 1, one response
             in 40 is over 4.4x the mean), the few long ones capped at R; EOS is drawn at each row's
             response token t with the hazard P(L = t + 1 | L > t), so each row's chance to end depends
             on how long it already is (its position, less the prompt's length: prompts unpadded, as
             the bench's synthetic ones are)

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

log-normal needs each row's position, which the LM head does not see: the model's forward is wrapped
(`LogNormalEOS`) and sets the EOS logit the same way on the logits it returns, from the position_ids
it was called with (the rollout's and HF generate's calls pass them), the prompt length a buffer set per
case (`set_response_length(..., prompt_length=)`).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

__all__ = [
    "LENGTH_PROFILES",
    "GeometricEOSHead",
    "LogNormalEOS",
    "install",
    "eos_id",
    "set_response_length",
    "describe",
]

LENGTH_PROFILES = ("fixed", "geometric", "eos-rate", "log-normal")
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


class LogNormalEOS:
    """log-normal lengths (module docstring): `__call__(logits, positions)` returns the logits with each
    row's EOS logit set to T * (logsumexp(other logits / T) + log(h / (1 - h))), h the hazard of its
    response token t = position - (prompt_length - 1)."""

    def __init__(self, eos: int, vocab: int, temperature: float, mean_length: int, sigma: float, device):
        self.eos, self.temperature, self.mean_length, self.sigma = eos, float(temperature), mean_length, sigma
        self.mu = math.log(mean_length) - sigma * sigma / 2  # (the mean of X is exp(mu + sigma^2 / 2) = M)
        self.is_eos = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.is_eos[eos] = True
        self.last_prompt_position = torch.zeros((), dtype=torch.long, device=device)  # prompt_length - 1

    def survival(self, x: Tensor) -> Tensor:
        """P(X > x), float64 (1 at x = 0)."""
        return 0.5 * torch.erfc((torch.log(x) - self.mu) / (self.sigma * math.sqrt(2.0)))

    def hazard(self, positions: Tensor) -> Tensor:
        """P(L = t + 1 | L > t) for the token each position draws (t = 0: a response's first token)."""
        t = (positions - self.last_prompt_position).clamp(min=0).double()
        now = self.survival(t)
        h = (now - self.survival(t + 1)) / now
        return torch.nan_to_num(h, nan=1.0).clamp(1e-12, 1 - 1e-12)  # (nan: past every length float64 holds)

    def __call__(self, logits: Tensor, positions: Tensor) -> Tensor:
        h = self.hazard(positions)
        log_odds = (torch.log(h) - torch.log1p(-h)).float()[..., None]
        scaled = logits.float().masked_fill(self.is_eos, float("-inf")) / self.temperature
        eos = self.temperature * (torch.logsumexp(scaled, dim=-1, keepdim=True) + log_odds)
        return torch.where(self.is_eos, eos.to(logits.dtype), logits)


def _kept_positions(kwargs: dict, logits: Tensor) -> Tensor:
    """The positions of the tokens whose logits a forward returned (its position_ids, or its
    cache_position for every row, as far as logits_to_keep kept them)."""
    positions = kwargs.get("position_ids")
    if positions is None:
        cache_position = kwargs.get("cache_position")
        if cache_position is None:
            raise ValueError("the log-normal length profile needs the positions the model is called with")
        positions = cache_position[None, :].expand(logits.shape[0], -1)
    keep = kwargs.get("logits_to_keep", 0)
    if isinstance(keep, Tensor):
        positions = positions[:, keep]
    elif keep:
        positions = positions[:, -keep:]
    if positions.shape != logits.shape[:2]:
        raise ValueError(
            f"the log-normal length profile found positions {tuple(positions.shape)} for logits "
            f"{tuple(logits.shape)}: a forward it does not know"
        )
    return positions


def _wrap_forward(model: nn.Module, lengths: LogNormalEOS) -> None:
    original = model.forward

    @functools.wraps(original)  # (the signature callers inspect stays the model's)
    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = lengths(out.logits, _kept_positions(kwargs, out.logits))
        return out

    model.forward = forward
    model._torchkvops_log_normal = lengths


def install(
    model: nn.Module,
    profile: str,
    eos: int | None,
    temperature: float,
    mean_length: int | None = None,
    sigma: float = 1.0,
) -> None:
    """Give `model` the response lengths of `profile` (LENGTH_PROFILES): for "geometric" and "eos-rate"
    (whose mean is `mean_length`), wrap its LM head (the EOS id `eos`, sampled at `temperature`); for
    "log-normal" (mean `mean_length`, shape `sigma`), its forward; "fixed" changes nothing."""
    if profile not in LENGTH_PROFILES:
        raise ValueError(f"length profile must be one of {', '.join(LENGTH_PROFILES)}, got {profile!r}")
    if profile == "fixed":
        return
    if profile in ("eos-rate", "log-normal") and not (isinstance(mean_length, int) and mean_length >= 1):
        raise ValueError(f"the {profile} length profile needs a mean length >= 1, got {mean_length!r}")
    if profile == "log-normal" and not (isinstance(sigma, (int, float)) and 0 < sigma <= 4):
        raise ValueError(f"the log-normal length profile needs a sigma in (0, 4], got {sigma!r}")
    if eos is None:
        raise ValueError(f"the {profile} length profile needs an EOS token id, and the model has none")
    if not temperature > 0:
        raise ValueError(
            f"the {profile} length profile needs sampling (a temperature > 0): greedy decoding picks EOS never or always"
        )
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    if profile == "log-normal":
        _wrap_forward(model, LogNormalEOS(eos, vocab, temperature, mean_length, float(sigma), head.weight.device))
        return
    mean = mean_length if profile == "eos-rate" else None
    model.set_output_embeddings(GeometricEOSHead(head, eos, vocab, temperature, mean))


def eos_id(model: nn.Module) -> int | None:
    """The EOS id responses end with under the model's length profile; None: no EOS (fixed lengths)."""
    log_normal = getattr(model, "_torchkvops_log_normal", None)
    if log_normal is not None:
        return log_normal.eos
    head = model.get_output_embeddings()
    return head.eos if isinstance(head, GeometricEOSHead) else None


def eos_probability(response_length: int) -> float:
    return min(1 / (MEAN_FRACTION * response_length), 0.5)


def set_response_length(model: nn.Module, response_length: int, prompt_length: int | None = None) -> None:
    """Set the EOS probability for a case of `response_length` (R): geometric's mean is a quarter of R,
    eos-rate's its own mean whatever R; log-normal's hazard counts from the case's `prompt_length` (its
    prompts unpadded); a no-op for fixed lengths."""
    log_normal = getattr(model, "_torchkvops_log_normal", None)
    if log_normal is not None:
        if prompt_length is None:
            raise ValueError("the log-normal length profile needs the case's prompt length")
        log_normal.last_prompt_position.fill_(prompt_length - 1)
        return
    head = model.get_output_embeddings()
    if isinstance(head, GeometricEOSHead):
        p = eos_probability(response_length) if head.mean_length is None else min(1 / head.mean_length, 0.5)
        head.log_odds.fill_(math.log(p / (1 - p)))


def describe(profile: str, mean_length: int | None = None, sigma: float = 1.0) -> str:
    if profile == "fixed":
        return "fixed: no EOS, every row generates exactly R tokens"
    if profile == "log-normal":
        return (
            f"log-normal: response lengths ceil(X), X log-normal with mean {mean_length} and sigma {sigma:g}, "
            "capped at R (EOS drawn at each row's response token with the hazard of that length)"
        )
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
