"""A budget in KV tokens (issue #52): which rows decode, decided on the host from the pool's free blocks.

`max_rows` counts rows at their longest; a budget of KV tokens counts what rows hold. At each of the
decode loop's checks (every `interval` steps) `KVBudget.step` gives every live row blocks for the next
`interval` tokens, oldest row first; when the pool runs out, the newest rows are preempted (their blocks
given back, their samples queued again at the front), as vLLM v1's scheduler preempts its last-admitted
request. A preempted sample later restarts from its prompt: its sampling key is per sample and step, so it
draws the same tokens. Then waiting samples start, in order, while the pool has blocks for their first
interval and every live row's next one (`start`). A prompt's KV is held by its prompt row while a sample
of it decodes, its samples sharing its full blocks (`BlockTables.fork`); a prompt none of whose samples
decodes holds no block (a later sample of it prefills it again), so waiting prompts never starve the rows
that decode.

The oldest row always keeps its blocks (the budget must hold one prompt and one row at its longest,
`check_budget`), so every sample ends: no livelock. Host bookkeeping only, tested without a model
(tests/test_kv_budget.py); the decode loop carries out its decisions once the KV lives in the pool (#52's
next step).
"""

from __future__ import annotations

from .block_pool import BlockPool, BlockTables, OutOfBlocks, blocks_for

__all__ = ["KVBudget", "check_budget"]


def check_budget(max_kv_tokens: int, block_size: int, prompt_len: int, max_new_tokens: int, interval: int) -> int:
    """The pool's blocks for `max_kv_tokens`, raising ValueError naming the setting when they cannot hold a
    prompt and one of its rows at its longest (every rollout must be able to finish its longest row)."""
    blocks = max_kv_tokens // block_size
    longest = blocks_for(prompt_len, block_size) + blocks_for(prompt_len + max_new_tokens + interval, block_size)
    if blocks < longest:
        raise ValueError(
            f"torchkvops: max_kv_tokens={max_kv_tokens} holds {blocks} blocks of {block_size} tokens, fewer than "
            f"a prompt of {prompt_len} tokens and one row at max_new_tokens={max_new_tokens} need ({longest}); "
            f"raise it to at least {longest * block_size}"
        )
    return blocks


class KVBudget:
    """Rows of a decode batch (`rows` of them) under a pool of `num_blocks` blocks of `block_size` tokens;
    prompt p's KV is held in table row `rows + p` (apart from the batch's rows) while a sample of it
    decodes."""

    def __init__(self, rows: int, prompts: int, num_blocks: int, block_size: int, max_blocks: int, interval: int):
        self.pool = BlockPool(num_blocks, block_size)
        self.rows, self.interval = rows, interval
        self.tables = BlockTables(self.pool, rows + prompts, max_blocks)
        self.order: list[int] = []  # live rows, oldest admitted first
        self.prompt_of: dict[int, int] = {}  # live row -> its prompt
        self.live: dict[int, int] = {}  # held prompt -> its live rows
        self.preemptions = 0

    def held(self, prompt: int) -> bool:
        """Prompt `prompt`'s KV is in the pool (prefilled, and a sample of it decodes)."""
        return prompt in self.live

    def start(self, prompt: int, prompt_len: int, row: int) -> tuple[bool, list[tuple[int, int]]] | None:
        """Start a sample of `prompt` in free batch row `row`, with blocks for its first interval, prefilling
        the prompt first when it is not held: (whether it must be prefilled, the block copies to make: its
        prompt's partly filled block), or None when the pool has too few blocks (nothing taken)."""
        bs, prefill = self.pool.block_size, not self.held(prompt)
        # The row's own blocks: those past its prompt's full blocks, which it shares.
        need = blocks_for(prompt_len + self.interval, bs) - prompt_len // bs
        need += blocks_for(prompt_len, bs) if prefill else 0
        if need + self._next_step_blocks() > self.pool.num_free:
            return None
        if prefill:
            self.tables.append(self.rows + prompt, prompt_len)
            self.live[prompt] = 0
        copies = self.tables.fork(self.rows + prompt, [row])
        self.tables.append(row, self.interval)
        self.order.append(row)
        self.prompt_of[row] = prompt
        self.live[prompt] += 1
        return prefill, copies

    def _next_step_blocks(self) -> int:
        """The most blocks the live rows take at the next `step`: a row admitted now must not make the next
        step preempt (vLLM keeps a watermark of free blocks for the same reason)."""
        return len(self.order) * blocks_for(self.interval, self.pool.block_size)

    def end(self, row: int) -> None:
        """Row `row`'s sample has ended or is preempted: its blocks go back, and its prompt's when no other
        sample of it decodes (a later sample of that prompt prefills it again: a prompt that waits holds
        no block, so waiting prompts never starve the rows that decode)."""
        self.tables.release(row)
        self.order.remove(row)
        prompt = self.prompt_of.pop(row)
        self.live[prompt] -= 1
        if not self.live[prompt]:
            del self.live[prompt]
            self.tables.release(self.rows + prompt)

    def step(self) -> list[int]:
        """Before the next `interval` steps: blocks for every live row's next interval, oldest first; the rows
        preempted for them (newest first; their blocks given back, the caller queues their samples again
        and starts them later from their prompts)."""
        preempted = []
        kept = 0
        while kept < len(self.order):
            row = self.order[kept]
            try:
                self.tables.append(row, self.interval)
                kept += 1
            except OutOfBlocks:
                if len(self.order) == 1:
                    raise AssertionError("torchkvops: one row alone outgrows the pool (check_budget)") from None
                victim = self.order[-1]
                self.end(victim)
                preempted.append(victim)
                self.preemptions += 1
        return preempted

    @property
    def tokens_held(self) -> int:
        return self.tables.tokens_held()
