"""Hugging Face `generate`'s contract on top of the rollout, for RL trainers that call `model.generate`.

    import torchkvops
    torchkvops.patch_generate(model)            # the one line a TRL user adds
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)

TRL's GRPOTrainer (without vLLM), verl's HF rollout and OpenRLHF call `model.generate` on left-padded
prompts in which each prompt already appears N times. `generate` finds runs of consecutive identical
rows (same ids and same mask), prefills each run's prompt once and decodes all its rows from one
expanded KV cache; rows that are equal but not adjacent are not merged. Runs of different lengths are
padded to the longest with filler rows that end at once, so one rollout decodes the whole batch.

The contract. Where a call is served, its output is HF's: greedy tokens equal HF's, sampled ones follow
the same distribution (from the rollout's counter-based sampler, seeded per call from torch's global
generator, so `torch.manual_seed` makes it reproducible; not HF's random stream). Every other call goes,
unchanged, to the model's own `generate`, with a warning naming the cause the first time it is seen;
nothing raises that HF's generate would not (the exceptions are clear errors for inputs that HF's
generate fails on too: ids outside the vocabulary, a mask of another shape). The decision is made
before any work, mostly by HF's own code: HF resolves the generation config
(`_prepare_generation_config`, whose validation raises what HF raises), the special tokens, the
attention mask when none is given (`_prepare_attention_mask_for_generation`), the length
(`_prepare_generated_length`: 20 new tokens by default) and the logits processors and stopping
criteria; a call is served when those are greedy or sampling with temperature, top-k, top-p, min
lengths, EOS and the length limit only, the prompts left-padded, and the model one the rollout
implements. Anything else (beams, repetition penalty, output_scores, extra model inputs, right padding,
a model with ALiBi or attention sinks, a forward that autocasts to another dtype than the weights', ...)
falls back.

State kept between calls (rollouts with their KV buffers and decode graphs) lives on the model object
itself, so `del model` frees it, and it is rebuilt when the model changes (attention implementation,
dtype, device, vocabulary: `hf.model_state`). Copies of a patched model (`copy.deepcopy`, pickle,
`torch.save`) are unpatched: their `generate` is the one the patch replaced.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
import numbers
import operator
import sys
import threading
import warnings
import weakref

import torch
from torch import Tensor, nn
from transformers import GenerationConfig
from transformers.generation import (
    EosTokenCriteria,
    GenerationMixin,
    LogitsProcessorList,
    MaxLengthCriteria,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import distributed
from .hf import ModelAdapter, is_peft_model, model_state, peft_refusal, unwrap_model
from .rollout import MIN_TEMPERATURE, NonFiniteLogitsError, Rollout, RolloutConfig, check_prompts

__all__ = ["generate", "patch_generate", "GeneratePatch", "PATCH_OPTIONS"]

# RolloutConfig fields that make sense per model (the rest come from each call's generation config).
PATCH_OPTIONS = ("compile", "cuda_graphs", "kv_sharing", "shared_prefill", "enable_profiling", "compact_finished_rows")
# HF's generate signature: calls are bound to it as HF binds them (same defaults, same TypeErrors).
_SIGNATURE = inspect.signature(GenerationMixin.generate)
# generate() arguments that select something the rollout does not do, whenever they are given.
_HF_ONLY_ARGUMENTS = ("prefix_allowed_tokens_fn", "assistant_model", "streamer", "negative_prompt_ids",
                      "negative_prompt_attention_mask", "custom_generate")
# Generation config fields honoured here (through HF's own resolution of them, below) ...
_HONOURED = {"max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k",
             "top_p", "eos_token_id", "pad_token_id", "num_return_sequences", "return_dict_in_generate"}
# ... those that cannot change a decoder-only model's greedy or sampled tokens here (beam-only ones are
# harmless since num_beams must be 1; assisted-only ones since no assistant is allowed) ...
_HARMLESS = {"bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config",
             "max_cache_len", "disable_compile", "compile_config", "prefill_chunk_size", "continuous_batching_config",
             "early_stopping", "length_penalty", "num_beam_groups", "diversity_penalty", "num_assistant_tokens",
             "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind",
             "target_lookbehind", "max_matching_ngram_size", "assistant_ensemble_weight", "speculation_type",
             "transformers_version"}
# ... those that only sampling reads (ignored by greedy decoding, as HF ignores them) ...
_SAMPLING_ONLY = {"min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff"}
# ... and on/off flags whose None and False both mean off. Every other field must equal HF's default.
_FLAGS = {"output_attentions", "output_hidden_states", "output_scores", "output_logits", "token_healing",
          "renormalize_logits", "remove_invalid_values", "use_mtp", "is_assistant", "low_memory"}
# Cache implementations whose output is not the exact computation's (or not generate's usual output).
_FALLBACK_CACHES = {"paged": "continuous batching, another output format", "quantized": "a lossy KV cache"}
_SESSION_ATTRIBUTE = "_torchkvops_generate_session"
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
    """A model's rollouts, reused across calls: one per distinct (samples per group, lengths, sampling,
    special ids), least recently used dropped first. Kept on the model (`_SESSION_ATTRIBUTE`), so that
    it lives exactly as long as the model; copies of the model get none."""

    def __init__(self, model: nn.Module, options: dict, original_generate=None):
        self.model_ref = weakref.ref(model)
        self.options = options
        # What calls fall back to: the generate a patch replaced; None: the model class's own.
        self.original_generate = original_generate
        self.rollouts: collections.OrderedDict[tuple, Rollout] = collections.OrderedDict()
        self.warned: set[str] = set()
        self.lock = threading.RLock()
        self.state: tuple | None = None  # hf.model_state when the rollouts were built
        self.adapter: ModelAdapter | None = None  # the model read in that state
        self.refusal: str | None = None  # why the rollout cannot run the model in that state (None: it can)
        self.proven = False  # a call was served in that state (until then a failure falls back)
        self.failed: dict[_Plan, str] = {}  # settings whose call failed in that state, and why

    def __reduce__(self):
        return (type(None), ())  # a copy of the model starts without a session

    def fallback(self, model: nn.Module):
        if self.original_generate is not None:
            return self.original_generate
        return type(model).generate.__get__(model)

    def check_model(self, model: nn.Module) -> str | None:
        """Why the rollout cannot run `model` as it is now, or None. Rebuilds the rollouts when the
        model changed since they were built (they read its dtype, attention implementation, ...)."""
        state = model_state(model)
        if state != self.state:
            self.release()
            self.state, self.proven = state, False
            self.failed.clear()
            try:
                self.adapter, self.refusal = ModelAdapter(model), None
            except (TypeError, ValueError) as e:
                self.adapter, self.refusal = None, f"this model ({str(e).removeprefix('torchkvops: ')})"
        return self.refusal

    def rollout(self, model: nn.Module, samples: int, plan: _Plan) -> Rollout:
        key = (samples, plan.max_new_tokens, plan.min_new_tokens, plan.temperature, plan.top_k, plan.top_p, plan.eos,
               plan.pad)
        rollout = self.rollouts.get(key)
        if rollout is None:
            options = dict(self.options)
            if _is_fsdp(model):  # a replayed graph would skip FSDP's hooks, which gather the weights each forward
                options["cuda_graphs"] = False
            config = RolloutConfig(samples_per_prompt=samples, max_new_tokens=plan.max_new_tokens,
                                   min_new_tokens=plan.min_new_tokens, temperature=plan.temperature,
                                   top_k=plan.top_k, top_p=plan.top_p, eos_token_id=list(plan.eos),
                                   pad_token_id=plan.pad, **options)
            rollout = self.rollouts[key] = Rollout(model, config)
            while len(self.rollouts) > _MAX_ROLLOUTS:
                self.rollouts.popitem(last=False)[1].release()
        self.rollouts.move_to_end(key)
        return rollout

    def release(self) -> None:
        with self.lock:
            for rollout in self.rollouts.values():
                rollout.release()
            self.rollouts.clear()

    def warn_once(self, reason: str, where: str = "torchkvops.generate", stacklevel: int = 4) -> None:
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(f"{where}: {reason} is not supported; this call (and every call with it) runs the "
                          "model's own generate", UserWarning, stacklevel=stacklevel)


def _is_fsdp(model: nn.Module) -> bool:
    """Whether FSDP (fully_shard, or the FullyShardedDataParallel wrapper) manages the model's weights."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # a torch built without distributed
        return False
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


