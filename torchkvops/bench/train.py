"""The training side of shared prefill (issue #17): forward + backward of the completion log-probabilities
of G rows per prompt, the plain forward against `torchkvops.patch_forward`'s shared-prefix one.

A case is B prompts of P tokens, each followed by G completions of C tokens (TRL's layout: the G rows
of a prompt adjacent; every token real, so that the token counts are exact). One step is what a GRPO
loss pass does: `model(input_ids, attention_mask, logits_to_keep=C + 1)`, the log-probabilities of the
C completion tokens, their sum, backward. Per case, on one model:

  time        plain and shared steps alternate (A B A B ...) after `warmup` untimed steps of each; the
              median of `iterations` timed steps each, with the one Clock of the harness (CUDA events,
              perf_counter on the CPU); speedup = plain median / shared median
  saved       bytes of the activations autograd holds for backward at the end of the forward (unique
              storages passed to saved-tensor hooks, parameters excluded): the activation memory
  peak        peak memory of one extra step of each mode beyond the weights and their gradients (CUDA
              max_memory_allocated, CPU the profiler's memory events, as metrics.peak_memory_bytes)
  agree       the shared step's loss and gradients against the plain step's (max difference relative to
              the largest gradient)

Models are built from a named shape with random weights (torchkvops.models), in train mode with every
dropout off (dropout cannot be shared: the patched forward would fall back).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from ..models import build_model
from ..rollout.profiling import Clock
from ..training.shared_forward import disable_dropout, patch_forward
from .metrics import cpu_peak_memory_bytes, saved_tensor_bytes

__all__ = ["TrainCase", "cases", "make_batch", "measure_case", "format_table", "NOTES"]

NOTES = {
    "time": "median ms of `iterations` steps per mode, plain and shared steps alternating after the warm-up",
    "saved_mib": "activations held for backward after the forward (unique storages seen by saved-tensor hooks, "
    "parameters excluded)",
    "peak_mib": "peak memory of one more step per mode beyond the weights and their gradients (allocated by a step "
    "before, zeroed in place): CUDA max_memory_allocated beyond what was allocated before; CPU the running "
    "sum of the profiler's memory events",
    "grad_rel_diff": "max |shared - plain| over every parameter's gradient / the largest |plain| gradient (ReLU models: "
    "a unit within float32 rounding of the kink can switch, see the README)",
    "tokens": "rows x (P + C) for plain; for shared, the tokens the packed sequence holds (B x (P + G x C))",
}


@dataclasses.dataclass(frozen=True)
class TrainCase:
    prompts: int  # B
    prompt_length: int  # P
    completion_length: int  # C
    group: int  # G

    @property
    def rows(self) -> int:
        return self.prompts * self.group


def cases(prompts: int, prompt_lengths, completion_lengths, groups) -> Iterator[TrainCase]:
    for p in prompt_lengths:
        for c in completion_lengths:
            for g in groups:
                yield TrainCase(prompts, p, c, g)


def make_batch(case: TrainCase, vocab: int, device, seed: int = 0) -> Tensor:
    """[B*G, P+C] token ids: each prompt G times in a row, each row with its own completion."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (case.prompts, 1, case.prompt_length), generator=g)
    completions = torch.randint(3, vocab, (case.prompts, case.group, case.completion_length), generator=g)
    ids = torch.cat([prompts.expand(-1, case.group, -1), completions], dim=2)
    return ids.reshape(case.rows, -1).to(device)


def _loss(model: nn.Module, ids: Tensor, completion_length: int) -> Tensor:
    mask = torch.ones_like(ids)
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=completion_length + 1, use_cache=False).logits
    logprobs = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, -completion_length:, None])
    return -logprobs.mean()


def _step(model: nn.Module, ids: Tensor, completion_length: int, keep_grads: bool = False) -> Tensor:
    model.zero_grad(set_to_none=not keep_grads)
    loss = _loss(model, ids, completion_length)
    loss.backward()
    return loss.detach()


def _in_mode(model: nn.Module, shared: bool, fn: Callable[[], object]):
    if not shared:
        return fn()
    with patch_forward(model) as handle:
        out = fn()
    if handle.stats.fallback_calls or not handle.stats.shared_calls:
        raise RuntimeError(f"bench-train: the shared step ran the plain forward ({handle.stats})")
    return out


def _saved_bytes(model: nn.Module, ids: Tensor, completion_length: int) -> int:
    params = frozenset(p.untyped_storage().data_ptr() for p in model.parameters())
    return saved_tensor_bytes(lambda: _loss(model, ids, completion_length), exclude=params)


