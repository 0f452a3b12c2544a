"""Hugging Face `generate`'s contract on top of the rollout, for RL trainers that call `model.generate`.

    import torchkvops
    torchkvops.patch_generate(model)            # the one line a TRL user adds
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)

TRL's GRPOTrainer (without vLLM), verl's HF rollout and OpenRLHF call `model.generate` on left-padded
prompts in which each prompt already appears N times. `generate` finds the identical rows (same ids and
same mask, adjacent or not: Online DPO repeats its whole batch), prefills each distinct prompt once and
decodes all its rows from one expanded KV cache. Prompts with fewer rows are padded to the most with
filler rows that end at once, so one rollout decodes the whole batch.

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
dtype, device, vocabulary: `models.model_state`). Copies of a patched model (`copy.deepcopy`, pickle,
`torch.save`) are unpatched: their `generate` is the one the patch replaced.

This module is the public API, the state kept between calls and the patch's lifecycle; the contract
itself (a call -> a plan or a refusal, a plan -> HF's output) is `generate_contract`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import operator
import threading
import weakref

import torch
from torch import Tensor, nn
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..models.adapter import ModelAdapter, is_peft_model, model_state, peft_refusal, unwrap_model
from ..rollout import NonFiniteLogitsError, Rollout, RolloutConfig
from ..rollout.profiling import RolloutProfile
from ..utils import LRU, PatchHandle, WarnOnce
from .call_weights import WeightOptions, call_weights, gather_vote
from .generate_batch import serve_batch
from .generate_contract import SIGNATURE, Call, Plan, Refusal, agree, bind, check, run, run_extension
from .generate_reuse import KeptCall, kv_fingerprint
from .sharded import Settled, is_sharded

__all__ = ["generate", "patch_generate", "GeneratePatch", "PATCH_OPTIONS", "ROLLOUT_OPTIONS"]

# RolloutConfig fields that make sense per model (the rest come from each call's generation config), and
# the patch's own: reuse_kv (keep the last served call's KV for a call that extends its rows,
# hf.generate_reuse; default True).
ROLLOUT_OPTIONS = (
    "compile",
    "cuda_graphs",
    "kv_sharing",
    "shared_prefill",
    "enable_profiling",
    "compact_finished_rows",
    "max_rows",
    "max_kv_tokens",
    "min_shared_tokens",
)
WEIGHT_OPTIONS = tuple(field.name for field in dataclasses.fields(WeightOptions))
PATCH_OPTIONS = (*ROLLOUT_OPTIONS, "reuse_kv", *WEIGHT_OPTIONS)
_SESSION_ATTRIBUTE = "_torchkvops_generate_session"
# How many rollouts (one per distinct sampling setup) a model keeps between calls.
_MAX_ROLLOUTS = 4
# The warning for each cause of a fallback, given once per model (where: the function that found it).
_FALLBACK_WARNING = (
    "{where}: {cause} is not supported; this call (and every call with it) runs the model's own generate"
)
# The warning for a call that failed inside the rollout before any was served (cause: the exception).
_RETRY_WARNING = (
    "{where}: the rollout failed on this call ({cause}); the model's own generate runs it, and the next call "
    "with these settings tries the rollout again"
)
# How many calls with the same settings may fail inside the rollout before every later one falls back.
_FAILED_TRIES = 2


class _Session:
    """A model's rollouts, reused across calls: one per distinct (samples per group, lengths, sampling,
    special ids), least recently used dropped first. Kept on the model (`_SESSION_ATTRIBUTE`), so that
    it lives exactly as long as the model; copies of the model get none."""

    def __init__(self, model: nn.Module, options: dict, original_generate=None):
        self.model_ref = weakref.ref(model)
        self.given = dict(options)  # as the patch was asked for: a deep copy of the model is patched alike
        options = dict(options)
        self.reuse_kv = options.pop("reuse_kv", True)
        # A sharded model's weights gathered once per served call, its LoRA merged for it (hf.call_weights).
        self.weights = WeightOptions(**{name: options.pop(name) for name in WEIGHT_OPTIONS if name in options})
        # Served calls' profiles (GeneratePatch.last_profile) unless the caller turned profiling off.
        options.setdefault("enable_profiling", True)
        self.options = options
        self.kept: KeptCall | None = None  # the last served call, for a call that extends its rows
        self.last_profile: RolloutProfile | None = None
        # What calls fall back to: the generate a patch replaced; None: the model class's own.
        self.original_generate = original_generate
        self.rollouts: LRU[tuple, Rollout] = LRU(_MAX_ROLLOUTS, release=lambda rollout: rollout.release())
        self.warnings = WarnOnce(_FALLBACK_WARNING)
        self.lock = threading.RLock()
        self.state: tuple | None = None  # models.model_state when the rollouts were built
        self.adapter: ModelAdapter | None = None  # the model read in that state
        self.refusal: Refusal | None = None  # why the rollout cannot run the model in that state (None: it can)
        self.proven = False  # a call was served in that state (until then a failure falls back)
        self.failed: dict[Plan, Refusal] = {}  # settings whose calls failed _FAILED_TRIES times, and why
        self.failures: dict[Plan, int] = {}  # how many calls with these settings failed in that state

    def __reduce__(self):
        return (type(None), ())  # a pickled copy of the model starts without a session

    def __deepcopy__(self, memo):
        """A deep copy of the model gets a session of its own with the same options (no rollouts, buffers
        or kept KV: they are the original's); one copied without its model gets none."""
        model = self.model_ref()
        twin = None if model is None else memo.get(id(model))
        return None if twin is None else _Session(twin, self.given)

    def fallback(self, model: nn.Module):
        if self.original_generate is not None:
            return self.original_generate
        return type(model).generate.__get__(model)

    def check_model(self, model: nn.Module) -> Refusal | None:
        """Why the rollout cannot run `model` as it is now, or None. Rebuilds the rollouts when the
        model changed since they were built (they read its dtype, attention implementation, ...)."""
        state = model_state(model)
        if state != self.state:
            self.release()
            self.state, self.proven = state, False
            self.failed.clear()
            self.failures.clear()
            try:
                self.adapter, self.refusal = ModelAdapter(model), None
            except Exception as e:  # noqa: BLE001 (whatever reading the model raised: refused, not broken)
                self.adapter = None
                reason = str(e).removeprefix("torchkvops: ")
                if not isinstance(e, (TypeError, ValueError)):
                    reason = f"{type(e).__name__} while reading it: {reason}"
                self.refusal = Refusal(f"this model ({reason})", "model")
        return self.refusal

    def rollout(
        self,
        model: nn.Module,
        samples: int,
        plan: Plan,
        limits: dict | None = None,
        synced: bool = False,
        gathered: bool = False,
    ) -> Rollout:
        """The rollout for `samples` rows per prompt and the plan's settings; `limits`: this call's budgets
        (torchkvops.generate's max_rows and max_kv_tokens; None values: the patch's); a budget of KV tokens
        decodes in the paged layout, whose blocks it counts; `synced`: the call generates in step with the
        other processes (which rules out both budgets: a stream's refills prefill where rows end);
        `gathered`: a sharded model's weights stay gathered for the whole call (hf.sharded), so decode
        may replay CUDA graphs."""
        options = dict(self.options)
        options.update({name: value for name, value in (limits or {}).items() if value is not None})
        if options.get("max_kv_tokens") is not None:
            options["kv_sharing"] = "paged"
        if synced:
            options.pop("max_rows", None)
            options.pop("max_kv_tokens", None)
        if is_sharded(model):
            # Gathered per step, a replayed graph would skip FSDP's hooks, which gather the weights at each
            # forward (gathered once, the graphs are captured on the gathered weights and keyed by their
            # addresses); and synced generation runs as many forwards on every process, which refills
            # (prefills where rows end) do not.
            if not gathered:
                options["cuda_graphs"] = False
            options.pop("max_rows", None)
            options.pop("max_kv_tokens", None)
        budget = options.get("max_rows")
        if budget is not None and budget < samples:
            raise RowBudgetError(
                f"torchkvops: max_rows={budget} is smaller than this call's largest group of identical prompts "
                f"({samples} rows with num_return_sequences): a prompt's samples decode together; raise max_rows"
            )
        key = (
            tuple(sorted(options.items())),
            samples,
            plan.max_new_tokens,
            plan.min_new_tokens,
            plan.temperature,
            plan.top_k,
            plan.top_p,
            plan.eos,
            plan.pad,
        )
        rollout = self.rollouts.get(key)
        if rollout is None:
            config = RolloutConfig(
                samples_per_prompt=samples,
                max_new_tokens=plan.max_new_tokens,
                min_new_tokens=plan.min_new_tokens,
                temperature=plan.temperature,
                top_k=plan.top_k,
                top_p=plan.top_p,
                eos_token_id=list(plan.eos),
                pad_token_id=plan.pad,
                **options,
            )
            rollout = self.rollouts.put(key, Rollout(model, config))
        return rollout

    def release(self) -> None:
        with self.lock:
            self.kept = None
            self.rollouts.clear()

    def extension(self, call: Call, fingerprint: tuple) -> tuple[KeptCall, list[int], list[Tensor]] | None:
        """(the kept call, the rollout rows the call's rows extend, what each appends) when the call can
        be served from the kept call's KV: same settings, the same weights (`fingerprint`, read now),
        every row extending a distinct kept row. Else None."""
        kept = self.kept
        if kept is None or call.plan.num_return_sequences != 1 or _reuse_settings(call.plan) != kept.settings:
            return None
        if not kept.is_current() or kept.rollout.holds_inference_tensors():
            return None
        if fingerprint != kept.fingerprint:
            self.kept = None  # stale: computed by other weights
            return None
        match = kept.match(call.input_ids, call.attention_mask)
        return None if match is None else (kept, match.rows, match.appended)

    def keep(self, call: Call, rollout: Rollout, rows: list[int], fingerprint: tuple | None) -> None:
        """Remember this served call (its rollout and the rollout rows that are the call's) for the next."""
        self.last_profile = rollout.get_last_profile()
        kept = fingerprint is not None and rollout.history is not None  # (a streamed call keeps no KV)
        self.kept = KeptCall(rollout, _reuse_settings(call.plan), rows, fingerprint) if kept else None

    def warn_once(
        self, reason: str, where: str = "torchkvops.generate", stacklevel: int = 4, retried: bool = False
    ) -> None:
        """The fallback warning for `reason` (a Refusal's), the first time this model meets it; `retried`: a
        failed call's, which the next call tries again. stacklevel: counted from this method
        (scripts/hf_generate_plugin.py wraps it to count the fallbacks)."""
        self.warnings(reason, stacklevel=stacklevel, template=_RETRY_WARNING if retried else None, where=where)


class RowBudgetError(ValueError):
    """max_rows cannot hold one group of a call: the caller's setting, raised rather than served otherwise."""


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


def _compiled_module(model: nn.Module) -> nn.Module:
    """The module `torch.compile(model)` compiled, for its OptimizedModule (whose `generate` is that
    module's: OptimizedModule forwards attributes to it); any other model as it is. The rollout decodes
    the module itself (its own `compile=True` compiles decode); HF's generate, where a call falls back,
    runs the module's uncompiled forward, as `compiled.generate` does unpatched."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return model._orig_mod
    return model


def _check_generative(model, where: str) -> None:
    """A bare backbone (LlamaModel) or a wrapper (DDP, FSDP1's root) has no generate to serve or fall back
    to: the caller's mistake, named with its fix."""
    if callable(getattr(type(model), "generate", None)):
        return
    name = type(model).__name__
    if name == "FullyShardedDataParallel":
        raise TypeError(
            f"{where}: {name} has no generate method; patch the model it wraps, {where}(model.module), and "
            "call model.module.generate with the root's own parameters gathered, as TRL does: "
            "`with FullyShardedDataParallel.summon_full_params(model, recurse=False): model.module.generate(...)` "
            "(the wrappers inside are gathered once per call)"
        )
    if name in ("DistributedDataParallel", "DataParallel"):
        raise TypeError(f"{where}: {name} has no generate method; patch the model it wraps: {where}(model.module)")
    raise TypeError(
        f"{where}: {name} has no generate method (a bare backbone without a language-model "
        f"head?); use the causal LM that wraps it, e.g. {name.removesuffix('Model') or name}ForCausalLM"
    )


def _peft_refusal(model: nn.Module) -> Refusal | None:
    """hf.peft_refusal's reason, as a Refusal."""
    reason = peft_refusal(model)
    return None if reason is None else Refusal(reason, "model")


def generate(
    model: nn.Module,
    input_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    *,
    max_rows: int | None = None,
    max_kv_tokens: int | None = None,
    gather_weights: str = "auto",
    gather_budget_bytes: int | None = None,
    merge_lora: bool = True,
    **kwargs,
):
    """`model.generate(input_ids, attention_mask=..., generation_config=..., **kwargs)` for a decoder-only
    Hugging Face model, with identical prompts prefilled once (wherever they sit in the batch). Returns what HF's generate returns:
    `[rows, P + T]` token ids (the prompts as given, then the new tokens; rows that ended early are
    filled with the pad id), or with `return_dict_in_generate=True` a `GenerateDecoderOnlyOutput` whose
    `.sequences` is set and whose `.cache` is None (the rollout's KV buffers are reused by the next call;
    a call that needs HF's cache must go to `model.generate` unpatched). Calls the rollout cannot serve
    run the model's own generate (see the module docstring). `max_rows`: the most rows decoded at once
    (RolloutConfig.max_rows): a larger batch is streamed, its prompts admitted as others' rows end.
    `max_kv_tokens`: the most KV tokens its rows hold at once (RolloutConfig.max_kv_tokens, in the paged
    layout): rows start while blocks are free, the newest preempted and restarted when they run short.
    `gather_weights` ("auto", "once", "per_step"), `gather_budget_bytes` and `merge_lora`: as
    patch_generate's."""
    weights = WeightOptions(gather_weights, gather_budget_bytes, merge_lora).check("torchkvops.generate")
    model = _compiled_module(model)
    _check_generative(model, "torchkvops.generate")
    paged = "paged" if max_kv_tokens is not None else "copy"
    RolloutConfig(max_rows=max_rows, max_kv_tokens=max_kv_tokens, kv_sharing=paged)  # the same checks and messages
    args = () if input_ids is None else (input_ids,)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if generation_config is not None:
        kwargs["generation_config"] = generation_config
    session = _session(model)
    limits = dict(max_rows=max_rows, max_kv_tokens=max_kv_tokens)
    return _serve(session, model, args, kwargs, session.fallback(model), limits, weights)


def _serve(
    session: _Session,
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    original,
    limits: dict | None = None,
    weights: WeightOptions | None = None,
):
    """One call with generate's arguments as the caller passed them: served by a rollout, or passed
    unchanged to `original` (the model's own generate) with a warning naming the cause. A PEFT model
    is served from the model its adapters are injected into (`models.unwrap_model`).

    Where the call's forwards are collectives (synced_gpus, or a sharded model: FSDP's or ZeRO-3's
    gathers) and several processes run, every process first joins one agreement (`generate_contract.agree`)
    whatever it found locally, so that all serve the call or all run HF's generate, and all gather a
    sharded model's weights once or none does: no collective of ours runs on one process only."""
    weights = weights or session.weights
    with session.lock:
        target = unwrap_model(model) if is_peft_model(model) else model
        call, synced = _prepare(session, target, args, kwargs)
        call = _peft_refusal(model) or call
        if isinstance(call, Call):
            call = session.failed.get(call.plan, call)
        sharded = is_sharded(target)
        settled = None
        if synced or sharded:
            call, settled = agree(call, synced, sharded, lambda: gather_vote(target, weights))
        if isinstance(call, Call):
            try:
                sequences = _run(session, target, call, limits, weights, settled)
                session.proven = True
            except (torch.OutOfMemoryError, NonFiniteLogitsError, RowBudgetError):
                raise
            except Exception as e:
                tried = call.plan in session.failures  # (these settings failed before: tried again)
                if (session.proven and not tried) or call.lockstep or settled is not None or _out_of_memory(e):
                    raise  # (the other processes are in the call's collectives, or served it: no fallback here)
                # A call failed inside the rollout before any call was served in this model state: the
                # model may do something the rollout does not implement, or the failure was passing. HF's
                # generate takes this call, and the next one with the same settings tries again; after
                # _FAILED_TRIES failures every later one falls back (until the model changes). Calls with
                # other settings are still tried (one odd call must not cost every later one its speed).
                session.release()
                what = f"{type(e).__name__}: {e}"
                tries = session.failures[call.plan] = session.failures.get(call.plan, 0) + 1
                if tries < _FAILED_TRIES:
                    call = Refusal(what, "model", retried=True)
                else:
                    refusal = Refusal(f"this model (the rollout failed on it {tries} times, last: {what})", "model")
                    session.failed[call.plan] = call = refusal
    if isinstance(call, Refusal):
        session.last_profile = None
        session.warn_once(call.reason, retried=call.retried)
        return original(*args, **kwargs)
    return GenerateDecoderOnlyOutput(sequences=sequences) if call.plan.return_dict else sequences


def _out_of_memory(error: Exception) -> bool:
    """Whether `error` says memory ran out (a CUDA OutOfMemoryError, or the CPU allocator's RuntimeError):
    raised to the caller, as HF's generate would, and remembered nowhere."""
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text)
    )


