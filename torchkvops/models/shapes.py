"""Named model shapes with random weights, built in memory: the benchmarks' and demos' default models
(nothing is downloaded). Each shape copies a public checkpoint's config; only the weights are random."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GptOssConfig,
    LlamaConfig,
    OPTConfig,
    PreTrainedConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
)

__all__ = ["MODEL_SHAPES", "build_model", "model_config"]


def _tiny() -> PreTrainedConfig:
    # A modern decoder (grouped-query attention, RoPE) small enough for tests and CPU demos.
    return LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _llama_small() -> PreTrainedConfig:
    # A small Llama-style decoder (grouped-query attention, RoPE, 8192 positions) for CPU benchmarks with
    # long prompts: the KV cache, not the weights, dominates a decode step's reads there.
    return LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _gemma3_small() -> PreTrainedConfig:
    # llama-small's sizes with Gemma 3's attention: five sliding-window layers (window 512) to one global,
    # QK norms, query_pre_attn_scalar (Gemma 3 1B's pattern and window, scaled down).
    return Gemma3TextConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=512,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=8192,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )


def _gpt_oss_small() -> PreTrainedConfig:
    # llama-small's sizes with gpt-oss's attention and MLP: attention sinks, sliding windows of 128 on every
    # other layer, 4 experts (2 per token) (gpt-oss-20b's pattern, scaled down). Eager attention: gpt-oss
    # has no SDPA path in transformers.
    return GptOssConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=131072,  # (its YaRN rope: 4096 x 32)
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _qwen3_5_small() -> PreTrainedConfig:
    # llama-small's sizes with Qwen3.5's hybrid layers: three Gated DeltaNet layers before each attention
    # layer (Qwen3.5's pattern), 2 key and 4 value heads of 64 in the linear attention, a convolution of 4,
    # gated attention output (Qwen3.5's), scaled down.
    return Qwen3_5TextConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=32768,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _opt_125m() -> PreTrainedConfig:
    return OPTConfig(
        vocab_size=50272,
        hidden_size=768,
        ffn_dim=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=2048,
        word_embed_proj_dim=768,
        do_layer_norm_before=True,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )


def _opt_6_7b() -> PreTrainedConfig:
    # The shape of DeepSpeed's published shared-prefill measurement (facebook/opt-6.7b).
    return OPTConfig(
        vocab_size=50272,
        hidden_size=4096,
        ffn_dim=16384,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=2048,
        word_embed_proj_dim=4096,
        do_layer_norm_before=True,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )


def _gpt2() -> PreTrainedConfig:
    return GPT2Config()  # gpt2 (124M)


def _qwen3_0_6b() -> PreTrainedConfig:
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    )


MODEL_SHAPES = {
    "tiny": _tiny,
    "llama-small": _llama_small,
    "gemma3-small": _gemma3_small,
    "gpt-oss-small": _gpt_oss_small,
    "qwen3.5-small": _qwen3_5_small,
    "opt-125m": _opt_125m,
    "gpt2": _gpt2,
    "qwen3-0.6b": _qwen3_0_6b,
    "opt-6.7b": _opt_6_7b,
}


def model_config(shape: str) -> PreTrainedConfig:
    if shape not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[shape]()


def build_model(
    shape: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
) -> torch.nn.Module:
    """A causal LM of the named shape with random weights (seeded), in eval mode."""
    config = model_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError:  # a family without an SDPA path (gpt-oss): its eager attention
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval()
