"""Typed Python face of the torchkvops operators, plus their fake kernels and autograd formulas.

Importing this module loads the compiled library first: its schemas and kernels must exist before the
fake kernels and autograd formulas below register against them."""

import math

import torch
from torch import Tensor

try:
    from . import _C  # noqa: F401  (registers the schemas and the CPU / CUDA kernels)
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "torchkvops: the compiled library torchkvops._C is missing or broken "
        f"({e}); build it with: pip install --no-build-isolation -e ."
    ) from None

__all__ = [
    "repeat_kv_cache_",
    "repeat_kv_cache",
    "write_kv_",
    "write_kv_slots_",
    "merge_attention_states",
    "paged_attention",
    "sample_tokens",
    "sample_tokens_with_logprobs",
]


def repeat_kv_cache_(cache: Tensor, batch: int, repeats: int, num_tokens: int) -> None:
    """Expand the prompt KV of `batch` rows to `batch * repeats` rows, in place.

    `cache` holds rows at dim -4 and token positions at dim -2, with any leading dims: a whole buffer
    `[layers, 2, rows, kv_heads, max_tokens, head_dim]` or one layer's `[rows, kv_heads, max_tokens,
    head_dim]`. Before the call rows `[0, batch)` hold the prompts at positions `[0, num_tokens)`;
    afterwards row `r < batch * repeats` holds old row `r // repeats` there (repeat_interleave
    order). Nothing else changes, and no temporary copy of the cache is made.
    """
    torch.ops.torchkvops.repeat_kv_cache_.default(cache, batch, repeats, num_tokens)


def repeat_kv_cache(cache: Tensor, repeats: int) -> Tensor:
    """Return `cache.repeat_interleave(repeats, dim=-4)` as a new contiguous tensor (differentiable)."""
    return torch.ops.torchkvops.repeat_kv_cache.default(cache, repeats)


@torch.library.register_fake("torchkvops::repeat_kv_cache")
def _repeat_kv_cache_fake(cache: Tensor, repeats: int) -> Tensor:
    torch._check(cache.dim() >= 4, lambda: f"repeat_kv_cache: cache must have at least 4 dims, got {cache.dim()}")
    torch._check(repeats >= 1, lambda: f"repeat_kv_cache: repeats must be >= 1, got {repeats}")
    torch._check_value(
        cache.numel() * repeats * cache.element_size() < 2**63,
        lambda: (
            f"repeat_kv_cache: repeats={repeats} makes an output of {cache.shape[-4]} x {repeats} rows "
            f"of shape {tuple(cache.shape)}, more bytes than int64 can count"
        ),
    )
    shape = list(cache.shape)
    shape[-4] = shape[-4] * repeats
    return cache.new_empty(shape)


def _setup_context(ctx, inputs, output) -> None:
    _, ctx.repeats = inputs


def _backward(ctx, grad: Tensor):
    # Output row r came from input row r // repeats: sum each group of `repeats` rows.
    rows = grad.shape[-4] // ctx.repeats
    return grad.unflatten(-4, (rows, ctx.repeats)).sum(dim=-4), None


torch.library.register_autograd("torchkvops::repeat_kv_cache", _backward, setup_context=_setup_context)


def write_kv_(cache: Tensor, key: Tensor, value: Tensor, layer: int, start: Tensor) -> None:
    """Store one layer's keys and values in a whole KV buffer, in place.

    `cache` is `[layers, 2, rows, kv_heads, max_tokens, head_dim]`; `key` and `value` are
    `[r, kv_heads, q, head_dim]` with r <= rows; `start` is an int64 tensor on the cache's device, of 1
    element (where every row starts) or of r elements (where each row starts: rows of one batch at
    different columns). Afterwards `cache[layer, 0, i, :, start[i]:start[i]+q] == key[i]` for every
    i < r (index 1 for `value`). Pass the whole buffer: under torch.compile the write stays one in-place
    call on it. Every argument is checked before anything is written; on CUDA, `start` stays on the
    device and the kernel checks its range (an out-of-range start writes nothing of its row and raises a
    device-side assert, as torch's own indexing kernels do) instead of syncing with the host on every call.
    """
    torch.ops.torchkvops.write_kv_.default(cache, key, value, layer, start)


