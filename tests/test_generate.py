"""torchkvops.generate / patch_generate against Hugging Face's own generate (the oracle): greedy tokens
row by row, the generation-config precedence, EOS and pad filling, the fallback, and fresh weights."""

import warnings

import conftest
import pytest
import torch
from models import FAMILIES, prompts
from transformers import GenerationConfig

import torchkvops


def batch_with_runs(seed=0):
    """Left-padded rows: a run of 3 copies of prompt A, a singleton B, 2 copies of C, then A again (equal to
    the first run but not adjacent: one prompt with it, as Online DPO's `repeat(2, 1)` batches need)."""
    ids, mask = prompts(3, 9, seed=seed, left_pad=[0, 3, 5])
    order = [0, 0, 0, 1, 2, 2, 0]
    return ids[order], mask[order]


def hf(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **kwargs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_hf_generate_on_runs_singletons_and_repeats(family_models, family):
    model = family_models[family]
    ids, mask = batch_with_runs(seed=1)
    kwargs = dict(max_new_tokens=7, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = torchkvops.generate(model, ids, attention_mask=mask, **kwargs)
    expected = hf(model, ids, mask, **kwargs)
    assert out.shape == expected.shape
    for row in range(ids.shape[0]):
        assert torch.equal(out[row], expected[row]), (family, row)


def test_each_run_is_prefilled_once(llama, monkeypatch):
    """The rollout sees one prompt per distinct row, wherever its copies sit: here 3 (A, B, C), A's 4 rows
    (3 adjacent, 1 after C) the widest."""
    seen = []
    original = torchkvops.Rollout.generate_rows

    def spy(self, input_ids, *args, **kwargs):
        seen.append((input_ids.shape[0], self.config.samples_per_prompt))
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(torchkvops.Rollout, "generate_rows", spy)
    ids, mask = batch_with_runs()
    torchkvops.generate(llama, ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert seen == [(3, 4)]  # 3 prompts, padded to the widest (A: 4 rows)


def test_eos_and_pad_filling_and_early_stop_equal_hf(llama):
    ids, mask = batch_with_runs(seed=2)
    free = hf(llama, ids, mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[:, 9:]
    eos = [int(free[0, 2]), int(free[3, 4])]  # rows 0-2 end at step <= 2, row 3 at step <= 4
    for kwargs in (
        dict(eos_token_id=eos, pad_token_id=5),
        dict(eos_token_id=eos[0], pad_token_id=0),
        dict(eos_token_id=[int(t) for t in free[:, 1].unique()], pad_token_id=7),
    ):  # all rows end at 1
        expected = hf(llama, ids, mask, max_new_tokens=12, do_sample=False, **kwargs)
        out = torchkvops.generate(llama, ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **kwargs)
        assert torch.equal(out, expected), kwargs


def test_min_new_tokens_forbids_eos_like_hf(llama):
    ids, mask = batch_with_runs(seed=3)
    first = hf(llama, ids, mask, max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)[:, -1]
    kwargs = dict(max_new_tokens=8, min_new_tokens=4, do_sample=False, eos_token_id=int(first[0]), pad_token_id=0)
    expected = hf(llama, ids, mask, **kwargs)
    assert torch.equal(torchkvops.generate(llama, ids, attention_mask=mask, **kwargs), expected)


def test_generation_config_precedence(llama):
    """kwargs over generation_config over the model's generation_config, as HF resolves them."""
    ids, mask = prompts(2, 6, seed=4)
    saved = llama.generation_config
    llama.generation_config = GenerationConfig(max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        for config, kwargs, length in [
            (None, {}, 9),
            (GenerationConfig(max_new_tokens=5), {}, 5),
            (GenerationConfig(max_new_tokens=5), dict(max_new_tokens=3), 3),
            (None, dict(max_length=10), 9),
        ]:  # max_new_tokens (model) wins over max_length
            out = torchkvops.generate(llama, ids, attention_mask=mask, generation_config=config, **kwargs)
            expected = hf(llama, ids, mask, generation_config=config, **kwargs)
            assert out.shape == (2, 6 + length) and torch.equal(out, expected)
    finally:
        llama.generation_config = saved


def test_return_dict_in_generate(llama):
    ids, mask = prompts(2, 6, seed=5)
    out = torchkvops.generate(
        llama, ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True
    )
    expected = hf(llama, ids, mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected.sequences)


def test_sampling_honours_num_return_sequences_and_is_seeded_by_torch(llama):
    ids, mask = prompts(2, 6, seed=6)
    kwargs = dict(
        max_new_tokens=6,
        do_sample=True,
        temperature=1.3,
        top_k=20,
        top_p=0.95,
        num_return_sequences=3,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(11)
    a = torchkvops.generate(llama, ids, attention_mask=mask, **kwargs)
    torch.manual_seed(11)
    b = torchkvops.generate(llama, ids, attention_mask=mask, **kwargs)
    c = torchkvops.generate(llama, ids, attention_mask=mask, **kwargs)  # the generator moved on
    assert a.shape == (6, 12) and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, :6], ids.repeat_interleave(3, dim=0))
    assert len({tuple(r.tolist()) for r in a[:3, 6:]}) > 1  # the 3 samples of a prompt differ


def spy_prefills(monkeypatch) -> list:
    """The prompts (rows of input_ids) of each rollout the calls after it prefill, in order."""
    seen = []
    original = torchkvops.Rollout.generate_rows

    def spy(self, input_ids, *args, **kwargs):
        seen.append(input_ids.shape[0])
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(torchkvops.Rollout, "generate_rows", spy)
    return seen


def test_a_sampled_row_is_keyed_by_its_output_row_whether_its_copies_are_adjacent_or_not(llama, monkeypatch):
    """[A, A, B, B] and Online DPO's [A, B, A, B] (`repeat(2, 1)`): two prompts each, and the rows both
    batches hold at the same place (0: A, 3: B) draw the same tokens with the same seed."""
    seen = spy_prefills(monkeypatch)
    ids, mask = prompts(2, 6, seed=8, left_pad=[0, 2])
    kwargs = dict(max_new_tokens=8, do_sample=True, temperature=1.0, eos_token_id=None, pad_token_id=0)
    out = {}
    for name, order in (("adjacent", [0, 0, 1, 1]), ("repeated", [0, 1, 0, 1])):
        torch.manual_seed(3)
        out[name] = torchkvops.generate(llama, ids[order], attention_mask=mask[order], **kwargs)
    assert seen == [2, 2]
    for row in (0, 3):
        assert torch.equal(out["adjacent"][row], out["repeated"][row]), row
    assert not torch.equal(out["repeated"][0, 6:], out["repeated"][2, 6:])  # A's two rows: two samples


@pytest.mark.parametrize(
    "kwargs,cause",
    [
        (dict(repetition_penalty=1.3), "generation_config.repetition_penalty=1.3"),
        (dict(num_beams=2), "generation_config.num_beams=2"),
        (dict(output_scores=True, return_dict_in_generate=True), "generation_config.output_scores=True"),
        (dict(logits_processor="LP"), "the argument 'logits_processor'"),
    ],
    ids=["repetition_penalty", "beams", "output_scores", "logits_processor"],
)
def test_unsupported_settings_fall_back_to_hf_with_a_warning_naming_them(llama, kwargs, cause):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    if kwargs.get("logits_processor") == "LP":
        kwargs = dict(logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]))
    ids, mask = prompts(2, 6, seed=7)
    base = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    with patched(llama) as handle:
        with pytest.warns(
            UserWarning,
            match=f"torchkvops.generate: {cause!s}".replace("(", r"\(").replace(")", r"\)").replace("[", r"\["),
        ):
            out = llama.generate(ids, attention_mask=mask, **base, **kwargs)
        expected = handle.session.original_generate(ids, attention_mask=mask, **base, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second time: no warning
            llama.generate(ids, attention_mask=mask, **base, **kwargs)
    got = out.sequences if hasattr(out, "sequences") else out
    want = expected.sequences if hasattr(expected, "sequences") else expected
    assert torch.equal(got, want)


def patched(model, **options):
    return torchkvops.patch_generate(model, **options)


def test_patch_swaps_undoes_and_is_a_context_manager(llama):
    original = llama.generate
    ids, mask = batch_with_runs(seed=8)
    kwargs = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = hf(llama, ids, mask, **kwargs)
    handle = torchkvops.patch_generate(llama)
    assert llama.generate is not original and "generate" in vars(llama)
    calls = []
    spy = torchkvops.Rollout.generate_rows
    try:
        torchkvops.Rollout.generate_rows = lambda self, *a, **k: calls.append(1) or spy(self, *a, **k)
        assert torch.equal(llama.generate(input_ids=ids, attention_mask=mask, **kwargs), expected)
        assert calls  # it went through the rollout
    finally:
        torchkvops.Rollout.generate_rows = spy
    handle.undo()
    assert "generate" not in vars(llama) and llama.generate == original
    with torchkvops.patch_generate(llama, kv_sharing="prefix") as handle:
        assert torch.equal(llama.generate(ids, attention_mask=mask, **kwargs), expected)
        assert handle.session.rollouts  # state kept between calls ...
        handle.release()
        assert not handle.session.rollouts  # ... until released
    assert "generate" not in vars(llama)


@pytest.mark.parametrize(
    "options,error,match",
    [
        (dict(temperature=1.0), TypeError, "unknown option 'temperature'"),
        (dict(kv_sharing="blocks"), ValueError, "RolloutConfig.kv_sharing"),
        (dict(compile="yes"), ValueError, "RolloutConfig.compile must be a bool"),
    ],
)
def test_patch_options_are_validated(llama, options, error, match):
    with pytest.raises(error, match=match):
        torchkvops.patch_generate(llama, **options)
    assert "generate" not in vars(llama)


def train_step(model):
    """One SGD step with a large learning rate, so that greedy tokens change."""
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    ids, _ = prompts(4, 10, seed=9)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_weights_updated_in_place_are_read_by_the_next_generate(compile):
    model = FAMILIES["llama"]()
    ids, mask = batch_with_runs(seed=10)
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torchkvops.patch_generate(model, compile=compile) as handle:
        before = model.generate(ids, attention_mask=mask, **kwargs)
        assert torch.equal(before, handle.session.original_generate(ids, attention_mask=mask, **kwargs))
        train_step(model)
        after = model.generate(ids, attention_mask=mask, **kwargs)
        expected = handle.session.original_generate(ids, attention_mask=mask, **kwargs)
        assert all(conftest.compiled(r) == compile for r in handle.session.rollouts.values())
    assert not torch.equal(before, expected)  # the step changed the greedy tokens ...
    assert torch.equal(after, expected)  # ... and generate saw it


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_replaced_parameters_are_read_by_the_next_generate(compile):
    """A parameter replaced by a new tensor (as FSDP / ZeRO-3 gathers do, or load_state_dict(assign=True))."""
    model = FAMILIES["llama"]()
    donor = FAMILIES["llama"]()
    with torch.no_grad():
        for p in donor.parameters():
            p.mul_(-1.0)
    ids, mask = batch_with_runs(seed=11)
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torchkvops.patch_generate(model, compile=compile) as handle:
        before = model.generate(ids, attention_mask=mask, **kwargs)
        model.load_state_dict({k: v.clone() for k, v in donor.state_dict().items()}, assign=True)
        after = model.generate(ids, attention_mask=mask, **kwargs)
        expected = handle.session.original_generate(ids, attention_mask=mask, **kwargs)
    assert not torch.equal(before, expected) and torch.equal(after, expected)


def test_runs_under_inference_mode_and_in_train_mode(llama):
    ids, mask = batch_with_runs(seed=12)
    kwargs = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = hf(llama, ids, mask, **kwargs)
    with torch.inference_mode():
        assert torch.equal(torchkvops.generate(llama, ids, attention_mask=mask, **kwargs), expected)
    llama.train()  # as in a trainer's step; these models have no dropout
    try:
        assert torch.equal(torchkvops.generate(llama, ids, attention_mask=mask, **kwargs), expected)
    finally:
        llama.eval()


@pytest.mark.parametrize("family", ["opt", "gpt2"])
def test_train_mode_with_attention_dropout_falls_back_until_it_is_disabled(family):
    """In train mode HF's attention applies its dropout, which the rollout's decode attention does not:
    such calls go to HF's generate. Once the dropout is 0 (as TRL's disable_dropout sets every
    nn.Dropout), the rollout runs them."""
    from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    if family == "opt":
        model = OPTForCausalLM(
            OPTConfig(
                vocab_size=96,
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                word_embed_proj_dim=32,
                attention_dropout=0.1,
                dropout=0.0,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            )
        )
    else:
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=96,
                n_embd=32,
                n_layer=1,
                n_head=2,
                attn_pdrop=0.1,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            )
        )
    model.train()
    ids = prompts(1, 5)[0]
    with pytest.warns(UserWarning, match="train mode with attention dropout"):
        torchkvops.generate(model, ids, max_new_tokens=2, do_sample=False)
    for module in model.modules():  # as TRL's disable_dropout, plus the float Llama/OPT layers pass
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        elif hasattr(module, "q_proj") and isinstance(getattr(module, "dropout", None), float):
            module.dropout = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = torchkvops.generate(model, ids, max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(
        out, hf(model, ids, torch.ones_like(ids), max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    )


def test_greedy_with_num_return_sequences_is_hf_error(llama):
    ids, mask = prompts(1, 5)
    with pytest.raises(ValueError):
        hf(llama, ids, mask, max_new_tokens=2, do_sample=False, num_return_sequences=2)
    with pytest.raises(ValueError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchkvops.generate(llama, ids, attention_mask=mask, max_new_tokens=2, do_sample=False, num_return_sequences=2)


def test_autocast_to_another_dtype_than_the_weights_falls_back(llama, monkeypatch):
    """Under a bf16 autocast, an fp32 model's K come out fp32 (RoPE's fp32 cos/sin) and its V bf16: the
    rollout's cache holds one dtype, so the call goes to HF's generate (a Trainer with bf16=True wraps
    forward in such an autocast). Weights already in the autocast dtype run through the rollout."""
    calls = []
    original = torchkvops.Rollout.generate_rows
    monkeypatch.setattr(
        torchkvops.Rollout, "generate_rows", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    ids, mask = batch_with_runs(seed=13)
    kwargs = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(UserWarning, match=r"autocast to torch.bfloat16 with torch.float32 parameters"):
            out = torchkvops.generate(llama, ids, attention_mask=mask, **kwargs)
        expected = hf(llama, ids, mask, **kwargs)
    assert torch.equal(out, expected) and not calls
    half = FAMILIES["llama"]().to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("error")
        out = torchkvops.generate(half, ids, attention_mask=mask, **kwargs)
    assert calls and out.shape == (ids.shape[0], ids.shape[1] + 4)


@pytest.mark.parametrize(
    "ids, mask, error, match",
    [
        (torch.empty(0, 5, dtype=torch.long), None, ValueError, r"input_ids is empty \(shape \(0, 5\)\)"),
        (torch.ones(2, 5), None, TypeError, "input_ids must hold token ids as int64 or int32"),
        # (HF's generate raises for these too, from the embedding: "Expected tensor for argument #1 'indices'")
        (torch.ones(2, 5, dtype=torch.int16), None, TypeError, "input_ids must hold token ids as int64 or int32"),
        (torch.ones(2, 5, dtype=torch.uint8), None, TypeError, "input_ids must hold token ids as int64 or int32"),
        (torch.ones(2, 5, dtype=torch.long, device="meta"), None, ValueError, "input_ids is on the meta device"),
        (
            torch.ones(2, 5, dtype=torch.long),
            torch.ones(2, 5, dtype=torch.long, device="meta"),
            ValueError,
            "attention_mask is on the meta device",
        ),
        (torch.full((2, 5), 10_000), None, ValueError, r"input_ids must be token ids in \[0, "),
        (
            torch.ones(2, 5, dtype=torch.long),
            torch.ones(2, 4, dtype=torch.long),
            ValueError,
            r"attention_mask must have input_ids' shape \(2, 5\), got \(2, 4\)",
        ),
    ],
)  # (a right-padded mask is not an error: HF's generate takes it, see test_generate_contract.py)
def test_bad_inputs_are_named_for_generate_with_the_callers_shapes(llama, ids, mask, error, match):
    """Checked before the rows are grouped, so the message names generate and the shapes the caller
    passed (not the grouped prompts' shapes, nor a RolloutConfig field)."""
    with pytest.raises(error, match=r"^torchkvops\.generate: " + match):
        torchkvops.generate(llama, ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_a_patch_that_fails_midway_leaves_generate_as_it_was(family_models, monkeypatch):
    """Any error while patching: the original generate stays (calls give HF's tokens), ours is raised."""
    from torchkvops.hf import generate_patch

    model = family_models["llama"]
    ids, mask = prompts(2, 6)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)

    def broken(self, *args, **kwargs):
        raise KeyError("boom")

    before = {name: vars(model).get(name) for name in ("generate", generate_patch._SESSION_ATTRIBUTE)}
    monkeypatch.setattr(generate_patch._Session, "check_model", broken)
    with pytest.raises(RuntimeError, match=r"patching failed \(KeyError: 'boom'\); the model's generate is left"):
        torchkvops.patch_generate(model)
    assert all(vars(model).get(name) is value for name, value in before.items())
    assert "generate" not in vars(model)  # (no patch was active: the class's generate)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


def test_whatever_reading_a_model_raises_is_a_refusal_not_a_broken_generate(family_models, monkeypatch):
    """An error of any type while the rollout reads the model (transformers' heterogeneous configs raise a
    RuntimeError on a global per-layer attribute): patch_generate patches, warns once naming it, and every
    call gives HF's tokens."""
    from torchkvops.hf import generate_patch

    model = family_models["llama"]
    ids, mask = prompts(2, 6)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)

    def unreadable(model):
        raise RuntimeError("'head_dim' is a per-layer attribute")

    monkeypatch.setattr(generate_patch, "ModelAdapter", unreadable)
    with pytest.warns(UserWarning, match="RuntimeError while reading it: 'head_dim' is a per-layer attribute"):
        handle = torchkvops.patch_generate(model)
    with handle, warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # one warning, at patch time
        got = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
