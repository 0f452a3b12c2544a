"""What ties torchkvops to Hugging Face models and trainers.

adapter.py reads a causal LM (its KV shape, cache argument, attention implementation) and refuses what
the rollout cannot run; integration.py holds what both integrations share (patch handles, warn-once,
dropout and autocast detection, one LRU). Above the rollout: generate_contract.py decides what HF's
generate would do with a call (a Plan, or a Refusal that goes to HF's own generate), generate_patch.py
is `patch_generate`'s lifecycle, distributed.py the multi-rank `generate`.
"""

from .adapter import KVShape, ModelAdapter, is_peft_model, model_state, unwrap_model

__all__ = ["ModelAdapter", "KVShape", "model_state", "unwrap_model", "is_peft_model"]
