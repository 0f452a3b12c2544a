"""GRPO with TRL's GRPOTrainer on 2 processes with DeepSpeed ZeRO-3, torchkvops in both places: every
generate call served from weights gathered once per call (not once per decode step), the training passes
shared; the weights after two steps are those of a run with TRL's own training passes.

    .venv/bin/python examples/grpo_trl_sharded.py                 # the matrix below, 2 min 16 s on a 2-core CPU (2026-12-07)
    .venv/bin/python examples/grpo_trl_sharded.py --configs zero3-nogather

Each configuration runs twice under `torchrun --nproc-per-node 2` (gloo on 127.0.0.1, DeepSpeed's CPU
accelerator; every parameter partitioned: no persistence, no reuse), from the same tiny random-weight
Llama and seed:
    patched    torchkvops.patch_generate(model) (gather_weights="auto": gathered once per call) and
               torchkvops.patch_forward(model)
    reference  torchkvops.patch_generate(model, gather_weights="per_step") and no patch_forward: the same
               sampled completions (the rollout's seeded sampler; a run with HF's generate samples others),
               and TRL's own training passes
The configurations: ZeRO-3 with TRL's `ds3_gather_for_generation` on (TRL gathers; torchkvops finds the
weights gathered) and off (TRL leaves generation to per-step gathers, TRL #3858; torchkvops gathers once),
each without and with LoRA (TRL's `peft_config`, r=4 on every linear layer). It prints, per configuration,
the generate calls served, the bytes torchkvops gathered and the LoRA layers it merged for each, the calls that reached HF's
generate, patch_forward's shared and fallback calls, and the largest difference of any weight between the
two runs next to the largest change training made.

FSDP2 is not in the matrix: accelerate turns FSDP on only for accelerator devices (a CPU run gets DDP),
so TRL with FSDP2 cannot run on this machine; tests/test_fsdp.py covers patch_generate under fully_shard.

The same file is the per-process worker (`--worker`), launched by the driver and by tests/test_trl_sharded.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {
    "zero3-gather": dict(ds3_gather=True, peft=False),
    "zero3-nogather": dict(ds3_gather=False, peft=False),
    "zero3-gather-lora": dict(ds3_gather=True, peft=True),
    "zero3-nogather-lora": dict(ds3_gather=False, peft=True),
}
ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {
        "stage": 3,
        # Nothing kept whole or kept gathered between uses: every forward fetches every parameter, as in
        # a model too large to keep whole.
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
    },
}
PROMPTS, NUM_GENERATIONS, MAX_NEW, STEPS = 2, 4, 8, 2


def length_reward(completions, **kwargs):
    """Dense (completions of one prompt almost never tie), so that advantages and gradients are nonzero."""
    return [len(text) / 100.0 for text in completions]


def full_weights(model) -> dict:
    """Every parameter whole, on every rank (ZeRO-3: gathered for the copy)."""
    import deepspeed

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def worker(setting: str, out: str, ds3_gather: bool, peft: bool) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_S", "120"))))
    rank = dist.get_rank()
    warnings.simplefilter("ignore")
    from transformers import AutoModelForCausalLM

    import torchkvops
    from torchkvops.models import build_model

    sys.path.insert(0, HERE)  # (grpo_trl, which make_trainer imports)

    checkpoint = os.path.join(out, "model")
    if rank == 0 and not os.path.isdir(checkpoint):
        build_model("tiny", seed=0).save_pretrained(checkpoint)
    dist.barrier()
    trainer = make_trainer(AutoModelForCausalLM.from_pretrained(checkpoint), setting, out, ds3_gather, peft)
    patched = setting == "patched"
    generate = torchkvops.patch_generate(trainer.model, gather_weights="auto" if patched else "per_step")
    calls, fallbacks = record_calls(trainer, generate)
    forward = torchkvops.patch_forward(trainer.model, min_shared_tokens=4) if patched else None
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}  # not yet partitioned
    trainer.train()
    weights = full_weights(trainer.model)
    result = {
        "rank": rank,
        # Per generate call: the bytes torchkvops gathered for it and the LoRA layers it merged; None: not served.
        "calls": calls,
        "fallbacks": len(fallbacks),
        "forward": None if forward is None else [forward.stats.shared_calls, forward.stats.fallback_calls],
        "update": max((weights[n] - t).abs().max().item() for n, t in initial.items()),
        "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
        "lora_layers": sum(type(m).__name__ == "Linear" and hasattr(m, "lora_A") for m in trainer.model.modules()),
    }
    torch.save({**result, "weights": weights}, os.path.join(out, f"{setting}_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def make_trainer(model, setting: str, out: str, ds3_gather: bool, peft: bool):
    """TRL's GRPOTrainer under ZeRO-3 (LoRA on every linear layer with `peft`), the same in both settings."""
    import grpo_trl  # the offline tokenizer and in-memory dataset
    from trl import GRPOConfig, GRPOTrainer

    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    config = GRPOConfig(
        output_dir=os.path.join(out, f"run_{setting}"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=STEPS,
        per_device_train_batch_size=PROMPTS * NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_NEW,
        learning_rate=1e-3,
        save_strategy="no",
        disable_tqdm=True,
        deepspeed=ZERO3,
        ds3_gather_for_generation=ds3_gather,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=config,
        train_dataset=grpo_trl.build_dataset(16, 8),
        processing_class=grpo_trl.build_tokenizer(model.config),
        peft_config=peft_config,
    )
    return trainer


def record_calls(trainer, generate) -> tuple[list, list]:
    """Each generate call's record, appended as it ends: [bytes gathered, LoRA layers merged] when torchkvops
    served it, None when not; and one entry per call that went to HF's generate."""
    calls, fallbacks = [], []
    fallback = generate.session.original_generate
    generate.session.original_generate = lambda *a, **k: fallbacks.append(1) or fallback(*a, **k)
    served_generate = trainer.model.generate

    def recorded(*args, **kwargs):
        before = generate.session.last_profile
        output = served_generate(*args, **kwargs)
        profile = generate.session.last_profile
        served = profile is not before and profile is not None
        calls.append([profile.gathered_bytes, profile.merged_lora_layers] if served else None)
        return output

    trainer.model.generate = recorded
    return calls, fallbacks


def launch(setting: str, out: str, config: str, timeout: float) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = CONFIGS[config]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(port), os.path.abspath(__file__), "--worker", setting, out]
    cmd += ["--ds3-gather"] if options["ds3_gather"] else []
    cmd += ["--peft"] if options["peft"] else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} {setting}: torchrun failed:\n{proc.stderr[-3000:]}")


