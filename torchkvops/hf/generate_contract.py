"""Hugging Face `generate`'s contract, for `torchkvops.generate` (generate_patch.py): what HF's generate
would make of a call, decided by HF's own code, as a plan the rollout serves or a `Refusal` (the call
then runs the model's own generate); and, for a served call, HF's output from the rollout's.

    arguments, synced = bind(model, args, kwargs)       # Arguments | Refusal, HF's synced_gpus
    call = check(model, adapter, arguments)             # Call | Refusal
    call, settled = agree(call, synced, sharded, vote)  # several processes: every one decides alike
    sequences = run(call, rollout_for)                  # [rows, P + T], HF's layout and length

Nothing here keeps state between calls: the rollouts, the model check and the patch's lifecycle are
generate_patch.py's.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import operator
from collections.abc import Callable
from typing import Literal

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

from .. import collectives
from ..models.adapter import ModelAdapter
from ..models.forward_modes import attention_dropout, forward_autocast_dtype
from ..rollout import MIN_TEMPERATURE, Rollout, check_prompts
from ..utils import check_has_values, left_padding_fault
from .sharded import NEUTRAL_VOTE, GatherVote, Settled, settle

# HF's generate signature: calls are bound to it as HF binds them (same defaults, same TypeErrors).
SIGNATURE = inspect.signature(GenerationMixin.generate)
# generate() arguments that select something the rollout does not do, whenever they are given.
_HF_ONLY_ARGUMENTS = (
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
)
# Generation config fields honoured here (through HF's own resolution of them, below) ...
_HONOURED = {
    "max_new_tokens",
    "max_length",
    "min_new_tokens",
    "min_length",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "eos_token_id",
    "pad_token_id",
    "num_return_sequences",
    "return_dict_in_generate",
}
# ... those that cannot change a decoder-only model's greedy or sampled tokens here (beam-only ones are
# harmless since num_beams must be 1; assisted-only ones since no assistant is allowed) ...
_HARMLESS = {
    "bos_token_id",
    "decoder_start_token_id",
    "use_cache",
    "cache_implementation",
    "cache_config",
    "max_cache_len",
    "disable_compile",
    "compile_config",
    "prefill_chunk_size",
    "continuous_batching_config",
    "early_stopping",
    "length_penalty",
    "num_beam_groups",
    "diversity_penalty",
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
    "assistant_lookbehind",
    "target_lookbehind",
    "max_matching_ngram_size",
    "assistant_ensemble_weight",
    "speculation_type",
    "transformers_version",
}
# ... those that only sampling reads (ignored by greedy decoding, as HF ignores them) ...
_SAMPLING_ONLY = {"min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff"}
# ... and on/off flags whose None and False both mean off. Every other field must equal HF's default.
_FLAGS = {
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "output_logits",
    "token_healing",
    "renormalize_logits",
    "remove_invalid_values",
    "use_mtp",
    "is_assistant",
    "low_memory",
}
# Cache implementations whose output is not the exact computation's (or not generate's usual output).
_FALLBACK_CACHES = {"paged": "continuous batching, another output format", "quantized": "a lossy KV cache"}
# What an attention mask that is not left-padded is refused as (integration.left_padding_fault's names).
_MASK_FAULTS = {
    "empty row": "an attention mask with a row of zeros (a prompt without tokens)",
    "right padding": "an attention mask with a 0 in the last column (right padding)",
    "hole": "an attention mask with a 0 after a 1 (a hole; the rollout takes left padding only)",
}

# What a refusal is about: the call's arguments, the model, the call's context (autocast, train mode),
# the generation settings, the input tensors, the length, or the other processes (synced_gpus).
Concern = Literal["call", "model", "context", "settings", "inputs", "length", "processes"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why the rollout does not serve a call, which then runs the model's own generate: `reason` is
    what the warning names ("... is not supported"), `concerns` what it is about."""

    reason: str
    concerns: Concern
    # A call that failed inside the rollout (`reason` names the exception) and is tried again next time:
    # its warning says so instead of "not supported".
    retried: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
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


@dataclasses.dataclass
class Call:
    """A call the rollout serves: its plan, inputs, whether HF generates it in step with the other
    processes (`synced`: synced_gpus as HF resolves it), and whether the rollout must (`lockstep`: synced,
    or a sharded model whose forwards gather its weights; every process then runs as many decode steps,
    the all-ended check a collective; set by `agree`)."""

    plan: Plan
    input_ids: Tensor
    attention_mask: Tensor
    synced: bool
    lockstep: bool = False

    def __post_init__(self):
        self.lockstep = self.lockstep or self.synced


