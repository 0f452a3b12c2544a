"""TRL's GRPOTrainer (no vLLM) with `torchkvops.patch_generate`: the trainer's generate calls go through the
rollout (one prefill per prompt, none through HF's generate), TRL receives prompts x num_generations
sequences, and training updates the weights. Also: TRL's default bf16=True on a float32 model falls back
to HF's generate (see integration.forward_autocast_dtype), and examples/grpo_trl.py runs end to end."""

import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from timeouts import TIMEOUT

pytest.importorskip("trl")
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import torchkvops  # noqa: E402
from torchkvops.models import build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_trl.py"
PROMPTS, NUM_GENERATIONS, MAX_NEW = 2, 4, 8


# (conftest.one_thread: one OpenMP thread for the GRPO steps' hundreds of small ops)
pytestmark = pytest.mark.usefixtures("one_thread")


def load_example():
    """examples/grpo_trl.py as a module: its offline tokenizer and in-memory dataset."""
    spec = importlib.util.spec_from_file_location("grpo_trl_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return load_example()


def length_reward(completions, **kwargs):
    """Dense (completions of one prompt almost never tie), so that advantages and gradients are nonzero."""
    return [len(text) / 100.0 for text in completions]


def grpo_trainer(example, model, output_dir, steps, peft_config=None, **overrides):
    config = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=steps,
        per_device_train_batch_size=PROMPTS * NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_NEW,
        learning_rate=1e-3,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    config.update(overrides)
    return GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=GRPOConfig(**config),
        train_dataset=example.build_dataset(16, 8),
        processing_class=example.build_tokenizer(model.config),
        peft_config=peft_config,
    )


