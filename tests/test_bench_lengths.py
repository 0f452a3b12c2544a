"""The bench's response-length profiles (torchkvops.bench.lengths): the EOS probability the wrapped LM head
gives, and eos-rate's point: with a mean that does not follow the budget, the rows sample the same tokens
at a small and a large max_new_tokens (what a benchmark of cost against the budget needs)."""

from __future__ import annotations

import math

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