_sessions_lock = threading.Lock()


def _session(model: nn.Module) -> _Session:
    session = vars(model).get(_SESSION_ATTRIBUTE)
    if session is not None and session.model_ref() is model:
        return session
    with _sessions_lock:
        session = vars(model).get(_SESSION_ATTRIBUTE)
        if session is None or session.model_ref() is not model:  # none yet, or a shallow copy's original's
            session = vars(model)[_SESSION_ATTRIBUTE] = _Session(model, {})
        return session


def _check_generative(model, where: str) -> None:
    """A bare backbone (LlamaModel) has no generate to serve or fall back to: the caller's mistake."""
    if not callable(getattr(type(model), "generate", None)):
        name = type(model).__name__
        raise TypeError(f"{where}: {name} has no generate method (a bare backbone without a language-model "
                        f"head?); use the causal LM that wraps it, e.g. {name.removesuffix('Model') or name}ForCausalLM")


def generate(model: nn.Module, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
             generation_config: GenerationConfig | None = None, **kwargs):
    """`model.generate(input_ids, attention_mask=..., generation_config=..., **kwargs)` for a decoder-only
    Hugging Face model, with runs of identical prompts prefilled once. Returns what HF's generate returns:
    `[rows, P + T]` token ids (the prompts as given, then the new tokens; rows that ended early are
    filled with the pad id), or with `return_dict_in_generate=True` a `GenerateDecoderOnlyOutput` whose
    `.sequences` is set and whose `.cache` is None (the rollout's KV buffers are reused by the next call;
    a call that needs HF's cache must go to `model.generate` unpatched). Calls the rollout cannot serve
    run the model's own generate (see the module docstring)."""
    _check_generative(model, "torchkvops.generate")
    args = () if input_ids is None else (input_ids,)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if generation_config is not None:
        kwargs["generation_config"] = generation_config
    session = _session(model)
    return _serve(session, model, args, kwargs, session.fallback(model))


