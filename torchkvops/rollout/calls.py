"""A call's stages: one path for `Rollout.generate`, `Rollout.extend` and a stream under a row budget.

`run_stages` runs a call's stages in their one order (prompt_expansion, prefill, kv_expand, decode,
post_processing; a call leaves out those it has none of: a stream prefills inside decode, as rows free
up), each timed by the call's StageTimer, and returns the call's result and its `Counts` for the
profile. What differs between calls is what each stage does:

- `GenerateCall`: the prompts (a common prefix found, computed once), one prefill, the layout's KV
  expansion, a batch of every row decoded until it ends (`Decoder.run_call`), the history extend goes on
  with;
- `ExtendCall`: the appended tokens packed (`turns.make_turn`), one forward over them, rows that
  generate nothing left out, decode, the history recorded;
- `StreamCall`: a batch of `max_rows` rows refilled as rows end (`streaming.stream`), no history kept.

The calls read the rollout's parts (config, layout, cache, decoder, adapter), its prefill functions and
its output helpers, and set the history it keeps for extend; they hold a call's values, the rollout holds
what lasts across calls.
"""

from __future__ import annotations

import dataclasses

import torch

from . import attention, layouts
from .config import RolloutOutput
from .layouts import round_up
from .packed_states import segmented_mixers
from .prompts import common_prefix_length, common_prompts, plain_prompts
from .streaming import Prefill, stream, unbudgeted_width
from .turns import History, first_history, history_output, make_turn, record, turn_attention

__all__ = ["Counts", "GenerateCall", "ExtendCall", "StreamCall", "run_stages"]


@dataclasses.dataclass
class Counts:
    """What a call computed, for its RolloutProfile (`RolloutProfile.from_stages`)."""

    generated: int = 0
    decode_steps: int = 0
    batch_size: int = 0
    samples_per_prompt: int = 0
    prompt_length: int = 0
    response_length: int = 0
    kv_cache_bytes: int = 0
    kv_allocated_bytes: int = 0
    computed_row_steps: int = 0
    prefill_tokens: int = 0
    reused_tokens: int = 0
    refills: int = 0
    preemptions: int = 0


class Call:
    """A call's stages (module docstring); each runs once, in `stages` order, then `post_processing`."""

    stages = ("prompt_expansion", "prefill", "kv_expand", "decode")

    def __init__(self, rollout):
        self.rollout = rollout
        self.counts = Counts(samples_per_prompt=rollout.config.samples_per_prompt)

    def prompt_expansion(self) -> None: ...

    def prefill(self) -> None: ...

    def kv_expand(self) -> None: ...

    def decode(self) -> None: ...

    def post_processing(self):
        raise NotImplementedError

    def count_decode(self, steps: int) -> None:
        """The counts of a call's batch (`self.decoding`) after `steps` decode steps."""
        c = self.counts
        c.decode_steps, c.response_length = steps, steps + 1
        c.kv_cache_bytes, c.computed_row_steps = self.rollout.cache.used_bytes, self.decoding.row_steps
        c.kv_allocated_bytes = self.rollout.cache.allocated_bytes


def run_stages(timer, call: Call):
    """(the call's result, its counts as keyword arguments of RolloutProfile.from_stages)."""
    for name in call.stages:
        with timer.stage(name):
            getattr(call, name)()
    with timer.stage("post_processing"):
        result = call.post_processing()
    return result, dataclasses.asdict(call.counts)