def spy_on(model, handle, monkeypatch):
    """Record what TRL passed to and got from model.generate, each rollout's (prompts, samples), and
    every call that reached HF's own generate."""
    calls = {"generate": [], "rollout": [], "hf": []}
    original_rollout = torchkvops.Rollout.generate_rows

    def rollout_spy(self, input_ids, *args, **kwargs):
        calls["rollout"].append((input_ids.shape[0], self.config.samples_per_prompt))
        return original_rollout(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(torchkvops.Rollout, "generate_rows", rollout_spy)
    original_hf = handle.session.original_generate
    handle.session.original_generate = lambda *a, **k: calls["hf"].append(1) or original_hf(*a, **k)
    patched = model.generate

    def generate_spy(*args, **kwargs):
        out = patched(*args, **kwargs)
        calls["generate"].append(
            (
                kwargs["input_ids"].clone(),
                kwargs["attention_mask"].clone(),
                out.clone(),
                kwargs.get("generation_config"),
            )
        )
        return out

    model.generate = generate_spy
    return calls


def test_grpo_trainer_generates_through_the_patch_and_trains(example, tmp_path, monkeypatch):
    model = build_model("tiny", seed=0)
    handle = torchkvops.patch_generate(model)
    calls = spy_on(model, handle, monkeypatch)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = grpo_trainer(example, model, tmp_path, steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainer.train()
    assert not [str(w.message) for w in caught if "torchkvops" in str(w.message)]

    # (a) Every generate TRL made went through the rollout, one prefill per prompt; none reached HF's.
    assert len(calls["generate"]) == 2  # one generation batch per step (steps_per_generation=1)
    assert calls["rollout"] == [(PROMPTS, NUM_GENERATIONS)] * 2
    assert calls["hf"] == []
    # (c) TRL received prompts x num_generations rows: its prompts (left-padded, each repeated
    # num_generations times in a row), then at most max_completion_length sampled tokens.
    for ids, mask, out, config in calls["generate"]:
        rows, prompt_len = ids.shape
        assert rows == PROMPTS * NUM_GENERATIONS and out.shape[0] == rows
        assert prompt_len < out.shape[1] <= prompt_len + MAX_NEW
        assert torch.equal(out[:, :prompt_len], ids)
        groups = ids.view(PROMPTS, NUM_GENERATIONS, prompt_len)
        assert torch.equal(groups, groups[:, :1].expand_as(groups))
        assert bool((mask[:, 1:] >= mask[:, :-1]).all())  # left-padded
        completions = out[:, prompt_len:].view(PROMPTS, NUM_GENERATIONS, -1)
        for group in completions:  # sampled: the completions of one prompt differ
            assert len({tuple(row.tolist()) for row in group}) > 1
        assert config.do_sample and config.max_new_tokens == MAX_NEW
    # (b) Training changed the weights (also those that the next generate read).
    changed = [name for name, p in model.named_parameters() if not torch.equal(before[name], p.detach())]
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "lm_head.weight" in changed
    handle.undo()
    assert "generate" not in vars(model)


def test_trl_default_bf16_on_a_float32_model_falls_back_to_hf_generate(example, tmp_path, monkeypatch):
    """bf16=True (TRL's default) makes accelerate wrap forward in a bf16 autocast: an fp32 model's K and V
    then come in mixed dtypes, which the rollout's cache does not hold, so generate is HF's (with a warning)."""
    model = build_model("tiny", seed=0)
    handle = torchkvops.patch_generate(model)
    calls = spy_on(model, handle, monkeypatch)
    trainer = grpo_trainer(example, model, tmp_path, steps=1, bf16=True)
    with pytest.warns(UserWarning, match="autocast to torch.bfloat16 with torch.float32 parameters"):
        trainer.train()
    assert calls["rollout"] == [] and calls["hf"] == [1] and len(calls["generate"]) == 1
    handle.undo()


def test_example_script_prints_the_step_split_of_both_settings(tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        HF_HUB_OFFLINE="1",
        TMPDIR=str(tmp_path),
    )
    command = [
        sys.executable,
        str(EXAMPLE),
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--num-generations",
        "2",
        "--prompt-length",
        "20",
        "--exact-prompt-length",
        "--max-completion-length",
        "4",
        "--beta",
        "0.04",
        "--num-iterations",
        "2",
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    columns = [f"{c} ms ({s})" for s in ("both", "neither") for c in ("generate", "logprob", "train", "step")]
    assert "| step | " + " | ".join(columns) + " |" in lines
    numbers = r"(\| \d+ ){8}\|"
    for label in ("1", "2", "median", "total"):
        assert any(re.fullmatch(rf"\| {label} {numbers}", line) for line in lines), label
    step_one = next(line for line in lines if line.startswith("| 1 |")).split("|")[2:-1]
    assert all(float(v) > 0 for v in step_one)  # step 1 generates and runs both logprob passes, in both settings
    assert any(line.startswith("speedup of both over neither (totals): generate ") for line in lines)
    # The policy's old-logprob and two loss passes, and the reference pass, were shared.
    assert "shared forward (both): 3 passes shared, 0 fell back" in result.stdout
    assert "shared forward (both): 1 passes shared, 0 fell back" in result.stdout
    assert "NOTE:" not in result.stdout  # nothing fell back to HF's generate or the plain forward
    # Every generate call of the patched setting was served by torchkvops, none of the plain one's.
    served = re.search(r"^generate \(both\): (\d+) of (\d+) calls served by torchkvops", result.stdout, re.M)
    assert served and served[1] == served[2] and int(served[1]) >= 1, result.stdout[-2000:]
    assert re.search(r"^generate \(neither\): \d+ calls, none served by torchkvops", result.stdout, re.M)


CHECKPOINTING = {
    "trl": {},  # TRL's default: on, non-reentrant
    "off": {"gradient_checkpointing": False},
    "reentrant": {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
}


def grpo_weights(
    example,
    checkpoint,
    output_dir,
    patch: str | None,
    checkpointing="trl",
    beta=0.04,
    iterations=2,
    micro_batch=None,
    **overrides,
):
    """Two GRPO steps (beta > 0: the reference pass runs; num_iterations = 2: the old-logprob pass runs;
    gradient checkpointing as `checkpointing` says) from the checkpoint, with patch_forward on the policy
    (before or after TRL patches its forward) and on the reference model, or without. Returns the final
    weights and the policy's and reference's patch stats."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    handles = []
    if patch == "before":
        handles.append(torchkvops.patch_forward(model, min_shared_tokens=4))
    split = {}
    if micro_batch is not None:  # micro-batches of the generation batch: TRL shuffles rows across them
        generation = PROMPTS * NUM_GENERATIONS
        split = dict(per_device_train_batch_size=micro_batch, steps_per_generation=generation // micro_batch)
    trainer = grpo_trainer(
        example,
        model,
        output_dir,
        steps=2,
        beta=beta,
        num_iterations=iterations,
        **CHECKPOINTING[checkpointing],
        **split,
        **overrides,
    )
    assert trainer.args.gradient_checkpointing == (checkpointing != "off")
    if patch == "after":
        handles.append(torchkvops.patch_forward(trainer.model, min_shared_tokens=4))
    if patch and trainer.ref_model is not None:
        handles.append(torchkvops.patch_forward(trainer.ref_model, min_shared_tokens=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainer.train()
    assert not [str(w.message) for w in caught if "torchkvops" in str(w.message)]
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}, [h.stats for h in handles]


def test_micro_batches_that_split_groups_end_with_the_same_weights(example, tmp_path):
    """per_device_train_batch_size below the generation batch: TRL scores the old-policy and reference
    passes in chunks of that size (whole groups here) and shuffles rows across the loss's micro-batches,
    so each micro-batch holds parts of groups, which share among their own rows; training still ends where
    the plain forward's does. SGD: Adam would turn the passes' rounding noise into updates of the
    learning rate's size wherever a gradient is near 0, and shuffled micro-batches leave many there."""
    checkpoint = str(tmp_path / "model")
    build_model("tiny", seed=0).save_pretrained(checkpoint)
    initial = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    runs = dict(micro_batch=NUM_GENERATIONS, optim="sgd", learning_rate=0.05)
    plain, _ = grpo_weights(example, checkpoint, tmp_path / "plain", None, **runs)
    shared, (policy, reference) = grpo_weights(example, checkpoint, tmp_path / "shared", "after", **runs)
    assert policy.fallback_calls == 0 and reference.fallback_calls == 0
    assert reference.group_sizes == {NUM_GENERATIONS: PROMPTS}  # chunks of whole groups
    # Every pass saw one micro-batch of NUM_GENERATIONS rows; the loss passes' shuffled ones split groups.
    assert sum(size * n for size, n in policy.group_sizes.items()) == policy.shared_calls * NUM_GENERATIONS
    assert min(policy.group_sizes) < NUM_GENERATIONS
    update = max((plain[name] - initial[name]).abs().max().item() for name in plain)
    assert update > 1e-4
    for name in plain:  # float rounding of the passes, no more
        torch.testing.assert_close(shared[name], plain[name], rtol=0, atol=1e-4 * update, msg=name)


@pytest.mark.parametrize(
    "when,checkpointing,beta,iterations",
    [
        ("before", "trl", 0.04, 2),
        ("after", "trl", 0.04, 2),
        ("after", "off", 0.0, 1),
        ("after", "reentrant", 0.04, 1),
    ],
)
def test_grpo_with_patch_forward_ends_with_the_same_weights(example, tmp_path, when, checkpointing, beta, iterations):
    """TRL's fused LM head calls the backbone, where the patch lives; the old-logprob, reference and loss
    passes are served by the shared path at full group size (every pass sees its 2 groups of 4 rows), and
    training ends where the plain forward's does, with gradient checkpointing off, non-reentrant (TRL's
    default) or reentrant, with and without the old-policy and reference passes."""
    checkpoint = str(tmp_path / "model")
    build_model("tiny", seed=0).save_pretrained(checkpoint)  # TRL loads its reference model from the path
    initial = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    runs = dict(checkpointing=checkpointing, beta=beta, iterations=iterations)
    plain, _ = grpo_weights(example, checkpoint, tmp_path / "plain", None, **runs)
    shared, stats = grpo_weights(example, checkpoint, tmp_path / when, when, **runs)
    policy = stats[0]
    # A generation batch every num_iterations steps, scored once by the old policy (num_iterations > 1)
    # and once by the reference model (beta > 0); a loss pass per step.
    generations = 2 // iterations
    passes = 2 + (iterations > 1) * generations
    assert (policy.shared_calls, policy.fallback_calls) == (passes, 0)
    assert policy.group_sizes == {NUM_GENERATIONS: PROMPTS * passes}
    if beta > 0:
        assert (stats[1].shared_calls, stats[1].fallback_calls) == (generations, 0)
        assert stats[1].group_sizes == {NUM_GENERATIONS: PROMPTS * generations}
    assert policy.computed_tokens < policy.row_tokens
    update = max((plain[name] - initial[name]).abs().max().item() for name in plain)
    assert update > 1e-4  # training moved the weights ...
    for name in plain:  # ... and both runs moved them alike (Adam turns rounding noise into at most this much)
        torch.testing.assert_close(shared[name], plain[name], rtol=0, atol=0.02 * update, msg=name)


def test_patch_forward_makes_trls_fused_head_score_only_the_kept_positions_on_the_cpu(monkeypatch):
    """On a CPU TRL's fused LM head projects every position (it keeps only the labelled ones where Triton
    runs); a patched model's calls project only the positions whose label is kept, with the same
    log-probabilities and entropies, and TRL's own device test is back in place after each call."""
    from trl.trainer import utils as trl_utils

    model = build_model("tiny", seed=0)
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (6, 20), generator=g)
    ids[3:, :12] = ids[0, :12]  # two groups of three rows that share 12 tokens
    ids[1:3, :12] = ids[0, :12]
    mask = torch.ones_like(ids)
    mask[3:, :2] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :12] = -100  # only the completions are scored, as in GRPO
    projected = []
    function = trl_utils._ChunkedLogProbFunction

    class Spy:
        @staticmethod
        def apply(hidden, *args):
            projected.append(hidden.shape[0])
            return function.apply(hidden, *args)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Spy)
    device_test = trl_utils._use_triton

    def scored():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)

    plain = scored()
    with torchkvops.patch_forward(model, min_shared_tokens=4) as handle:
        shared = scored()
    assert handle.stats.shared_calls == 1
    assert projected == [6 * 19, int((labels[:, 1:] != -100).sum())]  # every position, then the kept ones
    assert trl_utils._use_triton is device_test
    kept = labels[:, 1:] != -100
    torch.testing.assert_close(shared.log_probs[kept], plain.log_probs[kept], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared.entropy[kept], plain.entropy[kept], rtol=1e-5, atol=1e-5)
    assert not shared.log_probs[~kept].any() and not plain.log_probs[~kept].any()


