"""What the sampler's non-finite check (DecodeStep.watch_nonfinite: one max per row per step, no host
sync) costs a sampled rollout: the same rollout with the check and with it stubbed out, interleaved
(A B A B ...), medians of the whole rollout's decode time per step.

    .venv/bin/python benchmarks/bench_nonfinite_check.py --model-shape llama-small --rows 64 --rounds 7

On this 2-core CPU (2026-12-02), three runs of that command gave ratios (with / without) 1.035, 0.925 and,
with `--model-shape opt-125m --rows 32 --rounds 5` (vocab 50272), 0.989: within the machine's noise. The
check alone is one max per row: 0.06 ms at 64 x 8192, 0.22 ms at 64 x 49152, 1.6 ms at 64 x 152064
(float32, one thread), against 1.0, 5.9 and 16.8 ms for the sampler op itself.
"""

import argparse
import statistics
import time

import torch

from torchkvops import Rollout, RolloutConfig
from torchkvops.models import build_model
from torchkvops.rollout.decode import DecodeStep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", default="llama-small")
    parser.add_argument("--rows", type=int, default=64, help="prompts x samples (samples = 8)")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.model_shape)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.rows // 8, args.prompt_length))
    rollout = Rollout(
        model,
        RolloutConfig(samples_per_prompt=8, max_new_tokens=args.new_tokens, temperature=1.0, eos_token_id=[], seed=0),
    )
    checked = DecodeStep.watch_nonfinite
    times = {"with check": [], "without": []}
    tokens = {}
    for _ in range(args.rounds + 1):  # the first round warms up
        for mode in times:
            DecodeStep.watch_nonfinite = checked if mode == "with check" else (lambda self, logits: None)
            start = time.perf_counter()
            tokens[mode] = rollout.generate(ids).responses
            times[mode].append((time.perf_counter() - start) * 1e3 / args.new_tokens)
    DecodeStep.watch_nonfinite = checked
    a, b = (statistics.median(t[1:]) for t in times.values())
    print(
        f"{args.model_shape}, {args.rows} rows, vocab {vocab}, {args.new_tokens} new tokens, {args.threads} threads, "
        f"median of {args.rounds} interleaved rounds:"
    )
    print(
        f"  ms per step with the check {a:.3f}, without {b:.3f}, ratio {a / b:.3f}; "
        f"tokens equal: {torch.equal(*tokens.values())}"
    )


if __name__ == "__main__":
    main()
