"""A cache group's KV in a pool of blocks on the device (issue #52, the pool's second part): the tensor
that `rollout.block_pool.BlockTables` hands out blocks of, and what a forward does with it.

The pool is `[group layers, 2, blocks, kv_heads, block_size, head_dim]` (K at 0, V at 1), so that one
layer's `pool[layer, 0]` and `pool[layer, 1]` are what `ops.paged_attention` takes. Where each row's tokens
lie is data (the block tables, a device tensor of int32), so a decode step writes and reads through them
without a host sync, and one CUDA graph serves every length:

- `slot_mapping(tables, columns)`: each row's pool slot for the token at its column (decode: one a row).
- `write(layer, key, value, slots)`: a forward's K and V to their slots.
- `attend(layer, query, tables, lengths, ...)`: a decode step's attention over each row's written keys.
- `dense(layer, tables, tokens)`: rows' first `tokens` keys and values as `[rows, kv_heads, tokens,
  head_dim]`, for what reads KV densely (a packed forward's history, a dtype the operator does not take).
- `copy_blocks(pairs)`: the block copies a fork makes (a prompt's partly filled block, per sample).
- `grow(num_blocks)`: more blocks, the held ones copied (a new allocation: addresses change).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import ops

__all__ = [
    "PagedKV",
    "slot_mapping",
    "window_table",
    "window_slots",
    "write_slots",
    "gather_blocks",
    "dense_rows",
    "token_major_zeros",
]


def slot_mapping(tables: Tensor, columns: Tensor, block_size: int) -> Tensor:
    """The pool slot (block * block_size + offset) of each row's token at `columns` ([rows] or [rows,
    tokens], int64): `tables[r, c // block_size] * block_size + c % block_size`, on the device."""
    cols = columns if columns.dim() == 2 else columns[:, None]
    blocks = tables.long().gather(1, cols // block_size)
    slots = blocks * block_size + cols % block_size
    return slots if columns.dim() == 2 else slots[:, 0]


def window_table(window_map: Tensor, tables: Tensor) -> Tensor:
    """A sliding-window group's tables: the window pool's block of each entry of `tables` (int32, any
    shape) through `window_map` ([table pool's blocks] int32; 0, the scratch block, for blocks out of every
    holder's window: entries the window's reads never reach)."""
    return window_map[tables.long()]


def window_slots(window_map: Tensor, slots: Tensor, block_size: int) -> Tensor:
    """A sliding-window group's pool slots of tokens whose table slots are `slots` (int64, any shape)."""
    return window_map[slots // block_size].long() * block_size + slots % block_size


def write_slots(pool: Tensor, layer: int, key: Tensor, value: Tensor, slots: Tensor) -> None:
    """`key`, `value` [rows, kv_heads, tokens, head_dim] of `layer` to their pool slots ([rows, tokens], or
    [rows] for one token a row) of `pool` [layers, 2, blocks, kv_heads, block_size, head_dim]: one
    `write_kv_slots_` (a launch for K and V together, no index arithmetic around it)."""
    ops.write_kv_slots_(pool, key.to(pool.dtype), value.to(pool.dtype), layer, slots.contiguous())


def gather_blocks(blocks: Tensor, table: Tensor) -> Tensor:
    """A layer's keys or values in a pool ([blocks, kv_heads, block_size, head_dim], its storage token-major:
    `token_major_zeros`) as each row of `table` ([rows, n] int32) names them: [rows, kv_heads, n *
    block_size, head_dim], a view of one copy (whole blocks by index, each [block_size, kv_heads, head_dim]
    as stored; the tokens' stride kv_heads * head_dim), for what reads a row's KV densely: the fused
    attention takes it as it is. On this CPU, 8 prompts of 1,088 tokens (llama-small's K and V, one
    layer) gathered and read by the fused attention: 1.9-2.5 ms, against 4.4-4.5 with the head-major pool's
    two copies (the blocks, then heads outermost)."""
    rows, n = table.shape
    tokens = blocks.transpose(1, 2)  # [blocks, block_size, kv_heads, head_dim]: the storage's order
    gathered = tokens.index_select(0, table.flatten().long())
    return gathered.view(rows, n * blocks.shape[2], blocks.shape[1], blocks.shape[3]).transpose(1, 2)


def block_runs(blocks: Tensor, start: int, runs: int, length: int, stride: int) -> Tensor:
    """`runs` runs of `length` blocks each of a layer's keys or values in a pool ([blocks, kv_heads,
    block_size, head_dim], stored token-major: `token_major_zeros`), run i from block `start + i * stride`:
    [runs, kv_heads, length * block_size, head_dim], a view (no copy): what `gather_blocks` makes of tables
    that name those blocks, where a reader knows they lie there (`PagedStore.place_prompts`)."""
    tokens = blocks.transpose(1, 2)  # [blocks, block_size, kv_heads, head_dim]: the storage's order
    run = tokens[start : start + runs * stride].reshape(
        runs, stride * blocks.shape[2], blocks.shape[1], blocks.shape[3]
    )
    return run[:, : length * blocks.shape[2]].transpose(1, 2)


def token_major_zeros(
    layers: int, blocks: int, kv_heads: int, block_size: int, head_dim: int, like: Tensor | None = None, **kw
) -> Tensor:
    """A pool of zeros, [layers, 2, blocks, kv_heads, block_size, head_dim] as every reader takes it
    (`paged_attention`, `write_kv_slots_` and the gathers read strides), stored token-major in a block
    ([..., block_size, kv_heads, head_dim], vLLM's layout for its flash kernels): a prompt's whole blocks,
    gathered by index, are then a run of tokens that the fused attention reads without a second copy
    (`gather_blocks`)."""
    shape = (layers, 2, blocks, block_size, kv_heads, head_dim)
    storage = like.new_zeros(shape) if like is not None else torch.zeros(shape, **kw)
    return storage.transpose(3, 4)


def dense_rows(pool: Tensor, layer: int, table: Tensor, tokens: int) -> tuple[Tensor, Tensor]:
    """The first `tokens` keys and values of each row of `table` ([rows, blocks] int32) in `pool`, as
    [rows, kv_heads, tokens, head_dim] each (a copy); the columns a row has not written hold whatever its
    table names (mask them)."""
    table = table[:, : -(-tokens // pool.shape[4])]
    return tuple(gather_blocks(pool[layer, i], table)[:, :, :tokens] for i in (0, 1))


class PagedKV:
    """One cache group's blocks: `pool` [layers, 2, num_blocks, kv_heads, block_size, head_dim] (stored
    token-major in a block: `token_major_zeros`)."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.block_size = block_size
        self.pool = token_major_zeros(layers, num_blocks, kv_heads, block_size, head_dim, dtype=dtype, device=device)

    @property
    def num_blocks(self) -> int:
        return self.pool.shape[2]

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def grow(self, num_blocks: int) -> None:
        """`num_blocks` blocks (more than now), the current ones copied to the same ids."""
        old = self.pool
        layers, _, _, kv_heads, block_size, head_dim = old.shape
        self.pool = token_major_zeros(layers, num_blocks, kv_heads, block_size, head_dim, like=old)
        self.pool[:, :, : old.shape[2]].copy_(old)

    def write(self, layer: int, key: Tensor, value: Tensor, slots: Tensor) -> None:
        """`key`, `value` [rows, kv_heads, tokens, head_dim] of `layer` to their `slots` ([rows, tokens]
        int64, or [rows] for one token a row)."""
        write_slots(self.pool, layer, key, value, slots)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block dst = block src, in every layer's K and V, for each (src, dst)."""
        if pairs:
            src, dst = (torch.tensor(side, device=self.pool.device) for side in zip(*pairs))
            self.pool[:, :, dst] = self.pool[:, :, src]

    def dense(self, layer: int, tables: Tensor, tokens: int) -> tuple[Tensor, Tensor]:
        """The first `tokens` keys and values of each row of `tables` ([rows, blocks] int32), as [rows,
        kv_heads, tokens, head_dim] each (a copy); the columns a row has not written hold whatever its
        table names (mask them)."""
        return dense_rows(self.pool, layer, tables, tokens)

    def attend(
        self,
        layer: int,
        query: Tensor,
        tables: Tensor,
        lengths: Tensor,
        *,
        starts: Tensor | None = None,
        positions: Tensor | None = None,
        scale: float | None = None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor]:
        """A decode step's attention of `query` [rows, heads, head_dim] over each row's keys [starts,
        lengths) through `tables`: (out [rows, heads, head_dim], lse [rows, heads]) as `ops.paged_attention`
        returns them."""
        return ops.paged_attention(
            query,
            self.pool[layer, 0],
            self.pool[layer, 1],
            tables,
            lengths,
            positions,
            scale,
            window,
            softcap,
            starts,
        )
