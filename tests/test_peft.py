"""PEFT (LoRA) models through both patches: patch_forward finds the backbone inside PeftModel (with and
without a task type) and its outputs and LoRA gradients are the unpatched model's; patch_generate on a
PeftModel is served from the model the adapters are injected into, gives PEFT's own generate's tokens,
and follows the adapter weights as an optimizer changes them in place; TRL's GRPOTrainer with
`peft_config` and both patches serves every generate call and shares every training pass, ending with
the weights of the unpatched run. Skipped when peft is not installed."""

import warnings

import pytest
import torch

peft = pytest.importorskip("peft")
from devices import CUDA  # noqa: E402
from models import FAMILIES, prompts  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

import torchkvops  # noqa: E402

TARGETS = {"q_v": ["q_proj", "v_proj"], "all_linear": "all-linear"}


def lora(model, targets, task_type=None):
    """LoRA with random B (init_lora_weights=False), so that the adapters change the outputs."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, task_type=task_type)
    torch.manual_seed(1)
    return get_peft_model(model, config)


def batch():
    """Two prompts of 16 tokens, left-padded, 3 completions each."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 90, (6, 22), generator=g)
    ids[:3, :16], ids[3:, :16] = ids[0, :16], ids[3, :16]
    mask = torch.ones_like(ids)
    mask[3:, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def loss_and_lora_grads(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"], ids=["PeftModel", "PeftModelForCausalLM"])
@pytest.mark.parametrize("targets", list(TARGETS))
def test_patch_forward_on_a_peft_model_shares_and_gives_the_plain_lora_gradients(targets, task_type):
    model = lora(FAMILIES["llama"]().train(), TARGETS[targets], task_type)
    ids, mask, labels = batch()
    plain, plain_grads = loss_and_lora_grads(model, ids, mask, labels)
    assert plain_grads and all("lora_" in n for n in plain_grads)
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        shared, shared_grads = loss_and_lora_grads(model, ids, mask, labels)
    assert handle.stats.shared_calls == 1 and handle.stats.fallback_calls == 0
    torch.testing.assert_close(shared.logits, plain.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(shared.loss, plain.loss, rtol=1e-5, atol=1e-6)
    assert shared_grads.keys() == plain_grads.keys()
    scale = max(g.abs().max() for g in plain_grads.values())
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("targets", list(TARGETS))
def test_patch_generate_on_a_peft_model_is_served_and_follows_the_adapters(targets, monkeypatch):
    model = lora(FAMILIES["llama"](), TARGETS[targets], "CAUSAL_LM")
    served = []
    original = torchkvops.Rollout.generate_rows
    monkeypatch.setattr(
        torchkvops.Rollout, "generate_rows", lambda self, *a, **k: served.append(1) or original(self, *a, **k)
    )
    ids, mask = prompts(4, 8, seed=4, left_pad=[0, 1, 2, 0])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = type(model).generate(model, input_ids=ids, **kwargs)  # PEFT's own generate
    with torchkvops.patch_generate(model):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # served, no fallback warning
            first = model.generate(input_ids=ids, **kwargs)
        optimizer = torch.optim.SGD([p for n, p in model.named_parameters() if "lora_" in n], lr=5.0)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()  # in place: the same tensors, new values
        model.eval()
        after = model.generate(input_ids=ids, **kwargs)
    assert len(served) == 2 and torch.equal(first, expected)
    updated = type(model).generate(model, input_ids=ids, **kwargs)
    assert not torch.equal(updated, expected) and torch.equal(after, updated)


def test_a_prompt_learning_adapter_falls_back_to_peft_generate():
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = get_peft_model(FAMILIES["llama"](), config)
    ids, mask = prompts(2, 6, seed=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = type(model).generate(model, input_ids=ids, **kwargs)
    with pytest.warns(UserWarning, match="prompt-learning adapter"):
        handle = torchkvops.patch_generate(model)
    assert torch.equal(model.generate(input_ids=ids, **kwargs), expected)
    handle.undo()


def two_adapters(device: str):
    model = lora(FAMILIES["llama"](), TARGETS["q_v"], "CAUSAL_LM")
    torch.manual_seed(2)
    model.add_adapter(
        "other",
        LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS["q_v"], init_lora_weights=False, task_type="CAUSAL_LM"),
    )
    return model.to(device).eval()


# The same decode path eager, compiled (CPU) and replayed from CUDA graphs (GPU): an optimizer step on
# the adapters in place, a switch of adapter and disabling them are each followed by the next call.
@pytest.mark.parametrize("device,decode", [("cpu", "compile"), pytest.param("cuda", "graphs", marks=CUDA.marks)])
def test_rollout_decode_of_a_lora_model_follows_its_adapters(device, decode):
    from torchkvops import Rollout, RolloutConfig

    model = two_adapters(device)
    ids, mask = prompts(2, 8, seed=6, left_pad=[0, 2])
    ids, mask = ids.to(device), mask.to(device)
    options = dict(compile=True) if decode == "compile" else dict(cuda_graphs=True)
    rollout = Rollout(
        model.get_base_model(), RolloutConfig(samples_per_prompt=2, max_new_tokens=10, eos_token_id=[], **options)
    )
    reference = Rollout(
        model.get_base_model(),
        RolloutConfig(samples_per_prompt=2, max_new_tokens=10, eos_token_id=[], cuda_graphs=False),
    )

    def tokens():
        out = rollout.generate(ids, mask).responses
        assert torch.equal(out, reference.generate(ids, mask).responses)
        return out

    seen = [tokens(), tokens()]  # the second call replays (or reuses the compiled graph)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B.default" in name:
                p.mul_(-3.0)  # in place, as an optimizer step: same address, new values
    seen.append(tokens())
    model.set_adapter("other")
    seen.append(tokens())
    with model.disable_adapter():
        seen.append(tokens())
    for a, b in zip(seen[1:], seen[2:]):
        assert not torch.equal(a, b)  # every change changed the tokens (and the rollout followed: tokens())


# --- LoRA merged for the rollout (merge_lora, models.lora) ------------------------------------------
def lora_layers(model):
    return [m for m in model.modules() if isinstance(m, peft.tuners.lora.Linear)]


def count_adapter_forwards(model) -> list[int]:
    """A counter of the calls of every LoRA A module: unmerged, each layer's forward calls its own; merged,
    none of them runs."""
    calls = [0]
    for layer in lora_layers(model):
        for module in layer.lora_A.values():
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA.marks)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_a_merged_lora_rollout_leaves_every_parameter_bit_identical(dtype, device):
    """Served with the adapters merged (no LoRA module runs), and afterwards every parameter is the same
    tensor with the same bits, and the layers run unmerged again. In half precision, merging then
    subtracting the delta (PEFT's own unmerge) does change weights: a restore by subtraction would fail."""
    model = lora(FAMILIES["llama"](), "all-linear", "CAUSAL_LM").to(device, dtype)
    ids, mask = (t.to(device) for t in prompts(4, 8, seed=4, left_pad=[0, 1, 2, 0]))
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    before = {name: (p.detach().clone(), p.data_ptr()) for name, p in model.named_parameters()}
    adapter_calls = count_adapter_forwards(model)
    with torchkvops.patch_generate(model) as handle:
        model.generate(input_ids=ids, **kwargs)
        profile = handle.last_profile()
    assert profile.merged_lora_layers == len(lora_layers(model)) == 14 and adapter_calls == [0]
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name][0]) and p.data_ptr() == before[name][1], name
    assert all(layer.merged_adapters == [] for layer in lora_layers(model))
    model(input_ids=ids, attention_mask=mask)
    assert adapter_calls[0] == len(lora_layers(model))  # unmerged again: every adapter runs
    if dtype != torch.float32:
        model.merge_adapter()
        model.unmerge_adapter()
        assert any(not torch.equal(p, before[n][0]) for n, p in model.named_parameters())


