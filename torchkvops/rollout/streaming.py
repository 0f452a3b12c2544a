"""Rollouts larger than the row budget (`RolloutConfig.max_rows`): a fixed batch of rows, refilled.

When B x N sample rows exceed max_rows, the rollout decodes in one batch of max_rows rows (rounded down
to whole prompts' samples) whose KV buffers are sized for those rows only. At every all-ended check
(every FINISHED_CHECK_INTERVAL steps, the host sync decode makes anyway) the rows whose samples have
ended are copied out to their places in the output, and waiting samples take them: a prompt is
prefilled once for its N samples, into a small scratch cache, and its samples start as rows free up, in
any free rows (copy layout: each row gets the prompt's KV in the columns that end at the batch's current
write column, the decode buffer being a ring, and the KV of a prompt whose samples still wait for rows is
kept apart; prefix layout: the prompt's KV goes into a free prompt slot, held until all its samples have
ended, and its samples' rows read it through the compacted prefix layout's query slots). Decode goes on
with one batch, one decode shape (one CUDA graph). Once no prompt waits, the rows still decoding are
compacted in place as compaction compacts them.

The same tokens as without a budget: a row samples with its global row's key and its own step (the
sampler takes a step per row), its attention sees its own prompt and tokens only (the columns of other
occupants of its row are hidden), and it ends at its own max_new_tokens. The caller cuts the output to the
unbudgeted rollout's length (`unbudgeted_width`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import compaction
from .decode import FINISHED_CHECK_INTERVAL, DecodeShape, _raise_on_nonfinite
from .kv_cache import RolloutKVCache
from .sampling import row_keys

__all__ = ["Streamed", "stream", "unbudgeted_width"]


@dataclasses.dataclass
class Streamed:
    responses: Tensor  # [B*N, max_new_tokens] in input order (the pad id after each row's end)
    logprobs: Tensor | None
    steps: int  # decode steps run
    row_steps: int  # rows sampled, summed over the steps (the batch's rows at every step)
    refills: int  # prompts admitted after the start
    kv_bytes: int  # the batch's KV buffers, the scratch cache prompts are prefilled into, pending prompts' KV


def unbudgeted_width(lengths: list[int], max_new_tokens: int, has_eos: bool) -> int:
    """How many columns an unbudgeted rollout's responses have, given each live row's response length
    (through its first EOS; max_new_tokens without one): decode stops at the first all-ended check
    (every FINISHED_CHECK_INTERVAL steps) at which every row has ended, else after max_new_tokens."""
    if not has_eos or not lengths or max(lengths) >= max_new_tokens:
        return max_new_tokens
    interval = FINISHED_CHECK_INTERVAL
    check = max(interval, -(-(max(lengths) - 1) // interval) * interval)  # the first check after the longest
    return min(max_new_tokens, check + 1)


def stream(
    rollout,
    input_ids: Tensor,
    prompt_mask: Tensor,
    seed: int,
    row_ids: Tensor,
    live: Tensor | None,
    lengths: tuple[int, ...],
    scratch: RolloutKVCache,
) -> Streamed:
    """Decode every prompt's N rows within `rollout.config.max_rows` rows (module docstring). `lengths`:
    the KV buffers' positions (engine.kv_lengths); `scratch`: the cache admitted prompts are prefilled into."""
    cfg, cache, decoder, adapter = rollout.config, rollout.cache, rollout._decoder, rollout.adapter
    n, new_tokens, device = cfg.samples_per_prompt, cfg.max_new_tokens, rollout.device
    batch, prompt_len = input_ids.shape
    prefix = cfg.kv_sharing == "prefix"
    slots = min(cfg.max_rows // n, batch)
    rows = slots * n
    # Prefix layout: prompt KV slots, each held until all of its prompt's samples have ended (twice the
    # prompts the rows hold at once, so that prompts whose last samples linger do not keep rows idle).
    prompt_slots = min(batch, 2 * slots)
    if prefix:
        cache.prepare_prefix(prompt_slots, lengths[0], rows, lengths[1])
    else:
        cache.prepare_copy(rows, lengths[0])
    columns = cache.decode_kv.shape[4]
    batch_bytes = cache.used_bytes  # (the tail's in-place compaction makes the views smaller)
    live = torch.ones(batch * n, dtype=torch.bool, device=device) if live is None else live.to(device, torch.bool)
    padded = (prompt_mask == 0).any(dim=1).tolist()  # host: which prompts need a padding mask
    state = decoder.state_for(
        DecodeShape(
            rows,
            columns,
            new_tokens,
            adapter.dtype,
            prompt_slots if prefix else 0,
            cache.prompt_kv.shape[4] if prefix else 0,
            cfg.return_logprobs,
            n if prefix else 0,  # prefix: each prompt slot's N query slots, its samples' rows anywhere
        )
    )
    for t in state.tensors():  # empty rows: ended, seeing nothing
        t.zero_()
    state.bias.fill_(float("-inf"))
    if prefix:
        state.prompt_bias.fill_(float("-inf"))
    state.finished.fill_(True)
    state.nonfinite_step.fill_(-1)
    write = 0 if prefix else prompt_len  # the column the next step writes, as without a budget
    cache.start_decode(write)
    decoder.bind(state)

    responses = torch.full((batch * n, new_tokens), rollout.pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(batch * n, new_tokens, device=device) if cfg.return_logprobs else None
    # Each batch row's sample (its global row), None while free. Copy layout: a row is freed as soon as
    # it ends, and a prompt takes any N free rows. Prefix layout: a prompt takes a slot (a prompt KV slot
    # and its N rows), freed when all its rows have ended (its rows read the prompt KV of their slot).
    sample_at: list[int | None] = [None] * rows
    waiting = list(range(batch))
    refills = steps = row_steps = 0

    def prefill(prompts: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """Each prompt's KV once ([layers, 2, k, kv_heads, P, head_dim], a copy) and first logits [k, vocab]."""
        index = torch.tensor(prompts, device=device)
        ids, mask = input_ids[index], prompt_mask[index]
        scratch.prepare_copy(len(prompts), prompt_len)
        scratch.start_prefill()
        attn = rollout._prefill_attention_mask(mask) if any(padded[p] for p in prompts) else None
        logits = adapter.last_logits(
            scratch, ids, attn, (mask.cumsum(dim=1) - 1).clamp(min=0), torch.arange(prompt_len, device=device)
        )
        return scratch.prompt_kv, logits, mask  # (the next prefill overwrites the scratch cache)

    # Prefix layout: the prompt in each prompt slot, and how many of its samples have not ended yet.
    slot_prompt: list[int | None] = [None] * prompt_slots
    slot_left = [0] * prompt_slots
    slot_of_row = [0] * rows  # (host) each row's prompt slot

    def place_prompts(prompts: list[int], kv: Tensor, mask: Tensor) -> list[int]:
        """Prefix layout: each prompt's KV into a free prompt slot; the slots."""
        free = [g for g in range(prompt_slots) if slot_prompt[g] is None][: len(prompts)]
        index = torch.tensor(free, device=device)
        cache.prompt_kv[..., :prompt_len, :].index_copy_(2, index, kv)
        bias = torch.full((len(prompts), cache.prompt_kv.shape[4]), float("-inf"), device=device)
        bias[:, :prompt_len].masked_fill_(mask.bool(), 0.0)
        state.prompt_bias[index, 0, 0] = bias.to(state.prompt_bias.dtype)
        for g, prompt in zip(free, prompts):
            slot_prompt[g], slot_left[g] = prompt, n
        return free

    def start(kv: Tensor, logits: Tensor, mask: Tensor, of_row: Tensor, samples: list[int], batch_rows: list[int]):
        """Start samples `samples` (global rows) at `batch_rows`: row i of them is a sample of prefilled prompt
        of_row[i] (an index into kv, logits and mask)."""
        nonlocal row_steps
        new_rows = torch.tensor(batch_rows, device=device)
        global_rows = torch.tensor(samples, device=device)
        row_mask = mask.bool()[of_row]  # [rows', P]
        state.bias[new_rows] = float("-inf")
        if prefix:  # the rows' own buffers start empty; their prompt's KV is in its slot (`kv`: the slot)
            sample = global_rows % n
            state.slot_rows[kv * n + sample] = new_rows
            state.row_prompt[new_rows] = kv
            state.row_sample[new_rows] = sample
            for r in batch_rows:
                slot_of_row[r] = kv
        else:  # each row's copy of its prompt, in the columns that end where the next step writes
            ring = (write - prompt_len + torch.arange(prompt_len, device=device)) % columns
            for layer in range(cache.decode_kv.shape[0]):
                rows_kv = kv[layer][:, of_row]  # [2, rows', heads, P, head_dim]
                cache.decode_kv[layer][:, new_rows[:, None], :, ring[None, :]] = rows_kv.permute(1, 3, 0, 2, 4)
            visible = torch.full((new_rows.numel(), columns), float("-inf"), device=device)
            visible[:, ring] = torch.where(row_mask, 0.0, float("-inf"))
            state.bias[new_rows, 0, 0] = visible.to(state.bias.dtype)
        state.position_ids[new_rows, 0] = row_mask.sum(dim=1)
        state.finished[new_rows] = ~live[global_rows]
        state.keys[new_rows] = row_keys(seed, row_ids.to(device)[global_rows])
        state.step[new_rows] = 0
        state.nonfinite_step[new_rows] = -1
        state.responses[new_rows] = rollout.pad_id
        if state.logprobs is not None:
            state.logprobs[new_rows] = 0.0
        decoder.draw_rows(new_rows, logits[of_row])
        row_steps += new_rows.numel()
        for r, g in zip(batch_rows, samples):
            sample_at[r] = g

    # Copy layout: prompts prefilled whose samples have not all started (rows free up one by one): their
    # KV, first logits and mask, and the samples still to start.
    pending: list[tuple[Tensor, Tensor, Tensor, list[int]]] = []
    peak_pending = [0]  # bytes of the pending prompts' KV, at most

    def copy_out(batch_rows: list[int]) -> None:
        """The tokens of these (ended) rows to their samples' places in the output; the rows are free."""
        if not batch_rows:
            return
        src = torch.tensor(batch_rows, device=device)
        dst = torch.tensor([sample_at[r] for r in batch_rows], device=device)
        responses[dst] = state.responses[src, :new_tokens]
        if logprobs is not None:
            logprobs[dst] = state.logprobs[src, :new_tokens]
        for r in batch_rows:
            sample_at[r] = None

    def refill(ended: list[bool]) -> None:
        """Free the rows whose samples have ended (copied out), then give them to waiting samples: the
        next sample of a prompt prefilled already, else of the next waiting prompt, prefilled once (its
        other samples start as rows free up; prefix layout: while a prompt KV slot is free)."""
        nonlocal refills
        done = [r for r, s in enumerate(sample_at) if s is not None and ended[r]]
        if prefix:
            for r in done:
                g = slot_of_row[r]
                slot_left[g] -= 1
                if slot_left[g] == 0:
                    slot_prompt[g] = None
        copy_out(done)
        free = [r for r, s in enumerate(sample_at) if s is None]
        unstarted = sum(len(rest) for *_, rest in pending)
        wanted = -(-max(0, len(free) - unstarted) // n)
        if prefix:
            wanted = min(wanted, sum(1 for g in slot_prompt if g is None))
        prompts = [waiting.pop(0) for _ in range(min(len(waiting), wanted))]
        if prompts:
            refills += len(prompts) if steps > 0 else 0
            kv, logits, mask = prefill(prompts)
            where = place_prompts(prompts, kv, mask) if prefix else None
            for i, prompt in enumerate(prompts):
                home = where[i] if prefix else kv[:, :, i : i + 1]
                pending.append((home, logits[i : i + 1], mask[i : i + 1], [prompt * n + j for j in range(n)]))
        while free and pending:
            kv, logits, mask, rest = pending[0]
            take = rest[: len(free)]
            start(kv, logits, mask, torch.zeros(len(take), dtype=torch.long, device=device), take, free[: len(take)])
            free, rest[:] = free[len(take) :], rest[len(take) :]
            if not rest:
                pending.pop(0)
        if prefix:
            return
        # What still waits for rows keeps its prompt's KV apart from the scratch cache.
        scratch_storage = scratch.prompt_kv.untyped_storage().data_ptr() if scratch.prompt_kv is not None else None
        for i, (kv, logits, mask, rest) in enumerate(pending):
            if kv.untyped_storage().data_ptr() == scratch_storage:
                pending[i] = (kv.clone(), logits, mask, rest)
        held = sum(kv.numel() * kv.element_size() for kv, *_ in pending)
        peak_pending[0] = max(peak_pending[0], held)

    def compact_tail() -> None:
        """Once no prompt waits: the rows still decoding gathered into a smaller batch, as compaction
        gathers them (its plan, sizes and rule; the prefix layout keeps the prompt slots that still have
        a sample, with their query slots), so that the last prompts' ended rows stop costing."""
        nonlocal state
        batch_map = compaction.BatchMap(len(sample_at))
        if prefix:
            batch_map.group, batch_map.groups = torch.tensor(slot_of_row), len(slot_prompt)
        plan = compaction.plan(torch.tensor([s is None for s in sample_at]), batch_map)
        if plan is None:
            return
        keep = plan.rows.to(device)
        groups = None if plan.groups is None else plan.groups.to(device)
        smaller = decoder.state_for(
            dataclasses.replace(state.shape, rows=plan.size, prompts=plan.prompts, slots=plan.slots)
        )
        state.gather_into(smaller, keep, groups)
        if prefix:
            smaller.slot_rows.copy_(plan.slot_rows)
            smaller.row_prompt.copy_(plan.row_slot // plan.slots)
            smaller.row_sample.copy_(plan.row_slot % plan.slots)
            kept_slots = plan.groups.tolist()
            slot_prompt[:] = [slot_prompt[g] for g in kept_slots]
            slot_left[:] = [slot_left[g] for g in kept_slots]
            slot_of_row[:] = plan.row_group.tolist()
        cache.compact_in_place(keep, groups)  # (nothing is kept for extend after a streamed call)
        sample_at[:] = [sample_at[r] for r in plan.rows.tolist()]
        state = smaller
        decoder.bind(state)

    refill([True] * rows)
    while True:
        with decoder.decoding():  # (a prefill runs the model's own attention: admissions happen outside)
            for _ in range(FINISHED_CHECK_INTERVAL):
                decoder.runner()
            steps += FINISHED_CHECK_INTERVAL
            row_steps += state.rows * FINISHED_CHECK_INTERVAL
            write = (write + FINISHED_CHECK_INTERVAL) % columns
        # Host sync: the all-ended check, as without a budget; retiring and refilling add no other.
        flags = torch.stack([state.finished.long(), state.nonfinite_step]).cpu()
        _raise_on_nonfinite(flags[1])
        refill(flags[0].bool().tolist())
        if not waiting and not pending and all(s is None for s in sample_at):
            break
        if not waiting and not pending and cfg.compact_finished_rows:
            compact_tail()
    kv_bytes = batch_bytes + scratch.allocated_bytes + peak_pending[0]
    return Streamed(responses, logprobs, steps, row_steps, refills, kv_bytes)
