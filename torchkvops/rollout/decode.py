"""The decode loop: `Decoder` runs statically shaped steps over a `DecodeBatch` until its scheduler says stop.

One loop serves every call: steps (eager, compiled or replayed from CUDA graphs, `graphs.DecodeRunner`),
and every FINISHED_CHECK_INTERVAL steps the all-ended check, the one host sync of decode, which hands the
rows' `finished` flags to a scheduler (`torchkvops.rollout.scheduler`) and carries out the decisions it
returns (`Decoder.apply`: retire, prefill and start through the call's admission, compact, stop):
- `UntilEnded` (generate, extend): stop when every row has ended (on every process, with a collective),
  else compact the batch when enough rows have ended (`torchkvops.rollout.compaction`);
- `Refill` (a streaming batch, `torchkvops.rollout.streaming`): retire ended rows, admit waiting samples
  into them, compact the tail once nothing waits.

A step feeds every row's last token, writes its K/V at the row's own `column`, samples the next token with the
`sample_tokens` operator (`sample_tokens_with_logprobs` when log-probabilities are asked for) and
records it; it reads and updates only tensors that keep their addresses for the whole rollout (the
decode state, the KV buffers, the model's parameters) and never syncs with the host, so on CUDA it is
captured once per decode shape and replayed.

Graph keys. A captured graph replays kernels on fixed addresses: it is keyed by the decode shape and
by the address of every tensor it reads that may be made anew while the graph is kept (the state, the
KV views, the cache's position tensors, the model's parameters and buffers), so that a tensor replaced
by a new one (the KV buffers grown by a larger call or an extend, FSDP/ZeRO-3 gathering weights into
new storage, `load_state_dict(assign=True)`, `model.to(...)`) re-captures instead of replaying on freed
memory; what the key leaves out lives as long as the rollout (the EOS ids, the sampling constants).
Python values the step bakes into a graph are keyed too (the adapters' state and scales).
tests/test_graph_keys.py records every address a step reads and checks this.
Parameters updated in place (an optimizer step) keep their addresses, and the graph reads the new
values.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict  # (the bounded record of graph keys)
from collections.abc import Callable

import torch
from torch import Tensor

from ..models.adapter import ModelAdapter
from ..utils import LRU
from . import attention, compaction
from .batch import DecodeBatch, visible_bias
from .graphs import DecodeRunner
from .kv_cache import RolloutKVCache
from .layouts import round_up
from .paged_kv import slot_mapping
from .sampling import SamplingParams, row_keys, sample, sample_with_logprobs
from .scheduler import Decisions, UntilEnded
from .state import DecodeShape, DecodeState

__all__ = [
    "DecodeStep",
    "Decoder",
    "DecodeCounters",
    "NonFiniteLogitsError",
    "FINISHED_CHECK_INTERVAL",
    "MAX_DECODE_STATES",
]

# The all-rows-ended check syncs with the host, so decode makes it only every this many steps.
FINISHED_CHECK_INTERVAL = 8
# Decode states (and so decode graphs) kept for this many distinct decode shapes: with compaction, a
# rollout configuration of R rows has up to 8 + 4 log2(R / 8) of them (torchkvops.rollout.compaction).
MAX_DECODE_STATES = 48
# Carries out a scheduler's prefills and starts on the batch (a streaming batch's `streaming.Admission`).
Admit = Callable[[DecodeBatch, Decisions], None]


class DecodeStep:
    """One decode step over every row; `bind()` points it at a rollout's state first."""

    def __init__(
        self,
        adapter: ModelAdapter,
        cache: RolloutKVCache,
        params: SamplingParams,
        pad_id: int,
        eos: Tensor | None,
        min_new_tokens: int = 0,
        logprobs: bool = False,
    ):
        self.adapter, self.cache, self.params, self.pad_id, self.eos = adapter, cache, params, pad_id, eos
        self.logprobs = logprobs  # also record each token's log-probability (DecodeState.logprobs)
        self.min_new_tokens = min_new_tokens if eos is not None else 0
        self.eos_mask: Tensor | None = None  # [vocab] bool, True at the EOS ids (only with min_new_tokens)
        self.state: DecodeState | None = None
        self.kwargs: dict = {}

    def bind(self, state: DecodeState) -> None:
        self.state = state
        # Built once per rollout, not per step: the same tensors every step. HF's cache_position: the column
        # HF's padded layout would feed this step's tokens at (the state's, set when the call starts).
        self.kwargs = self.adapter.forward_kwargs(self.cache, state.bias, state.position_ids, state.cache_position)

    def __call__(self) -> None:
        s = self.state
        s.bias.scatter_(-1, s.column.view(-1, 1, 1, 1), 0.0)  # the key each row writes this step becomes visible
        s.kv_length.copy_(s.column + 1)  # (what the decode attention reads: up to that key)
        if s.kv_slot is not None:  # the paged layout: the slot of that key, through the row's table
            s.kv_slot.copy_(slot_mapping(s.kv_blocks, s.column, s.shape.kv_block))
        logits = self.adapter.model(input_ids=s.tokens, **self.kwargs).logits[:, -1, :]
        self.cache.end_step()  # (recurrent layers: ended rows' states as they were)
        self.draw(logits)
        s.position_ids.add_(1)
        s.cache_position.add_(1)
        # A live row never passes the buffer's last column (its length covers the row's tokens); a row that
        # has ended may decode on as filler until the batch stops or retires it: it stays on the last column.
        s.column.add_(1).clamp_(max=s.shape.key_columns - 1)

    def draw(self, logits: Tensor) -> None:
        """Sample every row's next token from its logits [rows, vocab] (with its log-probability when
        asked) and record it."""
        logits = self.suppress_eos(logits)
        if not self.params.greedy:
            self.watch_nonfinite(logits)
        if self.logprobs:
            self.accept(*sample_with_logprobs(logits, self.params, self.state.sample_keys, self.state.step))
        else:
            self.accept(sample(logits, self.params, self.state.sample_keys, self.state.step))

    def suppress_eos(self, logits: Tensor) -> Tensor:
        """While fewer than min_new_tokens tokens exist, EOS ids cannot be sampled (as HF's
        MinNewTokensLengthLogitsProcessor): their logits are -inf. Without min_new_tokens, no op."""
        if not self.min_new_tokens:
            return logits
        if self.eos_mask is None or self.eos_mask.shape[0] != logits.shape[-1]:
            self.eos_mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            self.eos_mask[self.eos] = True
        early = (self.state.step < self.min_new_tokens)[:, None]
        return logits.masked_fill(self.eos_mask & early, float("-inf"))

    def watch_nonfinite(self, logits: Tensor) -> None:
        """Record the step at which a live row's logits / temperature first hold a NaN or +inf or are all
        -inf (softmax gives NaN: HF's sampling raises "probability tensor contains either inf, nan or
        element < 0"). One max per row, no host sync: the rollout reads the record at its checks."""
        s = self.state
        top = logits.amax(dim=-1).float() / self.params.temperature  # NaN if any NaN; +inf if any +inf
        bad = ~torch.isfinite(top) & ~s.finished & (s.nonfinite_step < 0)
        s.nonfinite_step.copy_(torch.where(bad, s.step, s.nonfinite_step))

    def accept(self, sampled: Tensor, logprob: Tensor | None = None) -> None:
        """Record sampled tokens [rows] (and their log-probabilities) at index `step`; rows that
        already ended get the pad id (and 0)."""
        s = self.state
        token = sampled if self.eos is None else torch.where(s.finished, self.pad_id, sampled)
        last = s.shape.max_new_tokens - 1  # a row's last token
        column = s.step.clamp(max=last + 1)[:, None]  # past its last: the spare column
        s.responses.scatter_(1, column, token[:, None])
        if logprob is not None:
            s.logprobs.scatter_(1, column, torch.where(s.finished, 0.0, logprob)[:, None])
        if self.eos is not None:
            # A comparison, not torch.isin: isin sorts (and syncs) when there are many EOS ids.
            s.finished.logical_or_((token[:, None] == self.eos).any(dim=1))
        s.finished.logical_or_(s.step >= last)  # a row with max_new_tokens tokens has ended
        s.tokens.copy_(token[:, None])
        s.step.add_(1)


