"""The rows of one decode: `DecodeBatch` owns every join and leave of them.

As vLLM's InputBatch does with add_request / remove_request / condense, every change of the batch's rows
goes through four methods, so a per-row field is moved by one piece of code (`DecodeState.FIELDS` says
how) and a new field cannot be forgotten:

- `admit(rows, ...)`: rows start samples (every row when a call starts; free rows of a streaming batch
  when waiting samples take them): their state is set and their first token drawn;
- `compact(plan, tokens)`: the batch goes on with the rows a compaction plan keeps (torchkvops.rollout.
  compaction), in a state of the smaller shape, the KV cache gathered with them;
- `retire(rows)`: ended rows' tokens to their samples' places in the output, the rows free (a streaming
  batch);
- `finish(tokens)`: after decode, every row's tokens in its place in the output and its KV at home.

The batch also keeps the host-side map (`compaction.BatchMap`): which output row each batch row is (-1:
free), and, where prompts are read stacked, the prompt group each row reads. Nothing outside this class
writes a decode state's rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from ..fused_attention import MASKED_KEY_BIAS
from . import compaction
from .state import DecodeShape, DecodeState

__all__ = ["DecodeBatch", "visible_bias"]


def visible_bias(visible: Tensor, width: int) -> Tensor:
    """An additive attention bias [rows, width] (float32): 0 where `visible` [rows, C <= width] is True,
    -inf elsewhere and past C."""
    bias = torch.full((visible.shape[0], width), float("-inf"), device=visible.device)
    bias[:, : visible.shape[1]].masked_fill_(visible, 0.0)
    return bias


def first_seen(bias: Tensor, columns: Tensor, live: Tensor | None) -> Tensor:
    """[k] int32: the first column each row sees of its bias ([k, C], 0 where seen), or its `columns` [k] (the
    first it writes) where it sees none. What a live row sees must be one run of columns up to the one it
    writes (the decode attention reads from its start on: `DecodeState.kv_start`): checked, once per
    admission. (A row that is not `live` only holds the pad id: what it reads is never used.)"""
    seen = bias == 0
    index = torch.arange(seen.shape[1], device=seen.device)
    start = torch.where(seen, index, seen.shape[1]).amin(dim=1).minimum(columns)
    run = (index[None, :] >= start[:, None]) & (index[None, :] < columns[:, None])
    wrong = (seen != run).any(dim=1)
    if live is not None:
        wrong &= live.to(wrong.device, torch.bool)
    if bool(wrong.any()):  # host sync: once per admission
        raise AssertionError("torchkvops: a row's visible KV columns are not one run ending where it writes")
    return start.to(torch.int32)


class DecodeBatch:
    """The rows being decoded (module docstring). `keeps_left`: rows that leave at a compaction keep their
    KV and tokens so far (a call's rows, which Rollout.extend may go on with); a streaming batch's rows
    leave by `retire` instead, and its compactions drop only free rows, in place. `output`: where rows'
    tokens (and log-probabilities) end up, [samples, columns] (default: the first state's own).

    What it is given, and nothing else (it holds no decoder, so it is tested alone): the KV `cache` whose
    rows move with its rows and the `layout` that says how, the `pad_id` ended rows hold, `make_state(shape)`
    (the decode state of a shape: a compacted batch's) and `draw(state, logits)` (each row of `state` draws
    its next token from `logits`: the decode step's sampler)."""

    def __init__(
        self,
        cache,
        layout,
        state: DecodeState,
        batch_map: compaction.BatchMap,
        *,
        pad_id: int,
        make_state: Callable[[DecodeShape], DecodeState],
        draw: Callable[[DecodeState, Tensor], None],
        keeps_left: bool = True,
        output: tuple[Tensor, Tensor | None] | None = None,
    ):
        self.cache, self.layout, self.pad_id, self.make_state, self.draw = cache, layout, pad_id, make_state, draw
        self.first = self.state = state
        self.map = batch_map
        self.keeps_left = keeps_left
        self.responses, self.logprobs = output if output is not None else (state.responses, state.logprobs)
        self.row_steps = 0  # rows sampled, summed over the tokens
        self.compactions = 0

    @property
    def rows(self) -> int:
        return self.state.rows

    def clear(self) -> None:
        """Every row free: ended, seeing nothing (a streaming batch before its first admission)."""
        s = self.state
        s.clear()
        s.bias.fill_(float("-inf"))
        if s.prompt_bias is not None:
            s.prompt_bias.fill_(float("-inf"))
        s.finished.fill_(True)
        s.nonfinite_step.fill_(-1)

    # --- joins ---------------------------------------------------------------------------------------
    def admit(
        self,
        rows: Tensor | None,
        samples,
        first_logits: Tensor,
        *,
        sample_keys: Tensor,
        positions: Tensor,
        columns: Tensor,
        bias: Tensor,
        live: Tensor | None = None,
    ) -> None:
        """Rows `rows` (device int64; None: every row) start the samples `samples` (their output rows:
        host int64 [k]): `sample_keys` [k] their sampling keys, `positions` [k] the position of the token each
        feeds first, `columns` [k] the decode buffer's column each writes first, `bias` [k, the decode
        buffer's columns] (additive) what each sees, `live` [k] (bool,
        optional) False for rows that have ended before they start (filler rows, rows an extend leaves
        alone), which only ever hold the pad id. Their first token is drawn from `first_logits` [k, vocab]."""
        s, pad_id = self.state, self.pad_id
        every = rows is None
        index = slice(None) if every else rows
        s.bias[index, 0, 0] = bias.to(s.bias.dtype)
        s.kv_start[index] = first_seen(bias, columns.to(bias.device), live).to(s.kv_start.device)
        s.position_ids[index, 0] = positions.to(s.position_ids.device)
        s.column[index] = columns.to(s.column.device)
        s.finished[index] = False if live is None else ~live.to(s.finished.device, torch.bool)
        s.sample_keys[index] = sample_keys.to(s.sample_keys.device)
        s.step[index] = 0
        s.nonfinite_step[index] = -1
        s.responses[index] = pad_id
        if s.logprobs is not None:
            s.logprobs[index] = 0.0
        if s.kv_blocks is not None:  # the paged layout: each row's block table (a call's rows: their home rows')
            homes = torch.as_tensor(samples, dtype=torch.long, device=s.kv_blocks.device)
            table = self.cache.paged.table.index_select(0, homes)
            width = min(table.shape[1], s.kv_blocks.shape[1])
            s.kv_blocks[index] = 0
            s.kv_blocks[index, :width] = table[:, :width]
        self.map.original[slice(None) if every else rows.cpu()] = torch.as_tensor(samples, dtype=torch.long)
        self._draw(rows, first_logits)
        self.row_steps += first_logits.shape[0]

    def load_tables(self, rows: list[int]) -> None:
        """The paged layout: rows `rows` (batch rows) read their samples' block tables again (they took
        blocks: `PagedStore.reserve`)."""
        if not rows:
            return
        s = self.state
        index = torch.tensor(rows, device=s.kv_blocks.device)
        samples = self.map.original[rows].to(s.kv_blocks.device)
        tables = self.cache.paged.table.index_select(0, samples)
        s.kv_blocks.index_copy_(0, index, tables[:, : s.kv_blocks.shape[1]])

    def set_cache_position(self, position: int) -> None:
        """HF's cache position of the next decode step (the width of the input HF's generate would have;
        the step adds one): what the model numbers the step from and the cache reports as its length."""
        self.state.cache_position.fill_(position)

    def show_prompt_blocks(self, visible: Tensor, samples: int) -> None:
        """Prompts read stacked, a call's rows (row i answers prompt i // `samples`,
        its table the sample's): each prompt's whole blocks, which its rows' tables name (`visible` [prompts,
        W] bool: the columns that hold its tokens, ending where its rows' first token is written), read from
        its first visible column; each row reads its own keys after them (or from its own start, if later)."""
        s = self.state
        block, shared, common = s.shape.kv_block, s.shape.prompt_len, s.shape.common_len
        visible = visible.bool()
        # Each prompt's tokens end where its rows write first: its whole blocks are those before that end.
        end = visible.shape[1] - visible.flip(1).int().argmax(dim=1)
        whole = torch.where(visible.any(dim=1), end // block * block, 0)
        # The prompts' own part: the columns after a common prefix's whole blocks (read apart, for every row).
        columns = common + torch.arange(shared, device=visible.device)[None, :]
        seen = visible[:, common : common + shared] & (columns < whole[:, None])
        # A masked key's bias finite (MASKED_KEY_BIAS): a prompt whose whole blocks are all padding keeps a
        # finite log-sum-exp, which then weighs nothing in the merge with its rows' own keys.
        s.prompt_bias[:, 0, 0] = torch.where(seen, 0.0, MASKED_KEY_BIAS).to(s.prompt_bias.dtype)
        homes = torch.arange(s.shape.prompts, device=s.prompt_table.device) * samples
        tables = self.cache.paged.table.index_select(0, homes)
        s.prompt_table.copy_(tables[:, common // block : (common + shared) // block])
        if s.common_table is not None:  # (the same blocks in every prompt's table: the first one's)
            s.common_table.copy_(tables[:1, : common // block])
        own = whole.repeat_interleave(samples).to(s.kv_start.device, s.kv_start.dtype)
        s.own_start.copy_(torch.maximum(s.kv_start, own))

    def _draw(self, rows: Tensor | None, logits: Tensor) -> None:
        """Sample the first token of rows `rows` (None: every row) from `logits`, the other rows left as
        they are."""
        state = self.state
        if rows is None:
            self.draw(state, logits)
            return
        sub = DecodeState(
            dataclasses.replace(
                state.shape, rows=rows.numel(), prompts=0, slots=0, common_len=0, prompts_in_place=False
            ),
            state.tokens.device,
        )
        state.gather_into(sub, rows, None)
        self.draw(sub, logits)
        state.scatter_rows_from(sub, rows)

    # --- leaves --------------------------------------------------------------------------------------
    def plan(self, ended: Tensor) -> compaction.Plan | None:
        """The compaction that leaves out the rows `ended` (host bool [rows]), or None when it would not
        save enough (torchkvops.rollout.compaction)."""
        return compaction.plan(ended, self.map)

    def compact(self, plan: compaction.Plan, tokens: int, cache_gathered: bool = False) -> None:
        """Go on with the rows of `plan` after `tokens` tokens: a state of the compacted shape holds them,
        the KV cache keeps theirs (unless `cache_gathered`: the caller gathered it), and (`keeps_left`)
        the output keeps every row's tokens so far."""
        state, cache = self.state, self.cache
        device = state.tokens.device
        rows = plan.rows.to(device)
        groups = None if plan.groups is None else plan.groups.to(device)
        # A batch whose rows read no prompt stacked (the paged layout reading through each row's table) keeps
        # no prompt groups or query slots in its shape: the plan's would only multiply its decode shapes.
        stacked = state.shape.prompts > 0
        prompts, slots = (plan.prompts, plan.slots) if stacked else (0, 0)
        # Prompts read in place stay so while the batch keeps all of them (the pool's runs are every prompt's).
        in_place = state.shape.prompts_in_place and prompts == state.shape.prompts
        shape = dataclasses.replace(
            state.shape, rows=plan.size, prompts=prompts, slots=slots, prompts_in_place=in_place
        )
        new = self.make_state(shape)
        state.gather_into(new, rows, groups)
        if plan.slot_rows is not None and stacked:
            new.slot_rows.copy_(plan.slot_rows)
            new.row_prompt.copy_(plan.row_slot // plan.slots)
            new.row_sample.copy_(plan.row_slot % plan.slots)
        if not self.keeps_left:
            cache.compact_in_place(rows, groups, self.written())  # the rows left behind are free: nothing is kept
        else:
            if not cache_gathered:
                cache.compact(rows, groups, self.map.original.to(device), self.written())
            self._write_back(tokens)
            # Rows that end here hold the pad id (and log-probability 0) from now on, as in a full batch;
            # the others are written back again later.
            self.responses[:, tokens:].fill_(self.pad_id)
            if self.logprobs is not None:
                self.logprobs[:, tokens:].zero_()
        self.map.apply(plan)
        self.state = new
        self.compactions += 1

    def widen(self, columns: int) -> None:
        """Go on in a state whose decode buffer has `columns` columns (the KV cache widened first,
        `RolloutKVCache.widen`): every field copied, each row's bias hiding the new columns until it writes
        them."""
        state = self.state
        new = self.make_state(dataclasses.replace(state.shape, key_columns=columns))
        for old, wider in zip(state.tensors(), new.tensors()):
            if old.shape == wider.shape:
                wider.copy_(old)
        new.bias.fill_(float("-inf"))
        new.bias[..., : state.shape.key_columns].copy_(state.bias)
        if new.kv_blocks is not None:  # the paged layout: the tables' new entries name the scratch block
            new.kv_blocks.zero_()
            new.kv_blocks[:, : state.kv_blocks.shape[1]].copy_(state.kv_blocks)
        self.state = new

    def retire(self, rows: list[int]) -> None:
        """Rows `rows` (ended) leave: their tokens to their samples' places in the output; the rows are free."""
        if not rows:
            return
        device, width = self.state.tokens.device, self.responses.shape[1]
        src = torch.tensor(rows, device=device)
        dst = self.map.original[rows].to(device)
        self.responses[dst] = self.state.responses[src, :width]
        if self.logprobs is not None:
            self.logprobs[dst] = self.state.logprobs[src, :width]
        self.layout.release_rows(self, rows)
        self.map.original[rows] = -1

    def preempt(self, rows: list[int]) -> None:
        """Rows `rows` (live) leave without their tokens (a budget of KV tokens ran short: their samples start
        again later); the rows are free and ended."""
        if not rows:
            return
        self.layout.release_rows(self, rows)
        self.state.finished[torch.tensor(rows, device=self.state.finished.device)] = True
        self.map.original[rows] = -1

    def finish(self, tokens: int) -> None:
        """After decode: the first `tokens` tokens of every row in its place in the output, and (a call's
        batch) every row's KV in its home row, where Rollout.extend looks for it."""
        if self.keeps_left:
            self._write_back(tokens)
        compacted = self.cache.compacted  # (the home rows of a compacted batch's rows: one host-to-device copy)
        if compacted:
            self.cache.finish_decode(self.map.original.to(self.first.tokens.device), self.written())
        else:
            self.cache.finish_decode(None)

    def written(self) -> int:
        """The decode buffer's columns some row has written: what moving rows' KV must move (each row
        writes its columns in order, and `column` is the next one)."""
        return int(self.state.column.max()) + 1  # host sync: once per compaction

    def _write_back(self, tokens: int) -> None:
        """The first `tokens` tokens (and logprobs) of a compacted batch's rows, into their output rows."""
        if self.state is self.first:
            return
        original = self.map.original.to(self.responses.device)
        self.responses[:, :tokens].index_copy_(0, original, self.state.responses[:, :tokens])
        if self.logprobs is not None:
            self.logprobs[:, :tokens].index_copy_(0, original, self.state.logprobs[:, :tokens])