def _serve(session: _Session, model: nn.Module, args: tuple, kwargs: dict, original):
    """One call with generate's arguments as the caller passed them: served by a rollout, or passed
    unchanged to `original` (the model's own generate) with a warning naming the cause. A PEFT model
    is served from the model its adapters are injected into (`hf.unwrap_model`)."""
    with session.lock:
        target = unwrap_model(model) if is_peft_model(model) else model
        call, synced = _prepare(session, target, args, kwargs)
        call = peft_refusal(model) or call
        if isinstance(call, _Call) and call.plan in session.failed:
            call = session.failed[call.plan]
        if synced:
            call = _agree(call)  # every process serves this call, or every process falls back
        if isinstance(call, _Call):
            try:
                sequences = _run(session, target, call)
                session.proven = True
            except (torch.OutOfMemoryError, NonFiniteLogitsError):
                raise
            except Exception as e:
                if session.proven or call.synced:  # (the other processes are in the rollout's collectives)
                    raise
                # A call failed inside the rollout before any call was served in this model state: the
                # model may do something the rollout does not implement. HF's generate takes this call,
                # and every later one with the same settings (until the model changes); calls with other
                # settings are still tried (one odd call must not cost every later one its speed).
                session.release()
                reason = f"this model (the rollout failed on it: {type(e).__name__}: {e})"
                session.failed[call.plan] = call = reason
    if isinstance(call, str):
        session.warn_once(call)
        return original(*args, **kwargs)
    return GenerateDecoderOnlyOutput(sequences=sequences) if call.plan.return_dict else sequences


@dataclasses.dataclass
class _Call:
    """A call the rollout serves: its plan, inputs, and whether every process must step together."""

    plan: "_Plan"
    input_ids: Tensor
    attention_mask: Tensor
    synced: bool


