"""Hugging Face `generate`'s contract on top of the rollout, for RL trainers that call `model.generate`.

    import torchkvops
    torchkvops.patch_generate(model)            # the one line a TRL user adds
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)

TRL's GRPOTrainer (without vLLM), verl's HF rollout and OpenRLHF call `model.generate` on left-padded
prompts in which each prompt already appears N times. `generate` finds runs of consecutive identical
rows (same ids and same mask), prefills each run's prompt once and decodes all its rows from one
expanded KV cache; rows that are equal but not adjacent are not merged. Runs of different lengths are
padded to the longest with filler rows that end at once, so one rollout decodes the whole batch.

Generation parameters are resolved as HF resolves them (keyword arguments over `generation_config` over
the model's `generation_config` over HF's global defaults), with HF's own `_prepare_generation_config`.
Honoured: max_new_tokens / max_length, min_new_tokens / min_length, do_sample, temperature, top_k,
top_p, eos_token_id (int or list), pad_token_id, num_return_sequences, return_dict_in_generate.
Anything else that would change the output (beam search, repetition penalty, logits processors,
stopping criteria, streamers, output_scores, extra model inputs, a forward that autocasts to another
dtype than the weights', ...) goes to the model's own `generate`, with a warning the first time each
cause is seen.

Sampling uses the rollout's counter-based sampler, seeded per call from torch's global generator (so
`torch.manual_seed` makes it reproducible, as it does HF's). Greedy tokens equal HF's; sampled ones
follow the same distribution but not the same random stream.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import threading
import warnings
import weakref

import torch
from torch import Tensor, nn
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .hf import input_vocab
from .rollout import Rollout, RolloutConfig, check_prompts

__all__ = ["generate", "patch_generate", "GeneratePatch", "PATCH_OPTIONS"]

# RolloutConfig fields that make sense per model (the rest come from each call's generation config).
PATCH_OPTIONS = ("compile", "cuda_graphs", "kv_sharing", "shared_prefill", "enable_profiling")
# generate() arguments besides the generation config: any of them set means HF's own generate.
_HF_ONLY_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
                      "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
                      "custom_generate")
# Generation config fields that we honour, or that cannot change a decoder-only model's sampled tokens.
_HONOURED = {"max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k",
             "top_p", "eos_token_id", "pad_token_id", "num_return_sequences", "return_dict_in_generate"}
_HARMLESS = {"bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config",
             "disable_compile", "compile_config", "prefill_chunk_size", "return_legacy_cache", "early_stopping",
             "length_penalty", "transformers_version", "_from_model_config", "_commit_hash",
             "_original_object_hash", "num_assistant_tokens", "num_assistant_tokens_schedule",
             "assistant_confidence_threshold", "assistant_early_exit", "assistant_lookbehind",
             "target_lookbehind", "is_assistant", "generation_kwargs", "use_model_defaults"}
# How many rollouts (one per distinct sampling setup) a model keeps between calls.
_MAX_ROLLOUTS = 4


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One call's generation parameters, resolved."""

    max_new_tokens: int
    min_new_tokens: int
    temperature: float  # 0: greedy
    top_k: int
    top_p: float
    eos: tuple[int, ...]
    pad: int
    num_return_sequences: int
    return_dict: bool


