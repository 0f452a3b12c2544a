"""N samples per prompt from a Hugging Face causal LM, prefilling each unique prompt once.

    rollout = Rollout(model, RolloutConfig(samples_per_prompt=4, max_new_tokens=32))
    out = rollout.generate(input_ids, attention_mask=None)   # input_ids: LongTensor [B, P]

A call runs as stages, one path for every kind of call (`torchkvops.rollout.calls`): prompt expansion
(the expanded baseline repeats prompts N times; shared prefill does not), prefill (one forward over the
prompts, last-position logits only), kv_expand (each row's block table forks its prompt's: whole blocks
shared by reference, the partly filled last one copied; a hybrid's recurrent states by one repeat_kv_cache_
call per group), decode (the decoder's loop over a batch of B*N rows, `torchkvops.rollout.decode`) and
post-processing. `extend` goes on after a call with appended tokens (`torchkvops.rollout.turns`), and with
more rows than RolloutConfig.max_rows a call streams them (`torchkvops.rollout.streaming`). With `compile=True` prefill
and decode are compiled separately: prefill with dynamic shapes, decode with fullgraph=True and dynamic
row and key-length dims. On CUDA, decode steps are replayed from CUDA graphs (`cuda_graphs=True`).
docs/architecture.md draws the call flow.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..models.adapter import ModelAdapter
from ..utils import check_has_values, left_padding_fault
from . import attention
from .attention import packed_attention
from .cache_groups import KVViews
from .calls import ExtendCall, GenerateCall, StreamCall, run_stages
from .config import RolloutConfig, RolloutOutput
from .decode import FINISHED_CHECK_INTERVAL, Decoder, DecodeStep
from .kv_budget import budget_blocks, call_blocks
from .kv_cache import RolloutKVCache
from .layouts import DenseLayout, layout_for
from .lm_head import Float32LMHead
from .packed_states import segmented_mixers
from .packing import pack
from .profiling import RolloutProfile, StageTimer
from .sampling import SamplingParams
from .turns import History, check_appended

# (The package's public names are torchkvops.rollout's __all__; this module's own are these.)
__all__ = ["Rollout", "check_prompts"]


# A rollout switches its model's attention implementation while it decodes: one rollout per model at a
# time, whichever Rollout object or thread runs it (a second caller waits).
_model_locks: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_model_locks_guard = threading.Lock()


def _lock_for(model: nn.Module) -> threading.RLock:
    with _model_locks_guard:
        lock = _model_locks.get(model)
        if lock is None:
            lock = _model_locks[model] = threading.RLock()
        return lock


class Rollout:
    def __init__(self, model: nn.Module, config: RolloutConfig | None = None):
        self.config = config if config is not None else RolloutConfig()
        if not isinstance(self.config, RolloutConfig):
            raise TypeError(f"Rollout: config must be a RolloutConfig, got {type(self.config).__name__}")
        self.adapter = ModelAdapter(model)
        self.model = model
        self.device, self.dtype = self.adapter.device, self.adapter.dtype
        self.cache = RolloutKVCache(self.adapter.cache_spec, self.dtype, self.device)
        self.eos_ids = self.adapter.eos_ids(self.config.eos_token_id)
        self.pad_id = self.adapter.pad_id(self.config.pad_token_id, self.eos_ids)
        self._check_special_ids()
        self._eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device) if self.eos_ids else None
        self._params = SamplingParams(float(self.config.temperature), self.config.top_k, float(self.config.top_p))
        self._last_profile: RolloutProfile | None = None
        self._history: History | None = None  # what the last call left for extend()
        self._scratch: RolloutKVCache | None = None  # max_rows: where admitted prompts are prefilled
        self._streamed = False  # the last call streamed its rows (max_rows): no KV kept for extend()
        # Buffers made under a caller's torch.inference_mode() are inference tensors, which cannot be
        # written outside it: a later call outside it makes new ones.
        self._buffers_are_inference = False
        self._lock = _lock_for(model)
        # A float32 LM head only where it changes something: a float32 head (or model) computes in float32.
        # (Float32LMHead refuses a head it cannot stand in for, rather than leaving the setting unapplied.)
        self._head32 = Float32LMHead(model) if self.config.lm_head_dtype == torch.float32 else None
        if self._head32 is not None and self._head32.head.weight.dtype == torch.float32:
            self._head32 = None
        cfg = self.config
        self.layout = layout_for(cfg.kv_sharing, cfg.samples_per_prompt, cfg.shared_prefill)
        step = DecodeStep(
            self.adapter, self.cache, self._params, self.pad_id, self._eos, cfg.min_new_tokens, cfg.return_logprobs
        )
        self._decoder = Decoder(
            self.adapter,
            self.cache,
            step,
            self.layout,
            compile=cfg.compile,
            cuda_graphs=cfg.cuda_graphs,
            compacts=cfg.compact_finished_rows,
            graph_extra=self._head32.addresses if self._head32 is not None else tuple,
        )
        # Where a prefill's K and V go (its forward's metadata), one object per cache: a compiled prefill sees it.
        self._prefill_kv, self._scratch_prefill_kv = attention.PrefillForward(), attention.PrefillForward()
        self._prefill_fn = torch.compile(self._prefill_forward, dynamic=True) if cfg.compile else self._prefill_forward

    # --- public API ----------------------------------------------------------------------------
    def generate(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> RolloutOutput:
        """N samples for each of the B left-padded prompts `input_ids` [B, P]: row r of the output
        answers prompt r // N. Returns ordinary tensors (not inference tensors), on the model's device."""
        return self.generate_rows(input_ids, attention_mask)

    def extend(self, previous: RolloutOutput, appended, max_new_tokens: int | None = None) -> RolloutOutput:
        """Go on after the last call: append `appended[r]` to row r of `previous` (the RolloutOutput this
        Rollout's last `generate` or `extend` returned) after its response so far (through its first EOS),
        and decode up to `max_new_tokens` (default: RolloutConfig.max_new_tokens) more tokens.
        `appended[r]`: a list or 1-D tensor of token ids (a tool's answer, the chat template's turn
        tokens; may be empty), or None for a row that has finished and generates nothing more.

        Each row's KV from the earlier calls is reused: only the appended tokens (and each row's last
        token, which has no KV yet) are computed before decoding goes on (`RolloutProfile.prefill_tokens`,
        `reused_tokens`). Returns the whole history after the prompt: `sequences` (the prompt as given,
        then each row's history, right-padded with the pad id), `responses` (the history alone),
        `response_mask` (1 on generated tokens, through each turn's EOS; 0 on appended tokens and
        padding), `logprobs` (on generated tokens, 0 elsewhere). When every row is None there is nothing
        to do: `previous` itself is returned (and extends as before), and get_last_profile() is None."""
        return self.extend_turn(previous, appended, max_new_tokens)[0]

    def holds_inference_tensors(self) -> bool:
        """Whether the buffers were made under torch.inference_mode() while it is off now: the next call
        makes new ones (and so keeps no KV from the last)."""
        return self._buffers_are_inference and not torch.is_inference_mode_enabled()

    def get_last_profile(self) -> RolloutProfile | None:
        """The profile of the last `generate()` call, or None when profiling was off."""
        return self._last_profile

    def decode_counters(self):
        """What this rollout's decode has built and done (`torchkvops.rollout.decode.DecodeCounters`): decode
        shapes kept, graph keys met, CUDA graphs captured, compactions, the last graph key."""
        return self._decoder.counters

    def release(self) -> None:
        """Free the KV buffer, decode state and CUDA graphs; the next `generate()` makes them again."""
        with self._lock:
            self._buffers_are_inference = False
            self._history = None
            self._scratch = None
            self.cache.release()
            self._decoder.release()
            if self._head32 is not None:
                self._head32.release()

    # --- entry points for the integrations (generate's contract, data-parallel rollouts) ----------
    def generate_rows(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        *,
        row_ids: Tensor | None = None,
        live: Tensor | None = None,
        seed: int | None = None,
        ended_everywhere: Callable[[bool], bool] | None = None,
    ) -> RolloutOutput:
        """`generate`, and what the drop-in `generate` and data-parallel rollouts need besides:
        - row_ids [B*N] int64: the index that keys each row's sampling (default 0..B*N-1), e.g. a
          data-parallel shard's place among all rows, or a row's place in a caller's batch;
        - live [B*N] bool: False for filler rows (groups padded to N), which end at once and hold the pad id;
        - seed: the sampling seed of this call (default: RolloutConfig.seed, else a fresh one);
        - ended_everywhere: at each all-ended check, this process's answer -> every process's (a
          collective: FSDP's synced generation, where every process must run as many forwards as the
          others); decode stops only when it says True, until then ended rows decode on as filler.

        Runs under torch.no_grad(), not inference mode: whatever the model allocates in its forward
        (FSDP's unsharded parameters, a rotary embedding's refreshed buffers) must stay usable by the
        training step that follows, as after HF's generate."""
        return self._call(lambda: self._generate(input_ids, attention_mask, row_ids, live, seed, ended_everywhere))

    def extend_turn(
        self, previous: RolloutOutput, appended, max_new_tokens: int | None = None, *, seed: int | None = None
    ) -> tuple[RolloutOutput, RolloutOutput | None]:
        """`extend`, returning this turn alone too: (the whole history's output, this turn's [rows, R]
        responses, mask and logprobs; None when every row is None). seed: this turn's sampling seed
        (default: derived from the first call's)."""
        return self._call(lambda: self._extend(previous, appended, max_new_tokens, seed))

    @property
    def history(self) -> History | None:
        """What the last call left for `extend` (its output, each row's tokens, KV columns and positions;
        torchkvops.rollout.turns.History), or None (no call yet, a streamed call, release())."""
        return self._history

    # --- a call ---------------------------------------------------------------------------------
    def _call(self, run: Callable[[], object]):
        head32 = self._head32.applied() if self._head32 is not None else contextlib.nullcontext()
        with self._lock, torch.no_grad(), head32:
            inference = torch.is_inference_mode_enabled()
            if self._buffers_are_inference and not inference:  # a caller's inference_mode made them
                self.release()
            self._buffers_are_inference = inference or self._buffers_are_inference
            return run()

    def _profiled(self, stages: Callable[[StageTimer], tuple[object, dict]]):
        """Run a call's stages with one StageTimer; its profile (RolloutProfile: the stage times, and the
        counts `stages` returns with its result) becomes get_last_profile() when profiling is on."""
        timer = StageTimer(self.device, self.config.enable_profiling)
        timer.start()
        result, counts = stages(timer)
        self._last_profile = None
        if self.config.enable_profiling and counts is not None:
            self._last_profile = RolloutProfile.from_stages(
                timer.elapsed_ms(), peak_memory_bytes=timer.peak_memory_bytes(), **counts
            )
        return result

    def _generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        row_ids: Tensor | None,
        live: Tensor | None,
        seed: int | None,
        ended_everywhere: Callable[[bool], bool] | None = None,
    ) -> RolloutOutput:
        cfg = self.config
        input_ids, attention_mask = self._check_inputs(input_ids, attention_mask)
        batch, prompt_len = input_ids.shape
        n, new_tokens = cfg.samples_per_prompt, cfg.max_new_tokens
        rows = batch * n
        self.adapter.check_length(prompt_len, new_tokens)
        if seed is None:
            seed = cfg.seed if cfg.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        if row_ids is None:
            row_ids = torch.arange(rows, device=self.device)
        over_rows = cfg.max_rows is not None and rows > cfg.max_rows
        if over_rows or not self._fits_kv_budget(batch, rows, prompt_len):
            if ended_everywhere is not None:
                setting = "max_rows" if over_rows else "max_kv_tokens"
                raise ValueError(
                    f"Rollout: RolloutConfig.{setting} cannot stream the rows of a synced generation (every process "
                    "must run as many forwards as the others, and refills prefill where rows end)"
                )
            call = self._stream_call(input_ids, attention_mask, seed, row_ids, live)
        else:
            call = GenerateCall(self, input_ids, attention_mask, seed, row_ids, live, ended_everywhere)
        return self._profiled(lambda timer: run_stages(timer, call))

    def _fits_kv_budget(self, prompts: int, rows: int, prompt_len: int) -> bool:
        """Whether a call's rows fit RolloutConfig.max_kv_tokens at their longest (each prompt's blocks and
        each row's through max_new_tokens and a check interval: `kv_budget.call_blocks`), so that it runs
        as a call (its KV kept for a turn); else it streams under the budget. True without a budget."""
        budget = self.config.max_kv_tokens
        if budget is None:
            return True
        block = self.layout.block_size
        need = call_blocks(prompts, rows, prompt_len, self.config.max_new_tokens, block, FINISHED_CHECK_INTERVAL)
        return need <= budget_blocks(budget, block)

    def _prefill_prompts(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, int]:
        """The prompts as given, one forward over all of them (every row's copy in the expanded baseline):
        (the last positions' logits [B or B*N, vocab], the positions computed)."""
        n = self.config.samples_per_prompt
        if not self.config.shared_prefill and n > 1:
            input_ids = input_ids.repeat_interleave(n, dim=0)
            attention_mask = attention_mask.repeat_interleave(n, dim=0)
        positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        rows, width = input_ids.shape
        self.layout.lay_out_prompts(self.cache, rows, width)
        self.layout.reserve(self.cache, list(range(rows)), [width] * rows)  # (before the views are bound)
        self.cache.bind(self._prefill_kv.bind(self.cache.prompt_views))
        logits = self._prefill_fn(input_ids, self._prefill_attention_mask(attention_mask), positions)
        return logits, input_ids.numel()

    def _prefill_common(self, prompts) -> tuple[Tensor, int]:
        """The prompts after a prefix common to all of them (`rollout.prompts`): the prefix once (prompt 0's
        row), shared with every prompt's row, then every prompt's remainder in one packed forward that
        attends to it: (each prompt's last position's logits [B, vocab], the positions computed)."""
        cache, layout, common = self.cache, self.layout, prompts.common
        batch, length = prompts.ids.shape
        first = length - int(prompts.lengths[0])  # host sync: where prompt 0's tokens start, once per call
        layout.reserve(cache, [0], [common])  # (before the views are bound, as below)
        cache.bind(self._prefill_kv.bind(cache.prompt_views))
        self._prefill_fn(prompts.ids[:1, first : first + common], None, torch.arange(common, device=self.device)[None])
        layout.lay_out_prompts(cache, batch, prompts.width, common)
        layout.share_common(cache, batch, common)
        # Each prompt's row through its own end, where its samples write first: the block that holds that
        # column is copied to each sample when the rows are forked, not shared.
        layout.reserve(cache, list(range(batch)), prompts.ends)
        starts = torch.full((batch,), common, dtype=torch.long, device=self.device)  # each remainder's first column
        packed = pack(prompts.remainders(), starts, starts)
        seen = torch.arange(prompts.width, device=self.device)[None, :].expand(batch, -1) < common  # the common prefix
        context = packed_attention(packed, starts, seen)
        cache.bind(context.bind(cache.prompt_views))
        with attention.rollout_attention(self.adapter.model, context), segmented_mixers(self.adapter, cache):
            logits = self.adapter.packed_logits(cache, packed.ids, packed.positions, packed.column, packed.last)
        return logits, common + packed.tokens

    def _extend(
        self, previous: RolloutOutput, appended, max_new_tokens: int | None, seed: int | None = None
    ) -> tuple[RolloutOutput, RolloutOutput | None]:
        cfg, history = self.config, self._history
        if history is None or previous is not history.output:
            if history is None and self._streamed:
                reason = "; the last call streamed its rows (RolloutConfig.max_rows), which keeps no KV"
            else:
                reason = "" if history is not None else "; there is none: call generate() first"
            raise ValueError(
                "Rollout.extend: previous must be the RolloutOutput that this Rollout's last generate() or "
                "extend() returned (its rows' KV is kept until the next call or release())" + reason
            )
        if max_new_tokens is None:
            max_new_tokens = cfg.max_new_tokens
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"Rollout.extend: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        rows = history.rows
        appended = check_appended(appended, rows, self.adapter.input_vocab, self.device)
        if all(a is None for a in appended):  # every row has finished: nothing to compute
            self._last_profile = None
            return previous, None
        call = ExtendCall(self, history, appended, max_new_tokens, seed)
        return self._profiled(lambda timer: run_stages(timer, call))

    def _stream_call(self, input_ids, attention_mask, seed, row_ids, live) -> StreamCall:
        """More rows than RolloutConfig.max_rows (calls.StreamCall): prompts are prefilled by index into a
        scratch cache as their samples get rows."""
        prompt_len = input_ids.shape[1]
        if self._scratch is None:
            self._scratch = RolloutKVCache(self.adapter.cache_spec, self.dtype, self.device)
        scratch = self._scratch

        def prefill(prompts: list[int]) -> tuple[KVViews, Tensor, Tensor]:
            index = torch.tensor(prompts, device=self.device)
            ids, mask = input_ids[index], attention_mask[index]
            scratch.prepare(DenseLayout(1), len(prompts), len(prompts), (prompt_len,))
            scratch.bind(self._scratch_prefill_kv.bind(scratch.prompt_views))
            positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
            cache_position = torch.arange(prompt_len, device=self.device)
            logits = self.adapter.last_logits(
                scratch, ids, self._prefill_attention_mask(mask), positions, cache_position
            )
            return scratch.prompt_views, logits, mask  # (the next prefill overwrites the scratch cache)

        return StreamCall(self, input_ids, attention_mask, seed, row_ids, live, prefill, scratch)

    def _prefill_forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        cache_position = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.adapter.last_logits(self.cache, input_ids, attention_mask, position_ids, cache_position)

    def _finish(self, input_ids: Tensor, state, response_len: int) -> RolloutOutput:
        logprobs = None if state.logprobs is None else state.logprobs[:, :response_len].clone()
        return self._output(input_ids, state.responses[:, :response_len].clone(), logprobs)

    def _output(self, input_ids: Tensor, responses: Tensor, logprobs: Tensor | None) -> RolloutOutput:
        """The RolloutOutput of the prompts `input_ids` [B, P] and their rows' responses [B*N, R]."""
        prompts = input_ids.repeat_interleave(self.config.samples_per_prompt, dim=0)
        return RolloutOutput(
            torch.cat([prompts, responses], dim=1),
            responses,
            self._response_mask(responses),
            input_ids.shape[1],
            logprobs,
        )

    def _response_mask(self, responses: Tensor) -> Tensor:
        """1 on each row's tokens up to and including its first EOS (every token without EOS ids)."""
        if self._eos is None:
            return torch.ones_like(responses)
        is_eos = torch.isin(responses, self._eos).long()
        return ((is_eos.cumsum(dim=1) - is_eos) == 0).long()

    # --- inputs --------------------------------------------------------------------------------
    def _prefill_attention_mask(self, prompt_mask: Tensor) -> Tensor | None:
        """None when no prompt is padded: the model then builds its own causal mask, which lets SDPA
        use its causal fast path instead of materializing [rows, P, P]. Otherwise a mask that is causal
        and hides pads as keys; a pad query sees itself only, so that no softmax row is empty (pad
        positions' outputs are never used)."""
        if bool(prompt_mask.all()):
            return None
        if self.adapter.has_states:  # the model builds every layer's mask, recurrent layers' padding too
            return prompt_mask
        p = prompt_mask.shape[1]
        causal = torch.ones(p, p, dtype=torch.bool, device=prompt_mask.device).tril()
        allowed = causal[None] & prompt_mask.bool()[:, None, :]
        allowed |= torch.eye(p, dtype=torch.bool, device=prompt_mask.device)[None]
        return self.adapter.prefill_mask(allowed)

    def _check_special_ids(self) -> None:
        """EOS and pad ids must be tokens of this model: a pad id is fed back after EOS, an EOS id
        outside the vocabulary could never end a row."""
        vocab_in, vocab_out = self.adapter.input_vocab, self.adapter.output_vocab
        if vocab_in is not None and not 0 <= self.pad_id < vocab_in:
            raise ValueError(
                f"Rollout: pad_token_id {self.pad_id} is outside the model's vocabulary of {vocab_in} "
                "token ids (set RolloutConfig.pad_token_id)"
            )
        bad = [e for e in self.eos_ids if vocab_out is not None and not 0 <= e < vocab_out]
        if bad:
            raise ValueError(
                f"Rollout: eos_token_id {bad[0]} is outside the model's vocabulary of {vocab_out} "
                "token ids (set RolloutConfig.eos_token_id)"
            )

    def _check_inputs(self, input_ids, attention_mask) -> tuple[Tensor, Tensor]:
        return check_prompts(input_ids, attention_mask, self.device, self.adapter.input_vocab, "Rollout.generate")


