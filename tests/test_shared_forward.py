"""torchkvops.patch_forward: the shared-prefix forward and backward give the plain forward's outputs and
gradients (the oracle is the same model, unpatched, on the same batch), for the five families, padded
and unpadded batches, groups adjacent, interleaved and in split halves, groups of 1, 2 and 8 rows,
completions of different lengths, with gradient checkpointing (reentrant or not) and under bf16
autocast; the work is really saved (FLOPs); every fallback says why and gives the plain result; undo,
the context manager and the refusal of a second patch. The attention alone and the grouping have their
own tests (tests/test_prefix_attention.py, test_prefix_groups.py); TRL's GRPOTrainer is in
tests/test_trl.py, PEFT in tests/test_peft.py."""

import copy
import io
import pickle
import warnings

import pytest
import torch
from devices import per_device
from mem_eff_emulator import emulated_cuda_branch
from models import FAMILIES, VOCAB, prompts
from torch.utils.flop_counter import FlopCounterMode
from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel, GPTBigCodeConfig, GPTBigCodeForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import torchkvops
from torchkvops.training import shared_forward
from torchkvops.training.shared_forward import disable_dropout


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def no_dropout_train(model):
    """Train mode with every dropout at 0, as TRL's disable_dropout intends (OPT's functional dropout
    floats included)."""
    disable_dropout(model)
    return model.train()


def batch(group_sizes, arrangement="adjacent", padded=True, prompt_length=12, completion_length=6, seed=0, system=0):
    """GRPO's layout: one prompt per group (left-padded when `padded`), each of its rows followed by its own
    completion (right-padded when `padded`, so completions differ in length; the first two completions of
    a group start alike, so that group's shared prefix runs past the prompt). Rows are ordered by group
    ("adjacent", as TRL), by sample ("interleaved", as verl) or as two halves of one sample per group
    each ("halves", DPO's chosen and rejected rows; groups of 2). Returns ids, mask, labels on every real
    token after the first (the plain forward's loss then reads no padding position). `system` > 0: every
    prompt's real tokens start with the same `system` tokens (a system prompt), after its own padding."""
    g = torch.Generator().manual_seed(seed)
    system_prompt = torch.randint(3, VOCAB, (system,), generator=torch.Generator().manual_seed(seed + 1))
    rows = []  # (group, sample, ids, mask)
    for i, n in enumerate(group_sizes):
        pads = i % 3 if padded else 0
        prompt = torch.randint(3, VOCAB, (prompt_length,), generator=g)
        prompt[pads : pads + system] = system_prompt
        first = torch.randint(3, VOCAB, (completion_length,), generator=g)
        for j in range(n):
            completion = torch.randint(3, VOCAB, (completion_length,), generator=g)
            if j == 1:
                completion[:2] = first[:2]
            ids, mask = (
                torch.cat([prompt, first if j == 0 else completion]),
                torch.ones(prompt_length + completion_length, dtype=torch.long),
            )
            mask[:pads] = 0
            if padded and j % 3:
                mask[-(j % 3) :] = 0
            rows.append((i, j, ids.masked_fill(mask == 0, 0), mask))
    if arrangement == "adjacent":
        rows.sort(key=lambda r: (r[0], r[1]))
    else:  # interleaved; halves is the same order with groups of 2
        rows.sort(key=lambda r: (r[1], r[0]))
    ids = torch.stack([r[2] for r in rows])
    mask = torch.stack([r[3] for r in rows])
    follows_real = torch.nn.functional.pad(mask, (1, 0))[:, :-1] == 1
    labels = ids.masked_fill((mask == 0) | ~follows_real, -100)
    return ids, mask, labels