def _run(
    session: _Session,
    model: nn.Module,
    call: Call,
    limits: dict | None = None,
    weights: WeightOptions = WeightOptions(),
    settled: Settled | None = None,
) -> Tensor:
    """A served call's output: from the kept call's KV when its rows extend that call's
    (`generate_contract.run_extension`), else decoded by the session's rollout for its plan
    (`generate_contract.run`); a sharded model's weights gathered once and its LoRA merged around it
    (`weights`, hf.call_weights; `settled`: the gather the processes agreed on, None: decided there).
    (scripts/hf_generate_plugin.py wraps `_serve` and this to count the calls served.)"""
    fingerprint = None
    if session.reuse_kv and not call.lockstep and not is_sharded(model):
        fingerprint = kv_fingerprint(model, session.adapter.adapter_state())
    extension = None if fingerprint is None else session.extension(call, fingerprint)
    with call_weights(model, weights, settled) as prepared:
        if extension is not None:
            kept, rows, appended = extension
            sequences = run_extension(call, kept.rollout, rows, appended)
            session.keep(call, kept.rollout, kept.candidates, fingerprint)
        else:
            served: list = []
            rollout_for = functools.partial(
                session.rollout,
                model,
                plan=call.plan,
                limits=limits,
                synced=call.lockstep,
                gathered=prepared.gathered.units > 0,
            )
            sequences = run(call, rollout_for, served)
            session.keep(call, *served[0], fingerprint)
    profile = session.last_profile
    if profile is not None:
        profile.gather_ms, profile.gathered_bytes = prepared.gathered.ms, prepared.gathered.bytes
        profile.merge_ms, profile.merged_lora_layers = prepared.merged.ms, prepared.merged.layers
    return sequences


