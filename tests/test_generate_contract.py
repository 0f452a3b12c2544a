"""torchkvops.generate / patch_generate keep Hugging Face generate's contract. Where a call is
served its output is HF's (HF's own generate, unpatched, is the oracle); anything else goes to HF's
generate with a warning naming the cause, never an exception HF would not raise, never a silent
difference."""

import copy
import gc
import io
import pickle
import warnings
import weakref

import numpy as np
import pytest
import torch
import transformers
from devices import DEVICES
from models import COMMON, FAMILIES, prompts
from transformers import CompileConfig, GenerationConfig

import torchkvops


def hf_generate(model, *args, **kwargs):
    """The oracle: the model class's own generate, whatever is patched on the instance."""
    return type(model).generate(model, *args, **kwargs)


@pytest.fixture
def served(monkeypatch):
    """How many rollouts ran (calls the rollout served rather than HF's generate)."""
    calls = []
    original = torchkvops.Rollout.generate_rows

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(1)  # after it returned: a rollout that raised served nothing
        return out

    monkeypatch.setattr(torchkvops.Rollout, "generate_rows", spy)
    return calls


def same_tokens(out, expected):
    out, expected = getattr(out, "sequences", out), getattr(expected, "sequences", expected)
    return out.shape == expected.shape and torch.equal(out, expected)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


GREEDY = dict(max_new_tokens=5, do_sample=False)


# --- no attention_mask on left-padded ids: HF infers it from the pad id ---------------------------
@pytest.mark.parametrize("pad_id", [0, 2], ids=["pad_not_eos", "pad_is_eos"])
def test_missing_mask_is_inferred_from_pad_tokens_as_hf_does(llama, served, pad_id):
    """pad 0 != eos 2: HF masks the pads (the rollout must too); pad == eos: HF cannot tell pads from
    EOS and attends to everything."""
    ids, _ = prompts(3, 8, seed=1, pad_id=pad_id, left_pad=[0, 2, 4])
    kwargs = dict(GREEDY, pad_token_id=pad_id, eos_token_id=2)
    out = torchkvops.generate(llama, ids, **kwargs)
    assert served and same_tokens(out, hf_generate(llama, ids, **kwargs))


# --- default length: HF 5.x generates 20 new tokens, capped by the model's positions -------------
@pytest.mark.parametrize("prompt_length,new_tokens", [(8, 20), (120, 8)])  # max_position_embeddings=128
def test_default_length_is_hfs(llama, served, prompt_length, new_tokens):
    ids, mask = prompts(2, prompt_length, seed=2)
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = quiet(torchkvops.generate, llama, ids, **kwargs)  # HF warns that the default length is used
    assert served and out.shape == (2, prompt_length + new_tokens)
    assert same_tokens(out, quiet(hf_generate, llama, ids, **kwargs))


# --- settings equal to 0 are settings; invalid ones get HF's own error --------------------------
@pytest.mark.parametrize(
    "setting",
    [dict(forced_eos_token_id=0), dict(forced_bos_token_id=0), dict(guidance_scale=0), dict(max_time=0.0)],
    ids=lambda s: next(iter(s)),
)
def test_zero_valued_settings_fall_back(llama, served, setting):
    ids, mask = prompts(2, 6, seed=3)
    kwargs = dict(GREEDY, attention_mask=mask, eos_token_id=None, pad_token_id=0, **setting)
    with pytest.warns(UserWarning, match=f"torchkvops.generate: generation_config.{next(iter(setting))}="):
        out = torchkvops.generate(llama, ids, **kwargs)
    assert not served and same_tokens(out, hf_generate(llama, ids, **kwargs))


