"""The rollout-vs-trainer log-probability mismatch (torchkvops.bench.mismatch, as `bench --mismatch`) on a
random-weight model whose LM head is scaled, so that its logits have a trained model's spread.

    python benchmarks/bench_mismatch_scaled_head.py --model-shape llama-small --head-scale 10 --dtype bf16

Randomly initialized heads give logits of standard deviation ~0.3-0.6, where a bf16 head's rounding
(relative 2^-9) moves log-probabilities by ~1e-3 at most; a trained model's logits spread over tens of
units, where one bf16 step is 0.03-0.25. Multiplying the head's weights by --head-scale (before the cast
to --dtype) gives that spread without a checkpoint. Use a shape whose head is not tied to the input
embeddings (llama-small): scaling a tied head would scale the inputs too.

--float32-partials (an experiment, not a rollout option): the prefix layout's two partial attentions run
in float32 (their inputs upcast), so that only the merged output is rounded to the model's dtype; it
measures how much of the prefix layout's bf16 mismatch that rounding accounts for.
"""

from __future__ import annotations

import argparse

import torch

from torchkvops.bench import cases, mismatch, report
from torchkvops.models import MODEL_SHAPES, build_model
from torchkvops.rollout import attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-shape", choices=MODEL_SHAPES, default="llama-small")
    p.add_argument("--head-scale", type=float, default=10.0)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--case", type=int, nargs=4, default=[2, 4, 64, 32], metavar=("B", "N", "P", "R"))
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--modes", nargs="+", default=["shared", "prefix", "hf-generate"])
    p.add_argument(
        "--float32-partials",
        action="store_true",
        help="run the prefix layout's partial attentions in float32 (an experiment)",
    )
    args = p.parse_args(argv)
    if args.float32_partials:
        float32_partials(DTYPES[args.dtype])
    model = build_model(args.model_shape, dtype=torch.float32, device=args.device)
    if model.config.tie_word_embeddings:
        p.error(f"--model-shape {args.model_shape} ties its LM head to its input embeddings; pick an untied one")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(args.head_scale)
    model = model.to(DTYPES[args.dtype])
    case = cases.Case(*args.case)
    settings = cases.Settings(temperature=args.temperature, top_p=args.top_p, seed=0)
    prompts = cases.synthetic_prompts(case, model.config.vocab_size, [0, 1, 2], 0, torch.device(args.device))
    with torch.inference_mode():
        logits = model(prompts).logits.float()
    print(
        f"{args.model_shape}, head x{args.head_scale:g}, {args.dtype}, {args.device}: {case.name}, temperature "
        f"{args.temperature:g}, top_p {args.top_p:g}; prompt logits: std {logits.std().item():.2f}, mean top-1 "
        f"probability {logits.softmax(-1).amax(-1).mean().item():.3f}\n"
    )
    engines = mismatch.measure_mismatch(model, case, args.modes, settings, prompts, pad_token_id=0)
    print(report.format_mismatch_table({"case": case.name, "mismatch": engines}))
    return 0


def float32_partials(dtype: torch.dtype) -> None:
    """Patch torchkvops.rollout.attention for this process: the attentions whose log-sum-exp is asked for (the
    prefix layout's two partial ones) take float32 inputs, and their merge's output is cast back to `dtype`."""
    attend, ops = attention.attend, attention.ops

    def attend_float32(q, k, v, bias, scale, with_lse):
        if with_lse:
            q, k, v, bias = q.float(), k.float(), v.float(), bias.float()
        return attend(q, k, v, bias, scale, with_lse)

    class Ops:
        def __getattr__(self, name):
            return getattr(ops, name)

        @staticmethod
        def merge_attention_states(*args):
            out, lse = ops.merge_attention_states(*args)
            return out.to(dtype), lse

    attention.attend, attention.ops = attend_float32, Ops()


if __name__ == "__main__":
    raise SystemExit(main())
