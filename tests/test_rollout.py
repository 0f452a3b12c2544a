"""Rollout against Hugging Face's own generate (the oracle), shared against expanded prefill, EOS and
masks, profiling, compiled decode, and the errors for what is not supported."""

import conftest
import pytest
import torch
from models import FAMILIES, hf_greedy, prompts
from transformers import BartConfig, BartForConditionalGeneration

from torchkvops import Rollout, RolloutConfig, RolloutOutput, RolloutProfile

NO_EOS = []  # never stop early: every response has exactly max_new_tokens tokens


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_greedy_matches_hf_generate(family_models, family, padded):
    model = family_models[family]
    ids, mask = prompts(3, 11, seed=1, left_pad=[0, 4, 1] if padded else None)
    n, new = 2, 12
    out = Rollout(model, RolloutConfig(samples_per_prompt=n, max_new_tokens=new, eos_token_id=NO_EOS)).generate(
        ids, mask
    )
    # Oracle 1: each prompt alone, unpadded.
    for row in range(ids.shape[0]):
        alone = ids[row : row + 1, mask[row].bool()]
        expected = hf_greedy(model, alone, torch.ones_like(alone), new)[0]
        for sample in range(n):
            assert torch.equal(out.responses[row * n + sample], expected), (family, row, sample)
    # Oracle 2: the padded batch as HF runs it.
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, new).repeat_interleave(n, dim=0))


def test_eager_attention_matches_hf_generate(llama):
    """eager attention takes an additive float mask (SDPA a boolean one): both must hide the pads."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(llama.config, attn_implementation="eager").eval()
    model.load_state_dict(llama.state_dict())
    ids, mask = prompts(3, 11, seed=1, left_pad=[0, 4, 1])
    out = Rollout(model, RolloutConfig(samples_per_prompt=2, max_new_tokens=8, eos_token_id=NO_EOS)).generate(ids, mask)
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, 8).repeat_interleave(2, dim=0))


def test_output_layout(llama):
    ids, mask = prompts(2, 7, seed=2, left_pad=[0, 3])
    out = Rollout(llama, RolloutConfig(samples_per_prompt=3, max_new_tokens=5, eos_token_id=NO_EOS)).generate(ids, mask)
    assert isinstance(out, RolloutOutput)
    assert out.prompt_length == 7
    assert out.sequences.shape == (6, 12) and out.responses.shape == (6, 5) and out.response_mask.shape == (6, 5)
    assert torch.equal(out.sequences[:, :7], ids.repeat_interleave(3, dim=0))  # row r answers prompt r // N
    assert torch.equal(out.sequences[:, 7:], out.responses)
    assert bool(out.response_mask.eq(1).all())


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=20, top_p=0.9, seed=7)], ids=["greedy", "sampled"]
)
def test_shared_and_expanded_give_identical_tokens(llama, batch, n, sampling):
    ids, mask = prompts(batch, 9, seed=batch, left_pad=[2, 0, 5][:batch])
    outs = [
        Rollout(
            llama,
            RolloutConfig(
                samples_per_prompt=n, max_new_tokens=10, shared_prefill=shared, eos_token_id=NO_EOS, **sampling
            ),
        ).generate(ids, mask)
        for shared in (True, False)
    ]
    assert torch.equal(outs[0].sequences, outs[1].sequences)


def test_seeded_sampling_is_reproducible_and_rows_differ(llama):
    ids, mask = prompts(1, 8, seed=3)
    cfg = dict(samples_per_prompt=8, max_new_tokens=16, temperature=1.5, seed=11, eos_token_id=NO_EOS)
    a = Rollout(llama, RolloutConfig(**cfg)).generate(ids, mask).responses
    b = Rollout(llama, RolloutConfig(**cfg)).generate(ids, mask).responses
    c = Rollout(llama, RolloutConfig(**{**cfg, "seed": 12})).generate(ids, mask).responses
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert len({tuple(r.tolist()) for r in a}) > 1  # the N samples of one prompt are not copies


def test_row_randomness_does_not_depend_on_other_rows(llama):
    """A row's draws depend on (seed, row index, step) alone: adding prompts after it changes nothing."""
    ids, mask = prompts(3, 8, seed=4)
    cfg = dict(samples_per_prompt=2, max_new_tokens=8, temperature=1.0, seed=5, eos_token_id=NO_EOS)
    one = Rollout(llama, RolloutConfig(**cfg)).generate(ids[:1], mask[:1]).responses
    three = Rollout(llama, RolloutConfig(**cfg)).generate(ids, mask).responses
    assert torch.equal(one, three[:2])


