"""RolloutOutput.logprobs (RolloutConfig.return_logprobs) and RolloutConfig.lm_head_dtype (issue #18).

The oracle is what a trainer computes: one plain forward over prompt + response, and the
log-probability of each response token under the processed distribution of its position
(torchkvops.reference.processed_logprobs: logits / temperature over what top-k / top-p keep,
renormalized; greedy: log_softmax of the logits), 0 after a row's first EOS. float32 models, so that
the rollout's decode path and the plain forward agree to float32 rounding. Compiled decode's
log-probabilities are checked against eager ones in test_rollout.py (its compiled fixture records them).
"""

import pytest
import torch
import torch.nn.functional as F
from devices import requires_gpu
from models import FAMILIES, prompts

from torchkvops import Rollout, RolloutConfig, reference

NO_EOS = []
SAMPLING = {
    "greedy": dict(),
    "temperature": dict(temperature=0.8, seed=1),
    "top-k": dict(temperature=1.0, top_k=5, seed=2),
    "top-p": dict(temperature=1.2, top_p=0.7, seed=3),
}
LAYOUTS = {
    "shared-copy": dict(),
    "expanded": dict(shared_prefill=False),
    "shared-prefix": dict(kv_sharing="prefix"),
}
TOL = dict(rtol=1e-4, atol=1e-4)


def trainer_logprobs(model, ids, mask, out, sampling, min_new_tokens=0, eos=None):
    """One plain forward over each row's prompt + response (left-padded prompts: positions from the
    mask), then the processed log-probability of every response token, 0 where response_mask is 0."""
    n = out.sequences.shape[0] // ids.shape[0]
    p, r = ids.shape[1], out.responses.shape[1]
    full_mask = torch.cat([mask.repeat_interleave(n, dim=0), torch.ones_like(out.responses)], dim=1)
    positions = (full_mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=out.sequences, attention_mask=full_mask, position_ids=positions).logits
    logits = logits[:, p - 1 : p + r - 1].float()
    if min_new_tokens:  # the rollout's EOS suppression before min_new_tokens tokens
        logits[:, :min_new_tokens, eos] = float("-inf")
    expected = reference.processed_logprobs(
        logits, out.responses, sampling.get("temperature", 0.0), sampling.get("top_k", 0), sampling.get("top_p", 1.0)
    )
    return torch.where(out.response_mask.bool(), expected, 0.0)


