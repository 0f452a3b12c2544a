"""One process of a DeepSpeed ZeRO-3 test, launched by torchrun (tests/test_zero3.py):

    torchrun --nproc-per-node 2 tests/zero3_worker.py SCENARIO[,SCENARIO...] OUT_DIR

A tiny Llama (a LoRA one for "lora") wrapped by `deepspeed.initialize` with ZeRO-3 on DeepSpeed's CPU
accelerator over gloo, with persistence and parameter reuse off, so that every parameter is partitioned
and every module's forward gathers it (as a model too large to keep whole would). Each rank writes
OUT_DIR/rank<r>_<scenario>.pt. Scenarios: "gather" (HF's generate on the same engine, the oracle, then
gather_weights "per_step", "once" and "auto" with a budget of 1 byte: tokens, parameter all-gathers per
call, the parameters' status after, warnings; then the loss and weights of a training step after a
gathered call against those of the same step on a second engine that made no call), "lora" (LoRA on
every linear layer: gathered then merged, PEFT's unmerged tokens, the local partitions bit-identical;
then per-step gathers, which leave the partitioned weights unmerged), "eos_one_rank" (synced calls where
only rank 0's has EOS ids, gathered once and per step: each rank's tokens and whether it was served),
"rollout_engine" (DeepSpeed's RolloutEngine interface: HybridEngineRollout against TorchkvopsRollout).
"""

import dataclasses
import datetime
import os
import sys
import types
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_worker import count_calls, generate_in_each_gather_mode, llama  # noqa: E402
from models import prompts  # noqa: E402
from worker_exit import end_worker  # noqa: E402

import torchkvops  # noqa: E402

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {
        "stage": 3,
        # Nothing kept whole or kept gathered between uses: every forward fetches every parameter.
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
    },
}


def zero3_engine(lora: bool = False):
    import deepspeed

    model = llama(lora)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
    return engine


def count_parameter_gathers() -> list[int]:
    """A counter of ZeRO-3's parameter all-gathers (torch.distributed.all_gather_into_tensor calls)."""
    return count_calls("all_gather_into_tensor")


def training_step(engine, sequences) -> torch.Tensor:
    out = engine(input_ids=sequences, labels=sequences)
    engine.backward(out.loss)
    engine.step()
    return out.loss.detach()


def main() -> None:
    scenarios, out_dir = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_S", "60"))))
    rank = dist.get_rank()
    warnings.simplefilter("ignore")
    gathers = count_parameter_gathers()  # before DeepSpeed's communication layer binds the function
    import deepspeed  # noqa: F401  (after the process group: DeepSpeed takes the existing one)

    for scenario in scenarios:  # (one launch runs several scenarios: each process imports torch once)
        print(f"scenario {scenario}", file=sys.stderr, flush=True)  # (which one failed, in the log)
        result = run(scenario, rank, gathers)
        torch.save(result, os.path.join(out_dir, f"rank{rank}_{scenario}.pt"))
    end_worker()


