"""The modes, one call at a time: each mode's runner makes one Rollout or Hugging Face generate call
for a case's prompts (run) and then reports that call's profile (profile); timed_call times the whole
call with the clock every mode shares.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..rollout import Rollout, RolloutConfig
from ..rollout.profiling import Clock
from . import lengths
from .cases import HF_MODES, MODES, PROFILE_FIELDS, ROLLOUT_MODES, Case, Settings

__all__ = ["DECODE_STEP_NOTE", "make_runner", "timed_call"]

DECODE_STEP_NOTE = {
    "rollout modes": "decode_ms / decode_steps from the rollout's profile: its decode stage (sampling the first token "
    "from the prefill logits, then R-1 decode steps) over its R-1 steps",
    "hf modes": "forward pre-hooks on the model record the clock at the start of every forward during the timed call "
    "(CUDA events, no synchronize in the hook); the first forward is the prefill. prefill_ms = start of "
    "the second forward - start of the first; decode_ms = end of the call - start of the second forward; "
    "decode_steps = forwards - 1; decode_ms_per_step = decode_ms / decode_steps",
}


def rollout_config(case: Case, mode: str, s: Settings, eos_token_id: list[int], **options) -> RolloutConfig:
    """The RolloutConfig of a rollout mode (ROLLOUT_MODES: a layout, `-nocompact` turning compaction off)
    for one case, with the run's sampling settings; `options`: further RolloutConfig fields."""
    layout = mode.removesuffix("-nocompact")
    return RolloutConfig(
        samples_per_prompt=case.samples_per_prompt,
        max_new_tokens=case.response_length,
        shared_prefill=layout != "expanded",
        kv_sharing=layout if layout in ("prefix", "paged") else "copy",
        compile=s.compile,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=s.seed,
        eos_token_id=eos_token_id,
        compact_finished_rows=not mode.endswith("-nocompact"),
        max_rows=s.max_rows,
        max_kv_tokens=s.max_kv_tokens if layout == "paged" else None,
        **options,
    )


def hf_sampling(prompts: Tensor, case: Case, s: Settings) -> tuple[Tensor, dict]:
    """The input ids and generate() sampling arguments that make HF generate N samples per prompt in
    the rollout's row order, as the run's settings ask."""
    if s.greedy:
        # HF refuses greedy search with num_return_sequences > 1: repeat the prompts instead
        # (repeat_interleave, the rollout's row order).
        return prompts.repeat_interleave(case.samples_per_prompt, dim=0), dict(do_sample=False)
    return prompts, dict(
        do_sample=True, num_return_sequences=case.samples_per_prompt, temperature=s.temperature, top_p=s.top_p, top_k=0
    )  # top_k=0: off, as in the rollout (HF's default is 50)


class _RolloutRunner:
    """One rollout mode. run() is one generate call; profile() reads its stage times afterwards."""

    def __init__(self, model: nn.Module, case: Case, mode: str, s: Settings, prompts: Tensor):
        self.prompts = prompts
        eos = lengths.eos_id(model)
        # fixed lengths: no EOS, every mode generates exactly R tokens; else the length profile's EOS
        self.rollout = Rollout(
            model, rollout_config(case, mode, s, [] if eos is None else [eos], enable_profiling=True)
        )

    def run(self) -> Tensor:
        return self.rollout.generate(self.prompts).responses

    def profile(self, clock: Clock, end) -> dict:
        p = self.rollout.get_last_profile().to_dict()
        p["rollout_total_ms"] = p["total_ms"]
        p["peak_memory_bytes"] = None  # while modes interleave, other modes' buffers are held too: see PEAK_NOTE
        return p

    def free(self) -> None:
        self.rollout.release()

    def close(self) -> None:
        self.free()