@pytest.mark.parametrize(
    "setting",
    [
        dict(do_sample=True, temperature=0),
        dict(do_sample=True, temperature=2),
        dict(repetition_penalty=0),
        dict(do_sample=True, typical_p=0),
        dict(num_beams=0),
        dict(do_sample=False, num_return_sequences=2),
    ],
    ids=[
        "temperature_0",
        "temperature_int",
        "repetition_penalty_0",
        "typical_p_0",
        "num_beams_0",
        "greedy_num_return_sequences",
    ],
)
def test_settings_hf_rejects_raise_hfs_error(llama, served, setting):
    ids, mask = prompts(2, 6, seed=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=3, **setting)
    with pytest.raises(Exception) as expected:
        hf_generate(llama, ids, **kwargs)
    with pytest.raises(type(expected.value), match=str(expected.value)[:40].replace("(", r"\(").replace(")", r"\)")):
        quiet(torchkvops.generate, llama, ids, **kwargs)
    assert not served


# --- state kept across calls follows the model ---------------------------------------------------
@pytest.mark.parametrize("change", ["eager", "float64", "half", "resize"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cached_state_is_rebuilt_when_the_model_changes(served, family, change):
    model = FAMILIES[family]()
    ids, mask = prompts(3, 8, seed=4, left_pad=[0, 2, 5])
    kwargs = dict(GREEDY, attention_mask=mask, eos_token_id=None, pad_token_id=0)
    torchkvops.generate(model, ids, **kwargs)  # builds the session's rollout for the model as it was
    if change == "eager":
        model.set_attn_implementation("eager")
    elif change == "float64":
        model.to(torch.float64)
    elif change == "half":
        model.half()
    else:
        model.resize_token_embeddings(COMMON["vocab_size"] + 24)
        ids[:, -1] = COMMON["vocab_size"] + 20  # an id only the resized model has
    served.clear()
    if change == "float64":  # the rollout's sampler takes float32, float16 and bfloat16
        with pytest.warns(UserWarning, match="torch.float64 parameters"):
            out = torchkvops.generate(model, ids, **kwargs)
        assert not served and same_tokens(out, hf_generate(model, ids, **kwargs))
        return
    out = torchkvops.generate(model, ids, **kwargs)
    assert served and same_tokens(out, hf_generate(model, ids, **kwargs))


# --- del model frees the model, its rollouts and their KV buffers --------------------------------
@pytest.mark.parametrize("how", ["generate", "patch", "patch_then_undo"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_model_used_through_torchkvops_is_freed(monkeypatch, device, how):
    """On CUDA the decode graphs (captured from the second call of a shape on) go with the rollout."""
    kv_buffers = []
    original = torchkvops.Rollout.generate_rows

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        kv_buffers.append(weakref.ref(self.cache._storage))
        return out

    monkeypatch.setattr(torchkvops.Rollout, "generate_rows", spy)
    model = FAMILIES["llama"]().to(device)
    ids, mask = (t.to(device) for t in prompts(2, 6, seed=5))
    handle = None
    for _ in range(2):
        if how == "generate":
            torchkvops.generate(model, ids, attention_mask=mask, **GREEDY)
        else:
            handle = handle or torchkvops.patch_generate(model)
            model.generate(ids, attention_mask=mask, **GREEDY)
    if how == "patch_then_undo":
        handle.undo()
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None and len(kv_buffers) == 2 and all(kv() is None for kv in kv_buffers)
    if handle is not None:  # the handle outlives the model, harmlessly
        assert handle.session is None
        handle.undo()
        handle.release()


# --- copies of a patched model work: deep copies patched alike, pickled ones unpatched ----------------
def test_a_deep_copy_of_a_patched_model_is_patched_alike_with_a_session_of_its_own(served):
    """TRL's A2PO deep-copies the policy into its reference model after it was patched: the copy is served
    too, with the patch's options, from its own rollouts (not the original's buffers), and undone alone."""
    model = FAMILIES["llama"]()
    ids, mask = prompts(2, 6, seed=6)
    kwargs = dict(GREEDY, attention_mask=mask)
    with torchkvops.patch_generate(model, kv_sharing="prefix", compact_finished_rows=False) as handle:
        expected = model.generate(ids, **kwargs)
        twin = copy.deepcopy(model)
        twin_handle = torchkvops.GeneratePatch.of(twin)
        assert twin_handle is not None and twin_handle.session is not handle.session
        assert twin_handle.session.options == handle.session.options  # the patch's options
        assert not twin_handle.session.rollouts  # none of the original's rollouts, buffers or kept KV
        served.clear()
        assert same_tokens(twin.generate(ids, **kwargs), expected) and served  # the copy: served
        (rollout,) = twin_handle.session.rollouts.values()
        assert rollout.model is twin and rollout.config.kv_sharing == "prefix"
        twin_handle.undo()
        served.clear()
        assert same_tokens(twin.generate(ids, **kwargs), expected) and not served  # undone alone ...
        assert same_tokens(model.generate(ids, **kwargs), expected) and served  # ... the original still patched
    assert torchkvops.GeneratePatch.of(model) is None


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_pickled_patched_model_copies_unpatched(served, how):
    model = FAMILIES["llama"]()
    ids, mask = prompts(2, 6, seed=6)
    kwargs = dict(GREEDY, attention_mask=mask)
    with torchkvops.patch_generate(model):
        expected = model.generate(ids, **kwargs)  # served: a session with rollouts, locks and buffers
        if how == "pickle":
            twin = pickle.loads(pickle.dumps(model))
        else:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            twin = torch.load(buffer, weights_only=False)
        served.clear()
        assert same_tokens(twin.generate(ids, **kwargs), expected) and not served  # the copy: HF's generate
        assert same_tokens(model.generate(ids, **kwargs), expected) and served  # the original: still patched
    assert same_tokens(torchkvops.patch_generate(twin).session.original_generate(ids, **kwargs), expected)


# --- undo in any order; refusals say what to do ---------------------------------------------------
def test_undo_in_either_order_restores_hfs_generate(llama, served):
    ids, mask = prompts(2, 6, seed=7)
    kwargs = dict(GREEDY, attention_mask=mask)
    expected = hf_generate(llama, ids, **kwargs)
    for order in ("first_patch_first", "second_patch_first"):
        first = torchkvops.patch_generate(llama)
        inner = llama.generate
        llama.generate = lambda *args, **kw: inner(*args, **kw)  # a caller's wrapper around the patch
        second = torchkvops.patch_generate(llama)
        for handle in (first, second) if order == "first_patch_first" else (second, first):
            handle.undo()
        served.clear()
        assert same_tokens(llama.generate(ids, **kwargs), expected) and not served, order
        again = torchkvops.patch_generate(llama)  # and it can be patched again
        assert same_tokens(llama.generate(ids, **kwargs), expected) and served
        again.undo()
        vars(llama).pop("generate", None)


def test_refusals_say_what_to_do(llama):
    with pytest.raises(
        TypeError, match="LlamaModel has no generate method .*use the causal LM that wraps it, e.g. LlamaForCausalLM"
    ):
        torchkvops.patch_generate(llama.model)
    with pytest.raises(
        TypeError, match=r"DataParallel has no generate method; patch the model it wraps: .*\(model.module\)"
    ):
        torchkvops.patch_generate(torch.nn.DataParallel(llama))
    with pytest.raises(TypeError, match=r"DataParallel has no generate method; .*torchkvops.generate\(model.module\)"):
        torchkvops.generate(torch.nn.DataParallel(llama), torch.ones(1, 2, dtype=torch.long))
    with torchkvops.patch_generate(llama):
        with pytest.raises(RuntimeError, match=r"already patched by torchkvops; call undo\(\) on the handle"):
            torchkvops.patch_generate(llama)


# --- models the rollout cannot run fall back, from patch time ------------------------------------
def _tiny(cls, config_cls, **fields):
    torch.manual_seed(0)
    return cls(config_cls(**COMMON, **fields)).eval()


def _with_config(model, **fields):
    """`model` with config fields changed after its layers were built from the old ones."""
    for name, value in fields.items():
        setattr(model.config, name, value)
    return model


UNSERVABLE = {
    "bloom": (
        lambda: _tiny(transformers.BloomForCausalLM, transformers.BloomConfig, hidden_size=32, n_layer=2, n_head=4),
        "ALiBi",
    ),
    "mpt": (
        lambda: _tiny(transformers.MptForCausalLM, transformers.MptConfig, d_model=32, n_heads=4, n_layers=2),
        "ALiBi",
    ),
    "falcon_alibi": (
        lambda: _tiny(
            transformers.FalconForCausalLM,
            transformers.FalconConfig,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            alibi=True,
            multi_query=False,
        ),
        "ALiBi",
    ),
    "deepseek_v3": (
        lambda: _tiny(
            transformers.DeepseekV3ForCausalLM,
            transformers.DeepseekV3Config,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            first_k_dense_replace=1,
        ),
        "multi-head latent attention",
    ),
    # Layers whose KV has other heads than the config says (as multi-query Falcon's had before
    # transformers 5.2x): nothing in the config says the rollout cannot run it; its first call shows it.
    "kv_heads_unlike_config": (
        lambda: _with_config(
            _tiny(
                transformers.LlamaForCausalLM,
                transformers.LlamaConfig,
                hidden_size=32,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            ),
            num_key_value_heads=1,
        ),
        None,
    ),
}


@pytest.mark.parametrize("name", list(UNSERVABLE))
def test_models_the_rollout_cannot_run_fall_back_with_a_warning(monkeypatch, name):
    attempts = []
    original = torchkvops.Rollout.generate_rows
    monkeypatch.setattr(
        torchkvops.Rollout, "generate_rows", lambda self, *a, **k: attempts.append(1) or original(self, *a, **k)
    )
    build, cause = UNSERVABLE[name]
    model = build()
    ids, mask = prompts(2, 6, seed=8, left_pad=[0, 2])
    kwargs = dict(GREEDY, attention_mask=mask, eos_token_id=None, pad_token_id=0)
    expected = hf_generate(model, ids, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = torchkvops.patch_generate(model)
        outs = [model.generate(ids, **kwargs) for _ in range(3)]
    messages = [str(w.message) for w in caught if "torchkvops" in str(w.message)]
    assert all(same_tokens(out, expected) for out in outs)
    if cause is not None:  # refused when reading the model: once, at patch time or at the first call
        assert len(messages) == 1 and cause in messages[0] and len(attempts) == 0, messages
    else:  # failed in the rollout: tried again at the next call, then settled (no third attempt)
        assert len(attempts) == 2
        assert len(messages) == 2 and "the next call with these settings tries the rollout again" in messages[0]
        assert "the rollout failed on it 2 times" in messages[1] and "is not supported" in messages[1]
    handle.undo()


def fail_once_in_the_rollout(monkeypatch, error: Exception) -> None:
    """The next Rollout.generate_rows call raises `error`; the ones after it run as they are."""
    original, failures = torchkvops.Rollout.generate_rows, [error]

    def fails_once(self, *args, **kwargs):
        if failures:
            raise failures.pop()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torchkvops.Rollout, "generate_rows", fails_once)


def test_a_call_that_fails_once_in_the_rollout_falls_back_and_the_next_is_served(llama, monkeypatch):
    """Issue #51: a passing failure of the first served call (here a RuntimeError, once) made every later
    call with those settings fall back, with a warning calling the model "not supported". It falls back
    for that call only, with a warning naming what failed; the next call is served."""
    fail_once_in_the_rollout(monkeypatch, RuntimeError("a passing failure"))
    ids, mask = prompts(2, 6, seed=8, left_pad=[0, 2])
    kwargs = dict(GREEDY, attention_mask=mask, eos_token_id=None, pad_token_id=0)
    expected = hf_generate(llama, ids, **kwargs)
    with torchkvops.patch_generate(llama) as handle:
        with pytest.warns(UserWarning, match=r"the rollout failed on this call \(RuntimeError: a passing failure\)"):
            first = llama.generate(ids, **kwargs)
        assert handle.last_profile() is None  # HF's generate ran it
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            second = llama.generate(ids, **kwargs)
        assert handle.last_profile() is not None  # served
    assert same_tokens(first, expected) and same_tokens(second, expected)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory"),
    ],
    ids=["cuda", "cpu"],
)
def test_running_out_of_memory_is_raised_and_remembered_nowhere(llama, monkeypatch, error):
    """Memory that runs out is the caller's to handle, as with HF's generate (which would run out too):
    raised, and the next call is served."""
    fail_once_in_the_rollout(monkeypatch, error)
    ids, mask = prompts(2, 6, seed=8, left_pad=[0, 2])
    kwargs = dict(GREEDY, attention_mask=mask, eos_token_id=None, pad_token_id=0)
    with torchkvops.patch_generate(llama) as handle:
        with pytest.raises(type(error), match="memory"):
            llama.generate(ids, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = llama.generate(ids, **kwargs)
        assert handle.last_profile() is not None
    assert same_tokens(out, hf_generate(llama, ids, **kwargs))


# --- inputs and settings HF accepts fall back instead of raising ---------------------------------
MASKS = {
    "right_padded": [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]],
    "hole": [[1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 1, 1]],
    "empty_row": [[1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]],
}
SETTINGS = {
    "top_p_0": dict(do_sample=True, top_p=0.0),
    "temperature_1e-8": dict(do_sample=True, temperature=1e-8),
    "eos_-1": dict(eos_token_id=-1),
    "eos_outside_vocab": dict(eos_token_id=1000),
    "beyond_positions": dict(max_new_tokens=30),
}
# + 30 > 128 positions. (Beyond a sliding window the copy layout serves: tests/test_sliding_window.py.)
PROMPT_LENGTHS = {"beyond_positions": 100}


@pytest.mark.parametrize("case", list(MASKS) + ["tril"] + list(SETTINGS))
def test_what_hf_accepts_falls_back_with_hfs_output(served, case):
    model = FAMILIES["llama"]()  # 128 positions
    ids, mask = prompts(2, PROMPT_LENGTHS.get(case, 6), seed=9)
    if case in MASKS:
        mask = torch.tensor(MASKS[case])
    elif case == "tril":  # transformers' own generation tests build their masks so
        ids, mask = ids[:, :2], torch.tril(torch.ones(2, 2, dtype=torch.long))
    kwargs = dict(GREEDY, attention_mask=mask, pad_token_id=0)
    kwargs.update(SETTINGS.get(case, {}))
    torch.manual_seed(9)
    with pytest.warns(UserWarning, match="torchkvops.generate: "):
        out = torchkvops.generate(model, ids, **kwargs)
    torch.manual_seed(9)  # the fallback is HF's generate: its own random stream
    assert not served and same_tokens(out, quiet(hf_generate, model, ids, **kwargs))


def test_eos_as_a_tensor_is_served(llama, served):
    ids, mask = prompts(2, 6, seed=9)
    free = hf_generate(llama, ids, attention_mask=mask, **GREEDY, eos_token_id=None, pad_token_id=0)
    kwargs = dict(GREEDY, attention_mask=mask, eos_token_id=torch.tensor(int(free[0, 8])), pad_token_id=0)
    assert same_tokens(torchkvops.generate(llama, ids, **kwargs), hf_generate(llama, ids, **kwargs)) and served


# --- arguments that change nothing do not cost the speed-up -------------------------------------
@pytest.mark.parametrize(
    "extra",
    [
        dict(synced_gpus=False),
        dict(tokenizer=None),
        dict(cache_implementation="static", compile_config=CompileConfig()),
        dict(return_dict_in_generate=True),
    ],
    ids=["synced_gpus_False", "tokenizer_None", "static_cache_compile_config", "return_dict"],
)
def test_harmless_arguments_are_served(llama, served, extra):
    ids, mask = prompts(2, 6, seed=10)
    kwargs = dict(GREEDY, attention_mask=mask, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        out = torchkvops.generate(llama, ids, **kwargs)
    assert served and same_tokens(out, hf_generate(llama, ids, **kwargs))
    if extra.get("return_dict_in_generate"):  # documented: sequences only, no HF cache
        # (the output's cache field: `cache` from transformers 5.2x, `past_key_values` in 5.17)
        def cache(output):
            return getattr(output, "cache", getattr(output, "past_key_values", None))

        assert cache(out) is None and cache(hf_generate(llama, ids, **kwargs)) is not None


def test_generation_config_precedence_with_a_config_passed_positionally(llama, served):
    """The patched generate binds its arguments with HF's signature (inputs, generation_config, ...)."""
    ids, mask = prompts(2, 6, seed=11)
    config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torchkvops.patch_generate(llama):
        out = llama.generate(ids, config, attention_mask=mask)
    assert served and same_tokens(out, hf_generate(llama, ids, config, attention_mask=mask))


# --- odd-typed and odd-shaped arguments HF accepts --------------------------------------------------
@pytest.mark.parametrize(
    "length", [np.int64(4), 4.0, torch.tensor(4), 3.5], ids=["numpy_int", "float", "tensor", "3.5"]
)
def test_lengths_of_other_numeric_types_are_served_as_hf_serves_them(served, length):
    """HF stops once the length reaches prompt + max_new_tokens, whatever its numeric type (3.5: 4 tokens).
    A call that failed here once made every later call of the model fall back: the next one is served."""
    model = FAMILIES["llama"]()
    ids, mask = prompts(2, 6, seed=21)
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torchkvops.patch_generate(model):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # served, no fallback warning
            out = model.generate(ids, max_new_tokens=length, **kwargs)
            ordinary = model.generate(ids, max_new_tokens=3, **kwargs)
    assert len(served) == 2 and out.shape == (2, 10)
    assert same_tokens(out, hf_generate(model, ids, max_new_tokens=length, **kwargs))
    assert same_tokens(ordinary, hf_generate(model, ids, max_new_tokens=3, **kwargs))


def test_a_call_that_fails_in_the_rollout_does_not_disable_calls_with_other_settings(monkeypatch, served):
    """A rollout failure before anything was served falls back for that call; the next call with the same
    settings tries again (even after a call with other settings was served), and after a second failure
    every later one falls back without trying; calls with other settings are served."""
    model = FAMILIES["llama"]()
    original = torchkvops.Rollout.generate_rows

    def fails_at_three(self, *args, **kwargs):
        if self.config.max_new_tokens == 3:
            raise RuntimeError("a failure only this setting meets")
        return original(self, *args, **kwargs)

    attempts = []
    monkeypatch.setattr(
        torchkvops.Rollout, "generate_rows", lambda self, *a, **k: attempts.append(1) or fails_at_three(self, *a, **k)
    )
    ids, mask = prompts(2, 6, seed=22)
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torchkvops.patch_generate(model):
        with pytest.warns(UserWarning, match=r"failed on this call \(RuntimeError: a failure only this setting meets"):
            failed = model.generate(ids, max_new_tokens=3, **kwargs)
        other = model.generate(ids, max_new_tokens=4, **kwargs)
        with pytest.warns(UserWarning, match="the rollout failed on it 2 times"):
            again = model.generate(ids, max_new_tokens=3, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            settled = model.generate(ids, max_new_tokens=3, **kwargs)
    assert len(served) == 1  # the max_new_tokens=4 call
    assert len(attempts) == 3  # failed, other, again (not settled)
    for out, n in ((failed, 3), (other, 4), (again, 3), (settled, 3)):
        assert same_tokens(out, hf_generate(model, ids, max_new_tokens=n, **kwargs))


def test_eos_as_a_2d_tensor_is_served(llama, served):
    ids, mask = prompts(2, 6, seed=23)
    free = hf_generate(llama, ids, attention_mask=mask, **GREEDY, eos_token_id=None, pad_token_id=0)
    eos = torch.tensor([[int(free[0, 8]), int(free[1, 7])]])
    kwargs = dict(GREEDY, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    out = torchkvops.generate(llama, ids, **kwargs)
    assert served and same_tokens(out, hf_generate(llama, ids, **kwargs))


def test_an_attention_mask_of_other_numbers_falls_back_to_hf(llama, served):
    """HF attends where the mask is not 0 (and numbers positions by its cumulative sum): its output."""
    ids, mask = prompts(2, 6, seed=24, left_pad=[0, 2])
    kwargs = dict(GREEDY, attention_mask=mask * 2, eos_token_id=None, pad_token_id=0)
    with pytest.warns(UserWarning, match="values other than 0 and 1"):
        out = torchkvops.generate(llama, ids, **kwargs)
    assert not served and same_tokens(out, quiet(hf_generate, llama, ids, **kwargs))


def test_top_k_true_gets_hfs_error(llama, served):
    ids, mask = prompts(2, 6, seed=25)
    kwargs = dict(attention_mask=mask, do_sample=True, top_k=True, max_new_tokens=3)
    with pytest.raises(TypeError) as hf_error:
        hf_generate(llama, ids, **kwargs)
    with (
        pytest.raises(TypeError, match=str(hf_error.value).split(":")[0]),
        pytest.warns(UserWarning, match="top_k=True"),
    ):
        torchkvops.generate(llama, ids, **kwargs)
    assert not served


def test_prompt_and_new_tokens_up_to_the_positions_plus_one_are_served(family_models, served):
    """The last sampled token is never fed back: 120 + 9 tokens run the model at 128 positions, as HF does."""
    model = family_models["gpt2"]  # n_positions=128
    ids, mask = prompts(2, 120, seed=26)
    kwargs = dict(attention_mask=mask, max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = torchkvops.generate(model, ids, **kwargs)
    assert served and out.shape == (2, 129) and same_tokens(out, hf_generate(model, ids, **kwargs))
    with pytest.warns(UserWarning, match="129 positions exceed"), pytest.raises(IndexError):  # HF's own error
        torchkvops.generate(model, ids, **dict(kwargs, max_new_tokens=10))


# --- logits that cannot be sampled from --------------------------------------------------------------
def nan_at_position(position: int):
    """A GPT-2 whose position embedding `position` is NaN: the forward at that position gives NaN logits."""
    model = FAMILIES["gpt2"]()
    with torch.no_grad():
        model.transformer.wpe.weight[position] = float("nan")
    return model


def test_nan_logits_raise_when_sampling_as_hf_does(served):
    """Prompt of 6: the forward at position 9 computes new token 4. HF's sampling raises there; so do
    generate (patched or not) and Rollout, naming the token; greedy takes the argmax, as HF does."""
    model = nan_at_position(9)
    ids, mask = prompts(2, 6, seed=27)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        quiet(hf_generate, model, ids, do_sample=True, **kwargs)
    with pytest.raises(torchkvops.rollout.NonFiniteLogitsError, match="NaN or inf at new token 4"):
        torchkvops.generate(model, ids, do_sample=True, **kwargs)
    rollout = torchkvops.Rollout(model, torchkvops.RolloutConfig(max_new_tokens=8, temperature=1.0, eos_token_id=[2]))
    with pytest.raises(torchkvops.rollout.NonFiniteLogitsError, match="at new token 4"):
        rollout.generate(ids, mask)
    greedy = torchkvops.generate(model, ids, do_sample=False, **kwargs)
    assert same_tokens(greedy, hf_generate(model, ids, do_sample=False, **kwargs))


def test_logits_that_are_finite_until_the_last_token_do_not_raise(served):
    """The forward at position 12 would compute a 7th new token; with 6 new tokens it never runs."""
    model = nan_at_position(12)
    ids, mask = prompts(2, 6, seed=27)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, eos_token_id=None, pad_token_id=0, do_sample=True)
    assert torchkvops.generate(model, ids, **kwargs).shape == (2, 12) and served