def _reuse_settings(plan: Plan) -> tuple:
    """What a kept call's rollout fixed, which a call served from it must share (max_new_tokens may differ)."""
    return plan.min_new_tokens, plan.temperature, plan.top_k, plan.top_p, plan.eos, plan.pad


def _prepare(session: _Session, model: nn.Module, args: tuple, kwargs: dict) -> tuple[Call | Refusal, bool]:
    """(the call the rollout serves, else the refusal; whether the processes generate in step:
    synced_gpus as HF resolves it). Checked in order: the arguments, the model (`session.check_model`,
    which rebuilds the session's state when the model changed), then the rest (`generate_contract.check`)."""
    arguments, synced = bind(model, args, kwargs)
    if isinstance(arguments, Refusal):
        return arguments, synced
    # After check_model, session.adapter describes the model as it is now.
    return session.check_model(model) or check(model, session.adapter, arguments), synced


class _PatchedGenerate:
    """What `patch_generate` puts in the model's `generate` (an instance attribute): HF's generate
    signature, served by the rollout. Undone, it passes every call to what it replaced. Deep-copied with
    its model (TRL's A2PO copies the policy into its reference model), the copy is patched alike, with a
    session of its own (`GeneratePatch.of(copy)` is its handle); pickled (`torch.save`, another process),
    it becomes the generate it replaced: the copy is unpatched."""

    def __init__(self, model: nn.Module, session: _Session, replaced):
        self.__self__ = model  # as a bound method holds its instance
        self.session = session
        self.replaced = replaced  # the instance attribute it shadows; None: the class's generate
        self.active = True
        self.batch: _PatchedGenerateBatch | None = None  # its generate_batch twin, where the model has one
        self.__doc__ = type(model).generate.__doc__
        self.__signature__ = SIGNATURE.replace(parameters=list(SIGNATURE.parameters.values())[1:])  # HF's, bound

    def original(self):
        model = self.__self__
        return self.replaced if self.replaced is not None else type(model).generate.__get__(model)

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.original()(*args, **kwargs)
        return _serve(self.session, self.__self__, args, kwargs, self.session.fallback(self.__self__))

    def __deepcopy__(self, memo):
        twin = memo.get(id(self.__self__))
        if twin is None or not self.active:  # copied without its model, or undone: what it stands for
            function, args = self.__reduce__()
            return function(*copy.deepcopy(args, memo))
        session = copy.deepcopy(self.session, memo)
        patched = _PatchedGenerate(twin, session, copy.deepcopy(self.replaced, memo))
        session.original_generate = patched.original()
        return patched

    def __reduce__(self):
        replaced = _unwrap(self.replaced)
        if replaced is None:  # the copy's own class generate, bound to the copy
            return (getattr, (self.__self__, "generate"))
        return (operator.getitem, ([replaced], 0))