def run(model, ids, mask, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True, **kwargs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same(shared, plain, mask, rtol=1e-3):
    """Outputs at every position (padding ones too: a padding collator's labels read the last padding
    column of a left-padded row) and every parameter's gradient, within float32 rounding."""
    (out_s, grads_s), (out_p, grads_p) = shared, plain
    torch.testing.assert_close(out_s.loss, out_p.loss, rtol=rtol, atol=1e-6)
    torch.testing.assert_close(out_s.logits, out_p.logits, rtol=rtol, atol=1e-5)
    assert len(out_s.hidden_states) == len(out_p.hidden_states)
    for h_s, h_p in zip(out_s.hidden_states, out_p.hidden_states):
        torch.testing.assert_close(h_s, h_p, rtol=rtol, atol=1e-5)
    assert grads_s.keys() == grads_p.keys()
    scale = max(g.abs().max().item() for g in grads_p.values())
    for name in grads_p:  # atol: some gradients are 0 in exact arithmetic (a key bias's), rounding noise here
        torch.testing.assert_close(grads_s[name], grads_p[name], rtol=rtol, atol=1e-5 * scale, msg=name)


def assert_same_in(dtype, shared, plain, mask):
    """assert_same in float32; in half precision, real positions' logits and every gradient (finite) within
    the dtype's own rounding of the plain forward's."""
    if dtype == torch.float32:
        assert_same(shared, plain, mask)
        return
    (out_s, grads_s), (out_p, grads_p) = shared, plain
    real = mask.bool()
    torch.testing.assert_close(out_s.logits[real].float(), out_p.logits[real].float(), rtol=0.05, atol=0.1)
    for name in grads_p:
        assert torch.isfinite(grads_s[name]).all(), name
        scale = grads_p[name].float().norm()
        assert (grads_s[name].float() - grads_p[name].float()).norm() <= 0.05 * scale + 1e-6, name


def spy_packed_attention(monkeypatch) -> list:
    calls = []
    original = shared_forward.packed_attention
    monkeypatch.setattr(shared_forward, "packed_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


ARRANGEMENTS = {"adjacent": [8, 2, 1, 3], "interleaved": [8, 2, 1, 3], "halves": [2, 2, 2, 2]}


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("arrangement", list(ARRANGEMENTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_outputs_and_gradients_equal_the_plain_forward(family_models, family, arrangement, padded, monkeypatch):
    model = no_dropout_train(family_models[family])
    ids, mask, labels = batch(ARRANGEMENTS[arrangement], arrangement, padded)
    plain = run(model, ids, mask, labels)
    calls = spy_packed_attention(monkeypatch)
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        shared = run(model, ids, mask, labels)
    assert handle.stats.shared_calls == 1 and handle.stats.fallback_calls == 0
    assert len(calls) == model.config.num_hidden_layers
    assert handle.stats.computed_tokens < handle.stats.row_tokens == ids.numel()
    assert_same(shared, plain, mask)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_identical_unpadded_rows_equal_the_plain_forward(family_models, family):
    """Greedy samples of one prompt (DeepSpeed's OPSD batch at temperature 0): every row the same, no
    padding. Computed once, as one group (this batch failed in the grouping before)."""
    model = no_dropout_train(family_models[family])
    ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(2)).expand(4, -1).contiguous()
    mask = torch.ones_like(ids)
    plain = run(model, ids, mask, ids)
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        shared = run(model, ids, mask, ids)
    assert handle.stats.shared_calls == 1 and handle.stats.computed_tokens == 20
    assert_same(shared, plain, mask)


# With a system prompt, the work saved beyond groups per prompt: the system prompt once instead of once per
# group, for families whose results depend on positions counted from a row's first real token (rotary
# embeddings: the plain forward numbers columns, but only their differences count; OPT numbers real
# tokens); none for GPT-2 (learned absolute positions: rows of different padding differ there).
SYSTEM_PROMPT_SHARED = {"gpt2": False, "opt": True, "llama": True, "qwen3": True, "mistral": True}


@pytest.mark.parametrize("arrangement", ["adjacent", "interleaved"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_system_prompt_common_to_every_prompt_is_computed_once(family_models, family, arrangement):
    """Prompts of different left padding that start with the same 8 tokens: outputs and gradients are
    the plain forward's, and the tokens computed are those of the same batch with a system prompt of its
    own per prompt, less (prompts - 1) x 8."""
    model = no_dropout_train(family_models[family])
    sizes, system = [4, 2, 3], 8
    ids, mask, labels = batch(sizes, arrangement, prompt_length=16, system=system)
    plain = run(model, ids, mask, labels)
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        shared = run(model, ids, mask, labels)
        computed = handle.stats.computed_tokens
        run(model, *batch(sizes, arrangement, prompt_length=16, seed=1))  # each prompt its own first tokens
        own = handle.stats.computed_tokens - computed
    assert handle.stats.shared_calls == 2
    assert_same(shared, plain, mask)
    assert computed == own - (len(sizes) - 1) * system * SYSTEM_PROMPT_SHARED[family]


def test_qwen2_too():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            initializer_range=0.2,
            max_position_embeddings=128,
        )
    ).train()
    ids, mask, labels = batch([8, 2, 1], "interleaved")
    plain = run(model, ids, mask, labels)
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        shared = run(model, ids, mask, labels)
    assert handle.stats.shared_calls == 1
    assert_same(shared, plain, mask)


@pytest.mark.parametrize(
    "device,case",
    per_device(
        [], [("llama", torch.float32), ("qwen3", torch.bfloat16), ("gpt2", torch.float32), ("opt", torch.bfloat16)]
    ),
)
def test_on_cuda(family_models, device, case):
    """The CUDA kernels (memory-efficient attention and its backward, K/V heads repeated for the causal
    parts) against the plain forward on the GPU; bf16 weights against bf16's own rounding."""
    family, dtype = case
    model = copy.deepcopy(no_dropout_train(family_models[family])).to(device, dtype)
    ids, mask, labels = (t.to(device) for t in batch([8, 2, 1], "interleaved"))
    plain = run(model, ids, mask, labels)
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        shared = run(model, ids, mask, labels)
    assert handle.stats.shared_calls == 1
    assert_same_in(dtype, shared, plain, mask)


@pytest.mark.parametrize("masked_rows", ["nan", "zero"])
@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("gpt2", torch.float32), ("qwen3", torch.bfloat16)])
def test_the_cuda_branch_on_the_emulated_kernels_gives_the_plain_outputs_and_gradients(
    family_models, family, dtype, masked_rows
):
    """patch_forward's attention through fused_attention's CUDA branch, against the emulated memory-efficient
    kernels (tests/mem_eff_emulator.py), on left- and right-padded groups: the layout of `out` the backward
    assumes, the log-sum-exp's padding, and a left-padding query that sees no key, which must stay finite
    (a mask of float32's minimum overflows in the kernels' float32 scores: NaN gradients)."""
    model = copy.deepcopy(no_dropout_train(family_models[family])).to(dtype)
    ids, mask, labels = batch([8, 2, 1], "interleaved")
    plain = run(model, ids, mask, labels)
    with emulated_cuda_branch(masked_rows) as emulator, torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        shared = run(model, ids, mask, labels)
    assert handle.stats.shared_calls == 1
    assert {call for call, _ in emulator.calls} == {"forward", "backward"}
    assert_same_in(dtype, shared, plain, mask)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_to_keep_and_the_backbone_called_directly(family_models, family):
    """TRL's fused LM head calls the backbone itself, and the loss passes keep only the completion logits."""
    model = no_dropout_train(family_models[family])
    ids, mask, _ = batch([4, 4])
    keep = 6
    with torch.no_grad():
        plain_logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
        plain_hidden = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
            hidden = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    assert handle.stats.shared_calls == 2
    real = mask.bool()
    torch.testing.assert_close(logits[real[:, -keep:]], plain_logits[real[:, -keep:]], rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(hidden[real], plain_hidden[real], rtol=1e-3, atol=1e-5)


def enable_checkpointing(model, reentrant: bool) -> None:
    """transformers 5.24 renamed gradient_checkpointing_enable (older ones, as on the GPU machine, lack the new name)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(kwargs)


def disable_checkpointing(model) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gradient_checkpointing_recomputes_the_shared_attention(family_models, family, reentrant, monkeypatch):
    """The recomputation in backward runs outside the patched forward: the layout reaches it through the
    layer call's arguments, so every layer runs the shared attention twice and the gradients are exact."""
    model = no_dropout_train(family_models[family])
    ids, mask, labels = batch([8, 2, 1], "interleaved")
    plain = run(model, ids, mask, labels)
    enable_checkpointing(model, reentrant)
    try:
        calls = spy_packed_attention(monkeypatch)
        with torchkvops.patch_forward(model, min_shared_tokens=4), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers: use_cache=True is incompatible with checkpointing
            shared = run(model, ids, mask, labels)
    finally:
        disable_checkpointing(model)
    assert len(calls) == 2 * model.config.num_hidden_layers
    assert_same(shared, plain, mask)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_autocast_stays_within_the_plain_forwards_own_bf16_error(family_models, family):
    model = no_dropout_train(family_models[family])
    ids, mask, labels = batch([8, 2, 1], "interleaved")
    exact_out, exact_grads = run(model, ids, mask, labels)

    def bf16_run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run(model, ids, mask, labels)

    plain = bf16_run()
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        shared = bf16_run()
    assert handle.stats.shared_calls == 1
    real = mask.bool()

    def errors(result):
        out, grads = result
        logits = (out.logits.float() - exact_out.logits)[real].abs().max().item()
        relative = [
            ((grads[n] - exact_grads[n]).norm() / exact_grads[n].norm().clamp_min(1e-12)).item()
            for n in exact_grads
            if exact_grads[n].norm() > 1e-6
        ]
        return logits, max(relative)

    (logits_s, grads_s), (logits_p, grads_p) = errors(shared), errors(plain)
    assert logits_s <= 2 * logits_p + 1e-3, (logits_s, logits_p)
    assert grads_s <= 2 * grads_p + 1e-3, (grads_s, grads_p)


def attention_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    """The CPU flash kernel's FLOPs (torch counts its CUDA siblings only): two matmuls of q against k, v."""
    b, h, m, d = q
    return 4 * b * h * m * k[2] * d


def attention_backward_flops(grad, q, k, v, *args, out_shape=None, **kwargs) -> int:
    b, h, m, d = q
    return 8 * b * h * m * k[2] * d  # four matmuls: dV, dP, dQ, dK


def test_shared_forward_and_backward_really_do_less_work(family_models):
    """P=256, C=16, G=8 with logits_to_keep: the plain forward processes 8 x 272 tokens, the shared one
    256 + 8 x 16. FlopCounterMode counts matmuls and (with the formulas above) the fused attention."""
    model = no_dropout_train(family_models["llama"])
    prompt_length, completion_length, group = 256, 16, 8
    ids, mask, _ = batch([group], prompt_length=prompt_length, completion_length=completion_length, padded=False)
    mapping = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: attention_flops,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_backward_flops,
    }

    def count() -> int:
        model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=completion_length + 1).logits
            logits[:, :-1].log_softmax(-1).gather(-1, ids[:, -completion_length:, None]).sum().backward()
        return counter.get_total_flops()

    plain = count()
    with torchkvops.patch_forward(model, min_shared_tokens=16) as handle:
        shared = count()
    assert handle.stats.shared_calls == 1
    assert shared <= 0.35 * plain, (shared, plain, shared / plain)


