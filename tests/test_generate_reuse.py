"""patch_generate across calls (torchkvops.hf.generate_reuse): a call whose rows extend the last served
call's (an agent's next turn: prompt, completion through EOS, a tool's answer) is served from the kept
KV and prefills only what the rows append; any change of the weights drops what was kept. The oracle
is HF's generate on an unpatched twin of the model (same weights) or on the model with its patch undone."""

import copy

import pytest
import torch
from models import FAMILIES, prompts
from torch import nn

import torchkvops

EOS = [41, 60, 90]
KWARGS = dict(do_sample=False, max_new_tokens=12, eos_token_id=EOS, pad_token_id=0)


def hf(model, ids, mask):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **KWARGS)


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.numel() :], mask[i, width - r.numel() :] = r, 1
    return ids, mask


def next_turn(ids, mask, out, rows, suffixes):
    """TRL's tool loop: for each row that called a tool, prompt (no padding) + completion through its
    first EOS + the tool's answer, left-padded."""
    built = []
    for i, suffix in zip(rows, suffixes):
        completion = out[i, ids.shape[1] :]
        ends = [k for k, t in enumerate(completion.tolist()) if t in EOS]
        completion = completion[: ends[0] + 1] if ends else completion
        built.append(torch.cat([ids[i][mask[i].bool()], completion, torch.tensor(suffix)]))
    return left_pad(built)


def first_turn():
    ids, mask = prompts(3, 6, seed=0, left_pad=[0, 2, 1])
    return ids.repeat_interleave(2, dim=0), mask.repeat_interleave(2, dim=0)  # GRPO: each prompt N=2 times


@pytest.mark.parametrize("layout", ["copy", "prefix", "paged"])
def test_tool_turns_are_served_from_the_kept_kv_and_equal_hf(layout):
    model, twin = FAMILIES["llama"](), FAMILIES["llama"]()
    handle = torchkvops.patch_generate(model, kv_sharing=layout)
    ids, mask = first_turn()
    out = model.generate(ids, attention_mask=mask, **KWARGS)
    assert torch.equal(out, hf(twin, ids, mask))
    assert handle.last_profile().reused_tokens == 0 and handle.last_profile().prefill_tokens == 3 * 6
    for turn, rows in enumerate(([0, 1, 3, 4], [1, 2])):  # rows that made a tool call
        suffixes = [[5, 6, 7 + i][: 1 + (i + turn) % 3] for i in range(len(rows))]
        ids, mask = next_turn(ids, mask, out, rows, suffixes)
        out = model.generate(ids, attention_mask=mask, **KWARGS)
        assert torch.equal(out, hf(twin, ids, mask)), turn
        profile = handle.last_profile()
        # The call's rows' chunks only (each its last token and its tool answer), packed without padding;
        # the rollout's other rows compute nothing.
        assert profile.prefill_tokens == sum(1 + len(s) for s in suffixes)
        # Reused: each row's tokens after padding but its last (fed again), whose KV was kept.
        assert profile.reused_tokens == int(mask.sum()) - sum(len(s) for s in suffixes) - len(rows)


def step_optimizer(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()


def write_data(model):
    weight = model.lm_head.weight
    weight.data.copy_(weight.data.flip(0))  # through .data: no version counter bump


def replace_parameter(model):
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach() * 1.5)


def load_state(model):
    state = {k: v * 0.9 for k, v in model.state_dict().items()}
    model.load_state_dict(state)


@pytest.mark.parametrize("change", [step_optimizer, write_data, replace_parameter, load_state])
def test_a_weight_change_drops_the_kept_kv(change):
    model = FAMILIES["llama"]()
    handle = torchkvops.patch_generate(model)
    ids, mask = first_turn()
    out = model.generate(ids, attention_mask=mask, **KWARGS)
    change(model)
    ids, mask = next_turn(ids, mask, out, [0, 2], [[5, 6], [7]])
    out = model.generate(ids, attention_mask=mask, **KWARGS)
    assert handle.last_profile().reused_tokens == 0  # prefilled anew, by the new weights
    twin = copy.deepcopy(model)  # unpatched (copies are), with the changed weights
    assert torch.equal(out, hf(twin, ids, mask))


