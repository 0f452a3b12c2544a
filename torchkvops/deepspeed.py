"""torchkvops as a DeepSpeed rollout engine (`deepspeed.runtime.rollout`: DeepSpeed 0.19.8 has it, 0.19.0 not).

    rollout = TorchkvopsRollout(engine, tokenizer)            # where HybridEngineRollout(engine, tokenizer) was
    batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=256, n_samples_per_prompt=8))

DeepSpeed's trainer talks to its rollout engine through `RolloutEngine`: left-padded prompts in
(`RolloutRequest`), sampling settings per call (`SamplingConfig`), prompt + right-padded response out
(`RolloutBatch`, with `response_start_idx`), `sync_weights`, and `get_last_profile()`. `TorchkvopsRollout`
is one, with `HybridEngineRollout`'s signature: `engine` a DeepSpeed engine (its `.module` generates) or a
plain model. Each call takes the path `torchkvops.generate` takes (`hf.generate_patch`: a session kept on
the model, its `_serve`) on the prompts repeated `n_samples_per_prompt` times, as
`HybridEngineRollout` repeats them: each prompt is prefilled once and its KV shared by its samples; under
ZeRO-3 the weights are gathered once per call, and a PEFT model's LoRA merged for it
(`torchkvops.hf.sharded`, `torchkvops.models.lora`).

What a caller gets, against `HybridEngineRollout.generate`'s (HF's generate on the repeated prompts with
`eos_token_id=None`, then every token after a response's first `tokenizer.eos_token_id` padded):
- rows `[B * n]`, each prompt's n samples adjacent; the prompt as given, then its response;
  `response_start_idx` the prompt width for every row; `attention_mask` the prompt's mask, then 1 for each
  response token up to and including its first EOS; greedy tokens (temperature 0) the same.
- responses end at the tokenizer's EOS, so decode stops when every row has ended and the batch is
  right-padded to the longest response (as DeepSpeed's continuous-batching path returns it), not to
  `max_new_tokens`. `run_to_budget=True` restores HybridEngineRollout's shape and run: every row decodes
  `max_new_tokens` tokens, EOS applied afterwards (DeepSpeed does so that ZeRO-3 ranks gather in step;
  torchkvops gathers once per call and checks for the end on every rank, so it is not needed for that).
- `continuous_batch_size`: the most rows decoded at once (`RolloutConfig.max_rows`): a larger batch is
  streamed, prompts admitted as others' rows end (any temperature, any n; DeepSpeed's takes greedy, n=1).
- `get_last_profile()`: DeepSpeed's profile keys (`prompt_expansion_ms`, `generation_ms`,
  `prefill_forward_ms`, `decode_forward_ms`, `generation_overhead_ms`, `num_decode_forwards`,
  `post_processing_ms`, `total_ms`, `num_generated_tokens` (rows x response columns, DeepSpeed's count),
  `tokens_per_second`, `batch_size`, `num_samples_per_prompt`, `prompt_length`, `response_length`) with
  `enable_profiling`, plus `num_response_tokens` (through each first EOS) and `kv_cache_bytes`.

Importing this module needs no DeepSpeed; making a `TorchkvopsRollout` does.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import Tensor, nn

from .hf.call_weights import WeightOptions
from .rollout.layouts import LAYOUTS

__all__ = ["TorchkvopsRollout", "TorchkvopsRolloutConfig", "pad_after_eos"]


@dataclasses.dataclass
class TorchkvopsRolloutConfig:
    """What `TorchkvopsRollout` is asked to do besides each call's `SamplingConfig`. An object of
    DeepSpeed's own config classes works too: the fields it has are read (`enable_profiling`, and
    `use_graph_capture` as `cuda_graphs`), the rest keep these defaults."""

    enable_profiling: bool = False  # get_last_profile() returns the last call's figures (else None)
    run_to_budget: bool = False  # every row decodes max_new_tokens tokens, EOS applied after (HybridEngineRollout's)
    kv_sharing: str | None = None  # RolloutConfig.kv_sharing: "copy", "prefix" or "paged" (None: its default)
    compile: bool = False  # torch.compile the rollout's prefill and decode
    cuda_graphs: bool = True  # on CUDA, replay decode steps from CUDA graphs
    gather_weights: str = "auto"  # a ZeRO-3 model's weights: "auto", "once" or "per_step" (hf.sharded)
    gather_budget_bytes: int | None = None
    merge_lora: bool = True  # a PEFT model's LoRA merged into the weights for each call, restored after

    def __post_init__(self):
        for flag in ("enable_profiling", "run_to_budget", "compile", "cuda_graphs", "merge_lora"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"TorchkvopsRolloutConfig.{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.kv_sharing is not None and self.kv_sharing not in LAYOUTS:
            raise ValueError(
                f"TorchkvopsRolloutConfig.kv_sharing must be None or one of {', '.join(map(repr, LAYOUTS))}, "
                f"got {self.kv_sharing!r}"
            )
        WeightOptions(self.gather_weights, self.gather_budget_bytes, self.merge_lora).check("TorchkvopsRolloutConfig")

    @classmethod
    def of(cls, cfg) -> TorchkvopsRolloutConfig:
        """`cfg` itself, or one made from the fields another config object has (None: the defaults)."""
        if cfg is None or isinstance(cfg, cls):
            return cfg or cls()
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)}
        if hasattr(cfg, "use_graph_capture") and "cuda_graphs" not in fields:
            fields["cuda_graphs"] = bool(cfg.use_graph_capture)
        return cls(**fields)


def pad_after_eos(responses: Tensor, eos_token_id, pad_token_id: int) -> tuple[Tensor, Tensor]:
    """DeepSpeed's post-processing of responses ([rows, R]): each row's first EOS kept and every token after
    it set to the pad id; the mask 1 on each token that is not the pad id, and on the first EOS (a valid
    token even when it is the pad id), 0 after it. Returns (responses, mask as int64)."""
    valid = responses != pad_token_id
    if eos_token_id is None or responses.shape[1] == 0:
        return responses, valid.long()
    eos = torch.as_tensor(eos_token_id, device=responses.device, dtype=responses.dtype).flatten()
    is_eos = torch.isin(responses, eos)
    has_eos = is_eos.any(dim=1, keepdim=True)
    first = is_eos.long().argmax(dim=1, keepdim=True)
    column = torch.arange(responses.shape[1], device=responses.device)[None, :]
    after, at = has_eos & (column > first), has_eos & (column == first)
    return responses.masked_fill(after, pad_token_id), ((valid | at) & ~after).long()


class TorchkvopsRollout:
    """A DeepSpeed `RolloutEngine` served by torchkvops (module docstring). `engine`: a DeepSpeed engine or
    a Hugging Face causal LM (a PEFT model too); `tokenizer`: its `pad_token_id` (else `eos_token_id`) pads,
    its `eos_token_id` ends responses; `cfg`: a `TorchkvopsRolloutConfig` (or a DeepSpeed rollout config)."""

    name = "torchkvops"

    def __init__(self, engine, tokenizer, cfg=None):
        try:
            from deepspeed.runtime.rollout import RolloutEngine
        except ImportError as e:
            raise ImportError(
                "torchkvops.deepspeed.TorchkvopsRollout needs DeepSpeed's rollout interface, deepspeed.runtime.rollout "
                f"(DeepSpeed 0.19.8 has it, 0.19.0 has not): pip install -U deepspeed ({e})"
            ) from None
        RolloutEngine.register(TorchkvopsRollout)  # isinstance(rollout, RolloutEngine) for DeepSpeed's trainer
        self.engine, self.tokenizer = engine, tokenizer
        self.cfg = TorchkvopsRolloutConfig.of(cfg)
        if getattr(tokenizer, "pad_token_id", None) is None and getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("TorchkvopsRollout: the tokenizer must define pad_token_id or eos_token_id")
        self._session = None  # the model's rollouts, built at the first call (hf.generate_patch)
        self._last_profile: dict | None = None

    @property
    def module(self) -> nn.Module:
        """The model that generates: a DeepSpeed engine's `.module`, or the model given."""
        inner = getattr(self.engine, "module", None)
        return inner if isinstance(inner, nn.Module) else self.engine

    def _session_for(self, module: nn.Module):
        from .hf.generate_patch import _Session

        if self._session is None or self._session.model_ref() is not module:
            c = self.cfg
            options = dict(
                kv_sharing=c.kv_sharing,
                compile=c.compile,
                cuda_graphs=c.cuda_graphs,
                enable_profiling=True,
                reuse_kv=False,
            )
            options.update(
                gather_weights=c.gather_weights, gather_budget_bytes=c.gather_budget_bytes, merge_lora=c.merge_lora
            )
            self._session = _Session(module, options)
        return self._session

    @torch.no_grad()
    def generate(self, request, sampling):
        """DeepSpeed's `RolloutEngine.generate`: a `RolloutBatch` of `request`'s prompts, each followed by
        `sampling.n_samples_per_prompt` responses (module docstring)."""
        from deepspeed.runtime.rollout import RolloutBatch

        n, max_rows = _check_sampling(sampling)
        sync = _synchronizer(request.prompt_ids.device)
        start = sync()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        eos = self.tokenizer.eos_token_id
        prompt_ids = request.prompt_ids.repeat_interleave(n, dim=0)
        prompt_mask = request.prompt_attention_mask.repeat_interleave(n, dim=0)
        expanded = sync()
        greedy = sampling.temperature <= 0.0
        kwargs = dict(
            attention_mask=prompt_mask,
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            pad_token_id=pad,
            eos_token_id=None if self.cfg.run_to_budget or eos is None else [eos],  # (None: none, as HF reads it)
        )
        if not greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0))
        from .hf.generate_patch import _serve

        module = self.module
        session = self._session_for(module)
        weights = WeightOptions(self.cfg.gather_weights, self.cfg.gather_budget_bytes, self.cfg.merge_lora)
        limits = dict(max_rows=max_rows)
        output = _serve(session, module, (prompt_ids,), kwargs, session.fallback(module), limits, weights)
        generated = sync()
        prompt_len = prompt_ids.shape[1]
        responses, response_mask = pad_after_eos(output[:, prompt_len:], eos, pad)
        input_ids = torch.cat([prompt_ids, responses], dim=1)
        attention_mask = torch.cat([prompt_mask.to(response_mask.dtype), response_mask], dim=1)
        batch = RolloutBatch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_start_idx=torch.full((input_ids.shape[0],), prompt_len, dtype=torch.long, device=input_ids.device),
        )
        if self.cfg.enable_profiling:
            ms = {"expansion": expanded - start, "generation": generated - expanded, "total": sync() - start}
            self._last_profile = _deepspeed_profile(session.last_profile, ms, request, n, responses, response_mask)
        return batch

    def sync_weights(self, step: int) -> None:  # noqa: ARG002
        """Nothing to push: each call reads the model's weights as they are (a ZeRO-3 model's gathered for
        the call, a PEFT model's LoRA merged for it), and no KV is kept from one call to the next."""
        return None

    def get_last_profile(self) -> dict | None:
        """The last call's figures under DeepSpeed's keys (module docstring); None without `enable_profiling`."""
        return self._last_profile

    def shutdown(self) -> None:
        """Free the KV buffers and decode graphs kept between calls."""
        if self._session is not None:
            self._session.release()
        self._session = None


