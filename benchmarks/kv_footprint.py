"""The rollout's KV bytes against what its rows hold (issue #52's memory goals), on five workloads:

- `tail`: responses that end at spread lengths under a larger budget (`--length-profile eos-rate`: EOS with
  probability 1/M at every step), llama-small shape;
- `window`: gemma3-small's shape (five sliding-window layers of 512 to one global), every row running to
  a length 4x the window;
- `turns`: a first call, then a turn that appends 1 to 2,000 tokens to the rows (spread), then a short
  answer (`Rollout.extend`), llama-small shape;
- `rows`: a row budget's bytes (`max_rows`, streaming): the copy layout's at max_rows=16 against the paged
  layout's at 16 to 64 rows at once, and a budget of KV tokens as large as 16 rows at their longest
  (`max_kv_tokens`), 8 prompts x 8 samples, spread lengths (mean 256, budget 2048: an EOS rate of 1/256, or
  with `--length-profile log-normal` log-normal lengths of sigma 1, a heavier tail);
- `budget`: a budget of KV tokens against a row budget in the same bytes: 32 prompts x 8 samples, the copy
  layout through max_rows=16 against the paged layout under max_kv_tokens = 16 rows at their longest: the
  rows each decodes at once on average (generated tokens / decode steps).

For each: the KV bytes the call used (`RolloutProfile.kv_cache_bytes`) and what the rows hold when it ends
(each row's prompt and tokens, a prompt once: every layout keeps its KV in the pool since 2026-12-07, a
prompt's blocks shared by its rows; a sliding layer at most its window: `held_bytes`), and their ratio.
The paged layout (blocks of 16 tokens) holds the latter plus a
partly filled block or two per row; its sliding layers' own pool holds a window, the stretch of 8 tokens
a row reserves ahead and a block per row (`sliding_kv_bytes`, against `sliding_goal_bytes`: a window and
one block a row). No timing is compared (decode_ms is printed for the record only): bytes and rows.

    .venv/bin/python benchmarks/kv_footprint.py --threads 2 --output out/kv_footprint.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from torchkvops import Rollout, RolloutConfig
from torchkvops.bench.lengths import install, set_response_length
from torchkvops.models import build_model

TAIL_CASES = ((34, 256), (34, 7680), (256, 2048), (1024, 4096))  # (mean length M, max_new_tokens)
PROMPTS, SAMPLES, PROMPT_LEN = 2, 8, 256


def per_token_bytes(config, layers: int | None = None) -> int:
    """K and V bytes of one token in `layers` layers (None: all), fp32."""
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * (layers or config.num_hidden_layers) * heads * dim * 4


def lengths_of(out) -> list[int]:
    """Each row's response tokens through its first EOS."""
    return out.response_mask.sum(1).tolist()


def prompts(vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (PROMPTS, PROMPT_LEN), generator=g)


def held(config, rows_len: list[int], window: int | None = None, sliding_layers: int = 0) -> int:
    """The bytes of what the rows hold: each prompt once (its rows share its blocks, in every layout) and
    each row's tokens; sliding layers at most `window` tokens a row."""
    full_layers = config.num_hidden_layers - sliding_layers
    total = 0
    for layers, cap in ((full_layers, None), (sliding_layers, window)):
        if not layers:
            continue
        if cap is None:  # (a prompt's blocks are shared by its rows)
            tokens = PROMPTS * PROMPT_LEN + sum(rows_len)
        else:
            tokens = sum(min(PROMPT_LEN + n, cap or 1 << 62) for n in rows_len)
        total += tokens * per_token_bytes(config, layers)
    return total


def rollout_for(model, layout: str, max_new_tokens: int, **options) -> Rollout:
    """A profiled, sampled rollout of SAMPLES rows a prompt (`options`: more RolloutConfig fields)."""
    cfg = RolloutConfig(
        samples_per_prompt=SAMPLES,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        seed=1,
        kv_sharing=layout,
        enable_profiling=True,
        **options,
    )
    return Rollout(model, cfg)


