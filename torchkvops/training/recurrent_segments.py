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
    `layout` (a PackedLayout without a common prefix): per bucket, the prefixes as one batch from no state,
    then the suffixes as one batch, each row from its group's final states. Returns [1, T, hidden']."""
    if layout.common:
        raise AssertionError("torchkvops: recurrent layers run over whole-row groups only (no common prefix)")
    tokens, mask = hidden_states[0], layout.token_mask
    outputs = []

    def run(start: int, rows: int, length: int, states: SegmentStates) -> None:
        end = start + rows * length
        x, bits = tokens[start:end].view(rows, length, -1), mask[start:end].view(rows, length)
        if length == 1 and states.initial:
            # A one-token continuation would take the layers' decode step, which updates a state in place
            # (Mamba2's): not differentiable. One padding column after it (masked, its output dropped)
            # takes the scan, which gives the token the same output.
            x, bits = F.pad(x, (0, 0, 0, 1)), F.pad(bits, (0, 1))
        out = original(x, cache=states, attention_mask=bits, **kwargs)
        outputs.append(out[:, :length].reshape(rows * length, -1))

    for bucket in layout.buckets:
        start, initial = bucket.offset, None
        if bucket.prefix:
            prefix = SegmentStates()
            run(start, bucket.groups, bucket.prefix, prefix)
            start += bucket.groups * bucket.prefix
            initial = {k: v.repeat_interleave(bucket.rows, dim=0) for k, v in prefix.final.items()}
        if bucket.suffix:
            run(start, bucket.groups * bucket.rows, bucket.suffix, SegmentStates(initial))
    return torch.cat(outputs)[None]