def test_a_merged_lora_rollout_gives_the_unmerged_rollouts_tokens():
    """fp32 greedy (the test model's logits have no near-ties): the merged rollout's tokens are the
    unmerged rollout's and PEFT's own generate's; merge_lora=False runs the adapters at every step."""
    model = lora(FAMILIES["llama"](), "all-linear", "CAUSAL_LM")
    ids, mask = prompts(4, 8, seed=7, left_pad=[0, 1, 2, 0])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = type(model).generate(model, input_ids=ids, **kwargs)
    adapter_calls = count_adapter_forwards(model)
    outputs = {}
    for merge in (True, False):
        adapter_calls[0] = 0
        with torchkvops.patch_generate(model, merge_lora=merge) as handle:
            outputs[merge] = model.generate(input_ids=ids, **kwargs)
            assert handle.last_profile().merged_lora_layers == (14 if merge else 0)
        assert (adapter_calls[0] > 0) is not merge
    assert torch.equal(outputs[True], expected) and torch.equal(outputs[False], expected)
    merged = torchkvops.generate(model, ids, **kwargs)  # torchkvops.generate merges too (its default)
    assert torch.equal(merged, expected)
    with pytest.raises(ValueError, match="merge_lora must be a bool"):
        torchkvops.patch_generate(model, merge_lora="yes")