class _HFRunner:
    """model.generate, default or static cache. A forward pre-hook records the clock at the start of
    every forward of this runner's calls (DECODE_STEP_NOTE). It is registered for this runner's calls
    only: the rollout's modes share the model, and their compiled decode (`--compile`, one graph) cannot
    call a hook that runs outside graphs. Each call registers the same function, and Dynamo does not guard
    on a module's hooks (`skip_nnmodule_hook_guards`), so HF's compiled decode (hf-static on CUDA) is not
    recompiled between calls."""

    def __init__(
        self, model: nn.Module, case: Case, s: Settings, prompts: Tensor, pad_token_id: int, clock: Clock, static: bool
    ):
        self.model, self.case, self.s, self.clock = model, case, s, clock
        self.eos = lengths.eos_id(model)
        # Fixed lengths: no EOS at all, as the rollout's eos_token_id=[] (with an EOS, min_new_tokens would
        # mask its logit and greedy tokens could differ from the rollout's). Else the length profile's EOS.
        self.kwargs = dict(
            max_new_tokens=case.response_length,
            min_new_tokens=case.response_length if self.eos is None else 0,
            pad_token_id=pad_token_id,
            use_cache=True,
            eos_token_id=self.eos,
        )
        if static:
            self.kwargs["cache_implementation"] = "static"
        self.input_ids, sampling = hf_sampling(prompts, case, s)
        self.kwargs.update(sampling)
        self.attention_mask = torch.ones_like(self.input_ids)
        self._recording: list | None = None  # the marks of the call under way
        self.marks: list = []  # the marks of the last call

        def mark(module, args):
            if self._recording is not None:
                self._recording.append(clock.mark())

        # Outside any compiled graph: a compiled call breaks its graph here and runs the hook eagerly.
        self._mark = torch.compiler.disable(mark)

    def run(self) -> Tensor:
        torch.manual_seed(self.s.seed)
        self._recording = []
        hook = self.model.register_forward_pre_hook(self._mark)
        try:
            out = self.model.generate(self.input_ids, attention_mask=self.attention_mask, **self.kwargs)
        finally:
            hook.remove()
            self.marks, self._recording = self._recording, None
        c = self.case
        responses = out[:, c.prompt_length :]
        shape = tuple(responses.shape)
        # Without EOS exactly R tokens; with one, HF stops when every row has ended.
        if shape[0] != c.rows or shape[1] > c.response_length or (self.eos is None and shape[1] < c.response_length):
            raise RuntimeError(
                f"Hugging Face generate returned responses of shape {shape}, expected "
                f"{(c.rows, c.response_length)}" + ("" if self.eos is None else " or fewer columns")
            )
        self.generated = c.rows * shape[1] if self.eos is None else int(_up_to_first_eos(responses, self.eos).sum())
        return responses

    def profile(self, clock: Clock, end) -> dict:
        c, marks = self.case, self.marks
        if not marks:
            raise RuntimeError("Hugging Face generate ran no forward through the model (the timing hook saw none)")
        profile = dict.fromkeys(PROFILE_FIELDS)  # the stages it cannot report stay None
        second = marks[1] if len(marks) > 1 else end
        profile.update(
            prefill_ms=clock.ms(marks[0], second),
            decode_ms=clock.ms(second, end),
            decode_steps=len(marks) - 1,
            generated_tokens=self.generated,
            batch_size=c.batch_size,
            samples_per_prompt=c.samples_per_prompt,
            prompt_length=c.prompt_length,
            response_length=c.response_length,
            # every row runs every forward (the prefill's logits give the first token)
            computed_row_steps=c.rows * len(marks),
            useful_row_steps=self.generated,
        )
        return profile

    def free(self) -> None:
        pass

    def close(self) -> None:
        pass


def _up_to_first_eos(responses: Tensor, eos: int) -> Tensor:
    """1 for each token up to and including a row's first EOS (the rollout's response_mask)."""
    is_eos = (responses == eos).long()
    return (is_eos.cumsum(dim=1) - is_eos) == 0


def make_runner(mode: str, model: nn.Module, case: Case, s: Settings, prompts: Tensor, pad_token_id: int, clock: Clock):
    # (the modes of a case are made together)
    lengths.set_response_length(model, case.response_length, prompt_length=case.prompt_length)
    if mode in ROLLOUT_MODES:
        return _RolloutRunner(model, case, mode, s, prompts)
    if mode in HF_MODES:
        return _HFRunner(model, case, s, prompts, pad_token_id, clock, static=mode == "hf-static")
    raise ValueError(f"bench: unknown mode {mode!r}; choose from {', '.join(MODES)}")


def timed_call(runner, clock: Clock) -> tuple[dict, Tensor]:
    """One call of a mode, timed around the whole call by the shared clock (TIMING_NOTE)."""
    start = clock.mark()
    responses = runner.run()
    end = clock.mark()
    clock.wait()
    profile = runner.profile(clock, end)
    total = clock.ms(start, end)
    profile["total_ms"] = total
    profile["tokens_per_second"] = profile["generated_tokens"] / (total / 1e3) if total > 0 else 0.0
    computed = profile.get("computed_row_steps")
    profile["useful_fraction"] = profile["useful_row_steps"] / computed if computed else None
    return profile, responses
