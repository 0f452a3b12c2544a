"""Which compaction policy (torchkvops.rollout.compaction): decode time and the useful fraction of computed
row-steps for a few bucket schemes and thresholds, interleaved, on the bench's geometric length profile
(torchkvops.bench.lengths: EOS with probability 4/R at every step, lengths geometric with mean R/4).

  off       compact_finished_rows=False
  pow2/0.5  batch sizes that are powers of two, compacted when the bucket is at most half the rows
  q4/0.875  the default: every size up to 8, then four sizes per octave, compacted whenever the bucket drops
  exact/1   the bucket is the live row count itself, compacted whenever a row has ended (an upper bound
            on the useful fraction at this check interval; one decode shape per row count)

Every policy gives the same tokens (checked). On the CPU, with the llama-small shape:

    .venv/bin/python benchmarks/compaction_policy.py --threads 1 [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from torchkvops import Rollout, RolloutConfig
from torchkvops.bench import lengths
from torchkvops.models import build_model
from torchkvops.rollout import compaction


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


POLICIES = {
    "off": None,
    "pow2/0.5": (pow2, 0.5),
    "q4/0.875": (compaction.bucket, compaction.COMPACT_FRACTION),
    "exact/1": (lambda n: max(n, 1), 1.0),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="llama-small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--response-length", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.model_shape)
    eos = model.config.eos_token_id
    lengths.install(model, "geometric", eos, temperature=1.0)
    lengths.set_response_length(model, args.response_length)
    prompts = torch.randint(
        3, model.config.vocab_size, (args.batch_size, args.prompt_length), generator=torch.Generator().manual_seed(0)
    )
    default = (compaction.bucket, compaction.COMPACT_FRACTION)
    rollouts = {
        name: Rollout(
            model,
            RolloutConfig(
                samples_per_prompt=args.samples_per_prompt,
                max_new_tokens=args.response_length,
                temperature=1.0,
                seed=0,
                eos_token_id=[eos],
                enable_profiling=True,
                compact_finished_rows=policy is not None,
            ),
        )
        for name, policy in POLICIES.items()
    }
    results = {name: [] for name in POLICIES}
    tokens = {}
    for k in range(args.rounds + 1):  # round 0 warms up
        for name, policy in POLICIES.items():
            compaction.bucket, compaction.COMPACT_FRACTION = policy or default
            try:
                out = rollouts[name].generate(prompts)
            finally:
                compaction.bucket, compaction.COMPACT_FRACTION = default
            tokens.setdefault(name, out.sequences)
            assert torch.equal(tokens[name], tokens["off"]), f"{name}: other tokens than without compaction"
            if k:
                prof = rollouts[name].get_last_profile()
                shapes = rollouts[name].decode_counters().decode_shapes
                results[name].append((prof.decode_ms, prof.useful_fraction, shapes))
    off = statistics.median(r[0] for r in results["off"])
    print(
        f"{args.model_shape}, B={args.batch_size} N={args.samples_per_prompt} P={args.prompt_length} "
        f"R={args.response_length}, geometric lengths, {args.rounds} interleaved rounds, threads "
        f"{torch.get_num_threads()}"
    )
    print("| policy | decode ms (median) | off / policy | useful fraction | decode shapes met |")
    print("|---|---:|---:|---:|---:|")
    for name, rows in results.items():
        ms = statistics.median(r[0] for r in rows)
        print(
            f"| {name} | {ms:.0f} | {off / ms:.2f} | {statistics.median(r[1] for r in rows):.3f} | "
            f"{max(r[2] for r in rows)} |"
        )


if __name__ == "__main__":
    main()
