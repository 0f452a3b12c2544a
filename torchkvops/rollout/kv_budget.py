"""A budget in KV tokens (`RolloutConfig.max_kv_tokens`, issue #52): what a streaming batch may hold, counted
from the paged pool's blocks on the host.

`max_rows` counts rows at their longest; a budget of KV tokens counts what rows hold. The streaming
scheduler (`scheduler.Refill`) asks a `BlockBudget` at each all-ended check (every `interval` steps):
- how many blocks are free under the budget once the rows that ended (or that it preempts) have given
  theirs back (`free`: a block shared with a row that stays is not freed);
- how many blocks each live row takes for its next `interval` tokens (`growth`, what the decode loop's
  reservation then takes: `Decoder._reserve_blocks`);
- what starting a sample costs: its own blocks for its first interval (`sample_blocks`: the copy of its
  prompt's partly filled block and the blocks after it; it shares the prompt's full ones), and a prompt
  that is not held its own table first (`prompt_blocks`).
When the live rows' next interval does not fit, the scheduler first lets go of prompts kept for samples
that wait (their samples will prefill them again), then preempts the newest rows, as vLLM v1's scheduler
preempts its last-admitted request; a preempted sample restarts from its prompt later and draws the same
tokens (its sampling key is per sample and step). The oldest row is never preempted, and `check_budget`
makes sure it fits alone at its longest, so every sample ends.

Host bookkeeping only: the store's `BlockTables` (`paged_store.PagedStore.tables`) say what is held; the
scheduler's decisions are carried out by the decode loop (tests/test_kv_budget.py drives the scheduler
with tables and no model).
"""

from __future__ import annotations

from collections import Counter

from .block_pool import blocks_for

__all__ = ["BlockBudget", "check_budget", "budget_blocks", "call_blocks"]


def budget_blocks(max_kv_tokens: int, block_size: int) -> int:
    """The blocks a budget of `max_kv_tokens` tokens holds (whole blocks: a row's last block is held whole)."""
    return max_kv_tokens // block_size


def call_blocks(prompts: int, rows: int, prompt_len: int, max_new_tokens: int, block_size: int, interval: int) -> int:
    """The most blocks a call's rows may hold: each prompt's own and every row at its longest (a check interval
    past max_new_tokens: the last stretch's reservation). A call under a budget this large runs unstreamed."""
    return prompts * blocks_for(prompt_len, block_size) + rows * blocks_for(
        prompt_len + max_new_tokens + interval, block_size
    )


def check_budget(max_kv_tokens: int, block_size: int, prompt_len: int, max_new_tokens: int, interval: int) -> int:
    """The blocks `max_kv_tokens` holds, raising ValueError naming the setting when they cannot hold a prompt
    and one of its rows at its longest (every rollout must be able to finish its longest row)."""
    blocks = budget_blocks(max_kv_tokens, block_size)
    longest = blocks_for(prompt_len, block_size) + blocks_for(prompt_len + max_new_tokens + interval, block_size)
    if blocks < longest:
        raise ValueError(
            f"torchkvops: max_kv_tokens={max_kv_tokens} holds {blocks} blocks of {block_size} tokens, fewer than "
            f"a prompt of {prompt_len} tokens and one row at max_new_tokens={max_new_tokens} need ({longest}); "
            f"raise it to at least {longest * block_size}"
        )
    return blocks


class BlockBudget:
    """The blocks of `store` (anything with `tables` (a `BlockTables`), `limit`: the most blocks held at once,
    and `prompt_table(prompt)`) as a streaming batch of prompts of `prompt_len` columns sees them, with
    checks every `interval` steps."""

    def __init__(self, store, prompt_len: int, interval: int):
        self.store, self.interval = store, interval
        bs = store.block_size
        self.prompt_blocks = blocks_for(prompt_len, bs)  # a prompt's own table
        # A sample's own blocks for its first interval: all but its prompt's full blocks, which it shares.
        self.sample_blocks = blocks_for(prompt_len + interval, bs) - prompt_len // bs

    def prompt_table(self, prompt: int) -> int:
        return self.store.prompt_table(prompt)

    def free(self, released: list[int]) -> int:
        """Blocks free under the budget once tables `released` have given theirs back (a block another table
        holds too stays held)."""
        tables = self.store.tables
        holders = Counter(b for t in released for b in tables.blocks[t])
        freed = sum(1 for b, n in holders.items() if tables.pool.refs[b] == n)
        return self.store.limit - tables.pool.num_held + freed

    def growth(self, table: int, column: int) -> int:
        """Blocks `table` takes to write its next interval from `column` on."""
        tables = self.store.tables
        return max(0, tables.blocks_needed(table, max(0, column + self.interval - tables.lengths[table])))