def test_merged_lora_log_probabilities_match_the_unmerged_rollouts():
    """The rollout's own log-probabilities, sampled with one seed, merged vs unmerged: the same tokens
    and log-probabilities within float32 rounding."""
    from torchkvops import Rollout, RolloutConfig
    from torchkvops.models.lora import merged_lora

    model = lora(FAMILIES["llama"](), "all-linear", "CAUSAL_LM")
    base = model.get_base_model()
    ids, mask = prompts(2, 8, seed=8, left_pad=[0, 2])
    config = RolloutConfig(samples_per_prompt=3, max_new_tokens=8, eos_token_id=[], seed=5, return_logprobs=True)
    unmerged = Rollout(base, config).generate(ids, mask)
    with merged_lora(base) as merged:
        fused = Rollout(base, config).generate(ids, mask)
    assert merged.layers == 14 and merged.bytes == sum(m.base_layer.weight.nbytes for m in lora_layers(model))
    assert torch.equal(fused.responses, unmerged.responses)
    torch.testing.assert_close(fused.logprobs, unmerged.logprobs, rtol=1e-4, atol=1e-5)


class FixedNoise(torch.nn.Module):
    """A deterministic stand-in for an adapter's dropout in train mode (a fixed mask, scaled): what PEFT's
    forward does with it is reproducible, so its generate is an exact oracle for a call that keeps it."""

    def __init__(self, features: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("mask", (torch.rand(features, generator=g) > 0.5).float() * 2.0)

    def forward(self, x):
        return x * self.mask.to(x.dtype) if self.training else x


def test_an_adapter_whose_dropout_is_active_runs_unmerged_with_peft_generates_tokens():
    """In train mode an adapter's dropout acts on its input: merging would silently drop it. A layer whose
    dropout is active runs PEFT's own forward (the deterministic stand-in gives PEFT's generate's exact
    tokens; the merged weights gave the eval-mode ones; a dropout module of another class is never merged,
    as nothing says it is the identity in eval mode), a plain nn.Dropout draws a mask as PEFT's does
    (different seeds, different tokens), and merges again in eval mode."""
    model = lora(FAMILIES["llama"](), "all-linear", "CAUSAL_LM")
    for i, layer in enumerate(lora_layers(model)):
        layer.lora_dropout["default"] = FixedNoise(layer.in_features, seed=i)
    model.eval()  # (new modules start in train mode)
    ids, mask = prompts(4, 8, seed=7, left_pad=[0, 1, 2, 0])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    eval_mode = type(model).generate(model, input_ids=ids, **kwargs)
    model.train()
    expected = type(model).generate(model, input_ids=ids, **kwargs)  # PEFT's generate, the noise applied
    assert not torch.equal(expected, eval_mode)
    with torchkvops.patch_generate(model) as handle:
        assert torch.equal(model.generate(input_ids=ids, **kwargs), expected)
        assert handle.last_profile().merged_lora_layers == 0
        model.eval()
        assert torch.equal(model.generate(input_ids=ids, **kwargs), eval_mode)
        assert handle.last_profile().merged_lora_layers == 0

    model = lora(FAMILIES["llama"](), "all-linear", "CAUSAL_LM")
    for layer in lora_layers(model):
        layer.lora_dropout["default"] = torch.nn.Dropout(0.5)
    model.train()
    adapter_calls = count_adapter_forwards(model)
    with torchkvops.patch_generate(model) as handle:
        outputs = set()
        for seed in range(4):
            torch.manual_seed(seed)
            outputs.add(tuple(model.generate(input_ids=ids, **kwargs).flatten().tolist()))
        assert handle.last_profile().merged_lora_layers == 0 and adapter_calls[0] > 0
        model.eval()
        assert torch.equal(
            model.generate(input_ids=ids, **kwargs), type(model).generate(model, input_ids=ids, **kwargs)
        )
        assert handle.last_profile().merged_lora_layers == 14
    assert len(outputs) > 1  # dropout drawn: the seeds give different tokens, as PEFT's generate's


def test_an_adapter_holding_a_nan_is_served_as_peft_serves_it():
    """PEFT's own generate (and its unmerged layers) returns tokens for an adapter holding a NaN; its safe
    merge raises on one. The merged call returns PEFT's generate's tokens and leaves the weights as they
    were; so does merge_lora=False."""
    model = lora(FAMILIES["llama"](), "all-linear", "CAUSAL_LM")
    with torch.no_grad():
        lora_layers(model)[3].lora_B["default"].weight[0, 0] = float("nan")
    ids, mask = prompts(4, 8, seed=7, left_pad=[0, 1, 2, 0])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = type(model).generate(model, input_ids=ids, **kwargs)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for merge in (True, False):
        with torchkvops.patch_generate(model, merge_lora=merge) as handle:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # served, no fallback warning
                assert torch.equal(model.generate(input_ids=ids, **kwargs), expected), merge
            assert handle.last_profile().merged_lora_layers == (14 if merge else 0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_merged_lora_in_half_precision_computes_the_merged_models_tokens(dtype):
    """Half-precision base weights, float32 adapters (PEFT's default autocast_adapter_dtype). Merged, the
    call decodes with the weights PEFT's merge_and_unload() makes: tokens and log-probabilities equal the
    rollout's on that merged model, bit for bit. merge_lora=False runs PEFT's own layers: the rollout's
    tokens and log-probabilities on the PeftModel unmerged. What docs/generate.md states."""
    import copy

    from torchkvops import Rollout, RolloutConfig

    model = lora(FAMILIES["llama"]().to(dtype), "all-linear", "CAUSAL_LM")
    assert lora_layers(model)[0].lora_A["default"].weight.dtype == torch.float32
    ids, mask = prompts(4, 8, seed=7, left_pad=[0, 1, 2, 0])
    config = RolloutConfig(samples_per_prompt=2, max_new_tokens=10, eos_token_id=[], seed=3, return_logprobs=True)
    merged_model = copy.deepcopy(model).merge_and_unload()
    merged_oracle = Rollout(merged_model, config).generate(ids, mask)
    unmerged_oracle = Rollout(model.get_base_model(), config).generate(ids, mask)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    from torchkvops.models.lora import merged_lora

    with merged_lora(model.get_base_model()) as merged:
        fused = Rollout(model.get_base_model(), config).generate(ids, mask)
    assert merged.layers == 14
    assert torch.equal(fused.responses, merged_oracle.responses)
    assert torch.equal(fused.logprobs, merged_oracle.logprobs)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    # Not the same computation as PEFT's: the merged weights are rounded to the base dtype.
    assert not torch.equal(fused.logprobs, unmerged_oracle.logprobs)


# --- TRL's GRPOTrainer with peft_config --------------------------------------------------------------
def grpo_lora_run(checkpoint, output_dir, patch_forward: bool, monkeypatch):
    """Two GRPO steps with TRL's `peft_config` (TRL wraps the model in a PeftModel; beta > 0: the reference
    pass runs with the adapters disabled; num_iterations = 2: the old-logprob pass runs), generate patched
    (so that both runs sample the same completions: the rollout's sampler, seeded from torch's generator),
    patch_forward or not. Returns the final LoRA weights, the rollouts run, the calls that reached PEFT's
    own generate and the forward patch's stats."""
    import test_trl
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = test_trl.grpo_trainer(
        test_trl.load_example(), model, output_dir, steps=2, beta=0.04, num_iterations=2, peft_config=config
    )
    assert isinstance(trainer.model, peft.PeftModel)
    rollouts, fallbacks = [], []
    original = torchkvops.Rollout.generate_rows
    monkeypatch.setattr(
        torchkvops.Rollout,
        "generate_rows",
        lambda self, *a, **k: rollouts.append(a[0].shape[0]) or original(self, *a, **k),
    )
    generate = torchkvops.patch_generate(trainer.model)
    fallback = generate.session.original_generate
    generate.session.original_generate = lambda *a, **k: fallbacks.append(1) or fallback(*a, **k)
    forward = torchkvops.patch_forward(trainer.model, min_shared_tokens=4) if patch_forward else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainer.train()
    assert not [str(w.message) for w in caught if "torchkvops" in str(w.message)]
    monkeypatch.undo()  # the next run counts its own rollouts
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    return weights, rollouts, fallbacks, None if forward is None else forward.stats


def test_grpo_with_peft_config_serves_every_generate_and_shares_every_pass(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    import test_trl

    from torchkvops.models import build_model

    checkpoint = str(tmp_path / "model")
    build_model("tiny", seed=0).save_pretrained(checkpoint)
    plain, rollouts, fallbacks, _ = grpo_lora_run(checkpoint, tmp_path / "plain", False, monkeypatch)
    shared, shared_rollouts, shared_fallbacks, stats = grpo_lora_run(checkpoint, tmp_path / "shared", True, monkeypatch)
    # Each generation batch of each run: served (one prefill per prompt), never PEFT's generate.
    assert rollouts == shared_rollouts == [test_trl.PROMPTS] and fallbacks == shared_fallbacks == []
    # Old-logprob, reference (adapters disabled) and loss passes: all shared, none plain.
    assert (stats.shared_calls, stats.fallback_calls) == (4, 0) and stats.computed_tokens < stats.row_tokens
    update = max(p.abs().max().item() for n, p in plain.items() if "lora_B" in n)  # B starts at 0
    assert update > 1e-4 and plain.keys() == shared.keys()
    for name in plain:  # both runs moved the adapters alike (Adam turns rounding noise into at most this much)
        torch.testing.assert_close(shared[name], plain[name], rtol=0, atol=0.02 * update, msg=name)