def _agree(call: "_Call | str") -> "_Call | str":
    """synced_gpus (FSDP or ZeRO-3 over several processes): every process must run as many forwards as
    the others, so either all serve the call, decoding as many steps, or all fall back to HF's generate
    (which steps them together itself). One collective per call; every process calls it, whatever it
    found locally."""
    if not distributed.initialized():
        return call if isinstance(call, str) else "synced_gpus=True without an initialized torch.distributed"
    served = isinstance(call, _Call)
    everyone, same_length = distributed.agree(served, call.plan.max_new_tokens if served else 0)
    if not served:
        return call
    if not everyone:
        return "synced_gpus=True with a call that another process's rollout cannot serve"
    if not same_length:
        return "synced_gpus=True with processes that generate different numbers of new tokens"
    return call


@dataclasses.dataclass
class _Arguments:
    """A call's arguments, bound as HF's generate binds them."""

    input_ids: Tensor
    attention_mask: Tensor | None
    generation_config: GenerationConfig | None
    tokenizer: object
    extra: dict  # the rest of **kwargs: generation settings (and model inputs, which fall back)
    synced: bool  # synced_gpus as HF resolves it: every process runs as many forwards as the others


def _prepare(session: _Session, model: nn.Module, args: tuple, kwargs: dict) -> tuple["_Call | str", bool]:
    """(the call the rollout serves, else the reason it does not; whether the processes generate in
    step: synced_gpus as HF resolves it). Checked in order: the arguments, the model and the call's
    context, the generation settings, the inputs."""
    arguments = _bind(model, args, kwargs)
    if isinstance(arguments, str):
        return arguments, False
    return _check(session, model, arguments), arguments.synced


def _check(session: _Session, model: nn.Module, arguments: "_Arguments") -> "_Call | str":
    reason = session.check_model(model) or _unsupported_context(model, session.adapter)
    if reason:
        return reason
    # From here on session.adapter describes the model as it is now (check_model rebuilt it if not).
    resolved = _resolve(model, session.adapter, arguments)
    if isinstance(resolved, str):
        return resolved
    config, ids, mask, processors, criteria = resolved
    reason = _unsupported_mask(mask)
    if reason:
        return reason
    plan = _plan(config, session.adapter, ids.shape[1], processors, criteria)
    if isinstance(plan, str):
        return plan
    try:  # the positions (and sliding window) the rollout's KV cache covers
        session.adapter.check_length(ids.shape[1], plan.max_new_tokens)
    except ValueError as e:
        return f"this length ({str(e).removeprefix('torchkvops: ')})"
    return _Call(plan, ids, mask, arguments.synced)


def _bind(model: nn.Module, args: tuple, kwargs: dict) -> _Arguments | str:
    """The call's arguments, or the first one that selects something the rollout does not do."""
    try:
        bound = _SIGNATURE.bind(model, *args, **kwargs)
    except TypeError as e:
        return f"a call that Hugging Face's generate refuses ({e})"
    arguments = bound.arguments
    extra = dict(arguments.get("kwargs", {}))
    given = [name for name in _HF_ONLY_ARGUMENTS if arguments.get(name) is not None]
    given += [name for name in ("logits_processor", "stopping_criteria") if arguments.get(name)]  # None or empty: none
    if given:
        return f"the argument {given[0]!r}"
    extra.pop("trust_remote_code", None)  # only read with custom_generate, refused above
    extra.pop("assistant_tokenizer", None)  # only read with an assistant model, refused above
    tokenizer = extra.pop("tokenizer", None)  # only read for stop_strings and token healing, which fall back
    # synced_gpus: as HF resolves it (True under DeepSpeed ZeRO-3 or FSDP with several processes).
    synced = bool(model._extract_generation_mode_kwargs(None, {}, arguments.get("synced_gpus"), None,
                                                        None)["synced_gpus"])
    input_ids = arguments.get("inputs")
    if input_ids is not None and "input_ids" in extra:
        return "both inputs and input_ids"
    if input_ids is None:
        input_ids = extra.pop("input_ids", None)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        return "input that is not a 2-D tensor of token ids (inputs_embeds, or no input_ids)"
    return _Arguments(input_ids, extra.pop("attention_mask", None), arguments.get("generation_config"), tokenizer, extra,
                      synced)


