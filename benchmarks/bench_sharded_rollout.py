"""Generation from a sharded model: the weights gathered at every decode step (FSDP's or ZeRO-3's hooks,
as before) vs gathered once per call (`gather_weights="once"`, hf.sharded) vs the same model unsharded.

Two processes on gloo (127.0.0.1), each with one CPU thread, a model of a torchkvops.bench shape with the
same random weights on both; --engine fsdp2 (default): each decoder layer and the root `fully_shard`-ed,
marked FSDP-managed as accelerate marks it (so HF resolves synced_gpus=True: every process runs as many
forwards); --engine zero3: wrapped by `deepspeed.initialize` with ZeRO-3 on DeepSpeed's CPU accelerator,
every parameter partitioned (no persistence, no reuse), called with synced_gpus=True. Each rank
generates N greedy rows for each of its own B prompts (N copies in a row, prefilled once; no EOS: R
tokens each) with `torchkvops.generate`; the
modes run interleaved (per_step, once, unsharded, per_step, ...) for --rounds rounds after a warm-up.
Rank 0 prints per mode the median whole-call ms, parameter all-gathers per call (FSDP2's
all_gather_single calls, ZeRO-3's all_gather_into_tensor calls), gathered bytes and gather ms
(RolloutProfile), and whether the tokens equal the per-step mode's. On this CPU:

    .venv/bin/python benchmarks/bench_sharded_rollout.py --rounds 5 --output out/sharded_rollout.json
    .venv/bin/python benchmarks/bench_sharded_rollout.py --engine zero3 --rounds 5 --output out/sharded_rollout_zero3.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

import torchkvops
from torchkvops.models import build_model

MODES = ("per_step", "once", "unsharded")


def sharded(shape: str) -> torch.nn.Module:
    model = build_model(shape, torch.float32, "cpu")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model._is_fsdp_managed_module = True
    return model


def zero3(shape: str) -> torch.nn.Module:
    import deepspeed

    model = build_model(shape, torch.float32, "cpu")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
        },
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine.module


def worker(rank: int, args, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    # Counted before DeepSpeed's communication layer binds the function.
    collective = "all_gather_single" if args.engine == "fsdp2" else "all_gather_into_tensor"
    gathers, original = [0], getattr(dist, collective)

    def counted(*a, **k):
        gathers[0] += 1
        return original(*a, **k)

    setattr(dist, collective, counted)
    build = sharded if args.engine == "fsdp2" else zero3
    models = {"per_step": build(args.model_shape), "unsharded": build_model(args.model_shape, torch.float32, "cpu")}
    models["once"] = models["per_step"]
    g = torch.Generator().manual_seed(100 + rank)
    vocab = models["unsharded"].config.vocab_size
    # N copies of each prompt in a row: a run of identical prompts, prefilled once (greedy: HF refuses
    # num_return_sequences without sampling).
    ids = torch.randint(3, vocab, (args.prompts, args.prompt_length), generator=g).repeat_interleave(args.samples, 0)
    kwargs = dict(
        max_new_tokens=args.response_length,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        synced_gpus=True,
    )
    times: dict[str, list[float]] = {m: [] for m in MODES}
    record: dict[str, dict] = {m: {} for m in MODES}
    for round_ in range(args.warmup + args.rounds):
        for mode in MODES:
            model = models[mode]
            gather = "once" if mode == "once" else "per_step"
            dist.barrier()
            before, start = gathers[0], time.perf_counter()
            with torchkvops.patch_generate(model, gather_weights=gather) as handle:
                tokens = model.generate(ids, **kwargs)
                profile = handle.last_profile()
            elapsed = (time.perf_counter() - start) * 1e3
            if round_ >= args.warmup:
                times[mode].append(elapsed)
                record[mode] = {
                    "gathers_per_call": gathers[0] - before,
                    "gathered_bytes": profile.gathered_bytes,
                    "gather_ms": profile.gather_ms,
                    "tokens": tokens,
                }
    if rank == 0:
        reference = record["per_step"]["tokens"]
        for mode in MODES:
            r = record[mode]
            out[mode] = {
                "median_ms": statistics.median(times[mode]),
                "ms": times[mode],
                "gathers_per_call": r["gathers_per_call"],
                "gathered_bytes": r["gathered_bytes"],
                "gather_ms": r["gather_ms"],
                "tokens_equal_per_step": bool(torch.equal(r["tokens"], reference)),
            }
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["fsdp2", "zero3"], default="fsdp2")
    p.add_argument("--model-shape", default="llama-small")
    p.add_argument("--prompts", type=int, default=2, help="B per process")
    p.add_argument("--samples", type=int, default=4, help="N")
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(worker, args=(args, port, out), nprocs=2)
    result = {"args": vars(args), "modes": dict(out)}
    base = result["modes"]["per_step"]["median_ms"]
    for mode in MODES:
        r = result["modes"][mode]
        print(
            f"{mode:>10}: {r['median_ms']:8.1f} ms  ({base / r['median_ms']:.2f}x per_step)  "
            f"gathers/call {r['gathers_per_call']:4d}  gathered {r['gathered_bytes'] / 2**20:6.1f} MiB "
            f"in {r['gather_ms']:6.1f} ms  tokens equal: {r['tokens_equal_per_step']}"
        )
    if args.output:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
