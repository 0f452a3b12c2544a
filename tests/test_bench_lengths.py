"""The bench's response-length profiles (torchkvops.bench.lengths): the EOS probability the wrapped LM head
gives, and eos-rate's point: with a mean that does not follow the budget, the rows sample the same tokens
at a small and a large max_new_tokens (what a benchmark of cost against the budget needs); log-normal's
hazard at each response token, and its lengths against the distribution through the rollout and HF."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch
from models import FAMILIES, prompts

from torchkvops import Rollout, RolloutConfig
from torchkvops.bench import lengths

EOS = 2


@pytest.mark.parametrize(
    "profile,mean,response_length,want", [("geometric", None, 64, 4 / 64), ("eos-rate", 8, 7680, 1 / 8)]
)
def test_the_eos_token_gets_its_probability_at_every_position(profile, mean, response_length, want):
    model = FAMILIES["llama"]()
    lengths.install(model, profile, EOS, temperature=0.7, mean_length=mean)
    lengths.set_response_length(model, response_length)
    hidden = torch.randn(3, 5, model.config.hidden_size) * 4
    logits = model.get_output_embeddings()(hidden).double()
    p = torch.softmax(logits / 0.7, dim=-1)[..., EOS]
    torch.testing.assert_close(p, torch.full_like(p, want), rtol=1e-5, atol=0)


def test_eos_rate_rows_sample_the_same_tokens_at_a_small_and_a_large_budget():
    model = FAMILIES["llama"]()
    lengths.install(model, "eos-rate", EOS, temperature=1.0, mean_length=6)
    lengths.set_response_length(model, 64)
    ids, mask = prompts(2, 8, seed=4, left_pad=[0, 3])

    def run(budget):
        config = RolloutConfig(samples_per_prompt=4, max_new_tokens=budget, eos_token_id=EOS, temperature=1.0, seed=5)
        return Rollout(model, config).generate(ids, mask)

    small, large = run(40), run(120)  # (the tiny llama has 128 positions)
    ended = (small.responses == EOS).any(dim=1)
    assert ended.all()  # (mean 6: every row ends well inside the small budget)
    lens = small.response_mask.sum(dim=1)
    assert torch.equal(large.response_mask.sum(dim=1), lens)
    assert torch.equal(
        large.responses[:, : small.responses.shape[1]] * small.response_mask, small.responses * small.response_mask
    )
    assert lens.float().mean() < 4 * 6 and len(set(lens.tolist())) > 2  # spread lengths, mean near 6


def test_eos_rate_needs_a_mean_and_sampling():
    model = FAMILIES["llama"]()
    with pytest.raises(ValueError, match="mean length >= 1"):
        lengths.install(model, "eos-rate", EOS, temperature=1.0, mean_length=None)
    with pytest.raises(ValueError, match="needs sampling"):
        lengths.install(model, "eos-rate", EOS, temperature=0.0, mean_length=4)
    assert math.isclose(lengths.eos_probability(64), 1 / 16)


def log_normal_cdf(length: int, mean: float, sigma: float) -> float:
    """P(L <= length) for L = ceil(X), X log-normal of mean `mean` (the standard library's normal CDF of
    log X: an implementation apart from the profile's erfc)."""
    return NormalDist(math.log(mean) - sigma * sigma / 2, sigma).cdf(math.log(length)) if length > 0 else 0.0


def test_log_normal_eos_has_the_hazard_of_its_length_at_each_response_token():
    """The EOS probability at a row's response token t (its position less the prompt's last) is
    P(L = t + 1 | L > t); the prompt's own positions draw as its first token does (the prefill's last)."""
    model = FAMILIES["llama"]()
    lengths.install(model, "log-normal", EOS, temperature=0.7, mean_length=10, sigma=0.8)
    lengths.set_response_length(model, 64, prompt_length=6)
    assert lengths.eos_id(model) == EOS
    positions = torch.arange(0, 40)[None, :].expand(2, -1)
    with torch.no_grad():
        logits = model(input_ids=torch.randint(3, 90, (2, 40)), position_ids=positions).logits.double()
    p = torch.softmax(logits / 0.7, dim=-1)[..., EOS]
    want = []
    for position in range(40):
        t = max(0, position - 5)
        before, upto = log_normal_cdf(t, 10, 0.8), log_normal_cdf(t + 1, 10, 0.8)
        want.append((upto - before) / (1 - before))
    torch.testing.assert_close(p, torch.tensor(want, dtype=torch.float64).expand(2, -1), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("sampler", ["torchkvops", "hf"])
def test_log_normal_lengths_follow_their_distribution_in_the_rollout_and_in_hf_generate(sampler):
    """256 samples of one prompt: the empirical CDF of their lengths within 0.12 of the log-normal's at
    every length (the DKW inequality: a larger gap has probability < 0.2%), through the rollout's decode
    and through HF generate (both pass the positions the profile reads)."""
    model = FAMILIES["llama"]()
    mean, sigma, budget, rows = 12, 0.8, 100, 256
    lengths.install(model, "log-normal", EOS, temperature=1.0, mean_length=mean, sigma=sigma)
    lengths.set_response_length(model, budget, prompt_length=8)
    ids = torch.randint(3, 90, (1, 8), generator=torch.Generator().manual_seed(2))
    if sampler == "torchkvops":
        config = RolloutConfig(
            samples_per_prompt=rows, max_new_tokens=budget, eos_token_id=EOS, temperature=1.0, seed=7
        )
        lens = Rollout(model, config).generate(ids).response_mask.sum(dim=1)
    else:
        torch.manual_seed(7)
        with torch.no_grad():
            out = model.generate(
                ids.expand(rows, -1), do_sample=True, max_new_tokens=budget, eos_token_id=EOS, pad_token_id=0, top_k=0
            )
        ended = out[:, 8:] == EOS
        lens = torch.where(ended.any(dim=1), ended.int().argmax(dim=1) + 1, budget)
    for length in range(1, budget):
        empirical = (lens <= length).float().mean().item()
        assert abs(empirical - log_normal_cdf(length, mean, sigma)) < 0.12, (length, empirical)
    assert len(set(lens.tolist())) > 10  # spread


def test_log_normal_needs_a_mean_a_sigma_and_a_prompt_length():
    model = FAMILIES["llama"]()
    with pytest.raises(ValueError, match="mean length >= 1"):
        lengths.install(model, "log-normal", EOS, temperature=1.0, mean_length=None)
    with pytest.raises(ValueError, match=r"sigma in \(0, 4\]"):
        lengths.install(model, "log-normal", EOS, temperature=1.0, mean_length=8, sigma=0.0)
    lengths.install(model, "log-normal", EOS, temperature=1.0, mean_length=8)
    with pytest.raises(ValueError, match="prompt length"):
        lengths.set_response_length(model, 64)