def _resolve(model: nn.Module, adapter: ModelAdapter, call: _Arguments):
    """What HF's generate would make of the call, by HF's own code: (generation config with special
    tokens and length set, ids, attention mask (inferred from the pad id when none is given), logits
    processors, stopping criteria); else the reason the rollout cannot do it."""
    # Whether no length was given anywhere, as HF's generate decides it before resolving the config.
    has_default = {name: call.extra.get(name) is None and getattr(call.generation_config, name, None) is None
                   and getattr(model.generation_config, name, None) is None for name in ("max_length", "min_length")}
    try:
        config, model_kwargs = model._prepare_generation_config(call.generation_config, **call.extra)
    except Exception as e:  # HF's validation: its generate raises the same
        return f"a generation config that Hugging Face's generate refuses ({type(e).__name__}: {e})"
    reason = _unsupported_setting(config)
    if reason:
        return reason
    model_kwargs = sorted(k for k, v in model_kwargs.items() if v is not None and k != "use_cache")
    if model_kwargs:
        return f"the model input {model_kwargs[0]!r}"

    input_ids = call.input_ids
    given = call.attention_mask
    if (isinstance(given, Tensor) and given.shape == input_ids.shape and not given.dtype.is_complex
            and not bool(((given == 0) | (given == 1)).all())):  # host sync: a mask check, once per call
        return ("an attention mask with values other than 0 and 1 (HF attends where it is not 0, and numbers "
                "positions by its cumulative sum)")
    ids, mask = check_prompts(input_ids, call.attention_mask, input_ids.device, adapter.input_vocab,
                              "torchkvops.generate", require_left_padding=False)
    batch, prompt_length = ids.shape
    try:
        model._prepare_special_tokens(config, call.attention_mask is not None, device=input_ids.device,
                                      batch_size=batch)
        if call.attention_mask is None and adapter.takes_attention_mask:
            mask = model._prepare_attention_mask_for_generation(input_ids, config, {}).to(ids.device, torch.long)
        config = model._prepare_generated_length(
            generation_config=config, has_default_max_length=has_default["max_length"],
            has_default_min_length=has_default["min_length"], model_input_name="input_ids",
            input_ids_length=prompt_length, inputs_tensor=input_ids)
        model._validate_generated_length(config, prompt_length, has_default["max_length"])
        processors = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=prompt_length, encoder_input_ids=input_ids,
            logits_processor=LogitsProcessorList(), device=input_ids.device, model_kwargs={"attention_mask": mask})
        criteria = model._get_stopping_criteria(generation_config=config, stopping_criteria=StoppingCriteriaList(),
                                                tokenizer=call.tokenizer)
    except Exception as e:  # HF's checks: its generate raises the same
        return f"settings that Hugging Face's generate refuses ({type(e).__name__}: {e})"
    return config, ids, mask, processors, criteria


def _unsupported_context(model: nn.Module, adapter: ModelAdapter) -> str | None:
    """What this call's context (rather than its arguments) does that the rollout's decode does not."""
    if type(model).generate is not GenerationMixin.generate:
        return f"{type(model).__name__}'s own generate method"
    autocast = _forward_autocast_dtype(model, adapter.device.type)
    weights = adapter.dtype
    if autocast is not None and autocast != weights:
        return (f"a forward that runs under autocast to {autocast} with {weights} parameters (its K and V then "
                f"come in mixed dtypes, the rollout's KV cache holds {weights}; load the model in {autocast}, or "
                "run without mixed precision)")
    if model.training and _attention_dropout(model) > 0:
        return ("a model in train mode with attention dropout (the rollout's decode attention applies none; "
                "call model.eval() or set the dropout to 0)")
    return None


def _same(value, default) -> bool:
    """Whether a config value is its default: None, False and 0 are three different values here."""
    if value is None or default is None:
        return value is default
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default) and value == default
    try:
        return bool(value == default)
    except Exception:  # tensors, or anything else without a plain equality
        return False


