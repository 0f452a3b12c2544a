"""torchkvops as a DeepSpeed RolloutEngine (torchkvops.deepspeed.TorchkvopsRollout) against DeepSpeed's own
HybridEngineRollout on the same model: greedy batches equal (tokens, masks, response_start_idx), each prompt
prefilled once, sampled first tokens distributed as the model's softmax says, the row budget, the profile's
keys, bad sampling settings named; DeepSpeed's OPSD loss and gradients the same with patch_forward on student
and teacher. ZeRO-3 on 2 processes: tests/test_zero3.py. Skipped where deepspeed is not installed."""

import subprocess
import sys
import types

import pytest
import torch
from models import FAMILIES, prompts

import torchkvops
from torchkvops.deepspeed import TorchkvopsRollout, TorchkvopsRolloutConfig, pad_after_eos

rollout_api = pytest.importorskip("deepspeed.runtime.rollout")
EOS, PAD = 7, 0
TOKENIZER = types.SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)


@pytest.fixture(scope="module")
def request_():
    ids, mask = prompts(3, 9, seed=3, left_pad=[0, 2, 4])
    return rollout_api.RolloutRequest(ids, mask)


def hybrid_engine(model, tokenizer=TOKENIZER, **cfg):
    """DeepSpeed's engine on a plain model (its non-injected path reads only `engine.module`)."""
    return rollout_api.HybridEngineRollout(types.SimpleNamespace(module=model), tokenizer, types.SimpleNamespace(**cfg))


def greedy(new_tokens=12, n=3, **kwargs):
    return rollout_api.SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, n_samples_per_prompt=n, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_greedy_batches_equal_hybrid_engine_rollouts(family_models, family, request_):
    model = family_models[family]
    # An EOS id that ends some responses early (row 0's fifth token), so that the test sees the padding.
    unended = hybrid_engine(model, tokenizer=types.SimpleNamespace(pad_token_id=PAD, eos_token_id=None))
    eos = int(unended.generate(request_, greedy()).input_ids[0, 9 + 4])
    tokenizer = types.SimpleNamespace(pad_token_id=PAD, eos_token_id=eos)
    expected = hybrid_engine(model, tokenizer=tokenizer).generate(request_, greedy())
    assert expected.attention_mask[:, 9:].sum() < 9 * 12
    run_to_budget = TorchkvopsRollout(model, tokenizer, TorchkvopsRolloutConfig(run_to_budget=True))
    got = run_to_budget.generate(request_, greedy())
    for field in ("input_ids", "attention_mask", "response_start_idx"):
        assert torch.equal(getattr(got, field), getattr(expected, field)), field
    # EOS honoured: the batch ends with its longest response; the columns HybridEngineRollout adds are padding.
    got = TorchkvopsRollout(model, tokenizer).generate(request_, greedy())
    width = got.input_ids.shape[1]
    longest = int(expected.attention_mask[:, 9:].sum(dim=1).max())
    assert width == 9 + longest
    assert torch.equal(got.input_ids, expected.input_ids[:, :width])
    assert torch.equal(got.attention_mask, expected.attention_mask[:, :width])
    assert (expected.attention_mask[:, width:] == 0).all() and (expected.input_ids[:, width:] == PAD).all()
    assert torch.equal(got.response_start_idx, expected.response_start_idx)


def test_each_prompt_is_prefilled_once_and_the_profile_has_deepspeeds_keys(llama, request_):
    ours = TorchkvopsRollout(llama, TOKENIZER, TorchkvopsRolloutConfig(enable_profiling=True))
    assert isinstance(ours, rollout_api.RolloutEngine)
    ours.generate(request_, greedy(n=4))
    assert ours._session.last_profile.prefill_tokens == 3 * 9  # 3 prompts of 9 columns, not 12 rows
    theirs = hybrid_engine(llama, enable_profiling=True)
    theirs.generate(request_, greedy(n=4))
    profile = ours.get_last_profile()
    assert set(theirs.get_last_profile()) <= set(profile)
    assert profile["batch_size"] == 3 and profile["num_samples_per_prompt"] == 4 and profile["prompt_length"] == 9
    assert profile["num_generated_tokens"] == 12 * profile["response_length"]
    assert (
        0
        < profile["prefill_forward_ms"] + profile["decode_forward_ms"]
        <= profile["generation_ms"]
        <= profile["total_ms"]
    )
    assert TorchkvopsRollout(llama, TOKENIZER).get_last_profile() is None  # profiling off: None, as DeepSpeed's