def test_top_k_one_is_greedy(llama):
    ids, mask = prompts(2, 8, seed=6)
    greedy = Rollout(llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=8, eos_token_id=NO_EOS)).generate(
        ids, mask
    )
    top1 = Rollout(
        llama,
        RolloutConfig(samples_per_prompt=2, max_new_tokens=8, eos_token_id=NO_EOS, temperature=1.0, top_k=1, seed=3),
    ).generate(ids, mask)
    assert torch.equal(greedy.responses, top1.responses)


def test_top_p_keeps_only_the_nucleus(llama):
    """With a tiny top_p only the most likely token survives, whatever the noise: greedy again."""
    ids, mask = prompts(2, 8, seed=6)
    greedy = Rollout(llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=8, eos_token_id=NO_EOS)).generate(
        ids, mask
    )
    nucleus = Rollout(
        llama,
        RolloutConfig(samples_per_prompt=2, max_new_tokens=8, eos_token_id=NO_EOS, temperature=2.0, top_p=1e-6, seed=3),
    ).generate(ids, mask)
    assert torch.equal(greedy.responses, nucleus.responses)


def test_eos_stops_rows_and_masks_the_rest(llama):
    ids, mask = prompts(2, 8, seed=8, left_pad=[0, 2])
    free = Rollout(llama, RolloutConfig(samples_per_prompt=1, max_new_tokens=12, eos_token_id=NO_EOS)).generate(
        ids, mask
    )
    eos = int(free.responses[0, 3])  # row 0 produces this token at step 3 (maybe earlier too)
    pad = 0
    out = Rollout(
        llama, RolloutConfig(samples_per_prompt=1, max_new_tokens=12, eos_token_id=eos, pad_token_id=pad)
    ).generate(ids, mask)
    for row in range(2):
        reference = free.responses[row]
        hits = (reference == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else reference.numel()  # tokens up to and including the first EOS
        got = out.responses[row]
        assert torch.equal(got[:end], reference[:end])
        assert bool((got[end:] == pad).all())  # pad_token_id 0 is kept as 0
        assert got[:end].numel() == int(out.response_mask[row].sum())
        assert bool(out.response_mask[row, :end].eq(1).all()) and bool(out.response_mask[row, end:].eq(0).all())


def test_generation_stops_early_when_every_row_ended(llama):
    ids, mask = prompts(1, 8, seed=9)
    free = Rollout(llama, RolloutConfig(samples_per_prompt=3, max_new_tokens=40, eos_token_id=NO_EOS)).generate(
        ids, mask
    )
    eos = int(free.responses[0, 0])  # greedy: every sample's first token
    out = Rollout(llama, RolloutConfig(samples_per_prompt=3, max_new_tokens=40, eos_token_id=[eos, 95])).generate(
        ids, mask
    )
    assert out.responses.shape[1] < 40
    assert bool((out.responses[:, 0] == eos).all())
    assert bool(out.response_mask[:, 0].eq(1).all()) and bool(out.response_mask[:, 1:].eq(0).all())


def test_eos_and_pad_default_to_the_generation_config(llama):
    r = Rollout(llama, RolloutConfig())
    assert r.eos_ids == [llama.generation_config.eos_token_id]
    assert r.pad_id == 0  # the model's pad id 0 is kept, not treated as missing


def test_variable_length_prompts_across_calls_reuse_the_buffer(llama):
    r = Rollout(llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=6, eos_token_id=NO_EOS))
    long_ids, long_mask = prompts(2, 20, seed=10)
    short_ids, short_mask = prompts(1, 5, seed=11)
    r.generate(long_ids, long_mask)
    storage = r.cache.groups[0].decode_kv.untyped_storage().data_ptr()
    short = r.generate(short_ids, short_mask)
    assert r.cache.groups[0].decode_kv.untyped_storage().data_ptr() == storage  # smaller request: same allocation
    assert torch.equal(short.responses, hf_greedy(llama, short_ids, short_mask, 6).repeat_interleave(2, dim=0))


def test_release_frees_the_buffer(llama):
    r = Rollout(llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=4, eos_token_id=NO_EOS))
    ids, mask = prompts(1, 6)
    first = r.generate(ids, mask)
    assert r.cache.allocated_bytes > 0
    r.release()
    assert r.cache.allocated_bytes == 0 and r.cache.decode_views is None
    assert torch.equal(r.generate(ids, mask).responses, first.responses)  # usable again afterwards


