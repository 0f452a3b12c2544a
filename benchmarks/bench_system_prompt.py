"""A system prompt in front of every prompt, computed once (RolloutConfig.min_shared_tokens,
torchkvops.rollout.prompts), against the same shapes without it.

B prompts, each a system prompt of S tokens (the same for all) and a question of Q tokens of its own, N
samples each, R new tokens (sampled, no EOS: every mode does the same work). Modes, interleaved (A B C A B
C ...) after a warm-up, medians reported:

  shared      the prompts as described: the system prompt is found and computed once (prefill), and in the
              "prefix" layout every row's decode reads its one copy of the system prompt's KV once a step
  unshared    the same prompts with the common prefix left alone (min_shared_tokens=None): what the rollout
              did before
  distinct    prompts of the same length that share nothing (S + Q random tokens each): the issue's
              baseline, "the same shapes whose prompts share no system prompt"

Per mode: prefill positions computed, prefill ms, decode ms (and per step), whole call ms, KV bytes; the
ratios of shared against the others.

The loss pass (`--parts loss`): GRPO's forward + backward through `patch_forward` (log-probabilities of
the completions as GRPOTrainer computes them: logits_to_keep, TRL's selective_log_softmax) on the rows a trainer builds from such a rollout: each prompt
left-padded to the longest (questions of Q - 8 * (i % 4) tokens: the system prompt sits at a different
column in each prompt's rows), G rows of C completion tokens each. Modes, interleaved: "shared" (the
system prompt common to all: computed once, then each prompt, then the completions), "distinct" (the
same shapes, no common prefix: each prompt computed once per group). Tokens computed and medians.

On this CPU (llama-small shape, fp32, 2 threads):

    .venv/bin/python benchmarks/bench_system_prompt.py --output out/system_prompt.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import torchkvops
from torchkvops import Rollout, RolloutConfig
from torchkvops.models import build_model
from torchkvops.models.forward_modes import disable_dropout

MODES = ("shared", "unshared", "distinct")


def prompts(batch: int, system: int, question: int, vocab: int, shared: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if not shared:
        return torch.randint(3, vocab, (batch, system + question), generator=g)
    head = torch.randint(3, vocab, (system,), generator=g)
    tails = torch.randint(3, vocab, (batch, question), generator=g)
    tails[:, 0] = torch.arange(3, 3 + batch)  # the questions differ from their first token on
    return torch.cat([head.expand(batch, -1), tails], dim=1)


def trainer_rows(args, vocab: int, shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[B * G, S + Q + C] ids and mask: prompt i's question has Q - 8 * (i % 4) tokens, left-padded."""
    g = torch.Generator().manual_seed(3)
    base = prompts(args.prompts, args.system_length, args.question_length, vocab, shared, 1 if shared else 2)
    rows_ids, rows_mask = [], []
    width = base.shape[1]
    for i in range(args.prompts):
        pad = 8 * (i % 4)
        prompt = torch.cat([torch.zeros(pad, dtype=torch.long), base[i, : width - pad]])
        real = torch.cat([torch.zeros(pad, dtype=torch.long), torch.ones(width - pad, dtype=torch.long)])
        for _ in range(args.samples):
            completion = torch.randint(3, vocab, (args.completion_length,), generator=g)
            rows_ids.append(torch.cat([prompt, completion]))
            rows_mask.append(torch.cat([real, torch.ones_like(completion)]))
    return torch.stack(rows_ids), torch.stack(rows_mask)


def completion_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """What GRPOTrainer computes from the logits: TRL's selective_log_softmax where TRL is installed."""
    try:
        from trl.trainer.utils import selective_log_softmax
    except ImportError:
        return logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    return selective_log_softmax(logits, tokens)


