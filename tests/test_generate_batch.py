"""A patched model's `generate_batch` (transformers' continuous batching, what TRL's GRPO and RLOO call with
use_transformers_continuous_batching=True) is served by the rollout: greedy results equal transformers'
own generate_batch (requests, order, prompts, tokens through EOS), each distinct prompt prefilled once,
children of num_return_sequences named and ordered as transformers names and orders them, a configured
seed honoured, what changes results (timestamps, log-probabilities, unknown arguments) sent to
transformers' own with a warning, and undo() puts generate_batch back."""

import warnings

import pytest
from models import FAMILIES, prompts
from test_generate import spy_prefills
from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig

import torchkvops


@pytest.fixture(scope="module")
def model():
    return FAMILIES["llama"]()


def lists(count=3, length=9, seed=4, repeats=1):
    """Prompts of different lengths as token-id lists, each repeated `repeats` times in adjacent rows (TRL)."""
    ids, mask = prompts(count, length, seed=seed, left_pad=[0, 2, 5][:count])
    rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    return [row for row in rows for _ in range(repeats)]


def greedy_config(**kwargs):
    return GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=[5, 7, 11], pad_token_id=0, **kwargs)


def outputs(result):
    return [(key, out.prompt_ids, out.generated_tokens) for key, out in result.items()]


def test_greedy_generate_batch_equals_transformers_own_with_each_prompt_prefilled_once(model, monkeypatch):
    inputs = lists(repeats=2)
    expected = model.generate_batch(inputs, generation_config=greedy_config(), progress_bar=False)
    assert any(len(out.generated_tokens) < 10 for out in expected.values())  # some end at an EOS id
    seen = spy_prefills(monkeypatch)
    with torchkvops.patch_generate(model):
        got = model.generate_batch(inputs, generation_config=greedy_config(), progress_bar=False)
    assert outputs(got) == outputs(expected)
    assert seen == [3]  # 3 distinct prompts of 6 rows
    assert "generate_batch" not in vars(model)  # undone: transformers' own again


def test_children_are_named_and_ordered_as_transformers_does_and_a_seed_is_honoured(model, monkeypatch):
    inputs = lists(count=2)

    def config():  # (a fresh one per call: transformers' generate_batch writes into the one it is given)
        return GenerationConfig(
            max_new_tokens=6, do_sample=True, num_return_sequences=3, eos_token_id=[], pad_token_id=0
        )

    expected_keys = list(model.generate_batch(inputs, generation_config=config(), progress_bar=False))
    seeded = ContinuousBatchingConfig(seed=3)
    seen = spy_prefills(monkeypatch)
    with torchkvops.patch_generate(model):
        got = model.generate_batch(inputs, generation_config=config(), continuous_batching_config=seeded)
        again = model.generate_batch(inputs, generation_config=config(), continuous_batching_config=seeded)
    assert seen == [2, 2]  # served
    assert list(got) == expected_keys  # what this transformers answers num_return_sequences with
    if len(expected_keys) > 2:  # a transformers that forks children (5.25; 5.17 returns one sequence per request)
        children = ["req_0__child#0", "req_0__child#1", "req_0", "req_1__child#0", "req_1__child#1", "req_1"]
        assert expected_keys == children
    assert outputs(got) == outputs(again)  # the configured seed: the same samples
    assert len({tuple(out.generated_tokens) for out in got.values()}) == len(got)  # the samples differ
    assert all(len(out.generated_tokens) == 6 for out in got.values())


@pytest.mark.parametrize(
    "arguments,cause",
    [
        (dict(record_timestamps=True), "record_timestamps=True"),
        (dict(continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True)), "return_logprobs=True"),
        (dict(max_queue_size=4), "argument 'max_queue_size'"),
    ],
)
def test_what_changes_results_goes_to_transformers_own_with_a_warning(model, monkeypatch, arguments, cause):
    calls = []
    monkeypatch.setattr(type(model), "generate_batch", lambda self, inputs, **kw: calls.append((inputs, kw)) or "own")
    seen = spy_prefills(monkeypatch)
    inputs = lists(count=2)
    with torchkvops.patch_generate(model), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model.generate_batch(inputs, generation_config=greedy_config(), **arguments)
    assert got == "own" and seen == [] and calls == [(inputs, dict(generation_config=greedy_config(), **arguments))]
    assert any(cause in str(w.message) and "generate_batch" in str(w.message) for w in caught), [
        str(w.message) for w in caught
    ]


def test_a_deep_copy_serves_generate_batch_too(model, monkeypatch):
    import copy

    inputs = lists(count=2, repeats=2)
    with torchkvops.patch_generate(model):
        expected = model.generate_batch(inputs, generation_config=greedy_config())
        twin = copy.deepcopy(model)
    seen = spy_prefills(monkeypatch)
    assert outputs(twin.generate_batch(inputs, generation_config=greedy_config())) == outputs(expected)
    assert seen == [2]
    torchkvops.GeneratePatch.of(twin).undo()
    assert "generate_batch" not in vars(twin) and "generate" not in vars(twin)
