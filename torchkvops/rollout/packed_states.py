"""Recurrent layers in the rollout's packed forwards: a turn of `Rollout.extend` (each live row's chunk:
its last token, then what was appended) and the prompts' remainders after a prefix common to all of them.

A packed forward runs several rows' chunks as one sequence, which the attention layers read through the
packed metadata (`attention.PackedAttention`); a recurrent layer would run over it as one row. For the
block of `segmented_mixers`, each recurrent layer's forward instead runs the chunks row by row, batched by
chunk length (no padding, which would move a state): each row continues from its own states (its history's,
or the common prefix's), read from the cache's rows through transformers' cache interface over copies
(`recurrent.SegmentStates`), and its final states are written back to its rows. The layer's own forward does
the work, as in the training forward (`training.recurrent_segments`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from torch import Tensor, nn

from ..models.recurrent import SegmentStates, own_forward, recurrent_mixers, restore_forward
from .attention import PackedAttention

__all__ = ["segmented_mixers"]


@contextlib.contextmanager
def segmented_mixers(adapter, cache) -> Iterator[None]:
    """For the block, each recurrent layer of the adapter's model runs a packed forward bound to `cache`
    (its `forward` a PackedAttention) chunk by chunk; any other forward as its own. Nothing to do for a
    model without recurrent layers."""
    mixers = recurrent_mixers(adapter.model) if adapter.has_states else {}
    previous = {i: vars(m).get("forward") for i, m in mixers.items()}
    for i, mixer in mixers.items():
        mixer.forward = functools.partial(_packed_mixer_forward, mixer, previous[i], cache)
    try:
        yield
    finally:
        for i, mixer in mixers.items():
            restore_forward(mixer, previous[i])


def _packed_mixer_forward(mixer: nn.Module, previous, rollout_cache, hidden_states: Tensor, **kwargs) -> Tensor:
    original = own_forward(mixer, previous)
    given = kwargs.pop("cache", None)
    context = getattr(rollout_cache, "metadata", None)
    if given is not rollout_cache or not isinstance(context, PackedAttention):
        return original(hidden_states, cache=given, **kwargs)
    kwargs.pop("attention_mask", None)  # (every chunk token is real)
    layer = mixer.layer_idx
    tokens = hidden_states[0]  # [T, hidden]
    states = rollout_cache.row_states(layer)  # (kind, state_idx) -> [rows of the cache, ...]
    outputs: Tensor | None = None
    for length, members in context.length_buckets():
        index = context.slots[members, :length]  # [n, length]: the packed tokens of these rows' chunks
        rows = context.rows[members]  # their rows of the cache
        segment = SegmentStates({key: view.index_select(0, rows) for key, view in states.items()}, True)
        out = original(tokens[index], cache=segment, attention_mask=None, **kwargs)  # [n, length, hidden']
        if outputs is None:
            outputs = out.new_empty(tokens.shape[0], out.shape[-1])
        outputs[index.reshape(-1)] = out.reshape(-1, out.shape[-1])
        for key, final in segment.final.items():
            states[key].index_copy_(0, rows, final.to(states[key].dtype))
    return outputs[None]
