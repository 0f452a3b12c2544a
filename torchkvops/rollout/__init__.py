"""The rollout engine: prefill each unique prompt once, decode its N samples from one KV cache.

engine.py holds `Rollout`, calls.py a call's stages (one path for generate, extend and a stream),
config.py `RolloutConfig`, prompts.py where a call's prompts' KV is (a common prefix found); decode.py the
decode step and the one decode loop (`Decoder`), scheduler.py what the loop does at each check (retire,
admit, preempt, compact, stop), batch.py the batch whose rows join and leave (`DecodeBatch`), state.py the
per-row decode state, graphs.py the runner (eager, compiled, CUDA graphs); layouts.py the KV layouts as
objects, kv_cache.py and cache_groups.py the cache a model's forward is handed, one group of layers at a
time, block_pool.py, paged_kv.py and paged_store.py the pool of blocks the KV lives in, kv_budget.py a
budget of KV tokens; attention.py the attention the model runs in the rollout's forwards, packing.py and
packed_states.py packed forwards (their recurrent layers row by row); compaction.py which rows to keep,
streaming.py a budget's batch and its admissions, turns.py what extend goes on with; sampling.py,
lm_head.py and profiling.py the sampler, the float32 LM head and the per-stage timings.
docs/architecture.md draws how a call flows through them. It builds on
the operators (torchkvops.ops, torchkvops.fused_attention) and the model adapter and utilities
(torchkvops.models.adapter, torchkvops.utils), never on the generate or training integrations.
"""

from .config import MIN_TEMPERATURE, RolloutConfig, RolloutOutput
from .decode import NonFiniteLogitsError
from .engine import Rollout, check_prompts
from .layouts import KV_LENGTH_MULTIPLE, round_up
from .profiling import RolloutProfile

__all__ = [
    "Rollout",
    "RolloutConfig",
    "RolloutOutput",
    "RolloutProfile",
    "NonFiniteLogitsError",
    "check_prompts",
    "round_up",
    "KV_LENGTH_MULTIPLE",
    "MIN_TEMPERATURE",
]
