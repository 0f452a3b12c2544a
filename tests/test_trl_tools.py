"""TRL's GRPOTrainer with `tools=[multiply]` (its tool loop, no vLLM) and both torchkvops patches: every
generate call TRL makes is served by torchkvops, each tool turn (TRL calling generate again on prompt +
completion + the tool's answer) from the KV the call before kept, prefilling only what the turn appends;
the loss pass over the multi-turn rows is shared by patch_forward; and TRL ends up with the same tokens,
tool mask and log-probabilities as without the patches. Also: examples/grpo_trl_tools.py runs end to end.

The model is examples/grpo_trl_tools.py's: a tiny random Llama whose embeddings and LM head make it call
multiply(3, 4) at every turn with a logit margin so large that sampling at temperature 1 is deterministic,
so that the patched run (torchkvops' sampler) and the plain one (HF's) must produce the same tokens."""

import importlib.util
import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from timeouts import TIMEOUT

pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402
from trl.chat_template_utils import add_response_schema, parse_response  # noqa: E402

import torchkvops  # noqa: E402
from torchkvops import RolloutConfig  # noqa: E402
from torchkvops.rollout.prompts import common_prefix_length  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_trl_tools.py"
PROMPTS, NUM_GENERATIONS, ITERATIONS, MAX_COMPLETION = 2, 4, 2, 160
ROWS = PROMPTS * NUM_GENERATIONS
CALL_TEXT = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
# What TRL appends after a call (its _get_tool_suffix_ids, from Qwen3's training template): the tool's answer
# as a user turn, then the generation prompt.
ANSWER_TEXT = "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
MULTIPLY_CALL = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}


# (conftest.one_thread: one OpenMP thread for the GRPO steps' hundreds of small ops)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def example():
    """examples/grpo_trl_tools.py as a module: its tokenizer, model, dataset, reward and config."""
    spec = importlib.util.spec_from_file_location("grpo_trl_tools_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def counting_multiply(calls: list):
    """The example's tool, recording each call's arguments."""

    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        calls.append((a, b))
        return a * b

    return multiply


def test_the_tokenizer_and_model_make_a_tool_call(example):
    """The premises of the runs below: the call's tokens are distinct and decode to exactly the text TRL
    parses as multiply(3, 4); the generation prompt ends with the chain's first token; the model follows the
    chain with a margin that no sampling at temperature 1 crosses (exp(-100) is 0 in float32)."""
    tokenizer = example.build_tokenizer()
    chain = example.chain_ids(tokenizer)
    assert len(set(chain)) == 5 and tokenizer.unk_token_id not in chain
    assert tokenizer.decode(chain[1:]) == CALL_TEXT
    messages = [{"role": "user", "content": "What is 3 times 4?"}]
    prompt = tokenizer.apply_chat_template(
        messages, tools=[example.multiply], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    text = tokenizer.apply_chat_template(messages, tools=[example.multiply], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(prompt) == text and '"name": "multiply"' in text  # bytes: the prompt round-trips
    assert prompt[-1] == chain[0]
    add_response_schema(tokenizer)
    parsed = parse_response(tokenizer, chain[1:], prefix=prompt, tools=[example.multiply])
    assert parsed["tool_calls"] == [MULTIPLY_CALL]
    model = example.build_model(tokenizer)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + chain[1:]])).logits[0, len(prompt) - 1 : -1]
    top = logits.topk(2, dim=-1)
    assert top.indices[:, 0].tolist() == chain[1:]
    assert float((top.values[:, 0] - top.values[:, 1]).min()) > 100