@torch.library.register_fake("torchkvops::write_kv_")
def _write_kv_fake(cache: Tensor, key: Tensor, value: Tensor, layer: int, start: Tensor) -> None:
    """The shape checks the kernels make (the range of `start` is a value, checked by the kernels)."""
    torch._check(
        cache.dim() == 6 and cache.shape[1] == 2,
        lambda: f"write_kv_: cache must be [layers, 2, rows, kv_heads, max_tokens, head_dim], got {tuple(cache.shape)}",
    )
    torch._check(
        key.dim() == 4 and key.shape == value.shape,
        lambda: "write_kv_: key and value must both be [rows, kv_heads, tokens, head_dim]",
    )
    torch._check(
        start.numel() == 1 or (start.dim() == 1 and start.shape[0] == key.shape[0]),
        lambda: (
            f"write_kv_: start must hold 1 element or one per row of key ({key.shape[0]}), got {tuple(start.shape)}"
        ),
    )
    torch._check(start.dtype == torch.long, lambda: f"write_kv_: start must be int64, got {start.dtype}")


def write_kv_slots_(cache: Tensor, key: Tensor, value: Tensor, layer: int, slots: Tensor) -> None:
    """Store one layer's keys and values in a pool of KV blocks, each token at its slot, in place (vLLM's
    `reshape_and_cache` with a slot mapping; the paged layout's writes).

    `cache` is `[layers, 2, blocks, kv_heads, block_size, head_dim]`; `key` and `value` are
    `[r, kv_heads, q, head_dim]`; `slots` is a contiguous int64 tensor on the cache's device, `[r, q]` (or
    `[r]` when q == 1). Token t of row i goes to slot `s = slots[i, t]`, block `s // block_size` at offset
    `s % block_size`: afterwards `cache[layer, 0, s // block_size, :, s % block_size] == key[i, :, t]` (index 1
    for `value`). Slots must be distinct (two tokens written to one slot leave either). Every argument is
    checked before anything is written; on CUDA the slots stay on the device and the kernel checks their
    range (an out-of-range slot writes nothing and raises a device-side assert) instead of syncing with the
    host, so a decode step that writes through it can be captured in a CUDA graph.
    """
    torch.ops.torchkvops.write_kv_slots_.default(cache, key, value, layer, slots)


@torch.library.register_fake("torchkvops::write_kv_slots_")
def _write_kv_slots_fake(cache: Tensor, key: Tensor, value: Tensor, layer: int, slots: Tensor) -> None:
    """The shape checks the kernels make (the slots' range is a value, checked by the kernels)."""
    torch._check(
        cache.dim() == 6 and cache.shape[1] == 2,
        lambda: (
            "write_kv_slots_: cache must be [layers, 2, blocks, kv_heads, block_size, head_dim], "
            f"got {tuple(cache.shape)}"
        ),
    )
    torch._check(
        key.dim() == 4 and key.shape == value.shape,
        lambda: "write_kv_slots_: key and value must both be [rows, kv_heads, tokens, head_dim]",
    )
    shaped = (slots.dim() == 2 and slots.shape[0] == key.shape[0] and slots.shape[1] == key.shape[2]) or (
        slots.dim() == 1 and key.shape[2] == 1 and slots.shape[0] == key.shape[0]
    )
    torch._check(
        shaped,
        lambda: (
            f"write_kv_slots_: slots must be [{key.shape[0]}, {key.shape[2]}] (one slot per token of key), "
            f"got {tuple(slots.shape)}"
        ),
    )
    torch._check(slots.dtype == torch.long, lambda: f"write_kv_slots_: slots must be int64, got {slots.dtype}")