class _Session:
    """A model's rollouts, reused across calls: one per distinct (samples per group, lengths,
    sampling, special ids), least recently used dropped first."""

    def __init__(self, model: nn.Module, options: dict, original_generate):
        self.model_ref = weakref.ref(model)
        self.options = options
        self.original_generate = original_generate
        self.rollouts: collections.OrderedDict[tuple, Rollout] = collections.OrderedDict()
        self.warned: set[str] = set()
        self.lock = threading.Lock()

    def rollout(self, samples: int, plan: _Plan) -> Rollout:
        key = (samples, plan.max_new_tokens, plan.min_new_tokens, plan.temperature, plan.top_k, plan.top_p, plan.eos,
               plan.pad)
        with self.lock:
            rollout = self.rollouts.get(key)
            if rollout is None:
                config = RolloutConfig(samples_per_prompt=samples, max_new_tokens=plan.max_new_tokens,
                                       min_new_tokens=plan.min_new_tokens, temperature=plan.temperature,
                                       top_k=plan.top_k, top_p=plan.top_p, eos_token_id=list(plan.eos),
                                       pad_token_id=plan.pad, **self.options)
                rollout = self.rollouts[key] = Rollout(self.model_ref(), config)
                while len(self.rollouts) > _MAX_ROLLOUTS:
                    self.rollouts.popitem(last=False)[1].release()
            self.rollouts.move_to_end(key)
            return rollout

    def release(self) -> None:
        with self.lock:
            for rollout in self.rollouts.values():
                rollout.release()
            self.rollouts.clear()

    def warn_once(self, reason: str) -> None:
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(f"torchkvops.generate: {reason} is not supported; this call (and every call with it) "
                          "runs the model's own generate", UserWarning, stacklevel=4)


_sessions: weakref.WeakKeyDictionary[nn.Module, _Session] = weakref.WeakKeyDictionary()
_sessions_lock = threading.Lock()


def _session(model: nn.Module) -> _Session:
    with _sessions_lock:
        session = _sessions.get(model)
        if session is None:
            session = _sessions[model] = _Session(model, {}, None)
        return session


def generate(model: nn.Module, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
             generation_config: GenerationConfig | None = None, **kwargs):
    """`model.generate(input_ids, attention_mask=..., generation_config=..., **kwargs)` for a decoder-only
    Hugging Face model, with runs of identical prompts prefilled once. Returns `[rows, P + T]` token ids
    (the prompts as given, then the new tokens; rows that ended early are filled with the pad id), or
    with `return_dict_in_generate=True` a `GenerateDecoderOnlyOutput` with `.sequences`."""
    if input_ids is None:
        input_ids = kwargs.pop("inputs", None)
    return _generate(_session(model), model, input_ids, attention_mask, generation_config, kwargs)


def _generate(session: _Session, model: nn.Module, input_ids, attention_mask, generation_config, kwargs):
    def fall_back(reason: str):
        session.warn_once(reason)
        original = session.original_generate or model.generate
        return original(input_ids, attention_mask=attention_mask, generation_config=generation_config, **kwargs)

    hf_only = [name for name in _HF_ONLY_ARGUMENTS if kwargs.get(name) is not None]
    if hf_only:
        return fall_back(f"the argument {hf_only[0]!r}")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        return fall_back("input that is not a 2-D tensor of token ids (inputs_embeds, or no input_ids)")
    gen_kwargs = {k: v for k, v in kwargs.items() if k not in _HF_ONLY_ARGUMENTS}
    config, model_kwargs = model._prepare_generation_config(generation_config, **gen_kwargs)
    model_kwargs.pop("use_cache", None)
    if model_kwargs:
        return fall_back(f"the model input {sorted(model_kwargs)[0]!r}")
    reason = _unsupported(config, model)
    if reason:
        return fall_back(reason)
    plan = _plan(config, model, input_ids.shape[1])
    if isinstance(plan, str):
        return fall_back(plan)
    sequences = _run(session, plan, input_ids, attention_mask)
    return GenerateDecoderOnlyOutput(sequences=sequences) if plan.return_dict else sequences


def _unsupported(config: GenerationConfig, model: nn.Module) -> str | None:
    """The first generation setting that would change the output and that we do not implement."""
    reference = GenerationConfig()
    reference.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    defaults = reference.to_dict()
    for field, value in config.to_dict().items():
        if field in _HONOURED or field in _HARMLESS:
            continue
        if value != defaults.get(field) and value not in (None, False):
            return f"generation_config.{field}={value!r}"
    if not config.do_sample and (config.num_return_sequences or 1) > 1:
        return "num_return_sequences > 1 with greedy decoding (HF refuses it too)"
    autocast = _forward_autocast_dtype(model)
    weights = next(model.parameters()).dtype
    if autocast is not None and autocast != weights:
        return (f"a forward that runs under autocast to {autocast} with {weights} parameters (its K and V then "
                f"come in mixed dtypes, the rollout's KV cache holds {weights}; load the model in {autocast}, or "
                "run without mixed precision)")
    if model.training and _attention_dropout(model) > 0:
        return ("a model in train mode with attention dropout (the rollout's decode attention applies none; "
                "call model.eval() or set the dropout to 0)")
    return None