def grpo_run(example, output_dir, steps: int, patched: bool) -> dict:
    """A GRPO run of `steps` steps with tools=[multiply] (2 prompts x 4 completions, 2 tool turns), with
    patch_generate and patch_forward or without. Records every model.generate call (inputs, output and, when
    patched, handle.last_profile() right after it), the calls that reached HF's own generate, the tool's
    calls, what TRL's _generate returned, the loss pass's log-probabilities and torchkvops' warnings."""
    tokenizer = example.build_tokenizer()
    model = example.build_model(tokenizer)
    run = {"generate": [], "hf": [], "tool": [], "generated": [], "logps": []}
    handle = forward = None
    if patched:
        handle = torchkvops.patch_generate(model)
        forward = torchkvops.patch_forward(model)
        original_hf = handle.session.original_generate
        handle.session.original_generate = lambda *a, **k: run["hf"].append(1) or original_hf(*a, **k)
    generate = model.generate

    def generate_spy(*args, **kwargs):
        out = generate(*args, **kwargs)
        profile = handle.last_profile() if patched else None
        run["generate"].append((kwargs["input_ids"].clone(), kwargs["attention_mask"].clone(), out.clone(), profile))
        return out

    model.generate = generate_spy
    settings = types.SimpleNamespace(
        seed=0,
        steps=steps,
        batch_size=ROWS,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION,
        max_tool_calling_iterations=ITERATIONS,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=example.tool_answered_12,
        args=example.grpo_config(settings, str(output_dir)),
        train_dataset=example.build_dataset(8),
        processing_class=tokenizer,
        tools=[counting_multiply(run["tool"])],
    )
    trainer_generate, logps = trainer._generate, trainer._get_per_token_logps_and_entropies

    def generate_record(prompts):
        out = trainer_generate(prompts)
        prompt_ids, completion_ids, tool_mask, completions = out[:4]
        run["generated"].append((prompt_ids, completion_ids, tool_mask, completions))
        return out

    def logps_record(model, input_ids, *args, **kwargs):
        out = logps(model, input_ids, *args, **kwargs)
        if torch.is_grad_enabled():  # the loss pass: its rows, their log-probabilities and entropies
            run["logps"].append((input_ids.clone(), *(None if t is None else t.detach().clone() for t in out[:2])))
        return out

    trainer._generate, trainer._get_per_token_logps_and_entropies = generate_record, logps_record
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainer.train()
    run["warnings"] = [str(w.message) for w in caught if "torchkvops" in str(w.message)]
    run["tokenizer"], run["forward_stats"] = tokenizer, None if forward is None else forward.stats
    return run


def sorted_rows(loss_pass: tuple) -> tuple:
    """(input_ids, logps, entropies) of a loss pass with its rows in the order of their token ids."""
    ids = loss_pass[0]
    order = sorted(range(ids.shape[0]), key=lambda r: ids[r].tolist())
    return tuple(t[order] for t in loss_pass)


def real_tokens(ids, mask) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def kept_rows(ids, mask, out, eos: int) -> list[list[int]]:
    """What a served call keeps for the next (generate_reuse.KeptCall): each row's prompt without padding,
    then its completion through its first EOS."""
    rows = []
    for prompt, completion in zip(real_tokens(ids, mask), out[:, ids.shape[1] :].tolist()):
        rows.append(prompt + completion[: completion.index(eos) + 1])
    return rows