def compare(out: str) -> list[dict]:
    """Per rank: the patched run's record, and the largest weight difference to the reference run."""
    import torch

    ranks = []
    for rank in range(2):
        patched = torch.load(os.path.join(out, f"patched_rank{rank}.pt"), weights_only=False)
        reference = torch.load(os.path.join(out, f"reference_rank{rank}.pt"), weights_only=False)
        assert patched["weights"].keys() == reference["weights"].keys()
        diff = max((patched["weights"][n] - t).abs().max().item() for n, t in reference["weights"].items())
        record = {k: v for k, v in patched.items() if k != "weights"}
        record.update(weight_difference=diff, reference_calls=reference["calls"])
        ranks.append(record)
    return ranks


def run_config(config: str, out: str, timeout: float = 600) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    for setting in ("patched", "reference"):
        launch(setting, out, config, timeout)
    return compare(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--output", default=None, help="JSON of every configuration's records")
    p.add_argument("--worker", nargs=2, metavar=("SETTING", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--ds3-gather", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peft", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker, ds3_gather=args.ds3_gather, peft=args.peft)
        return
    import tempfile

    results = {}
    for config in args.configs:
        with tempfile.TemporaryDirectory() as out:
            results[config] = ranks = run_config(config, out)
        r = ranks[0]
        gathered = "; ".join("-" if c is None else f"{c[0] / 2**20:.1f} MiB, {c[1]} LoRA merged" for c in r["calls"])
        print(
            f"{config:>20}: generate calls served {sum(c is not None for c in r['calls'])}/{len(r['calls'])} "
            f"(gathered by torchkvops: {gathered}), to HF's generate {r['fallbacks']}; patch_forward shared "
            f"{r['forward'][0]}, plain {r['forward'][1]}; weights vs reference: max |diff| "
            f"{max(x['weight_difference'] for x in ranks):.2e} (training moved them by up to {r['update']:.2e})"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