class NonFiniteLogitsError(RuntimeError):
    """Sampling met logits holding NaN or +inf (or only -inf) on a live row, where Hugging Face's sampling
    raises "probability tensor contains either inf, nan or element < 0". Greedy decoding takes the
    argmax as HF does and never raises this."""


@dataclasses.dataclass(frozen=True)
class DecodeCounters:
    """What a rollout's decode has built and done so far (for tests and benchmarks, instead of reading
    private attributes): decode states kept (one per decode shape), distinct graph keys met (a shape and
    the addresses its step reads), CUDA graphs captured and kept, compactions applied, the key of the
    last decode, the steps that ran compiled (compile=True), and the graph keys that run eagerly because
    their compile or capture failed (Dynamo's recompile limit, a step that syncs)."""

    decode_shapes: int
    graph_keys: int
    captured_graphs: int
    compactions: int
    graph_key: tuple | None
    compiled_steps: int = 0
    eager_keys: int = 0


_KEYS_KEPT = 4096  # DecodeCounters.graph_keys counts among the last this many keys (a bounded record)


class Decoder:
    """A rollout's decode: its states (one per decode shape, kept across calls), step, runner and attention
    context, and the loop (module docstring).

    `layout`: the KV layout (torchkvops.rollout.layouts); `compacts`: compact the batch as rows end;
    `graph_extra`: more addresses a step reads (a float32 LM head's)."""

    def __init__(
        self,
        adapter: ModelAdapter,
        cache: RolloutKVCache,
        step: DecodeStep,
        layout,
        *,
        compile: bool,
        cuda_graphs: bool,
        compacts: bool,
        graph_extra: Callable[[], tuple] = tuple,
    ):
        self.adapter, self.cache, self.step, self.layout = adapter, cache, step, layout
        self.pad_id = step.pad_id
        self.compacts = compacts
        self.graph_extra = graph_extra
        self.runner = DecodeRunner(step, compile, cuda_graphs, adapter.device)
        self.context = attention.DecodeAttention()
        self.decode_states: LRU[DecodeShape, DecodeState] = LRU(MAX_DECODE_STATES)
        self._bound: DecodeState | None = None  # what the step, context and graph key point at
        self._bound_views: tuple[int, int] | None = None
        self._graph_keys: OrderedDict[int, None] = OrderedDict()  # hashes of the last _KEYS_KEPT keys met
        self._compactions = 0
        # The paged layout: each home row's (column, ended) as the last all-ended check read them, for the
        # next stretch's blocks (`_reserve_blocks`: no second host sync); None when unknown.
        self._known_rows: dict[int, tuple[int, bool]] | None = None

    @property
    def counters(self) -> DecodeCounters:
        runner = self.runner
        return DecodeCounters(
            len(self.decode_states),
            len(self._graph_keys),
            len(runner.graphs),
            self._compactions,
            runner.key,
            runner.compiled_steps,
            len(runner.eager_keys),
        )

    def release(self) -> None:
        """Forget every state and graph, and the last call's views of the KV cache."""
        self.decode_states.clear()
        self.runner.reset()
        self.step.state, self.step.kwargs = None, {}
        self._bound = None
        self.context = attention.DecodeAttention()

    def batch(self, state: DecodeState, batch_map: compaction.BatchMap, **options) -> DecodeBatch:
        """A batch over `state` with this decoder's cache, layout, pad id, decode states and sampler."""
        return DecodeBatch(
            self.cache,
            self.layout,
            state,
            batch_map,
            pad_id=self.pad_id,
            make_state=self.state_for,
            draw=self.draw,
            **options,
        )

    def draw(self, state: DecodeState, logits: Tensor) -> None:
        """Each row of `state` draws its next token from `logits` [rows, vocab] (the decode step's sampler)."""
        previous, self.step.state = self.step.state, state
        try:
            self.step.draw(logits)
        finally:
            self.step.state = previous

    def state_for(self, shape: DecodeShape) -> DecodeState:
        """The decode state of this shape, kept (least recently used dropped past MAX_DECODE_STATES)."""
        return self.decode_states.put(shape, self.decode_states.get(shape) or DecodeState(shape, self.adapter.device))

    # --- a call ----------------------------------------------------------------------------------
    def start(
        self,
        first_logits: Tensor,
        seed: int,
        row_ids: Tensor,
        live: Tensor | None,
        *,
        visible: Tensor,
        positions: Tensor,
        write_start: int | Tensor,
        max_new_tokens: int,
        cache_position: int,
        prompt_visible: Tensor | None = None,
        common: int = 0,
    ) -> DecodeBatch:
        """A batch of every row of a call, each row's first token sampled from `first_logits` [rows,
        vocab]. What each row sees: `visible` [rows, C] (bool) over the decode buffer's first C columns,
        and, when its prompt's whole blocks are read stacked, `prompt_visible` [prompts, P'] over them;
        `positions` [rows]: the position of the token each row feeds first; decode writes from column
        `write_start` on (one for every row, or [rows]: each row's own); `cache_position`: HF's cache
        position of the first token decode feeds (the width of the input HF's generate would have: it goes
        up by one a step). `live` [rows] (bool, optional): False for rows that have ended before they start.
        `common`: the tokens of a prefix common to every prompt (its whole blocks then read once for every row)."""
        rows = first_logits.shape[0]
        prompts, prompt_columns = (0, 0) if prompt_visible is None else prompt_visible.shape
        shape = self.layout.decode_shape(
            self.cache,
            rows,
            prompts,
            max_new_tokens,
            self.adapter.dtype,
            self.step.logprobs,
            prompt_columns=prompt_columns,
            common=common,
        )
        batch = self.batch(self.state_for(shape), self.layout.batch_map(rows))
        self.step.bind(batch.state)
        batch.admit(
            None,
            torch.arange(rows),
            first_logits,
            sample_keys=row_keys(seed, row_ids.to(batch.state.sample_keys.device, torch.long)),
            positions=positions,
            columns=torch.as_tensor(write_start, dtype=torch.long).expand(rows),
            bias=visible_bias(visible, shape.key_columns),
            live=live,
        )
        if batch.state.prompt_table is not None:  # (its prompts read stacked)
            batch.show_prompt_blocks(prompt_visible, self.layout.samples)
        batch.set_cache_position(cache_position)
        return batch

    def initial_plan(self, ended: Tensor) -> compaction.Plan | None:
        """The compaction that leaves out the rows that have ended before a call's decode starts (host
        bool [rows]; Rollout.extend's rows that generate nothing), or None when it would not save enough
        or the decoder does not compact. The caller gathers the KV cache (and computes only those rows'
        first logits); `run(..., initial_plan=)` gathers the state."""
        if not self.compacts or not bool(ended.any()) or bool(ended.all()):
            return None
        return compaction.plan(ended, self.layout.batch_map(ended.numel()))

    def run_call(
        self,
        batch: DecodeBatch,
        ended_everywhere: Callable[[bool], bool] | None = None,
        initial_plan: compaction.Plan | None = None,
    ) -> int:
        """Decode a call's batch (`UntilEnded`); `initial_plan` (see `initial_plan()`): decode starts with
        the rows it keeps, the KV cache already gathered. Returns the step count; the batch's output then
        holds every row's tokens."""
        if initial_plan is not None:
            batch.compact(initial_plan, 1, cache_gathered=True)
            batch.row_steps = initial_plan.size  # only the kept rows' first token was computed
        # (Rows end early only at an EOS id: without them there is nothing to compact at the checks.)
        compacts = self.compacts and self.step.eos is not None
        scheduler = UntilEnded(batch.first.shape.max_new_tokens, compacts, FINISHED_CHECK_INTERVAL, ended_everywhere)
        # Without EOS ids no row ends early and a rollout alone skips the checks; in lockstep it checks all
        # the same: the check is a collective, and another process's rows may end (its call has EOS ids).
        checks = self.step.eos is not None or ended_everywhere is not None
        steps = self.run(batch, scheduler, checks=checks)
        batch.finish(steps + 1)
        return steps

    # --- the loop --------------------------------------------------------------------------------
    def run(self, batch: DecodeBatch, scheduler, admission: Admit | None = None, checks: bool = True) -> int:
        """Decode steps over `batch` until `scheduler.max_steps` steps (None: no bound) or until its decisions
        at an all-ended check (every FINISHED_CHECK_INTERVAL steps, when `checks`) say stop
        (torchkvops.rollout.scheduler); `admission` carries out the prefills and starts it decides. Returns
        the step count. Raises NonFiniteLogitsError at the first check after a live row's logits could not
        be sampled from."""
        steps, limit = 0, scheduler.max_steps
        self._known_rows = None
        self._bound = None  # bound anew for every call: the weights or the cache's positions may be new
        self._bind(batch.state)
        self.cache.bind(self.context)  # each step's K and V go where the decode context says
        written = None  # (an upper bound of the decode buffer's columns written, once known)
        try:
            while limit is None or steps < limit:
                stretch = FINISHED_CHECK_INTERVAL - steps % FINISHED_CHECK_INTERVAL if checks else limit - steps
                stretch = stretch if limit is None else min(stretch, limit - steps)
                if not checks and self._slides():  # (sliding-window blocks go back between stretches only)
                    stretch = min(stretch, FINISHED_CHECK_INTERVAL)
                written = self._make_room(batch, written, stretch)
                self._reserve_blocks(batch, stretch)
                self._bind(batch.state)  # (again after a compaction or a widening)
                with attention.rollout_attention(self.adapter.model, self.context):
                    for _ in range(stretch):
                        self.runner()
                steps += stretch
                written = None if written is None else written + stretch
                batch.row_steps += stretch * batch.rows
                if not checks or steps % FINISHED_CHECK_INTERVAL:
                    continue
                # Host sync: reads `finished` (and the non-finite record) every few steps to stop early,
                # to compact and to refill; the scheduler adds no other.
                s = batch.state
                flags = torch.stack([s.finished.long(), s.nonfinite_step, s.column]).cpu()
                _raise_on_nonfinite(flags[1])
                homes, ended = batch.map.original.tolist(), flags[0].bool().tolist()
                if self.cache.paged is not None:  # (what the next stretch's blocks follow, by home row)
                    self._known_rows = _by_home(homes, flags[2].tolist(), ended)
                decisions = scheduler.decide(homes, ended, steps, flags[2].tolist())
                if self._known_rows is not None:  # a sample started now is a new row, whatever it was at the check
                    for _, samples, _ in decisions.start:
                        for sample in samples:
                            self._known_rows.pop(sample, None)
                if self.apply(batch, decisions, admission):
                    break
        finally:
            self._compactions += batch.compactions
            batch.compactions = 0
        return steps

    def _make_room(self, batch: DecodeBatch, written: int | None, stretch: int) -> int | None:
        """Before `stretch` steps: widen the decode buffer (doubling, up to the cache's decode_limit) when the
        rows' writes could pass its end. `written`: an upper bound of the columns written so far (None:
        unknown); the exact count is read (a host sync) only when the bound does not leave room. Returns the
        bound after the widening."""
        width, cache = batch.state.shape.key_columns, self.cache
        if width >= cache.decode_limit or (written is not None and written + stretch <= width):
            return written
        written = batch.written()  # host sync: only when the buffer may need widening
        if written + stretch <= width:
            return written
        columns = min(cache.decode_limit, round_up(max(2 * width, written + stretch)))
        cache.widen(columns)
        batch.widen(columns)
        return written

    def _slides(self) -> bool:
        """Whether the rows' KV has sliding-window blocks to give back as they grow (the paged layout)."""
        return self.cache.paged is not None and self.cache.paged.windows is not None

    def _reserve_blocks(self, batch: DecodeBatch, stretch: int) -> None:
        """The paged layout, before `stretch` steps: each live row holds blocks for the columns it will
        write (its table in the batch's state updated); ended rows take none. Host sync: the rows' columns."""
        if self.cache.paged is None:
            return
        s, homes = batch.state, batch.map.original.tolist()
        known, self._known_rows = self._known_rows, None
        if known is None or any(h >= 0 and h not in known for h in homes):
            flags = torch.stack([s.column, s.finished.long()]).cpu()  # host sync (none after a check: `known`)
            known = _by_home(homes, flags[0].tolist(), flags[1].bool().tolist())
        rows = [r for r, home in enumerate(homes) if home >= 0 and not known[home][1]]
        if not rows:
            return
        until = [min(known[homes[r]][0] + stretch, s.shape.key_columns) for r in rows]
        written = [known[homes[r]][0] for r in rows]  # (sliding-window blocks before their windows go back)
        changed = set(self.cache.reserve([homes[r] for r in rows], until, written))
        batch.load_tables([r for r in rows if homes[r] in changed])

    @staticmethod
    def apply(batch: DecodeBatch, decisions: Decisions, admission: Admit | None = None) -> bool:
        """Carry out a scheduler's decisions on `batch`, in their order; whether to stop."""
        batch.retire(decisions.retire)
        batch.preempt(decisions.preempt)
        if decisions.prefill or decisions.start or decisions.forget or decisions.release:
            admission(batch, decisions)
        if decisions.compact is not None:
            plan = batch.plan(torch.tensor(decisions.compact))
            if plan is not None:
                batch.compact(plan, decisions.compact_tokens)
        return decisions.stop

    def check_nonfinite(self, batch: DecodeBatch) -> None:
        """After a call, in sampling: raise NonFiniteLogitsError if any live row met logits it could not
        sample from since the last check. Host sync: one read, once per call."""
        if not self.step.params.greedy:
            _raise_on_nonfinite(batch.state.nonfinite_step.cpu())

    def _bind(self, state: DecodeState) -> None:
        """Point the step, the attention context and the runner's graph key at `state` and the KV cache's
        current views (again only when the state or the views changed)."""
        cache = self.cache
        views = tuple(id(t) for v in (cache.decode_views, cache.prompt_views) for t in v.buffers)
        views += (id(getattr(cache.paged, "window_map", None)),)  # (the paged layout's, made anew as its pool grows)
        if self._bound is state and self._bound_views == views:
            return
        self._bound, self._bound_views = state, views
        self.step.bind(state)
        self.context.load(state, cache)
        dynamic = [(t, (0,)) for t in state.tensors()] + [(state.bias, (0, 3))]
        # The decode buffers (the pools, a hybrid's states) by their addresses, no dim marked: a pool's blocks
        # change only when it grows (a recompile then, after which Dynamo's automatic dynamic shapes take
        # over), and a marked pool made the next call's prefill recompile.
        dynamic += [(t, ()) for t in cache.decode_views.buffers]
        dynamic += self.layout.dynamic_tensors(state, cache)
        # Once per tensor, with every dim it was listed with (rows, and for some the key length).
        merged: dict[int, tuple[Tensor, set[int]]] = {}
        for t, dims in dynamic:
            merged.setdefault(id(t), (t, set()))[1].update(dims)
        dynamic = [(t, tuple(sorted(dims))) for t, dims in merged.values()]
        addresses = tuple(t.data_ptr() for t, _ in dynamic)
        key = (
            state.shape,
            self.layout.name,
            addresses,
            self.adapter.weight_addresses() + self.graph_extra(),
            self.adapter.adapter_state(),
        )
        self._graph_keys[hash(key)] = None
        self._graph_keys.move_to_end(hash(key))
        while len(self._graph_keys) > _KEYS_KEPT:
            self._graph_keys.popitem(last=False)
        self.runner.start(dynamic, graph_key=key)


def _by_home(homes: list[int], columns: list[int], ended: list[bool]) -> dict[int, tuple[int, bool]]:
    """Each batch row's (column, ended), by its home row (its sample's table: stable across compactions)."""
    return {h: (c, e) for h, c, e in zip(homes, columns, ended)}


def _raise_on_nonfinite(nonfinite_step: Tensor) -> None:
    """nonfinite_step (host [rows]): DecodeState's record."""
    bad = nonfinite_step[nonfinite_step >= 0]
    if bad.numel():
        raise NonFiniteLogitsError(
            f"torchkvops: the logits of {bad.numel()} row(s) hold NaN or inf at new token {int(bad.min())} (counting "
            "from 0), so there is no distribution to sample from; Hugging Face's generate raises here too "
            '("probability tensor contains either inf, nan or element < 0"). Check the model\'s weights and inputs '
            "(a half-precision overflow?)"
        )
