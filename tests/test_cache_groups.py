"""Cache groups: a KV cache of two groups of different shapes (layers 0 and 2: 2 KV heads of 8; layers 1
and 3: 1 KV head of 16), and a fifth layer that reads layer 1's KV, without a model (dense buffers: the
groups' shapes and checks, an in-place compaction's gather, the decode attention reading each layer from
its group); and models whose layers keep KV of several shapes or read another layer's, through decode,
compaction and turns in the pool, against HF's generate."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from torchkvops.models.adapter import CacheSpec, GroupSpec, KVShape
from torchkvops.models.families import FULL_ATTENTION
from torchkvops.rollout import attention
from torchkvops.rollout.attention import DecodeAttention, PrefillForward, torchkvops_attention
from torchkvops.rollout.kv_cache import RolloutKVCache
from torchkvops.rollout.layouts import DenseLayout

SPEC = CacheSpec(
    (GroupSpec(FULL_ATTENTION, (0, 2), 2, 8), GroupSpec(FULL_ATTENTION, (1, 3), 1, 16)),
    reads=(0, 1, 2, 3, 1),  # layer 4 reads layer 1's KV and writes none
)
# Where the test expects each stored layer's KV: (group, index in it), and each layer's (kv_heads, head_dim).
WHERE = {0: (0, 0), 2: (0, 1), 1: (1, 0), 3: (1, 1)}
HEADS = {0: (2, 8), 2: (2, 8), 1: (1, 16), 3: (1, 16), 4: (1, 16)}
STORED = (0, 1, 2, 3)
B, N, P = 2, 3, 5  # prompts, samples per prompt, prompt length
ROWS = B * N


def make() -> tuple[RolloutKVCache, DenseLayout]:
    """Dense buffers (DenseLayout: the moves a hybrid's recurrent states make; the pool's groups: tests/test_paged_layout.py)."""
    cache = RolloutKVCache(SPEC, torch.float32, torch.device("cpu"))
    layout = DenseLayout(N)
    cache.prepare(layout, B, ROWS, layout.kv_lengths(P, 6))
    return cache, layout


def stored(cache: RolloutKVCache, layer: int, buffer: str) -> torch.Tensor:
    """Layer `layer`'s [2, rows, kv_heads, tokens, head_dim] in the buffer named `buffer` of its group."""
    group, index = WHERE[layer]
    return getattr(cache.groups[group], buffer)[index]