def run(scenario: str, rank: int, gathers: list[int]) -> dict:
    """One scenario's record on this rank."""
    result = {"rank": rank}
    # Different prompts per rank (rank 1's longer and more of them), so their rows end at different steps.
    ids, mask = prompts(2 + 2 * rank, 6 + 3 * rank, seed=40 + rank, left_pad=[0, 1] + [2, 0] * rank)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=[5, 7, 9, 11, 13], pad_token_id=0
    )
    kwargs["synced_gpus"] = True  # what HF resolves under ZeRO-3 when accelerate or a Trainer set it up
    engine = zero3_engine(lora=scenario == "lora")
    model = engine.module
    hf = type(model).generate
    result["parameters"] = sum(1 for _ in model.parameters())
    if scenario == "gather":
        before = gathers[0]
        result["expected"] = hf(model, ids, **kwargs)
        result["gathers_hf"] = gathers[0] - before
        generate_in_each_gather_mode(
            model,
            ids,
            kwargs,
            gathers,
            result,
            lambda handle: {"status_after": sorted({p.ds_status.name for p in model.parameters()})},
        )
        # The same training step on this engine (after the calls above) and on a fresh one (no call).
        sequences = torch.cat([ids, ids.flip(1)], dim=1)
        result["loss_after_calls"] = training_step(engine, sequences)
        fresh = zero3_engine()
        result["loss_without_call"] = training_step(fresh, sequences)
        result["weights_after_calls"] = [p.ds_tensor.clone() for p in engine.module.parameters()]
        result["weights_without_call"] = [p.ds_tensor.clone() for p in fresh.module.parameters()]
    elif scenario == "lora":
        kwargs.update(eos_token_id=None, max_new_tokens=8)
        result["expected"] = hf(model, ids, **kwargs)  # PEFT's generate: the adapters unmerged, per-step gathers
        partitions = {n: p.ds_tensor.clone() for n, p in model.named_parameters()}
        handle = torchkvops.patch_generate(model, gather_weights="once")
        result["got"] = model.generate(ids, **kwargs)
        result["profile"] = handle.last_profile().to_dict()
        result["lora_layers"] = sum(type(m).__name__ == "Linear" and hasattr(m, "lora_A") for m in model.modules())
        result["changed"] = [n for n, p in model.named_parameters() if not torch.equal(p.ds_tensor, partitions[n])]
        result["status_after"] = sorted({p.ds_status.name for p in model.parameters()})
        handle.undo()
        # Per-step gathers: the weights are partitioned during the call, so nothing is merged.
        handle = torchkvops.patch_generate(model, gather_weights="per_step")
        result["got_per_step"] = model.generate(ids, **kwargs)
        result["profile_per_step"] = handle.last_profile().to_dict()
        result["changed_per_step"] = [
            n for n, p in model.named_parameters() if not torch.equal(p.ds_tensor, partitions[n])
        ]
        handle.undo()
    elif scenario == "eos_one_rank":
        # The all-ended check is a collective: it must run on the rank whose call has no EOS ids too.
        kwargs.update(eos_token_id=[5, 7, 9, 11, 13] if rank == 0 else None, max_new_tokens=20)
        result["expected"] = hf(model, ids, **kwargs)
        rollouts = []
        original = torchkvops.Rollout.generate_rows
        torchkvops.Rollout.generate_rows = lambda self, *a, **k: rollouts.append(1) or original(self, *a, **k)
        for mode in ("per_step", "once"):
            handle = torchkvops.patch_generate(model, gather_weights=mode)
            result[f"got_{mode}"] = model.generate(ids, **kwargs)
            handle.undo()
        result["served"] = len(rollouts)
        result["loss"] = training_step(engine, torch.cat([ids, ids.flip(1)], dim=1))
    elif scenario == "rollout_engine":
        # DeepSpeed's rollout interface on this engine: HybridEngineRollout (the oracle; HF's generate run to
        # the budget, per-step gathers) against TorchkvopsRollout run to the budget and with EOS honoured.
        from deepspeed.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig

        from torchkvops.deepspeed import TorchkvopsRollout, TorchkvopsRolloutConfig

        tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=7)
        request, sampling = RolloutRequest(ids, mask), SamplingConfig(10, temperature=0.0, n_samples_per_prompt=3)
        rollouts = {
            "expected": HybridEngineRollout(engine, tokenizer),
            "got": TorchkvopsRollout(engine, tokenizer, TorchkvopsRolloutConfig(run_to_budget=True)),
            "got_eos": TorchkvopsRollout(engine, tokenizer),
        }
        for name, rollout in rollouts.items():
            before = gathers[0]
            result[name] = dataclasses.asdict(rollout.generate(request, sampling))
            result[f"gathers_{name}"] = gathers[0] - before
        result["status_after"] = sorted({p.ds_status.name for p in model.parameters()})
    return result


if __name__ == "__main__":
    main()