_DEFAULTS: dict | None = None


def _defaults() -> dict:
    """HF's global generation defaults, by field: what each field is when nobody set it."""
    global _DEFAULTS
    if _DEFAULTS is None:
        reference = GenerationConfig()
        reference.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
        _DEFAULTS = reference.to_dict()
    return _DEFAULTS


def _unsupported_setting(config: GenerationConfig) -> str | None:
    """The first generation setting that would change the output and that the rollout does not
    implement. Honoured fields are checked later, through the logits processors HF builds from them."""
    defaults = _defaults()
    sampled = config.get_generation_mode() == GenerationMode.SAMPLE
    for field, value in vars(config).items():
        if field not in defaults or field in _HONOURED or field in _HARMLESS or field.startswith("_"):
            continue  # unknown (custom) entries are not read by generate
        if field in _SAMPLING_ONLY and not sampled:
            continue
        if field in _FLAGS and (value is None or value is False):
            continue
        if field not in _FLAGS and _same(value, defaults[field]):
            continue
        return f"generation_config.{field}={value!r}"
    if config.cache_implementation in _FALLBACK_CACHES:
        return f"cache_implementation={config.cache_implementation!r} ({_FALLBACK_CACHES[config.cache_implementation]})"
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"the generation mode {mode.value!r}"
    return None


def _unsupported_mask(mask: Tensor) -> str | None:
    """The rollout takes left-padded rows with at least one token each (the layout of batched prompts)."""
    if not bool(mask.any(dim=1).all()):  # host sync: a mask check, once per call
        return "an attention mask with a row of zeros (a prompt without tokens)"
    if not bool(mask[:, -1].all()):
        return "an attention mask with a 0 in the last column (right padding)"
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        return "an attention mask with a 0 after a 1 (a hole; the rollout takes left padding only)"
    return None


def _plan(config: GenerationConfig, adapter: ModelAdapter, prompt_length: int, processors, criteria) -> _Plan | str:
    """The rollout's parameters from what HF built for this call, or why the rollout cannot do it."""
    sampled = config.get_generation_mode() == GenerationMode.SAMPLE
    temperature, top_k, top_p, min_new = 1.0, 0, 1.0, 0
    for processor in processors:
        if isinstance(processor, TemperatureLogitsWarper):
            temperature = processor.temperature
        elif isinstance(processor, TopKLogitsWarper):
            top_k = processor.top_k
        elif isinstance(processor, TopPLogitsWarper):
            top_p = processor.top_p
        elif isinstance(processor, MinLengthLogitsProcessor):
            min_new = max(min_new, processor.min_length - prompt_length)
        elif isinstance(processor, MinNewTokensLengthLogitsProcessor):
            min_new = max(min_new, processor.min_new_tokens)
        else:
            return f"the logits processor {type(processor).__name__}"
    for criterion in criteria:
        if not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)):
            return f"the stopping criterion {type(criterion).__name__}"
    if sampled and isinstance(top_k, bool):
        return f"top_k={top_k!r} (Hugging Face's top-k sampling raises on it)"
    if sampled and temperature < MIN_TEMPERATURE:
        return f"temperature={temperature!r} (below {MIN_TEMPERATURE:g}, the logits / temperature overflow)"
    if sampled and top_p <= 0:
        return f"top_p={top_p!r}"
    eos = config._eos_token_tensor
    if eos is not None and (eos.is_floating_point() or eos.is_complex()):
        return f"eos_token_id={config.eos_token_id!r} (not integers)"
    eos = () if eos is None else tuple(eos.flatten().tolist())  # host sync: a handful of ids, once per call
    vocab_out = adapter.output_vocab
    bad = [e for e in eos if e < 0 or (vocab_out is not None and e >= vocab_out)]
    if bad:
        return f"eos_token_id {bad[0]} (outside the model's {vocab_out} token ids)"
    pad = 0  # without EOS ids no row ever ends, and the pad id is never written
    if eos:
        pad_tensor = config._pad_token_tensor  # HF's: the pad id, else the first EOS id
        vocab_in = adapter.input_vocab
        # host sync: one id, once per call
        pad = pad_tensor.item() if pad_tensor.numel() == 1 and not pad_tensor.is_floating_point() else None
        if pad is None or pad < 0 or (vocab_in is not None and pad >= vocab_in):
            return f"pad_token_id={config.pad_token_id!r} (not one of the model's {vocab_in} token ids)"
    k = _whole(config.num_return_sequences)
    if k is None or k < 1:
        return f"num_return_sequences={config.num_return_sequences!r}"
    # HF's _prepare_generated_length set max_length; HF stops once the length reaches it, so a length of
    # another numeric type (4.0, np.int64(4), a 0-d tensor) means the next whole number of tokens.
    max_new = _tokens_until(config.max_length, prompt_length)
    min_new = _tokens_until(min_new + prompt_length, prompt_length) if min_new else 0
    if max_new is None or min_new is None:
        return f"max_length={config.max_length!r} or min_new_tokens (not numbers)"
    return _Plan(max_new_tokens=max_new, min_new_tokens=min(max(min_new, 0), max_new),
                 temperature=float(temperature) if sampled else 0.0, top_k=int(top_k) if sampled else 0,
                 top_p=min(float(top_p), 1.0) if sampled else 1.0, eos=eos, pad=int(pad), num_return_sequences=k,
                 return_dict=bool(config.return_dict_in_generate))