def _forward_autocast_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype the model's forward autocasts to, or None: an autocast around this call, or the one
    accelerate's mixed precision (a Trainer with bf16=True or fp16=True, as TRL's GRPOTrainer defaults
    to) wraps `model.forward` in, marking the model with `_original_forward`."""
    device_type = next(model.parameters()).device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if vars(model).get("_original_forward") is not None:
        state = sys.modules.get("accelerate.state")
        mixed = state.AcceleratorState._shared_state.get("_mixed_precision") if state is not None else None
        return torch.float16 if mixed == "fp16" else torch.bfloat16  # accelerate's bf16 and fp8 autocast to bf16
    return None


def _attention_dropout(model: nn.Module) -> float:
    """The largest dropout on attention probabilities that the model's attention layers apply in train
    mode, read from the layers themselves (an nn.Dropout's p, as GPT-2's, or the float that Llama- and
    OPT-style layers pass as `dropout`), so that TRL's disable_dropout (p = 0) is seen."""
    most = 0.0
    for module in model.modules():
        is_attention = hasattr(module, "layer_idx") and any(
            hasattr(module, proj) for proj in ("q_proj", "c_attn", "qkv_proj", "query_key_value", "Wqkv"))
        if not is_attention:
            continue
        for name in ("attn_dropout", "attention_dropout", "dropout"):
            value = getattr(module, name, None)
            p = value.p if isinstance(value, nn.Dropout) else value if isinstance(value, (int, float)) else None
            if p is not None:
                most = max(most, float(p))
                break
    return most


def _plan(config: GenerationConfig, model: nn.Module, prompt_length: int) -> _Plan | str:
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    else:
        max_new = (config.max_length or 0) - prompt_length
    if max_new < 1:
        return f"max_new_tokens={max_new} (max_length={config.max_length} with a prompt of {prompt_length} tokens)"
    min_new = config.min_new_tokens if config.min_new_tokens is not None else max(0, (config.min_length or 0) - prompt_length)
    eos = config.eos_token_id
    eos = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
    pad = config.pad_token_id
    if pad is None:  # HF uses the first EOS id (and warns); with neither, nothing is ever padded
        pad = eos[0] if eos else 0
    sampled = bool(config.do_sample)
    return _Plan(max_new_tokens=max_new, min_new_tokens=min(min_new, max_new),
                 temperature=float(config.temperature) if sampled else 0.0,
                 top_k=int(config.top_k or 0) if sampled else 0,
                 top_p=float(config.top_p if config.top_p is not None else 1.0) if sampled else 1.0,
                 eos=eos, pad=int(pad), num_return_sequences=int(config.num_return_sequences or 1),
                 return_dict=bool(config.return_dict_in_generate))


