"""`torchkvops bench --mismatch`: how far the log-probabilities a rollout reports are from the ones a
trainer computes for the same tokens (issue #18).

RL trainers correct for the gap between the policy that sampled a token and the one they train
(importance sampling, TRL's TIS/MIS, verl's rollout correction): the sampler's log-probability of every
generated token against the trainer's. Per case this generates R tokens per row with each engine, then
scores the same sequences as a trainer does, and compares token by token (MISMATCH_NOTE).

Engines: each rollout mode of the run (`Rollout(return_logprobs=True)`), the same with
`lm_head_dtype=torch.float32` when the model's head is half precision (scored by a trainer whose head
also runs in float32, as TRL's `cast_lm_head_to_fp32` does), Hugging Face generate on its own samples
(`output_scores`: the processed scores it sampled from, turned into log-probabilities), and Hugging Face
generate forced to the first rollout mode's sequences (its `output_logits`, processed as the sampler
processes them), so that the two engines are compared on the same tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
from torch import Tensor, nn
from transformers import LogitsProcessor, LogitsProcessorList

from .. import reference
from ..rollout import Rollout
from ..rollout.lm_head import Float32LMHead
from .cases import ROLLOUT_MODES, Case, Settings
from .runners import hf_sampling, rollout_config

__all__ = ["MISMATCH_NOTE", "measure_mismatch"]

MISMATCH_NOTE = (
    "mismatch: per engine, the log-probability it reports for each generated token against a trainer's for the same "
    "sequence: one plain forward over prompt + response in the model's dtype (with the LM head in float32 for the "
    "'+ fp32 head' engines, as TRL's cast_lm_head_to_fp32), then log_softmax of logits / temperature over what "
    "top-k / top-p keep (greedy: of the logits). torchkvops: RolloutOutput.logprobs; hf-generate: log_softmax of "
    "output_scores on its own samples; 'hf-generate on <mode> tokens': Hugging Face generate forced (a logits "
    "processor) to that mode's sequences, its output_logits processed the same way. Over every generated token (no "
    "EOS, R per row): mean and max of |delta| = |engine - trainer| and k3 = mean(exp(-delta) - 1 + delta), an "
    "unbiased estimate of KL(engine || trainer) over the engine's samples. Under torchrun each process measures its "
    "own prompts; the results are the first process's."
)

# Rows of trainer logits scored at once: at most this many float32 logits in memory.
_MAX_LOGITS = 2**28


def _half_head(model: nn.Module) -> bool:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return isinstance(head, nn.Linear) and head.weight.dtype in (torch.float16, torch.bfloat16)


def _rollout(
    model: nn.Module, case: Case, mode: str, s: Settings, prompts: Tensor, head32: bool
) -> tuple[Tensor, Tensor]:
    out = Rollout(
        model, rollout_config(case, mode, s, [], return_logprobs=True, lm_head_dtype=torch.float32 if head32 else None)
    ).generate(prompts)
    return out.sequences, out.logprobs


def _hf_kwargs(case: Case, pad_token_id: int) -> dict:
    # As the bench's hf-generate mode: exactly R tokens, no EOS, top-k off.
    return dict(
        max_new_tokens=case.response_length,
        min_new_tokens=case.response_length,
        eos_token_id=None,
        pad_token_id=pad_token_id,
        use_cache=True,
        return_dict_in_generate=True,
    )


def _hf_own_samples(
    model: nn.Module, case: Case, s: Settings, prompts: Tensor, pad_token_id: int
) -> tuple[Tensor, Tensor]:
    ids, sampling = hf_sampling(prompts, case, s)
    torch.manual_seed(s.seed)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), output_scores=True, **_hf_kwargs(case, pad_token_id), **sampling
    )
    responses = out.sequences[:, prompts.shape[1] :]
    scores = torch.stack(out.scores, dim=1).float()  # [rows, R, vocab], processed
    return out.sequences, scores.log_softmax(dim=-1).gather(-1, responses[..., None]).squeeze(-1)


class _ForceTokens(LogitsProcessor):
    """Makes greedy search pick `responses[:, step]` at every step."""

    def __init__(self, responses: Tensor, prompt_length: int):
        self.responses, self.prompt_length = responses, prompt_length

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        target = self.responses[:, input_ids.shape[1] - self.prompt_length]
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, target[:, None], 0.0)


def _hf_forced(
    model: nn.Module, case: Case, s: Settings, prompts: Tensor, pad_token_id: int, sequences: Tensor
) -> tuple[Tensor, Tensor]:
    p = prompts.shape[1]
    responses = sequences[:, p:]
    ids = prompts.repeat_interleave(case.samples_per_prompt, dim=0)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        output_logits=True,
        logits_processor=LogitsProcessorList([_ForceTokens(responses, p)]),
        **_hf_kwargs(case, pad_token_id),
    )
    if not torch.equal(out.sequences, sequences):
        raise RuntimeError("Hugging Face generate did not follow the forced tokens")
    logits = torch.stack(out.logits, dim=1)  # [rows, R, vocab], raw
    return sequences, reference.processed_logprobs(logits, responses, s.temperature, 0, s.top_p)


def trainer_logprobs(model: nn.Module, sequences: Tensor, prompt_length: int, s: Settings, head32: bool) -> Tensor:
    """What a trainer computes for the response tokens of `sequences` [rows, P+R] (unpadded): one plain
    forward, then the processed log-probabilities. [rows, R] float32."""
    rows, total = sequences.shape
    r = total - prompt_length
    vocab = model.get_output_embeddings().weight.shape[0]
    kwargs = {"logits_to_keep": r + 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    chunk = max(1, _MAX_LOGITS // (total * vocab))
    head = Float32LMHead(model).applied() if head32 else contextlib.nullcontext()
    parts = []
    with torch.inference_mode(), head:
        for start in range(0, rows, chunk):
            seq = sequences[start : start + chunk]
            logits = model(input_ids=seq, attention_mask=torch.ones_like(seq), **kwargs).logits
            logits = logits[:, -(r + 1) : -1]  # the positions that predict the response tokens
            parts.append(reference.processed_logprobs(logits, seq[:, prompt_length:], s.temperature, 0, s.top_p))
    return torch.cat(parts)


def mismatch_stats(engine: Tensor, trainer: Tensor) -> dict:
    delta = (engine.double() - trainer.double()).flatten()
    return {
        "tokens": delta.numel(),
        "mean_abs_delta": delta.abs().mean().item(),
        "max_abs_delta": delta.abs().max().item(),
        "k3_kl": (torch.expm1(-delta) + delta).mean().item(),
    }


def measure_mismatch(
    model: nn.Module, case: Case, modes, s: Settings, prompts: Tensor, pad_token_id: int
) -> dict[str, dict]:
    """Every engine of this case (see the module docstring): {engine: mismatch_stats, or {"error": ...}}."""
    p = prompts.shape[1]
    rollout_modes = [m for m in modes if m in ROLLOUT_MODES]
    engines = []  # (name, LM head in float32, run() -> (sequences, the engine's logprobs))
    for m in rollout_modes:
        engines.append((m, False, lambda m=m: _rollout(model, case, m, s, prompts, head32=False)))
        if _half_head(model):
            engines.append((f"{m} + fp32 head", True, lambda m=m: _rollout(model, case, m, s, prompts, head32=True)))
    if "hf-generate" in modes:
        engines.append(("hf-generate", False, lambda: _hf_own_samples(model, case, s, prompts, pad_token_id)))
    results: dict[str, dict] = {}
    sequences: dict[str, Tensor] = {}
    for name, head32, run in engines:
        results[name], sequences[name] = _scored(model, p, s, head32, run)
    if "hf-generate" in modes and rollout_modes and sequences[rollout_modes[0]] is not None:
        forced_to = sequences[rollout_modes[0]]
        results[f"hf-generate on {rollout_modes[0]} tokens"], _ = _scored(
            model, p, s, False, lambda: _hf_forced(model, case, s, prompts, pad_token_id, forced_to)
        )
    return results


def _scored(model: nn.Module, prompt_length: int, s: Settings, head32: bool, run) -> tuple[dict, Tensor | None]:
    """One engine's mismatch_stats (or its error) and its sequences (None if it failed)."""
    try:
        with torch.inference_mode():
            sequences, engine = run()
        result = mismatch_stats(engine, trainer_logprobs(model, sequences, prompt_length, s, head32))
    except Exception as e:  # noqa: BLE001 - an engine that fails is a result; the others still run
        return {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"}, None
    if not math.isfinite(result["max_abs_delta"]):
        result["note"] = "non-finite log-probabilities"
    return result, sequences
