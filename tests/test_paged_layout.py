"""kv_sharing="paged": the copy layout's rows with their KV in blocks of a pool taken as each row grows
(torchkvops.rollout.paged_store). Oracles: the copy layout's tokens and log-probabilities (the same rows, read
through tables instead of one buffer row each), Hugging Face's greedy generate, and the bytes of what the
rows hold, counted from the output. The layouts' shared tests (turns, compaction, windows, hybrids, a common
prefix, graph keys) run the paged layout too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from families import tiny_model
from models import FAMILIES, hf_greedy, prompts

from torchkvops import Rollout, RolloutConfig
from torchkvops.models.adapter import KVShape
from torchkvops.rollout import attention
from torchkvops.rollout.paged_store import KV_BLOCK_SIZE, SCRATCH_BLOCK, PagedStore

EOS = [11, 23, 37, 45]


@pytest.fixture(scope="module")
def llama():
    """A tiny llama whose positions cover the budgets below."""
    return tiny_model("llama", max_position_embeddings=8192)


def sampled(kv_sharing: str, max_new_tokens: int, **options) -> RolloutConfig:
    return RolloutConfig(
        samples_per_prompt=3,
        max_new_tokens=max_new_tokens,
        kv_sharing=kv_sharing,
        temperature=1.0,
        seed=4,
        eos_token_id=EOS,
        return_logprobs=True,
        enable_profiling=True,
        **options,
    )


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_paged_greedy_matches_hf_generate(family, padded):
    model = FAMILIES[family]()
    ids, mask = prompts(3, 21, seed=5, left_pad=[0, 4, 17] if padded else None)
    config = RolloutConfig(samples_per_prompt=2, max_new_tokens=40, eos_token_id=[], kv_sharing="paged")
    out = Rollout(model, config).generate(ids, mask)
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, 40).repeat_interleave(2, dim=0))


def test_the_paged_layout_is_the_default_but_for_the_expanded_baseline():
    """RolloutConfig's kv_sharing=None: "paged", or "copy" with shared_prefill=False (no prompt's blocks to
    share); a layout named is kept, each on the pool (its name says how rows read their prompt's blocks),
    the expanded baseline's too (each row its own prompt's blocks), and the paged one still refuses the
    expanded baseline by name."""
    assert RolloutConfig().kv_sharing == "paged"
    assert RolloutConfig(shared_prefill=False).kv_sharing == "copy"
    for layout in ("copy", "prefix", "paged"):
        assert RolloutConfig(kv_sharing=layout).kv_sharing == layout
        assert Rollout(FAMILIES["llama"](), RolloutConfig(kv_sharing=layout)).layout.paged
    assert Rollout(FAMILIES["llama"](), RolloutConfig(shared_prefill=False)).layout.paged
    with pytest.raises(ValueError, match=r"kv_sharing 'paged' needs shared_prefill=True"):
        RolloutConfig(kv_sharing="paged", shared_prefill=False)


def test_paged_samples_and_logprobs_equal_the_copy_layouts(llama):
    """Rows that end at spread steps (compaction: the tables move, not the KV), prompts whose last blocks are
    partly filled (16-token blocks, prompts of 21 columns): the tokens and log-probabilities of the dense
    copy layout (the expanded baseline's: a buffer row per row, each prefilled alone)."""
    ids, mask = prompts(3, 21, seed=2, left_pad=[0, 2, 5])
    copy = Rollout(llama, sampled("copy", 200, shared_prefill=False)).generate(ids, mask)
    rollout = Rollout(llama, sampled("paged", 200))
    paged = rollout.generate(ids, mask)
    assert torch.equal(paged.sequences, copy.sequences)
    torch.testing.assert_close(paged.logprobs, copy.logprobs, rtol=1e-5, atol=1e-6)
    lengths = paged.response_mask.sum(dim=1)
    assert int(lengths.max()) > 2 * KV_BLOCK_SIZE and int(lengths.min()) < int(lengths.max())  # spread
    assert rollout.decode_counters().compactions > 0


def test_the_kv_held_follows_what_the_rows_hold(llama):
    """The peak KV bytes of a call: each prompt's blocks once, each row's own blocks for its tokens, and at
    most a block a row of headroom (blocks are taken a stretch of steps ahead), whatever the budget; the
    expanded baseline's rows each their own copy of the prompt."""
    ids, mask = prompts(3, 40, seed=2)
    outputs, profiles = {}, {}
    for kv_sharing, budget in (("paged", 256), ("paged", 4096), ("copy", 4096)):
        options = dict(shared_prefill=False) if kv_sharing == "copy" else {}
        rollout = Rollout(llama, sampled(kv_sharing, budget, **options))
        outputs[kv_sharing, budget] = rollout.generate(ids, mask)
        profiles[kv_sharing, budget] = rollout.get_last_profile()
    out = outputs["paged", 4096]
    assert int(out.response_mask.sum(dim=1).max()) < 200, "the rows must end long before the budgets"
    width = outputs["paged", 256].responses.shape[1]
    assert torch.equal(out.responses[:, :width], outputs["paged", 256].responses)
    # Bytes of a token's K and V in every layer (the model's config, not the cache's).
    config = llama.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    block = KV_BLOCK_SIZE * per_token
    # What the rows hold at the end: each prompt once (40 tokens: 2 full blocks shared, the third partly
    # filled, copied per row), each row its tokens after the prompt (the last one is never fed back).
    rows, lengths = out.responses.shape[0], out.response_mask.sum(dim=1).tolist()
    prompt_blocks = 3 * (40 // KV_BLOCK_SIZE)
    own_blocks = sum(-(-(40 % KV_BLOCK_SIZE + n - 1) // KV_BLOCK_SIZE) for n in lengths)
    held = (prompt_blocks + own_blocks) * block
    for budget in (256, 4096):
        used = profiles["paged", budget].kv_cache_bytes
        assert held <= used <= held + (rows + 1) * block, (budget, used, held)
    assert profiles["paged", 4096].kv_cache_bytes == profiles["paged", 256].kv_cache_bytes
    copies = sum(-(-(40 + n - 1) // KV_BLOCK_SIZE) for n in lengths) * block  # (every row its prompt's blocks)
    assert copies <= profiles["copy", 4096].kv_cache_bytes <= copies + (rows + 1) * block
    assert profiles["paged", 4096].kv_cache_bytes < profiles["copy", 4096].kv_cache_bytes


def assert_every_block_is_held_by_a_row_that_reads_it(store) -> None:
    """The blocks the pool holds are exactly the scratch block and those the rows' tables name (none lost,
    none returned while a table names it), and the device tables name the host tables' blocks."""
    named = {b for r in range(store.tables.rows) for b in store.tables.blocks[r]}
    assert store.pool.num_held == len(named) + 1 and SCRATCH_BLOCK not in named
    store.pool.check_held(sorted(named))
    for r in range(store.tables.rows):
        held = store.tables.blocks[r]
        assert store.table[r, : len(held)].tolist() == held


def test_after_each_call_every_block_is_held_by_a_row_that_reads_it(llama):
    """After a call, a turn and the next call: no block lost and none read after it is returned; a prompt's
    full blocks are held once by each of its N rows."""
    ids, mask = prompts(2, 40, seed=3)
    rollout = Rollout(llama, sampled("paged", 100))
    out = rollout.generate(ids, mask)
    store = rollout.cache.paged
    assert_every_block_is_held_by_a_row_that_reads_it(store)
    first_full_block = store.tables.blocks[0][0]
    assert store.pool.refs[first_full_block] == 3  # prompt 0's first block, shared by its 3 rows
    assert all(store.tables.blocks[r][0] == first_full_block for r in range(3))
    assert store.tables.blocks[3][0] != first_full_block  # prompt 1's rows hold prompt 1's blocks
    rollout.extend(out, [[5, 6]] * out.responses.shape[0])  # a turn takes blocks for its tokens
    assert_every_block_is_held_by_a_row_that_reads_it(store)
    rollout.generate(ids, mask)  # every earlier block given back: the same blocks as the first call
    assert_every_block_is_held_by_a_row_that_reads_it(store)
    assert store.pool.refs[first_full_block] == 3


def test_a_layer_the_paged_operator_does_not_take_reads_the_rows_blocks_densely(llama, monkeypatch):
    """Where paged_attention does not take a layer (its dtype, a head size over 256), each row's blocks are
    gathered through its table and read by the dense attention: the copy layout's tokens, read densely too."""
    monkeypatch.setattr(attention, "_reads_paged", lambda query, key: False)
    ids, mask = prompts(3, 21, seed=2, left_pad=[0, 2, 5])
    outs = [Rollout(llama, sampled(kv, 60)).generate(ids, mask) for kv in ("copy", "paged")]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    torch.testing.assert_close(outs[0].logprobs, outs[1].logprobs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options,field",
    [(dict(shared_prefill=False), "kv_sharing")],
    ids=["expanded"],
)
def test_what_the_paged_layout_does_not_take_is_refused_by_name(options, field):
    with pytest.raises(ValueError, match=f"RolloutConfig.{field} .*paged"):
        RolloutConfig(kv_sharing="paged", **options)


def test_a_compiled_paged_decode_gives_the_eager_tokens(llama):
    """The decode step compiled (slot writes into the pool through the tables, paged attention): the eager
    tokens, and a second call compiles nothing more."""
    ids, mask = prompts(2, 21, seed=2, left_pad=[0, 3])
    config = sampled("paged", 40)
    eager = Rollout(llama, config).generate(ids, mask)
    rollout = Rollout(llama, dataclasses.replace(config, compile=True))
    compiled = rollout.generate(ids, mask)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=1e-4, atol=1e-4)
    assert rollout.decode_counters().compiled_steps > 0
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again = rollout.generate(ids, mask)
    assert torch.equal(again.sequences, eager.sequences)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before


def test_a_streamed_prompts_blocks_are_shared_by_its_samples_and_given_back_by_them():
    """Under a row budget a prompt is written once into a table of its own; each sample that gets a row
    forks it (full blocks shared, the partly filled one copied), and the prompt's table gives its blocks
    back once its last sample has forked (the scheduler releases it): from then on its samples alone hold
    them."""
    store = PagedStore([KVShape(layers=2, kv_heads=2, head_dim=4)], torch.float32, torch.device("cpu"))
    store.prepare(rows=6 + 2, columns=64, expected_blocks=16, samples=6)  # 2 prompts x 3 samples
    prompt = store.prompt_table(1)
    assert prompt == 7
    store.reserve([prompt], [40])  # 2 full blocks and a partly filled one
    full, partial = store.tables.blocks[prompt][:2], store.tables.blocks[prompt][2]
    store.fork_to(1, [3, 4])
    assert [store.pool.refs[b] for b in full] == [3, 3] and store.pool.refs[partial] == 1
    assert store.tables.blocks[3][:2] == full and store.tables.blocks[3][2] not in (partial, store.tables.blocks[4][2])
    store.fork_to(1, [5])
    store.release_prompt(1)
    assert store.tables.blocks[prompt] == [] and [store.pool.refs[b] for b in full] == [3, 3]
    assert store.pool.refs[partial] == 0  # the prompt's own partly filled block: back in the pool
    for sample in (3, 4, 5):
        store.tables.release(sample)
    assert store.pool.num_held == 1  # the scratch block alone


@pytest.mark.parametrize("common", [0, 20, 32], ids=["no-common-prefix", "common-partial-block", "common-whole-blocks"])
def test_placed_prompts_are_read_in_place_as_their_tables_gather_them(common):
    """Prompts laid out for the stacked read (`place_prompts`: a common prefix's whole blocks from block 1,
    each prompt's own run a fixed stride apart), written, forked to their samples: the store says so
    (`prompts_in_place`), and the pool's views (`block_runs`) hold what the tables gather; a store whose
    prompt blocks lie elsewhere says not."""
    from torchkvops.rollout.paged_kv import block_runs, gather_blocks

    store = PagedStore([KVShape(layers=1, kv_heads=2, head_dim=4)], torch.float32, torch.device("cpu"))
    store.prepare(rows=3 * 2, columns=96, expected_blocks=4)  # (smaller than the runs: the pool grows)
    width, first = 70, common // KV_BLOCK_SIZE
    blocks = width // KV_BLOCK_SIZE - first  # each prompt's whole blocks past the common prefix's
    if common:
        store.reserve([0], [common])
    store.place_prompts(3, first, blocks)
    if common:
        store.fork_prompts(1, 3)  # (the common prefix to every prompt's row, as share_common does)
    store.reserve([0, 1, 2], [width, 61, 48])
    pool = store.kv[0].pool
    pool.copy_(torch.randn(pool.shape))  # (every block written)
    store.end_placement()
    store.fork_prompts(3, 2)
    homes = [0, 2, 4]
    assert store.prompts_in_place(homes, first, blocks)
    table = store.table[homes].long()
    for kv in (0, 1):
        layer = pool[0, kv]
        own = block_runs(layer, 1 + first, 3, blocks, blocks + 1)
        for i, end in enumerate([width, 61, 48]):  # (past a prompt's own whole blocks the read masks the keys)
            n = min(end // KV_BLOCK_SIZE, first + blocks) - first
            gathered = gather_blocks(layer, table[i : i + 1, first : first + n])
            assert n > 0 and torch.equal(own[i : i + 1, :, : n * KV_BLOCK_SIZE], gathered)
        if first:
            assert torch.equal(block_runs(layer, 1, 1, first, first), gather_blocks(layer, table[:1, :first]))
    # Without the placement the prompts' blocks follow one another: no fixed stride to view.
    plain = PagedStore([KVShape(layers=1, kv_heads=2, head_dim=4)], torch.float32, torch.device("cpu"))
    plain.prepare(rows=3 * 2, columns=96, expected_blocks=64)
    if common:
        plain.reserve([0], [common])
        plain.fork_prompts(1, 3)
    plain.reserve([0, 1, 2], [width, 61, 48])
    plain.fork_prompts(3, 2)
    assert not plain.prompts_in_place(homes, first, blocks)
