"""What a model family's layers need, in one place: the cache kind of each layer type, how the training
forward numbers a family's positions, what makes the rollout refuse a model, and the arguments a model's
layers hand the attention function that torchkvops' attention functions honour. Read by the model
adapter (the cache groups, the refusals: `models.adapter`), the recurrent probe (`models.recurrent`), the
rollout's attention (`rollout.attention`), the training forward (`training.shared_forward`) and the
coverage table (tests/test_coverage.py, which checks that every family named here has its tiny model).

Most families need no entry: a decoder whose `config.layer_types` are all in LAYER_KINDS and whose
positions reach the scores through rotary embeddings alone is served from its config and modules. An entry
in FAMILIES says what differs for one `config.model_type`; a new family that needs one is one entry here
and its tiny model in tests/families.py.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_WINDOW",
    "RECURRENT",
    "ATTENTION_KINDS",
    "LAYER_KINDS",
    "ATTENTION_LAYER_TYPES",
    "RECURRENT_LAYER_TYPES",
    "STATELESS_LAYER_TYPES",
    "NO_ATTENTION_LAYER_TYPES",
    "Family",
    "FAMILIES",
    "family_of",
    "ABSOLUTE_POSITION_FIELDS",
    "REFUSED_CONFIG_FIELDS",
    "ATTENTION_ARGUMENTS",
    "REFUSED_ATTENTION_ARGUMENTS",
]

# The kinds of cache group (`models.adapter.GroupSpec.kind`, as vLLM's KVCacheSpec kinds): what a group's
# layers store, and so how its rows are expanded, gathered and extended (`rollout.cache_groups`): attention
# layers' KV, every key (FULL_ATTENTION) or the keys of a sliding window (SLIDING_WINDOW: a key `window` or
# more positions before the query is never read again, so the paged layout gives its blocks back), or
# recurrent layers' fixed-size states (RECURRENT: a convolution window, a recurrent state).
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
RECURRENT = "recurrent"
ATTENTION_KINDS = (FULL_ATTENTION, SLIDING_WINDOW)  # the kinds that store KV

# `config.layer_types` -> the cache kind the layer's KV or states go to (None: no cache).
LAYER_KINDS = {
    "full_attention": FULL_ATTENTION,
    "sliding_attention": SLIDING_WINDOW,
    "linear_attention": RECURRENT,  # Gated DeltaNet (Qwen3.5, Qwen3-Next)
    "mamba": RECURRENT,  # Mamba2 mixers (Nemotron-H, Granite 4)
    "conv": RECURRENT,  # short convolutions (LFM2)
    "hybrid": RECURRENT,  # attention beside a Mamba2 mixer in one layer (Falcon-H1): its KV too
    "mlp": None,  # Nemotron-H's blocks without a mixer
    "moe": None,
}
ATTENTION_LAYER_TYPES = frozenset(t for t, kind in LAYER_KINDS.items() if kind in ATTENTION_KINDS)
RECURRENT_LAYER_TYPES = frozenset(t for t, kind in LAYER_KINDS.items() if kind == RECURRENT)
STATELESS_LAYER_TYPES = frozenset(t for t, kind in LAYER_KINDS.items() if kind is None)
# The layer types without an attention module ("hybrid" layers have one beside their recurrent mixer).
NO_ATTENTION_LAYER_TYPES = (RECURRENT_LAYER_TYPES - {"hybrid"}) | STATELESS_LAYER_TYPES


@dataclasses.dataclass(frozen=True)
class Family:
    """What differs for one family (`config.model_type`).

    positions: how the training forward numbers positions when the caller passes none. "relative": the
    family's scores read positions only as differences (rotary embeddings), so each row is numbered from
    its first real token and a prefix common to rows of different left padding is computed once (every
    rotary family, and a hybrid without position embeddings). "column": the column index over the padded
    row (GPT-2's learned absolute positions; a family whose scores read absolute positions besides their
    differences). "mask": OPT's cumsum(mask) - 1.
    refused: why the rollout and the training forward refuse the family (None: served)."""

    positions: str = "relative"
    refused: str | None = None


FAMILIES = {
    "gpt2": Family(positions="column"),
    "opt": Family(positions="mask"),
    # A per-dimension norm applied to q and k after the rotation: its weights scale rotated coordinates, so
    # the scores read absolute positions (tests/test_coverage.py moves the norm's weights off 1 to see it).
    "hunyuan_v1_dense": Family(positions="column"),
    "hunyuan_v1_moe": Family(positions="column"),
    "bloom": Family(positions="column", refused="adds ALiBi biases to its attention scores"),
    "mpt": Family(positions="column", refused="adds ALiBi biases to its attention scores"),
}
DEFAULT_FAMILY = Family()


def family_of(config) -> Family:
    """The entry of the config's model_type, or the default (rotary, served) one."""
    return FAMILIES.get(getattr(config, "model_type", None), DEFAULT_FAMILY)


# Config fields that, set, make a rotary family's scores read absolute positions (Llama 4's attention
# temperature on its no-RoPE layers): its positions are numbered by column.
ABSOLUTE_POSITION_FIELDS = ("attn_temperature_tuning",)
# Config fields that, set, make a model's attention more than softmax(q k^T * scale + mask) v over a plain
# per-layer KV cache: field -> what the refusal says.
REFUSED_CONFIG_FIELDS = {
    "alibi": "adds ALiBi biases to its attention scores",
    "kv_lora_rank": "uses multi-head latent attention (keys and values of different sizes)",
}
# The arguments a model's attention layer hands the attention function (transformers' AttentionInterface)
# that the rollout's and the training forward's attention functions apply: name -> what it is.
ATTENTION_ARGUMENTS = {
    "sliding_window": "the layer's window: a query sees the keys less than this many positions before it",
    "s_aux": "attention sinks (gpt-oss): a logit per head with no value, joining the softmax",
    "softcap": "Gemma 2's attn_logit_softcapping: softcap * tanh(score / softcap), where the model's own "
    "attention implementation applies it (fused_attention.applied_softcap)",
}
# Arguments whose presence (not None) the rollout's attention refuses: name -> what it is.
REFUSED_ATTENTION_ARGUMENTS = {"position_bias": "a relative position bias added to the scores (T5-style)"}