class _PatchedGenerateBatch:
    """What `patch_generate` puts in the model's `generate_batch` (transformers' continuous batching, which
    TRL's paged path calls): served through its generate patch (`patched`, the same session and the same
    switch: undone with it) by `hf.generate_batch`, else the generate_batch it replaced. Copied as that
    patch is copied."""

    def __init__(self, patched: _PatchedGenerate, replaced):
        self.patched, self.replaced = patched, replaced
        self.__self__ = patched.__self__
        self.__doc__ = type(self.__self__).generate_batch.__doc__

    def original(self):
        model = self.patched.__self__
        return self.replaced if self.replaced is not None else type(model).generate_batch.__get__(model)

    def __call__(self, inputs, **arguments):
        if not self.patched.active:
            return self.original()(inputs, **arguments)
        model = self.patched.__self__
        return serve_batch(_serve, self.patched.session, model, inputs, self.original(), **arguments)

    def __deepcopy__(self, memo):
        patched = copy.deepcopy(self.patched, memo)
        if not isinstance(patched, _PatchedGenerate):  # the copy's generate is unpatched: so is this
            function, args = self.__reduce__()
            return function(*copy.deepcopy(args, memo))
        patched.batch = _PatchedGenerateBatch(patched, copy.deepcopy(self.replaced, memo))
        return patched.batch

    def __reduce__(self):
        replaced = _unwrap(self.replaced)
        if replaced is None:
            return (getattr, (self.__self__, "generate_batch"))
        return (operator.getitem, ([replaced], 0))


