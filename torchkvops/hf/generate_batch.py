"""transformers' continuous batching entry point, `model.generate_batch`, served by a patched model's rollout.

TRL's GRPO and RLOO trainers with `use_transformers_continuous_batching=True` call
`model.generate_batch(prompt_ids, generation_config=..., continuous_batching_config=..., progress_bar=False)`
instead of `generate`: a list of token-id lists in, a dict of `GenerationOutput`s out (one per request,
in input order, a request's `num_return_sequences - 1` children `req_i__child#c` before it, as transformers
orders them), each with the request's prompt ids and its generated tokens up to and including its EOS.
`serve_batch` left-pads the lists into one batch and serves it as the patch serves `generate` (each
distinct prompt prefilled once, the same checks and fallbacks), then cuts each row back to that form.
`num_return_sequences` is answered as the installed transformers answers it (children since they exist,
one sequence per request before).

What changes results goes to transformers' own `generate_batch`, with a warning naming it: per-token
timestamps (`record_timestamps`), log-probabilities (`continuous_batching_config.return_logprobs`), an
argument it does not know; a generation setting the rollout does not serve falls back as `generate`'s
does. Scheduling and memory settings of `continuous_batching_config` (blocks, batch tokens, memory
fraction, CUDA graphs, ...) change no token and are left unused; its `seed` seeds the call.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import torch
from torch import nn
from transformers import GenerationConfig

__all__ = ["serve_batch", "NotServed"]

# generate_batch's arguments that change nothing the caller receives (progress display, the manager's
# lifetime, its CUDA-graph warm-up): accepted and unused.
_UNUSED = ("progress_bar", "persistent_manager", "warmup")


class NotServed(Exception):
    """Raised by the fallback `serve_batch` hands the generate contract: the call goes to generate_batch."""


def _refuse(*args, **kwargs):
    raise NotServed


def serve_batch(serve, session, model: nn.Module, inputs, original, **arguments) -> dict:
    """`model.generate_batch(inputs, **arguments)` through `serve(session, model, args, kwargs, fallback)`
    (the patch's generate, which calls `fallback` where it does not serve the call); `original`: the
    generate_batch it replaced, which takes every call that is not served."""
    reason = _refusal(arguments)
    if reason is not None:
        session.warn_once(reason, where="torchkvops.patch_generate (generate_batch)")
        return original(inputs, **arguments)
    if not inputs:
        return {}
    config = arguments.get("generation_config") or model.generation_config
    if (config.num_return_sequences or 1) > 1 and not _forks_children():
        config = copy.deepcopy(config)  # (the caller's stays as it was)
        config.num_return_sequences = 1  # as this transformers' generate_batch: one sequence per request
    kwargs = {"generation_config": config}
    if "max_new_tokens" in arguments:
        kwargs["max_new_tokens"] = arguments["max_new_tokens"]
    ids, mask = _left_padded(inputs, config.pad_token_id, _device(model))
    kwargs["attention_mask"] = mask
    seed = getattr(arguments.get("continuous_batching_config"), "seed", None)
    try:
        with torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext():
            if seed is not None:
                torch.manual_seed(seed)
            sequences = serve(session, model, (ids,), kwargs, _refuse)
    except NotServed:
        return original(inputs, **arguments)
    return _outputs(inputs, sequences[:, ids.shape[1] :], config, _eos_ids(config, model))


@functools.cache
def _forks_children() -> bool:
    """Whether this transformers' generate_batch answers num_return_sequences with children requests
    (`req_i__child#c`; 5.25 does, 5.17 returns one sequence per request whatever the setting)."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    return "__child#" in inspect.getsource(ContinuousMixin.generate_batch)  # (its result: each child by name)


def _refusal(arguments: dict) -> str | None:
    """What of generate_batch's arguments the rollout does not serve (None: nothing)."""
    known = {"generation_config", "continuous_batching_config", "record_timestamps", "max_new_tokens", *_UNUSED}
    unknown = sorted(set(arguments) - known)
    if unknown:
        return f"generate_batch's argument {unknown[0]!r}"
    if arguments.get("record_timestamps"):
        return "generate_batch's record_timestamps=True (per-token timestamps)"
    if getattr(arguments.get("continuous_batching_config"), "return_logprobs", False):
        return "continuous_batching_config.return_logprobs=True"
    return None


def _device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def _left_padded(inputs, pad_id: int | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-id lists as one left-padded batch and its mask (the pad id, or 0: masked positions are
    never read)."""
    if not all(isinstance(row, (list, tuple)) and row for row in inputs):
        raise ValueError("generate_batch: inputs must be a list of non-empty lists of token ids")
    width = max(len(row) for row in inputs)
    ids = torch.full((len(inputs), width), 0 if pad_id is None else pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(inputs):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def _eos_ids(config: GenerationConfig, model: nn.Module) -> list[int]:
    eos = config.eos_token_id
    if eos is None:
        eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _outputs(inputs, responses: torch.Tensor, config: GenerationConfig, eos: list[int]) -> dict:
    """transformers' generate_batch result: request `req_i` (and its children `req_i__child#c`, before it)
    with its prompt and its tokens up to and including the first EOS (all of them without one)."""
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

    k = config.num_return_sequences or 1
    rows = responses.tolist()  # host sync: the outputs are Python lists
    results = {}
    for i, prompt in enumerate(inputs):
        names = [f"req_{i}__child#{c}" for c in range(k - 1)] + [f"req_{i}"]
        for c, name in enumerate(names):
            tokens = rows[i * k + c]
            end = next((t + 1 for t, token in enumerate(tokens) if token in eos), len(tokens))
            results[name] = GenerationOutput(
                request_id=name, prompt_ids=list(prompt), generated_tokens=tokens[:end], status=RequestStatus.FINISHED
            )
    return results
