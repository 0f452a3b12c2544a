"""`RolloutConfig`, what a Rollout is asked to do (every field checked when it is made), and
`RolloutOutput`, what a call returns."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from .layouts import LAYOUTS

__all__ = ["RolloutConfig", "RolloutOutput", "MIN_TEMPERATURE"]

# A positive temperature below this would overflow logits / temperature in float32 (1e-44 did): use 0.
MIN_TEMPERATURE = 1e-6
_INT64_MAX = 2**63 - 1


@dataclasses.dataclass
class RolloutConfig:
    samples_per_prompt: int = 1
    max_new_tokens: int = 32
    min_new_tokens: int = 0  # EOS ids cannot be sampled before this many new tokens
    shared_prefill: bool = True
    enable_profiling: bool = False
    compile: bool = False
    cuda_graphs: bool = True  # on CUDA, replay decode steps from CUDA graphs (eager or compiled)
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    eos_token_id: int | list[int] | None = None  # None: the model's generation config; []: none
    pad_token_id: int | None = None  # None: the model's generation config; 0 is a valid id
    # Every layout keeps the KV in a pool of blocks of 16 tokens taken as rows grow, a prompt's whole blocks
    # shared by its rows by reference (torchkvops.rollout.paged_store); the name says how a decode step reads
    # a prompt's blocks: "copy": each row through its own table; "prefix": once for its rows' stacked queries,
    # merged with each row's own keys; "paged": "prefix" from 256 tokens of whole blocks, "copy" below (what
    # measured faster on each side). None: "paged", or "copy" where shared_prefill=False (the expanded
    # baseline: every row prefilled alone into blocks of its own).
    kv_sharing: str | None = None
    return_logprobs: bool = False  # RolloutOutput.logprobs: each token's log-probability as sampled
    lm_head_dtype: torch.dtype | None = None  # torch.float32: run a half-precision model's LM head in float32
    # As rows end, decode goes on with the live rows only (gathered into a smaller batch at the all-ended
    # check, every few steps): decode cost follows the tokens still being generated. Same tokens either way.
    compact_finished_rows: bool = True
    # The most sample rows decoded at once (None: every row). With more rows than this the rollout streams:
    # one batch of max_rows rows, each ended row taken by a waiting sample (its prompt prefilled when its
    # first sample starts; torchkvops.rollout.streaming). Same tokens either way.
    max_rows: int | None = None
    # The most KV tokens the rows hold at once (None: no bound; the pool's blocks of 16 tokens, which it counts;
    # with a shared prefill): rows start while blocks are free, and when the rows' growth runs the budget out the newest
    # are preempted and restarted later from their prompts, with the same tokens (torchkvops.rollout.kv_budget).
    # A call whose rows fit at their longest runs as without it. Prefill scratch and recurrent states apart.
    max_kv_tokens: int | None = None
    # A prefix that every prompt of a call begins with (a system prompt), at least this many tokens long, is
    # computed once, its whole blocks shared by every row. None: never
    # looked for. Same tokens either way (torchkvops.rollout.prompts).
    min_shared_tokens: int | None = 32

    def __post_init__(self):
        self._check_lengths_and_flags()
        self._check_sampling()
        self._check_token_ids()
        if self.kv_sharing is None:
            self.kv_sharing = "paged" if self.shared_prefill is True else "copy"
        self._check_layout_and_budgets()

    def _need(self, ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ValueError(f"RolloutConfig.{field} {what}, got {getattr(self, field)!r}")

    def _check_lengths_and_flags(self) -> None:
        need = self._need
        need(
            _is_int(self.samples_per_prompt) and self.samples_per_prompt >= 1,
            "samples_per_prompt",
            "must be an int >= 1",
        )
        need(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens", "must be an int >= 1")
        need(
            _is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be an int in [0, max_new_tokens={self.max_new_tokens}]",
        )
        for flag in (
            "shared_prefill",
            "enable_profiling",
            "compile",
            "cuda_graphs",
            "return_logprobs",
            "compact_finished_rows",
        ):
            need(isinstance(getattr(self, flag), bool), flag, "must be a bool")
        need(
            self.lm_head_dtype in (None, torch.float32),
            "lm_head_dtype",
            "must be None (the model's dtype) or torch.float32",
        )

    def _check_sampling(self) -> None:
        need = self._need
        t = self.temperature
        need(
            isinstance(t, (int, float))
            and not isinstance(t, bool)
            and math.isfinite(t)
            and (t == 0 or t >= MIN_TEMPERATURE),
            "temperature",
            f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (smaller ones overflow the scaled logits)",
        )
        need(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an int >= 0")
        need(
            isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool) and 0.0 < self.top_p <= 1.0,
            "top_p",
            "must be in (0, 1]",
        )
        need(self.seed is None or _is_id(self.seed), "seed", "must be None or an int in [0, 2**63)")

    def _check_token_ids(self) -> None:
        eos = self.eos_token_id
        self._need(
            eos is None or _is_id(eos) or (isinstance(eos, (list, tuple)) and all(_is_id(e) for e in eos)),
            "eos_token_id",
            "must be None, a token id (an int in [0, 2**63)) or a list of them (empty: never stop early)",
        )
        self._need(
            self.pad_token_id is None or _is_id(self.pad_token_id),
            "pad_token_id",
            "must be None or a token id (an int in [0, 2**63))",
        )

    def _check_layout_and_budgets(self) -> None:
        need = self._need
        need(self.kv_sharing in LAYOUTS, "kv_sharing", f"must be one of {', '.join(map(repr, LAYOUTS))}")
        need(
            self.shared_prefill or not LAYOUTS[self.kv_sharing].needs_shared_prefill,
            "kv_sharing",
            f"{self.kv_sharing!r} needs shared_prefill=True (the expanded baseline has no shared prompt to keep once)",
        )
        need(
            self.max_rows is None or (_is_int(self.max_rows) and self.max_rows >= 1),
            "max_rows",
            "must be None (every row at once) or an int >= 1",
        )
        need(
            self.max_rows is None or self.max_rows >= self.samples_per_prompt,
            "max_rows",
            f"must hold at least one prompt's samples_per_prompt={self.samples_per_prompt} rows (a prompt's "
            "samples decode together)",
        )
        need(
            self.max_kv_tokens is None or (_is_int(self.max_kv_tokens) and self.max_kv_tokens >= 1),
            "max_kv_tokens",
            "must be None (no bound) or an int >= 1",
        )
        need(
            self.max_kv_tokens is None or self.shared_prefill is True,
            "max_kv_tokens",
            "counts the blocks of the pool a shared prefill writes: it needs shared_prefill=True (the expanded "
            "baseline, every row's prompt prefilled alone, is a measurement, not scheduled by a KV budget)",
        )
        need(
            self.min_shared_tokens is None or (_is_int(self.min_shared_tokens) and self.min_shared_tokens >= 1),
            "min_shared_tokens",
            "must be None (no common prefix looked for) or an int >= 1",
        )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_id(v) -> bool:
    """A token id or a seed: an int64 >= 0."""
    return _is_int(v) and 0 <= v <= _INT64_MAX


@dataclasses.dataclass
class RolloutOutput:
    sequences: Tensor  # [B*N, P+R]: each prompt (as given, padding included) followed by its response
    responses: Tensor  # [B*N, R]
    response_mask: Tensor  # [B*N, R]: 1 for generated tokens up to and including the first EOS
    prompt_length: int  # P
    # [B*N, R] float32 with return_logprobs, else None: each generated token's log-probability under the
    # distribution it was sampled from (logits / temperature over what top-k / top-p keep, renormalized;
    # greedy: log_softmax of the logits); 0 where response_mask is 0.
    logprobs: Tensor | None = None