def _unwrap(replaced):
    """What a chain of undone patches stands for: the first thing in it that is not an undone patch."""
    while isinstance(replaced, (_PatchedGenerate, _PatchedGenerateBatch)) and not _active(replaced):
        replaced = replaced.replaced
    return replaced


def _active(patched) -> bool:
    return (patched.patched if isinstance(patched, _PatchedGenerateBatch) else patched).active


class GeneratePatch(PatchHandle):
    """What `patch_generate` returns: `undo()` (or leaving the `with` block) restores the generate this
    patch replaced; `release()` frees the rollout state (KV buffers, decode graphs) kept between calls.
    The handle holds the model weakly: `del model` frees the model, its patch and its state."""

    def __init__(self, model: nn.Module, patched: _PatchedGenerate):
        super().__init__()
        self._model_ref = weakref.ref(model)
        self._patched_ref = weakref.ref(patched)
        self._session_ref = weakref.ref(patched.session)

    @classmethod
    def of(cls, model: nn.Module) -> GeneratePatch | None:
        """A handle on `model`'s torchkvops patch (None: its generate is not patched): for a deep copy of a
        patched model, which is patched too, to be undone or released."""
        current = vars(model).get("generate")
        return cls(model, current) if isinstance(current, _PatchedGenerate) and current.active else None

    @property
    def session(self) -> _Session | None:
        return self._session_ref()

    def undo(self) -> None:
        """Put back the `generate` this patch replaced (what was set over the patch since, e.g. a
        wrapper around it, goes too), in whatever order handles are undone: the patch itself is switched
        off, so that anything still holding it (a later patch set over a wrapper of it) passes its calls
        through, and the one exception is a later torchkvops patch now in place, which stays until its
        own undo() puts back what it replaced."""
        super().undo()

    def _restore(self) -> None:
        model, patched = self._model_ref(), self._patched_ref()
        if model is None or patched is None:
            return
        patched.active = False
        installed = (("generate", _PatchedGenerate, patched), ("generate_batch", _PatchedGenerateBatch, patched.batch))
        for name, kind, mine in installed:
            current = vars(model).get(name)
            if mine is None or (isinstance(current, kind) and _active(current)):
                continue  # not patched by this patch, or a later torchkvops patch, which its own undo() takes off
            replaced = _unwrap(mine.replaced)
            if replaced is None:
                vars(model).pop(name, None)
            else:
                setattr(model, name, replaced)
        patched.session.release()
        if vars(model).get(_SESSION_ATTRIBUTE) is patched.session:
            del vars(model)[_SESSION_ATTRIBUTE]

    def release(self) -> None:
        """Free the rollout state kept between calls (KV buffers, decode graphs, the last call's KV)."""
        session = self.session
        if session is not None:
            session.release()

    def last_profile(self) -> RolloutProfile | None:
        """The RolloutProfile of the last call, if it was served (None when it fell back to HF's generate,
        or with enable_profiling=False): its stage times, and `prefill_tokens` / `reused_tokens`, the
        positions its prefill computed and those whose KV came from the call before."""
        session = self.session
        return None if session is None else session.last_profile


