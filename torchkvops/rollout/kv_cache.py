"""The rollout's KV cache, reused across rollouts, presented to Hugging Face models as a `Cache`.

The cache is a list of cache groups (`torchkvops.rollout.cache_groups.CacheGroup`, built from the model's
`CacheSpec`: a full-attention group per KV shape, and a hybrid's recurrent groups). Two ways to keep KV:

- The pool (`PagedStore`, `paged_store.py`; every layout, the expanded baseline's too): each full-attention
  group's KV in blocks of 16 tokens, each row's through its block table, a prompt's whole blocks shared by
  its rows by reference; prefill writes the B prompts into blocks of their own (the expanded baseline:
  each row's prompt alone) and expanding them forks the tables (each row's copy of the prompt's partly
  filled last block). Blocks are taken as rows grow (`reserve`) and given back as they end.
- Dense buffers, only for what has no pool: the recurrent groups' states (one state a row, the prompts'
  expanded by one `repeat_kv_cache_` call per group) and a streaming batch's scratch cache, which a
  prefill writes with `write_kv_` before the prompts' KV goes to their tables:
  `[group layers, 2, rows, kv_heads, tokens, head_dim]` (K at index 0, V at 1). Every operation on them
  (prepare, compact, finish_decode, expand_prompts) runs once per group.

The tables' width (`columns`) follows the longest row, not the budget: a call starts with room for
FIRST_DECODE_COLUMNS tokens a row and is widened (`widen`) as its longest row grows, up to `decode_limit`
(max_new_tokens).

The cache keeps buffers; where a forward's K and V go and what its attention reads is that forward's own
metadata (`torchkvops.rollout.attention`: `PrefillForward`, `PackedAttention`, `DecodeAttention`), which
the caller binds (`bind`) before the model runs, to a buffer of every group (`KVViews`): `update` hands
each layer's K and V to it, and the metadata finds the layer's group and index in the views. A layer that
reads another layer's KV (`CacheSpec.reads`) writes none: `update` hands it the other layer's.

All views of every group are carved out of one flat allocation that is kept while it is big enough, and
every view is contiguous, so compiled graphs see the same strides (and addresses) for the same shapes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ..models.adapter import CacheSpec, KVShape
from ..models.families import ATTENTION_KINDS, RECURRENT
from ..models.recurrent import RecurrentStates, RowLayout, kept_window
from .cache_groups import CacheGroup, KVViews, make_group
from .compaction import COMPACT_FRACTION
from .paged_kv import write_slots
from .paged_store import PagedStore

__all__ = ["RolloutKVCache", "KVShape", "CacheSpec"]


def _carve(
    storage: Tensor | None, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, list[Tensor]]:
    """Views of these shapes, one after the other from the start of `storage` (made, or made larger,
    when it is too small; callers drop their reference to a storage that is too small first, so that it
    is freed before the new one is made): (the storage, the views)."""
    sizes = [math.prod(s) for s in shapes]
    if storage is None or storage.numel() < sum(sizes):
        storage = torch.zeros(sum(sizes), dtype=dtype, device=device)
    views, offset = [], 0
    for shape, size in zip(shapes, sizes):
        views.append(storage[offset : offset + size].view(shape))
        offset += size
    return storage, views


def _per_group(views: list[Tensor], groups: int) -> list[list[Tensor]]:
    """A flat list of views, group after group (as `_flat` lists their shapes), back into one list per group."""
    n = len(views) // groups
    return [views[g * n : (g + 1) * n] for g in range(groups)]


def _flat(shapes: list[list[tuple[int, ...]]]) -> list[tuple[int, ...]]:
    """Every group's buffer shapes, group after group: the order of the views in an allocation."""
    return [shape for group in shapes for shape in group]


