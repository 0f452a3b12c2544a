"""N samples per prompt from a Hugging Face causal LM, prefilling each unique prompt once.

    rollout = Rollout(model, RolloutConfig(samples_per_prompt=4, max_new_tokens=32))
    out = rollout.generate(input_ids, attention_mask=None)   # input_ids: LongTensor [B, P]

Stages: prompt expansion (the expanded baseline repeats prompts N times; shared prefill does not),
prefill (one forward over the prompts, last-position logits only), kv_expand (one repeat_kv_cache_
call over the whole KV buffer, shared prefill only), decode (statically shaped steps over B*N rows)
and post-processing. With `compile=True` prefill and decode are compiled separately: prefill with
dynamic shapes, decode with fullgraph=True, under CUDA graphs on CUDA.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from .hf import ModelAdapter
from .kv_cache import RolloutKVCache
from .profiling import RolloutProfile, StageTimer
from .sampling import SamplingParams, row_keys, sample

__all__ = ["Rollout", "RolloutConfig", "RolloutOutput", "RolloutProfile"]

# The all-rows-ended check syncs with the host, so decode makes it only every this many steps.
FINISHED_CHECK_INTERVAL = 8
# Compiled decode is specialized to the KV length; rounding it up to a multiple of this lets prompts of
# nearby lengths share one graph, at the cost of attending over a few more (masked) slots.
COMPILED_KV_LENGTH_MULTIPLE = 64


@dataclasses.dataclass
class RolloutConfig:
    samples_per_prompt: int = 1
    max_new_tokens: int = 32
    shared_prefill: bool = True
    enable_profiling: bool = False
    compile: bool = False
    cuda_graphs: bool = True  # decode under CUDA graphs when compiled on CUDA
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    eos_token_id: int | list[int] | None = None  # None: the model's generation config; []: none
    pad_token_id: int | None = None  # None: the model's generation config; 0 is a valid id

    def __post_init__(self):
        def need(ok: bool, field: str, what: str):
            if not ok:
                raise ValueError(f"RolloutConfig.{field} {what}, got {getattr(self, field)!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_int(self.samples_per_prompt) and self.samples_per_prompt >= 1, "samples_per_prompt", "must be an int >= 1")
        need(is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens", "must be an int >= 1")
        for flag in ("shared_prefill", "enable_profiling", "compile", "cuda_graphs"):
            need(isinstance(getattr(self, flag), bool), flag, "must be a bool")
        need(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
             and 0.0 <= self.temperature < float("inf"), "temperature", "must be a finite number >= 0")
        need(is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an int >= 0")
        need(isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool) and 0.0 < self.top_p <= 1.0,
             "top_p", "must be in (0, 1]")
        need(self.seed is None or (is_int(self.seed) and self.seed >= 0), "seed", "must be None or an int >= 0")
        eos = self.eos_token_id
        need(eos is None or (is_int(eos) and eos >= 0)
             or (isinstance(eos, (list, tuple)) and all(is_int(e) and e >= 0 for e in eos)),
             "eos_token_id", "must be None, an int >= 0 or a list of them (empty: never stop early)")
        need(self.pad_token_id is None or (is_int(self.pad_token_id) and self.pad_token_id >= 0),
             "pad_token_id", "must be None or an int >= 0")


@dataclasses.dataclass
class RolloutOutput:
    sequences: Tensor  # [B*N, P+R]: each prompt (as given, padding included) followed by its response
    responses: Tensor  # [B*N, R]
    response_mask: Tensor  # [B*N, R]: 1 for generated tokens up to and including the first EOS
    prompt_length: int  # P


class _DecodeState:
    """Statically shaped tensors that the decode step reads and updates in place."""

    def __init__(self, rows: int, max_len: int, max_new_tokens: int, device: torch.device):
        self.shape = (rows, max_len, max_new_tokens)
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)  # the token fed next
        self.position_ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.valid = torch.zeros(rows, max_len, dtype=torch.bool, device=device)  # keys a row may see
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # index of the token sampled next
        self.keys = torch.zeros(rows, dtype=torch.long, device=device)  # per-row sampling keys
        self.responses = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=device)
        for t in vars(self).values():
            if isinstance(t, Tensor):
                torch._dynamo.mark_static_address(t)


class Rollout:
    def __init__(self, model: nn.Module, config: RolloutConfig | None = None):
        self.config = config if config is not None else RolloutConfig()
        if not isinstance(self.config, RolloutConfig):
            raise TypeError(f"Rollout: config must be a RolloutConfig, got {type(self.config).__name__}")
        self.adapter = ModelAdapter(model)
        self.model = model
        self.device, self.dtype = self.adapter.device, self.adapter.dtype
        self.cache = RolloutKVCache(self.adapter.kv_shape, self.dtype, self.device)
        self.eos_ids = self.adapter.eos_ids(self.config.eos_token_id)
        self.pad_id = self.adapter.pad_id(self.config.pad_token_id, self.eos_ids)
        self._eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        self._params = SamplingParams(float(self.config.temperature), self.config.top_k, float(self.config.top_p))
        self._state: _DecodeState | None = None
        self._last_profile: RolloutProfile | None = None
        self._use_cuda_graphs = self.config.compile and self.config.cuda_graphs and self.device.type == "cuda"
        if self.config.compile:
            self._prefill_fn = torch.compile(self._prefill, dynamic=True)
            self._decode_fn = torch.compile(
                self._decode_step, fullgraph=True, mode="reduce-overhead" if self._use_cuda_graphs else None
            )
        else:
            self._prefill_fn, self._decode_fn = self._prefill, self._decode_step

    # --- public API ----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> RolloutOutput:
        cfg = self.config
        input_ids, attention_mask = self._check_inputs(input_ids, attention_mask)
        batch, prompt_len = input_ids.shape
        n = cfg.samples_per_prompt
        rows, new_tokens = batch * n, cfg.max_new_tokens
        self.adapter.check_length(prompt_len + new_tokens)
        max_len = prompt_len + new_tokens - 1  # the last sampled token is never fed back
        if cfg.compile:
            max_len = -(-max_len // COMPILED_KV_LENGTH_MULTIPLE) * COMPILED_KV_LENGTH_MULTIPLE
        seed = cfg.seed if cfg.seed is not None else int(torch.randint(0, 2**62, (1,)).item())

        timer = StageTimer(self.device, cfg.enable_profiling)
        timer.start()
        with timer.stage("prompt_expansion"):
            prefill_ids, prefill_mask = input_ids, attention_mask
            if not cfg.shared_prefill and n > 1:
                prefill_ids = input_ids.repeat_interleave(n, dim=0)
                prefill_mask = attention_mask.repeat_interleave(n, dim=0)
            prefill_positions = (prefill_mask.cumsum(dim=1) - 1).clamp(min=0)
            prefill_attn = self._prefill_attention_mask(prefill_mask)

        with timer.stage("prefill"):
            self.cache.prepare(rows, max_len)
            self.cache.start_prefill()
            logits = self._prefill_fn(prefill_ids, prefill_attn, prefill_positions)

        with timer.stage("kv_expand"):
            if cfg.shared_prefill and n > 1:
                self.cache.expand_prompts(batch, n, prompt_len)
                logits = logits.repeat_interleave(n, dim=0)

        with timer.stage("decode"):
            state = self._start_decode(rows, max_len, attention_mask, seed, logits)
            steps = 0
            while steps + 1 < new_tokens:
                if self._use_cuda_graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                self._decode_fn()
                steps += 1
                if steps % FINISHED_CHECK_INTERVAL == 0 and bool(state.finished.all()):
                    break
            response_len = steps + 1

        with timer.stage("post_processing"):
            out = self._finish(input_ids, state, response_len)
            generated = int(out.response_mask.sum())

        self._last_profile = None
        if cfg.enable_profiling:
            ms = timer.elapsed_ms()
            self._last_profile = RolloutProfile(
                prompt_expansion_ms=ms["prompt_expansion"], prefill_ms=ms["prefill"], kv_expand_ms=ms["kv_expand"],
                decode_ms=ms["decode"], generation_ms=ms["prefill"] + ms["kv_expand"] + ms["decode"],
                post_processing_ms=ms["post_processing"], total_ms=ms["total"], generated_tokens=generated,
                tokens_per_second=generated / (ms["total"] / 1e3) if ms["total"] > 0 else 0.0,
                decode_steps=steps, batch_size=batch, samples_per_prompt=n, prompt_length=prompt_len,
                response_length=response_len, peak_memory_bytes=timer.peak_memory_bytes(),
            )
        return out

    def get_last_profile(self) -> RolloutProfile | None:
        """The profile of the last `generate()` call, or None when profiling was off."""
        return self._last_profile

    def release(self) -> None:
        """Free the KV buffer and decode state; the next `generate()` allocates them again."""
        self.cache.release()
        self._state = None

    # --- stages --------------------------------------------------------------------------------
    def _prefill(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        cache_position = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.adapter.last_logits(self.cache, input_ids, attention_mask, position_ids, cache_position)

    def _decode_step(self) -> None:
        """Feed each row's last token, sample the next; everything static, no host sync."""
        s, cache = self._state, self.cache
        s.valid.index_fill_(1, cache.write_pos, True)
        mask = self.adapter.attention_mask(s.valid[:, None, :])
        logits = self.adapter.last_logits(cache, s.tokens, mask, s.position_ids, cache.write_pos)
        self._accept(sample(logits, self._params, s.keys, s.step))
        s.position_ids.add_(1)
        cache.write_pos.add_(1)

    def _accept(self, sampled: Tensor) -> None:
        """Record sampled tokens [rows] at index `step`: rows that already ended get the pad id."""
        s = self._state
        token = torch.where(s.finished, self.pad_id, sampled)
        s.responses.index_copy_(1, s.step, token[:, None])
        s.finished.logical_or_(torch.isin(token, self._eos))
        s.tokens.copy_(token[:, None])
        s.step.add_(1)

    def _start_decode(self, rows, max_len, prompt_mask, seed, first_logits) -> _DecodeState:
        n, new_tokens = self.config.samples_per_prompt, self.config.max_new_tokens
        if self._state is None or self._state.shape != (rows, max_len, new_tokens):
            self._state = _DecodeState(rows, max_len, new_tokens, self.device)
        s = self._state
        row_mask = prompt_mask.repeat_interleave(n, dim=0).bool()
        prompt_len = prompt_mask.shape[1]
        s.valid.zero_()
        s.valid[:, :prompt_len] = row_mask
        s.position_ids.copy_(row_mask.sum(dim=1, keepdim=True))
        s.finished.zero_()
        s.step.zero_()
        s.keys.copy_(row_keys(seed, rows, self.device))
        self._accept(sample(first_logits, self._params, s.keys, s.step))
        self.cache.start_decode(prompt_len)
        return s

    def _finish(self, input_ids: Tensor, state: _DecodeState, response_len: int) -> RolloutOutput:
        n = self.config.samples_per_prompt
        responses = state.responses[:, :response_len].clone()
        is_eos = torch.isin(responses, self._eos).long()
        ended_before = (is_eos.cumsum(dim=1) - is_eos) > 0
        response_mask = (~ended_before).long()
        prompts = input_ids.repeat_interleave(n, dim=0)
        return RolloutOutput(torch.cat([prompts, responses], dim=1), responses, response_mask, input_ids.shape[1])

    # --- inputs --------------------------------------------------------------------------------
    def _prefill_attention_mask(self, prompt_mask: Tensor) -> Tensor | None:
        """None when no prompt is padded: the model then builds its own causal mask, which lets SDPA
        use its causal fast path instead of materializing [rows, P, P]. Otherwise a mask that is causal
        and hides pads as keys; a pad query sees itself only, so that no softmax row is empty (pad
        positions' outputs are never used)."""
        if bool(prompt_mask.all()):
            return None
        p = prompt_mask.shape[1]
        causal = torch.ones(p, p, dtype=torch.bool, device=prompt_mask.device).tril()
        allowed = causal[None] & prompt_mask.bool()[:, None, :]
        allowed |= torch.eye(p, dtype=torch.bool, device=prompt_mask.device)[None]
        return self.adapter.attention_mask(allowed)

    def _check_inputs(self, input_ids, attention_mask) -> tuple[Tensor, Tensor]:
        if not isinstance(input_ids, Tensor):
            raise TypeError(f"Rollout.generate: input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(f"Rollout.generate: input_ids must be 2-D [batch, prompt_length], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.long, torch.int32):
            raise TypeError(f"Rollout.generate: input_ids must hold integer token ids, got {input_ids.dtype}")
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"Rollout.generate: input_ids is empty (shape {tuple(input_ids.shape)}); need batch >= 1 and prompt_length >= 1")
        input_ids = input_ids.to(self.device, torch.long)
        if attention_mask is None:
            return input_ids, torch.ones_like(input_ids)
        if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
            got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise ValueError(f"Rollout.generate: attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got {got}")
        mask = attention_mask.to(self.device, torch.long)
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("Rollout.generate: attention_mask must hold only 0 and 1")
        if not bool((mask[:, 1:] >= mask[:, :-1]).all()) or not bool(mask[:, -1].all()):
            raise ValueError(
                "Rollout.generate: attention_mask must be left-padded (zeros first, then ones) with at least one token per row"
            )
        return input_ids, mask