def test_profile_fields_are_consistent(llama):
    ids, mask = prompts(2, 10, seed=12, left_pad=[0, 3])
    eos = 5
    r = Rollout(llama, RolloutConfig(samples_per_prompt=4, max_new_tokens=9, enable_profiling=True, eos_token_id=eos))
    out = r.generate(ids, mask)
    p = r.get_last_profile()
    assert isinstance(p, RolloutProfile)
    assert p.total_ms >= p.prefill_ms + p.kv_expand_ms + p.decode_ms
    assert p.generation_ms == pytest.approx(p.prefill_ms + p.kv_expand_ms + p.decode_ms)
    assert p.generated_tokens == int(out.response_mask.sum())
    assert p.tokens_per_second == pytest.approx(p.generated_tokens / (p.total_ms / 1e3))
    assert (p.batch_size, p.samples_per_prompt, p.prompt_length) == (2, 4, 10)
    assert p.response_length == out.responses.shape[1] and p.decode_steps == p.response_length - 1
    assert p.peak_memory_bytes is None  # CPU: no accelerator peak to report
    assert set(p.to_dict()) >= {"prefill_ms", "kv_expand_ms", "decode_ms", "total_ms", "tokens_per_second"}


def test_profiling_off_gives_none_never_synchronizes_and_changes_nothing(llama, monkeypatch):
    ids, mask = prompts(2, 10, seed=13)
    cfg = dict(samples_per_prompt=2, max_new_tokens=6, temperature=0.8, seed=1, eos_token_id=NO_EOS)
    profiled = Rollout(llama, RolloutConfig(enable_profiling=True, **cfg)).generate(ids, mask)

    def no_sync(*args, **kwargs):
        raise AssertionError("synchronize called with profiling off")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    r = Rollout(llama, RolloutConfig(**cfg))
    plain = r.generate(ids, mask)
    assert r.get_last_profile() is None
    assert torch.equal(plain.sequences, profiled.sequences)


def test_stages_show_in_a_torch_profiler_trace(llama):
    ids, mask = prompts(1, 6)
    r = Rollout(llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=3, eos_token_id=NO_EOS))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        r.generate(ids, mask)
    names = {e.name for e in prof.events()}
    for stage in ("prompt_expansion", "prefill", "kv_expand", "decode", "post_processing"):
        assert f"torchkvops.{stage}" in names
    # The decode's attention and writes are visible operator calls.
    assert {"torchkvops::paged_attention", "torchkvops::write_kv_slots_"} <= names


def test_prefill_never_builds_full_logits(llama, monkeypatch):
    """Prefill asks the model for the last position's logits only."""
    seen = []
    original = llama.lm_head.forward
    monkeypatch.setattr(llama.lm_head, "forward", lambda h: seen.append(h.shape[1]) or original(h))
    ids, mask = prompts(2, 15)
    Rollout(llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=3, eos_token_id=NO_EOS)).generate(ids, mask)
    assert seen and max(seen) == 1


@pytest.fixture(scope="module")
def compiled_llama(llama):
    return Rollout(
        llama,
        RolloutConfig(samples_per_prompt=2, max_new_tokens=10, compile=True, eos_token_id=NO_EOS, return_logprobs=True),
    )


@pytest.mark.parametrize("length,pads", [(9, [0, 3]), (14, [2, 0]), (12, None)])
def test_compiled_rollout_gives_the_eager_tokens(llama, compiled_llama, length, pads):
    ids, mask = prompts(2, length, seed=length, left_pad=pads)
    eager = Rollout(
        llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=10, eos_token_id=NO_EOS, return_logprobs=True)
    ).generate(ids, mask)
    compiled = compiled_llama.generate(ids, mask)
    assert conftest.compiled(compiled_llama)  # (else eager is compared with eager)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=1e-5, atol=1e-5)  # issue #18


# --- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("samples_per_prompt", 0),
        ("samples_per_prompt", 2.0),
        ("max_new_tokens", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("seed", -3),
        ("eos_token_id", -1),
        ("eos_token_id", "2"),
        ("pad_token_id", -1),
        ("shared_prefill", 1),
        ("compile", "yes"),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"RolloutConfig.{field}"):
        RolloutConfig(**{field: value})