def record(rollout: Rollout, need: int, **fields) -> dict:
    """One row of the table: `fields`, the KV bytes the last call used, what the rows hold, the ratio."""
    used = rollout.get_last_profile().kv_cache_bytes
    row = dict(**fields, kv_bytes=used, held_bytes=need, ratio=used / need)
    print(row, flush=True)
    return row


def run_tail(layout: str) -> list[dict]:
    out = []
    for mean, budget in TAIL_CASES:
        model = build_model("llama-small", seed=0).eval()
        install(model, "eos-rate", model.config.eos_token_id, 1.0, mean)
        set_response_length(model, budget)  # (eos-rate: p = 1 / mean whatever the budget)
        rollout = rollout_for(model, layout, budget)
        lens = lengths_of(rollout.generate(prompts(model.config.vocab_size)))
        out.append(
            record(
                rollout,
                held(model.config, lens),
                workload="tail",
                layout=layout,
                mean=mean,
                max_new_tokens=budget,
                longest=max(lens),
                mean_len=sum(lens) / len(lens),
            )
        )
    return out


def run_window(layout: str) -> dict:
    model = build_model("gemma3-small", seed=0).eval()
    window = model.config.sliding_window
    new = 4 * window - PROMPT_LEN
    rollout = rollout_for(model, layout, new, eos_token_id=[])
    result = rollout.generate(prompts(model.config.vocab_size))
    lens = [new] * result.responses.shape[0]
    sliding = sum(t == "sliding_attention" for t in model.config.layer_types)
    need = held(model.config, lens, window=window, sliding_layers=sliding)
    fields = dict(workload="window", layout=layout, window=window, length=PROMPT_LEN + new)
    store = rollout.cache.paged
    if store is not None and store.windows is not None:
        # The sliding layers' own figure (issue #52's goal: a window and one block a row): their pool's most
        # blocks held at once, against that bound for every row.
        block, per_token = store.block_size, per_token_bytes(model.config, sliding)
        fields["sliding_kv_bytes"] = store.peak_window_blocks * block * per_token
        fields["sliding_goal_bytes"] = len(lens) * (window + block) * per_token
    return record(rollout, need, **fields)


def run_turns(layout: str) -> dict:
    model = build_model("llama-small", seed=0).eval()
    rollout = rollout_for(model, layout, 16, eos_token_id=[])
    first = rollout.generate(prompts(model.config.vocab_size))
    rows = first.responses.shape[0]
    g = torch.Generator().manual_seed(2)
    appended_lens = [1] + [int(x) for x in torch.logspace(0, 3.3, rows - 1).round()]  # 1 .. ~2,000
    appended = [torch.randint(3, model.config.vocab_size, (n,), generator=g) for n in appended_lens]
    second = rollout.extend(first, appended, max_new_tokens=16)
    lens = [16 + n + 16 for n in appended_lens]  # both answers and the appended tokens, after the prompt
    return record(
        rollout,
        held(model.config, lens),
        workload="turns",
        layout=layout,
        appended=f"{min(appended_lens)}..{max(appended_lens)}",
        history=second.responses.shape[1],
    )


ROW_BUDGET_PROMPTS, ROW_BUDGET_ROWS = 8, 16  # the rows workload: 8 prompts x 8 samples, max_rows=16 for copy


