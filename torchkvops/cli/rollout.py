"""`torchkvops rollout`: generate N samples for each prompt (text prompts through the checkpoint's
tokenizer, or synthetic token ids) and print them, or also write them as JSONL. Under torchrun each
process generates a contiguous shard of the prompts and the first process prints every sample.
Its arguments, the checks made before any work, and the run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .arguments import add_model_group
from .checks import (
    CLIError,
    check_kv_memory,
    check_max_rows,
    check_output_file,
    check_positions,
    check_token_memory,
    model_source,
    non_negative_int,
    positive_int,
    temperature,
    top_p,
)
from .launch import RunError, current_rank, current_world_size, say, set_threads, shard_bounds, start_processes
from .model import load_config, load_model, resolve_dtype, special_ids, vocab_size

__all__ = ["NAME", "HELP", "DESCRIPTION", "EPILOG", "add_arguments", "check_args", "execute", "read_prompts"]

NAME = "rollout"
HELP = "generate N samples for each prompt and print them"
DESCRIPTION = (
    "Generate N samples for each prompt and print them. Under torchrun the prompts are split among the "
    "processes (a prompt's samples stay together); the samples do not depend on the number of processes."
)
EPILOG = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable; needs --model)")
    src.add_argument(
        "--prompts", metavar="FILE", help='prompts, one per line, or JSONL with a "prompt" field (needs --model)'
    )
    src.add_argument(
        "--prompt-length",
        type=positive_int,
        default=16,
        help="without text prompts: synthetic prompts of this many random token ids",
    )
    src.add_argument(
        "--num-prompts", type=positive_int, default=2, help="without text prompts: how many synthetic prompts"
    )
    add_model_group(p)
    gen = p.add_argument_group("generation")
    gen.add_argument("-n", "--samples-per-prompt", type=positive_int, default=4, help="N")
    gen.add_argument("--max-new-tokens", type=positive_int, default=32, help="R, the most tokens per sample")
    gen.add_argument("--temperature", type=temperature, default=1.0, help="0 is greedy")
    gen.add_argument("--top-k", type=non_negative_int, default=0, help="0 is off")
    gen.add_argument("--top-p", type=top_p, default=1.0, help="in (0, 1]")
    gen.add_argument(
        "--no-shared-prefill", action="store_true", help="the expanded baseline: prefill every prompt N times"
    )
    p.add_argument("--output", metavar="FILE.jsonl", help="also write one JSON record per sample")


def check_args(args) -> None:
    """The checks argparse cannot make one flag at a time, before any work (no torch needed)."""
    check_max_rows(args, args.samples_per_prompt)
    if args.model:
        model_source(args.model)
    check_output_file(args.output, "--output")
    if (args.prompt or args.prompts) and not args.model:
        raise CLIError(
            "--prompt/--prompts need --model (a checkpoint with a tokenizer); without --model, "
            "use --prompt-length for synthetic prompts"
        )
    if not (args.prompt or args.prompts):
        check_token_memory(
            args.num_prompts,
            args.samples_per_prompt,
            args.prompt_length,
            args.max_new_tokens,
            f"--num-prompts {args.num_prompts} x --prompt-length {args.prompt_length}",
            "lower --num-prompts, --prompt-length, --samples-per-prompt or --max-new-tokens",
        )


def read_prompts(path: str) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"--prompts {path}: cannot read: {e}") from None
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise CLIError(f"--prompts {path}: no prompts in the file")
    jsonl = path.endswith(".jsonl")
    if not jsonl:
        try:
            jsonl = isinstance(json.loads(numbered[0][1]), dict)
        except ValueError:
            jsonl = False
    if not jsonl:
        return [line for _, line in numbered]
    prompts = []
    for no, line in numbered:
        try:
            record = json.loads(line)
        except ValueError as e:
            raise CLIError(f"--prompts {path}:{no}: not JSON ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise CLIError(f'--prompts {path}:{no}: a JSONL record needs a string "prompt" field')
        prompts.append(record["prompt"])
    return prompts


def execute(args) -> int:
    """`torchkvops rollout`: the prompts, the model, one call (a warm-up first under --compile), then the
    samples printed by the first process (and written to --output) with the call's times."""
    import torch

    from ..rollout import Rollout

    texts = list(args.prompt or []) + (read_prompts(args.prompts) if args.prompts else [])
    device = start_processes(args.device)
    set_threads(args)
    rank, world = current_rank(), current_world_size()
    _, dtype = resolve_dtype(args.dtype, device)
    config = _rollout_config(args)
    model_config, source = load_config(args)
    # Under torchrun a process holds the KV of its own shard only: at most ceil(prompts / processes) prompts.
    most = -(-(len(texts) or args.num_prompts) // world)
    if not texts:
        _check_synthetic_sizes(args, model_config, device, dtype, most, world)
    model, tokenizer, _ = load_model(args, model_config, source, device, dtype)
    if texts:
        input_ids, attention_mask = _encode(args, texts, tokenizer, model_config, device, dtype, most)
        config.pad_token_id = tokenizer.pad_token_id
    else:
        input_ids, attention_mask = _synthetic(args, model, tokenizer)
    rollout = Rollout(model, config)
    # Every process holds every prompt (the same seed, the same files) and generates its contiguous shard.
    shards = shard_bounds(input_ids.shape[0], world)

    def generate():
        if world > 1:
            return _generate_shard(rollout, input_ids, attention_mask, shards[rank])
        return rollout.generate(input_ids, attention_mask)

    if args.compile:  # the first call compiles: a warm-up, timed on its own line and not counted below
        start = time.perf_counter()
        generate()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # host sync: the warm-up's time includes its last kernels
        say(
            f"warm-up: {time.perf_counter() - start:.1f} s for a first call (--compile compiles in it); the samples "
            "and times below are the second call's (the same seed gives the same samples)"
        )
    out = generate()
    profile = rollout.get_last_profile()  # this process's own call (None when its shard was empty)
    if rank != 0:
        print(_rank_line(rank, world, shards[rank], args.samples_per_prompt, profile))
        return 0
    records = _print_samples(out, input_ids, attention_mask, texts, tokenizer, shards, args.samples_per_prompt)
    print(_summary(args, input_ids.shape[0], out, profile, device, world, shards[0]))
    if args.output:
        from .atomic_write import write_text_atomic

        write_text_atomic(args.output, "".join(json.dumps(rec) + "\n" for rec in records))
        print(f"wrote {len(records)} records to {args.output}")
    return 0


def _rollout_config(args):
    from ..rollout import RolloutConfig

    return RolloutConfig(
        samples_per_prompt=args.samples_per_prompt,
        max_new_tokens=args.max_new_tokens,
        shared_prefill=not args.no_shared_prefill,
        enable_profiling=True,
        compile=args.compile,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_rows=args.max_rows,
        max_kv_tokens=args.max_kv_tokens,
        # (kv_sharing None: RolloutConfig's default, "paged", the layout whose blocks max_kv_tokens counts;
        # "copy" with --no-shared-prefill)
    )


def _check_synthetic_sizes(args, model_config, device, dtype, most: int, world: int) -> None:
    """Synthetic prompts' sizes against the model's positions and the memory, before the model is built."""
    n = args.samples_per_prompt
    check_positions(
        model_config,
        args.prompt_length + args.max_new_tokens,
        f"--prompt-length {args.prompt_length} + --max-new-tokens {args.max_new_tokens}",
        "lower one of them",
    )
    check_kv_memory(
        model_config,
        device,
        dtype,
        most * n if args.max_rows is None else min(most * n, args.max_rows),
        args.prompt_length + args.max_new_tokens,
        f"--num-prompts {args.num_prompts} x -n {n}" + (f" over {world} processes" if world > 1 else ""),
        "lower --num-prompts, --samples-per-prompt, --prompt-length or --max-new-tokens",
    )


def _encode(args, texts: list[str], tokenizer, model_config, device, dtype, most: int):
    """The text prompts through the checkpoint's tokenizer (left padding), checked against the model's
    positions and the memory: (input_ids, attention_mask)."""
    if tokenizer is None:
        raise CLIError(
            f"--model {args.model}: has no tokenizer, so text prompts cannot be encoded; "
            "use --prompt-length for synthetic prompts"
        )
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
    if input_ids.shape[1] == 0:
        raise CLIError("the prompts encode to no tokens")
    total = input_ids.shape[1] + args.max_new_tokens
    check_positions(
        model_config,
        total,
        f"the longest prompt's {input_ids.shape[1]} tokens + --max-new-tokens {args.max_new_tokens}",
        "shorten it or lower --max-new-tokens",
    )
    check_kv_memory(
        model_config,
        device,
        dtype,
        most * args.samples_per_prompt,
        total,
        f"{len(texts)} prompt(s) x -n {args.samples_per_prompt}",
        "fewer prompts, a lower --samples-per-prompt or --max-new-tokens",
    )
    return input_ids, attention_mask


def _synthetic(args, model, tokenizer):
    """--num-prompts prompts of --prompt-length random token ids (no special ids), seeded by --seed."""
    import torch

    from ..bench.cases import Case, synthetic_prompts

    case = Case(args.num_prompts, args.samples_per_prompt, args.prompt_length, args.max_new_tokens)
    input_ids = synthetic_prompts(
        case, vocab_size(model, tokenizer), special_ids(model, tokenizer), args.seed, torch.device("cpu")
    )
    say(f"prompts: {args.num_prompts} synthetic prompts of {args.prompt_length} random token ids (seed {args.seed})")
    return input_ids, torch.ones_like(input_ids)


def _rank_line(rank: int, world: int, shard: tuple[int, int], n: int, profile) -> str:
    """What a process other than the first prints: its own shard and time."""
    lo, hi = shard
    mine = (
        (
            f"prompts {lo}..{hi - 1} ({hi - lo} x {n} samples), {profile.generated_tokens} tokens in "
            f"{profile.total_ms:.1f} ms ({profile.tokens_per_second:.1f} tokens/s)"
        )
        if hi > lo
        else "no prompts"
    )
    return f"rank {rank}/{world}: {mine}; rank 0 prints the samples"


def _print_samples(out, input_ids, attention_mask, texts, tokenizer, shards, n: int) -> list[dict]:
    """Every prompt and its samples, printed (text where there is a tokenizer, else token ids); the
    records --output writes, one a sample."""
    records = []
    responses, mask = out.responses.cpu(), out.response_mask.cpu()
    owner = [r for r, (lo, hi) in enumerate(shards) for _ in range(lo, hi)]
    for i in range(input_ids.shape[0]):
        prompt_ids = input_ids[i][attention_mask[i].bool()].tolist()
        prompt_text = texts[i] if texts else None
        print(
            f"\n=== prompt {i}: " + (repr(prompt_text) if texts else f"{len(prompt_ids)} token ids {_ids(prompt_ids)}")
        )
        for j in range(n):
            row = i * n + j
            ids = responses[row][mask[row].bool()].tolist()
            text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None
            print(f"--- sample {j} ({len(ids)} tokens): " + (repr(text) if text is not None else _ids(ids)))
            records.append(
                {
                    "prompt_index": i,
                    "sample_index": j,
                    "rank": owner[i],
                    "prompt": prompt_text,
                    "prompt_token_ids": prompt_ids,
                    "token_ids": ids,
                    "text": text,
                }
            )
    return records


def _summary(args, prompts: int, out, profile, device, world: int, first_shard: tuple[int, int]) -> str:
    """The closing line: the tokens, the first process's time and its stages."""
    import torch

    n = args.samples_per_prompt
    threads = torch.get_num_threads()
    kind = "expanded" if args.no_shared_prefill else "shared"
    stages = (
        f"prefill {profile.prefill_ms:.1f} ms, kv_expand {profile.kv_expand_ms:.2f} ms, decode "
        f"{profile.decode_ms:.1f} ms; {kind} prefill"
        + (f"; {threads} CPU thread{'s' if threads != 1 else ''}" if device.type == "cpu" else "")
    )
    if world > 1:
        import torch.distributed as dist

        lo, hi = first_shard
        return (
            f"\n{prompts} prompts x {n} samples on {world} processes ({dist.get_backend()}), "
            f"{int(out.response_mask.sum())} tokens; rank 0's {hi - lo} prompt(s): {profile.generated_tokens} "
            f"tokens in {profile.total_ms:.1f} ms ({profile.tokens_per_second:.1f} tokens/s; {stages})"
        )
    return (
        f"\n{prompts} prompts x {n} samples, {profile.generated_tokens} tokens in "
        f"{profile.total_ms:.1f} ms ({profile.tokens_per_second:.1f} tokens/s; {stages})"
    )


def _generate_shard(rollout, input_ids, attention_mask, bounds: tuple[int, int]):
    """This process's shard through torchkvops.distributed.generate; every process gets every row, in
    rank order (= prompt order). A failure on any process raises on every process: one line each."""
    from .. import distributed

    lo, hi = bounds
    ids, mask = (input_ids[lo:hi], attention_mask[lo:hi]) if hi > lo else (None, None)
    try:
        return distributed.generate(rollout, ids, mask, gather=True)
    except RuntimeError as e:  # distributed.generate's own report of a failed process, or a broken group
        if os.environ.get("TORCHKVOPS_DEBUG"):
            raise
        raise RunError(f"[rank {current_rank()}] {' '.join(str(e).split())}") from None


def _ids(ids: list[int], limit: int = 24) -> str:
    return str(ids) if len(ids) <= limit else str(ids[:limit])[:-1] + f", ... ({len(ids) - limit} more)]"