def test_continuous_batch_size_bounds_the_rows_with_the_same_tokens(llama, request_):
    ours = TorchkvopsRollout(llama, TOKENIZER)
    expected = ours.generate(request_, greedy(n=3))
    got = ours.generate(request_, greedy(n=3, continuous_batch_size=3))  # one prompt's rows at a time
    assert torch.equal(got.input_ids, expected.input_ids) and torch.equal(got.attention_mask, expected.attention_mask)
    assert ours._session.last_profile.refills == 2  # the second and third prompts took freed rows


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 1.0), (0.5, 0, 0.6)])
def test_sampled_first_tokens_follow_the_models_distribution(llama, temperature, top_k, top_p):
    """4000 samples of one prompt's first token: a Pearson chi-square against softmax(logits / T) over what
    top-k / top-p keep below 30 (df <= 8; the seed is torch's, fixed here, so the test is deterministic)."""
    ids, mask = prompts(1, 8, seed=11)
    with torch.no_grad():
        scaled = llama(ids, attention_mask=mask).logits[0, -1].double() / temperature
    kept = torch.ones_like(scaled, dtype=torch.bool)
    if top_k:
        kept &= scaled >= scaled.topk(top_k).values[-1]
    probs = torch.where(kept, scaled, float("-inf")).softmax(dim=0)
    if top_p < 1.0:
        larger = torch.stack([probs[scaled > s].sum() for s in scaled])
        kept &= larger < top_p
        probs = torch.where(kept, scaled, float("-inf")).softmax(dim=0)
    assert 2 <= int(kept.sum()) <= 9
    torch.manual_seed(5)
    n = 4000
    sampling = rollout_api.SamplingConfig(1, temperature=temperature, top_p=top_p, top_k=top_k, n_samples_per_prompt=n)
    batch = TorchkvopsRollout(llama, types.SimpleNamespace(pad_token_id=PAD, eos_token_id=None)).generate(
        rollout_api.RolloutRequest(ids, mask), sampling
    )
    counts = torch.bincount(batch.input_ids[:, -1], minlength=scaled.numel()).double()
    assert (counts[~kept] == 0).all()
    expected = probs[kept] * n
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
    assert chi2 < 30, (counts[kept].tolist(), expected.tolist(), chi2)


@pytest.mark.parametrize(
    "sampling,match",
    [
        (dict(max_new_tokens=4, n_samples_per_prompt=0), "n_samples_per_prompt must be an int >= 1, got 0"),
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
        (
            dict(max_new_tokens=4, n_samples_per_prompt=4, continuous_batch_size=2),
            "continuous_batch_size must be None or an int >= n_samples_per_prompt=4",
        ),
    ],
)
def test_bad_sampling_settings_are_named(llama, request_, sampling, match):
    with pytest.raises(ValueError, match=match):
        TorchkvopsRollout(llama, TOKENIZER).generate(request_, rollout_api.SamplingConfig(**sampling))


def test_bad_configs_are_named(llama):
    with pytest.raises(ValueError, match="TorchkvopsRolloutConfig.kv_sharing must be None or one of 'copy', 'prefix'"):
        TorchkvopsRolloutConfig(kv_sharing="blocks")
    with pytest.raises(ValueError, match="tokenizer must define pad_token_id or eos_token_id"):
        TorchkvopsRollout(llama, types.SimpleNamespace(pad_token_id=None, eos_token_id=None))
    # DeepSpeed's own config object: the fields it shares are read.
    cfg = TorchkvopsRolloutConfig.of(types.SimpleNamespace(enable_profiling=True, use_graph_capture=False))
    assert cfg.enable_profiling and not cfg.cuda_graphs