def test_reuse_off_release_and_calls_that_extend_nothing_prefill_anew():
    model, twin = FAMILIES["llama"](), FAMILIES["llama"]()
    ids, mask = first_turn()
    for setup in ("off", "release", "new row", "other settings"):
        handle = torchkvops.patch_generate(model, reuse_kv=setup != "off")
        out = model.generate(ids, attention_mask=mask, **KWARGS)
        if setup == "release":
            handle.release()
        rows, suffixes = [0, 3], [[5], [6, 7]]
        next_ids, next_mask = next_turn(ids, mask, out, rows, suffixes)
        if setup == "new row":  # a row that extends no kept row: the whole call is prefilled
            next_ids, next_mask = left_pad([*(r[m.bool()] for r, m in zip(next_ids, next_mask)), torch.tensor([9, 8])])
        kwargs = dict(KWARGS, eos_token_id=[41]) if setup == "other settings" else KWARGS
        result = model.generate(next_ids, attention_mask=next_mask, **kwargs)
        assert handle.last_profile().reused_tokens == 0, setup
        with torch.no_grad():
            assert torch.equal(result, twin.generate(next_ids, attention_mask=next_mask, **kwargs)), setup
        handle.undo()


def test_last_profile_is_none_after_a_fallback():
    model = FAMILIES["llama"]()
    handle = torchkvops.patch_generate(model)
    ids, mask = first_turn()
    model.generate(ids, attention_mask=mask, **KWARGS)
    assert handle.last_profile() is not None
    with pytest.warns(UserWarning, match="repetition_penalty"):
        model.generate(ids, attention_mask=mask, repetition_penalty=1.3, **KWARGS)
    assert handle.last_profile() is None


def test_reuse_kv_must_be_a_bool():
    with pytest.raises(ValueError, match="reuse_kv must be a bool, got 1"):
        torchkvops.patch_generate(FAMILIES["llama"](), reuse_kv=1)


# --- never stale: what else the kept KV depends on (issue #33) -------------------------------------------
def permute_kv_columns(model):
    """Values moved through .data: no version bump, and every sum and norm stays as it was."""
    for layer in model.model.layers:
        for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.weight.data[:, [0, 32]] = proj.weight.data[:, [32, 0]]


def permute_rotary_frequencies(model):
    inv_freq = model.model.rotary_emb.inv_freq
    inv_freq.data[[1, 5]] = inv_freq.data[[5, 1]]


def rescale_rotary(model):
    model.model.rotary_emb.attention_scaling = 1.25


def one_ulp(model):
    weight = model.model.layers[0].self_attn.k_proj.weight
    weight.data.view(-1)[7] = torch.nextafter(weight.data.view(-1)[7], torch.tensor(float("inf")))


@pytest.mark.parametrize("change", [permute_kv_columns, permute_rotary_frequencies, rescale_rotary, one_ulp])
def test_edits_that_keep_version_sum_and_norm_drop_the_kept_kv(change):
    """Writes a sum-and-norm checksum cannot see, a buffer's among them, and a plain float attribute the
    rotary embedding's forward reads: the next call is prefilled anew and equals HF's generate on the
    changed model."""
    model = FAMILIES["llama"]()
    handle = torchkvops.patch_generate(model)
    ids, mask = first_turn()
    out = model.generate(ids, attention_mask=mask, **KWARGS)
    change(model)
    ids, mask = next_turn(ids, mask, out, [0, 2, 4], [[5, 6], [7], [8, 9, 10]])
    out = model.generate(ids, attention_mask=mask, **KWARGS)
    assert handle.last_profile().reused_tokens == 0
    assert torch.equal(out, hf(copy.deepcopy(model), ids, mask))


def test_a_lora_scale_change_drops_the_kept_kv():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        FAMILIES["llama"](),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    handle = torchkvops.patch_generate(model)
    ids, mask = first_turn()
    out = model.generate(input_ids=ids, attention_mask=mask, **KWARGS)
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.set_scale("default", 0.25)
    ids, mask = next_turn(ids, mask, out, [0, 2, 4], [[5, 6], [7], [8, 9, 10]])
    out = model.generate(input_ids=ids, attention_mask=mask, **KWARGS)
    assert handle.last_profile().reused_tokens == 0
    twin = copy.deepcopy(model)  # unpatched, with the new scale
    with torch.no_grad():
        assert torch.equal(out, twin.generate(input_ids=ids, attention_mask=mask, **KWARGS))