def kv(layer: int, rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    heads, dim = HEADS[layer]
    return torch.randn(rows, heads, tokens, dim), torch.randn(rows, heads, tokens, dim)


def prefill(cache: RolloutKVCache) -> dict[int, torch.Tensor]:
    """Each stored layer's prompts' K and V through PrefillForward: {layer: [2, B, heads, P, dim]}."""
    cache.bind(PrefillForward().bind(cache.prompt_views))
    written = {}
    for layer in range(5):
        k, v = kv(layer, B, P)
        out_k, out_v = cache.update(k, v, layer)
        if layer in STORED:
            written[layer] = torch.stack([k, v])
            assert torch.equal(out_k, k) and torch.equal(out_v, v)
        else:  # the shared layer attends to layer 1's prompts' KV
            assert torch.equal(torch.stack([out_k, out_v]), written[1])
    return written


def test_the_spec_refuses_layers_stored_twice_or_reading_what_no_group_stores():
    with pytest.raises(ValueError, match="two cache groups"):
        CacheSpec((GroupSpec(FULL_ATTENTION, (0, 1), 1, 4), GroupSpec(FULL_ATTENTION, (1,), 1, 4)), (0, 1))
    with pytest.raises(ValueError, match="reads layer 2"):  # layer 2 reads itself but no group stores it
        CacheSpec((GroupSpec(FULL_ATTENTION, (0, 1), 1, 4),), (0, 1, 2))
    with pytest.raises(ValueError, match="reads layer 2"):  # layer 1 reads a layer no group stores
        CacheSpec((GroupSpec(FULL_ATTENTION, (0,), 1, 4),), (0, 2))
    single = CacheSpec.single(KVShape(3, 2, 4))
    assert single.reads == (0, 1, 2) and [g.layers for g in single.groups] == [(0, 1, 2)]


def test_each_group_has_its_own_shape_and_a_layer_is_checked_against_its_group():
    cache, _ = make()
    # P + 6 - 1 = 10 positions, rounded up to 64; the prompts are the decode buffer's first columns.
    assert [tuple(g.decode_kv.shape) for g in cache.groups] == [(2, 2, ROWS, 2, 64, 8), (2, 2, ROWS, 1, 64, 16)]
    assert all(g.prompt_kv is g.decode_kv for g in cache.groups)
    assert [cache.group_of(layer)[1] for layer in range(5)] == [0, 0, 1, 1, 0]
    assert cache.group_of(4)[0] is cache.group_of(1)[0] is cache.groups[1]
    elements = sum(math.prod(HEADS[layer]) for layer in STORED) * 2
    assert cache.used_bytes == elements * 4 * ROWS * 64  # float32, every group's buffers
    cache.bind(PrefillForward().bind(cache.prompt_views))
    with pytest.raises(ValueError, match="layer 1 produced keys"):
        cache.update(*kv(0, B, P), 1)  # layer 0's shape is not layer 1's group's


@pytest.mark.parametrize("family", ["gemma4_text", "gemma3n_text"])
def test_each_layer_keeps_its_kv_in_its_group_through_expansion_decode_compaction_and_turns(family):
    """Per-layer KV shapes (gemma4: a group per shape in the pool) and layers that read an earlier layer's
    KV (gemma3n, gemma4), with rows that end at spread steps (compaction moves their tables) and two
    turns (packed forwards into every group, histories widened): HF's greedy tokens on each row's full
    history. (Until the expanded baseline moved onto the pool, 2026-12-07, this was checked on the dense
    buffers without a model.)"""
    from families import tiny_model
    from models import prompts
    from test_turns import EOS as TURN_EOS
    from test_turns import run_turns

    from torchkvops import RolloutConfig

    model = tiny_model(family)
    if model is None:
        pytest.skip(f"{family}: not in this transformers")
    config = RolloutConfig(samples_per_prompt=2, max_new_tokens=10, eos_token_id=TURN_EOS)
    ids, mask = prompts(3, 7, seed=1, left_pad=[0, 2, 3])
    rollout, _ = run_turns(model, config, ids, mask, turns=2, appended_lengths=(0, 12), finished_at={1: (3,)})
    assert rollout.decode_counters().compactions > 0
    assert len(rollout.cache.paged.kv) == 2  # (gemma4: a pool per KV shape; gemma3n: its sliding layers' window pool)


def test_in_place_compaction_of_two_groups_gathers_every_layer():
    """The streaming batch's gather: into smaller views of the same allocation, group after group."""
    cache, layout = make()
    before = {}
    for group in cache.groups:
        for view in group.home:
            view.copy_(torch.randn(view.shape))
    for layer in STORED:
        before[layer] = stored(cache, layer, "decode_kv").clone()
    storage = cache.groups[0].decode_kv.untyped_storage().data_ptr()
    rows = torch.tensor([4, 1, 2])
    cache.compact_in_place(rows, None)
    assert not cache.compacted and cache.groups[0].decode_kv.untyped_storage().data_ptr() == storage
    for layer in STORED:
        assert torch.equal(stored(cache, layer, "decode_kv"), before[layer].index_select(1, rows)), layer


def test_the_decode_attention_reads_each_layer_from_its_group():
    """torchkvops_attention over each row's columns (its prompt's, expanded, and its own first), for each
    layer (the shared layer: layer 1's), against plain softmax attention over the same keys."""
    cache, layout = make()
    written = prefill(cache)
    layout.expand_prompts(cache, B, P)
    decode = {layer: stored(cache, layer, "decode_kv") for layer in STORED}
    for layer in STORED:
        decode[layer][:, :, :, P] = torch.randn_like(decode[layer][:, :, :, P])
    bias = torch.full((ROWS, 1, 1, cache.decode_views.tokens), float("-inf"))
    bias[..., : P + 1] = 0.0
    context = DecodeAttention(
        kv=cache.decode_views,
        columns=torch.full((ROWS,), P),
        kv_start=torch.zeros(ROWS, dtype=torch.int32),  # each row reads its columns [0, P + 1)
        kv_length=torch.full((ROWS,), P + 1, dtype=torch.int32),
        kv_table=torch.arange(ROWS, dtype=torch.int32)[:, None],
    )
    attention._active = context
    try:
        for layer in range(5):
            source = 1 if layer == 4 else layer
            kv_heads, dim = HEADS[layer]
            query = torch.randn(ROWS, 2 * kv_heads, 1, dim)
            own = decode[source]
            out, _ = torchkvops_attention(SimpleNamespace(layer_idx=layer), query, own[0], own[1], bias, scaling=0.5)
            # Row r: its prompt's (r // N) P columns, then its own; each KV head for 2 query heads.
            prompt = written[source].repeat_interleave(N, dim=1)
            assert torch.equal(own[:, :, :, :P], prompt)
            keys = own[0][:, :, : P + 1].repeat_interleave(2, dim=1)
            values = own[1][:, :, : P + 1].repeat_interleave(2, dim=1)
            expected = torch.softmax(query @ keys.transpose(2, 3) * 0.5, dim=-1) @ values
            torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)
    finally:
        attention._active = None


def test_a_config_with_sliding_layers_gives_a_sliding_window_group_beside_the_full_one():
    """gemma3-small's config (five sliding layers of window 512, then a global one): one group of each
    kind, the window on the sliding one only, and the cache's groups of those kinds; a group whose kind
    and window disagree is refused."""
    from torchkvops.models import model_config
    from torchkvops.models.families import SLIDING_WINDOW
    from torchkvops.rollout.cache_groups import CacheGroup, SlidingWindowGroup

    spec = CacheSpec.from_config(model_config("gemma3-small"))
    assert [(g.kind, g.layers, g.window) for g in spec.groups] == [
        (SLIDING_WINDOW, (0, 1, 2, 3, 4), 512),
        (FULL_ATTENTION, (5,), None),
    ]
    cache = RolloutKVCache(spec, torch.float32, torch.device("cpu"))
    assert [type(g) for g in cache.groups] == [SlidingWindowGroup, CacheGroup]
    assert cache.slots == tuple((0, i) for i in range(5)) + ((1, 0),)
    with pytest.raises(ValueError, match="only a sliding one has one"):
        GroupSpec(FULL_ATTENTION, (0,), 1, 4, window=8)
    with pytest.raises(ValueError, match="only a sliding one has one"):
        GroupSpec(SLIDING_WINDOW, (0,), 1, 4)