def check_served_calls(run, steps: int):
    """Every generate call of every step was served by torchkvops: the step's first call prefilled each
    prompt once; each tool turn's rows extend the call before's rows, and the turn reused all their KV
    (each row's tokens but its last) and prefilled only its appended tokens."""
    eos = run["tokenizer"].eos_token_id
    assert run["warnings"] == [] and run["hf"] == []
    calls = run["generate"]
    assert len(calls) == steps * (1 + ITERATIONS)
    assert all(profile is not None for *_, profile in calls)  # each call served (None: it fell back)
    for step in range(steps):
        ids, mask, out, profile = calls[step * (1 + ITERATIONS)]
        assert ids.shape[0] == ROWS and profile.reused_tokens == 0
        # Each prompt once, not once per row; the chat template's common beginning (its system part) once.
        unique, unique_mask = ids[:: ROWS // PROMPTS], mask[:: ROWS // PROMPTS]
        common = common_prefix_length(unique, unique_mask, RolloutConfig().min_shared_tokens)
        assert profile.prefill_tokens == common + int(unique_mask.sum()) - PROMPTS * common
        for turn in range(1, 1 + ITERATIONS):
            kept = kept_rows(ids, mask, out, eos)
            ids, mask, out, profile = calls[step * (1 + ITERATIONS) + turn]
            rows = real_tokens(ids, mask)
            assert len(rows) == ROWS and all(row[: len(k)] == k for row, k in zip(rows, kept))
            appended = [len(row) - len(k) for row, k in zip(rows, kept)]
            assert min(appended) > 0
            assert profile.reused_tokens == sum(len(k) - 1 for k in kept)
            assert profile.prefill_tokens == sum(a + 1 for a in appended)  # each row's last + appended, packed
            assert profile.prefill_tokens < 0.1 * int(mask.sum())


def test_tool_turns_are_served_from_the_kept_kv_and_match_the_plain_run(example, tmp_path):
    patched = grpo_run(example, tmp_path / "patched", steps=1, patched=True)
    check_served_calls(patched, steps=1)
    # The tool ran for every row at each of the 2 turns, and each row's completion is three calls with
    # the tool's answer between them, the answers masked out of the loss.
    assert patched["tool"] == [(3, 4)] * ROWS * ITERATIONS
    tokenizer = patched["tokenizer"]
    call = tokenizer.encode(CALL_TEXT, add_special_tokens=False)
    answer = tokenizer.encode(ANSWER_TEXT, add_special_tokens=False)
    [(prompt_ids, completion_ids, tool_mask, completions)] = patched["generated"]
    for ids, mask, messages in zip(completion_ids, tool_mask, completions):
        assert ids == call + answer + call + answer + call
        assert mask == [1] * len(call) + [0] * len(answer) + [1] * len(call) + [0] * len(answer) + [1] * len(call)
        assert [m["role"] for m in messages] == ["assistant", "tool"] * ITERATIONS + ["assistant"]
        assert all(m["tool_calls"] == [MULTIPLY_CALL] for m in messages if m["role"] == "assistant")
        assert all(m["content"] == "12" for m in messages if m["role"] == "tool")
    # patch_forward shared the loss pass over the multi-turn rows (4 equal rows per prompt).
    stats = patched["forward_stats"]
    assert (stats.shared_calls, stats.fallback_calls) == (1, 0)
    assert stats.computed_tokens < stats.row_tokens / 2

    # Without the patches (HF's generate and the plain forward): the same calls, outputs and tokens, and
    # the loss pass's log-probabilities and entropies alike.
    plain = grpo_run(example, tmp_path / "plain", steps=1, patched=False)
    assert plain["tool"] == patched["tool"]
    assert len(plain["generate"]) == len(patched["generate"])
    for (ids, mask, out, _), (plain_ids, plain_mask, plain_out, _) in zip(patched["generate"], plain["generate"]):
        assert torch.equal(ids, plain_ids) and torch.equal(mask, plain_mask) and torch.equal(out, plain_out)
    [plain_generated] = plain["generated"]
    assert plain_generated[:3] == (prompt_ids, completion_ids, tool_mask)
    # TRL shuffles the batch after generation with torch's global generator, which HF's sampling and
    # torchkvops' draw from differently: the loss pass's rows are compared in the order of their tokens.
    [patched_pass], [plain_pass] = patched["logps"], plain["logps"]
    (ids, logps, entropies), (plain_ids, plain_logps, plain_entropies) = map(sorted_rows, (patched_pass, plain_pass))
    assert torch.equal(ids, plain_ids)
    assert float(logps.abs().max()) > 0.1  # not all ~0: the tool's answers' tokens are no sure bet
    torch.testing.assert_close(logps, plain_logps, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropies, plain_entropies, rtol=0, atol=1e-5)


def test_a_second_step_prefills_its_prompts_anew_and_reuses_in_its_tool_turns(example, tmp_path):
    """After an optimizer step the kept KV is stale (and step 2's prompts extend no kept row): step 2's
    first call is a fresh prefill on the rollout that step 1's turns extended, and its own turns reuse again."""
    run = grpo_run(example, tmp_path, steps=2, patched=True)
    check_served_calls(run, steps=2)
    assert run["tool"] == [(3, 4)] * ROWS * ITERATIONS * 2
    assert (run["forward_stats"].shared_calls, run["forward_stats"].fallback_calls) == (2, 0)


def test_example_script_prints_each_turns_prefill_and_reuse(tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        HF_HUB_OFFLINE="1",
        TMPDIR=str(tmp_path),
    )
    command = [sys.executable, str(EXAMPLE), "--steps", "1"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "| step | turn | rows | row tokens | prefill tokens | reused tokens | generate ms |" in lines
    rows = [line.split("|")[1:-1] for line in lines if re.fullmatch(r"\| 1 \| \d \|( \d+ \|){5}", line)]
    assert [int(r[1]) for r in rows] == [0, 1, 2]  # the step's first call and its two tool turns
    for _, turn, count, tokens, prefill, reused, _ in (map(int, r) for r in rows):
        assert count == 8
        if turn == 0:
            assert reused == 0 and prefill < tokens  # each prompt prefilled once for its 4 rows
        else:
            assert reused > 0 and prefill < 0.1 * tokens
    assert "tool calls per completion, per step: 2" in lines
    assert "shared forward: 1 passes shared, 0 fell back" in result.stdout
    assert "NOTE:" not in result.stdout  # nothing fell back to HF's generate or the plain forward
    assert sorted(os.listdir(tmp_path)) == ["out"]  # TRL's output_dir is under out/