def test_torch_compile_of_the_patched_model():
    """torch.compile traces the packed forward (the grouping runs outside the graph) and AOT autograd the
    shared attention's forward and backward; aot_eager checks that without Inductor's compile time."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = no_dropout_train(
        LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=VOCAB,
                initializer_range=0.2,
            )
        )
    )
    ids, mask, labels = batch([4, 2], "interleaved")
    plain = run(model, ids, mask, labels)
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        compiled = torch.compile(model, backend="aot_eager")
        out, grads = run(compiled, ids, mask, labels)
    assert handle.stats.shared_calls == 1
    assert_same((out, {name.removeprefix("_orig_mod."): g for name, g in grads.items()}), plain, mask)


def test_patch_generate_and_patch_forward_together(family_models):
    """The rollout's prefill and decode carry a KV cache: the patched backbone runs them as they were."""
    model = family_models["llama"]
    ids, mask = (t.repeat_interleave(2, dim=0) for t in prompts(2, 12, left_pad=[0, 3]))
    expected = model.generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    with (
        torchkvops.patch_forward(model, min_shared_tokens=4) as handle,
        torchkvops.patch_generate(model),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error", UserWarning)
        got = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    assert torch.equal(got, expected)
    assert handle.stats.shared_calls == 0 and handle.stats.fallback_calls == 0


# --- fallbacks -----------------------------------------------------------------------------------
def plain_and_patched(model, call, match, **options):
    """`call(model)` unpatched, then patched (twice): the patched calls warn once with `match` and give the
    plain result (the same RNG state for both, for dropout)."""
    torch.manual_seed(0)
    expected = call(model)
    with torchkvops.patch_forward(model, **options) as handle:
        torch.manual_seed(0)
        with pytest.warns(UserWarning, match=match):
            got = call(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per cause
            call(model)
    assert handle.stats.fallback_calls == 2 and handle.stats.shared_calls == 0
    return expected, got


def logits_of(**kwargs):
    ids, mask, _ = batch([4, 4])

    def call(model):
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, **kwargs).logits

    return call


def test_dropout_in_train_mode_falls_back():
    model = FAMILIES["gpt2"]().train()  # nn.Dropout modules (attn_pdrop, resid_pdrop, embd_pdrop = 0.1)
    expected, got = plain_and_patched(model, logits_of(), r"dropout in train mode \(drop p=0\.1")
    assert torch.equal(got, expected)


def test_opt_functional_dropout_falls_back():
    """OPT applies config.dropout through nn.functional.dropout, which TRL's disable_dropout does not reach."""
    model = no_dropout_train(FAMILIES["opt"]())
    model.model.decoder.layers[1].dropout = 0.1
    expected, got = plain_and_patched(model, logits_of(), r"layers\.1\.dropout=0\.1")
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"output_attentions": True}, "output_attentions=True"),
        ({"position_ids": torch.zeros(2, 3, dtype=torch.long)}, "position_ids that are not"),
    ],
)
def test_arguments_the_shared_path_cannot_serve_fall_back(family_models, kwargs, match):
    model = family_models["llama"]
    if "position_ids" in kwargs:  # wrong shape: the model's own forward reports it
        with torchkvops.patch_forward(model), pytest.warns(UserWarning, match=match), pytest.raises(Exception):
            logits_of(**kwargs)(model)
        return
    expected, got = plain_and_patched(model, logits_of(**kwargs), match, min_shared_tokens=4)
    assert torch.equal(got, expected)


