"""What torchkvops knows about a Hugging Face causal LM, below the rollout engine that uses it.

adapter.py reads a model (its KV cache's groups and their shapes, cache argument, attention
implementation, the wrappers around it) and refuses what the rollout cannot run; recurrent.py what a
hybrid's recurrent layers keep (their states' probe, a row's layout, a segment's cache interface);
forward_modes.py the dropout and autocast a forward applies; lora.py PEFT's LoRA merged for a call;
precision.py and sharding.py a sharded model's compute dtype and whether it is sharded; gguf.py a GGUF file
as a plain model; shapes.py named model shapes with random weights (`build_model`, nothing downloaded),
the benchmarks' and demos' models.
"""

from .adapter import CacheSpec, GroupSpec, KVShape, ModelAdapter, is_peft_model, model_state, unwrap_model
from .shapes import MODEL_SHAPES, build_model, model_config

__all__ = [
    "ModelAdapter",
    "KVShape",
    "CacheSpec",
    "GroupSpec",
    "model_state",
    "unwrap_model",
    "is_peft_model",
    "MODEL_SHAPES",
    "build_model",
    "model_config",
]