def _whole(value) -> int | None:
    """An integral count of any numeric type HF takes (int, numpy integer, integral float, 1-element
    tensor) as an int; None for anything else (bools included)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            return None
        value = value.item()  # host sync: one number, once per call
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return int(value) if math.isfinite(value) and float(value).is_integer() else None


def _tokens_until(length, prompt_length: int) -> int | None:
    """How many new tokens HF's `cur_len >= length` test lets through: ceil(length - prompt_length)."""
    if isinstance(length, Tensor) and length.numel() == 1 and not length.is_complex():
        length = length.item()  # host sync: one number, once per call
    if isinstance(length, bool) or not isinstance(length, numbers.Real) or not math.isfinite(length):
        return None
    return max(0, math.ceil(length - prompt_length))


def _forward_autocast_dtype(model: nn.Module, device_type: str) -> torch.dtype | None:
    """The dtype the model's forward autocasts to, or None: an autocast around this call, or the one
    accelerate's mixed precision (a Trainer with bf16=True or fp16=True, as TRL's GRPOTrainer defaults
    to) wraps `model.forward` in, marking the model with `_original_forward`. device_type: the model's."""
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


def _run(session: _Session, model: nn.Module, call: _Call) -> Tensor:
    plan, input_ids, attention_mask = call.plan, call.input_ids, call.attention_mask
    device = input_ids.device
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
    rollout = session.rollout(model, samples, plan)
    seed = int(torch.randint(0, 2**62, (1,)).item())  # from torch's global generator, as HF's sampling
    out = rollout._generate(input_ids[starts], attention_mask[starts], row_ids=row_ids, live=live, seed=seed,
                            ended_everywhere=distributed.ended_everywhere if call.synced else None)
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


class _PatchedGenerate:
    """What `patch_generate` puts in the model's `generate` (an instance attribute): HF's generate
    signature, served by the rollout. Undone, it passes every call to what it replaced. Pickled or
    deep-copied (with its model), it becomes the generate it replaced: copies are unpatched."""

    def __init__(self, model: nn.Module, session: _Session, replaced):
        self.__self__ = model  # as a bound method holds its instance
        self.session = session
        self.replaced = replaced  # the instance attribute it shadows; None: the class's generate
        self.active = True
        self.__doc__ = type(model).generate.__doc__
        self.__signature__ = _SIGNATURE.replace(parameters=list(_SIGNATURE.parameters.values())[1:])  # HF's, bound

    def original(self):
        model = self.__self__
        return self.replaced if self.replaced is not None else type(model).generate.__get__(model)

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.original()(*args, **kwargs)
        return _serve(self.session, self.__self__, args, kwargs, self.session.fallback(self.__self__))

    def __reduce__(self):
        replaced = _unwrap(self.replaced)
        if replaced is None:  # the copy's own class generate, bound to the copy
            return (getattr, (self.__self__, "generate"))
        return (operator.getitem, ([replaced], 0))