def run_streamed(
    workload: str, prompts_: int, seed: int, cases: list[tuple[str, int | None, int | None]], length_profile: str
) -> list[dict]:
    """`prompts_` prompts x 8 samples of llama-small, spread lengths of mean 256 under a budget of 2048
    (`length_profile`: "eos-rate", EOS rate 1/256; or "log-normal", sigma 1), through each of `cases` (layout,
    max_rows, max_kv_tokens): the KV bytes (with and without the dense scratch prompts are prefilled into),
    the rows decoding per step on average (generated tokens / decode steps), the steps, preemptions and
    refills, and whether the tokens are the first case's."""
    model = build_model("llama-small", seed=0).eval()
    install(model, length_profile, model.config.eos_token_id, 1.0, 256)
    set_response_length(model, 2048, prompt_length=PROMPT_LEN)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (prompts_, PROMPT_LEN), generator=g)
    out, reference = [], None
    for layout, max_rows, max_kv_tokens in cases:
        rollout = rollout_for(model, layout, 2048, max_rows=max_rows, max_kv_tokens=max_kv_tokens)
        result = rollout.generate(ids)
        reference = result.sequences if reference is None else reference
        profile = rollout.get_last_profile()
        lens = result.response_mask.sum(dim=1).float()
        row = dict(
            workload=workload,
            length_profile=length_profile,
            mean_len=lens.mean().item(),
            longest=int(lens.max()),
            layout=layout,
            max_rows=max_rows,
            max_kv_tokens=max_kv_tokens,
            same_tokens=torch.equal(result.sequences, reference),
            kv_bytes=profile.kv_cache_bytes,
            batch_kv_bytes=rollout.cache.peak_used_bytes,  # (without the dense scratch prompts are prefilled into)
            rows_per_step=profile.generated_tokens / max(1, profile.decode_steps),
            decode_steps=profile.decode_steps,
            preemptions=profile.preemptions,
            refills=profile.refills,
            decode_ms=profile.decode_ms,  # (one run: for the record, not a timing comparison)
        )
        print(row, flush=True)
        out.append(row)
    return out


# A budget of KV tokens as large as the copy layout's 16 rows at their longest.
KV_TOKENS = ROW_BUDGET_ROWS * (PROMPT_LEN + 2048)


def run_rows(profile: str) -> list[dict]:
    """Rows a row budget's bytes hold: the copy layout streaming 64 rows through max_rows=16 (spread lengths,
    mean 256 under a budget of 2048) uses some KV bytes; the paged layout streams the same rows through
    max_rows = 16, 32, 48, 64, and under max_kv_tokens = the copy layout's 16 rows at their longest: the most
    rows it decodes at once within the copy layout's bytes, and the same tokens."""
    cases = [("copy", ROW_BUDGET_ROWS, None)] + [("paged", r, None) for r in (16, 32, 48, 64)]
    return run_streamed("rows", ROW_BUDGET_PROMPTS, 3, cases + [("paged", None, KV_TOKENS)], profile)


BUDGET_PROMPTS = 32  # the budget workload: 32 prompts x 8 samples, so that rows wait for most of the rollout


def run_budget(profile: str, budget_rows: list[int]) -> list[dict]:
    """A budget of KV tokens against a row budget in the same bytes (#52's goal): 32 prompts x 8 samples, the
    copy layout streaming through max_rows=16 against the paged layout under max_kv_tokens = what the copy
    layout's 16 rows hold at their longest; the rollout is long enough that rows wait for most of it."""
    cases = []
    for rows in budget_rows:  # (16 of the 256 rows at their longest; 64: a quarter of them)
        cases += [("copy", rows, None), ("paged", None, rows * (PROMPT_LEN + 2048))]
    return run_streamed("budget", BUDGET_PROMPTS, 4, cases, profile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["tail", "window", "turns", "rows", "budget"])
    parser.add_argument("--layouts", nargs="+", default=["copy", "prefix", "paged"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--budget-rows",
        type=int,
        nargs="+",
        default=[ROW_BUDGET_ROWS],
        help="the budget workload: the copy layout's max_rows, and the paged layout's max_kv_tokens as that many rows at their longest",
    )
    parser.add_argument(
        "--length-profile",
        choices=["eos-rate", "log-normal"],
        default="eos-rate",
        help="the rows and budget workloads' lengths (mean 256 under 2048): EOS rate 1/256, or log-normal (sigma 1)",
    )
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for layout in args.layouts:
        if "tail" in args.workloads:
            rows += run_tail(layout)
        if "window" in args.workloads:
            rows.append(run_window(layout))
        if "turns" in args.workloads:
            rows.append(run_turns(layout))
    if "rows" in args.workloads:
        rows += run_rows(args.length_profile)
    if "budget" in args.workloads:
        rows += run_budget(args.length_profile, args.budget_rows)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": "benchmarks/kv_footprint.py " + " ".join(sys.argv[1:]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