@pytest.mark.parametrize(
    "ids,mask,error,match",
    [
        (torch.zeros(0, 5, dtype=torch.long), None, ValueError, "empty"),
        (torch.zeros(2, 0, dtype=torch.long), None, ValueError, "empty"),
        (torch.zeros(5, dtype=torch.long), None, ValueError, "2-D"),
        (torch.zeros(2, 5), None, TypeError, "int64 or int32"),
        (torch.zeros(2, 5, dtype=torch.int16), None, TypeError, "input_ids must hold token ids as int64 or int32"),
        (torch.zeros(2, 5, dtype=torch.uint8), None, TypeError, "input_ids must hold token ids as int64 or int32"),
        (torch.zeros(2, 5, dtype=torch.long, device="meta"), None, ValueError, "input_ids is on the meta device"),
        (
            torch.ones(2, 5, dtype=torch.long),
            torch.ones(2, 5, device="meta"),
            ValueError,
            "attention_mask is on the meta",
        ),
        ([[1, 2]], None, TypeError, "torch.Tensor"),
        (torch.ones(2, 5, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), ValueError, "shape"),
        (torch.ones(1, 5, dtype=torch.long), torch.tensor([[1, 1, 1, 0, 0]]), ValueError, "left-padded"),
        (torch.ones(1, 3, dtype=torch.long), torch.tensor([[0, 2, 1]]), ValueError, "only 0 and 1"),
        (torch.ones(1, 3, dtype=torch.long), torch.tensor([[0, 0, 0]]), ValueError, "at least one token"),
    ],
)
def test_bad_inputs_raise_clear_errors(llama, ids, mask, error, match):
    r = Rollout(llama, RolloutConfig(max_new_tokens=2))
    with pytest.raises(error, match=match):
        r.generate(ids, mask)


def test_too_long_for_the_model_positions(llama):
    r = Rollout(llama, RolloutConfig(max_new_tokens=20))
    ids, mask = prompts(1, 120)
    with pytest.raises(ValueError, match="exceed the model.s 128 .max_position_embeddings"):
        r.generate(ids, mask)


def test_encoder_decoder_is_refused():
    model = BartForConditionalGeneration(
        BartConfig(
            vocab_size=64,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
        )
    )
    with pytest.raises(ValueError, match="encoder-decoder"):
        Rollout(model, RolloutConfig())


def test_layers_of_a_kind_the_rollout_does_not_know_are_refused(llama):
    """(Recurrent layers are served: tests/test_hybrid.py.)"""
    llama.config.layer_types = ["full_attention", "chunked_attention"]
    try:
        with pytest.raises(ValueError, match="layers of type \\['chunked_attention'\\]"):
            Rollout(llama, RolloutConfig())
    finally:
        del llama.config.layer_types


def test_unsupported_attention_implementation_is_refused(llama, monkeypatch):
    monkeypatch.setattr(llama.config, "_attn_implementation", "flex_attention")
    with pytest.raises(ValueError, match="attention implementation 'flex_attention' is not supported"):
        Rollout(llama, RolloutConfig())


def test_non_model_is_refused():
    with pytest.raises(TypeError, match="Hugging Face causal LM"):
        Rollout(torch.nn.Linear(2, 2), RolloutConfig())


# --- robustness (issue #7) -----------------------------------------------------------------------
def test_compiled_rollout_survives_many_batch_sizes_and_lengths(llama, compiled_llama):
    """Every batch size and prompt length an RL loop sees, with a bounded number of compiled graphs:
    no FailOnRecompileLimitHit, and the eager tokens."""
    from torch._dynamo.utils import counters

    eager = Rollout(llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=10, eos_token_id=NO_EOS))
    compiled_llama.generate(*prompts(2, 9, seed=0))  # graphs of the shared fixture exist from here on
    graphs_before = counters["stats"]["unique_graphs"]
    for b in range(1, 11):
        ids, mask = prompts(b, 4 + 3 * b, seed=b, left_pad=[b % 3] * b)
        assert torch.equal(compiled_llama.generate(ids, mask).sequences, eager.generate(ids, mask).sequences), b
    assert conftest.compiled(compiled_llama)
    # Rows and key length are dynamic: at most the size-1 specializations of prefill and decode are new.
    assert counters["stats"]["unique_graphs"] - graphs_before <= 4


