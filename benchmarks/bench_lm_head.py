"""What issue #18's options cost in a rollout: `return_logprobs=True` and `lm_head_dtype=torch.float32`
against a plain rollout, on one model shape (random weights) in bf16.

    python benchmarks/bench_lm_head.py --model-shape opt-125m --device cpu --rows 2 4 --prompt-length 64 \\
        --response-length 32 --rounds 5
    python benchmarks/bench_lm_head.py --model-shape qwen3-0.6b --device cuda --rows 4 8 --prompt-length 256 \\
        --response-length 64 --rounds 10

Three rollouts of the same model and prompts (B prompts, N samples each, temperature 1, no EOS): plain,
with log-probabilities, and with log-probabilities and the float32 LM head. After one warm-up call of
each (on CUDA the first calls also capture the decode graphs), they run in rounds (A B C A B C ...);
each call's decode ms per step comes from the rollout's own profile. The table gives the medians and
the ratios to plain, and the time of one refresh of the float32 head's weights (a cast of the head,
which every generate with the float32 head makes), timed on its own.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from torchkvops import Rollout, RolloutConfig
from torchkvops.bench.op import time_methods
from torchkvops.models import MODEL_SHAPES, build_model
from torchkvops.rollout.lm_head import Float32LMHead

VARIANTS = {
    "plain": dict(),
    "return_logprobs": dict(return_logprobs=True),
    "return_logprobs + fp32 head": dict(return_logprobs=True, lm_head_dtype=torch.float32),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-shape", choices=MODEL_SHAPES, default="opt-125m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, nargs=2, default=[2, 4], metavar=("B", "N"), help="prompts and samples each")
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.prompt_length < 1 or args.response_length < 2 or args.rounds < 1:
        p.error("--rows, --prompt-length and --rounds must be >= 1, --response-length >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    model = build_model(args.model_shape, dtype=torch.bfloat16, device=device)
    batch, n = args.rows
    prompts = torch.randint(
        3, model.config.vocab_size, (batch, args.prompt_length), generator=torch.Generator().manual_seed(0)
    ).to(device)
    rollouts = {
        name: Rollout(
            model,
            RolloutConfig(
                samples_per_prompt=n,
                max_new_tokens=args.response_length,
                temperature=1.0,
                seed=0,
                eos_token_id=[],
                enable_profiling=True,
                **extra,
            ),
        )
        for name, extra in VARIANTS.items()
    }
    for r in rollouts.values():  # warm-up (and on CUDA, capture)
        r.generate(prompts)
        r.generate(prompts)
    per_step = {name: [] for name in rollouts}
    for _ in range(args.rounds):
        for name, r in rollouts.items():
            r.generate(prompts)
            profile = r.get_last_profile()
            per_step[name].append(profile.decode_ms / max(1, profile.decode_steps))
    head = Float32LMHead(model)
    refresh_ms = [t * 1e3 for t in time_methods({"refresh": head.refresh}, device, 1, args.rounds)["refresh"]]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    w = model.get_output_embeddings().weight
    print(
        f"{args.model_shape} bf16 (random weights), {where}, B={batch} N={n} P={args.prompt_length} "
        f"R={args.response_length}, median of {args.rounds} interleaved rounds\n"
    )
    print("| rollout | decode ms/step | vs plain |")
    print("|---|---:|---:|")
    plain = statistics.median(per_step["plain"])
    for name, values in per_step.items():
        m = statistics.median(values)
        print(f"| {name} | {m:.2f} | {m / plain:.3f} |")
    print(
        f"\nfloat32 head refresh (a cast of the {tuple(w.shape)} head, once per generate): "
        f"{statistics.median(refresh_ms):.2f} ms; its copy holds {w.numel() * 4 / 2**20:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
