"""What ties the rollout to Hugging Face's `generate`, above the engine.

generate_contract.py decides what HF's generate would do with a call (a Plan, or a Refusal that goes to
HF's own generate); generate_patch.py is `patch_generate`'s lifecycle and `torchkvops.generate`;
generate_reuse.py keeps a call's KV for the next turn; generate_batch.py serves transformers'
`generate_batch`; call_weights.py and sharded.py the weights a call decodes with (a sharded model's
gathered once, LoRA merged). The model adapter they share with the engine is
torchkvops.models, the small helpers torchkvops.utils; the multi-rank `generate` is torchkvops.distributed.
"""