def _run(session: _Session, plan: _Plan, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    device = input_ids.device
    input_ids, attention_mask = check_prompts(input_ids, attention_mask, device, input_vocab(session.model_ref()),
                                              "torchkvops.generate")
    k = plan.num_return_sequences
    # Runs of consecutive identical rows (ids and mask): each becomes one prompt of `count` rows.
    same = (input_ids[1:] == input_ids[:-1]).all(dim=1) & (attention_mask[1:] == attention_mask[:-1]).all(dim=1)
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=device), ~same]).nonzero().flatten()
    counts = torch.diff(starts, append=torch.tensor([input_ids.shape[0]], device=device)) * k
    counts_list = counts.tolist()  # host sync: the grouping, once per call
    samples = max(counts_list)
    # Output row r (input row r // k, copy r % k) lives at (prompt u, slot j); filler slots are dead.
    slot = torch.arange(samples, device=device)
    live = (slot[None, :] < counts[:, None]).flatten()  # [groups * samples]
    first_out_row = torch.cumsum(counts, 0) - counts  # output row of each prompt's slot 0
    row_ids = (first_out_row[:, None] + slot[None, :]).flatten()
    rollout = session.rollout(samples, plan)
    seed = int(torch.randint(0, 2**62, (1,)).item())  # from torch's global generator, as HF's sampling
    out = rollout._generate(input_ids[starts], attention_mask[starts], row_ids=row_ids, live=live, seed=seed)
    responses = out.responses[live.to(out.responses.device)]  # [rows, R], in output order
    responses = _trim_to_hf_length(responses, plan)
    return torch.cat([input_ids.repeat_interleave(k, dim=0), responses.to(device)], dim=1)


def _trim_to_hf_length(responses: Tensor, plan: _Plan) -> Tensor:
    """HF stops as soon as every row has ended: drop the columns decoded after that (the rollout checks
    only every few steps), which hold nothing but the pad id."""
    if not plan.eos:
        return responses
    is_eos = torch.isin(responses, torch.tensor(plan.eos, device=responses.device))
    ended = is_eos.any(dim=1)
    if not bool(ended.all()):  # host sync: the output's length
        return responses
    length = int(is_eos.int().argmax(dim=1).max()) + 1
    return responses[:, :length]


class GeneratePatch:
    """What `patch_generate` returns: `undo()` (or leaving the `with` block) restores the model's
    own generate; `release()` frees the rollout state (KV buffers, decode graphs) kept between calls."""

    def __init__(self, model: nn.Module, options: dict):
        self._model_ref = weakref.ref(model)
        self._had_instance_attr = "generate" in vars(model)
        self._previous = vars(model).get("generate")
        self.session = _Session(model, options, model.generate)
        with _sessions_lock:
            _sessions[model] = self.session
        patched = functools.partial(_patched_generate, self.session, self._model_ref)
        functools.update_wrapper(patched, generate)
        model.generate = patched
        self.active = True

    def undo(self) -> None:
        model = self._model_ref()
        if not self.active or model is None:
            return
        if self._had_instance_attr:
            model.generate = self._previous
        else:
            del model.generate
        with _sessions_lock:
            if _sessions.get(model) is self.session:
                del _sessions[model]
        self.release()
        self.active = False

    def release(self) -> None:
        self.session.release()

    def __enter__(self) -> "GeneratePatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def _patched_generate(session: _Session, model_ref, inputs: Tensor | None = None,
                      generation_config: GenerationConfig | None = None, **kwargs):
    model = model_ref()
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    attention_mask = kwargs.pop("attention_mask", None)
    return _generate(session, model, input_ids, attention_mask, generation_config, kwargs)


def patch_generate(model: nn.Module, **options) -> GeneratePatch:
    """Make `model.generate` run through torchkvops (this instance only). `options` are rollout options
    that make sense per model: compile, cuda_graphs, kv_sharing, shared_prefill, enable_profiling
    (validated as RolloutConfig validates them). Returns a handle: `handle.undo()` restores the
    original generate, `with patch_generate(model): ...` does so on leaving the block, and
    `handle.release()` frees the KV buffers and decode graphs kept between calls."""
    unknown = sorted(set(options) - set(PATCH_OPTIONS))
    if unknown:
        raise TypeError(f"patch_generate: unknown option {unknown[0]!r}; the options are {', '.join(PATCH_OPTIONS)} "
                        "(the rest comes from each call's generation config)")
    RolloutConfig(**options)  # the same checks and messages
    Rollout(model, RolloutConfig(**options))  # refuses models it cannot run, now rather than at the first call
    if "generate" in vars(model) and isinstance(model.generate, functools.partial) \
            and model.generate.func is _patched_generate:
        raise RuntimeError("patch_generate: this model's generate is already patched; undo() that handle first")
    return GeneratePatch(model, dict(options))
