"""Rollout.extend (torchkvops.rollout.turns): multi-turn rollouts that keep each row's KV across calls.

The oracle is Hugging Face's generate (greedy) or the plain forward (sampling) run on each row's full
history alone: prompt, every earlier turn's response and appended tokens, then this turn's appended."""

import math

import conftest
import pytest
import torch
from devices import DEVICES
from models import FAMILIES, VOCAB, prompts
from transformers import LlamaConfig, LlamaForCausalLM

from torchkvops import Rollout, RolloutConfig

EOS = [41, 60, 90]  # several EOS ids: rows of the random models end at different steps


def eos_cut(tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` through the first EOS (all of them without one)."""
    hits = [i for i, t in enumerate(tokens.tolist()) if t in EOS]
    return tokens[: hits[0] + 1] if hits else tokens


def hf_response(model, history: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """HF's greedy continuation of one row's full history (1-D ids, no padding), through its first EOS."""
    with torch.no_grad():
        out = model.generate(
            history[None],
            attention_mask=torch.ones_like(history)[None],
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    return eos_cut(out[0, history.numel() :].cpu())


def random_appended(rows: int, generator, low: int, high: int, finished=()) -> list:
    return [
        None
        if r in finished
        else torch.randint(
            3, VOCAB, (int(torch.randint(low, high + 1, (1,), generator=generator)),), generator=generator
        ).tolist()
        for r in range(rows)
    ]


def run_turns(model, config, ids, mask, turns, appended_lengths=(0, 8), finished_at=None, device="cpu"):
    """generate, then `turns` extends with random appended tokens; after each, every live row's new tokens
    are checked against HF generate on that row's full history. Returns the rollout and last output."""
    rollout = Rollout(model, config)
    out = rollout.generate(ids.to(device), mask.to(device))
    rows = out.responses.shape[0]
    n = config.samples_per_prompt
    histories = [out.responses[r][: int(out.response_mask[r].sum())].cpu() for r in range(rows)]
    g = torch.Generator().manual_seed(1)
    for turn in range(turns):
        finished = (finished_at or {}).get(turn, ())
        appended = random_appended(rows, g, *appended_lengths, finished=finished)
        out = rollout.extend(out, appended)
        for r in range(rows):
            prompt = ids[r // n][mask[r // n].bool()]
            if appended[r] is None:
                assert torch.equal(out.responses[r][: histories[r].numel()].cpu(), histories[r])
                continue
            before = torch.cat([histories[r], torch.tensor(appended[r], dtype=torch.long)])
            expected = hf_response(model, torch.cat([prompt, before]).to(device), config.max_new_tokens)
            got = out.responses[r].cpu()
            assert torch.equal(got[: before.numel()], before), (turn, r)
            assert torch.equal(got[before.numel() : before.numel() + expected.numel()], expected), (turn, r)
            histories[r] = torch.cat([before, expected])
        for r in range(rows):  # the output is exactly the histories, right-padded with the pad id
            h = histories[r]
            assert torch.equal(out.responses[r, : h.numel()].cpu(), h)
            assert bool((out.responses[r, h.numel() :] == rollout.pad_id).all())
    return rollout, out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", ["copy", "prefix", "paged"])
def test_greedy_turns_equal_hf_generate_on_each_full_history(family_models, family, layout):
    """Three extends, rows of different history lengths (left-padded prompts, responses that end at
    different steps), a row finished (None) at the second turn that keeps its history."""
    model = family_models[family]
    cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=10, kv_sharing=layout, eos_token_id=EOS)
    ids, mask = prompts(3, 7, seed=1, left_pad=[0, 2, 3])
    run_turns(model, cfg, ids, mask, turns=3, finished_at={1: (3,)})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["copy", "prefix", "paged"])
@pytest.mark.parametrize("compact", [True, False])
def test_greedy_turns_with_compaction_and_long_appends(layout, compact, device):
    """Responses long enough for compaction in every turn (rows that left a compacted batch keep their
    KV), appended lengths from 0 to 100; on CUDA every turn's decode replays CUDA graphs."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval().to(device)
    cfg = RolloutConfig(
        samples_per_prompt=3, max_new_tokens=40, kv_sharing=layout, eos_token_id=EOS, compact_finished_rows=compact
    )
    ids, mask = prompts(2, 9, seed=3, left_pad=[0, 4])
    rollout, _ = run_turns(model, cfg, ids, mask, turns=2, appended_lengths=(0, 100), device=device)
    counters = rollout.decode_counters()
    assert (counters.compactions > 0) == compact
    assert (counters.captured_graphs > 0) == (device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_extend_reports_what_it_computed_and_what_it_reused(device):
    model = FAMILIES["llama"]().to(device)
    cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=6, eos_token_id=[], enable_profiling=True)
    ids, mask = prompts(2, 5, seed=0, left_pad=[0, 2])
    rollout = Rollout(model, cfg)
    out = rollout.generate(ids.to(device), mask.to(device))
    assert rollout.get_last_profile().prefill_tokens == 2 * 5  # each prompt once, padding included
    assert rollout.get_last_profile().reused_tokens == 0
    appended = [[5, 6, 7], [], None, [8]]
    out = rollout.extend(out, appended)
    profile = rollout.get_last_profile()
    # The live rows' chunks (each its last token + appended), packed without padding; the finished row
    # computes nothing.
    assert profile.prefill_tokens == (1 + 3) + (1 + 0) + (1 + 1)
    real = mask.sum(dim=1).repeat_interleave(2).tolist()  # the prompts' tokens
    # Reused: each live row's prompt and its 6 tokens but the last (fed again with the appended ones).
    assert profile.reused_tokens == sum(real[r] + 6 - 1 for r in (0, 1, 3))
    assert out.responses.shape == (4, 6 + 3 + 6)
    assert out.response_mask[0].tolist() == [1] * 6 + [0] * 3 + [1] * 6
    assert out.response_mask[1].tolist() == [1] * 12 + [0] * 3
    assert out.response_mask[2].tolist() == [1] * 6 + [0] * 9  # finished: its history only
    assert out.response_mask[3].tolist() == [1] * 6 + [0] + [1] * 6 + [0] * 2
    assert torch.equal(out.sequences, torch.cat([ids.to(device).repeat_interleave(2, 0), out.responses], dim=1))
    assert out.prompt_length == 5


def test_the_first_sample_after_an_extend_follows_the_plain_forwards_distribution(llama):
    """Sampling: each row's first token after an extend is drawn from softmax(logits / T) of a plain
    forward over its full history, and its log-probability is that distribution's. Rows have different
    histories, so the test is on each draw's randomized probability integral transform, uniform on
    [0, 1) when every draw follows its row's distribution (chi-square over 10 bins)."""
    temperature, rows = 1.3, 600
    cfg = RolloutConfig(
        samples_per_prompt=rows // 2,
        max_new_tokens=3,
        temperature=temperature,
        eos_token_id=[],
        seed=7,
        return_logprobs=True,
    )
    ids, mask = prompts(2, 6, seed=2, left_pad=[0, 1])
    rollout = Rollout(llama, cfg)
    out = rollout.generate(ids, mask)
    g = torch.Generator().manual_seed(0)
    appended = random_appended(rows, g, 0, 4)
    before = out.responses.clone()
    out = rollout.extend(out, appended, max_new_tokens=1)
    u, logprob_errors = [], []
    g = torch.Generator().manual_seed(1)
    for r in range(rows):
        prompt = ids[r // (rows // 2)][mask[r // (rows // 2)].bool()]
        history = torch.cat([prompt, before[r], torch.tensor(appended[r], dtype=torch.long)])
        with torch.no_grad():
            logits = llama(history[None]).logits[0, -1].double()
        probs = torch.softmax(logits / temperature, dim=-1)
        token = int(out.responses[r, 3 + len(appended[r])])
        below = float(probs[:token].sum())
        u.append(below + float(torch.rand((), generator=g, dtype=torch.float64)) * float(probs[token]))
        logprob_errors.append(abs(float(out.logprobs[r, 3 + len(appended[r])]) - math.log(float(probs[token]))))
    counts = torch.histc(torch.tensor(u), bins=10, min=0.0, max=1.0)
    expected = rows / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.9, counts.tolist()  # the 0.999 quantile of chi-square with 9 degrees of freedom
    assert max(logprob_errors) < 1e-4


def test_logprobs_are_zero_on_appended_tokens_and_each_turn_samples_anew(llama):
    cfg = RolloutConfig(
        samples_per_prompt=4, max_new_tokens=4, temperature=1.0, eos_token_id=[], seed=3, return_logprobs=True
    )
    ids, mask = prompts(1, 6, seed=0)
    rollout = Rollout(llama, cfg)
    out = rollout.generate(ids, mask)
    out = rollout.extend(out, [[7, 8]] * 4)
    assert bool((out.logprobs[:, 4:6] == 0).all()) and bool((out.logprobs[:, :4] < 0).all())
    assert bool((out.logprobs[:, 6:] < 0).all())
    # Turns draw with their own seeds: rows that share their history still differ after it.
    assert len({tuple(t) for t in out.responses[:, 6:].tolist()}) > 1


def test_extend_takes_only_the_last_output_and_checks_appended(llama):
    rollout = Rollout(llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=3, eos_token_id=[]))
    ids, mask = prompts(1, 4)
    with pytest.raises(ValueError, match="call generate"):
        rollout.extend(None, [[1], [1]])
    first = rollout.generate(ids, mask)
    second = rollout.extend(first, [[5], None])
    with pytest.raises(ValueError, match="last generate\\(\\) or extend\\(\\) returned"):
        rollout.extend(first, [[5], [5]])
    with pytest.raises(ValueError, match="appended has 3 entries, but the rollout has 2 rows"):
        rollout.extend(second, [[5], [5], [5]])
    with pytest.raises(ValueError, match=r"appended\[1\] must hold token ids in \[0, 96\)"):
        rollout.extend(second, [[5], [96]])
    with pytest.raises(TypeError, match=r"appended\[0\] must hold int token ids"):
        rollout.extend(second, [[5.0], [5]])
    with pytest.raises(ValueError, match=r"appended\[0\] must be a 1-D tensor of integer token ids"):
        rollout.extend(second, [torch.zeros(2, 2, dtype=torch.long), [5]])
    with pytest.raises(TypeError, match="appended must be a list"):
        rollout.extend(second, torch.tensor([[5], [5]]))
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        rollout.extend(second, [[5], [5]], max_new_tokens=0)
    third = rollout.extend(second, [torch.tensor([5, 6]), []], max_new_tokens=2)  # a failed call changes nothing
    assert third.responses.shape == (2, 3 + 1 + 3 + 2 + 2)
    rollout.release()
    with pytest.raises(ValueError, match="call generate"):
        rollout.extend(third, [[5], [5]])


def test_compiled_turns_equal_eager_turns(llama):
    cfg = dict(samples_per_prompt=2, max_new_tokens=6, eos_token_id=EOS)
    ids, mask = prompts(2, 5, seed=4, left_pad=[0, 2])
    outputs = []
    for compile in (False, True):
        rollout = Rollout(llama, RolloutConfig(compile=compile, **cfg))
        out = rollout.generate(ids, mask)
        out = rollout.extend(out, [[5, 6], [7], [], [8, 9, 10]])
        outputs.append(rollout.extend(out, [[11]] * 4))
        assert conftest.compiled(rollout) == compile  # (else eager is compared with eager)
    assert torch.equal(outputs[0].responses, outputs[1].responses)
    assert torch.equal(outputs[0].response_mask, outputs[1].response_mask)


@pytest.mark.parametrize("layout", ["copy", "prefix", "paged"])
def test_a_generate_after_an_extend_starts_afresh(llama, layout):
    """A new generate on a rollout that has extended: its prompts' KV goes where its decode reads it
    (an extend's forward had moved where prefill writes)."""
    cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=6, eos_token_id=[], kv_sharing=layout)
    first_ids, first_mask = prompts(2, 9, seed=5)
    ids, mask = prompts(2, 7, seed=6, left_pad=[0, 2])
    rollout = Rollout(llama, cfg)
    out = rollout.generate(first_ids, first_mask)
    rollout.extend(out, [[5, 6, 7, 8]] * 4)
    again = rollout.generate(ids, mask)
    fresh = Rollout(llama, cfg).generate(ids, mask)
    assert torch.equal(again.responses, fresh.responses)
    with torch.no_grad():
        expected = llama.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0
        )
    assert torch.equal(again.responses, expected[:, 7:].repeat_interleave(2, dim=0))


@pytest.mark.parametrize("layout", ["copy", "prefix", "paged"])
def test_an_extend_in_which_every_row_has_finished_returns_the_history_unchanged(llama, layout):
    """appended all None (every row finished, which extend allows): nothing to compute; the history is
    returned as it is and the next turn goes on from it as if that call had not been made."""
    config = RolloutConfig(samples_per_prompt=2, max_new_tokens=6, kv_sharing=layout, eos_token_id=[], seed=3)
    ids, mask = prompts(2, 5, seed=1, left_pad=[0, 2])
    rollout, twin = Rollout(llama, config), Rollout(llama, config)
    out = rollout.generate(ids, mask)
    assert rollout.extend(out, [None] * 4) is out
    appended = [[5], None, [6, 7], []]
    got = rollout.extend(out, appended)
    want = twin.extend(twin.generate(ids, mask), appended)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.response_mask, want.response_mask)
