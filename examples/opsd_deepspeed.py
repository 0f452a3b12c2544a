"""DeepSpeed's on-policy distillation (OPSD) loop with torchkvops as its rollout engine.

    rollout = TorchkvopsRollout(student_engine, tokenizer)   # <- instead of HybridEngineRollout(...)
    torchkvops.patch_forward(student); torchkvops.patch_forward(teacher)   # the teacher and loss passes

One step, as DeepSpeed's `deepspeed.runtime.rollout` lays it out: the student samples N responses per
prompt (`RolloutEngine.generate`: prompts in, prompt + response out), the teacher scores them (one forward,
no gradient), `generalized_jsd_loss` compares the student's and the teacher's distributions on the
response tokens (`ResponseTokenBatch`), and the student's engine steps. This script runs the same steps
with each rollout engine it is given (`--engines torchkvops hybrid`), interleaved, from the same weights,
and prints each step's split (rollout, teacher, student forward + backward + step) and each engine's loss,
then the speed-up. The torchkvops run also patches the teacher's and the student's forwards
(`--no-patch-forward`: not); the hybrid run is DeepSpeed's loop as it ships. With greedy rollouts (the default, as DeepSpeed's seeds measured) both engines give the
same responses and the losses agree to float rounding.

Models: random weights of a named shape (`--model-shape`, default tiny; nothing is downloaded), the
teacher a second seed of it; token ids synthetic. One process on the CPU: DeepSpeed's engine with ZeRO
stage `--zero-stage` (0 by default; 3 partitions every parameter, gathered once per rollout by torchkvops,
per forward by HybridEngineRollout) over gloo on 127.0.0.1.

    .venv/bin/python examples/opsd_deepspeed.py                       # tiny, both engines (33 s on a 2-core CPU)
    .venv/bin/python examples/opsd_deepspeed.py --model-shape opt-125m --prompts 1 --samples 4 \
        --prompt-length 512 --max-new-tokens 32 --steps 3 --threads 2  # the seeds' shape
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

import torchkvops
from torchkvops.deepspeed import TorchkvopsRollout, TorchkvopsRolloutConfig
from torchkvops.models import MODEL_SHAPES, build_model

ENGINES = ("torchkvops", "hybrid")


def deepspeed_engine(model, zero_stage: int):
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": zero_stage},
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def rollout_engine(name: str, engine, tokenizer, profiling: bool):
    if name == "torchkvops":
        return TorchkvopsRollout(engine, tokenizer, TorchkvopsRolloutConfig(enable_profiling=profiling))
    from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRollout, HybridEngineRolloutConfig

    return HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(enable_profiling=profiling))


def opsd_step(rollout, engine, teacher, request, sampling, clock) -> dict:
    """One OPSD step: (milliseconds of each stage, the loss)."""
    from deepspeed.runtime.rollout import ResponseTokenBatch, generalized_jsd_loss

    start = clock()
    engine.module.eval()
    batch = rollout.generate(request, sampling)
    rolled = clock()
    tokens = ResponseTokenBatch.from_rollout(batch)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).logits
    scored = clock()
    engine.module.train()
    student_logits = engine(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).logits
    loss = generalized_jsd_loss(
        tokens.select_causal_logits(student_logits), tokens.select_causal_logits(teacher_logits), tokens.response_mask
    ).loss
    engine.backward(loss)
    engine.step()
    done = clock()
    return {
        "rollout_ms": (rolled - start) * 1e3,
        "teacher_ms": (scored - rolled) * 1e3,
        "student_ms": (done - scored) * 1e3,
        "step_ms": (done - start) * 1e3,
        "loss": loss.item(),
        "response_columns": batch.input_ids.shape[1] - int(batch.response_start_idx[0]),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", choices=list(MODEL_SHAPES), default="tiny")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--prompts", type=int, default=2, help="B: prompts per step")
    parser.add_argument("--samples", type=int, default=4, help="N: responses per prompt")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the losses then agree)")
    parser.add_argument("--steps", type=int, default=3, help="steps per engine; the first is a warm-up")
    parser.add_argument("--zero-stage", type=int, choices=(0, 3), default=0)
    parser.add_argument(
        "--no-patch-forward", action="store_true", help="leave the torchkvops run's teacher and student forwards plain"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import deepspeed
    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig

    deepspeed.init_distributed(dist_backend="gloo")
    teacher = build_model(args.model_shape, seed=1)
    vocab = teacher.config.vocab_size
    pad_id, eos_id = 0, min(2, vocab - 1)
    tokenizer = type("Tokenizer", (), {"pad_token_id": pad_id, "eos_token_id": eos_id})()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (args.prompts, args.prompt_length), generator=g)
    request = RolloutRequest(ids, torch.ones_like(ids))
    sampling = SamplingConfig(
        args.max_new_tokens, temperature=args.temperature, n_samples_per_prompt=args.samples, top_k=0
    )
    runs = {}
    for name in args.engines:  # each engine's own student, from the same initial weights
        student = build_model(args.model_shape, seed=0)
        student.config.use_cache = False
        engine = deepspeed_engine(student, args.zero_stage)
        if name == "torchkvops" and not args.no_patch_forward:  # DeepSpeed's loop as it ships for the other
            torchkvops.patch_forward(engine.module)
        runs[name] = (rollout_engine(name, engine, tokenizer, profiling=False), engine, [])
    clock = time.perf_counter
    for step in range(args.steps):
        for name, (rollout, engine, steps) in runs.items():  # interleaved: A B A B ...
            torch.manual_seed(step)
            shared_teacher = name == "torchkvops" and not args.no_patch_forward
            with torchkvops.patch_forward(teacher) if shared_teacher else contextlib.nullcontext():
                figures = opsd_step(rollout, engine, teacher, request, sampling, clock)
            steps.append(figures)
            print(
                f"step {step} {name:>10}: rollout {figures['rollout_ms']:8.1f} ms, teacher {figures['teacher_ms']:7.1f}"
                f" ms, student {figures['student_ms']:8.1f} ms, step {figures['step_ms']:8.1f} ms, loss "
                f"{figures['loss']:.6f} ({figures['response_columns']} response columns)",
                flush=True,
            )
    timed = {name: steps[1:] or steps for name, (_, _, steps) in runs.items()}  # the first step warms up
    for name, steps in timed.items():
        medians = {
            key: statistics.median(s[key] for s in steps)
            for key in ("rollout_ms", "teacher_ms", "student_ms", "step_ms")
        }
        print(f"{name:>10} medians: " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()))
    if set(timed) == set(ENGINES):
        ours, theirs = (statistics.median(s["step_ms"] for s in timed[n]) for n in ENGINES)
        rollout_ratio = statistics.median(s["rollout_ms"] for s in timed["hybrid"]) / statistics.median(
            s["rollout_ms"] for s in timed["torchkvops"]
        )
        losses = [(a["loss"], b["loss"]) for a, b in zip(runs["torchkvops"][2], runs["hybrid"][2])]
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in losses)
        print(
            f"OPSD step: torchkvops {theirs / ours:.2f}x HybridEngineRollout's (rollout {rollout_ratio:.2f}x); losses' largest relative difference {worst:.2e}"
        )


if __name__ == "__main__":
    main()
