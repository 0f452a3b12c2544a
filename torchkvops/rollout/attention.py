"""The rollout's decode attention, plugged into Hugging Face models through transformers'
`AttentionInterface` under the name "torchkvops".

While a rollout decodes, the model's `config._attn_implementation` is "torchkvops" (restored afterwards,
see `rollout_attention`), so every attention layer of any supported decoder-only model calls
`torchkvops_attention` with one query token per row. Two things make it read each layer's KV once a step:

- Grouped-query attention without `repeat_kv`: the query heads that share a KV head are folded into the
  query length ([rows, kv_heads, group, head_dim]), so the kernel sees as many heads as K and V have
  and never copies them.
- A prompt's N rows read its whole blocks once a step (`kv_sharing="prefix"`, or `"paged"` from
  `PagedLayout.stacked_tokens` tokens; `_stacked_prompts`): the blocks, which every row of the prompt names
  in its table, are read once by torch's own fused attention for the rows' queries stacked into one
  [prompts, kv_heads, N * group, head_dim] matrix (Hydragen's trick): as views of the pool where the
  prompts' blocks were laid out as runs a fixed stride apart (`PagedStore.place_prompts`), else gathered
  through the tables (a copy a layer and step); each row reads its own keys
  after them through its table, and the two partial attentions are merged with their log-sum-exps
  (`merge_attention_states`). Once the batch is compacted as rows end (`torchkvops.rollout.compaction`),
  the rows of a prompt are no longer N consecutive ones: the queries are gathered into N slots per prompt
  (`slot_rows`), and each row reads its slot's prompt part back.

Each row's own keys are read by `ops.paged_attention` through its block table in the pool: columns
[kv_start, column] of its row, so that the work follows what rows hold, not the buffer's width. The fused
attention (`torchkvops.fused_attention`: the CPU flash kernel on CPU, the memory-efficient kernel on CUDA,
plain matmul + softmax elsewhere) also returns the log-sum-exp, with additive biases kept by the decode
loop; it also reads a row's own keys in a dtype or head size the paged operator does not take (the row's
blocks gathered, masked by the row's bias [rows, 1, 1, keys], 0 or -inf, in the model's dtype).

What a layer passes beyond q, k, v is honoured: a sliding window (keys `window` or more positions before
the query's own are out of it; a windowed layer reads each row through its table, never stacked),
attention sinks (gpt-oss: each head's sink logit merged into its softmax by the keys' log-sum-exp), and
Gemma 2's capped scores (`fused_attention.attend`'s `softcap`, float32 matmuls: no fused kernel takes a cap).

A packed forward runs several rows' chunks as one sequence (no padding in the model's projections and
MLPs): a turn of `Rollout.extend` (`torchkvops.rollout.turns`), and the prompts after a prefix common to
all of them. Its attention (`PackedAttention`) lays each live row's queries out against that row's own KV
(through its table), with a mask of what each query may see, and packs the outputs back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import ops
from ..fused_attention import MASKED_KEY_BIAS, applied_softcap, merge_sinks
from ..fused_attention import attend as _attend
from ..models.families import REFUSED_ATTENTION_ARGUMENTS
from .cache_groups import KVViews, layer_kv, layer_slot
from .paged_kv import block_runs, dense_rows, gather_blocks, window_slots, window_table, write_slots

__all__ = [
    "NAME",
    "PrefillForward",
    "DecodeAttention",
    "PackedAttention",
    "packed_attention",
    "rollout_attention",
]

NAME = "torchkvops"


@dataclasses.dataclass
class PrefillForward:
    """A forward over prompts with the model's own attention: each layer's K and V go to columns [0, P) of
    the rows of `into` (every cache group's prompts' buffer, or its pool's blocks through their tables), and
    the attention reads exactly those (no padding to the buffer's length). One object per rollout, reused:
    a compiled prefill sees the same one."""

    into: KVViews | None = None  # per group [group layers, 2, rows, kv_heads, max_tokens, head_dim]
    start: Tensor | None = None  # [1] int64 zero, on the buffers' device

    def bind(self, into: KVViews) -> PrefillForward:
        self.into = into
        if self.start is None or self.start.device != into.device:
            self.start = torch.zeros(1, dtype=torch.long, device=into.device)
        return self

    def write(self, cache, key: Tensor, value: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        cache.check_layout(key, value, layer)
        buffer, index = layer_slot(self.into, layer)
        if cache.paged is not None:  # the paged layout: rows [0, k)'s columns [0, P) through their tables
            columns = torch.arange(key.shape[2], device=key.device)[None, :].expand(key.shape[0], -1)
            slots = cache.paged.slots(cache.paged.table[: key.shape[0]], columns)
            write_slots(buffer, index, key, value, cache.paged.group_slots(self.into.slots[layer][0], slots))
        else:
            ops.write_kv_(buffer, key, value, index, self.start)
        return key, value

    def read(self, cache, key: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """A layer that reads another layer's KV: that layer's, at this forward's rows and columns."""
        if cache.paged is not None:
            buffer, index = layer_slot(self.into, layer)
            table = cache.paged.group_table(self.into.slots[layer][0], cache.paged.table[: key.shape[0]])
            return dense_rows(buffer, index, table, key.shape[2])
        kv = layer_kv(self.into, layer)[:, : key.shape[0], :, : key.shape[2]]
        return kv[0], kv[1]

    def seq_length(self) -> int:
        return 0

    continues = False  # recurrent layers start their rows' states here

    def state_views(self) -> KVViews:
        return self.into


@dataclasses.dataclass
class DecodeAttention:
    """What the attention layers need during one rollout's decode, besides the K/V of this step: where each
    row writes it (`kv`, the current decode buffer, at the row's `columns`) and what every row reads."""

    kv: KVViews | None = None  # the decode buffers: per group [group layers, 2, rows, kv_heads, T, head_dim]
    columns: Tensor | None = None  # [rows] the column each row writes this step (the decode state's)
    cache_position: Tensor | None = None  # [1] HF's cache position of this step (the decode state's)
    positions: Tensor | None = None  # [rows, 1] the position of each row's token this step (the decode state's)
    ended: Tensor | None = None  # [rows] bool: rows fed filler (their recurrent states are kept as they are)
    # What each row reads of the pool, as paged_attention takes it: columns [kv_start, kv_length) through
    # its block table (the decode state's).
    kv_start: Tensor | None = None  # [rows] int32
    kv_length: Tensor | None = None  # [rows] int32
    kv_table: Tensor | None = None  # [rows, blocks] int32: the rows' block tables
    kv_slot: Tensor | None = None  # [rows] the pool slot each row writes this step
    # The paged layout's sliding-window groups (`paged_store`): which groups read through `window_map`
    # (table block -> window pool block), for their tables and slots.
    windowed: tuple[bool, ...] = ()
    window_map: Tensor | None = None
    kept_window: int = 0  # the keys before its query such a group keeps (the store's window)
    # Prompts read stacked (the decode state's; None otherwise): each prompt's whole blocks [prompts, blocks],
    # gathered and read, as prompt_bias [prompts, 1, 1, P'] shows them, for its rows' stacked queries (rows
    # [i*N, (i+1)*N) answer prompt i), and each row's own keys from own_start ([rows] int32) on.
    prompt_table: Tensor | None = None
    own_start: Tensor | None = None
    prompt_bias: Tensor | None = None
    # A prefix common to every prompt, before the prompts' own part: its whole blocks [1, blocks], read once
    # a step for every row's queries, as common_bias [1, 1, 1, C] shows them (every key).
    common_table: Tensor | None = None
    common_bias: Tensor | None = None
    # The prompts' and common prefix's whole blocks lie as `PagedStore.place_prompts` lays them out: read as
    # views of the pool (`block_runs`), not gathered through the tables above (the state's shape's).
    prompts_in_place: bool = False
    # A compacted batch (torchkvops.rollout.compaction): rows need not come N per prompt; the queries of
    # prompt i are the rows slot_rows[i*S : (i+1)*S] ([B * S]), and row r reads its prompt part from sample
    # row_sample[r] of prompt row_prompt[r] ([rows] each).
    slot_rows: Tensor | None = None
    row_prompt: Tensor | None = None
    row_sample: Tensor | None = None

    def load(self, state, cache) -> None:
        """Take every field from the decode state being decoded (`torchkvops.rollout.state.DecodeState`) and the KV
        cache's current views, in one place: the decoder calls this whenever it starts decoding a state or
        the views change, so the context never holds a mix of two states. The object itself stays the same
        (a compiled decode step reads it)."""
        self.kv, self.columns, self.cache_position = cache.decode_views, state.column, state.cache_position
        self.positions, self.ended = state.position_ids, state.finished
        self.kv_start, self.kv_length = state.kv_start, state.kv_length
        self.kv_table = state.kv_blocks
        self.kv_slot = state.kv_slot
        paged = getattr(cache, "paged", None)
        self.window_map = None if paged is None else paged.window_map
        self.windowed = () if self.window_map is None else tuple(paged.windowed)
        self.kept_window = 0 if self.window_map is None else paged.window
        self.prompt_table, self.own_start = state.prompt_table, state.own_start
        self.prompt_bias = state.prompt_bias
        self.common_table, self.common_bias = state.common_table, state.common_bias
        self.prompts_in_place = state.shape.prompts_in_place
        self.slot_rows, self.row_prompt, self.row_sample = state.slot_rows, state.row_prompt, state.row_sample

    def write(self, cache, key: Tensor, value: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """Each row's K and V at the pool slot its table names for its column; the layer's pool to the
        attention. No Python checks (prefill made them for this model): a step is what a CUDA graph replays."""
        buffer, index = layer_slot(self.kv, layer)
        slots = self.kv_slot
        if self._windowed(layer):
            slots = window_slots(self.window_map, slots, buffer.shape[4])
        write_slots(buffer, index, key, value, slots)
        return buffer[index, 0], buffer[index, 1]

    def _windowed(self, layer: int) -> bool:
        """Whether `layer` reads a sliding-window group's KV (the paged layout's window pool)."""
        return bool(self.windowed) and self.windowed[self.kv.slots[layer][0]]

    def table(self, layer: int) -> Tensor:
        """The tables through which `layer` reads each row's KV (kv_table, or its window pool blocks)."""
        return window_table(self.window_map, self.kv_table) if self._windowed(layer) else self.kv_table

    def read(self, cache, key: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """A layer that reads another layer's KV: that layer's whole decode buffer."""
        kv = layer_kv(self.kv, layer)
        return kv[0], kv[1]

    def seq_length(self):
        """What HF's cache would hold before this step's tokens, in every layout: the input's width + steps."""
        return self.cache_position[0]

    continues = True  # recurrent layers read each row's state and update it in place

    def state_views(self) -> KVViews:
        return self.kv


@dataclasses.dataclass
class PackedAttention:
    """What the attention layers need during a packed forward: several rows' chunks in one sequence, in row
    order (a turn's appended tokens, `Rollout.extend`; the prompts after a prefix common to all). Each
    layer's K and V were written to the rows' buffer at each token's row and column (RolloutKVCache.update)
    before the attention reads that buffer; a token attends to its row's columns that `allowed` shows
    (what the row held before, and its chunk up to itself)."""

    rows: Tensor  # [L] the live rows: their rows of the buffer, in order
    token_rows: Tensor  # [T] each packed token's row of the buffer
    token_columns: Tensor  # [T] the column of its row its K and V go to
    slots: Tensor  # [L, C] the packed index of each live row's j-th chunk token (past its chunk: its last)
    query_columns: Tensor  # [L, C] the column of its row each live row's j-th chunk token writes
    token_slot: Tensor  # [T] each packed token's place in the [L * C] slots (to pack the outputs back)
    keys: int  # the buffer's columns read: up to the longest live row's chunk end
    allowed: Tensor  # [L, 1, C, keys] bool: the row's columns each chunk token sees
    into: KVViews | None = None  # the rows' buffers: per group [group layers, 2, rows, kv_heads, columns, head_dim]
    lengths: Tensor | None = None  # [L] each live row's chunk length
    _buckets: list | None = None  # (length_buckets)
    # The live rows' block tables [L, blocks] and the packed tokens' pool slots [1, T] (from the cache's
    # tables, once per forward).
    _tables: Tensor | None = None
    _slots: Tensor | None = None
    _store: object | None = None  # (the paged store: sliding-window groups read through its window_map)

    def bind(self, into: KVViews) -> PackedAttention:
        self.into = into
        return self

    def write(self, cache, key: Tensor, value: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """The packed tokens' K and V ([1, kv_heads, T, head_dim]), each to its row and column; the layer's
        whole buffer to the attention (`attend`)."""
        cache.check_layout(key, value, layer)
        self._find_tables(cache)
        buffer, index = layer_slot(self.into, layer)
        write_slots(buffer, index, key, value, cache.paged.group_slots(self.into.slots[layer][0], self._slots))
        return buffer[index, 0], buffer[index, 1]

    def _find_tables(self, cache) -> None:
        """The live rows' tables and the packed tokens' slots in the pool, made once per forward."""
        if self._tables is None:
            table, blocks = cache.paged.table, -(-self.keys // cache.paged.block_size)
            self._tables = table.index_select(0, self.rows)[:, :blocks]
            token_tables = table.index_select(0, self.token_rows)
            self._slots = cache.paged.slots(token_tables, self.token_columns[:, None]).view(1, -1)
            self._store = cache.paged

    def read(self, cache, key: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """A layer that reads another layer's KV: that layer's whole buffer (`attend` reads its rows)."""
        self._find_tables(cache)
        kv = layer_kv(self.into, layer)
        return kv[0], kv[1]

    def seq_length(self) -> int:
        return 0

    @property
    def continues(self) -> bool:
        raise AssertionError(
            "torchkvops: a packed forward runs recurrent layers chunk by chunk (rollout.packed_states), never "
            "as one sequence"
        )

    def state_views(self) -> KVViews:
        return self.into

    def length_buckets(self) -> list[tuple[int, Tensor]]:
        """The live rows grouped by chunk length: (length, their indices among the live rows [n]), the
        lengths in increasing order (one host copy, made once)."""
        if self._buckets is None:
            lengths = self.lengths.tolist()
            device = self.lengths.device
            by_length: dict[int, list[int]] = {}
            for i, n in enumerate(lengths):
                by_length.setdefault(n, []).append(i)
            self._buckets = [(n, torch.tensor(m, device=device)) for n, m in sorted(by_length.items())]
        return self._buckets

    def attend(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        scaling,
        window=None,
        sinks=None,
        softcap=None,
    ) -> Tensor:
        """query [1, heads, T, head_dim] (the packed tokens); key, value: the layer's buffer [rows, kv_heads,
        columns, head_dim]; `window`: the layer's sliding window (a token sees its row's columns less than
        `window` before its own, and the levels' keys less than `window` positions before it); `sinks` [heads]:
        attention sinks, a logit per head with no value (a zero key and value whose score is the sink);
        `softcap`: Gemma 2's capped scores (float32 matmuls). Returns [1, T, heads, head_dim]."""
        live, chunk = self.slots.shape
        heads, head_dim = query.shape[1], query.shape[3]
        q = query[0].transpose(0, 1)[self.slots].permute(0, 2, 1, 3)  # [L, heads, C, head_dim]
        tables = self._store.group_table(self.into.slots[module.layer_idx][0], self._tables)  # the live rows'
        k, v = (gather_blocks(t, tables)[:, :, : self.keys] for t in (key, value))
        allowed = self.allowed
        if window is not None:
            own = self.query_columns[:, :, None] - torch.arange(self.keys, device=allowed.device) < window
            allowed = allowed & own[:, None]
        mask = allowed
        if sinks is not None or softcap is not None:  # an additive mask, for the sinks' scores or the cap's path
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # one more key: zero K and V, its score the head's sink through the bias
            k, v = (torch.cat([t, t.new_zeros(*t.shape[:2], 1, t.shape[3])], dim=2) for t in (k, v))
            sink = sinks.to(q.dtype)[None, :, None, None].expand(live, heads, chunk, 1)
            mask = torch.cat([mask.expand(live, heads, chunk, -1), sink], dim=-1)
        if softcap is not None:
            out, _ = _attend(q, k, v, mask, softcap=softcap, scale=scaling)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[1] != heads
            )  # [L, heads, C, head_dim]
        out = out.permute(0, 2, 1, 3).reshape(live * chunk, heads, head_dim)[self.token_slot]
        return out[None]


def packed_attention(packed, frontier: Tensor, seen: Tensor) -> PackedAttention:
    """The metadata of a packed forward (`PackedAttention`) over `packed` (`packing.Packed`: the rows'
    chunks, each starting at its row's `frontier` [rows] column), `seen` [rows, >= keys] bool: the columns
    each row holds before its chunk (its history). Chunk token j of a row sees what its row held before and
    its chunk up to j. Bind it to the rows' buffer (`bind`) before the forward."""
    live, lengths = packed.live, packed.lengths
    device = lengths.device
    rows = live.nonzero().flatten()
    lengths, frontier = lengths[rows], frontier[rows]
    chunk = int(lengths.max())  # host sync: the layout's width, once per forward
    keys = int((frontier + lengths).max())  # host sync: the columns read
    j = torch.arange(chunk, device=device)
    firsts = torch.cumsum(lengths, 0) - lengths  # each live row's first packed token
    slots = firsts[:, None] + torch.minimum(j[None, :], lengths[:, None] - 1)
    tokens = int(lengths.sum())
    token_row = torch.repeat_interleave(torch.arange(rows.numel(), device=device), lengths)
    token_slot = token_row * chunk + (torch.arange(tokens, device=device) - firsts[token_row])
    column = torch.arange(keys, device=device)
    in_chunk = (column[None, None, :] >= frontier[:, None, None]) & (
        column[None, None, :] <= frontier[:, None, None] + j[None, :, None]
    )
    allowed = seen[rows][:, None, :keys] | in_chunk  # [L, C, keys]
    query_columns = frontier[:, None] + j[None, :]
    return PackedAttention(
        rows, packed.row, packed.column, slots, query_columns, token_slot, keys, allowed[:, None], lengths=lengths
    )


_active: DecodeAttention | PackedAttention | None = None
_implementation: str | None = None  # the model's own attention implementation while `_active` is set
# One decode at a time per process: `_active` is one global (a thread-local would break torch.compile's
# full graph), and two models decoding in two threads would otherwise read each other's context.
_decode_lock = threading.RLock()


@contextlib.contextmanager
def rollout_attention(model: nn.Module, context: DecodeAttention | PackedAttention) -> Iterator[None]:
    """Route the model's attention through `torchkvops_attention` with `context` for the block.

    The switch is on the model's config, which every attention layer reads at each call, so it holds
    for eager, CUDA-graphed and compiled decode alike (a compiled graph guards on it). Callers hold the
    rollout's per-model lock: two rollouts never switch one model at once; rollouts of different
    models decode one after the other."""
    global _active, _implementation
    with _decode_lock:
        config = model.config
        # The setter also sets every sub-config; restore each to what it was.
        original = {"": config._attn_implementation}
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if sub is not None:
                original[key] = getattr(sub, "_attn_implementation", None)
        config._attn_implementation = NAME
        _active, _implementation = context, original[""]
        try:
            yield
        finally:
            _active = _implementation = None
            config._attn_implementation = original if len(original) > 1 else original[""]


def torchkvops_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """query [rows, heads, 1, head_dim]; key, value: this layer's decode buffer [rows, kv_heads, T,
    head_dim]; attention_mask: its bias [rows, 1, 1, T]. Returns ([rows, 1, heads, head_dim], None)."""
    context = _active
    if context is None:
        raise RuntimeError("torchkvops attention is only used inside a torchkvops rollout's decode")
    refused = [name for name in REFUSED_ATTENTION_ARGUMENTS if kwargs.get(name) is not None]
    if refused:
        raise ValueError(
            f"torchkvops: this model's attention uses {refused[0]!r} ({REFUSED_ATTENTION_ARGUMENTS[refused[0]]}), "
            "which the rollout's decode attention does not support"
        )
    # The arguments honoured (models.families.ATTENTION_ARGUMENTS):
    window = kwargs.get("sliding_window")  # (this layer's: None for full attention)
    sinks = kwargs.get("s_aux")  # [heads]: attention sinks (gpt-oss), a logit per head with no value
    # Gemma 2's attn_logit_softcapping: capped scores, no fused kernel (where the model's own attention caps)
    softcap = applied_softcap(kwargs.get("softcap"), _implementation)
    if isinstance(context, PackedAttention):
        return context.attend(module, query, key, value, scaling, window, sinks, softcap), None
    attend = _attend if softcap is None else functools.partial(_attend, softcap=softcap)  # (the layer's)
    rows, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    if q_len != 1 or group * kv_heads != heads:
        raise ValueError(
            f"torchkvops: decode attention expects one query token and heads divisible by "
            f"kv_heads, got query {tuple(query.shape)} and keys {tuple(key.shape)}"
        )
    _check_window(context, module.layer_idx, window)
    own = functools.partial(
        _own_keys, context, module.layer_idx, query, key, value, attention_mask, scaling, window, softcap, attend
    )
    if context.prompt_table is not None and not context._windowed(module.layer_idx) and _reads_paged(query, key):
        out, lse = _stacked_prompts(context, query, key, value, scaling, softcap, attend)
    else:
        out, lse = own(with_lse=sinks is not None)
    return _with_sinks(out, lse, sinks, kv_heads).reshape(rows, 1, heads, head_dim), None


def _stacked_prompts(
    context: DecodeAttention, query: Tensor, key: Tensor, value: Tensor, scaling, softcap, attend
) -> tuple[Tensor, Tensor]:
    """Prompts read stacked: each prompt's whole blocks read once, not once per row (in place, or gathered:
    `_shared_blocks`), by the fused attention (`attend`: the layer's, softcapped or not) for the stacked
    queries of its rows ([prompts, kv_heads, N * group, head_dim]), each row's own keys after them through
    its table, the two
    merged by their log-sum-exps (Hydragen's split); a prefix common to every prompt (`common_table`) is
    read apart, once for every row's queries, and merged the same way. query [rows, heads, 1, head_dim];
    key, value: the layer's pool [blocks, kv_heads, block_size, head_dim]. Returns out [rows, kv_heads,
    group, head_dim] and its lse [rows, kv_heads, group] (no window: a windowed layer reads its tables).

    Why the fused attention over the blocks as one run rather than `ops.paged_attention` over the prompt's blocks with
    the queries stacked as heads: that operator computes each query head's scores key by key, so stacking
    saves reads of the keys but no arithmetic, and on the CPU the step cost the same as each row reading
    its own table; the fused attention's matrix products make the stacked read pay (docs/benchmarks.md)."""
    rows, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    prompts = context.prompt_table.shape[0]  # (from a shape: a compiled step keeps it symbolic)
    q = query.reshape(rows, kv_heads, group, head_dim)
    # (The prompts' runs lie past the common prefix's, one block apart for a partly filled one: place_prompts.)
    after_common = 0 if context.common_table is None else context.common_table.shape[1]
    prompt_k, prompt_v = _shared_blocks(context, key, value, context.prompt_table, 1 + after_common, gap=1)
    out_p, lse_p = attend(_stacked_queries(context, q, prompts), prompt_k, prompt_v, context.prompt_bias, scale=scaling)
    cap = 0.0 if softcap is None else float(softcap)
    out_s, lse_s = ops.paged_attention(
        query[:, :, 0], key, value, context.kv_table, context.kv_length, None, scaling, 0, cap, context.own_start
    )
    out_s, lse_s = out_s.view(rows, kv_heads, group, head_dim), lse_s.view(rows, kv_heads, group)
    out, lse = _merge_prompt_part(context, out_p, lse_p, out_s, lse_s)
    if context.common_table is None:
        return out, lse
    # A prefix common to every prompt: its whole blocks read once, every row's queries stacked against them.
    every = q.transpose(0, 1).reshape(1, kv_heads, rows * group, head_dim)
    common_k, common_v = _shared_blocks(context, key, value, context.common_table, 1, gap=0)
    out_c, lse_c = attend(every, common_k, common_v, context.common_bias, scale=scaling)
    out_c = out_c.view(kv_heads, rows, group, head_dim).transpose(0, 1)
    lse_c = lse_c.view(kv_heads, rows, group).transpose(0, 1)
    return ops.merge_attention_states(out_c, lse_c, out, lse)


def _shared_blocks(
    context: DecodeAttention, key: Tensor, value: Tensor, table: Tensor, start, gap: int
) -> tuple[Tensor, Tensor]:
    """The keys and values of the blocks `table` names ([prompts, n]: the prompts' whole blocks, or [1, n]:
    the common prefix's) as [prompts, kv_heads, n * block_size, head_dim]: where they lie as
    `PagedStore.place_prompts` lays them out (row i's n blocks from block `start + i * (n + gap)`), views
    of the pool; else gathered by the table (a copy each step)."""
    if not context.prompts_in_place:
        return gather_blocks(key, table), gather_blocks(value, table)
    runs, n = table.shape  # (shapes only: a compiled step keeps them symbolic)
    return block_runs(key, start, runs, n, n + gap), block_runs(value, start, runs, n, n + gap)


def _by_prompt(context: DecodeAttention, per_row: Tensor, prompts) -> Tensor:
    """A per-row tensor [rows, ...] as [prompts, N, ...]: rows [i*N, (i+1)*N) answer prompt i, or, once the
    batch is compacted, prompt i's N query slots hold the rows slot_rows[i*N : (i+1)*N] (padding slots
    repeat a row)."""
    slotted = per_row.index_select(0, context.slot_rows) if context.slot_rows is not None else per_row
    return slotted.view(prompts, -1, *per_row.shape[1:])


def _stacked_queries(context: DecodeAttention, q: Tensor, prompts) -> Tensor:
    """The rows' queries q [rows, kv_heads, group, head_dim] stacked per prompt, a KV head's query heads
    of every sample as one query length: [prompts, kv_heads, N * group, head_dim]."""
    kv_heads, head_dim = q.shape[1], q.shape[3]
    return _by_prompt(context, q, prompts).transpose(1, 2).reshape(prompts, kv_heads, -1, head_dim)


def _merge_prompt_part(
    context: DecodeAttention, out_p: Tensor, lse_p: Tensor, out_s: Tensor, lse_s: Tensor
) -> tuple[Tensor, Tensor]:
    """Each row's attention over its prompt's shared keys (out_p [prompts, kv_heads, N * group, head_dim],
    lse_p [prompts, kv_heads, N * group]: the stacked queries') merged with its attention over its own keys
    (out_s [rows, kv_heads, group, head_dim], lse_s [rows, kv_heads, group]) by their log-sum-exps. Returns
    out [rows, kv_heads, group, head_dim] and lse [rows, kv_heads, group]."""
    rows, kv_heads, group, head_dim = out_s.shape
    prompts = out_p.shape[0]
    out_p = out_p.view(prompts, kv_heads, -1, group, head_dim).transpose(1, 2)  # [prompts, N, ...]: a view
    lse_p = lse_p.view(prompts, kv_heads, -1, group).transpose(1, 2)
    if context.slot_rows is not None:  # each row's prompt part from its slot (prompt, sample): one gather
        prompt, sample = context.row_prompt, context.row_sample
        return ops.merge_attention_states(out_p[prompt, sample], lse_p[prompt, sample], out_s, lse_s)
    out, lse = ops.merge_attention_states(out_p, lse_p, out_s.view(out_p.shape), lse_s.view(lse_p.shape))
    return out.view(rows, kv_heads, group, head_dim), lse.view(rows, kv_heads, group)


def _reads_paged(query: Tensor, key: Tensor) -> bool:
    """Whether paged_attention takes this layer's decode (its dtypes, head size and a contiguous head_dim,
    which a model's query almost always has): it reads only the keys each row has written. Otherwise the
    dense attention over the whole buffer, masked."""
    supported = query.dtype in ops.ATTENTION_DTYPES and key.dtype == query.dtype and query.shape[-1] <= 256
    return supported and query.stride(-1) == 1


def _own_keys(
    context: DecodeAttention,
    layer: int,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor,
    scaling,
    window,
    softcap,
    attend,
    with_lse: bool,
) -> tuple[Tensor, Tensor | None]:
    """Each row's attention over its own keys in the layer's pool (key, value [blocks, kv_heads, block_size,
    head_dim]) through its table: columns [kv_start, column] of its row (its prompt's and its own; with the
    prompts read stacked, from own_start: after its prompt's whole blocks), `window`: the row's keys
    `window` or more columns before its query's own are out of it (a row's columns are consecutive
    positions). Through paged_attention where it takes the layer (the work follows each row's length),
    else the row's blocks gathered, dense and masked. Returns out [rows, kv_heads, group, head_dim] and its
    lse [rows, kv_heads, group] (float32; None unless `with_lse` on the dense path)."""
    rows, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    table = context.table(layer)
    if _reads_paged(query, key):
        out, lse = ops.paged_attention(
            query[:, :, 0],
            key,
            value,
            table,
            context.kv_length,
            None,
            scaling,
            0 if window is None else int(window),
            0.0 if softcap is None else float(softcap),
            context.kv_start,
        )
        return out.view(rows, kv_heads, heads // kv_heads, head_dim), lse.view(rows, kv_heads, heads // kv_heads)
    key, value = gather_blocks(key, table), gather_blocks(value, table)  # each row's columns, dense
    if window is not None:
        near = context.columns[:, None] - torch.arange(key.shape[2], device=key.device)[None, :] < window
        attention_mask = attention_mask.masked_fill(~near[:, None, None, :], MASKED_KEY_BIAS)
    q = query.reshape(rows, kv_heads, heads // kv_heads, head_dim)
    return attend(q, key, value, attention_mask, scale=scaling, with_lse=with_lse)


def _check_window(context: DecodeAttention, layer: int, window) -> None:
    """A layer whose KV the paged layout keeps for a sliding window only must read no further back than
    that window (the cache groups' windows come from the config's layer_types: a model whose attention
    windows otherwise would read keys whose blocks were given back)."""
    if context._windowed(layer):
        kept = context.kept_window
        if window is None or int(window) > kept:
            raise AssertionError(
                f"torchkvops: layer {layer} reads keys back to a window of {window}, but its cache group keeps "
                f"{kept} (the config's sliding_window for its layer type): a model whose attention windows "
                "differently from its config"
            )


def _with_sinks(out: Tensor, lse: Tensor | None, sinks: Tensor | None, kv_heads: int) -> Tensor:
    """out [rows, kv_heads, group, D] with the attention sinks [heads] merged in by its log-sum-exp lse
    [rows, kv_heads, group] (`merge_sinks`; heads in [kv_heads, group] order, as the queries are folded);
    None: none."""
    return out if sinks is None else merge_sinks(out, lse, sinks.view(kv_heads, -1))[0]


AttentionInterface.register(NAME, torchkvops_attention)
# Decode always passes its own 4-D mask (mask creation then returns it as it is); a mask function is
# registered anyway so that transformers' mask builders know the name.
AttentionMaskInterface.register(NAME, sdpa_mask)
