"""The rollout engine: prefill each unique prompt once, decode its N samples from one KV cache.

engine.py holds `Rollout` and its stages (prefill, expand, decode, collect); decode.py the decode loop
and its state (`Decoder`, `DecodeState`, CUDA graphs); kv_cache.py the static KV buffers in both layouts;
attention.py the attention the model runs during decode; compaction.py which rows to keep; sampling.py,
lm_head.py and profiling.py the sampler, the float32 LM head and the per-stage timings. It builds on
the operators (torchkvops.ops, torchkvops.fused_attention) and the model adapter (torchkvops.hf.adapter),
never on the generate or training integrations.
"""

from .engine import (
    KV_LENGTH_MULTIPLE,
    MIN_TEMPERATURE,
    RESPONSE_KV_MULTIPLE,
    NonFiniteLogitsError,
    Rollout,
    RolloutConfig,
    RolloutOutput,
    check_prompts,
    kv_lengths,
    round_up,
)
from .profiling import RolloutProfile

__all__ = [
    "Rollout",
    "RolloutConfig",
    "RolloutOutput",
    "RolloutProfile",
    "NonFiniteLogitsError",
    "check_prompts",
    "kv_lengths",
    "round_up",
    "KV_LENGTH_MULTIPLE",
    "RESPONSE_KV_MULTIPLE",
    "MIN_TEMPERATURE",
]