@dataclasses.dataclass
class Arguments:
    """A call's arguments, bound as HF's generate binds them."""

    input_ids: Tensor
    attention_mask: Tensor | None
    generation_config: GenerationConfig | None
    tokenizer: object
    extra: dict  # the rest of **kwargs: generation settings (and model inputs, which fall back)
    synced: bool  # synced_gpus as HF resolves it: every process runs as many forwards as the others


def resolve_synced(model: nn.Module, synced_gpus) -> bool:
    """synced_gpus as HF resolves it: the argument when given, else True under DeepSpeed ZeRO-3 or an
    FSDP-managed model with several processes."""
    try:
        return bool(model._extract_generation_mode_kwargs(None, {}, synced_gpus, None, None)["synced_gpus"])
    except Exception:  # noqa: BLE001 - a value HF's resolution chokes on: its generate raises on it too
        return bool(synced_gpus)


def bind(model: nn.Module, args: tuple, kwargs: dict) -> tuple[Arguments | Refusal, bool]:
    """(the call's arguments, or the first one that selects something the rollout does not do; synced_gpus
    as HF resolves it, for refused calls too: what the other processes must know of this one's)."""
    try:
        bound = SIGNATURE.bind(model, *args, **kwargs)
    except TypeError as e:
        return Refusal(f"a call that Hugging Face's generate refuses ({e})", "call"), resolve_synced(
            model, kwargs.get("synced_gpus")
        )
    arguments = bound.arguments
    synced = resolve_synced(model, arguments.get("synced_gpus"))
    extra = dict(arguments.get("kwargs", {}))
    given = [name for name in _HF_ONLY_ARGUMENTS if arguments.get(name) is not None]
    given += [name for name in ("logits_processor", "stopping_criteria") if arguments.get(name)]  # None or empty: none
    if given:
        return Refusal(f"the argument {given[0]!r}", "call"), synced
    extra.pop("trust_remote_code", None)  # only read with custom_generate, refused above
    extra.pop("assistant_tokenizer", None)  # only read with an assistant model, refused above
    tokenizer = extra.pop("tokenizer", None)  # only read for stop_strings and token healing, which fall back
    input_ids = arguments.get("inputs")
    if input_ids is not None and "input_ids" in extra:
        return Refusal("both inputs and input_ids", "call"), synced
    if input_ids is None:
        input_ids = extra.pop("input_ids", None)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        return Refusal("input that is not a 2-D tensor of token ids (inputs_embeds, or no input_ids)", "call"), synced
    arguments = Arguments(
        input_ids, extra.pop("attention_mask", None), arguments.get("generation_config"), tokenizer, extra, synced
    )
    return arguments, synced


def check(model: nn.Module, adapter: ModelAdapter, arguments: Arguments) -> Call | Refusal:
    """The call the rollout serves, else why not, for a model the rollout runs (`adapter`: the model as
    it is now). Checked in order: the call's context, the generation settings, the inputs, the length."""
    refusal = _unsupported_context(model, adapter)
    if refusal:
        return refusal
    resolved = _resolve(model, adapter, arguments)
    if isinstance(resolved, Refusal):
        return resolved
    config, ids, mask, processors, criteria = resolved
    refusal = _unsupported_mask(mask)
    if refusal:
        return refusal
    plan = _plan(config, adapter, ids.shape[1], processors, criteria)
    if isinstance(plan, Refusal):
        return plan
    try:  # the positions (and sliding window) the rollout's KV cache covers
        adapter.check_length(ids.shape[1], plan.max_new_tokens)
    except ValueError as e:
        return Refusal(f"this length ({str(e).removeprefix('torchkvops: ')})", "length")
    return Call(plan, ids, mask, arguments.synced)