def loss_pass(model, args) -> dict:
    disable_dropout(model)
    model.train()
    vocab, c = model.config.vocab_size, args.completion_length
    batches = {mode: trainer_rows(args, vocab, mode == "shared") for mode in ("shared", "distinct")}
    times: dict[str, list[float]] = {mode: [] for mode in batches}
    tokens = {}
    with torchkvops.patch_forward(model) as handle:
        for round_ in range(args.warmup + args.rounds):
            for mode, (ids, mask) in batches.items():
                model.zero_grad(set_to_none=True)
                before = handle.stats.computed_tokens
                start = time.perf_counter()
                logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=c + 1).logits
                (-completion_logprobs(logits[:, :-1], ids[:, -c:]).sum()).backward()
                elapsed = time.perf_counter() - start
                tokens[mode] = handle.stats.computed_tokens - before
                if round_ >= args.warmup:
                    times[mode].append(elapsed * 1e3)
    ideal = args.system_length + args.prompts * (args.question_length + args.samples * c)
    table = {mode: {"tokens": tokens[mode], "ms": statistics.median(times[mode])} for mode in batches}
    table["rows_tokens"] = batches["shared"][0].numel()
    table["tokens_over_ideal"] = tokens["shared"] / ideal
    table["speedup_over_distinct"] = table["distinct"]["ms"] / table["shared"]["ms"]
    print(
        f"loss pass (forward + backward): B={args.prompts} x G={args.samples} rows of S={args.system_length} + "
        f"Q<={args.question_length} + C={c}, medians of {args.rounds} rounds"
    )
    for mode in batches:
        print(f"{mode:<9} tokens {table[mode]['tokens']:>7} {table[mode]['ms']:>9.1f} ms")
    print(
        f"shared: {table['speedup_over_distinct']:.2f}x distinct; tokens computed "
        f"{table['tokens_over_ideal']:.3f}x (S + B x (Q + G x C)); token ratio "
        f"{tokens['distinct'] / tokens['shared']:.2f}"
    )
    return table


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="llama-small")
    p.add_argument("--prompts", type=int, default=8, help="B")
    p.add_argument("--system-length", type=int, default=1024, help="S")
    p.add_argument("--question-length", type=int, default=64, help="Q")
    p.add_argument("--samples", type=int, default=8, help="N")
    p.add_argument("--response-length", type=int, default=64, help="R")
    p.add_argument("--completion-length", type=int, default=128, help="C (the loss pass)")
    p.add_argument("--kv-sharing", nargs="+", default=["prefix", "copy"])
    p.add_argument("--parts", nargs="+", choices=["rollout", "loss"], default=["rollout", "loss"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.model_shape)
    vocab = model.config.vocab_size
    inputs = {
        "shared": prompts(args.prompts, args.system_length, args.question_length, vocab, True, 1),
        "unshared": prompts(args.prompts, args.system_length, args.question_length, vocab, True, 1),
        "distinct": prompts(args.prompts, args.system_length, args.question_length, vocab, False, 2),
    }
    results = {}
    for layout in args.kv_sharing if "rollout" in args.parts else []:
        results[layout] = rollout_table(model, args, layout, inputs)
    if "loss" in args.parts:
        results["loss_pass"] = loss_pass(model, args)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


def rollout_table(model, args, layout: str, inputs: dict) -> dict:
    """The rollout in one KV layout, the three modes interleaved: each mode's medians, the speedups of
    sharing, printed as a table."""
    base = dict(
        samples_per_prompt=args.samples,
        max_new_tokens=args.response_length,
        temperature=1.0,
        seed=0,
        eos_token_id=[],
        kv_sharing=layout,
        enable_profiling=True,
    )
    rollouts = {
        "shared": Rollout(model, RolloutConfig(**base)),
        "unshared": Rollout(model, RolloutConfig(min_shared_tokens=None, **base)),
        "distinct": Rollout(model, RolloutConfig(**base)),
    }
    profiles: dict[str, list] = {m: [] for m in MODES}
    for round_ in range(args.warmup + args.rounds):
        for mode in MODES:
            rollouts[mode].generate(inputs[mode])
            if round_ >= args.warmup:
                profiles[mode].append(rollouts[mode].get_last_profile())
    table = {}
    for mode, runs in profiles.items():
        med = lambda f: statistics.median(getattr(r, f) for r in runs)  # noqa: E731
        table[mode] = {
            "prefill_tokens": runs[0].prefill_tokens,
            "prefill_ms": med("prefill_ms"),
            "decode_ms": med("decode_ms"),
            "decode_ms_per_step": med("decode_ms") / runs[0].decode_steps,
            "total_ms": med("total_ms"),
            "kv_cache_bytes": runs[0].kv_cache_bytes,
        }
    table["speedup_over_unshared"] = table["unshared"]["total_ms"] / table["shared"]["total_ms"]
    table["speedup_over_distinct"] = table["distinct"]["total_ms"] / table["shared"]["total_ms"]
    table["prefill_tokens_over_ideal"] = table["shared"]["prefill_tokens"] / (
        args.system_length + args.prompts * args.question_length
    )
    print(
        f"kv_sharing={layout}: B={args.prompts} S={args.system_length} Q={args.question_length} "
        f"N={args.samples} R={args.response_length}, medians of {args.rounds} rounds"
    )
    print(
        f"{'mode':<9} {'prefill tok':>11} {'prefill ms':>10} {'decode ms':>10} {'ms/step':>8} {'total ms':>9} {'KV MiB':>7}"
    )
    for mode in MODES:
        r = table[mode]
        print(
            f"{mode:<9} {r['prefill_tokens']:>11} {r['prefill_ms']:>10.1f} {r['decode_ms']:>10.1f} "
            f"{r['decode_ms_per_step']:>8.2f} {r['total_ms']:>9.1f} {r['kv_cache_bytes'] / 2**20:>7.1f}"
        )
    print(
        f"shared: {table['speedup_over_unshared']:.2f}x unshared, {table['speedup_over_distinct']:.2f}x distinct; "
        f"prefill positions {table['prefill_tokens_over_ideal']:.3f}x (S + B x Q)"
    )
    return table


if __name__ == "__main__":
    main()