def patch_generate(model: nn.Module, **options) -> GeneratePatch:
    """Make `model.generate` run through torchkvops (this instance only). `options` are rollout options
    that make sense per model: compile, cuda_graphs, kv_sharing, shared_prefill, enable_profiling,
    compact_finished_rows, max_rows, max_kv_tokens (with no kv_sharing given, "paged": the layout whose
    blocks it counts), min_shared_tokens (validated as RolloutConfig validates them), reuse_kv (default True: a
    call whose rows extend the last served call's, as an agent's next turn does, prefills only what
    they append; hf.generate_reuse), and for a model sharded with FSDP2 gather_weights ("auto": its
    weights gathered once per served call when they fit gather_budget_bytes (and on CUDA the free
    memory), else gathered at every step with a warning; "once": gathered once or an error; "per_step":
    FSDP's own per-forward gathers) and gather_budget_bytes (default None: no budget; hf.sharded), and for
    a PEFT model merge_lora (default True: LoRA merged into the weights for each served call, every
    parameter bit-identical after it; models.lora). Returns a handle: `handle.undo()` restores the original generate,
    `with patch_generate(model): ...` does so on leaving the block, `handle.release()` frees the KV
    buffers and decode graphs kept between calls, and `handle.last_profile()` is the last served call's
    RolloutProfile.

    A model the rollout cannot run (ALiBi, attention sinks, an attention implementation it does not
    take, ...) is patched all the same, with a warning now: its calls run its own generate. For
    `torch.compile(model)` the compiled module is patched, so that `compiled.generate` and
    `model.generate` are both served (decode compiles with `compile=True`)."""
    unknown = sorted(set(options) - set(PATCH_OPTIONS))
    if unknown:
        raise TypeError(
            f"patch_generate: unknown option {unknown[0]!r}; the options are {', '.join(PATCH_OPTIONS)} "
            "(the rest comes from each call's generation config)"
        )
    if options.get("max_kv_tokens") is not None:
        options.setdefault("kv_sharing", "paged")
    RolloutConfig(**{k: v for k, v in options.items() if k in ROLLOUT_OPTIONS})  # the same checks and messages
    if not isinstance(options.get("reuse_kv", True), bool):
        raise ValueError(f"patch_generate: reuse_kv must be a bool, got {options['reuse_kv']!r}")
    WeightOptions(**{name: options[name] for name in WEIGHT_OPTIONS if name in options}).check("patch_generate")
    model = _compiled_module(model)
    _check_generative(model, "patch_generate")
    current = vars(model).get("generate")
    if isinstance(current, _PatchedGenerate) and current.active:
        raise RuntimeError(
            "patch_generate: this model's generate is already patched by torchkvops; call undo() on "
            "the handle that patch_generate returned (or leave its `with` block) before patching "
            "again, or keep using that patch"
        )
    previous = vars(model).get(_SESSION_ATTRIBUTE)
    current_batch = vars(model).get("generate_batch")
    try:
        session = _Session(model, dict(options))
        patched = _PatchedGenerate(model, session, current)
        session.original_generate = patched.original()
        vars(model)[_SESSION_ATTRIBUTE] = session
        model.generate = patched
        if callable(
            getattr(type(model), "generate_batch", None)
        ):  # transformers' continuous batching (TRL's paged path)
            patched.batch = _PatchedGenerateBatch(patched, vars(model).get("generate_batch"))
            model.generate_batch = patched.batch
        refusal = _peft_refusal(model) or session.check_model(unwrap_model(model) if is_peft_model(model) else model)
        handle = GeneratePatch(model, patched)
    except Exception as e:
        # Never a half-patched model: its generate and our session attribute as they were.
        if current is None:
            vars(model).pop("generate", None)
        else:
            model.generate = current
        if current_batch is None:
            vars(model).pop("generate_batch", None)
        else:
            model.generate_batch = current_batch
        if previous is None:
            vars(model).pop(_SESSION_ATTRIBUTE, None)
        else:
            vars(model)[_SESSION_ATTRIBUTE] = previous
        raise RuntimeError(
            f"patch_generate: patching failed ({type(e).__name__}: {e}); the model's generate is left as it was"
        ) from e
    if previous is not None:
        previous.release()
    if refusal:
        session.warn_once(refusal.reason, where="torchkvops.patch_generate", stacklevel=3)
    return handle
