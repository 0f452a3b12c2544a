"""A cache group's KV pool on the device (torchkvops.rollout.paged_kv) with the host's tables
(torchkvops.rollout.block_pool): rows forked from prompts and grown to ragged lengths, written slot by
slot and step by step as a rollout writes them, read back densely and through paged_attention, against
per-row dense KV kept beside them (the oracle)."""

import pytest
import torch

from torchkvops.rollout.block_pool import BlockPool, BlockTables
from torchkvops.rollout.paged_kv import PagedKV, slot_mapping

LAYERS, HEADS, KV_HEADS, DIM = 2, 4, 2, 16


def rollout_kv(block_size: int, prompt_lens=(5, 9), samples=3, steps=(1, 7, 18), dtype=torch.float32):
    """Prompts prefilled into their rows, forked to `samples` rows each, then rows decoding one token a step
    for ragged numbers of steps; returns (pool, tables, rows' dense KV [layers, 2, heads, tokens, dim])."""
    torch.manual_seed(block_size)
    rows = len(prompt_lens) * samples
    pool = BlockPool(256, block_size)
    tables = BlockTables(pool, rows + len(prompt_lens), max_blocks=64)
    kv = PagedKV(LAYERS, KV_HEADS, DIM, block_size, pool.num_blocks, dtype, "cpu")
    dense: list = [None] * rows  # each row's KV, filled below

    def write(row: int, new: torch.Tensor) -> None:  # new: [layers, 2, kv_heads, tokens, dim]
        start = tables.lengths[row]
        tables.append(row, new.shape[3])
        slots = torch.tensor([tables.slots(row, start, new.shape[3])])
        for layer in range(LAYERS):
            kv.write(layer, new[layer, 0][None], new[layer, 1][None], slots)

    for p, length in enumerate(prompt_lens):
        prompt_row = rows + p
        prompt = torch.randn(LAYERS, 2, KV_HEADS, length, DIM, dtype=dtype)
        write(prompt_row, prompt)
        children = list(range(p * samples, (p + 1) * samples))
        kv.copy_blocks(tables.fork(prompt_row, children))
        for c in children:
            dense[c] = prompt.clone()
        tables.release(prompt_row)  # the samples' references keep the shared blocks
    # Decode: each step every row still going writes one token at its column (slot_mapping on the device).
    ends = [steps[r % len(steps)] for r in range(rows)]
    for step in range(max(ends)):
        live = [r for r in range(rows) if step < ends[r]]
        columns = torch.tensor([tables.lengths[r] for r in live])
        for r in live:
            tables.append(r, 1)
        device_tables = tables.tensor()[live]
        slots = slot_mapping(device_tables, columns, block_size)
        new = torch.randn(LAYERS, 2, len(live), KV_HEADS, 1, DIM, dtype=dtype)
        for layer in range(LAYERS):
            kv.write(layer, new[layer, 0], new[layer, 1], slots)
        for i, r in enumerate(live):
            dense[r] = torch.cat([dense[r], new[:, :, i]], dim=3)
    return kv, tables, dense


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_rows_read_back_densely_are_what_was_written(block_size):
    kv, tables, dense = rollout_kv(block_size)
    longest = max(tables.lengths)
    for layer in range(LAYERS):
        k, v = kv.dense(layer, tables.tensor(), longest)
        for r, expected in enumerate(dense):
            n = expected.shape[3]
            torch.testing.assert_close(k[r, :, :n], expected[layer, 0], rtol=0, atol=0)
            torch.testing.assert_close(v[r, :, :n], expected[layer, 1], rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [0, 6])
def test_decode_attention_through_the_tables_equals_dense_attention_per_row(block_size, window):
    kv, tables, dense = rollout_kv(block_size)
    q = torch.randn(len(dense), HEADS, DIM)
    lengths = torch.tensor(tables.lengths[: len(dense)], dtype=torch.int32)
    for layer in range(LAYERS):
        out, lse = kv.attend(layer, q, tables.tensor()[: len(dense)], lengths, window=window)
        for r, rows_kv in enumerate(dense):
            k, v = (t.repeat_interleave(HEADS // KV_HEADS, 0) for t in rows_kv[layer])  # [heads, tokens, dim]
            n = k.shape[1]
            bias = torch.zeros(n)
            if window:
                bias[: max(0, n - window)] = float("-inf")
            scores = q[r, :, None] @ k.transpose(1, 2) * DIM**-0.5 + bias
            torch.testing.assert_close(out[r], (torch.softmax(scores, -1) @ v)[:, 0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[r], torch.logsumexp(scores, -1)[:, 0], rtol=1e-5, atol=1e-5)


def test_a_grown_pool_keeps_every_block_and_its_tables():
    kv, tables, dense = rollout_kv(4)
    before = kv.pool.clone()
    kv.grow(kv.num_blocks + 10)
    assert kv.num_blocks == before.shape[2] + 10
    torch.testing.assert_close(kv.pool[:, :, : before.shape[2]], before, rtol=0, atol=0)
    k, _ = kv.dense(1, tables.tensor(), max(tables.lengths))
    torch.testing.assert_close(k[0, :, : dense[0].shape[3]], dense[0][1, 0], rtol=0, atol=0)


def test_slot_mapping_of_several_tokens_a_row():
    tables = torch.tensor([[3, 7, 1], [2, 0, 5]], dtype=torch.int32)
    columns = torch.tensor([[0, 3, 4, 9], [5, 6, 7, 8]])
    expected = torch.tensor([[12, 15, 28, 5], [1, 2, 3, 20]])  # block * 4 + offset
    torch.testing.assert_close(slot_mapping(tables, columns, 4), expected)
    torch.testing.assert_close(slot_mapping(tables, columns[:, 0], 4), expected[:, 0])
