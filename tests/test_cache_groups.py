"""Cache groups without a model: a KV cache of two groups of different shapes (layers 0 and 2: 2 KV heads of
8; layers 1 and 3: 1 KV head of 16), and a fifth layer that reads layer 1's KV, in both layouts. Each
layer's K and V are written through the forwards' metadata (prefill, decode, packed) and must end in its own
group's buffers at the right rows and columns, through prompt expansion, compaction (to work views, then in
place), finish_decode and grow, against a plain-PyTorch reference kept per layer."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from torchkvops.models.adapter import FULL_ATTENTION, CacheSpec, GroupSpec, KVShape
from torchkvops.rollout import attention
from torchkvops.rollout.attention import DecodeAttention, PackedAttention, PrefillForward, torchkvops_attention
from torchkvops.rollout.kv_cache import RolloutKVCache
from torchkvops.rollout.layouts import CopyLayout

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


def make() -> tuple[RolloutKVCache, CopyLayout]:
    """The dense copy layout's buffers (the expanded baseline's; the pool's groups: tests/test_paged_layout.py)."""
    cache = RolloutKVCache(SPEC, torch.float32, torch.device("cpu"))
    layout = CopyLayout(N)
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


def test_each_layer_keeps_its_kv_in_its_group_through_expansion_decode_compaction_and_grow():
    cache, layout = make()
    written = prefill(cache)
    layout.expand_prompts(cache, B, P)
    # Reference, per stored layer: every row's decode KV [2, ROWS, ...], its prompt's first.
    first = P
    columns = stored(cache, 0, "decode_kv").shape[3]
    ref = {}
    for layer in STORED:
        heads, dim = HEADS[layer]
        ref[layer] = torch.zeros(2, ROWS, heads, columns, dim)
        ref[layer][:, :, :, :P] = written[layer].repeat_interleave(N, dim=1)  # each prompt's KV in its N rows
        assert torch.equal(stored(cache, layer, "decode_kv"), ref[layer])

    def decode_step(column: int, rows: torch.Tensor) -> None:
        """One decode step of the current rows (`rows`: their home rows) at `column`, every layer."""
        context = DecodeAttention(kv=cache.decode_views, columns=torch.full((rows.numel(),), column))
        cache.bind(context)
        for layer in range(5):
            k, v = kv(layer, rows.numel(), 1)
            out_k, out_v = cache.update(k, v, layer)
            source = 1 if layer == 4 else layer
            assert torch.equal(torch.stack([out_k, out_v]), stored(cache, source, "decode_kv"))
            if layer in STORED:
                ref[layer].select(3, column)[:, rows] = torch.stack([k, v])[:, :, :, 0]

    def check_home() -> None:
        for layer in STORED:
            assert torch.equal(stored(cache, layer, "home_decode_kv"), ref[layer]), layer

    all_rows = torch.arange(ROWS)
    decode_step(first, all_rows)
    check_home()
    # Compaction to work views, a step, then in place to fewer rows, a step, then every row home.
    rows = torch.tensor([5, 0, 3, 4])
    cache.compact(rows, None, all_rows)
    for layer in STORED:
        assert torch.equal(stored(cache, layer, "decode_kv"), ref[layer].index_select(1, rows))
    decode_step(first + 1, rows)
    rows2 = torch.tensor([3, 0])
    cache.compact(rows2, None, rows)
    for layer in STORED:
        assert torch.equal(stored(cache, layer, "decode_kv"), ref[layer].index_select(1, rows[rows2]))
    decode_step(first + 2, rows[rows2])
    cache.finish_decode(rows[rows2])
    check_home()
    # A longer history: every group's decode buffer grows, its KV kept.
    cache.grow(columns + 8)
    for layer in STORED:
        grown = stored(cache, layer, "decode_kv")
        assert grown.shape[3] == columns + 8 and torch.equal(grown[:, :, :, :columns], ref[layer])
        ref[layer] = grown.clone()
    # A packed forward (a turn): tokens of rows 1 and 4 at their own columns, into each layer's group.
    token_rows, token_columns = torch.tensor([1, 1, 4]), torch.tensor([columns, columns + 1, columns])
    unused = dict(slots=None, query_columns=None, token_slot=None, keys=None, allowed=None)  # (attend's)
    packed = PackedAttention(torch.tensor([1, 4]), token_rows, token_columns, **unused)
    cache.bind(packed.bind(cache.decode_views))
    for layer in range(5):
        k, v = kv(layer, 1, 3)
        out_k, _ = cache.update(k, v, layer)
        assert out_k is not None and torch.equal(out_k, stored(cache, 1 if layer == 4 else layer, "decode_kv")[0])
        for t, (row, column) in enumerate(zip(token_rows.tolist(), token_columns.tolist())):
            if layer in STORED:
                ref[layer][:, row, :, column] = torch.stack([k, v])[:, 0, :, t]
    for layer in STORED:
        assert torch.equal(stored(cache, layer, "decode_kv"), ref[layer])


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
    from torchkvops.models.adapter import SLIDING_WINDOW
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