def agree(
    call: Call | Refusal, synced: bool, sharded: bool, gather_vote: Callable[[], GatherVote] | None = None
) -> tuple[Call | Refusal, Settled | None]:
    """Every process decides the same for this call (several processes, and a call that is synced or a
    model that is sharded: the forwards of each are collectives), by one all_reduce that every process
    joins whatever it found locally: whether every process serves it (else every process falls back to
    HF's generate, where each runs HF's forwards), whether they generate as many new tokens (required
    where the decode runs in lockstep), and for a sharded model whether its weights are gathered once
    (`gather_vote()`, hf.sharded.settle, which raises on every process where one demands a gather that
    cannot happen). Returns (the call, with `lockstep` set, or a refusal; the gather decision, None where
    the processes did not agree on one)."""
    if not collectives.initialized():
        if synced and isinstance(call, Call):
            return Refusal("synced_gpus=True without an initialized torch.distributed", "processes"), None
        return call, None
    served = isinstance(call, Call)
    local_vote = gather_vote() if served and sharded and gather_vote is not None else None
    new_tokens = call.plan.max_new_tokens if served else 0
    votes = local_vote.ints() if local_vote is not None else NEUTRAL_VOTE
    everyone, fewest, negative_most, *gather = collectives.all_min([int(served), new_tokens, -new_tokens, *votes])
    if not served:
        return call, None
    if not everyone:
        reason = "synced_gpus=True" if synced else "a sharded model"
        return Refusal(f"{reason} with a call that another process's rollout cannot serve", "processes"), None
    settled = settle(local_vote, gather) if local_vote is not None else None
    call.lockstep = synced or (sharded and not (settled is not None and settled.gather))
    if call.lockstep and fewest != -negative_most:
        reason = "synced_gpus=True" if synced else "a sharded model gathered at every step"
        return Refusal(f"{reason} with processes that generate different numbers of new tokens", "processes"), None
    return call, settled


def _resolve(model: nn.Module, adapter: ModelAdapter, call: Arguments):
    """What HF's generate would make of the call, by HF's own code: (generation config with special
    tokens and length set, ids, attention mask (inferred from the pad id when none is given), logits
    processors, stopping criteria); else the Refusal."""
    # Whether no length was given anywhere, as HF's generate decides it before resolving the config.
    has_default = {
        name: call.extra.get(name) is None
        and getattr(call.generation_config, name, None) is None
        and getattr(model.generation_config, name, None) is None
        for name in ("max_length", "min_length")
    }
    try:
        config, model_kwargs = model._prepare_generation_config(call.generation_config, **call.extra)
    except Exception as e:  # HF's validation: its generate raises the same
        return Refusal(
            f"a generation config that Hugging Face's generate refuses ({type(e).__name__}: {e})", "settings"
        )
    refusal = _unsupported_setting(config)
    if refusal:
        return refusal
    model_kwargs = sorted(k for k, v in model_kwargs.items() if v is not None and k != "use_cache")
    if model_kwargs:
        return Refusal(f"the model input {model_kwargs[0]!r}", "call")

    input_ids = call.input_ids
    given = call.attention_mask
    for name, tensor in (("input_ids", input_ids), ("attention_mask", given)):
        if isinstance(tensor, Tensor):
            check_has_values(tensor, name, "torchkvops.generate")
    if (
        isinstance(given, Tensor)
        and given.shape == input_ids.shape
        and not given.dtype.is_complex
        and not bool(((given == 0) | (given == 1)).all())
    ):  # host sync: a mask check, once per call
        return Refusal(
            "an attention mask with values other than 0 and 1 (HF attends where it is not 0, and "
            "numbers positions by its cumulative sum)",
            "inputs",
        )
    ids, mask = check_prompts(
        input_ids,
        call.attention_mask,
        input_ids.device,
        adapter.input_vocab,
        "torchkvops.generate",
        require_left_padding=False,
    )
    batch, prompt_length = ids.shape
    try:
        model._prepare_special_tokens(
            config, call.attention_mask is not None, device=input_ids.device, batch_size=batch
        )
        if call.attention_mask is None and adapter.takes_attention_mask:
            mask = model._prepare_attention_mask_for_generation(input_ids, config, {}).to(ids.device, torch.long)
        config = model._prepare_generated_length(
            generation_config=config,
            has_default_max_length=has_default["max_length"],
            has_default_min_length=has_default["min_length"],
            model_input_name="input_ids",
            input_ids_length=prompt_length,
            inputs_tensor=input_ids,
        )
        model._validate_generated_length(config, prompt_length, has_default["max_length"])
        processors = model._get_logits_processor(
            generation_config=config,
            input_ids_seq_length=prompt_length,
            encoder_input_ids=input_ids,
            logits_processor=LogitsProcessorList(),
            device=input_ids.device,
            model_kwargs={"attention_mask": mask},
        )
        criteria = model._get_stopping_criteria(
            generation_config=config, stopping_criteria=StoppingCriteriaList(), tokenizer=call.tokenizer
        )
    except Exception as e:  # HF's checks: its generate raises the same
        return Refusal(f"settings that Hugging Face's generate refuses ({type(e).__name__}: {e})", "settings")
    return config, ids, mask, processors, criteria