def test_pad_after_eos_is_deepspeeds_post_processing():
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(0, 9, (64, 10), generator=g)  # EOS, pad, both, neither, in every place
    for eos, pad in ((EOS, PAD), (EOS, EOS), ([EOS, 3], PAD), (None, PAD)):
        prompt = torch.ones(64, 2, dtype=torch.long)
        ids, mask = rollout_api.HybridEngineRollout._pad_after_eos(torch.cat([prompt, responses], 1), 2, eos, pad)
        got_ids, got_mask = pad_after_eos(responses, eos, pad)
        assert torch.equal(got_ids, ids[:, 2:]) and torch.equal(got_mask, mask), (eos, pad)


def test_the_module_imports_without_deepspeed_and_says_what_to_install():
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "import torchkvops.deepspeed as d\n"
        "try:\n    d.TorchkvopsRollout(None, None)\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "needs DeepSpeed's rollout interface" in out.stdout and "pip install -U deepspeed" in out.stdout


def opsd_loss(student, teacher, batch):
    """DeepSpeed's OPSD loss of a rollout batch: the student's logits against the teacher's (no gradient)
    on the response tokens (`ResponseTokenBatch`, `generalized_jsd_loss`)."""
    tokens = rollout_api.ResponseTokenBatch.from_rollout(batch)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).logits
    student_logits = student(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).logits
    return rollout_api.generalized_jsd_loss(
        tokens.select_causal_logits(student_logits), tokens.select_causal_logits(teacher_logits), tokens.response_mask
    ).loss


def test_opsd_loss_and_gradients_are_the_same_with_patch_forward_on_student_and_teacher(request_):
    student, teacher = FAMILIES["llama"](), FAMILIES["qwen3"]()  # (one vocabulary: tests/models.py)
    ids, mask = prompts(2, 40, seed=9, left_pad=[0, 3])
    batch = TorchkvopsRollout(student, TOKENIZER).generate(rollout_api.RolloutRequest(ids, mask), greedy(10, n=4))
    results = []
    for patched in (False, True):
        handles = [torchkvops.patch_forward(m, min_shared_tokens=8) for m in (student, teacher)] if patched else []
        student.zero_grad()
        loss = opsd_loss(student, teacher, batch)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in student.parameters()]))
        if patched:
            assert handles[0].stats.shared_calls >= 1 and handles[1].stats.shared_calls >= 1
        for h in handles:
            h.undo()
    (loss_plain, grads_plain), (loss_shared, grads_shared) = results
    torch.testing.assert_close(loss_shared, loss_plain, rtol=1e-5, atol=1e-6)
    for shared, plain in zip(grads_shared, grads_plain):
        torch.testing.assert_close(shared, plain, rtol=1e-4, atol=1e-6)


def test_the_opsd_example_runs_both_engines_to_the_same_losses():
    """examples/opsd_deepspeed.py end to end (tiny shape, DeepSpeed engine over gloo, 2 steps per engine):
    greedy rollouts, so both engines' losses agree at every step."""
    import re
    from pathlib import Path

    from test_distributed import env, free_port

    example = Path(__file__).resolve().parents[1] / "examples" / "opsd_deepspeed.py"
    out = subprocess.run(
        [sys.executable, str(example), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env(MASTER_PORT=str(free_port())),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = {}
    for engine, loss in re.findall(r"step \d+ +(\w+): .* loss ([0-9.]+)", out.stdout):
        losses.setdefault(engine, []).append(float(loss))
    assert set(losses) == {"torchkvops", "hybrid"} and len(losses["hybrid"]) == 2
    for ours, theirs in zip(losses["torchkvops"], losses["hybrid"]):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)
    assert "OPSD step: torchkvops" in out.stdout