def _unwrap(replaced):
    """What a chain of undone patches stands for: the first thing in it that is not an undone patch."""
    while isinstance(replaced, _PatchedGenerate) and not replaced.active:
        replaced = replaced.replaced
    return replaced


class GeneratePatch:
    """What `patch_generate` returns: `undo()` (or leaving the `with` block) restores the generate this
    patch replaced; `release()` frees the rollout state (KV buffers, decode graphs) kept between calls.
    The handle holds the model weakly: `del model` frees the model, its patch and its state."""

    def __init__(self, model: nn.Module, patched: _PatchedGenerate):
        self._model_ref = weakref.ref(model)
        self._patched_ref = weakref.ref(patched)
        self._session_ref = weakref.ref(patched.session)
        self.active = True

    @property
    def session(self) -> _Session | None:
        return self._session_ref()

    def undo(self) -> None:
        """Put back the `generate` this patch replaced (what was set over the patch since, e.g. a
        wrapper around it, goes too), in whatever order handles are undone: the patch itself is switched
        off, so that anything still holding it (a later patch set over a wrapper of it) passes its calls
        through, and the one exception is a later torchkvops patch now in place, which stays until its
        own undo() puts back what it replaced."""
        if not self.active:
            return
        self.active = False
        model, patched = self._model_ref(), self._patched_ref()
        if model is None or patched is None:
            return
        patched.active = False
        current = vars(model).get("generate")
        if not (isinstance(current, _PatchedGenerate) and current.active):
            replaced = _unwrap(patched.replaced)
            if replaced is None:
                vars(model).pop("generate", None)
            else:
                model.generate = replaced
        patched.session.release()
        if vars(model).get(_SESSION_ATTRIBUTE) is patched.session:
            del vars(model)[_SESSION_ATTRIBUTE]

    def release(self) -> None:
        session = self.session
        if session is not None:
            session.release()

    def __enter__(self) -> "GeneratePatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def patch_generate(model: nn.Module, **options) -> GeneratePatch:
    """Make `model.generate` run through torchkvops (this instance only). `options` are rollout options
    that make sense per model: compile, cuda_graphs, kv_sharing, shared_prefill, enable_profiling,
    compact_finished_rows (validated as RolloutConfig validates them). Returns a handle: `handle.undo()` restores the
    original generate, `with patch_generate(model): ...` does so on leaving the block, and
    `handle.release()` frees the KV buffers and decode graphs kept between calls.

    A model the rollout cannot run (ALiBi, attention sinks, an attention implementation it does not
    take, ...) is patched all the same, with a warning now: its calls run its own generate."""
    unknown = sorted(set(options) - set(PATCH_OPTIONS))
    if unknown:
        raise TypeError(f"patch_generate: unknown option {unknown[0]!r}; the options are {', '.join(PATCH_OPTIONS)} "
                        "(the rest comes from each call's generation config)")
    RolloutConfig(**options)  # the same checks and messages
    _check_generative(model, "patch_generate")
    current = vars(model).get("generate")
    if isinstance(current, _PatchedGenerate) and current.active:
        raise RuntimeError("patch_generate: this model's generate is already patched by torchkvops; call undo() on "
                           "the handle that patch_generate returned (or leave its `with` block) before patching "
                           "again, or keep using that patch")
    session = _Session(model, dict(options))
    patched = _PatchedGenerate(model, session, current)
    session.original_generate = patched.original()
    previous = vars(model).get(_SESSION_ATTRIBUTE)
    if previous is not None:
        previous.release()
    vars(model)[_SESSION_ATTRIBUTE] = session
    model.generate = patched
    reason = peft_refusal(model) or session.check_model(unwrap_model(model) if is_peft_model(model) else model)
    if reason:
        session.warn_once(reason, where="torchkvops.patch_generate", stacklevel=3)
    return GeneratePatch(model, patched)