def test_inputs_embeds_falls_back(family_models):
    model = family_models["llama"]
    ids, mask, _ = batch([4, 4])

    def call(model):
        with torch.no_grad():
            return model(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask).logits

    expected, got = plain_and_patched(model, call, "inputs_embeds", min_shared_tokens=4)
    assert torch.equal(got, expected)


def test_another_attention_implementation_falls_back(family_models):
    AttentionInterface.register("test_other_sdpa", sdpa_attention_forward)
    model = family_models["llama"]
    model.config._attn_implementation = "test_other_sdpa"
    try:
        expected, got = plain_and_patched(
            model, logits_of(), "attn_implementation='test_other_sdpa'", min_shared_tokens=4
        )
    finally:
        model.config._attn_implementation = "sdpa"
    assert torch.equal(got, expected)


def test_a_sliding_window_shorter_than_the_rows_masks_within_the_packed_layout(family_models):
    """Mistral's window of 64 over rows of 72 tokens (the completions' queries lose the prompt's first
    keys): outputs and gradients are the plain forward's, with and without a system prompt common to every
    prompt (the window then spans the common level too)."""
    model = no_dropout_train(family_models["mistral"])
    assert model.config.sliding_window == 64
    for system in (0, 16):
        ids, mask, labels = batch([3, 2], prompt_length=60, completion_length=12, system=system)
        plain = run(model, ids, mask, labels)
        with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
            shared = run(model, ids, mask, labels)
        assert handle.stats.shared_calls == 1 and handle.stats.fallback_calls == 0
        assert_same(shared, plain, mask)


