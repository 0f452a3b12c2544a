"""What patch_generate's never-stale check costs per served call, beside one decode step of the same model:

  fingerprint   hf.generate_reuse.kv_fingerprint: every parameter's and buffer's bits hashed by value
                and position, every module's plain attributes, one host sync per device
  sum_norm      the checksum it replaced (sum and norm of each tensor: blind to permutations)
  decode_step   one decode step of a rollout of --rows rows (its decode time / steps)

interleaved (fingerprint, sum_norm, decode, fingerprint, ...) for --rounds rounds; medians and ratios.
On this CPU (OPT-125m's shape, random weights):

    .venv/bin/python benchmarks/bench_fingerprint.py --model-shape opt-125m --threads 2 --rounds 5

and on a GPU, the same with `--device cuda`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from torchkvops import Rollout, RolloutConfig
from torchkvops.hf.generate_reuse import kv_fingerprint
from torchkvops.models import ModelAdapter, build_model


def sum_norm(model: torch.nn.Module) -> list[float]:
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.numel()]
    with torch.no_grad():
        sums = [torch.stack([t.sum(dtype=torch.float32), torch.linalg.vector_norm(t).float()]) for t in tensors]
        return torch.stack(sums).flatten().tolist()


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="llama-small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=16, help="decode rows (B * N)")
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed rollout")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", help="JSON results")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = build_model(args.model_shape, seed=0).to(device)
    adapter_state = ModelAdapter(model).adapter_state()
    rollout = Rollout(
        model,
        RolloutConfig(
            samples_per_prompt=args.rows, max_new_tokens=args.steps + 1, eos_token_id=[], enable_profiling=True
        ),
    )
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt_length), device=device)

    def decode_step_ms() -> float:
        rollout.generate(ids)
        profile = rollout.get_last_profile()
        return profile.decode_ms / profile.decode_steps

    for warm in (lambda: kv_fingerprint(model, adapter_state), lambda: sum_norm(model), decode_step_ms):
        warm()
    times: dict[str, list[float]] = {"fingerprint": [], "sum_norm": [], "decode_step": []}
    for _ in range(args.rounds):
        times["fingerprint"].append(timed(lambda: kv_fingerprint(model, adapter_state), device))
        times["sum_norm"].append(timed(lambda: sum_norm(model), device))
        times["decode_step"].append(decode_step_ms())
    median = {k: statistics.median(v) for k, v in times.items()}
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    result = {
        "model_shape": args.model_shape,
        "device": str(device),
        "weight_bytes": weights,
        "rows": args.rows,
        "median_ms": median,
        "fingerprint_per_decode_step": median["fingerprint"] / median["decode_step"],
        "fingerprint_per_sum_norm": median["fingerprint"] / median["sum_norm"],
        "fingerprint_gb_per_s": weights / median["fingerprint"] / 1e6,
        "times_ms": times,
    }
    print(
        f"{args.model_shape} on {device}, {weights / 2**20:.0f} MiB of weights: fingerprint "
        f"{median['fingerprint']:.1f} ms ({result['fingerprint_gb_per_s']:.1f} GB/s), sum+norm "
        f"{median['sum_norm']:.1f} ms, one decode step of {args.rows} rows {median['decode_step']:.1f} ms: "
        f"fingerprint = {result['fingerprint_per_decode_step']:.2f} decode steps, "
        f"{result['fingerprint_per_sum_norm']:.2f}x sum+norm"
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
