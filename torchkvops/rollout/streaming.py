"""Rollouts larger than the row budget (`RolloutConfig.max_rows`): a fixed batch of rows, refilled.

When B x N sample rows exceed max_rows, the rollout decodes S = max_rows // N prompt groups at a time,
in one batch of S x N rows whose KV buffers are sized for those rows only. At every all-ended check
(every FINISHED_CHECK_INTERVAL steps, the host sync decode makes anyway) the groups whose rows have all
ended leave (their tokens copied out to their places in the output) and waiting prompts take their
rows: each prompt is prefilled once for its N rows, into a small scratch cache, and placed (copy layout:
any N rows freed by ended samples, each getting the prompt's KV in the columns that end at the batch's
current write column, the decode buffer being a ring; prefix layout: a slot of N rows and a prompt KV
slot, freed when all its rows have ended); its rows' first tokens are drawn and decode goes on with one
batch, one decode shape (one CUDA graph).

The same tokens as without a budget: a row samples with its global row's key and its own step (the
sampler takes a step per row), its attention sees its own prompt and tokens only (the columns of other
occupants of its row are hidden), and it ends at its own max_new_tokens. The output is as long as the
unbudgeted rollout's (`unbudgeted_width`), in input order.
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
    responses: Tensor  # [B*N, R'] in input order
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
    if prefix:
        cache.prepare_prefix(slots, lengths[0], rows, lengths[1])
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
            slots if prefix else 0,
            cache.prompt_kv.shape[4] if prefix else 0,
            cfg.return_logprobs,
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

    def start(kv: Tensor, logits: Tensor, mask: Tensor, of_row: Tensor, samples: list[int], batch_rows: list[int]):
        """Start samples `samples` (global rows) at `batch_rows`: row i of them is a sample of prefilled prompt
        of_row[i] (an index into kv, logits and mask)."""
        nonlocal row_steps
        new_rows = torch.tensor(batch_rows, device=device)
        global_rows = torch.tensor(samples, device=device)
        row_mask = mask.bool()[of_row]  # [rows', P]
        state.bias[new_rows] = float("-inf")
        if prefix:  # the prompt's KV once, in its slot; the rows' own buffers start empty
            slot_index = new_rows[::n] // n
            cache.prompt_kv[..., :prompt_len, :].index_copy_(2, slot_index, kv)
            bias = torch.full((slot_index.numel(), cache.prompt_kv.shape[4]), float("-inf"), device=device)
            bias[:, :prompt_len].masked_fill_(mask.bool(), 0.0)
            state.prompt_bias[slot_index, 0, 0] = bias.to(state.prompt_bias.dtype)
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
        """Free what has ended (copy layout: rows; prefix layout: slots whose rows have all ended), then
        give the free rows to waiting samples: copy layout, any free row to the next sample of a prompt
        prefilled already, else of the next waiting prompt (prefilled once, its other samples started as
        rows free up); prefix layout, a free slot to the next waiting prompt's N samples."""
        nonlocal refills
        admitted_late = steps > 0
        if prefix:
            done = [s for s in range(slots) if sample_at[s * n] is not None and all(ended[s * n : (s + 1) * n])]
            copy_out([s * n + j for s in done for j in range(n)])
            free_slots = [s for s in range(slots) if sample_at[s * n] is None]
            prompts = [waiting.pop(0) for _ in free_slots[: len(waiting)]]
            if prompts:
                refills += len(prompts) if admitted_late else 0
                kv, logits, mask = prefill(prompts)
                of_row = torch.arange(len(prompts), device=device).repeat_interleave(n)
                samples = [p * n + j for p in prompts for j in range(n)]
                start(
                    kv, logits, mask, of_row, samples, [s * n + j for s in free_slots[: len(prompts)] for j in range(n)]
                )
            return
        copy_out([r for r, s in enumerate(sample_at) if s is not None and ended[r]])
        free = [r for r, s in enumerate(sample_at) if s is None]
        unstarted = sum(len(rest) for *_, rest in pending)
        prompts = [waiting.pop(0) for _ in range(min(len(waiting), -(-max(0, len(free) - unstarted) // n)))]
        if prompts:
            refills += len(prompts) if admitted_late else 0
            kv, logits, mask = prefill(prompts)
            for i, prompt in enumerate(prompts):
                pending.append(
                    (kv[:, :, i : i + 1], logits[i : i + 1], mask[i : i + 1], [prompt * n + j for j in range(n)])
                )
        while free and pending:
            kv, logits, mask, rest = pending[0]
            take = rest[: len(free)]
            start(kv, logits, mask, torch.zeros(len(take), dtype=torch.long, device=device), take, free[: len(take)])
            free, rest[:] = free[len(take) :], rest[len(take) :]
            if not rest:
                pending.pop(0)
        # What still waits for rows keeps its prompt's KV apart from the scratch cache.
        scratch_storage = scratch.prompt_kv.untyped_storage().data_ptr() if scratch.prompt_kv is not None else None
        for i, (kv, logits, mask, rest) in enumerate(pending):
            if kv.untyped_storage().data_ptr() == scratch_storage:
                pending[i] = (kv.clone(), logits, mask, rest)
        held = sum(kv.numel() * kv.element_size() for kv, *_ in pending)
        peak_pending[0] = max(peak_pending[0], held)

    def compact_tail() -> None:
        """Copy layout, once no prompt waits: the rows still decoding gathered into a smaller batch, as
        compaction gathers them (its sizes and rule), so that the last prompts' ended rows stop costing."""
        nonlocal state
        occupied = [r for r, s in enumerate(sample_at) if s is not None]
        size = max(compaction.bucket(len(occupied)), min(2, len(sample_at)))
        if size >= len(sample_at) or size > compaction.COMPACT_FRACTION * len(sample_at):
            return
        keep = occupied + [r for r, s in enumerate(sample_at) if s is None][: size - len(occupied)]
        keep_rows = torch.tensor(keep, device=device)
        smaller = decoder.state_for(dataclasses.replace(state.shape, rows=size))
        state.gather_into(smaller, keep_rows, None)
        cache.compact_in_place(keep_rows)  # (nothing is kept for extend after a streamed call)
        sample_at[:] = [sample_at[r] for r in keep]
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
        if not prefix and not waiting and not pending and cfg.compact_finished_rows:
            compact_tail()
    lengths_out = _response_lengths(responses, live, rollout._eos, new_tokens)
    width = unbudgeted_width(lengths_out, new_tokens, rollout._eos is not None)
    kv_bytes = batch_bytes + scratch.allocated_bytes + peak_pending[0]
    return Streamed(
        responses[:, :width], None if logprobs is None else logprobs[:, :width], steps, row_steps, refills, kv_bytes
    )


def _response_lengths(responses: Tensor, live: Tensor, eos: Tensor | None, new_tokens: int) -> list[int]:
    """Each live row's response length through its first EOS (new_tokens without one)."""
    if eos is None:
        return [new_tokens] * int(live.sum())
    is_eos = torch.isin(responses, eos)
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, new_tokens)
    return first[live].tolist()