def _unsupported_context(model: nn.Module, adapter: ModelAdapter) -> Refusal | None:
    """What this call's context (rather than its arguments) does that the rollout's decode does not."""
    if type(model).generate is not GenerationMixin.generate:
        return Refusal(f"{type(model).__name__}'s own generate method", "model")
    autocast = forward_autocast_dtype(model, adapter.device.type)
    weights = adapter.dtype
    if autocast is not None and autocast != weights:
        return Refusal(
            f"a forward that runs under autocast to {autocast} with {weights} parameters (its K and V "
            f"then come in mixed dtypes, the rollout's KV cache holds {weights}; load the model in "
            f"{autocast}, or run without mixed precision)",
            "context",
        )
    if model.training and attention_dropout(model) > 0:
        return Refusal(
            "a model in train mode with attention dropout (the rollout's decode attention applies none; "
            "call model.eval() or set the dropout to 0)",
            "context",
        )
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


def _unsupported_setting(config: GenerationConfig) -> Refusal | None:
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
        return Refusal(f"generation_config.{field}={value!r}", "settings")
    if config.cache_implementation in _FALLBACK_CACHES:
        return Refusal(
            f"cache_implementation={config.cache_implementation!r} ({_FALLBACK_CACHES[config.cache_implementation]})",
            "settings",
        )
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return Refusal(f"the generation mode {mode.value!r}", "settings")
    return None


def _unsupported_mask(mask: Tensor) -> Refusal | None:
    """The rollout takes left-padded rows with at least one token each (the layout of batched prompts)."""
    fault = left_padding_fault(mask)  # host sync: a mask check, once per call
    return None if fault is None else Refusal(_MASK_FAULTS[fault], "inputs")


def _plan(config: GenerationConfig, adapter: ModelAdapter, prompt_length: int, processors, criteria) -> Plan | Refusal:
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
            return Refusal(f"the logits processor {type(processor).__name__}", "settings")
    for criterion in criteria:
        if not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)):
            return Refusal(f"the stopping criterion {type(criterion).__name__}", "settings")
    if sampled and isinstance(top_k, bool):
        return Refusal(f"top_k={top_k!r} (Hugging Face's top-k sampling raises on it)", "settings")
    if sampled and temperature < MIN_TEMPERATURE:
        return Refusal(
            f"temperature={temperature!r} (below {MIN_TEMPERATURE:g}, the logits / temperature overflow)", "settings"
        )
    if sampled and top_p <= 0:
        return Refusal(f"top_p={top_p!r}", "settings")
    eos = config._eos_token_tensor
    if eos is not None and (eos.is_floating_point() or eos.is_complex()):
        return Refusal(f"eos_token_id={config.eos_token_id!r} (not integers)", "settings")
    eos = () if eos is None else tuple(eos.flatten().tolist())  # host sync: a handful of ids, once per call
    vocab_out = adapter.output_vocab
    bad = [e for e in eos if e < 0 or (vocab_out is not None and e >= vocab_out)]
    if bad:
        return Refusal(f"eos_token_id {bad[0]} (outside the model's {vocab_out} token ids)", "settings")
    pad = 0  # without EOS ids no row ever ends, and the pad id is never written
    if eos:
        pad_tensor = config._pad_token_tensor  # HF's: the pad id, else the first EOS id
        vocab_in = adapter.input_vocab
        # host sync: one id, once per call
        pad = pad_tensor.item() if pad_tensor.numel() == 1 and not pad_tensor.is_floating_point() else None
        if pad is None or pad < 0 or (vocab_in is not None and pad >= vocab_in):
            return Refusal(
                f"pad_token_id={config.pad_token_id!r} (not one of the model's {vocab_in} token ids)", "settings"
            )
    k = _whole(config.num_return_sequences)
    if k is None or k < 1:
        return Refusal(f"num_return_sequences={config.num_return_sequences!r}", "settings")
    # HF's _prepare_generated_length set max_length; HF stops once the length reaches it, so a length of
    # another numeric type (4.0, np.int64(4), a 0-d tensor) means the next whole number of tokens.
    max_new = _tokens_until(config.max_length, prompt_length)
    min_new = _tokens_until(min_new + prompt_length, prompt_length) if min_new else 0
    if max_new is None or min_new is None:
        return Refusal(f"max_length={config.max_length!r} or min_new_tokens (not numbers)", "settings")
    return Plan(
        max_new_tokens=max_new,
        min_new_tokens=min(max(min_new, 0), max_new),
        temperature=float(temperature) if sampled else 0.0,
        top_k=int(top_k) if sampled else 0,
        top_p=min(float(top_p), 1.0) if sampled else 1.0,
        eos=eos,
        pad=int(pad),
        num_return_sequences=k,
        return_dict=bool(config.return_dict_in_generate),
    )


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