def check_prompts(
    input_ids, attention_mask, device: torch.device, vocab: int | None, where: str, require_left_padding: bool = True
) -> tuple[Tensor, Tensor]:
    """Left-padded prompts checked before any work, each problem named for the caller `where`;
    returns them on `device` as int64 ids and a 0/1 int64 mask. With require_left_padding=False the
    mask's layout is left to the caller (the drop-in generate hands other layouts to HF's generate)."""
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"{where}: input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"{where}: input_ids must be 2-D [batch, prompt_length], got shape {tuple(input_ids.shape)}")
    check_has_values(input_ids, "input_ids", where)
    if input_ids.dtype not in (torch.long, torch.int32):  # (what an embedding takes: HF's generate raises too)
        raise TypeError(f"{where}: input_ids must hold token ids as int64 or int32, got {input_ids.dtype}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(
            f"{where}: input_ids is empty (shape {tuple(input_ids.shape)}); need batch >= 1 and prompt_length >= 1"
        )
    input_ids = input_ids.to(device, torch.long)
    low, high = int(input_ids.min()), int(input_ids.max())  # host sync: input checks, once per call
    if low < 0 or (vocab is not None and high >= vocab):
        raise ValueError(
            f"{where}: input_ids must be token ids in [0, {vocab}) (the model's vocabulary), "
            f"got {low if low < 0 else high}"
        )
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids)
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"{where}: attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got {got}")
    check_has_values(attention_mask, "attention_mask", where)
    if attention_mask.dtype.is_complex:
        raise TypeError(f"{where}: attention_mask must hold 0 and 1, got dtype {attention_mask.dtype}")
    mask = attention_mask.to(device)
    if not bool(((mask == 0) | (mask == 1)).all()):  # before any conversion: 0.5 must not become 0
        raise ValueError(f"{where}: attention_mask must hold only 0 and 1")
    mask = mask.long()
    fault = left_padding_fault(mask) if require_left_padding else None
    if fault is not None:
        raise ValueError(
            f"{where}: attention_mask must be left-padded (zeros first, then ones) with at least "
            f"one token per row, got a mask with {'an' if fault == 'empty row' else 'a'} {fault}"
        )
    return input_ids, mask
