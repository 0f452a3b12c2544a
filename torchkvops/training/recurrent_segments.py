"""Recurrent layers (Gated DeltaNet, Mamba2, short convolutions) in the shared-prefix training forward.

A recurrent layer's output at a token depends on every token before it in its row only through the
layer's state after them: a convolution window and (Gated DeltaNet, Mamba2) a recurrent state, a fixed
size per row. So a group of rows that share their first p columns runs the layer once over the prefix
([groups, p], from a zero state, as the plain forward starts each row), keeps each group's final states,
and continues every row's suffix from its group's ([groups * rows, S], each row starting from a copy):
the outputs are the plain forward's (up to the chunked scans' rounding, whose chunks now start at the
prefix's end), and gradients reach the prefix through the states, by autograd.

The layer's own forward does both halves: it reads and writes its states through transformers' cache
interface (`get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`), which
`SegmentStates` implements for one segment (the prefix: no state before, the final ones kept; a suffix:
its group's final ones before, as tensors that carry gradients). Each layer sees the packed sequence as
the packed layout lays it out (`prefix_attention.PackedLayout`): a bucket's prefixes (group by group),
then its suffixes (group by group, row by row), each segment a run of its row's own columns in order.
That is true of the groups found on whole rows; a prefix common to every row computed once (a system
prompt after left padding of different lengths) is not a run of each row's columns, and the caller does
not plan one for models with recurrent layers.

The padding mask is the plain forward's: each segment gets its tokens' attention-mask bits, so that a
layer zeroes padding inputs exactly where the plain forward does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.recurrent import SegmentStates

__all__ = ["packed_recurrent_forward"]


def packed_recurrent_forward(original, hidden_states: Tensor, layout, **kwargs) -> Tensor:
    """`original` (the layer's own forward) over the packed sequence `hidden_states` [1, T, hidden] of
    `layout`: per bucket, the prefixes as one batch, then the suffixes as one batch, each row from its
    group's final states; with a prefix common to every row (`layout.common`), that prefix first, once, and
    every group's real tokens continuing from its states (module docstring). Returns [1, T, hidden']."""
    tokens, mask = hidden_states[0], layout.token_mask
    device = tokens.device
    pieces: list[tuple[Tensor, Tensor]] = []  # (packed token indices, their outputs)

    def run(index: Tensor, initial: dict | None) -> dict:
        """The segments at packed tokens `index` [rows, length], from `initial` states (None: none);
        returns their final states."""
        rows, length = index.shape
        x, bits = tokens[index], mask[index]
        if length == 1 and initial:
            # A one-token continuation would take the layers' decode step, which updates a state in place
            # (Mamba2's): not differentiable. One padding column after it (masked, its output dropped)
            # takes the scan, which gives the token the same output.
            x, bits = F.pad(x, (0, 0, 0, 1)), F.pad(bits, (0, 1))
        states = SegmentStates(initial)
        out = original(x, cache=states, attention_mask=bits, **kwargs)
        pieces.append((index.reshape(-1), out[:, :length].reshape(rows * length, -1)))
        return states.final

    def run_after_padding(index: Tensor, initial: dict) -> dict:
        """With a common prefix: each row's leading padding (the left padding the layout puts after the
        common tokens; in the row it comes first) from no state, as the plain forward runs it, for its
        outputs only; the rest from `initial`. Rows batched by their padding's length."""
        leading = (~mask[index]).long().cumprod(dim=1).sum(dim=1)
        finals = dict(initial)  # (a row of padding only keeps its initial states)
        for pads in sorted(set(leading.tolist())):  # host sync: once per segment batch
            members = (leading == pads).nonzero().flatten()
            if pads:
                run(index[members, :pads], None)
            if pads < index.shape[1]:
                ends = run(index[members, pads:], {k: v.index_select(0, members) for k, v in initial.items()})
                finals = {k: finals[k].index_copy(0, members, ends[k].to(finals[k].dtype)) for k in finals}
        return finals

    common = None
    if layout.common:  # it starts every row's real tokens: from no state, as each row's padding leaves it
        common = run(torch.arange(layout.common, device=device)[None], None)
    for bucket in layout.buckets:
        start = bucket.offset
        prefix = torch.arange(start, start + bucket.groups * bucket.prefix, device=device).view(bucket.groups, -1)
        start += bucket.groups * bucket.prefix
        suffix = torch.arange(start, start + bucket.groups * bucket.rows * bucket.suffix, device=device)
        suffix = suffix.view(bucket.groups * bucket.rows, bucket.suffix)
        if common is None:
            ends = run(prefix, None) if bucket.prefix else None
            after = None if ends is None else {k: v.repeat_interleave(bucket.rows, dim=0) for k, v in ends.items()}
            if bucket.suffix:
                run(suffix, after)
            continue
        ends = {k: v.expand(bucket.groups, *v.shape[1:]) for k, v in common.items()}
        if bucket.prefix:
            ends = run_after_padding(prefix, ends)
        if bucket.suffix:
            run_after_padding(suffix, {k: v.repeat_interleave(bucket.rows, dim=0) for k, v in ends.items()})
    index = torch.cat([i for i, _ in pieces])
    outputs = torch.cat([o for _, o in pieces])
    return outputs.new_empty(outputs.shape).index_copy(0, index, outputs)[None]
