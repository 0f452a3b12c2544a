"""Rollouts larger than the row budget (`RolloutConfig.max_rows`) or the KV budget (`max_kv_tokens`): a fixed
batch of rows, refilled.

When B x N sample rows exceed max_rows, the rollout decodes in one batch of max_rows rows (rounded down
to whole prompts' samples) whose KV buffers are sized for those rows only. At every all-ended check
(every FINISHED_CHECK_INTERVAL steps, the host sync decode makes anyway) the rows whose samples have
ended are copied out to their places in the output, and waiting samples take them: a prompt is
prefilled once for its N samples, into a small scratch cache, and its samples start as rows free up, in
any free rows (each sample's table forks its prompt's, whose blocks are held until its last sample has
started). A streaming batch reads every prompt through its rows' tables. Decode goes on
with one batch, one decode shape (one CUDA graph). Once no prompt waits, the rows still decoding are
compacted in place as compaction compacts them.

Under a budget of KV tokens (`RolloutConfig.max_kv_tokens`, the pool's blocks) the batch has a row for
every sample (or max_rows), and the scheduler starts samples while the pool has blocks for them and
preempts the newest rows when the live rows' next interval does not fit (`kv_budget`); a preempted row
leaves like a retired one without its tokens (`DecodeBatch.preempt`), and its sample starts again later
from its prompt, prefilled again if it was let go of.

The same tokens as without a budget: a row samples with its global row's key and its own step (the
sampler takes a step per row), its attention sees its own prompt and tokens only (the columns of other
occupants of its row are hidden), and it ends at its own max_new_tokens. The caller cuts the output to the
unbudgeted rollout's length (`unbudgeted_width`). Its decode buffer follows its longest row as a call's
does (widened as rows grow: one more decode shape each time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from .batch import DecodeBatch
from .cache_groups import KVViews
from .decode import FINISHED_CHECK_INTERVAL, Decoder
from .kv_budget import BlockBudget, check_budget
from .sampling import row_keys
from .scheduler import Decisions, Refill

__all__ = ["Streamed", "Admission", "Prefill", "stream", "unbudgeted_width"]


@dataclasses.dataclass
class Streamed:
    responses: Tensor  # [B*N, max_new_tokens] in input order (the pad id after each row's end)
    logprobs: Tensor | None
    steps: int  # decode steps run
    row_steps: int  # rows sampled, summed over the steps (the batch's rows at every step)
    refills: int  # prompts admitted after the start
    kv_bytes: int  # the batch's KV buffers, the scratch cache prompts are prefilled into, pending prompts' KV
    preemptions: int = 0  # samples preempted under a budget of KV tokens (each restarted from its prompt)


def unbudgeted_width(lengths: list[int], max_new_tokens: int, has_eos: bool) -> int:
    """How many columns an unbudgeted rollout's responses have, given each live row's response length
    (through its first EOS; max_new_tokens without one): decode stops at the first all-ended check
    (every FINISHED_CHECK_INTERVAL steps) at which every row has ended, else after max_new_tokens."""
    if not has_eos or not lengths or max(lengths) >= max_new_tokens:
        return max_new_tokens
    interval = FINISHED_CHECK_INTERVAL
    check = max(interval, -(-(max(lengths) - 1) // interval) * interval)  # the first check after the longest
    return min(max_new_tokens, check + 1)


class Admission:
    """What a streaming batch's scheduler (`scheduler.Refill`) decides, carried out: prompts prefilled once
    (`prefill`, into the scratch cache) and placed where the layout keeps them until their samples have
    rows (`layouts.place_prompts`; a prompt whose samples still wait keeps its KV apart from the scratch
    cache, which the next prefill overwrites), and samples started in free rows (`layouts.seat` and
    `DecodeBatch.admit`)."""

    def __init__(
        self, batch: DecodeBatch, prefill: Prefill, prompt_mask: Tensor, scratch, *, seed, row_ids, live, chunk=None
    ):
        self.batch, self.prefill, self.scratch = batch, prefill, scratch
        self.prefill_chunk = chunk  # the most prompts prefilled in one forward (None: all a decision asks)
        self.layout, self.cache = batch.layout, batch.cache
        self.seed, self.row_ids, self.live = seed, row_ids, live
        self.write_start = prompt_mask.shape[1]  # where an admitted row writes first: after its prompt's columns
        # Prompts prefilled whose samples have not all started: where their KV waits, their first logits and
        # mask (until the scheduler releases them).
        self.pending: dict[int, tuple[object, Tensor, Tensor]] = {}
        self.peak_pending_bytes = 0  # the KV of prompts waiting for rows apart from the batch, at most

    def __call__(self, batch: DecodeBatch, decisions: Decisions) -> None:
        for prompt in decisions.forget:  # (first: a budget's blocks go to the prefills below)
            self.drop(prompt)
        prefill, chunk = decisions.prefill, self.prefill_chunk or max(1, len(decisions.prefill))
        for first in range(0, len(prefill), chunk):
            part = prefill[first : first + chunk]
            kv, logits, mask = self.prefill(part)
            homes = self.layout.place_prompts(batch, part, kv, mask)
            last = first + chunk >= len(prefill)  # (an earlier chunk's KV is copied out before the next prefill)
            for i, prompt in enumerate(part):
                home = homes[i] if last else self.layout.keep_apart(homes[i], self.scratch)
                self.pending[prompt] = (home, logits[i : i + 1], mask[i : i + 1])
        for prompt, samples, rows in decisions.start:
            self.start(*self.pending[prompt], samples, rows)
        for prompt in decisions.release:
            self.drop(prompt)
        self.pending = {
            prompt: (self.layout.keep_apart(home, self.scratch), *rest)
            for prompt, (home, *rest) in self.pending.items()
        }
        held = sum(home.nbytes for home, *_ in self.pending.values() if isinstance(home, KVViews))
        self.peak_pending_bytes = max(self.peak_pending_bytes, held)

    def drop(self, prompt: int) -> None:
        """Prompt `prompt`'s KV is no longer kept for samples that wait (they have all started, or a budget
        of KV tokens let go of it: they will prefill it again)."""
        del self.pending[prompt]
        self.layout.drop_prompt(self.batch, prompt)

    def start(self, home, logits: Tensor, mask: Tensor, samples: list[int], rows: list[int]) -> None:
        """Start samples `samples` (output rows) of the prompt at `home` at batch rows `rows`."""
        device = logits.device
        new_rows, global_rows = torch.tensor(rows, device=device), torch.tensor(samples, device=device)
        row_mask = mask.bool().expand(len(rows), -1)  # [rows', P]
        bias = self.layout.seat(self.batch, self.cache, home, row_mask, new_rows, global_rows)
        self.batch.admit(
            new_rows,
            samples,
            logits.expand(len(rows), -1).contiguous(),
            sample_keys=row_keys(self.seed, self.row_ids[global_rows]),
            positions=row_mask.sum(dim=1),
            columns=torch.full((len(rows),), self.write_start, dtype=torch.long),
            bias=bias,
            live=self.live[global_rows],
        )


# The prompts at these indices prefilled once: (their KV, per cache group [group layers, 2, prompts, kv_heads,
# P, head_dim], views of the scratch cache the next prefill overwrites; their first logits [prompts, vocab];
# their mask).
Prefill = Callable[[list[int]], tuple[KVViews, Tensor, Tensor]]


def stream(
    decoder: Decoder,
    prefill: Prefill,
    prompt_mask: Tensor,
    *,
    seed: int,
    row_ids: Tensor,
    live: Tensor | None,
    max_new_tokens: int,
    max_rows: int | None,
    compacts: bool,
    scratch,
    max_kv_tokens: int | None = None,
) -> Streamed:
    """Decode every prompt's N rows within `max_rows` rows (None: every row) and `max_kv_tokens` tokens of
    KV (None: no bound; the paged layout's blocks) (module docstring), as `scheduler.Refill` decides.
    `prompt_mask` [B, P]: the prompts' masks; `prefill`: prefills prompts by index into `scratch`, the
    cache admitted prompts are prefilled into."""
    layout, cache, device = decoder.layout, decoder.cache, prompt_mask.device
    n = layout.samples
    prompts, prompt_len = prompt_mask.shape
    groups = prompts if max_rows is None else min(max_rows // n, prompts)
    rows = groups * n
    lengths, limit = layout.first_kv_lengths(prompt_len, max_new_tokens)  # (widened as rows grow)
    blocks = None
    if max_kv_tokens is not None:
        blocks = check_budget(max_kv_tokens, layout.block_size, prompt_len, max_new_tokens, FINISHED_CHECK_INTERVAL)
    # (the paged layout keeps a block table per sample: `PagedLayout.seat`)
    cache.prepare(layout, 0, rows, lengths, decode_limit=limit, table_rows=prompts * n, max_blocks=blocks)
    # (a streaming batch reads every prompt through its rows' tables: no prompt groups in its shape)
    shape = layout.decode_shape(cache, rows, 0, max_new_tokens, decoder.adapter.dtype, decoder.step.logprobs)
    responses = torch.full((prompts * n, max_new_tokens), decoder.pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(prompts * n, max_new_tokens, device=device) if decoder.step.logprobs else None
    batch = decoder.batch(
        decoder.state_for(shape), layout.stream_map(rows), keeps_left=False, output=(responses, logprobs)
    )
    batch.clear()
    # HF's cache position of the first decode step; rows admitted later go on from the batch's (a stream has no
    # single padded input whose columns they would be).
    batch.set_cache_position(prompt_len)
    live = torch.ones(prompts * n, dtype=torch.bool, device=device) if live is None else live.to(device, torch.bool)
    # Under a budget of KV tokens the prompts a check admits are prefilled in chunks, so that the dense scratch
    # cache they are prefilled into holds at most an eighth of the budget (at least one prompt).
    chunk = None if max_kv_tokens is None else max(1, max_kv_tokens // (8 * prompt_len))
    admission = Admission(
        batch, prefill, prompt_mask, scratch, seed=seed, row_ids=row_ids.to(device), live=live, chunk=chunk
    )
    budget = None if blocks is None else BlockBudget(cache.paged, prompt_len, FINISHED_CHECK_INTERVAL)
    scheduler = Refill(prompts, n, compacts=compacts, budget=budget)
    decoder.apply(batch, scheduler.decide(batch.map.original.tolist(), [True] * rows, 0, [0] * rows), admission)
    steps = decoder.run(batch, scheduler, admission)
    # (the peak: the tail's in-place compaction makes the views smaller)
    kv_bytes = cache.peak_used_bytes + scratch.allocated_bytes + admission.peak_pending_bytes
    return Streamed(responses, logprobs, steps, batch.row_steps, scheduler.refills, kv_bytes, scheduler.preemptions)