class GenerateCall(Call):
    def __init__(self, rollout, input_ids, attention_mask, seed, row_ids, live, ended_everywhere):
        super().__init__(rollout)
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.seed, self.row_ids, self.live, self.ended_everywhere = seed, row_ids, live, ended_everywhere
        self.counts.batch_size, self.counts.prompt_length = input_ids.shape

    def prompt_expansion(self) -> None:
        cfg = self.rollout.config
        # A prefix every prompt begins with is computed once: not in the expanded baseline, whose point is
        # to compute every row's prompt, nor in lockstep with other processes (`ended_everywhere`), whose
        # forwards may be collectives (FSDP's per-step gathers): a common prefix adds a forward where one
        # process's prompts have one and another's do not.
        look = cfg.shared_prefill and self.ended_everywhere is None
        ids, mask = self.input_ids, self.attention_mask
        self.common = common_prefix_length(ids, mask, cfg.min_shared_tokens if look else None)
        if self.common:
            self.prompts = common_prompts(ids, mask, self.common)
        else:
            self.prompts = plain_prompts(ids, mask)

    def prefill(self) -> None:
        r, batch = self.rollout, self.counts.batch_size
        layout, width = r.layout, self.prompts.width
        rows = batch * r.config.samples_per_prompt
        lengths, limit = layout.first_kv_lengths(width, r.config.max_new_tokens)  # (widened as rows grow)
        r.cache.prepare(layout, batch, rows, lengths, decode_limit=limit)
        if self.common:
            self.logits, self.counts.prefill_tokens = r._prefill_common(self.prompts)
        else:
            self.logits, self.counts.prefill_tokens = r._prefill_prompts(self.input_ids, self.attention_mask)

    def kv_expand(self) -> None:
        r, n = self.rollout, self.rollout.config.samples_per_prompt
        if r.config.shared_prefill and (n > 1 or r.cache.has_states):
            r.layout.expand_prompts(r.cache, self.counts.batch_size, self.prompts.width)
            self.logits = self.logits.repeat_interleave(n, dim=0)

    def decode(self) -> None:
        r, n, layout, prompts = self.rollout, self.rollout.config.samples_per_prompt, self.rollout.layout, self.prompts
        self.decoding = r._decoder.start(
            self.logits,
            self.seed,
            self.row_ids,
            self.live,
            visible=layout.decode_visible(prompts.columns.repeat_interleave(n, dim=0)),
            positions=prompts.lengths.repeat_interleave(n),
            write_start=prompts.ends.repeat_interleave(n),  # (after each prompt's KV)
            max_new_tokens=r.config.max_new_tokens,
            cache_position=self.counts.prompt_length,  # (the input's width)
            prompt_visible=layout.prompt_visible(prompts.columns, r.cache),
            common=prompts.common,
        )
        self.count_decode(r._decoder.run_call(self.decoding, self.ended_everywhere))

    def post_processing(self):
        r = self.rollout
        r._decoder.check_nonfinite(self.decoding)
        out = r._finish(self.input_ids, self.decoding.first, self.counts.response_length)
        self.counts.generated = int(out.response_mask.sum())
        r._history = first_history(out, self.prompts, r.config.samples_per_prompt, r.layout, self.seed, self.row_ids)
        r._streamed = False
        return out