# The dtypes the attention operators (merge_attention_states, paged_attention) take; the rollout asks it too.
ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def merge_attention_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial attentions over disjoint key sets A and B into the attention over A ∪ B.

    `out_a`, `out_b` are the partial outputs, `[..., heads, head_dim]` (any leading dims, same shape),
    float32, float16 or bfloat16 (they may differ); `lse_a`, `lse_b` are their log-sum-exps of the
    scores, `[..., heads]` (= `out_a.shape[:-1]`), float32, in NATURAL log (as `torch.logsumexp` and
    SDPA's `logsumexp` give; FlashInfer's merge_state takes base-2 lse, ours does not). Returns
    `(out, lse)`, both new contiguous tensors, out in out_a's dtype and lse float32 `[..., heads]`:

        out = (e^lse_a * out_a + e^lse_b * out_b) / (e^lse_a + e^lse_b),  lse = log(e^lse_a + e^lse_b)

    computed in float32 and stably (relative to m = max(lse_a, lse_b)). Per (row, head):

    - an lse of -inf marks an empty part: it contributes nothing and its output is never read (it may
      be NaN). If only lse_a is -inf the result is exactly out_b (cast to out_a's dtype) and lse_b,
      and the other way round. A part whose weight underflows to 0 is dropped in the same way.
    - both -inf: out = 0 and lse = -inf.
    - a NaN or +inf lse on either side: out = NaN and lse = NaN (as attention over scores holding a
      NaN or +inf would give).

    All four tensors must be on one device; any strides are accepted (e.g. `[B, L, H, D]` views of a
    `[B, H, L, D]` buffer), read in place when head_dim has stride 1 (an input with a strided head_dim,
    or with more than 6 strided leading dims, is copied to a contiguous temporary first). Not differentiable: there is no
    autograd formula, and a backward pass through it raises NotImplementedError (rather than leaving
    the inputs' gradients silently unset).
    """
    return torch.ops.torchkvops.merge_attention_states.default(out_a, lse_a, out_b, lse_b)


def _check_merge_args(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """The checks of merge_attention_states.h, with the same exception types and messages."""
    op = "merge_attention_states"
    for name, out in (("out_a", out_a), ("out_b", out_b)):
        torch._check_value(
            out.dim() >= 2,
            lambda: f"{op}: {name} must have at least 2 dims [..., heads, head_dim], got shape {list(out.shape)}",
        )
        torch._check_type(
            out.dtype in ATTENTION_DTYPES,
            lambda: f"{op}: {name} dtype {out.dtype} is not supported; use float32, float16 or bfloat16",
        )
    torch._check_value(
        out_b.dim() == out_a.dim(),
        lambda: f"{op}: out_b must have out_a's shape {list(out_a.shape)}, got {list(out_b.shape)}",
    )
    for sb, sa in zip(out_b.shape, out_a.shape):
        torch._check_value(
            sb == sa, lambda: f"{op}: out_b must have out_a's shape {list(out_a.shape)}, got {list(out_b.shape)}"
        )
    want = out_a.shape[:-1]
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        msg = lambda: f"{op}: {name} must have shape out_a.shape[:-1] = {list(want)}, got {list(lse.shape)}"  # noqa: E731
        torch._check_value(lse.dim() == len(want), msg)
        for sl, sw in zip(lse.shape, want):
            torch._check_value(sl == sw, msg)
        torch._check_type(
            lse.dtype == torch.float32,
            lambda: f"{op}: {name} must be float32 (natural-log log-sum-exp), got {lse.dtype}",
        )
    for name, t in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        torch._check_value(
            t.device == out_a.device,
            lambda: f"{op}: {name} must be on out_a's device {out_a.device}, got {t.device}",
        )


@torch.library.register_fake("torchkvops::merge_attention_states")
def _merge_attention_states_fake(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    _check_merge_args(out_a, lse_a, out_b, lse_b)
    # Like the kernels' at::empty: contiguous, out_a's dtype and device.
    out = out_a.new_empty(out_a.shape)
    lse = out_a.new_empty(out_a.shape[:-1], dtype=torch.float32)
    return out, lse


def _merge_attention_states_backward(ctx, grad_out: Tensor, grad_lse: Tensor):
    # Without an autograd kernel PyTorch only warns and leaves the inputs' gradients unset.
    raise NotImplementedError("merge_attention_states: not differentiable (it has no backward formula)")


torch.library.register_autograd("torchkvops::merge_attention_states", _merge_attention_states_backward)


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_positions: Tensor | None = None,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    seq_starts: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Decode attention over paged KV: one query per row against the keys that row has written, read
    through its block table, and nothing else. Returns `(out, lse)`: out `[rows, heads, head_dim]` in
    query's dtype, lse `[rows, heads]` float32 (natural log), both contiguous, so that the attention over
    several key sets (a prompt's shared blocks, a row's own) merges with `merge_attention_states`.

    - `query` `[rows, heads, head_dim]` (float32, float16 or bfloat16; head_dim <= 256, stride 1).
    - `key_cache`, `value_cache` `[num_blocks, kv_heads, block_size, head_dim]` in query's dtype: a pool of
      blocks (e.g. one layer's `pool[layer, 0]` and `pool[layer, 1]`, any block/head/slot strides). Query
      head h reads KV head h // (heads // kv_heads) (grouped-query attention, the heads folded).
    - `block_tables` int32 `[rows, max_blocks]`: row r's key t lies in block `block_tables[r, t //
      block_size]`, slot `t % block_size`; entries past a row's length are not read.
    - `seq_lens` int32 `[rows]`: row r reads keys `[0, seq_lens[r])` (at most max_blocks * block_size).
    - `seq_starts` int32 `[rows]` (None: zeros): row r reads keys `[seq_starts[r], seq_lens[r])` only, so
      that a row whose first columns hold no key of its own (a left-padded prompt's padding) never reads
      them; the blocks before a row's start are not read, so their table entries may be anything.
    - `query_positions` int64 `[rows, heads]` (any strides; None: `seq_lens - 1`): a query sees key t when
      `t <= position` and, with `window > 0`, `position - t < window` (transformers' sliding window).
    - `scale` (None: head_dim ** -0.5) multiplies q.k; `softcap > 0` caps the scores as
      `softcap * tanh(s / softcap)` (Gemma 2). Attention sinks are not an argument: merge them once, after
      every level, with `fused_attention.merge_sinks`.

    A row that sees no key gets out 0 and lse -inf. Lengths and tables are data: one CUDA graph serves
    every length, and the work follows the keys written, not the table's capacity. The CPU kernel raises
    for a length past the table's capacity or a block id outside the pool; the CUDA kernel cannot check
    data without a host sync and clamps them (garbage values, never memory outside the pool). Both run
    the same algorithm in the same order (csrc/paged_attention.h): flash-decoding over partitions of 256
    keys, merged by log-sum-exp. Not differentiable.
    """
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.torchkvops.paged_attention.default(
        query, key_cache, value_cache, block_tables, seq_lens, query_positions, scale, window, softcap, seq_starts
    )


@torch.library.register_fake("torchkvops::paged_attention")
def _paged_attention_fake(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_positions: Tensor | None,
    scale: float,
    window: int,
    softcap: float,
    seq_starts: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    # The shape and dtype checks of csrc/paged_attention.h, with its exception types and messages.
    op = "paged_attention"
    torch._check_value(
        query.dim() == 3, lambda: f"{op}: query must be 3-D [rows, heads, head_dim], got shape {list(query.shape)}"
    )
    torch._check_type(
        query.dtype in ATTENTION_DTYPES,
        lambda: f"{op}: query dtype {query.dtype} is not supported; use float32, float16 or bfloat16",
    )
    torch._check_value(1 <= query.shape[2] <= 256, lambda: f"{op}: head_dim must be in [1, 256], got {query.shape[2]}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        torch._check_value(
            cache.dim() == 4,
            lambda: (
                f"{op}: {name} must be 4-D [num_blocks, kv_heads, block_size, head_dim], got shape {list(cache.shape)}"
            ),
        )
        torch._check_type(
            cache.dtype == query.dtype, lambda: f"{op}: {name} must have query's dtype {query.dtype}, got {cache.dtype}"
        )
        torch._check_value(
            cache.shape[3] == query.shape[2],
            lambda: f"{op}: {name}'s head_dim must be query's {query.shape[2]}, got {cache.shape[3]}",
        )
    torch._check_value(
        key_cache.shape[1] >= 1 and query.shape[1] % key_cache.shape[1] == 0,
        lambda: (
            f"{op}: query's heads ({query.shape[1]}) must be a multiple of the caches' kv_heads ({key_cache.shape[1]})"
        ),
    )
    torch._check_type(
        block_tables.dtype == torch.int32, lambda: f"{op}: block_tables must be int32, got {block_tables.dtype}"
    )
    torch._check_type(seq_lens.dtype == torch.int32, lambda: f"{op}: seq_lens must be int32, got {seq_lens.dtype}")
    torch._check_value(
        block_tables.dim() == 2 and block_tables.shape[0] == query.shape[0],
        lambda: f"{op}: block_tables must be [rows, max_blocks] with rows = query's {query.shape[0]}",
    )
    torch._check_value(
        seq_lens.dim() == 1 and seq_lens.shape[0] == query.shape[0],
        lambda: f"{op}: seq_lens must be [rows] with rows = query's {query.shape[0]}",
    )
    if seq_starts is not None:
        torch._check_value(
            seq_starts.dim() == 1 and seq_starts.shape[0] == query.shape[0],
            lambda: f"{op}: seq_starts must be [rows] with rows = query's {query.shape[0]}",
        )
        torch._check_type(
            seq_starts.dtype == torch.int32, lambda: f"{op}: seq_starts must be int32, got {seq_starts.dtype}"
        )
    out = query.new_empty(query.shape)
    lse = query.new_empty(query.shape[:2], dtype=torch.float32)
    return out, lse


def _paged_attention_backward(ctx, grad_out: Tensor, grad_lse: Tensor):
    raise NotImplementedError("paged_attention: not differentiable (it has no backward formula)")


torch.library.register_autograd("torchkvops::paged_attention", _paged_attention_backward)


def sample_tokens(logits: Tensor, keys: Tensor, step: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """The next token of each row, by Gumbel-max sampling with counter-based noise: [rows] int64.

    `logits` is `[rows, vocab]` float32, float16 or bfloat16 with any strides (a row-strided view such
    as `hidden[:, -1, :]` is read in place); `keys` is `[rows]` int64 (one 32-bit key per row, see
    `sampling.row_keys`) and `step` an int64 tensor, 1 element (every row's step) or `[rows]` (each
    row's own, so that rows that started at other times draw their own steps' noise), both on logits'
    device. `temperature ==
    0` is greedy (`logits.argmax(-1)`; keys and step are not used); otherwise the result is
    `argmax(logits / temperature + noise)` over the tokens kept by `top_k` (0 or >= vocab: off; ties
    with the k-th largest value are kept) and then `top_p` (1: off; a token is dropped when the tokens
    with a larger value already hold top_p of the probability), with Gumbel noise hashed from (key,
    step, token): a 64-bit uniform per token, so the noise reaches 45.05 and a token is drawn at its
    probability down to about e^-45 of the best one's (see csrc/sample_tokens.h). Equals
    `torchkvops.reference.sample_tokens` except for near-ties of the perturbed scores (the kernels'
    log may differ from torch's in the last bit) and tokens whose place against the top-p cut is
    within the rounding of the reference's float32 sums (the kernels sum exactly). No host sync,
    nothing allocated but the output. Not differentiable: the output is an integer tensor.
    """
    return torch.ops.torchkvops.sample_tokens.default(logits, keys, step, temperature, top_k, top_p)


def sample_tokens_with_logprobs(
    logits: Tensor, keys: Tensor, step: Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[Tensor, Tensor]:
    """`sample_tokens`' tokens (the same ones) and each one's log-probability under the distribution it
    was drawn from: `([rows] int64, [rows] float32)`. For sampling, the log_softmax of `logits /
    temperature` over the tokens top-k / top-p keep (vLLM's processed logprobs, what TRL's importance
    sampling correction expects); greedy, of the raw logits. NaN where the kept logits hold a NaN or
    an infinite maximum (as `torch.log_softmax` gives). Computed in the sampling pass (one more pass
    over a row at most), no host sync. Equals `reference.processed_logprobs` up to float32 rounding
    where the tokens agree (see `sample_tokens`). Not differentiable.
    """
    return torch.ops.torchkvops.sample_tokens_with_logprobs.default(logits, keys, step, temperature, top_k, top_p)


def _check_sample_args(
    op: str, logits: Tensor, keys: Tensor, step: Tensor, temperature: float, top_k: int, top_p: float
) -> None:
    """The checks of sample_tokens.h that a fake tensor allows, with the same exception types and
    messages (floats as Python's repr writes them, as the kernels do)."""
    torch._check_value(
        logits.dim() == 2, lambda: f"{op}: logits must be 2-D [rows, vocab], got shape {list(logits.shape)}"
    )
    torch._check_value(
        keys.dim() == 1 and keys.shape[0] == logits.shape[0],
        lambda: f"{op}: keys must be 1-D with one key per row ({logits.shape[0]}), got shape {list(keys.shape)}",
    )
    torch._check_value(
        step.numel() == 1 or (step.dim() == 1 and step.shape[0] == logits.shape[0]),
        lambda: (
            f"{op}: step must be a 1-element int64 tensor or 1-D with one step per row ({logits.shape[0]}), "
            f"got shape {list(step.shape)}"
        ),
    )
    torch._check_value(
        math.isfinite(temperature) and temperature >= 0.0,
        lambda: f"{op}: temperature must be finite and >= 0 (0 = greedy), got {temperature!r}",
    )
    torch._check_value(top_k >= 0, lambda: f"{op}: top_k must be >= 0 (0 = off), got {top_k!r}")
    torch._check_value(0.0 < top_p <= 1.0, lambda: f"{op}: top_p must be in (0, 1] (1 = off), got {top_p!r}")


@torch.library.register_fake("torchkvops::sample_tokens")
def _sample_tokens_fake(
    logits: Tensor, keys: Tensor, step: Tensor, temperature: float, top_k: int, top_p: float
) -> Tensor:
    _check_sample_args("sample_tokens", logits, keys, step, temperature, top_k, top_p)
    return logits.new_empty((logits.shape[0],), dtype=torch.long)


@torch.library.register_fake("torchkvops::sample_tokens_with_logprobs")
def _sample_tokens_with_logprobs_fake(
    logits: Tensor, keys: Tensor, step: Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[Tensor, Tensor]:
    _check_sample_args("sample_tokens_with_logprobs", logits, keys, step, temperature, top_k, top_p)
    rows = logits.shape[0]
    return logits.new_empty((rows,), dtype=torch.long), logits.new_empty((rows,), dtype=torch.float32)
