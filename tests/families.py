"""Tiny random models of every decoder-only family the coverage table lists (tests/test_coverage.py), built
from transformers' own config classes (a family the installed transformers lacks is skipped by name).

Each config is the family's defaults made small: 2-4 layers of hidden size 64, 4 query and 2 KV heads of
16, a vocabulary of VOCAB, MoE layers of 4 experts (2 per token), and where a family alternates layer
kinds both kinds present (a sliding window of 8: shorter than the rows tested, so a window must mask).
Weights are drawn with initializer_range 0.2 (norm weights moved off their initial value too), a scale at
which a wrong mask or position moves logits and gradients well past rounding."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from torchkvops.models.recurrent import recurrent_cache_unsupported

VOCAB = 97
WINDOW = 8

_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
_MOE = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=0,
    first_k_dense=0,
    moe_layer_start_index=0,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)
_SLIDING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
# Hybrids: recurrent layers before attention ones. Gated DeltaNet (Qwen3.5, Qwen3-Next): 2 key and 4 value
# heads of 8, a convolution of 4; Mamba2 (Granite 4, Nemotron-H, Falcon-H1): 4 heads of 16, a state of 8,
# chunks of 8 (shorter than the prompts: the chunked scan's carry is exercised); LFM2: short convolutions.
_GATED_DELTANET = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"],
)
_MAMBA2 = dict(
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=8,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=1,
    mamba_chunk_size=8,
    layer_types=["linear_attention", "full_attention"],
)

# model type -> the fields its tiny config sets beyond _SMALL.
FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": _MOE,
    "mixtral": _MOE,
    "phi3": {},
    "olmo2": {},
    "olmo3": _SLIDING,
    "smollm3": dict(no_rope_layers=[1, 0]),
    "glm4": {},
    "glm4_moe": _MOE,
    "granite": dict(embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0),
    "cohere2": dict(_SLIDING, layer_types=["sliding_attention", "full_attention"]),
    "seed_oss": dict(attention_dropout=0.0, residual_dropout=0.0),
    "ernie4_5": {},
    "hunyuan_v1_dense": {},
    "hunyuan_v1_moe": dict(_MOE, moe_topk=2),
    "exaone4": _SLIDING,
    "apertus": {},
    "ministral3": {},
    "minimax_m2": _MOE,
    "gemma3_text": dict(_SLIDING, query_pre_attn_scalar=16),
    "gemma2": dict(_SLIDING, query_pre_attn_scalar=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gpt_oss": dict(_MOE, **_SLIDING),
    "gemma3n_text": dict(
        _SLIDING,
        num_kv_shared_layers=2,
        num_hidden_layers=4,
        altup_num_inputs=2,
        laurel_rank=8,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        intermediate_size=[96] * 4,
        activation_sparsity_pattern=[0.0] * 4,
    ),
    "gemma4_text": dict(_SLIDING, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8),
    "qwen3_5_text": _GATED_DELTANET,
    "qwen3_5_moe_text": dict(_GATED_DELTANET, **_MOE, shared_expert_intermediate_size=32),
    "qwen3_next": dict(_GATED_DELTANET, **_MOE, shared_expert_intermediate_size=32),
    "granitemoehybrid": dict(_MAMBA2, **_MOE, shared_intermediate_size=32),
    "nemotron_h": dict(  # (its Mamba2 and shared-expert fields have names of their own: 128 heads of 64 else)
        _MAMBA2,
        **_MOE,
        layer_types=["linear_attention", "full_attention", "mlp", "moe"],
        num_hidden_layers=4,
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=1,
        chunk_size=8,
        moe_shared_expert_intermediate_size=32,
    ),
    "falcon_h1": dict(_MAMBA2, mamba_d_ssm=64),  # (each layer "hybrid": Mamba2 beside attention)
    "lfm2": dict(
        layer_types=["conv", "full_attention"], conv_L_cache=3, block_ff_dim=96, block_auto_adjust_ff_dim=False
    ),
}
# The hybrids: models with recurrent layers (tests/test_hybrid.py).
HYBRIDS = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "granitemoehybrid", "nemotron_h", "falcon_h1", "lfm2"]


def tiny_config(model_type: str, **overrides):
    """The family's tiny config (`overrides`: fields set on it last), or None when the installed transformers
    lacks the family."""
    try:
        config = AutoConfig.for_model(model_type)
    except (KeyError, ValueError):
        return None
    fields = {**_SMALL, **FAMILIES[model_type], **overrides}
    kinds = fields.pop("layer_types", None)  # (set below, once the layer count is)
    for name, value in fields.items():
        try:
            settable = hasattr(config, name) or name in _SMALL
        except RuntimeError:  # a per-layer attribute of a heterogeneous config (gemma4): its defaults stay
            continue
        if settable:
            setattr(config, name, value)
    if kinds or getattr(config, "layer_types", None) is not None:
        kinds = kinds or ["full_attention"]
        try:
            config.layer_types = [kinds[i % len(kinds)] for i in range(config.num_hidden_layers)]
        except AttributeError:  # derived, not settable (Falcon-H1: every layer "hybrid")
            pass
    if model_type == "gemma4_text":  # head sizes and KV heads of its own per layer kind
        sizes = {
            "sliding_attention": {"head_dim": 16, "num_key_value_heads": 2},
            "full_attention": {"head_dim": 32, "num_key_value_heads": 1},
        }
        config.per_layer_config = {i: sizes[kind] for i, kind in enumerate(config.layer_types)}
    config._attn_implementation = "sdpa"
    return config


def unavailable(model_type: str) -> str:
    """Why `tiny_model(model_type)` gave None: a skip reason."""
    reason = recurrent_cache_unsupported() if model_type in HYBRIDS else None
    return reason or f"this transformers has no {model_type}"


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """The family's tiny model, or None when the installed transformers lacks the family (or, for a hybrid,
    the cache interface through which torchkvops reads recurrent states: `recurrent_cache_unsupported`)."""
    if model_type in HYBRIDS and recurrent_cache_unsupported():
        return None
    config = tiny_config(model_type, **overrides)
    if config is None:
        return None
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:  # a family without SDPA support (gemma2, gpt_oss)
        config._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # Norm weights away from their initial 1 (or 0): a norm that is the identity hides where it sits (a
    # QK norm after the rotary embedding makes scores depend on absolute positions only once it is not).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.2)
    return model.eval()