def test_rows_that_share_too_little_fall_back(family_models):
    model = family_models["llama"]
    expected, got = plain_and_patched(model, logits_of(), "min_shared_tokens=100", min_shared_tokens=100)
    assert torch.equal(got, expected)


def test_generation_with_a_kv_cache_runs_the_plain_forward_without_a_warning(family_models):
    model = family_models["llama"]
    ids, mask, _ = batch([2, 2])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle, warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    assert torch.equal(got, expected)
    assert out.past_key_values is not None
    assert handle.stats.shared_calls == 0 and handle.stats.fallback_calls == 0


# --- the handle ----------------------------------------------------------------------------------
def test_undo_restores_the_model_and_the_context_manager_undoes(family_models):
    model = family_models["opt"]
    backbone = model.model.decoder
    attention = backbone.layers[0].self_attn
    config_before = attention.config
    handle = torchkvops.patch_forward(model)
    assert "forward" in vars(backbone) and attention.config is not config_before
    assert attention.config._attn_implementation == shared_forward.NAME
    assert model.config._attn_implementation == "sdpa"  # what TRL reads and copies to its reference model
    handle.undo()
    assert "forward" not in vars(backbone) and attention.config is config_before
    handle.undo()  # twice is harmless
    with torchkvops.patch_forward(model) as again:
        assert "forward" in vars(backbone)
    assert not again.active and "forward" not in vars(backbone)


