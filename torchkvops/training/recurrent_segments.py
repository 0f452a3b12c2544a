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

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.recurrent import RECURRENT_LAYER_TYPES

__all__ = ["SegmentStates", "recurrent_mixers", "packed_recurrent_forward"]


class SegmentStates:
    """transformers' recurrent-state cache interface for one segment of rows of one layer: `initial`
    ((kind, state_idx) -> [rows, ...]: the states the rows continue from; empty: none, the layer starts
    them), and `final`, what the layer leaves at the segment's end (the states the next segment continues
    from). Tensors, not buffers: gradients flow through them."""

    def __init__(self, initial: dict[tuple[str, int], Tensor] | None = None):
        self.initial = initial or {}
        self.final: dict[tuple[str, int], Tensor] = {}

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        state = self.initial.get(("conv", state_idx))
        return None if state is None else state.clone()  # (a one-token segment updates it in place)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self.initial.get(("recurrent", state_idx))

    def update_conv_state(
        self, conv_states: Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs
    ) -> Tensor:
        """The convolution's input to run over: the window before the segment, then `conv_states` ([rows,
        channels, tokens]); its last `conv_kernel_size` columns (zeros before a shorter input) are kept."""
        previous = self.initial.get(("conv", state_idx))
        full = conv_states if previous is None else torch.cat([previous.to(conv_states.dtype), conv_states], dim=-1)
        width = conv_kernel_size if conv_kernel_size is not None else previous.shape[-1]
        kept = full[..., -width:]
        self.final[("conv", state_idx)] = F.pad(kept, (width - kept.shape[-1], 0))
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        if not isinstance(recurrent_states, Tensor):  # intermediate states were asked for: the last one
            recurrent_states = recurrent_states[-1]
        self.final[("recurrent", state_idx)] = recurrent_states
        return recurrent_states

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int) -> None:
        pass


def recurrent_mixers(backbone: nn.Module) -> dict[int, nn.Module]:
    """layer index -> the module that keeps that recurrent layer's states (a Gated DeltaNet, a Mamba2
    mixer, a short convolution: a module with a `layer_idx` whose forward takes (hidden_states, cache,
    attention_mask)), for every layer whose kind (config.layer_types) is recurrent. Raises ValueError
    when a recurrent layer has none, or more than one."""
    kinds = getattr(backbone.config, "layer_types", None) or []
    wanted = {i for i, kind in enumerate(kinds) if kind in RECURRENT_LAYER_TYPES}
    found: dict[int, list[nn.Module]] = {}
    for module in backbone.modules():
        layer = getattr(module, "layer_idx", None)
        if layer in wanted and not type(module).__name__.endswith("Attention") and _takes_states(type(module)):
            found.setdefault(layer, []).append(module)
    for layer, modules in found.items():  # the innermost (a decoder block may take the same arguments)
        found[layer] = [m for m in modules if not any(o is not m and o in set(m.modules()) for o in modules)]
    odd = sorted(i for i in wanted if len(found.get(i, ())) != 1)
    if odd:
        raise ValueError(
            f"patch_forward: recurrent layers {odd} of {type(backbone).__name__} have no single module that "
            "keeps their states (a forward taking hidden_states, cache and attention_mask)"
        )
    return {i: found[i][0] for i in sorted(wanted)}


@functools.cache
def _takes_states(cls: type) -> bool:
    names = list(inspect.signature(cls.forward).parameters)[1:4]
    return names == ["hidden_states", "cache", "attention_mask"]


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
