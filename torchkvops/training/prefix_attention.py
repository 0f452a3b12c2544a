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
(`merge_attention_states`). The cost is p*p/2 + n*S*(p + S/2) scores per group instead of the plain
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
uniform average over the whole row instead, which a shared prefix cannot reproduce:
`torchkvops.patch_forward` runs such calls plain when labels read one.

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
from ..fused_attention import MASKED_KEY_BIAS, attend, attend_backward

__all__ = ["Bucket", "PackedLayout", "packed_attention", "shared_prefix_attention", "SERVED_DEVICES"]

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
    serves every row of its group). `token_mask[t]` is the attention-mask bit of packed token t."""

    buckets: tuple[Bucket, ...]
    src: Tensor  # [T] int64
    dest: Tensor  # [rows * length] int64
    token_mask: Tensor  # [T] bool
    rows: int
    length: int
    blind_queries: Tensor | None = None  # [T] bool: queries whose every key is padding (None: no such query)
    _biases: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def tokens(self) -> int:
        return int(self.src.numel())

    def biases(self, index: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Bucket `index`'s additive key biases in `dtype`, built once per dtype (every layer reuses them):
        prefix keys [groups, 1, 1, prefix] and suffix keys [groups*rows, 1, 1, suffix]."""
        key = (index, dtype)
        if key not in self._biases:
            b = self.buckets[index]
            start, mid = b.offset, b.offset + b.groups * b.prefix

            def bias(allowed: Tensor, batch: int) -> Tensor:
                values = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
                values = values.masked_fill(~allowed, MASKED_KEY_BIAS)
                return values.view(batch, 1, 1, -1)

            self._biases[key] = (
                bias(self.token_mask[start:mid], b.groups),
                bias(self.token_mask[mid : start + b.tokens], b.groups * b.rows),
            )
        return self._biases[key]


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


class _SharedPrefixAttention(torch.autograd.Function):
    """One bucket: (prefix outputs [G, H, p, D], suffix outputs [G*n, H, S, D])."""

    @staticmethod
    def forward(ctx, q_pre, k_pre, v_pre, q_suf, k_suf, v_suf, bias_pre, bias_suf, scale):
        groups, heads = q_pre.shape[0], q_pre.shape[1]
        out_pre, lse_pre = attend(q_pre, k_pre, v_pre, bias_pre, causal=True, scale=scale)
        rows, s = q_suf.shape[0], q_suf.shape[2]
        if s == 0:
            out_suf = q_suf.new_empty(q_suf.shape)
            lse_suf = q_suf.new_empty(q_suf.shape[:3], dtype=torch.float32)
        else:
            kv_heads = k_pre.shape[1]
            folded = _fold(q_suf, groups, kv_heads)
            out_x, lse_x = attend(folded, k_pre, v_pre, bias_pre, scale=scale)
            out_s, lse_s = attend(q_suf, k_suf, v_suf, bias_suf, causal=True, scale=scale)
            n, per_kv = rows // groups, heads // kv_heads
            split = (groups, n, kv_heads, per_kv, s)
            out_suf, lse_suf = ops.merge_attention_states(
                _unfold(out_x, groups, rows, heads),
                _unfold(lse_x, groups, rows, heads),
                out_s.view(*split, -1),
                lse_s.reshape(split),
            )
            out_suf, lse_suf = out_suf.view(q_suf.shape), lse_suf.view(q_suf.shape[:3])
        ctx.scale = scale
        ctx.save_for_backward(
            q_pre, k_pre, v_pre, q_suf, k_suf, v_suf, bias_pre, bias_suf, out_pre, lse_pre, out_suf, lse_suf
        )
        return out_pre, out_suf

    @staticmethod
    def backward(ctx, grad_pre, grad_suf):
        q_pre, k_pre, v_pre, q_suf, k_suf, v_suf, bias_pre, bias_suf, out_pre, lse_pre, out_suf, lse_suf = (
            ctx.saved_tensors
        )
        scale = ctx.scale
        dq_pre, dk_pre, dv_pre = attend_backward(
            grad_pre.contiguous(), q_pre, k_pre, v_pre, bias_pre, causal=True, scale=scale, out=out_pre, lse=lse_pre
        )
        if q_suf.shape[2] == 0:
            return (
                dq_pre,
                dk_pre,
                dv_pre,
                torch.zeros_like(q_suf),
                torch.zeros_like(k_suf),
                torch.zeros_like(v_suf),
                None,
                None,
                None,
            )
        groups, kv_heads = q_pre.shape[0], k_pre.shape[1]
        grad_suf = grad_suf.contiguous()
        # Cross part: the folded queries against the prefix K/V, with the merged output and lse.
        dq_x, dk_x, dv_x = attend_backward(
            _fold(grad_suf, groups, kv_heads),
            _fold(q_suf, groups, kv_heads),
            k_pre,
            v_pre,
            bias_pre,
            causal=False,
            scale=scale,
            out=_fold(out_suf, groups, kv_heads),
            lse=_fold(lse_suf, groups, kv_heads),
        )
        # Suffix part: each row against its own keys, causally, with the same merged output and lse.
        dq_s, dk_s, dv_s = attend_backward(
            grad_suf, q_suf, k_suf, v_suf, bias_suf, causal=True, scale=scale, out=out_suf, lse=lse_suf
        )
        rows, heads = q_suf.shape[0], q_suf.shape[1]
        dq_suf = dq_s + _unfold(dq_x, groups, rows, heads).reshape(q_suf.shape)
        return dq_pre, dk_pre + dk_x, dv_pre + dv_x, dq_suf, dk_s, dv_s, None, None, None


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
    return _SharedPrefixAttention.apply(q_pre, k_pre, v_pre, q_suf, k_suf, v_suf, bias_pre, bias_suf, scale)


def packed_attention(query: Tensor, key: Tensor, value: Tensor, layout: PackedLayout, scale: float | None) -> Tensor:
    """A transformers attention layer's call over a packed sequence: query [1, H, T, D], key/value
    [1, Hkv, T, D] in `layout`'s token order -> [1, T, H, D] (what attention functions return)."""
    q, k, v = query[0], key[0], value[0]  # [H, T, D]
    heads, dim = q.shape[0], q.shape[-1]
    pieces = []
    for index, b in enumerate(layout.buckets):
        mid, end = b.offset + b.groups * b.prefix, b.offset + b.tokens

        def prefix(t: Tensor) -> Tensor:  # [h, groups*prefix, D] -> [groups, h, prefix, D] (a view)
            return t[:, b.offset : mid].unflatten(1, (b.groups, b.prefix)).transpose(0, 1)

        def suffix(t: Tensor) -> Tensor:  # [h, groups*rows*suffix, D] -> [groups*rows, h, suffix, D]
            return t[:, mid:end].unflatten(1, (b.groups * b.rows, b.suffix)).transpose(0, 1)

        bias_pre, bias_suf = layout.biases(index, q.dtype)
        out_pre, out_suf = shared_prefix_attention(
            prefix(q), prefix(k), prefix(v), suffix(q), suffix(k), suffix(v), bias_pre, bias_suf, scale
        )
        pieces.append(out_pre.transpose(1, 2).reshape(-1, heads, dim))
        pieces.append(out_suf.transpose(1, 2).reshape(-1, heads, dim))
    out = torch.cat(pieces)[None] if len(pieces) > 1 else pieces[0][None]
    if layout.blind_queries is not None:  # SDPA's and flash-attention's output for a query with no key
        out = out.masked_fill(layout.blind_queries[None, :, None, None], 0.0)
    return out