def _peak_bytes(model: nn.Module, ids: Tensor, completion_length: int, device: torch.device) -> int:
    """Peak memory of one step beyond the weights and their gradients (allocated by a step before, then
    zeroed in place: they are the same in both modes and, for a large vocabulary, would hide the rest)."""
    _step(model, ids, completion_length)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _step(model, ids, completion_length, keep_grads=True)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return cpu_peak_memory_bytes(lambda: _step(model, ids, completion_length, keep_grads=True))


def measure_case(model: nn.Module, case: TrainCase, iterations: int, warmup: int, seed: int = 0) -> dict:
    """One case: times, memory and agreement of the plain and shared steps (see the module docstring)."""
    device = next(model.parameters()).device
    ids = make_batch(case, model.config.vocab_size, device, seed)
    clock = Clock(device)
    c = case.completion_length
    result = {
        **dataclasses.asdict(case),
        "plain_tokens": case.rows * (case.prompt_length + c),
        "shared_tokens": case.prompts * (case.prompt_length + case.group * c),
    }

    # Agreement first (it also warms both modes up).
    loss_plain = _step(model, ids, c)
    grads_plain = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    loss_shared = _in_mode(model, True, lambda: _step(model, ids, c))
    grads_shared = [p.grad for p in model.parameters() if p.grad is not None]
    result["loss_rel_diff"] = ((loss_shared - loss_plain).abs() / loss_plain.abs()).item()
    # Relative to the largest gradient: some are 0 in exact arithmetic (a key projection's bias), noise here.
    scale = max(g.float().abs().max().item() for g in grads_plain)
    result["grad_rel_diff"] = (
        max((s.float() - p.float()).abs().max().item() for s, p in zip(grads_shared, grads_plain)) / scale
    )
    del grads_plain, grads_shared

    times: dict[str, list[float]] = {"plain": [], "shared": []}
    for i in range(warmup + iterations):
        for mode in ("plain", "shared"):

            def timed():
                clock.wait()
                start = clock.mark()
                _step(model, ids, c)
                end = clock.mark()
                clock.wait()
                return clock.ms(start, end)

            ms = _in_mode(model, mode == "shared", timed)
            if i >= warmup:
                times[mode].append(ms)
    for mode in ("plain", "shared"):
        result[f"{mode}_ms"] = statistics.median(times[mode])
        result[f"{mode}_ms_all"] = times[mode]
        result[f"{mode}_saved_mib"] = _in_mode(model, mode == "shared", lambda: _saved_bytes(model, ids, c)) / 2**20
        result[f"{mode}_peak_mib"] = (
            _in_mode(model, mode == "shared", lambda: _peak_bytes(model, ids, c, device)) / 2**20
        )
    model.zero_grad(set_to_none=True)
    result["speedup"] = result["plain_ms"] / result["shared_ms"]
    result["saved_ratio"] = result["shared_saved_mib"] / result["plain_saved_mib"]
    result["peak_ratio"] = result["shared_peak_mib"] / result["plain_peak_mib"]
    return result


def train_model(shape: str, device, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """A model of the named shape (random weights drawn with `seed`) in train mode with every dropout off."""
    model = build_model(shape, dtype=dtype, device=device, seed=seed).train()
    disable_dropout(model)
    return model


def format_table(rows: list[dict]) -> str:
    header = [
        "P",
        "C",
        "G",
        "B",
        "tokens plain/shared",
        "plain ms",
        "shared ms",
        "speedup",
        "saved MiB plain/shared",
        "saved ratio",
        "peak MiB plain/shared",
        "peak ratio",
        "grad rel diff",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    str(r["prompt_length"]),
                    str(r["completion_length"]),
                    str(r["group"]),
                    str(r["prompts"]),
                    f"{r['plain_tokens']}/{r['shared_tokens']}",
                    f"{r['plain_ms']:.0f}",
                    f"{r['shared_ms']:.0f}",
                    f"{r['speedup']:.2f}x",
                    f"{r['plain_saved_mib']:.0f}/{r['shared_saved_mib']:.0f}",
                    f"{r['saved_ratio']:.2f}",
                    f"{r['plain_peak_mib']:.0f}/{r['shared_peak_mib']:.0f}",
                    f"{r['peak_ratio']:.2f}",
                    f"{r['grad_rel_diff']:.1e}",
                ]
            )
            + " |"
        )
    return "\n".join(lines)
