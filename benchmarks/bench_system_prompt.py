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
ratios of shared against the others. On this CPU (llama-small shape, fp32, 2 threads):

    .venv/bin/python benchmarks/bench_system_prompt.py --output out/system_prompt.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from torchkvops import Rollout, RolloutConfig
from torchkvops.models import build_model

MODES = ("shared", "unshared", "distinct")


def prompts(batch: int, system: int, question: int, vocab: int, shared: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if not shared:
        return torch.randint(3, vocab, (batch, system + question), generator=g)
    head = torch.randint(3, vocab, (system,), generator=g)
    tails = torch.randint(3, vocab, (batch, question), generator=g)
    tails[:, 0] = torch.arange(3, 3 + batch)  # the questions differ from their first token on
    return torch.cat([head.expand(batch, -1), tails], dim=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="llama-small")
    p.add_argument("--prompts", type=int, default=8, help="B")
    p.add_argument("--system-length", type=int, default=1024, help="S")
    p.add_argument("--question-length", type=int, default=64, help="Q")
    p.add_argument("--samples", type=int, default=8, help="N")
    p.add_argument("--response-length", type=int, default=64, help="R")
    p.add_argument("--kv-sharing", nargs="+", default=["prefix", "copy"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.model_shape)
    vocab = model.config.vocab_size
    inputs = {
        "shared": prompts(args.prompts, args.system_length, args.question_length, vocab, True, 1),
        "unshared": prompts(args.prompts, args.system_length, args.question_length, vocab, True, 1),
        "distinct": prompts(args.prompts, args.system_length, args.question_length, vocab, False, 2),
    }
    results = {}
    for layout in args.kv_sharing:
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
        results[layout] = table
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
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
