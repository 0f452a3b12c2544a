"""Hybrid models (recurrent layers beside attention: Gated DeltaNet, Mamba2, short convolutions) in the
rollout: each prompt's states computed once by the prefill, copied to its N rows (a recurrent cache
group), continued in place by decode (ended rows' kept), gathered by compaction, refilled by a row
budget's stream, continued chunk by chunk by a turn and after a system prompt computed once; and in the
training forward.

Oracles: HF's generate (greedy tokens, left-padded prompts of different lengths) and the plain forward
(the log-probability of every sampled token), on tiny random models of every hybrid family
(tests/families.py) at two weight scales."""

from __future__ import annotations

import warnings

import pytest
import torch
from families import HYBRIDS, VOCAB, tiny_model, unavailable
from test_shared_forward import enable_checkpointing
from test_turns import EOS, run_turns

import torchkvops
from torchkvops import Rollout, RolloutConfig

PROMPT, NEW = 12, 10


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    model = tiny_model(request.param)
    if model is None:
        pytest.skip(unavailable(request.param))
    return model


def left_padded(seed: int, batch: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[batch - 1, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


def hf_greedy(model, ids, mask, new=NEW, eos=None):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=0
        )
    return out[:, ids.shape[1] :]


def scaled(model, scale: float):
    """The model with its weights (not its norms) times `scale`: a second weight scale."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(scale)


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_greedy_tokens_equal_hfs_with_a_row_budget_too(hybrid, kv_sharing, scale):
    model = hybrid
    scaled(model, scale)
    try:
        ids, mask = left_padded(0)
        expected = hf_greedy(model, ids, mask).repeat_interleave(2, dim=0)
        for max_rows in (None, 4):  # 4: rows stream through a batch smaller than the call's 6
            config = RolloutConfig(
                samples_per_prompt=2, max_new_tokens=NEW, eos_token_id=[], kv_sharing=kv_sharing, max_rows=max_rows
            )
            assert torch.equal(Rollout(model, config).generate(ids, mask).responses, expected), max_rows
    finally:
        scaled(model, 1 / scale)


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_rows_that_end_early_are_compacted_and_the_rest_keep_hfs_tokens(hybrid, kv_sharing):
    """EOS ids that end some rows after 2-6 tokens: the batch is compacted (every group's rows gathered,
    the recurrent states with them) and the others go on with HF's tokens."""
    model = hybrid
    ids, mask = left_padded(1, batch=4)
    free = hf_greedy(model, ids, mask)
    eos = sorted({int(free[0, 2]), int(free[1, 5]), int(free[3, 3])})
    expected = hf_greedy(model, ids, mask, eos=eos)
    config = RolloutConfig(
        samples_per_prompt=2,
        max_new_tokens=NEW,
        eos_token_id=eos,
        pad_token_id=0,
        kv_sharing=kv_sharing,
        compact_finished_rows=True,
        enable_profiling=True,
    )
    rollout = Rollout(model, config)
    out = rollout.generate(ids, mask)
    assert torch.equal(out.responses[:, : expected.shape[1]], expected.repeat_interleave(2, dim=0))
    assert bool((out.responses[:, expected.shape[1] :] == 0).all())


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_sampled_tokens_log_probabilities_equal_the_plain_forwards(hybrid, kv_sharing):
    """Seeded sampling (N=3 rows per prompt from one state each): each sampled token's recorded
    log-probability is the plain forward's over the prompt and the response, and the samples do not
    depend on the layout."""
    model = hybrid
    ids, mask = left_padded(2)
    config = RolloutConfig(
        samples_per_prompt=3,
        max_new_tokens=NEW,
        eos_token_id=[],
        temperature=1.0,
        seed=3,
        return_logprobs=True,
        kv_sharing=kv_sharing,
    )
    out = Rollout(model, config).generate(ids, mask)
    other = "prefix" if kv_sharing == "copy" else "copy"
    twin = Rollout(model, RolloutConfig(**{**vars(config), "kv_sharing": other})).generate(ids, mask)
    assert torch.equal(out.responses, twin.responses)
    rows_mask = torch.cat([mask.repeat_interleave(3, dim=0), torch.ones_like(out.responses)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=out.sequences, attention_mask=rows_mask).logits.float()
    plain = logits[:, PROMPT - 1 : -1].log_softmax(-1).gather(-1, out.responses[..., None])[..., 0]
    torch.testing.assert_close(out.logprobs, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_turns_equal_hf_on_each_full_history(hybrid, kv_sharing):
    """Two extends (appended chunks of 0-8 tokens, EOS ids: rows of different lengths, one row stopping
    after the first turn): each chunk runs through the recurrent layers row by row from the row's own
    states (those of its last token: decode keeps ended rows' states as they were), each row's new tokens
    against HF's generate on its full history."""
    config = RolloutConfig(samples_per_prompt=2, max_new_tokens=NEW, eos_token_id=EOS, kv_sharing=kv_sharing)
    run_turns(hybrid, config, *left_padded(3), turns=2, finished_at={1: (2,)})


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_a_system_prompt_is_computed_once_with_hfs_tokens(hybrid, kv_sharing):
    """A prefix every prompt begins with (after left padding of different lengths) computed once; each
    prompt's remainder continues from its states, chunk by chunk."""
    ids, mask = left_padded(4)
    for row, start in enumerate((3, 0, 5)):  # every prompt's real tokens begin with them
        ids[row, start : start + 4] = torch.tensor([7, 8, 9, 10])
    config = RolloutConfig(
        samples_per_prompt=2,
        max_new_tokens=NEW,
        eos_token_id=[],
        min_shared_tokens=3,
        enable_profiling=True,
        kv_sharing=kv_sharing,
    )
    rollout = Rollout(hybrid, config)
    out = rollout.generate(ids, mask)
    assert torch.equal(out.responses, hf_greedy(hybrid, ids, mask).repeat_interleave(2, dim=0))
    assert rollout.get_last_profile().prefill_tokens == 4 + int(mask.sum()) - 3 * 4  # the 4 common tokens once


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_patch_generate_serves_hybrids_with_hfs_tokens_call_after_call(hybrid, kv_sharing):
    """Two calls, the second extending the first's rows (as an agent's next turn): both served (no
    fallback warning), each with HF's tokens; the second from the first's KV and states (only what the
    rows append is prefilled)."""
    model = hybrid
    ids, mask = left_padded(5)
    expected = hf_greedy(model, ids, mask)
    kwargs = dict(do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    with torchkvops.patch_generate(model, kv_sharing=kv_sharing, enable_profiling=True) as handle:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            first = model.generate(ids, attention_mask=mask, **kwargs)
            assert torch.equal(first[:, PROMPT:], expected)
            longer = torch.cat([first, torch.randint(3, VOCAB, (3, 2))], dim=1)
            longer_mask = torch.cat([mask, torch.ones(3, NEW + 2, dtype=torch.long)], dim=1)
            second = model.generate(longer, attention_mask=longer_mask, **kwargs)
        profile = handle.last_profile()
        assert profile.reused_tokens > 0 and profile.prefill_tokens == 3 * (1 + 2)  # last token + appended
    assert torch.equal(second[:, longer.shape[1] :], hf_greedy(model, longer, longer_mask))


def test_a_compiled_decode_continues_the_states_in_place_with_hfs_tokens():
    """torch.compile'd decode steps (fullgraph) read and update every recurrent layer's states in the
    cache's buffers, whose addresses stay put: HF's tokens in both layouts, one Qwen3.5 model."""
    model = tiny_model("qwen3_5_text")
    if model is None:
        pytest.skip(unavailable("qwen3_5_text"))
    ids, mask = left_padded(6)
    expected = hf_greedy(model, ids, mask).repeat_interleave(2, dim=0)
    for kv_sharing in ("copy", "prefix"):
        config = RolloutConfig(
            samples_per_prompt=2, max_new_tokens=NEW, eos_token_id=[], kv_sharing=kv_sharing, compile=True
        )
        assert torch.equal(Rollout(model, config).generate(ids, mask).responses, expected), kv_sharing


# --- patch_forward: each group's prompt once through every layer, recurrent layers continued per row ------
def grpo_rows(seed: int):
    """Rows of 16 columns: a prompt of 9 real tokens (1 pad) in 3 rows with completions of their own (the
    second right-padded by 2); a prompt of 7 (3 pads) in 2 rows that differ in their last token only (a
    suffix of one column: a recurrent layer's one-step path continues the group's state); a row alone."""
    g = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(3, VOCAB, (n,), generator=g)

    zeros = torch.zeros
    first, second = tokens(9), tokens(7)
    rows = [torch.cat([zeros(1, dtype=torch.long), first, tokens(6)]) for _ in range(3)]
    shared = torch.cat([zeros(3, dtype=torch.long), second, tokens(5)])
    rows += [torch.cat([shared, tokens(1)]) for _ in range(2)]
    rows.append(torch.cat([zeros(2, dtype=torch.long), tokens(14)]))
    ids = torch.stack(rows)
    mask = (ids != 0).long()
    mask[1, -2:] = 0
    return ids.masked_fill(mask == 0, 0), mask


# Gradients agree to float32 rounding of the chunked scans, whose chunks now start at each prompt's end
# (sums of up to 1e4 here): within 1e-4 of each gradient's largest entry.
GRAD_ATOL = 1e-4


def loss_pass(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits.float().log_softmax(-1)[mask.bool()].sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_patch_forward_gives_the_plain_logits_and_every_gradient(hybrid, scale):
    model = hybrid.train()
    scaled(model, scale)
    try:
        ids, mask = grpo_rows(7)
        real = mask.bool()
        plain_logits, plain_grads = loss_pass(model, ids, mask)
        with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
            logits, grads = loss_pass(model, ids, mask)
        assert handle.stats.shared_calls == 1 and handle.stats.fallback_calls == 0
        assert handle.stats.computed_tokens == (10 + 3 * 6) + (15 + 2 * 1) + 16  # each prompt once
        torch.testing.assert_close(logits[real], plain_logits[real], rtol=1e-3, atol=1e-4)
        assert grads.keys() == plain_grads.keys()
        for name, want in plain_grads.items():
            scale_of = want.abs().max()
            torch.testing.assert_close(grads[name], want, rtol=1e-3, atol=GRAD_ATOL * scale_of, msg=name)
    finally:
        scaled(model, 1 / scale)
        model.eval()


def test_patch_forward_under_gradient_checkpointing_gives_the_plain_gradients():
    """Recomputation in backward (non-reentrant) reaches the recurrent layers with the packed layout too."""
    model = tiny_model("qwen3_5_text")
    if model is None:
        pytest.skip(unavailable("qwen3_5_text"))
    model.train()
    ids, mask = grpo_rows(8)
    _, plain = loss_pass(model, ids, mask)
    enable_checkpointing(model, reentrant=False)
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        _, grads = loss_pass(model, ids, mask)
    assert handle.stats.shared_calls == 1
    for name, want in plain.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-3, atol=GRAD_ATOL * want.abs().max(), msg=name)


def test_patch_forward_undo_restores_each_recurrent_layers_forward(hybrid):
    mixers = [m for m in hybrid.modules() if "forward" in vars(m)]
    handle = torchkvops.patch_forward(hybrid)
    patched = [m for m in hybrid.modules() if "forward" in vars(m)]
    assert len(patched) > len(mixers)
    handle.undo()
    assert [m for m in hybrid.modules() if "forward" in vars(m)] == mixers


def test_patch_forward_survives_train_and_eval_switches_after_patching(hybrid):
    """transformers re-kernelizes hub-kernel layers (Qwen3.5's Gated DeltaNet) on train() and eval(), which
    drops an instance's forward: the patch puts the recurrent layers' back before each packed forward (TRL
    calls train() every step after the user patched)."""
    ids, mask = grpo_rows(9)
    hybrid.train()
    plain_logits, plain_grads = loss_pass(hybrid, ids, mask)
    try:
        with torchkvops.patch_forward(hybrid, min_shared_tokens=4) as handle:
            hybrid.eval()
            hybrid.train()
            logits, grads = loss_pass(hybrid, ids, mask)
        assert handle.stats.shared_calls == 1
        torch.testing.assert_close(logits[mask.bool()], plain_logits[mask.bool()], rtol=1e-3, atol=1e-4)
        for name, want in plain_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-3, atol=GRAD_ATOL * want.abs().max(), msg=name)
    finally:
        hybrid.eval()


def test_bfloat16_with_float32_states_gives_hfs_tokens(hybrid):
    """A bfloat16 model whose Gated DeltaNet and Mamba2 states are float32 (as HF keeps them): each state is
    viewed in its own dtype within the cache's bfloat16 rows (`recurrent.RowLayout`). HF's greedy tokens,
    up to bfloat16's rounding: the rollout's attention accumulates in float32 and HF's in bfloat16
    (docs/limitations.md), so where a row's token first differs from HF's, the two tokens must be a tie in
    HF's own logits at that step (within a few bfloat16 steps), which a misread state would not give."""
    model = tiny_model(hybrid.config.model_type).to(torch.bfloat16)  # (its own copy: the fixture stays fp32)
    ids, mask = left_padded(10)
    expected = hf_greedy(model, ids, mask).repeat_interleave(2, dim=0)
    config = RolloutConfig(samples_per_prompt=2, max_new_tokens=NEW, eos_token_id=[], kv_sharing="copy")
    got = Rollout(model, config).generate(ids, mask).responses
    differing = 0
    for row in range(got.shape[0]):
        apart = (got[row] != expected[row]).nonzero().flatten()
        if apart.numel() == 0:
            continue
        differing += 1
        step = int(apart[0])
        prompt = ids[row // 2][mask[row // 2].bool()]
        with torch.no_grad():
            logits = model(torch.cat([prompt, got[row, :step]])[None]).logits[0, -1].float()
        gap = float(logits[expected[row, step]] - logits[got[row, step]])
        assert 0 <= gap <= 4 * 2**-7 * float(logits.abs().max()), (row, step, gap)  # 4 bfloat16 steps
    assert differing <= got.shape[0] // 2


def test_a_sharded_hybrid_is_refused_naming_why(hybrid, monkeypatch):
    """(Its states' probe would be a forward, whose FSDP or ZeRO-3 gathers are collectives, on each process
    at its own time: refused alike on every process, before any forward.)"""
    import torchkvops.models.sharding

    monkeypatch.setattr(torchkvops.models.sharding, "is_sharded", lambda model: True)
    with pytest.raises(ValueError, match="has recurrent layers and is sharded"):
        Rollout(hybrid, RolloutConfig(max_new_tokens=2))


def test_patch_forward_computes_a_system_prompt_once_across_left_padding_with_the_plain_gradients(hybrid):
    """Prompts with 0, 1, 2 pads that begin with one system prompt, at twice the weights: the system prompt
    runs once through every layer (a recurrent layer from no state, as each row's left padding leaves it);
    each row's padding, which the layout puts after it, runs from no state for its outputs only, and each
    prompt's rest continues from the system prompt's states (tests/test_coverage.py: the same at 1x)."""
    from test_coverage import grpo_batch

    model = hybrid.train()
    scaled(model, 2.0)
    try:
        ids, mask = grpo_batch()
        plain_logits, plain_grads = loss_pass(model, ids, mask)
        with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
            logits, grads = loss_pass(model, ids, mask)
        assert handle.stats.computed_tokens == 6 + 3 * (10 - 6) + 9 * 6  # system prompt once, rests, completions
        # float32 rounding, logits up to ~13 at twice the weights: up to 7e-4 here (in float64 the two are
        # equal to the last bit, checked on Qwen3.5; the MoE families' grouped matmul takes no float64).
        torch.testing.assert_close(logits[mask.bool()], plain_logits[mask.bool()], rtol=1e-3, atol=1e-3)
        for name, want in plain_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-3, atol=GRAD_ATOL * want.abs().max(), msg=name)
    finally:
        scaled(model, 0.5)
        model.eval()


def system_prompt_rows(case: str, system: int = 16, completions: int = 4):
    """Two prompts after one `system`-token system prompt, each in `completions` rows whose completions
    (3 to 10 tokens, right-padded to 10) start with different tokens: prompt A holds one token of its own
    after the system prompt ("one own token"), or none, its completions then sharing their first token
    ("a shared first token"); prompt B holds 30 of its own. A is left-padded to B's length."""
    g = torch.Generator().manual_seed(3)
    head = torch.randint(3, VOCAB, (system,), generator=g)
    own_a = torch.randint(3, VOCAB, (1 if case == "one own token" else 0,), generator=g)
    own_b = torch.randint(3, VOCAB, (30,), generator=g)
    width = system + 30 + 10
    ids, mask = [], []
    for own in (own_a, own_b):
        prompt = torch.cat([head, own])
        for j in range(completions):
            length = 3 + (j * 7) // (completions - 1)
            completion = torch.randint(3, VOCAB, (length,), generator=g)
            completion[0] = 3 + j  # (distinct first tokens: the group's prefix is the prompt)
            if case == "a shared first token" and own is own_a:
                completion[0] = 50
            row = torch.cat([prompt, completion])
            pads = width - 10 - prompt.numel()
            ids.append(
                torch.cat([torch.zeros(pads, dtype=torch.long), row, torch.zeros(10 - length, dtype=torch.long)])
            )
            mask.append(ids[-1] != 0)
    return torch.stack(ids), torch.stack(mask).long()


@pytest.mark.parametrize("case", ["one own token", "a shared first token"])
def test_patch_forward_after_a_system_prompt_a_prompt_of_one_token_of_its_own_gets_the_plain_gradients(hybrid, case):
    """A prompt whose part after a system prompt computed once is exactly one token (or none, its
    completions sharing a first token): that token's states, which its completions continue from, are the
    states after it, not after a padding column the layer's scan needs (issue #51: every row of that
    prompt got other logits from its first completion token on, silently). At 1x the weights: at 2x the
    plain forward's own logits for one system prompt differ by up to 6e-3 between rows of other padding
    (qwen3_next: its chunked scans round by where the chunks start)."""
    model = hybrid.train()
    try:
        ids, mask = system_prompt_rows(case)
        plain_logits, plain_grads = loss_pass(model, ids, mask)
        with torchkvops.patch_forward(model) as handle:
            logits, grads = loss_pass(model, ids, mask)
        assert handle.stats.shared_calls == 1 and handle.stats.fallback_calls == 0
        torch.testing.assert_close(logits[mask.bool()], plain_logits[mask.bool()], rtol=1e-3, atol=1e-4)
        for name, want in plain_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-3, atol=GRAD_ATOL * want.abs().max(), msg=name)
    finally:
        model.eval()