def test_train_then_eval_drops_the_kv_computed_under_dropout():
    """A call in train mode (GPT-2 with residual and embedding dropout, none in attention: served) keeps
    KV computed under dropout; after eval() the next call must not read it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.2, resid_pdrop=0.3, embd_pdrop=0.3
    )
    config.attn_pdrop, config.vocab_size, config.eos_token_id, config.pad_token_id = 0.0, 96, 2, 0
    model = GPT2LMHeadModel(config).train()
    handle = torchkvops.patch_generate(model)
    ids, mask = first_turn()
    out = model.generate(ids, attention_mask=mask, **KWARGS)
    assert handle.last_profile() is not None  # served in train mode
    model.eval()
    ids, mask = next_turn(ids, mask, out, [0, 2, 4], [[5, 6], [7], [8, 9, 10]])
    out = model.generate(ids, attention_mask=mask, **KWARGS)
    assert handle.last_profile().reused_tokens == 0
    assert torch.equal(out, hf(copy.deepcopy(model), ids, mask))


def test_patch_generate_serves_a_compiled_model():
    """torch.compile(model) is an OptimizedModule whose generate is the compiled module's: patching it
    patches that module, and both generates are served."""
    model, twin = FAMILIES["llama"](), FAMILIES["llama"]()
    compiled = torch.compile(model)
    handle = torchkvops.patch_generate(compiled)
    ids, mask = first_turn()
    for call in (compiled.generate, model.generate):
        out = call(ids, attention_mask=mask, **KWARGS)
        assert handle.last_profile() is not None and handle.last_profile().generated_tokens > 0
        assert torch.equal(out, hf(twin, ids, mask))
    assert torch.equal(torchkvops.generate(compiled, ids, attention_mask=mask, **KWARGS), hf(twin, ids, mask))
    handle.undo()
    assert "generate" not in vars(model)


def test_the_int32_product_of_the_value_hash_wraps():
    """The value hash relies on int32 products wrapping modulo 2^32 (two's complement)."""
    a, b = [2**30, -(2**31), 123456789, -987654321], [4, 3, 97, 2**31 - 1]
    product = torch.tensor(a, dtype=torch.int32) * torch.tensor(b, dtype=torch.int32)
    assert product.tolist() == [(x * y + 2**31) % 2**32 - 2**31 for x, y in zip(a, b)]


def random_edit(model, g) -> str:
    """One in-place edit of a random parameter or buffer, of a random kind, through a random path."""
    tensors = [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers()) if t.numel() > 1]
    name, t = tensors[int(torch.randint(len(tensors), (1,), generator=g))]
    flat = t.data.view(-1)
    i, j = torch.randperm(flat.numel(), generator=g)[:2].tolist()
    kind = ["swap", "sign", "ulp", "copy_"][int(torch.randint(4, (1,), generator=g))]
    new = flat.clone()
    if kind == "swap":
        if new[i] == new[j]:
            new[i] = torch.nextafter(new[i], torch.tensor(float("inf"), dtype=new.dtype))
        new[[i, j]] = new[[j, i]]
    elif kind == "sign":
        new[i] = -new[i] if new[i] != 0 else 1.0
    elif kind == "ulp":
        new[i] = torch.nextafter(new[i], torch.tensor(float("inf"), dtype=new.dtype))
    else:
        new[i:] = new[i:].roll(1)
        if torch.equal(new, flat):
            new[i] = torch.nextafter(new[i], torch.tensor(float("inf"), dtype=new.dtype))
    via = ["data", "no_grad"][int(torch.randint(2, (1,), generator=g))]
    if via == "data":
        t.data.view(-1).copy_(new)
    else:
        with torch.no_grad():
            t.view(-1).copy_(new)
    return f"{kind} via {via} on {name}"


def test_randomized_in_place_edits_each_drop_the_kept_kv():
    """Many edits of many kinds (swaps, sign flips, one-ulp changes, rotations written with copy_; through
    .data or under torch.no_grad; parameters and buffers), each after a served call: the fingerprint sees
    every one, and the next call through patch_generate is prefilled anew."""
    from torchkvops.hf.generate_reuse import kv_fingerprint
    from torchkvops.models import ModelAdapter

    model = FAMILIES["llama"]()
    adapter_state = ModelAdapter(model).adapter_state()
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        before = kv_fingerprint(model, adapter_state)
        what = random_edit(model, g)
        assert kv_fingerprint(model, adapter_state) != before, (trial, what)
    handle = torchkvops.patch_generate(model)
    for trial in range(6):
        ids, mask = first_turn()
        out = model.generate(ids, attention_mask=mask, **KWARGS)
        what = random_edit(model, g)
        ids, mask = next_turn(ids, mask, out, [1, 3], [[5], [6, 7]])
        model.generate(ids, attention_mask=mask, **KWARGS)
        assert handle.last_profile().reused_tokens == 0, (trial, what)
