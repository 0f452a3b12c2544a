"""Tiny causal LMs of several families, built from configs with random weights (nothing downloaded).
A larger initializer range makes the logits peaked, so greedy decoding has no near-ties that would
turn a harmless rounding difference into a different token."""

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _build(cls, config):
    torch.manual_seed(0)
    return cls(config).eval()


FAMILIES = {
    "gpt2": lambda: _build(
        GPT2LMHeadModel, GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.2, **COMMON)
    ),
    "opt": lambda: _build(
        OPTForCausalLM,
        OPTConfig(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
            init_std=0.2,
            **COMMON,
        ),
    ),
    "llama": lambda: _build(
        LlamaForCausalLM,
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            initializer_range=0.2,
            **COMMON,
        ),
    ),
    "qwen3": lambda: _build(
        Qwen3ForCausalLM,
        Qwen3Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            max_position_embeddings=128,
            initializer_range=0.2,
            **COMMON,
        ),
    ),
    "mistral": lambda: _build(
        MistralForCausalLM,
        MistralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=128,
            sliding_window=64,
            initializer_range=0.2,
            **COMMON,
        ),
    ),
}


def prompts(batch: int, length: int, seed: int = 0, pad_id: int = 0, left_pad: list[int] | None = None):
    """Random prompt ids avoiding special ids, and a left-padded mask with `left_pad[i]` pads in row i."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pads in enumerate(left_pad or []):
        mask[row, :pads] = 0
    ids[mask == 0] = pad_id
    return ids, mask


def hf_greedy(model, ids, mask, new_tokens):
    """The oracle: HF generate's greedy response tokens for each prompt, [B, new_tokens]. No EOS (as the
    rollout tests' eos_token_id=[]; min_new_tokens would instead forbid the EOS token, changing the argmax)."""
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0
        )
    return out[:, ids.shape[1] :]