def run(call: Call, rollout_for: Callable[[int], Rollout], served: list | None = None) -> Tensor:
    """HF's output for a served call: `[rows, P + T]`, the prompts as given then the new tokens, as long
    as HF's would be. `rollout_for(samples)`: the rollout to decode with, `samples` rows per prompt.
    `served`, when given, gets (the rollout, its rows that are the call's rows, in output order)."""
    plan, input_ids, attention_mask = call.plan, call.input_ids, call.attention_mask
    device = input_ids.device
    k = plan.num_return_sequences
    starts, counts, output_rows = identical_rows(input_ids, attention_mask, k)
    samples = int(counts.max())  # host sync: the grouping's widest prompt, once per call
    # Output row o lives at (prompt u, slot j): row_ids holds o there; filler slots are dead (any id).
    slot = torch.arange(samples, device=device)
    live = (slot[None, :] < counts[:, None]).flatten()  # [groups * samples]
    first = torch.cumsum(counts, 0) - counts  # where each prompt's rows begin in output_rows
    index = (first[:, None] + slot[None, :]).clamp(max=output_rows.numel() - 1).flatten()
    row_ids = output_rows[index]  # a row's sampling key is its output row's: the grouping changes no token
    rollout = rollout_for(samples)
    seed = _call_seed()
    out = rollout.generate_rows(
        input_ids[starts],
        attention_mask[starts],
        row_ids=row_ids,
        live=live,
        seed=seed,
        ended_everywhere=collectives.ended_everywhere if call.lockstep else None,
    )
    live_slots = live.nonzero().flatten()
    in_order = live_slots[torch.argsort(row_ids[live_slots])]  # each output row's slot, in output order
    responses = out.responses[in_order.to(out.responses.device)]  # [rows, R]
    responses = _trim_to_hf_length(responses, plan)
    if served is not None:
        served.append((rollout, in_order.tolist()))
    return torch.cat([input_ids.repeat_interleave(k, dim=0), responses.to(device)], dim=1)


def identical_rows(input_ids: Tensor, attention_mask: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The call's distinct prompts (ids and mask alike), wherever their copies sit in the batch (TRL's GRPO
    repeats each prompt G times in adjacent rows; Online DPO repeats the whole batch, `repeat(2, 1)`), in
    the order of their first rows, each to be prefilled once: (each one's first input row [U], its output
    rows' count [U] (copies x k), the output rows grouped by prompt, in order within each [rows x k])."""
    rows = input_ids.shape[0]
    key = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    position = torch.arange(rows, device=input_ids.device)
    first = torch.full((int(inverse.max()) + 1,), rows, device=input_ids.device).scatter_reduce(
        0, inverse, position, "amin"
    )  # (host sync above: the number of distinct prompts, once per call)
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    prompt_of_output_row = rank[inverse].repeat_interleave(k)
    return first[order], torch.bincount(prompt_of_output_row), torch.argsort(prompt_of_output_row, stable=True)


def run_extension(call: Call, rollout: Rollout, rows: list[int], appended: list[Tensor]) -> Tensor:
    """HF's output for a served call whose row i extends row `rows[i]` of `rollout`'s last call by
    `appended[i]` (hf.generate_reuse): one `Rollout.extend` in which the rollout's other rows generate
    nothing; the call's rows decode on from their kept KV."""
    plan, input_ids = call.plan, call.input_ids
    per_row: list[Tensor | None] = [None] * rollout.history.rows
    for r, tokens in zip(rows, appended):
        per_row[r] = tokens
    previous = rollout.history.output
    _, turn = rollout.extend_turn(previous, per_row, plan.max_new_tokens, seed=_call_seed())
    responses = turn.responses[torch.tensor(rows, device=turn.responses.device)]
    responses = _trim_to_hf_length(responses, plan)
    return torch.cat([input_ids, responses.to(input_ids.device)], dim=1)


def _call_seed() -> int:
    return int(torch.randint(0, 2**62, (1,)).item())  # from torch's global generator, as HF's sampling


def _trim_to_hf_length(responses: Tensor, plan: Plan) -> Tensor:
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
