"""DeepSpeed's rollout interface, two engines side by side: HybridEngineRollout (HF's generate on the prompts
repeated N times, every response run to max_new_tokens) and torchkvops.deepspeed.TorchkvopsRollout (each
prompt prefilled once), on the same model, request and sampling settings, interleaved (A B A B ...).

Each engine's own profile (`get_last_profile()`, DeepSpeed's keys) gives the call's total and its prefill
forward: the seeds' figure is the shared prefill's time against the expanded one's. Greedy by default (the
seeds' setting), so both engines return the same tokens (checked: the script says where they differ).

    .venv/bin/python benchmarks/bench_deepspeed_rollout.py --model-shape opt-125m --batch-sizes 1 8 \
        --samples 4 --prompt-length 512 --max-new-tokens 32 --threads 2 --iterations 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import types

import torch

from torchkvops.deepspeed import TorchkvopsRollout, TorchkvopsRolloutConfig
from torchkvops.models import MODEL_SHAPES, build_model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", choices=list(MODEL_SHAPES), default="opt-125m")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=None, help="a JSON file for every call's profile")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig
    from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRollout, HybridEngineRolloutConfig

    model = build_model(args.model_shape)
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=2)
    engine = types.SimpleNamespace(module=model)  # HybridEngineRollout's non-injected path reads engine.module
    engines = {
        "hybrid": HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(enable_profiling=True)),
        "torchkvops": TorchkvopsRollout(model, tokenizer, TorchkvopsRolloutConfig(enable_profiling=True)),
    }
    results = {"model_shape": args.model_shape, "threads": torch.get_num_threads(), "cases": {}}
    for batch in args.batch_sizes:
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(3, model.config.vocab_size, (batch, args.prompt_length), generator=g)
        request = RolloutRequest(ids, torch.ones_like(ids))
        sampling = SamplingConfig(args.max_new_tokens, temperature=args.temperature, n_samples_per_prompt=args.samples)
        profiles = {name: [] for name in engines}
        outputs = {}
        for i in range(args.warmup + args.iterations):
            for name, rollout in engines.items():
                torch.manual_seed(i)
                out = rollout.generate(request, sampling)
                if i >= args.warmup:
                    profiles[name].append(rollout.get_last_profile())
                outputs[name] = out
        width = outputs["torchkvops"].input_ids.shape[1]
        same = torch.equal(outputs["torchkvops"].input_ids, outputs["hybrid"].input_ids[:, :width])
        medians = {
            name: {
                key: statistics.median(p[key] for p in ps)
                for key in ("total_ms", "prefill_forward_ms", "decode_forward_ms")
            }
            for name, ps in profiles.items()
        }
        total = medians["torchkvops"]["total_ms"] / medians["hybrid"]["total_ms"]
        prefill = medians["torchkvops"]["prefill_forward_ms"] / medians["hybrid"]["prefill_forward_ms"]
        print(
            f"B={batch} N={args.samples} P={args.prompt_length} R={args.max_new_tokens}: "
            + ", ".join(
                f"{n} total {m['total_ms']:.1f} ms (prefill {m['prefill_forward_ms']:.1f}, decode {m['decode_forward_ms']:.1f})"
                for n, m in medians.items()
            )
            + f"; torchkvops / hybrid: total {total:.2f}, prefill {prefill:.2f}; tokens {'the same' if same else 'DIFFER'}",
            flush=True,
        )
        results["cases"][f"B{batch}"] = {
            "profiles": profiles,
            "medians": medians,
            "total_ratio": total,
            "prefill_ratio": prefill,
            "same_tokens": same,
        }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