def eos_ids(model, ids, mask, **cfg):
    """EOS ids that make some rows end early but not all: the tokens that a run of the same config
    without EOS draws at step 2 of its first rows."""
    cfg.update(eos_token_id=NO_EOS, return_logprobs=False)
    free = Rollout(model, RolloutConfig(**cfg)).generate(ids, mask)
    return sorted({int(t) for t in free.responses[: max(1, free.responses.shape[0] // 2), 2]})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sampling", SAMPLING)
def test_logprobs_equal_the_trainers(llama, layout, sampling):
    ids, mask = prompts(2, 9, seed=4, left_pad=[0, 3])
    cfg = dict(samples_per_prompt=3, max_new_tokens=10, pad_token_id=0, **LAYOUTS[layout], **SAMPLING[sampling])
    eos = eos_ids(llama, ids, mask, **cfg)
    out = Rollout(llama, RolloutConfig(eos_token_id=eos, return_logprobs=True, **cfg)).generate(ids, mask)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == out.responses.shape
    assert not out.logprobs.is_inference()
    ended = out.response_mask == 0
    assert ended.any(), "no row ended: the test would not check the zeros after EOS"
    assert bool((out.logprobs[ended] == 0).all())
    assert bool((out.logprobs[~ended] <= 0).all())
    torch.testing.assert_close(out.logprobs, trainer_logprobs(llama, ids, mask, out, SAMPLING[sampling]), **TOL)


def test_logprobs_with_min_new_tokens_are_of_the_distribution_without_eos(llama):
    ids, mask = prompts(2, 9, seed=4)
    sampling = dict(temperature=1.0, seed=5)
    eos = eos_ids(llama, ids, mask, samples_per_prompt=2, max_new_tokens=8, **sampling)
    out = Rollout(
        llama,
        RolloutConfig(
            samples_per_prompt=2,
            max_new_tokens=8,
            min_new_tokens=4,
            eos_token_id=eos,
            pad_token_id=0,
            return_logprobs=True,
            **sampling,
        ),
    ).generate(ids, mask)
    torch.testing.assert_close(out.logprobs, trainer_logprobs(llama, ids, mask, out, sampling, 4, eos), **TOL)


def test_filler_rows_hold_zeros(llama):
    ids, mask = prompts(2, 7, seed=6)
    rollout = Rollout(
        llama,
        RolloutConfig(
            samples_per_prompt=2, max_new_tokens=5, eos_token_id=NO_EOS, return_logprobs=True, temperature=1.0, seed=0
        ),
    )
    live = torch.tensor([True, False, True, True])
    out = rollout.generate_rows(ids, mask, live=live)
    assert bool((out.logprobs[1] == 0).all()) and bool((out.logprobs[live] < 0).all())


def test_tokens_do_not_change_and_every_layout_gives_the_same_logprobs(llama):
    ids, mask = prompts(3, 8, seed=7, left_pad=[2, 0, 4])
    base = dict(samples_per_prompt=4, max_new_tokens=9, pad_token_id=0, temperature=0.9, top_k=20, top_p=0.95, seed=11)
    base["eos_token_id"] = eos_ids(llama, ids, mask, **base)
    plain = Rollout(llama, RolloutConfig(**base)).generate(ids, mask)
    assert plain.logprobs is None
    outs = [
        Rollout(llama, RolloutConfig(return_logprobs=True, **base, **layout)).generate(ids, mask)
        for layout in LAYOUTS.values()
    ]
    for out in outs:
        assert torch.equal(out.sequences, plain.sequences)
        torch.testing.assert_close(out.logprobs, outs[0].logprobs, rtol=1e-5, atol=1e-5)


# --- lm_head_dtype -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_llama():
    return FAMILIES["llama"]().to(torch.bfloat16)


def head_calls(model):
    """Record every (input, output) of the model's LM head while in the block."""
    calls = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: calls.append((args[0], out)))
    return calls, handle


def assert_float32_head(model, calls):
    weight = model.lm_head.weight.float()
    bias = None if model.lm_head.bias is None else model.lm_head.bias.float()
    assert calls
    for hidden, logits in calls:
        assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
        assert torch.equal(logits, F.linear(hidden.float(), weight, bias))


@pytest.mark.parametrize("layout", ["shared-copy", "shared-prefix"])
def test_float32_head_computes_the_logits_in_float32(bf16_llama, layout):
    """Every logit the rollout sampled from (prefill and decode) is the float32 head's on the bf16
    hidden state; without lm_head_dtype they are bf16. The head is back to itself afterwards."""
    ids, mask = prompts(2, 9, seed=9)
    cfg = dict(samples_per_prompt=2, max_new_tokens=5, eos_token_id=NO_EOS, return_logprobs=True, **LAYOUTS[layout])
    calls, handle = head_calls(bf16_llama)
    try:
        out = Rollout(bf16_llama, RolloutConfig(lm_head_dtype=torch.float32, **cfg)).generate(ids, mask)
        assert_float32_head(bf16_llama, calls)
        assert len(calls) == 5  # the prefill and 4 decode steps
        calls.clear()
        Rollout(bf16_llama, RolloutConfig(**cfg)).generate(ids, mask)
        assert {logits.dtype for _, logits in calls} == {torch.bfloat16}
    finally:
        handle.remove()
    assert "forward" not in vars(bf16_llama.lm_head)
    # Greedy: the log-probability is log_softmax of the float32 logits of the last call's hidden state.
    assert out.logprobs.dtype == torch.float32


def test_float32_head_follows_weight_updates_and_replacements(bf16_llama):
    ids, mask = prompts(1, 6, seed=10)
    model = FAMILIES["llama"]().to(torch.bfloat16)
    rollout = Rollout(model, RolloutConfig(max_new_tokens=3, eos_token_id=NO_EOS, lm_head_dtype=torch.float32))
    calls, handle = head_calls(model)
    try:
        rollout.generate(ids, mask)
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)  # in place (an optimizer step)
        calls.clear()
        rollout.generate(ids, mask)
        assert_float32_head(model, calls)
        model.lm_head.weight.data.copy_(model.lm_head.weight.data * 0.5)  # behind autograd's back
        calls.clear()
        rollout.generate(ids, mask)
        assert_float32_head(model, calls)
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))  # replaced
        calls.clear()
        rollout.generate(ids, mask)
        assert_float32_head(model, calls)
    finally:
        handle.remove()