def test_compiled_decode_past_the_recompile_limit_runs_eagerly_with_a_warning(llama, compiled_llama):
    """Dynamo's recompile limit counts every graph of the decode step in the process (every Rollout,
    every sampling config): past it, a rollout must still finish, eagerly, and say so."""
    import torch._dynamo

    cfg = dict(samples_per_prompt=2, max_new_tokens=10, eos_token_id=NO_EOS, temperature=0.7, top_k=3, seed=4)
    ids, mask = prompts(3, 7, seed=5)
    compiled_llama.generate(ids, mask)  # the fixture's decode graph exists: any other config is a recompile
    compiled = Rollout(llama, RolloutConfig(compile=True, **cfg))
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(RuntimeWarning, match="recompile limit"):
        out = compiled.generate(ids, mask)
    assert torch.equal(out.sequences, Rollout(llama, RolloutConfig(**cfg)).generate(ids, mask).sequences)


def test_outputs_are_ordinary_tensors_that_can_be_trained_on(llama):
    ids, mask = prompts(2, 6, seed=3)
    out = Rollout(llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=4, eos_token_id=NO_EOS)).generate(ids, mask)
    for t in (out.sequences, out.responses, out.response_mask):
        assert not t.is_inference()
    llama.zero_grad()
    llama(input_ids=out.sequences, labels=out.sequences).loss.backward()
    assert llama.lm_head.weight.grad is not None
    llama.zero_grad(set_to_none=True)


def test_one_rollout_from_two_threads_gives_the_sequential_results(llama):
    import threading

    r = Rollout(llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=8, eos_token_id=NO_EOS))
    inputs = [prompts(1 + i % 3, 5 + i, seed=i) for i in range(6)]
    expected = [r.generate(ids, mask).sequences for ids, mask in inputs]
    results, errors = {}, []

    def worker(indices):
        try:
            for i in indices:
                results[i] = r.generate(*inputs[i]).sequences
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(range(k, 6, 2),)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    for i in range(6):
        assert torch.equal(results[i], expected[i]), i


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_rollouts_of_two_models_in_two_threads_give_the_sequential_results(kv_sharing):
    """Two models, one thread each: their decodes must not see each other's attention context (the
    prompt KV of the prefix layout), whatever the interleaving."""
    import threading

    models = [FAMILIES["llama"](), FAMILIES["llama"]()]
    with torch.no_grad():  # same shapes, other weights: reading the other's context would go unnoticed
        for p in models[1].parameters():
            p.mul_(-1.5)
    rollouts = [
        Rollout(m, RolloutConfig(samples_per_prompt=2, max_new_tokens=8, eos_token_id=NO_EOS, kv_sharing=kv_sharing))
        for m in models
    ]
    inputs = [prompts(1 + i % 3, 5 + i, seed=i) for i in range(4)]
    expected = [[r.generate(ids, mask).sequences for ids, mask in inputs] for r in rollouts]
    results, errors = {}, []

    def worker(k):
        try:
            for i in range(4):
                results[k, i] = rollouts[k].generate(*inputs[i]).sequences
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for k in range(2):
        for i in range(4):
            assert torch.equal(results[k, i], expected[k][i]), (k, i)


@pytest.mark.parametrize(
    "config,match",
    [
        (dict(pad_token_id=96), "pad_token_id 96 is outside the model's vocabulary of 96"),
        (dict(pad_token_id=10**6), "pad_token_id 1000000 is outside"),
        (dict(eos_token_id=[2, 500]), "eos_token_id 500 is outside the model's vocabulary of 96"),
    ],
)
def test_special_ids_outside_the_vocabulary_are_refused_at_construction(llama, config, match):
    with pytest.raises(ValueError, match=match):
        Rollout(llama, RolloutConfig(**config))


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 1e-44),
        ("temperature", 1e-7),
        ("eos_token_id", 2**64),
        ("eos_token_id", [1, 2**63]),
        ("pad_token_id", 2**63),
        ("seed", 2**64),
        ("kv_sharing", "blocks"),
    ],
)
def test_config_values_that_used_to_fail_later(field, value):
    with pytest.raises(ValueError, match=f"RolloutConfig.{field}"):
        RolloutConfig(**{field: value})


def test_smallest_allowed_temperature_is_greedy(llama):
    ids, mask = prompts(2, 8, seed=6)
    greedy = Rollout(llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=8, eos_token_id=NO_EOS)).generate(
        ids, mask
    )
    cold = Rollout(
        llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=8, eos_token_id=NO_EOS, temperature=1e-6, seed=1)
    ).generate(ids, mask)
    assert torch.equal(greedy.sequences, cold.sequences)


