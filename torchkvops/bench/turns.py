"""Multi-turn rollouts (`torchkvops bench-turns`): an agent's workload, the KV kept across turns against
prefilling every turn's whole history again.

A case is B prompts of P tokens x N samples, K turns: each turn generates R tokens per row (no EOS, so
every mode does the same work), and after every turn but the last T tokens are appended to each row (a
tool's answer: random ids, the same in every mode). Modes:

  reuse     one Rollout: `generate`, then `Rollout.extend` per turn (each row's KV kept; a turn prefills
            its rows' appended tokens and last token)
  no-reuse  the rollout without reuse: turn 1 as `reuse`, then each turn a new `generate` over the B x N
            full histories (prompt, responses, appended), one row per history: what `patch_generate`
            served for a tool turn before it kept the KV
  hf        HF generate: turn 1 on the prompts repeated N times (TRL's layout), then each turn on the full
            histories, as TRL's tool loop calls it on its non-vLLM path

Per turn and mode: prefill tokens (positions the prefill computed), prefill ms, decode ms (HF: the
first forward of the call is its prefill, the rest its decode), the whole turn. The modes run
interleaved (A B C A B C ...) for `iterations` rounds after `warmup`; medians are reported.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from ..rollout import Rollout, RolloutConfig
from ..rollout.profiling import Clock

__all__ = ["TurnsCase", "MODES", "measure", "format_table", "NOTES"]

MODES = ("reuse", "no-reuse", "hf")
NOTES = {
    "prefill_tokens": "token positions the turn's prefill computed (padding included); reuse: each row's appended "
    "tokens and last token after turn 1; no-reuse and hf: every row's whole history",
    "prefill_ms": "the prefill stage (hf: the call's first forward)",
    "decode_ms": "the decode stage (hf: the call's other forwards and sampling)",
    "total_ms": "the whole turn, as the caller sees it (median over rounds)",
    "turn_tokens_over_appended": "reuse: the positions the turns after the first computed over the tokens they "
    "appended (each row's chunk is its last token + its appended tokens, packed without padding)",
}


@dataclasses.dataclass(frozen=True)
class TurnsCase:
    prompts: int  # B
    samples: int  # N
    prompt_length: int  # P
    turns: int  # K
    response_length: int  # R
    append_length: int  # T
    # "fixed": every row appends T tokens; "uniform": each row a length drawn from [1, T] (tool answers of
    # different lengths: what a padded turn would pad to the longest)
    append_profile: str = "fixed"

    @property
    def rows(self) -> int:
        return self.prompts * self.samples


class _ForwardTimes:
    """Each forward of a model timed by the harness's Clock (pre- and post-hooks), for HF generate's
    prefill/decode split; read `times()` after the call."""

    def __init__(self, model: nn.Module, clock: Clock):
        self.clock, self.marks = clock, []
        self._hooks = [
            model.register_forward_pre_hook(lambda *_: self.marks.append(clock.mark())),
            model.register_forward_hook(lambda *_: self.marks.append(clock.mark())),
        ]

    def times(self) -> list[float]:
        self.clock.wait()
        return [self.clock.ms(a, b) for a, b in zip(self.marks[::2], self.marks[1::2])]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def appended_tokens(case: TurnsCase, vocab: int, seed: int) -> list[list[Tensor]]:
    """[turn][row]: the tokens appended after each turn but the last, random ids in [3, vocab), of
    case.append_length tokens each or (the "uniform" profile) of a length drawn from [1, append_length]."""
    g = torch.Generator().manual_seed(seed + 1)

    def length() -> int:
        if case.append_profile == "fixed" or case.append_length == 0:
            return case.append_length
        return int(torch.randint(1, case.append_length + 1, (1,), generator=g))

    return [
        [torch.randint(3, vocab, (length(),), generator=g) for _ in range(case.rows)] for _ in range(case.turns - 1)
    ]


def _left_pad(rows: list[Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    """1-D token id tensors as one left-padded batch: (ids [rows, longest] with pad_id before each row, its
    0/1 mask)."""
    ids = pad_sequence([r.flip(0) for r in rows], batch_first=True, padding_value=-1).flip(1)
    real = ids >= 0
    return ids.clamp(min=0).masked_fill(~real, pad_id), real.long()


def _config(case: TurnsCase, samples: int, temperature: float, seed: int) -> RolloutConfig:
    return RolloutConfig(
        samples_per_prompt=samples,
        max_new_tokens=case.response_length,
        temperature=temperature,
        seed=seed,
        eos_token_id=[],
        pad_token_id=0,
        enable_profiling=True,
    )


def _profile_record(rollout: Rollout, total_ms: float) -> dict:
    p = rollout.get_last_profile()
    return {
        "prefill_tokens": p.prefill_tokens,
        "reused_tokens": p.reused_tokens,
        "prefill_ms": p.prefill_ms + p.prompt_expansion_ms + p.kv_expand_ms,
        "decode_ms": p.decode_ms,
        "total_ms": total_ms,
    }


def _timed(device: torch.device, fn):
    """(fn(), its wall time in ms by the harness's Clock)."""
    clock = Clock(device)
    start = clock.mark()
    out = fn()
    end = clock.mark()
    clock.wait()
    return out, clock.ms(start, end)


def run_reuse(model, case: TurnsCase, prompts: Tensor, appended, temperature: float, seed: int) -> list[dict]:
    rollout = Rollout(model, _config(case, case.samples, temperature, seed))
    out, ms = _timed(prompts.device, lambda: rollout.generate(prompts))
    records = [_profile_record(rollout, ms)]
    for turn in range(case.turns - 1):
        rows = [a.to(prompts.device) for a in appended[turn]]
        out, ms = _timed(prompts.device, lambda: rollout.extend(out, rows))
        records.append(_profile_record(rollout, ms))
    rollout.release()
    return records


def run_no_reuse(model, case: TurnsCase, prompts: Tensor, appended, temperature: float, seed: int) -> list[dict]:
    first = Rollout(model, _config(case, case.samples, temperature, seed))
    out, ms = _timed(prompts.device, lambda: first.generate(prompts))
    records = [_profile_record(first, ms)]
    histories = list(out.sequences)
    first.release()
    rollout = Rollout(model, _config(case, 1, temperature, seed))
    for turn in range(case.turns - 1):
        rows = [torch.cat([h, a.to(h.device)]) for h, a in zip(histories, appended[turn])]
        ids, mask = _left_pad(rows, 0)
        out, ms = _timed(prompts.device, lambda: rollout.generate(ids, mask))
        records.append(_profile_record(rollout, ms))
        histories = [torch.cat([r, resp]) for r, resp in zip(rows, out.responses)]
    rollout.release()
    return records


def run_hf(model, case: TurnsCase, prompts: Tensor, appended, temperature: float, seed: int) -> list[dict]:
    kwargs = dict(max_new_tokens=case.response_length, eos_token_id=None, pad_token_id=0)
    kwargs.update(dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else {})
    torch.manual_seed(seed)
    ids = prompts.repeat_interleave(case.samples, dim=0)
    mask = torch.ones_like(ids)
    records, histories = [], None
    for turn in range(case.turns):
        if turn:
            rows = [torch.cat([h, a.to(h.device)]) for h, a in zip(histories, appended[turn - 1])]
            ids, mask = _left_pad(rows, 0)
        forwards = _ForwardTimes(model, Clock(prompts.device))
        try:
            with torch.no_grad():
                out, ms = _timed(prompts.device, lambda: model.generate(ids, attention_mask=mask, **kwargs))
        finally:
            forwards.remove()
        prefill = forwards.times()[0]
        records.append(
            {
                "prefill_tokens": ids.numel(),
                "reused_tokens": 0,
                "prefill_ms": prefill,
                "decode_ms": ms - prefill,
                "total_ms": ms,
            }
        )
        histories = [
            row[m.bool()] for row, m in zip(out, torch.cat([mask, torch.ones_like(out[:, ids.shape[1] :])], 1))
        ]
    return records


RUNNERS = {"reuse": run_reuse, "no-reuse": run_no_reuse, "hf": run_hf}


def measure(
    model: nn.Module,
    case: TurnsCase,
    modes=MODES,
    iterations: int = 3,
    warmup: int = 1,
    temperature: float = 1.0,
    seed: int = 0,
) -> dict:
    """Every mode's per-turn records: the median over `iterations` interleaved rounds, after `warmup`."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (case.prompts, case.prompt_length), generator=g).to(device)
    appended = appended_tokens(case, vocab, seed)
    rounds: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for i in range(warmup + iterations):
        for mode in modes:
            records = RUNNERS[mode](model, case, prompts, appended, temperature, seed + i)
            if i >= warmup:
                rounds[mode].append(records)
    result = {"case": dataclasses.asdict(case), "modes": {}}
    for mode, runs in rounds.items():
        turns = []
        for t in range(case.turns):
            turns.append({k: statistics.median(run[t][k] for run in runs) for k in runs[0][t]})
        whole = statistics.median(sum(r["total_ms"] for r in run) for run in runs)
        result["modes"][mode] = {
            "turns": turns,
            "total_ms": whole,
            "prefill_tokens": sum(t["prefill_tokens"] for t in turns),
        }
    reuse = result["modes"].get("reuse")
    if reuse is not None:
        first_prompts = case.prompts * case.prompt_length
        appended_total = sum(a.numel() for turn in appended for a in turn)
        result["prefill_tokens_over_prompts_and_appended"] = reuse["prefill_tokens"] / (first_prompts + appended_total)
        if appended_total:  # what the turns after the first computed, over what they appended
            turn_tokens = sum(t["prefill_tokens"] for t in reuse["turns"][1:])
            result["turn_tokens_over_appended"] = turn_tokens / appended_total
        for other in ("no-reuse", "hf"):
            if other in result["modes"]:
                result[f"speedup_over_{other}"] = result["modes"][other]["total_ms"] / reuse["total_ms"]
    return result


def format_table(result: dict) -> str:
    lines = [f"{'mode':<9} {'turn':>4} {'prefill tok':>11} {'prefill ms':>10} {'decode ms':>9} {'turn ms':>9}"]
    for mode, m in result["modes"].items():
        for t, r in enumerate(m["turns"], start=1):
            lines.append(
                f"{mode:<9} {t:>4} {r['prefill_tokens']:>11} {r['prefill_ms']:>10.1f} {r['decode_ms']:>9.1f} "
                f"{r['total_ms']:>9.1f}"
            )
        lines.append(f"{mode:<9} {'all':>4} {m['prefill_tokens']:>11} {'':>10} {'':>9} {m['total_ms']:>9.1f}")
    for key in (
        "prefill_tokens_over_prompts_and_appended",
        "turn_tokens_over_appended",
        "speedup_over_no-reuse",
        "speedup_over_hf",
    ):
        if key in result:
            lines.append(f"{key}: {result[key]:.3f}")
    return "\n".join(lines)
