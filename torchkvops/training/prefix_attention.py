"""Exact causal attention over a shared-prefix layout, forward and backward, without a dense mask.

The training side of shared prefill (`torchkvops.patch_forward`): a group of n rows that share their
first p tokens is laid out as the prefix once, then the n suffixes of S tokens each. Causal attention
over the n original rows then splits into three parts, each one call of torch's fused attention:

  prefix   the p prefix queries attend causally to the p prefix keys                (once per group)
  cross    the n*S suffix queries attend to the p prefix keys (no mask but padding), stacked into one
           [kv_heads, n * q_per_kv * S] query matrix per group, so the prefix K/V is read once
           (Hydragen's trick, as the decode attention does; grouped-query heads folded, no repeat_kv)
  suffix   each row's S suffix queries attend causally to its own S suffix keys

and the cross and suffix parts of a suffix query are merged with their log-sum-exps
(`merge_attention_states`). A prefix common to every group (a system prompt: `PackedLayout.common`) is a
level above: its queries attend causally to it once, and every group's prefix and suffix queries attend
to it as one more folded part (`context_attention`: own keys causally, then each context wholly). The cost is p*p/2 + n*S*(p + S/2) scores per group instead of the plain
forward's n*(p+S)^2/2, and nothing of size (p + n*S)^2 is ever built.

Backward is exact too, the way ring and cascade attention do it: the gradient of a softmax over the
union of two key blocks, restricted to one block, is that block's fused attention backward given the
MERGED output and the MERGED log-sum-exp (the backward needs the output only through
rowsum(dO * O) and the probabilities only through exp(s - lse), both global quantities). So each part's
backward is torch's own fused kernel, and no gradient flows through the merge or a log-sum-exp.

Masking: keys whose attention-mask bit is 0 get the additive bias `fused_attention.MASKED_KEY_BIAS`
(-65504), not -inf or the dtype's minimum. A real query then gives them exactly zero weight (exp
underflows to 0) as the plain forward does. A query whose every key is padding (a left-padded row's
first columns: "blind") gets a finite kernel output and log-sum-exp on every kernel, forward and
backward, instead of NaN (the CUDA kernels' float32 scores overflow to -inf at the dtype's minimum:
see fused_attention), which `packed_attention` then sets to 0: what torch's SDPA
(safe softmax) and flash-attention (unpadded) give such a row in the plain forward, so the outputs at
padding positions are the plain forward's too (the logit at a row's last padding column predicts its
first real token, and a padding collator's labels include it). Plain eager attention gives them a
uniform average over the whole row instead (every key's score is the dtype's minimum), which a shared
prefix cannot reproduce for every row of a group that shares the padding: `torchkvops.patch_forward`
runs such calls plain when labels read one, and otherwise gives them that average for the row the
packed token comes from, as a constant (`blind_average`): never exactly 0, which a layer may not
differentiate (Gemma 3n's AltUp takes sqrt(mean(x**2)): 0 x inf in backward at a zero padding row).

Kernels: `torchkvops.fused_attention` (on CPU the flash kernel and its backward, grouped-query heads
natively; on CUDA the memory-efficient kernel and its backward, K/V heads repeated for the two causal
parts, whose queries cannot be folded). Other devices are not served: the caller falls back to the
plain forward.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .. import ops
from ..fused_attention import MASKED_KEY_BIAS, attend, attend_backward, merge_sinks

__all__ = [
    "Bucket",
    "PackedLayout",
    "packed_attention",
    "shared_prefix_attention",
    "causal_attention",
    "context_attention",
    "SERVED_DEVICES",
]

SERVED_DEVICES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Bucket:
    """`groups` groups of `rows` rows each that share `prefix` columns and have `suffix` columns of
    their own, laid out from token `offset` of the packed sequence: groups*prefix prefix tokens (group
    by group), then groups*rows*suffix suffix tokens (group by group, row by row)."""

    offset: int
    groups: int
    rows: int
    prefix: int
    suffix: int

    @property
    def tokens(self) -> int:
        return self.groups * (self.prefix + self.rows * self.suffix)


@dataclasses.dataclass
class PackedLayout:
    """Where each token of the packed sequence comes from, and how attention must treat it.

    `src[t]` is the flat index (row * length + column) in the [rows, length] batch of packed token t;
    `dest[i]` is the packed token that computes flat position i of the batch (a shared prefix token
    serves every row of its group). `token_mask[t]` is the attention-mask bit of packed token t.
    `common` > 0: the packed sequence starts with that many tokens common to every row (a system prompt,
    wherever left padding puts it in each row), which every bucket's tokens attend to before their own;
    a bucket's `prefix` is then what its groups share after it."""

    buckets: tuple[Bucket, ...]
    src: Tensor  # [T] int64
    dest: Tensor  # [rows * length] int64
    token_mask: Tensor  # [T] bool
    rows: int
    length: int
    blind_queries: Tensor | None = None  # [T] bool: queries whose every key is padding (None: no such query)
    common: int = 0
    # [T] int64: each token's column counted from its row's first column that the layout aligns rows on
    # (the first real one when there is a common prefix, else column 0): distances for sliding windows.
    offsets: Tensor | None = None
    _biases: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def tokens(self) -> int:
        return int(self.src.numel())

    def common_bias(self, dtype: torch.dtype) -> Tensor:
        """The common tokens' additive key bias [1, 1, 1, common] in `dtype`, built once per dtype."""
        key = ("common", dtype)
        if key not in self._biases:
            self._biases[key] = _key_bias(self.token_mask[: self.common], dtype).view(1, 1, 1, -1)
        return self._biases[key]

    def window_bias(
        self,
        key: tuple,
        queries: tuple[int, int],
        keys: tuple[int, int],
        shape: tuple,
        per_kv: int | None,
        window: int,
        dtype: torch.dtype,
    ) -> Tensor:
        """The additive bias of one part of a layer's attention under a sliding window, built once per
        (part, window, dtype): the packed tokens [queries[0], queries[1]) as [Xq, M] query rows against
        the keys [keys[0], keys[1]) as [Xk, L] (`shape` = (Xq, M, Xk, L)); a key is seen when it is real
        and less than `window` columns before the query (transformers' sliding window: q - k < window;
        the kernel's causal flag, or the keys preceding the queries, bounds it from above). `per_kv`
        None: each query row against its own keys (Xq == Xk), bias [X, 1, M, L]; else a context part, the
        query rows folded per key row as `_fold` folds them (`per_kv` query heads per KV head), bias
        [Xk, 1, Xq/Xk * per_kv * M, L]."""
        key = (*key, window, dtype)
        if key not in self._biases:
            xq, m, xk, length = shape
            q_off = self.offsets[queries[0] : queries[1]].view(xq, m)
            k_off = self.offsets[keys[0] : keys[1]].view(xk, length)
            real = self.token_mask[keys[0] : keys[1]].view(xk, length)
            if per_kv is not None:
                q_off = q_off.view(xk, xq // xk, 1, m).expand(-1, -1, per_kv, -1).reshape(xk, -1)
            allowed = real[:, None, :] & (q_off[:, :, None] - k_off[:, None, :] < window)
            self._biases[key] = _key_bias(allowed, dtype)[:, None]
        return self._biases[key]

    def blind_average(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(weights [R, T] in `dtype`, which [T] int64), built once per dtype: weights @ values averages the
        values of every column of each of the R rows that blind queries come from, and `which[t]` is
        blind query t's row among them (0 for the others). What plain eager attention gives a query whose
        every key is masked (module docstring), for the row its packed token comes from."""
        key = ("blind", dtype)
        if key not in self._biases:
            source = self.src // self.length
            rows, which = torch.unique(source[self.blind_queries], return_inverse=True)
            weights = torch.zeros(rows.numel(), self.src.numel(), dtype=dtype, device=self.src.device)
            columns = self.dest.view(self.rows, self.length)[rows]  # [R, length]: the packed tokens of each row
            weights[torch.arange(rows.numel(), device=rows.device)[:, None], columns] = 1.0 / self.length
            index = torch.zeros_like(source).masked_scatter(self.blind_queries, which)
            self._biases[key] = (weights, index)
        return self._biases[key]

    def biases(self, index: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Bucket `index`'s additive key biases in `dtype`, built once per dtype (every layer reuses them):
        prefix keys [groups, 1, 1, prefix] and suffix keys [groups*rows, 1, 1, suffix]."""
        key = (index, dtype)
        if key not in self._biases:
            b = self.buckets[index]
            start, mid = b.offset, b.offset + b.groups * b.prefix
            self._biases[key] = (
                _key_bias(self.token_mask[start:mid], dtype).view(b.groups, 1, 1, -1),
                _key_bias(self.token_mask[mid : start + b.tokens], dtype).view(b.groups * b.rows, 1, 1, -1),
            )
        return self._biases[key]


def _key_bias(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where `allowed`, MASKED_KEY_BIAS elsewhere (see the module docstring), in `dtype`, of its shape."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, MASKED_KEY_BIAS)


# --- the three parts of a bucket ---------------------------------------------------------------
def _fold(t: Tensor, groups: int, kv_heads: int) -> Tensor:
    """Suffix rows [groups*n, H, S, ...] -> [groups, kv_heads, n * (H // kv_heads) * S, ...]: every query
    that reads one prefix KV head, as one query matrix (a copy)."""
    rows, heads, s = t.shape[:3]
    n, per_kv = rows // groups, heads // kv_heads
    t = t.reshape(groups, n, kv_heads, per_kv, s, *t.shape[3:]).transpose(1, 2)
    return t.reshape(groups, kv_heads, n * per_kv * s, *t.shape[5:])


def _unfold(t: Tensor, groups: int, rows: int, heads: int) -> Tensor:
    """The inverse of `_fold`, as a view: [groups, kv_heads, n * per_kv * S, ...] -> [groups, n, kv_heads,
    per_kv, S, ...] (merge_attention_states reads such strided views in place)."""
    kv_heads = t.shape[1]
    n, per_kv = rows // groups, heads // kv_heads
    s = t.shape[2] // (n * per_kv)
    return t.view(groups, kv_heads, n, per_kv, s, *t.shape[3:]).transpose(1, 2)


class _CausalAttention(torch.autograd.Function):
    """Causal attention of q [X, H, M, D] over its own keys [X, Hkv, M, D] with a key bias [X, 1, 1, M]."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, sinks):
        if q.shape[2] == 0:  # no query: nothing to compute (the kernels want one)
            out, lse = q.new_zeros(q.shape), q.new_zeros(q.shape[:3], dtype=torch.float32)
        else:
            out, lse = _with_sinks(*attend(q, k, v, bias, causal=True, scale=scale), sinks)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, bias, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, bias, out, lse, sinks = ctx.saved_tensors
        if q.shape[2] == 0:
            dsinks = None if sinks is None else torch.zeros_like(sinks)
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, dsinks
        grad = grad.contiguous()
        dq, dk, dv = attend_backward(grad, q, k, v, bias, causal=True, scale=ctx.scale, out=out, lse=lse)
        return dq, dk, dv, None, None, _sinks_grad(grad, out, lse, sinks)


class _ContextAttention(torch.autograd.Function):
    """Rows [B, H, S, D] that attend causally to their own keys and wholly to the keys of every context
    before them: a context of G groups serves rows [i*B/G, (i+1)*B/G) with its group i's keys
    [G, Hkv, L, D] (key bias [G, 1, 1, L]), read once for all of them (the queries folded). Each part is
    one fused attention call; the parts are merged by their log-sum-exps, and each part's backward is its
    kernel's own given the merged output and log-sum-exp (see the module docstring)."""

    @staticmethod
    def forward(ctx, scale, groups, q, k, v, bias, sinks, *contexts):
        rows, heads, s = q.shape[:3]
        ctx.scale, ctx.groups = scale, groups
        if s == 0:  # no query: nothing to compute (the kernels want one)
            ctx.save_for_backward(q, k, v, sinks, *contexts)
            return q.new_zeros(q.shape)
        out, lse = attend(q, k, v, bias, causal=True, scale=scale)
        for g, (k_x, v_x, bias_x) in zip(groups, _triples(contexts)):
            kv_heads = k_x.shape[1]
            out_x, lse_x = attend(_fold(q, g, kv_heads), k_x, v_x, bias_x, scale=scale)
            split = (g, rows // g, kv_heads, heads // kv_heads, s)
            out, lse = ops.merge_attention_states(
                _unfold(out_x, g, rows, heads), _unfold(lse_x, g, rows, heads), out.view(*split, -1), lse.reshape(split)
            )
            out, lse = out.view(q.shape), lse.view(q.shape[:3])
        out, lse = _with_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, bias, out, lse, sinks, *contexts)
        return out

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[2] == 0:
            q, k, v, sinks, *contexts = ctx.saved_tensors
            zeros = [None if i % 3 == 2 else torch.zeros_like(t) for i, t in enumerate(contexts)]
            dsinks = None if sinks is None else torch.zeros_like(sinks)
            return None, None, torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, dsinks, *zeros
        q, k, v, bias, out, lse, sinks, *contexts = ctx.saved_tensors
        scale, grad = ctx.scale, grad.contiguous()
        rows, heads = q.shape[:2]
        dq, dk, dv = attend_backward(grad, q, k, v, bias, causal=True, scale=scale, out=out, lse=lse)
        context_grads = []
        for g, (k_x, v_x, bias_x) in zip(ctx.groups, _triples(contexts)):
            kv_heads = k_x.shape[1]
            dq_x, dk_x, dv_x = attend_backward(
                _fold(grad, g, kv_heads),
                _fold(q, g, kv_heads),
                k_x,
                v_x,
                bias_x,
                causal=False,
                scale=scale,
                out=_fold(out, g, kv_heads),
                lse=_fold(lse, g, kv_heads),
            )
            dq = dq + _unfold(dq_x, g, rows, heads).reshape(q.shape)
            context_grads += [dk_x, dv_x, None]
        return None, None, dq, dk, dv, None, _sinks_grad(grad, out, lse, sinks), *context_grads


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """(out [X, H, M, D], lse [X, H, M]) with the attention sinks [H] merged in (`merge_sinks`); None: none."""
    return (out, lse) if sinks is None else merge_sinks(out, lse, sinks[None, :, None])


def _sinks_grad(grad: Tensor, out: Tensor, lse: Tensor, sinks: Tensor | None) -> Tensor | None:
    """d loss / d sinks: the sink's weight p = exp(sink - lse) takes -p * O from the output (O the whole
    output, the sink's value 0), so each head's gradient is -sum over queries of p * rowsum(dO * O)."""
    if sinks is None:
        return None
    weight = torch.exp(sinks.float()[None, :, None] - lse)
    return -(weight * (grad.float() * out.float()).sum(-1)).sum(dim=(0, 2)).to(sinks.dtype)


def _capped_parts(q, k, v, bias, contexts, scale, sinks, softcap) -> Tensor:
    """`context_attention` (and with no context `causal_attention`) with capped scores: each part by
    `attend` with its `softcap` and the parts merged by their log-sum-exps, all in autograd's own ops (no fused
    kernel, no hand-written backward: the cap changes the scores' gradient). Gemma 2's layers only."""
    rows, heads, s, dim = q.shape
    if s == 0:
        return q.new_zeros(q.shape) + 0 * q.sum()
    out, lse = attend(q, k, v, bias, softcap=softcap, causal=True, scale=scale)
    outs, lses = [out.float()], [lse]
    for k_x, v_x, bias_x in contexts:
        g, kv_heads = k_x.shape[0], k_x.shape[1]
        out_x, lse_x = attend(_fold(q, g, kv_heads), k_x, v_x, bias_x, softcap=softcap, scale=scale)
        outs.append(_unfold(out_x, g, rows, heads).reshape(rows, heads, s, dim).float())
        lses.append(_unfold(lse_x, g, rows, heads).reshape(rows, heads, s))
    if sinks is not None:  # a part with no value
        lses.append(sinks.float()[None, :, None].expand(rows, heads, s))
    total = torch.logsumexp(torch.stack(lses), dim=0)
    merged = sum(torch.exp(l - total)[..., None] * o for o, l in zip(outs, lses))
    return merged.to(q.dtype)


def _triples(flat: tuple) -> list[tuple]:
    return [tuple(flat[i : i + 3]) for i in range(0, len(flat), 3)]


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    scale: float | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Causal attention of q [X, H, M, D] over k, v [X, Hkv, M, D] with a key bias [X, 1, 1, M]
    (0 or MASKED_KEY_BIAS, q's dtype), and `sinks` [H] (a logit per head with no value), differentiable.
    M may be 0. `softcap`: scores capped (Gemma 2), computed by `_capped_parts` instead."""
    if softcap is not None:
        return _capped_parts(q, k, v, bias, [], scale, sinks, softcap)
    return _CausalAttention.apply(q, k, v, bias, scale, sinks)


def context_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    contexts: list[tuple[Tensor, Tensor, Tensor]],
    scale: float | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention of rows that continue shared contexts, differentiable: q [B, H, S, D] attends causally
    to its own k, v [B, Hkv, S, D] (bias [B, 1, 1, S]) and wholly to each context's (k, v, bias)
    ([G, Hkv, L, D], [G, 1, 1, L]; G divides B, and context group i is that of rows [i*B/G, (i+1)*B/G)).
    Contexts with no key are skipped; `sinks` [H]: a logit per head with no value; `softcap`: scores
    capped (Gemma 2), computed by `_capped_parts`. S may be 0."""
    contexts = [c for c in contexts if c[0].shape[2]]
    if softcap is not None:
        return _capped_parts(q, k, v, bias, contexts, scale, sinks, softcap)
    groups = tuple(c[0].shape[0] for c in contexts)
    return _ContextAttention.apply(scale, groups, q, k, v, bias, sinks, *(t for c in contexts for t in c))


def shared_prefix_attention(
    q_pre: Tensor,
    k_pre: Tensor,
    v_pre: Tensor,
    q_suf: Tensor,
    k_suf: Tensor,
    v_suf: Tensor,
    bias_pre: Tensor,
    bias_suf: Tensor,
    scale: float | None = None,
):
    """Causal attention of G groups of n rows that share a prefix, differentiable.

    q_pre [G, H, p, D], k_pre/v_pre [G, Hkv, p, D]: each group's prefix; q_suf [G*n, H, S, D],
    k_suf/v_suf [G*n, Hkv, S, D]: its rows' suffixes (group by group); bias_pre [G, 1, 1, p] and
    bias_suf [G*n, 1, 1, S]: additive key biases (0 or MASKED_KEY_BIAS) in q's dtype.
    Returns (out_pre [G, H, p, D], out_suf [G*n, H, S, D]): what causal attention over each row
    [prefix, suffix] gives at those positions. S may be 0 (rows identical to the end)."""
    out_pre = causal_attention(q_pre, k_pre, v_pre, bias_pre, scale)
    return out_pre, context_attention(q_suf, k_suf, v_suf, bias_suf, [(k_pre, v_pre, bias_pre)], scale)


def packed_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layout: PackedLayout,
    scale: float | None,
    window: int | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
    blind_average: bool = False,
) -> Tensor:
    """A transformers attention layer's call over a packed sequence: query [1, H, T, D], key/value
    [1, Hkv, T, D] in `layout`'s token order -> [1, T, H, D] (what attention functions return). `window`:
    the layer's sliding window (a key is seen only within `window` columns of its query), None: none;
    `sinks` [H]: the layer's attention sinks (a logit per head in every softmax, with no value); `softcap`:
    its scores capped (Gemma 2). A query whose every key is padding gets 0, what SDPA gives it, or with
    `blind_average` what eager attention without sinks gives it: the mean of its row's values, every
    column's (detached; for the row its packed token comes from, when a group's rows share it)."""
    q, k, v = query[0], key[0], value[0]  # [H, T, D]
    heads, dim = q.shape[0], q.shape[-1]
    per_kv = heads // k.shape[0]
    windowed = window is not None and window < layout.length
    dtype = q.dtype

    def bias(part: tuple, queries: tuple[int, int], keys: tuple[int, int], shape: tuple, plain: Tensor) -> Tensor:
        """`plain` (the keys' mask alone), or under a window the part's query-dependent bias (a part whose
        queries and keys are the same tokens is causal over its own keys; any other is a context)."""
        if not windowed:
            return plain
        folds = None if queries == keys else per_kv
        return layout.window_bias(part, queries, keys, shape, folds, window, dtype)

    pieces, c = [], layout.common
    if c:
        q_c, k_c, v_c = (t[None, :, :c] for t in (q, k, v))  # [1, h, common, D]
        plain_c = layout.common_bias(dtype)
        own_c = bias(("common",), (0, c), (0, c), (1, c, 1, c), plain_c)
        pieces.append(causal_attention(q_c, k_c, v_c, own_c, scale, sinks, softcap)[0].transpose(0, 1))
    for index, b in enumerate(layout.buckets):
        start, mid, end = b.offset, b.offset + b.groups * b.prefix, b.offset + b.tokens
        rows = b.groups * b.rows

        def prefix(t: Tensor) -> Tensor:  # [h, groups*prefix, D] -> [groups, h, prefix, D] (a view)
            return t[:, start:mid].unflatten(1, (b.groups, b.prefix)).transpose(0, 1)

        def suffix(t: Tensor) -> Tensor:  # [h, groups*rows*suffix, D] -> [groups*rows, h, suffix, D]
            return t[:, mid:end].unflatten(1, (rows, b.suffix)).transpose(0, 1)

        plain_pre, plain_suf = layout.biases(index, dtype)
        pre, suf = (start, mid), (mid, end)
        own_pre = bias(("pre", index), pre, pre, (b.groups, b.prefix, b.groups, b.prefix), plain_pre)
        own_suf = bias(("suf", index), suf, suf, (rows, b.suffix, rows, b.suffix), plain_suf)
        to_pre = bias(("suf-pre", index), suf, pre, (rows, b.suffix, b.groups, b.prefix), plain_pre)
        if c:  # each group's prefix continues the common tokens
            common = (0, c)
            pre_to_c = bias(("pre-c", index), pre, common, (b.groups, b.prefix, 1, c), plain_c)
            suf_to_c = bias(("suf-c", index), suf, common, (rows, b.suffix, 1, c), plain_c)
            out_pre = context_attention(
                prefix(q), prefix(k), prefix(v), own_pre, [(k_c, v_c, pre_to_c)], scale, sinks, softcap
            )
            contexts = [(k_c, v_c, suf_to_c), (prefix(k), prefix(v), to_pre)]
        else:
            out_pre = causal_attention(prefix(q), prefix(k), prefix(v), own_pre, scale, sinks, softcap)
            contexts = [(prefix(k), prefix(v), to_pre)]
        out_suf = context_attention(suffix(q), suffix(k), suffix(v), own_suf, contexts, scale, sinks, softcap)
        pieces.append(out_pre.transpose(1, 2).reshape(-1, heads, dim))
        pieces.append(out_suf.transpose(1, 2).reshape(-1, heads, dim))
    out = torch.cat(pieces)[None] if len(pieces) > 1 else pieces[0][None]
    if layout.blind_queries is not None and blind_average:  # eager's output for a query with no key,
        with torch.no_grad():  # a constant: it reaches no loss (padding predicts no label that is served)
            weights, which = layout.blind_average(dtype)
            mean = (weights @ v.transpose(0, 1).reshape(v.shape[1], -1))[which]  # [T, Hkv * D]
            mean = mean.view(-1, k.shape[0], 1, dim).expand(-1, -1, per_kv, -1).reshape(1, -1, heads, dim)
        out = torch.where(layout.blind_queries[None, :, None, None], mean, out)
    elif layout.blind_queries is not None:  # SDPA's and flash-attention's output for a query with no key
        out = out.masked_fill(layout.blind_queries[None, :, None, None], 0.0)
    return out