def test_float32_head_on_a_float32_model_changes_nothing(llama):
    ids, mask = prompts(2, 8, seed=12)
    cfg = dict(
        samples_per_prompt=2, max_new_tokens=6, eos_token_id=NO_EOS, temperature=1.0, seed=3, return_logprobs=True
    )
    plain = Rollout(llama, RolloutConfig(**cfg)).generate(ids, mask)
    head32 = Rollout(llama, RolloutConfig(lm_head_dtype=torch.float32, **cfg))
    assert head32._head32 is None
    out = head32.generate(ids, mask)
    assert torch.equal(out.sequences, plain.sequences) and torch.equal(out.logprobs, plain.logprobs)


def precision_settings() -> tuple:
    """(the global float32 matmul precision, or "mixed" where torch refuses to read it; CUDA's and oneDNN's)."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = "mixed"
    return (legacy, torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)


@pytest.mark.parametrize("setting", ["high", "medium", "cuda_tf32"])
def test_float32_head_matmuls_at_full_precision_whatever_the_trainer_allows(bf16_llama, setting, monkeypatch):
    """A trainer that allows TF32 (or oneDNN's bf16 rounding of float32 matmuls on a CPU) does not make the
    float32 head round its inputs: inside the head's matmul every float32 precision setting is full, and
    after the call the trainer's settings are exactly as they were (torch's legacy and per-backend
    settings agree, so reading either does not raise)."""
    import torchkvops.rollout.lm_head as lm_head

    before = precision_settings()
    try:
        if setting == "cuda_tf32":
            torch.backends.cuda.matmul.fp32_precision = "tf32"
        else:
            torch.set_float32_matmul_precision(setting)
        trainer = precision_settings()
        seen = []

        def linear(*args, **kwargs):
            seen.append(precision_settings())
            return F.linear(*args, **kwargs)

        monkeypatch.setattr(lm_head, "F", type("F", (), {"linear": staticmethod(linear)}))
        ids, mask = prompts(2, 6, seed=13)
        cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=4, eos_token_id=NO_EOS, lm_head_dtype=torch.float32)
        Rollout(bf16_llama, cfg).generate(ids, mask)
        assert seen and set(seen) == {("highest", "ieee", "ieee")}, seen
        assert precision_settings() == trainer != ("highest", "ieee", "ieee")
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = before[1:]
        assert precision_settings() == before


@pytest.mark.parametrize("merged", [False, True], ids=["unmerged", "merged"])
def test_float32_head_keeps_a_lora_adapter_on_the_head(merged):
    """PEFT LoRA on the LM head (lora.Linear around it): the float32 layer stands in for the base layer,
    so every logit is the float32 base head's plus the adapter's output (unmerged), or the float32 copy
    of the merged weights (merged, models.lora); the head is back to itself after."""
    peft = pytest.importorskip("peft")
    from torchkvops.models.lora import merged_lora

    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False)
    model = peft.get_peft_model(FAMILIES["llama"]().to(torch.bfloat16), config).get_base_model()
    head = model.lm_head
    assert isinstance(head, peft.tuners.lora.Linear)
    calls = []
    handle = head.register_forward_hook(lambda module, args, out: calls.append((args[0], out)))
    ids, mask = prompts(2, 6, seed=14)
    cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=4, eos_token_id=NO_EOS, lm_head_dtype=torch.float32)
    try:
        with merged_lora(model, enabled=merged) as merge:
            Rollout(model, cfg).generate(ids, mask)
            weight = head.base_layer.weight.float()
    finally:
        handle.remove()
    assert merge.layers == (3 if merged else 0) and len(calls) == 4  # the head and 2 layers' q_proj
    lora_a, lora_b, scale = head.lora_A["default"], head.lora_B["default"], head.scaling["default"]
    for hidden, logits in calls:
        assert logits.dtype == torch.float32
        expected = F.linear(hidden.float(), weight)
        if not merged:
            expected = expected + lora_b(lora_a(hidden.to(lora_a.weight.dtype))).float() * scale
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert "forward" not in vars(head.base_layer) and "forward" not in vars(head)


def test_float32_head_names_what_it_needs():
    model = FAMILIES["llama"]().to(torch.bfloat16)
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(ValueError, match="a torch.nn.Linear .*got torch.nn.modules.container.Sequential"):
        Rollout(model, RolloutConfig(lm_head_dtype=torch.float32))


@pytest.mark.parametrize("value", [torch.bfloat16, torch.float64, "float32", 32])
def test_bad_lm_head_dtype_names_the_field(value):
    with pytest.raises(ValueError, match="RolloutConfig.lm_head_dtype must be None .* or torch.float32"):
        RolloutConfig(lm_head_dtype=value)


def test_bad_return_logprobs_names_the_field():
    with pytest.raises(ValueError, match="RolloutConfig.return_logprobs must be a bool"):
        RolloutConfig(return_logprobs=1)


# --- CUDA: graphs and the float32 head on the GPU ---------------------------------------------------
@pytest.mark.cuda
@requires_gpu
@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_graphs_give_the_eager_logprobs_and_the_trainers(kv_sharing, dtype):
    """CUDA-graph decode records the same log-probabilities as eager decode; in float32 they are the
    trainer's; in bf16 with the float32 head, every logit is the float32 head's."""
    model = FAMILIES["llama"]().cuda().to(dtype)
    ids, mask = prompts(2, 9, seed=13, left_pad=[0, 2])
    ids, mask = ids.cuda(), mask.cuda()
    sampling = dict(temperature=0.9, top_k=20, top_p=0.9, seed=4)
    cfg = dict(
        samples_per_prompt=3,
        max_new_tokens=10,
        pad_token_id=0,
        kv_sharing=kv_sharing,
        return_logprobs=True,
        lm_head_dtype=torch.float32 if dtype != torch.float32 else None,
        **sampling,
    )
    cfg["eos_token_id"] = eos_ids(model, ids, mask, **cfg)
    graphs = Rollout(model, RolloutConfig(cuda_graphs=True, **cfg))
    eager = Rollout(model, RolloutConfig(cuda_graphs=False, **cfg))
    for _ in range(3):  # warm-up, capture, replay
        out = graphs.generate(ids, mask)
    assert graphs.decode_counters().captured_graphs
    calls, handle = head_calls(model)
    try:
        expected = eager.generate(ids, mask)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(out.logprobs, expected.logprobs, rtol=1e-5, atol=1e-5)
    if dtype == torch.float32:  # (torch's default: no TF32 in float32 matmuls)
        torch.testing.assert_close(out.logprobs, trainer_logprobs(model, ids, mask, out, sampling), **TOL)
    else:
        assert_float32_head(model, calls)