def test_patching_twice_is_refused(family_models):
    model = family_models["llama"]
    with torchkvops.patch_forward(model):
        with pytest.raises(RuntimeError, match="already patched"):
            torchkvops.patch_forward(model)
        with pytest.raises(RuntimeError, match="already patched"):
            torchkvops.patch_forward(model.model)  # the same backbone


def test_options_are_validated(family_models):
    model = family_models["llama"]
    with pytest.raises(TypeError, match="unknown option 'min_shared'"):
        torchkvops.patch_forward(model, min_shared=4)
    for bad in (0, -1, True, 2.5, "8"):
        with pytest.raises(ValueError, match="min_shared_tokens must be an int >= 1"):
            torchkvops.patch_forward(model, min_shared_tokens=bad)
    assert "forward" not in vars(model.model)


def test_unsupported_models_are_refused():
    bigcode = GPTBigCodeForCausalLM(GPTBigCodeConfig(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="model type 'gpt_bigcode' is not supported: its positions are neither rotary"):
        torchkvops.patch_forward(bigcode)
    upcast = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, reorder_and_upcast_attn=True))
    with pytest.raises(ValueError, match="reorder_and_upcast_attn"):
        torchkvops.patch_forward(upcast)
    with pytest.raises(TypeError, match="Hugging Face causal LM"):
        torchkvops.patch_forward(torch.nn.Linear(2, 2))


def test_a_deep_copy_is_patched_on_its_own_weights(family_models):
    """A trainer that deep-copies a patched model (a reference model) gets a copy whose patched forward
    runs the copy's weights."""
    model = family_models["llama"]
    ids, mask, _ = batch([4, 2])
    with torchkvops.patch_forward(model, min_shared_tokens=4):
        twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.01)
        shared = twin(input_ids=ids, attention_mask=mask).logits
        reference = FAMILIES["llama"]()
        reference.load_state_dict(twin.state_dict())
        expected = reference(input_ids=ids, attention_mask=mask).logits
    assert getattr(twin.model, "_torchkvops_shared_forward").stats.shared_calls == 1
    real = mask.bool()
    torch.testing.assert_close(shared[real], expected[real], rtol=1e-3, atol=1e-5)