class ExtendCall(Call):
    stages = ("prompt_expansion", "prefill", "decode")  # its rows' KV is where the last call left it

    def __init__(self, rollout, history: History, appended, max_new_tokens: int, seed: int | None):
        super().__init__(rollout)
        self.history, self.appended, self.max_new_tokens, self.seed = history, appended, max_new_tokens, seed
        self.counts.batch_size = history.rows // rollout.config.samples_per_prompt
        self.counts.prompt_length = history.prompts.shape[1]

    def prompt_expansion(self) -> None:
        r, history = self.rollout, self.history
        layout, cache = r.layout, r.cache
        self.turn = turn = make_turn(history, self.appended)
        self.live_positions = torch.where(turn.live, history.last_position + turn.lengths, 0)
        r.adapter.check_length(int(self.live_positions.max()), self.max_new_tokens)
        self.decode_start = history.frontier + turn.lengths  # each row decodes on after its chunk
        start = int(self.decode_start.max())
        first = min(self.max_new_tokens, layouts.FIRST_DECODE_COLUMNS)
        cache.grow(round_up(start + first - 1), decode_limit=round_up(start + self.max_new_tokens - 1))
        self.prompt_visible = layout.prompt_visible(history.prompt_info.columns, cache)
        self.context = turn_attention(history, turn)
        # Rows that generate nothing this turn are left out of its decode when that saves enough: the others
        # are gathered as compaction gathers them, after the forward.
        self.plan = r._decoder.initial_plan(~turn.live.cpu())
        self.counts.prefill_tokens = turn.tokens

    def prefill(self) -> None:
        r, turn, context, cache = self.rollout, self.turn, self.context, self.rollout.cache
        live = turn.live.nonzero().flatten()
        r.layout.reserve(cache, live, self.decode_start[live])  # (the blocks its chunks write; before binding)
        cache.bind(context.bind(cache.decode_views))
        with attention.rollout_attention(r.adapter.model, context), segmented_mixers(r.adapter, cache):
            live_logits = r.adapter.packed_logits(cache, turn.ids, turn.positions, turn.column, turn.last)
        self.logits = live_logits.new_zeros(self.history.rows, live_logits.shape[-1])  # rows left out have ended
        self.logits[context.rows] = live_logits
        if self.plan is not None:
            computed = self.plan.rows.to(r.device)
            cache.compact(computed, None if self.plan.groups is None else self.plan.groups.to(r.device), computed)

    def decode(self) -> None:
        r, history, cache = self.rollout, self.history, self.rollout.cache
        self.decoding = r._decoder.start(
            self.logits,
            history.turn_seed() if self.seed is None else self.seed,
            history.row_ids,
            self.turn.live,
            visible=history.visible(cache.decode_columns, self.decode_start),
            positions=self.live_positions,
            write_start=self.decode_start,
            max_new_tokens=self.max_new_tokens,
            # HF's generate on the full histories, left-padded to the longest: its width.
            cache_position=int(self.live_positions.max()),  # host sync: one int, once per turn
            prompt_visible=self.prompt_visible,
            common=history.prompt_info.common,
        )
        self.count_decode(r._decoder.run_call(self.decoding, initial_plan=self.plan))

    def post_processing(self):
        r, history, turn = self.rollout, self.history, self.turn
        r._decoder.check_nonfinite(self.decoding)
        turn_out = r._finish(
            history.prompts[:: r.config.samples_per_prompt], self.decoding.first, self.counts.response_length
        )
        turn_out.response_mask[~turn.live] = 0
        self.counts.generated = int(turn_out.response_mask.sum())
        self.counts.reused_tokens = int(history.last_position[turn.live].sum())
        record(history, turn, turn_out)
        out = history.output = history_output(history, r.pad_id, RolloutOutput)
        return out, turn_out


class StreamCall(Call):
    """More rows than RolloutConfig.max_rows, or more KV than RolloutConfig.max_kv_tokens may hold: a batch of
    max_rows rows, refilled as rows end (torchkvops.rollout.streaming). Its prefills (once per prompt) happen as rows free up, within decode;
    its rows' KV is not kept for extend()."""

    stages = ("decode",)

    def __init__(self, rollout, input_ids, attention_mask, seed, row_ids, live, prefill: Prefill, scratch):
        super().__init__(rollout)
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.seed, self.row_ids, self.live, self.scratch_prefill, self.scratch = seed, row_ids, live, prefill, scratch
        self.counts.batch_size, self.counts.prompt_length = input_ids.shape
        self.counts.prefill_tokens = input_ids.numel()

    def decode(self) -> None:
        r, cfg = self.rollout, self.rollout.config
        r._history, r._streamed = None, True
        self.done = stream(
            r._decoder,
            self.scratch_prefill,
            self.attention_mask,
            seed=self.seed,
            row_ids=self.row_ids,
            live=self.live,
            max_new_tokens=cfg.max_new_tokens,
            max_rows=cfg.max_rows,
            compacts=cfg.compact_finished_rows,
            scratch=self.scratch,
            max_kv_tokens=cfg.max_kv_tokens,
        )
        c, done = self.counts, self.done
        c.decode_steps, c.kv_cache_bytes, c.computed_row_steps = done.steps, done.kv_bytes, done.row_steps
        c.refills, c.preemptions = done.refills, done.preemptions
        c.kv_allocated_bytes = r.cache.allocated_bytes + self.scratch.allocated_bytes

    def post_processing(self):
        r, done, live = self.rollout, self.done, self.live
        # As long as the unbudgeted rollout's output: it would stop at its first all-ended check.
        lengths = r._response_mask(done.responses).sum(dim=1)
        lengths = (lengths if live is None else lengths[live.to(lengths.device, torch.bool)]).tolist()
        width = unbudgeted_width(lengths, r.config.max_new_tokens, r._eos is not None)
        logprobs = None if done.logprobs is None else done.logprobs[:, :width]
        out = r._output(self.input_ids, done.responses[:, :width], logprobs)
        self.counts.generated = int(out.response_mask.sum())
        self.counts.response_length = width
        return out
