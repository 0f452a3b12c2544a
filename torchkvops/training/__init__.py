"""The shared-prefix training forward (`patch_forward`): shared_forward.py patches the model,
prefix_groups.py finds the rows that share a prompt and packs them, prefix_attention.py computes their
attention with the prompt's keys and values once per group. It never imports the rollout."""