# --- padding collators, eager attention, pickling, empty batches ------------------------------------
def collator_batch():
    """4 rows sharing a 20-token prompt, left-padded by 2, with a padding collator's labels: the logit at
    the last padding column predicts the first real token, and is part of the loss."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (4, 26), generator=g)
    ids[:, :20] = ids[0, :20]
    mask = torch.ones_like(ids)
    mask[:, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_padding_collators_loss_and_gradients_are_the_plain_forwards(family_models, family):
    model = no_dropout_train(family_models[family])
    ids, mask, labels = collator_batch()
    plain = run(model, ids, mask, labels)
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        shared = run(model, ids, mask, labels)
    assert handle.stats.shared_calls == 1
    assert_same(shared, plain, mask)


def test_under_eager_attention_labels_read_from_padding_run_plain(family_models):
    """Eager attention averages a padding query's values over the whole row: no shared prefix gives that.
    A call whose labels read such a column runs plain (warned); one whose labels do not is shared."""
    model = FAMILIES["llama"]()
    model.set_attn_implementation("eager")
    ids, mask, labels = collator_batch()
    plain = run(model, ids, mask, labels)
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        with pytest.warns(UserWarning, match="labels that a left-padding column predicts, under eager"):
            got = run(model, ids, mask, labels)
        assert handle.stats.fallback_calls == 1 and handle.stats.shared_calls == 0
        assert_same(got, plain, mask, rtol=1e-6)
        unread = labels.clone()
        unread[:, 2] = -100  # the first real token is no label: nothing reads the padding columns
        shared = run(model, ids, mask, unread)
    assert handle.stats.shared_calls == 1
    torch.testing.assert_close(shared[0].loss, run(model, ids, mask, unread)[0].loss, rtol=1e-4, atol=1e-6)


def test_under_eager_attention_padding_queries_get_the_rows_average_and_gradients_stay_finite():
    """Issue #51: Gemma 3n, eager, prompts of 1 and 20 tokens, four one-token completions each. A padding
    query attends to nothing in the shared layout; at 0 its hidden state stayed exactly 0 (Gemma 3n's
    padding embedding is 0), and AltUp's sqrt(mean(x**2)) gave 0 x inf in backward: NaN gradients where
    the plain eager forward's are finite. It now gets what eager gives it (the mean of its row's values;
    a constant): the gradients are the plain forward's, and so are the padding logits of the row the
    shared padding columns come from."""
    from families import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("gemma3n_text")
    if config is None:
        pytest.skip("this transformers has no gemma3n_text")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()
    g = torch.Generator().manual_seed(0)
    rows = []
    for prompt in (torch.randint(3, VOCAB, (1,), generator=g), torch.randint(3, VOCAB, (20,), generator=g)):
        for j in range(4):
            rows.append(torch.cat([torch.zeros(21 - prompt.numel(), dtype=torch.long), prompt, torch.tensor([3 + j])]))
    ids = torch.stack(rows)
    mask = (ids != 0).long()

    def loss_pass():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits.float().log_softmax(-1)[mask.bool()].sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain_logits, plain_grads = loss_pass()
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        logits, grads = loss_pass()
    assert handle.stats.shared_calls == 1
    real = mask.bool()
    torch.testing.assert_close(logits[real], plain_logits[real], rtol=1e-4, atol=1e-4)
    # Row 0 leads the group whose 20 padding columns are shared: its padding logits are eager's.
    torch.testing.assert_close(logits[0, :20], plain_logits[0, :20], rtol=1e-4, atol=1e-4)
    assert all(torch.isfinite(g).all() for g in plain_grads.values())
    for name, want in plain_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-3, atol=1e-4 * want.abs().max(), msg=name)


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_pickled_patched_model_loads_patched_on_its_own_weights(how):
    model = FAMILIES["llama"]()  # (a model run with output_hidden_states holds transformers' unpicklable hooks)
    ids, mask, _ = batch([4, 2])
    with torchkvops.patch_forward(model, min_shared_tokens=4):
        buffer = io.BytesIO()
        torch.save(model, buffer) if how == "torch.save" else pickle.dump(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False) if how == "torch.save" else pickle.load(buffer)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits  # the original, unpatched again
        got = loaded(input_ids=ids, attention_mask=mask).logits
    assert getattr(loaded.model, "_torchkvops_shared_forward").stats.shared_calls == 1
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 8), (4, 0)], ids=["no_rows", "no_columns"])
def test_an_empty_batch_names_input_ids_and_runs_the_plain_forward(family_models, shape):
    model = family_models["llama"]
    ids = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(RuntimeError) as plain:
        model(input_ids=ids)
    with torchkvops.patch_forward(model, min_shared_tokens=4):
        with (
            pytest.warns(UserWarning, match=r"an empty batch \(input_ids of shape"),
            pytest.raises(RuntimeError) as got,
        ):
            model(input_ids=ids)
    assert str(got.value) == str(plain.value)  # the model's own error


def test_a_deep_copy_of_a_patched_model_is_patched_with_a_handle_of_its_own(family_models):
    """TRL's Online DPO and A2PO deep-copy the policy into their reference model: the copy shares rows too
    (outputs the plain forward's), counts in its own stats, which `ForwardPatch.of(copy)` reads, and is
    undone alone, its label hooks with it."""
    import copy

    model = no_dropout_train(copy.deepcopy(family_models["llama"]))
    ids, mask, labels = batch([3, 2], "adjacent", True)
    plain = run(model, ids, mask, labels)
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        twin = copy.deepcopy(model)
        assert torchkvops.ForwardPatch.of(model).stats is handle.stats
        twin_handle = torchkvops.ForwardPatch.of(twin)
        assert twin_handle is not None and twin_handle.stats is not handle.stats
        assert_same(run(twin, ids, mask, labels), plain, mask)
        assert twin_handle.stats.shared_calls == 1 and handle.stats.shared_calls == 0
        hooks = len(twin._forward_pre_hooks) + len(twin._forward_hooks)
        twin_handle.undo()
        assert torchkvops.ForwardPatch.of(twin) is None and "forward" not in vars(twin.model)
        assert len(twin._forward_pre_hooks) + len(twin._forward_hooks) == hooks - 2
        assert torchkvops.ForwardPatch.of(model) is not None  # the original: still patched
        assert_same(run(twin, ids, mask, labels), plain, mask)  # the plain forward now
        assert twin_handle.stats.shared_calls == 1
    assert torchkvops.ForwardPatch.of(model) is None