class RolloutKVCache(RecurrentStates, Cache):
    """Static KV buffers reused across rollouts, one set per cache group (`groups`); `prepare()` sizes them
    for a layout (torchkvops.rollout.layouts), `release()` frees them. Each group's buffers are one per entry
    of the layout's `kv_lengths`: the prompts' buffer is the first and the decode buffer the last (one and the
    same in every layout now); `prompt_views` and `decode_views` are that buffer of every group."""

    def __init__(self, spec: CacheSpec | KVShape, dtype: torch.dtype, device: torch.device):
        super().__init__(layers=[])
        self.spec = spec if isinstance(spec, CacheSpec) else CacheSpec.single(spec)
        self.dtype, self.device = dtype, torch.device(device)
        self.groups: tuple[CacheGroup, ...] = tuple(make_group(g) for g in self.spec.groups)

        def slots(*kinds: str) -> dict[int, tuple[int, int]]:
            groups = enumerate(self.groups)
            return {layer: (g, i) for g, group in groups if group.kind in kinds for i, layer in enumerate(group.layers)}

        stored, kept = slots(*ATTENTION_KINDS), slots(RECURRENT)
        # Each model layer's slot: (group, index in it) of the KV its attention reads (KVViews.slots), and of
        # its states (KVViews.state_slots); None where it has none.
        self.slots = tuple(None if source is None else stored[source] for source in self.spec.reads)
        self.state_slots = tuple(kept.get(layer) for layer in range(len(self.spec.reads)))
        for group, group_spec in zip(self.groups, self.spec.groups):
            if group.kind == RECURRENT:
                group.row_layout = RowLayout(group_spec.state_fields, dtype)
        self._storage: Tensor | None = None  # flat; every group's home views are carved out of it
        self._work: Tensor | None = None  # flat; a compacted batch's views are carved out of it
        self.layout = None  # the layout object the buffers are prepared for
        # The decode buffer's columns when every row runs to max_new_tokens: it starts narrower and is widened
        # (`widen`) as rows grow, up to this, so that its size follows the longest row, not the budget.
        self.decode_limit = 0
        self.metadata = None  # the metadata of the forward running now (bind)
        self.work_used_bytes = 0  # the largest compacted batch's views since the home views were made
        self.peak_used_bytes = 0  # the most `used_bytes` since `prepare`
        self._windows_before: dict[tuple[int, int], Tensor] = {}  # a decode step's (end_step)
        # The paged layout: the full-attention groups' blocks and the rows' tables (None in the others).
        self.paged: PagedStore | None = None
        self.columns = 0  # the paged layout: the columns a row may address now (its decode shape's width)

    def group_of(self, layer: int) -> tuple[CacheGroup, int]:
        """The group that holds the KV `layer` reads (its own, or the layer's whose KV it shares), and the
        index of that KV in the group."""
        group, index = self.slots[layer]
        return self.groups[group], index

    # --- every group's buffer of one kind, for a forward's metadata --------------------------------------
    def _views(self, views: list[Tensor | None]) -> KVViews | None:
        return None if not views or views[0] is None else KVViews(tuple(views), self.slots, self.state_slots)

    @property
    def prompt_views(self) -> KVViews | None:
        """Where prefill writes the prompts."""
        return self._views([g.prompt_kv for g in self.groups])

    @property
    def decode_views(self) -> KVViews | None:
        """Where decode writes, and what its attention reads."""
        return self._views([g.decode_kv for g in self.groups])

    # --- buffer management ---------------------------------------------------------------------
    def prepare(
        self,
        layout,
        prompts: int,
        rows: int,
        lengths: tuple[int, ...],
        decode_limit: int | None = None,
        table_rows: int | None = None,
        max_blocks: int | None = None,
    ) -> None:
        """Buffers of `layout` for `prompts` prompts and `rows` rows, of `lengths` positions each (every
        group's: [group layers, 2, rows of the buffer, kv_heads, positions, head_dim]). `decode_limit`: the decode
        buffer's columns at the budget, which `widen` may grow it to (None: its length now). `table_rows`:
        the paged layout's samples with block tables of their own (None: one a row; a streaming batch keeps
        one per sample, and one per prompt after them); `max_blocks`: the most blocks they may hold at once
        (a budget of KV tokens)."""
        self.decode_limit = lengths[-1] if decode_limit is None else max(decode_limit, lengths[-1])
        self._prepare_paged(layout, rows, lengths[-1], table_rows, max_blocks)
        buffer_rows = layout.buffer_rows(prompts, rows)
        self._set_home(
            self._home_views([[g.buffer_shape(r, t) for r, t in zip(buffer_rows, lengths)] for g in self.groups])
        )
        self.layout = layout
        self.peak_used_bytes = self.used_bytes

    def _prepare_paged(self, layout, rows: int, columns: int, samples: int | None, max_blocks: int | None) -> None:
        """The paged layout: every block free and a table for each of `rows` rows (a streaming batch: for each
        of `samples` samples, then each prompt's own), the pools kept while large enough; each full-attention
        group's buffer is its pool. Other layouts: no pools."""
        attention = [g for g in self.groups if g.kind in ATTENTION_KINDS]
        if not getattr(layout, "paged", False):
            self.paged = None
            for g in attention:
                g.pool = None
            return
        if self.paged is None:
            windows = [g.window for g in attention]  # (None but in a SLIDING_WINDOW group: GroupSpec checks)
            self.paged = PagedStore([g.shape for g in attention], self.dtype, self.device, layout.block_size, windows)
        self.columns = columns
        # A first guess of the blocks a call holds (the pools grow as rows do): each row's prompt and a stretch.
        expected = rows * (-(-columns // layout.block_size) // 2 + 2)
        tables = rows if samples is None else samples + samples // layout.samples
        self.paged.prepare(tables, self.decode_limit, expected, samples, max_blocks)
        for g in attention:
            g.pool = None  # (a new view of each pool for this call)
        self._refresh_pools()

    def _refresh_pools(self) -> None:
        """Each paged group's buffer is its pool (again, after the pools grew: new tensors), a view of it made
        anew for each call, as the other layouts' views are."""
        if self.paged is None:
            return
        for g, kv in zip((g for g in self.groups if g.kind in ATTENTION_KINDS), self.paged.kv):
            if g.pool is None or g.pool.data_ptr() != kv.pool.data_ptr() or g.pool.shape != kv.pool.shape:
                g.pool = kv.pool.view(kv.pool.shape)
            g.home = g.current = [g.pool]

    def reserve(self, rows: list[int], until: list[int], written: list[int] | None = None) -> list[int]:
        """The paged layout: home rows `rows` hold blocks for their columns [0, until[i]) (`PagedStore.reserve`;
        `written`: the columns they write next, where known). Returns the rows whose tables changed."""
        changed = self.paged.reserve(rows, until, written)
        self._refresh_pools()
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        return changed

    def write_prompts(self, prompts: list[int], kv: KVViews, prompt_len: int) -> None:
        """The paged layout, a streaming batch: prompts `prompts`' KV (rows of `kv`, the scratch cache's) into
        blocks of each one's own table (`PagedStore.prompt_table`), which its samples fork (`seat_samples`)."""
        tables = [self.paged.prompt_table(p) for p in prompts]
        self.reserve(tables, [prompt_len] * len(tables))
        table = self.paged.table.index_select(0, torch.tensor(tables, device=self.device))
        columns = torch.arange(prompt_len, device=self.device)[None, :].expand(len(tables), -1)
        slots = self.paged.slots(table, columns)
        for i, (g, src) in enumerate(zip(self.groups, kv.buffers)):
            if g.pool is not None:
                group_slots = self.paged.group_slots(i, slots)
                for layer in range(src.shape[0]):
                    written = src[layer][:, : len(tables), :, :prompt_len]
                    write_slots(g.pool, layer, written[0], written[1], group_slots)

    def seat_samples(self, prompt: int, samples: list[int], home: KVViews, rows: Tensor) -> None:
        """The paged layout, a streaming batch: samples `samples` of prompt `prompt` continue its table
        (`PagedStore.fork_to`), and their decode rows `rows` get the prompt's states at `home` in the other
        groups (as the copy layout seats them)."""
        self.paged.fork_to(prompt, samples)
        self._refresh_pools()
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        for g, src in zip(self.groups, home.buffers):
            if g.pool is None:
                dst = g.current[-1]
                for layer in range(src.shape[0]):
                    dst[layer][:, rows] = src[layer].expand(-1, rows.numel(), *src[layer].shape[2:])

    def release_prompt(self, prompt: int) -> None:
        """The paged layout, a streaming batch: prompt `prompt`'s own table gives its blocks back."""
        self.paged.release_prompt(prompt)

    def release_tables(self, tables: list[int]) -> None:
        """The paged layout: these tables' blocks given back (their rows' samples ended)."""
        for t in tables:
            self.paged.release_table(t)

    @property
    def decode_columns(self) -> int:
        """The columns a row of the decode buffer may address now."""
        return self.columns

    def _set_home(self, views: list[list[Tensor]]) -> None:
        for g, v in zip(self.groups, views):
            g.home = g.current = [g.pool] if g.pool is not None else v

    @property
    def compacted(self) -> bool:
        """Whether decode runs in a compacted batch's views (a paged group's KV never moves: its rows'
        tables do; the other groups tell)."""
        dense = [g for g in self.groups if g.pool is None]
        return bool(dense) and bool(dense[0].current) and dense[0].current[-1] is not dense[0].home[-1]

    def compact(self, rows: Tensor, prompts: Tensor | None, original: Tensor, written: int | None = None) -> None:
        """Decode goes on with the decode buffer's rows `rows` (int64, on the buffer's device) only (the
        prompt groups `prompts` kept: the layout's `kv_index` says what each buffer keeps; the pool's
        tables move with the decode state, not here); `original` [current rows]
        is each current row's row in the home views. In every group.

        Every row's KV is kept for `Rollout.extend`: the compacted batch decodes in a second allocation
        (the work views), so the rows that leave stay in the home views. The first compaction gathers
        from home into the work views; a later one first writes the current rows home (the ones leaving
        would be overwritten), then gathers in place into smaller work views carved from the start of the
        same allocation: views lie group after group, each group's buffers in the layout's order, and a
        smaller view's layer l ends where the current view's layer l + 1 begins or before, so gathering in
        that order (groups, buffers, layers) overwrites nothing before it is read. A compacted shape thus
        has the same addresses in every call (its CUDA graph replays). `written`: the decode buffer's columns
        any row has written (None: all), the only ones moved."""
        if self.compacted:
            self._write_home(original, written)
        views = self._gather(self._work_views, rows, prompts, written)
        for g, v in zip(self.groups, views):
            g.current = [g.pool] if g.pool is not None else v
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)

    def compact_in_place(self, rows: Tensor, prompts: Tensor | None = None, written: int | None = None) -> None:
        """Decode goes on with rows `rows` only (`prompts`: as in compact()), gathered
        in place into smaller views carved from the start of the same allocation (see compact()'s in-place
        case); what is left behind is not kept (a streaming batch's rows, copied out already)."""
        assert not self.compacted
        self._set_home(self._gather(self._home_views, rows, prompts, written))

    def _gather(self, carve, rows: Tensor, prompts: Tensor | None, written: int | None) -> list[list[Tensor]]:
        """Each group's current views' kept rows (the layout's index for each buffer), into views that
        `carve` makes; group after group, in the order the views lie in the allocation (compact())."""
        index = self.layout.kv_index(rows, prompts)
        views = carve([[g.buffer_shape(i.numel(), v.shape[4]) for i, v in zip(index, g.current)] for g in self.groups])
        for g, v in zip(self.groups, views):
            g.gather(index, v, written)
        return views

    def finish_decode(self, original: Tensor | None, written: int | None = None) -> None:
        """After decode: the rows of a compacted batch (`original`: each one's home row) back home, and the
        home views current again, so that every row's KV is where `Rollout.extend` looks for it."""
        if self.compacted:
            self._write_home(original, written)
        for g in self.groups:
            g.current = g.home

    def _write_home(self, original: Tensor, written: int | None = None) -> None:
        for g in self.groups:
            g.write_home(original, written)

    def grow(self, decode_tokens: int, decode_limit: int | None = None) -> None:
        """Rows may address `decode_tokens` columns (Rollout.extend: a longer history; no KV moves, the rows'
        tables may name more blocks), and `decode_limit` (None: as it was) the columns `widen` may grow
        them to. Not while compacted."""
        assert not self.compacted, "grow() runs on the home views"
        self.decode_limit = max(self.decode_limit, decode_tokens, decode_limit or 0)
        self.columns = max(self.columns, decode_tokens)
        self.paged.widen(self.decode_limit)

    def widen(self, decode_tokens: int) -> None:
        """Decode goes on with rows that may address `decode_tokens` columns (more than now, at most
        `decode_limit`): blocks are taken as rows write them, so nothing moves."""
        assert decode_tokens <= self.decode_limit, (decode_tokens, self.decode_limit)
        self.columns = decode_tokens

    def _home_views(self, shapes: list[list[tuple[int, ...]]]) -> list[list[Tensor]]:
        """Views of these shapes (one list per group), from the start of the home allocation."""
        self.work_used_bytes = 0  # new home views: no compacted batch yet
        flat = _flat(shapes)
        if self._storage is None or self._storage.numel() < sum(math.prod(s) for s in flat):
            # Free the old allocation before making the new one.
            self._storage = self._work = None
            self._set_home([[] for _ in self.groups])
        self._storage, views = _carve(self._storage, flat, self.dtype, self.device)
        return _per_group(views, len(self.groups))

    def _work_views(self, shapes: list[list[tuple[int, ...]]]) -> list[list[Tensor]]:
        flat = _flat(shapes)
        if self._work is None or self._work.numel() < sum(math.prod(s) for s in flat):
            # Made once for the largest compacted batch of these home views (every prompt, and
            # COMPACT_FRACTION of the rows), so that compacted shapes keep their addresses from call to
            # call; made only before a call's first compaction, which reads the home views only.
            largest = []
            for g in self.groups:
                decode = g.home[-1]
                largest += [tuple(v.shape) for v in g.home[:-1]]
                largest.append(g.buffer_shape(int(COMPACT_FRACTION * decode.shape[2]), decode.shape[4]))
            self._work = None
            self._work, _ = _carve(None, largest, self.dtype, self.device)
        views = _carve(self._work, flat, self.dtype, self.device)[1]
        self.work_used_bytes = max(self.work_used_bytes, sum(v.numel() * v.element_size() for v in views))
        return _per_group(views, len(self.groups))

    def release(self) -> None:
        """Free the buffers; the next `prepare()` allocates new ones."""
        self._storage = self._work = self.layout = None
        for g in self.groups:
            g.pool = None
        self._set_home([[] for _ in self.groups])
        self.metadata = None
        if self.paged is not None:
            self.paged.release()
        self.paged = None

    @property
    def allocated_bytes(self) -> int:
        """Bytes of every allocation the cache holds (home, work, the pools)."""
        storages = (self._storage, self._work)
        pools = 0 if self.paged is None else self.paged.allocated_bytes
        return sum(0 if s is None else s.numel() * s.element_size() for s in storages) + pools

    @property
    def used_bytes(self) -> int:
        """Bytes of KV storage the home views of every group and the largest compacted batch use (the
        allocations may be larger, from an earlier call)."""
        views = [v for g in self.groups if g.pool is None for v in g.home]
        blocks = 0 if self.paged is None else self.paged.used_bytes  # (the most blocks held at once)
        return sum(v.numel() * v.element_size() for v in views) + self.work_used_bytes + blocks

    def bind(self, forward) -> None:
        """The metadata of the forward about to run (what `update` hands each layer's K and V to)."""
        self.metadata = forward

    def expand_prompts(self, batch: int, repeats: int, num_tokens: int) -> None:
        """Copy layout: rows [0, batch) hold the prompts; make rows [0, batch*repeats) hold them, in
        repeat_interleave order, with one operator call per group over its every layer's K and V (the paged
        layout: the rows' tables, full blocks shared by reference)."""
        if self.paged is not None:
            self.paged.fork_prompts(batch, repeats)
            self._refresh_pools()
        for g in self.groups:
            if g.pool is None:
                g.expand_prompts(batch, repeats, num_tokens)

    @property
    def recurrent_groups(self) -> list[CacheGroup]:
        return [g for g in self.groups if g.kind == RECURRENT]

    @property
    def has_states(self) -> bool:
        return bool(self.recurrent_groups)

    # --- recurrent layers' states: models.recurrent.RecurrentStates, transformers' cache interface for them --
    # The bound forward says where the rows' states are (`state_views`) and whether it continues them
    # (decode: a state is read and updated in place) or starts them (prefill: none is read, the forward's
    # final ones are written to its rows). In decode, the rows that have ended (`ended`: fed filler after
    # their last token) keep their states as they were: a later turn (Rollout.extend) continues each row
    # from its own last token. A recurrent state's update is masked where it is written; a convolution
    # window, which the layers update in place, is kept as it was before the step and put back for ended
    # rows after the model's forward (`end_step`).
    def _state_rows(self, layer_idx: int) -> tuple[CacheGroup, Tensor]:
        """The group of `layer_idx`'s states, and its rows in the bound forward's buffer: [rows, width]."""
        views = self.metadata.state_views()
        group = self.groups[views.state_slots[layer_idx][0]]
        return group, group.rows(views, layer_idx)

    def _state(self, layer_idx: int, kind: str, state_idx: int) -> Tensor:
        group, rows = self._state_rows(layer_idx)
        state = group.row_layout.view(rows, kind, state_idx)
        if state is None:
            raise ValueError(f"torchkvops: layer {layer_idx} keeps no {kind} state {state_idx} (the probe found none)")
        return state

    def row_states(self, layer_idx: int) -> dict[tuple[str, int], Tensor]:
        """Every state of `layer_idx` in the bound forward's buffer: (kind, state_idx) -> [rows, ...] views."""
        group, rows = self._state_rows(layer_idx)
        return {key: group.row_layout.view(rows, *key) for key in group.row_layout.places}

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        if not self.metadata.continues:
            return None
        state = self._state(layer_idx, "conv", state_idx)
        self._windows_before[(layer_idx, state_idx)] = state.clone()
        return state

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self._state(layer_idx, "recurrent", state_idx) if self.metadata.continues else None

    def update_conv_state(self, conv_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        """A forward that starts its rows: each keeps the window's last columns of `conv_states` ([rows,
        channels, tokens]: the convolution's input), zeros before a shorter input, as transformers' cache
        does. Returns the input (nothing came before it)."""
        if self.metadata.continues:  # decode updates the window in place (causal_conv1d_update)
            raise AssertionError(f"torchkvops: layer {layer_idx}'s conv state is updated in place in decode")
        state = self._state(layer_idx, "conv", state_idx)[: conv_states.shape[0]]
        state.copy_(kept_window(conv_states, state.shape[-1]))
        return conv_states

    def update_recurrent_state(self, recurrent_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        state = self._state(layer_idx, "recurrent", state_idx)[: recurrent_states.shape[0]]
        if self.metadata.continues:  # decode: ended rows keep theirs
            ended = self.metadata.ended.view(-1, *([1] * (state.dim() - 1)))
            recurrent_states = torch.where(ended, state, recurrent_states.to(state.dtype))
        state.copy_(recurrent_states)
        return state

    def end_step(self) -> None:
        """After a decode step's forward: ended rows' convolution windows as they were before it."""
        if not self._windows_before:
            return
        ended = self.metadata.ended
        for (layer_idx, state_idx), before in self._windows_before.items():
            state = self._state(layer_idx, "conv", state_idx)
            state.copy_(torch.where(ended.view(-1, 1, 1), before, state))
        self._windows_before = {}

    # --- the transformers Cache interface ------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Hand a layer's K and V to the bound forward: it writes them where they go and returns what the
        model's attention reads. A layer that reads another layer's KV writes none: it gets that layer's."""
        if self.spec.reads[layer_idx] != layer_idx:
            return self.metadata.read(self, key_states, layer_idx)
        return self.metadata.write(self, key_states, value_states, layer_idx)

    def check_layout(self, key_states: Tensor, value_states: Tensor, layer_idx: int) -> None:
        """A layer's K and V fit its group's buffers (made once per forward before decode, which skips it)."""
        self.group_of(layer_idx)[0].check(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0):
        return 0 if self.metadata is None else self.metadata.seq_length()

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """Asked only when the model builds its own mask, which happens in an unpadded prefill (decode
        always passes its own 4-D mask): keys are then exactly the prompt's positions."""
        return int(query_length), 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        if self.paged is not None:
            return self.columns
        decode = (self.group_of(layer_idx)[0] if self.slots[layer_idx] is not None else self.groups[0]).decode_kv
        return -1 if decode is None else decode.shape[4]

    def __len__(self) -> int:
        return len(self.spec.reads)

    @property
    def is_compileable(self) -> bool:
        return True

    # Per-layer kinds that transformers' mask builders read: none sliding, none built here (the rollout hands
    # the model its own masks, a sliding window's included: ModelAdapter's masks).
    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_linear(self) -> list[bool]:
        return [slot is not None for slot in self.state_slots]

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self)