@pytest.mark.parametrize(
    "ids,mask,match",
    [
        (torch.tensor([[5, 96, 7]]), None, r"input_ids must be token ids in \[0, 96\).*got 96"),
        (torch.tensor([[5, -1, 7]]), None, r"got -1"),
        (torch.tensor([[5, 6, 7]]), torch.tensor([[0.0, 0.5, 1.0]]), "only 0 and 1"),
        (torch.tensor([[5, 6, 7]]), torch.tensor([[0.0, 1.0, 1.7]]), "only 0 and 1"),
    ],
    ids=["id-at-vocab", "negative-id", "mask-0.5", "mask-1.7"],
)
def test_inputs_checked_against_the_model_before_any_work(llama, ids, mask, match):
    r = Rollout(llama, RolloutConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match=match):
        r.generate(ids, mask)


def test_float_and_bool_masks_of_zeros_and_ones_are_accepted(llama):
    ids, mask = prompts(2, 7, seed=2, left_pad=[0, 3])
    cfg = RolloutConfig(samples_per_prompt=1, max_new_tokens=4, eos_token_id=NO_EOS)
    expected = Rollout(llama, cfg).generate(ids, mask).sequences
    for as_type in (torch.float32, torch.bool, torch.int32):
        assert torch.equal(Rollout(llama, cfg).generate(ids, mask.to(as_type)).sequences, expected)


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_decode_graph_key_is_stable_across_calls_and_follows_the_weights(kv_sharing):
    """A CUDA graph replays on fixed addresses: calls of the same shape must map to the same key (or
    every call would capture again), and a replaced parameter must change it (or a graph would replay
    on freed memory). Checked here on the key itself; tests/test_cuda_graphs.py replays on a GPU."""
    from models import FAMILIES

    model = FAMILIES["llama"]()
    r = Rollout(
        model, RolloutConfig(samples_per_prompt=2, max_new_tokens=5, eos_token_id=NO_EOS, kv_sharing=kv_sharing)
    )
    r.generate(*prompts(2, 9, seed=1))
    key = r.decode_counters().graph_key
    r.generate(*prompts(2, 9, seed=2, left_pad=[3, 0]))  # other prompts, same shapes
    assert r.decode_counters().graph_key == key
    r.generate(*prompts(3, 9, seed=3))  # another batch size: another key
    assert r.decode_counters().graph_key != key
    r.generate(*prompts(2, 9, seed=1))  # the KV allocation grew for 3 prompts: new addresses once,
    key = r.decode_counters().graph_key
    r.generate(*prompts(3, 9, seed=3))
    r.generate(*prompts(2, 9, seed=4))  # then alternating shapes find their own addresses again
    assert r.decode_counters().graph_key == key
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())  # new storage
    r.generate(*prompts(2, 9, seed=1))
    assert r.decode_counters().graph_key != key


@pytest.mark.parametrize("masked_rows", ["nan", "zero"])
@pytest.mark.parametrize("kv_sharing", ["prefix"])
def test_decode_on_the_emulated_cuda_attention_gives_the_cpu_tokens(llama, kv_sharing, masked_rows):
    """The decode attention's shared levels (the prefix layout's prompts, read stacked: their whole blocks,
    one padded over a whole block) through fused_attention's CUDA branch against the emulated
    memory-efficient kernels (tests/mem_eff_emulator.py: layouts, alignment checks, masked rows as torch
    before and after its fix): the same samples as the CPU kernels, with compaction, and no bias ever copied
    for alignment (the rollout sizes its buffers for the kernels). (Each row's own keys go through
    paged_attention, whose CPU kernel runs the CUDA kernel's row logic.)"""
    from mem_eff_emulator import emulated_cuda_branch, recording_bias_copies

    config = RolloutConfig(
        samples_per_prompt=3,
        max_new_tokens=24,
        kv_sharing=kv_sharing,
        temperature=1.0,
        seed=0,
        eos_token_id=[41, 60, 90],
        return_logprobs=True,
    )
    ids, mask = prompts(3, 40, seed=2, left_pad=[0, 2, 21])
    expected = Rollout(llama, config).generate(ids, mask)
    rollout = Rollout(llama, config)
    with emulated_cuda_branch(masked_rows) as emulator, recording_bias_copies() as copied:
        got = rollout.generate(ids, mask)
    assert emulator.calls and rollout.decode_counters().compactions > 0
    assert copied and not any(copied)
    assert torch.equal(got.responses, expected.responses)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-4, atol=1e-4)