def _check_sampling(sampling) -> tuple[int, int | None]:
    """(n_samples_per_prompt, the row budget continuous_batch_size sets, None: none), checked."""
    n = sampling.n_samples_per_prompt
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"SamplingConfig.n_samples_per_prompt must be an int >= 1, got {n!r}")
    m = sampling.max_new_tokens
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"SamplingConfig.max_new_tokens must be an int >= 1, got {m!r}")
    rows = sampling.continuous_batch_size
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < n):
        raise ValueError(
            f"SamplingConfig.continuous_batch_size must be None or an int >= n_samples_per_prompt={n} (a prompt's "
            f"samples decode together), got {rows!r}"
        )
    return n, rows


def _synchronizer(device: torch.device):
    """A clock read after the device's work is done (CUDA), as DeepSpeed's profile reads it."""

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def _deepspeed_profile(profile, seconds: dict, request, n: int, responses: Tensor, response_mask: Tensor) -> dict:
    """HybridEngineRollout's profile keys, from the call's own clock and the rollout's stages (`profile`,
    a RolloutProfile; None where the call fell back to HF's generate: the stage fields are None then)."""
    total_ms = seconds["total"] * 1e3
    generation_ms = seconds["generation"] * 1e3
    rows, width = responses.shape
    figures = {
        "prompt_expansion_ms": seconds["expansion"] * 1e3 + (profile.prompt_expansion_ms if profile else 0.0),
        "generation_ms": generation_ms,
        "prefill_forward_ms": profile.prefill_ms if profile else None,
        "decode_forward_ms": profile.decode_ms if profile else None,
        "generation_overhead_ms": max(0.0, generation_ms - profile.prefill_ms - profile.decode_ms)
        if profile
        else generation_ms,
        "num_decode_forwards": profile.decode_steps if profile else 0,
        "post_processing_ms": total_ms - generation_ms - seconds["expansion"] * 1e3,
        "total_ms": total_ms,
        "num_generated_tokens": rows * width,
        "tokens_per_second": rows * width / (total_ms / 1e3) if total_ms > 0 else 0.0,
        "batch_size": request.prompt_ids.shape[0],
        "num_samples_per_prompt": n,
        "prompt_length": request.prompt_ids.shape[1],
        "response_length": width,
        "num_response_tokens": int(response_mask.sum()),  # host sync: the profile's count, once per call
        "kv_cache_bytes": profile.kv_cache_bytes if profile else None,
    }
    return figures