def test_grpo_on_a_hybrid_model_with_both_patches_ends_with_the_generate_only_runs_weights(example, tmp_path):
    """A tiny Qwen3.5 (Gated DeltaNet layers before attention): two GRPO steps with patch_generate (the
    rollout samples, the same completions in both runs), the reference and old-policy passes on, and with
    patch_forward on the policy and the reference model or without: every pass shared, the same final
    weights."""
    from families import tiny_model, unavailable

    model = tiny_model("qwen3_5_text", vocab_size=512)
    if model is None:
        pytest.skip(unavailable("qwen3_5_text"))
    checkpoint = str(tmp_path / "model")
    model.save_pretrained(checkpoint)
    initial = model.state_dict()
    weights, stats = {}, {}
    for run in ("generate only", "both"):
        policy = AutoModelForCausalLM.from_pretrained(checkpoint)
        handles = [torchkvops.patch_generate(policy)]
        trainer = grpo_trainer(example, policy, tmp_path / run.replace(" ", "_"), steps=2, beta=0.04, num_iterations=2)
        if run == "both":
            handles += [torchkvops.patch_forward(m, min_shared_tokens=4) for m in (trainer.model, trainer.ref_model)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            trainer.train()
        assert not [str(w.message) for w in caught if "torchkvops" in str(w.message)]
        weights[run] = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        stats[run] = [h.stats for h in handles[1:]]
    policy_stats, reference_stats = stats["both"]
    assert (policy_stats.shared_calls, policy_stats.fallback_calls) == (3, 0)  # old-logprob pass + 2 loss passes
    assert (reference_stats.shared_calls, reference_stats.fallback_calls) == (1, 0)
    plain, shared = weights["generate only"], weights["both"]
    update = max((plain[name] - initial[name]).abs().max().item() for name in plain)
    assert update > 1e-4
    for name in plain:
        torch.testing.assert_close(shared[name], plain[name], rtol=0, atol=0.02 * update, msg=name)
