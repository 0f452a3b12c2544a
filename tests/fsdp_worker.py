"""One process of an FSDP2 test, launched by torchrun (tests/test_fsdp.py):

    torchrun --nproc-per-node 2 tests/fsdp_worker.py SCENARIO[,SCENARIO...] OUT_DIR

The model is a tiny Llama sharded with `fully_shard` (each decoder layer, then the root) and marked
FSDP-managed as accelerate marks it, so HF's generate resolves synced_gpus=True. Each rank writes
OUT_DIR/rank<r>_<scenario>.pt with HF's output (the model class's generate on the same wrapper: the oracle), the
patched generate's output and how many rollouts ran. Scenarios: "synced" (ranks' rows end at different
steps; then a call that one rank cannot serve: every rank falls back), "train" (synced_gpus=False: a
served generate, then a training step on its sequences, then a generate that follows the new weights),
"gather" (gather_weights "per_step" then "once": parameter collectives counted, FSDP's settings after;
a budget too small for the weights: per-step gathers with a warning), "grad" (the gradients of a
training step after a gathered call and after no call), "lora" (a LoRA model sharded, gathered then
merged: PEFT's unmerged tokens, the local shards bit-identical after), "distributed"
(torchkvops.distributed.generate on the sharded model: each rank its own rows, gathered once), "fsdp1"
(FullyShardedDataParallel wrappers, the root summoned around generate as TRL does: per-step, once, and a
budget too small; the gradients of a training step before and after the calls).
"""

import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(__file__))
from models import FAMILIES, prompts  # noqa: E402
from worker_exit import end_worker  # noqa: E402

import torchkvops  # noqa: E402
from torchkvops.models.sharding import fsdp2_param_groups  # noqa: E402


def llama(lora: bool = False):
    """The test Llama (seeded: the same weights on every rank), with LoRA r=4 on every linear layer and
    random B (init_lora_weights=False, so that the adapters change the tokens) when `lora`."""
    model = FAMILIES["llama"]()
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM"
        )
        model = get_peft_model(model, config, autocast_adapter_dtype=False)
    return model


def sharded_llama(lora: bool = False):
    model = llama(lora)
    # The causal LM is the root FSDP module (inside PEFT's wrapper, whose generate calls the causal LM's).
    causal_lm = model.get_base_model() if lora else model
    for layer in causal_lm.get_decoder().layers:
        fully_shard(layer)
    fully_shard(causal_lm)
    model._is_fsdp_managed_module = causal_lm._is_fsdp_managed_module = (
        True  # what accelerate sets; HF's generate reads it for synced_gpus
    )
    return model


def count_calls(name: str) -> list[int]:
    """A counter of the calls of torch.distributed.<name> from now on (what binds the function later sees
    the counting one)."""
    count, original = [0], getattr(dist, name)

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    setattr(dist, name, counted)
    return count


def count_parameter_gathers() -> list[int]:
    """A counter of FSDP2's parameter all-gathers from now on: the torch.distributed calls FSDP2 makes for
    them, all_gather_single (torch 2.14) or all_gather_into_tensor (torch 2.11, which has no
    all_gather_single)."""
    return count_calls("all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor")


def generate_in_each_gather_mode(model, ids, kwargs, gathers, result, after=None) -> None:
    """patch_generate(model) with gather_weights "per_step", "once", and "auto" with a budget of 1 byte, one
    call each: its tokens, parameter gathers (`gathers`: a counter), torchkvops warnings and profile in
    `result` under "<what>_<mode>", with what `after(handle)` returns (a dict) before the patch is undone."""
    for mode, budget in (("per_step", None), ("once", None), ("auto", 1)):
        handle = torchkvops.patch_generate(model, gather_weights=mode, gather_budget_bytes=budget)
        before = gathers[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result[f"got_{mode}"] = model.generate(ids, **kwargs)
        result[f"gathers_{mode}"] = gathers[0] - before
        result[f"warnings_{mode}"] = [str(w.message) for w in caught if "torchkvops" in str(w.message)]
        result[f"profile_{mode}"] = handle.last_profile().to_dict()
        for what, value in (after(handle) if after else {}).items():
            result[f"{what}_{mode}"] = value
        handle.undo()


def reshard_setting(module) -> list[bool]:
    """Whether each of an FSDP module's parameter groups reshards after forward (FSDP's own state)."""
    return [group.post_forward_mesh_info is not None for group in fsdp2_param_groups(module)]


def main() -> None:
    scenarios, out_dir = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_S", "60"))))
    rank = dist.get_rank()
    warnings.simplefilter(os.environ.get("WORKER_WARNINGS", "ignore"))
    for scenario in scenarios:  # (one launch runs several scenarios: each process imports torch once)
        print(f"scenario {scenario}", file=sys.stderr, flush=True)  # (which one failed, in the log)
        result = run(scenario, rank)
        torch.save(result, os.path.join(out_dir, f"rank{rank}_{scenario}.pt"))
    end_worker()


def run(scenario: str, rank: int) -> dict:
    """One scenario's record on this rank."""
    model = sharded_llama(lora=scenario == "lora")
    rollouts = []
    original = torchkvops.Rollout.generate_rows
    torchkvops.Rollout.generate_rows = lambda self, *a, **k: rollouts.append(1) or original(self, *a, **k)
    hf = type(model).generate
    result = {"rank": rank}
    # Different prompts per rank (rank 1's longer and more of them), so their rows end at different steps.
    ids, mask = prompts(2 + 2 * rank, 6 + 3 * rank, seed=40 + rank, left_pad=[0, 1] + [2, 0] * rank)
    if scenario == "synced":
        kwargs = dict(
            attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=[5, 7, 9, 11, 13], pad_token_id=0
        )
        result["expected"] = hf(model, ids, **kwargs)
        handle = torchkvops.patch_generate(model)
        result["got"] = model.generate(ids, **kwargs)
        result["served"] = len(rollouts)
        # Right padding on rank 1 only: it cannot serve, so neither may rank 0 (or FSDP's collectives would
        # pair its rollout's forwards with HF's on rank 1).
        odd_mask = mask.flip(1) if rank == 1 else mask
        odd = dict(kwargs, attention_mask=odd_mask)
        result["fallback_expected"] = hf(model, ids, **odd)
        result["fallback_got"] = model.generate(ids, **odd)
        result["served_after_fallback"] = len(rollouts)
        handle.undo()
    elif scenario == "gather":
        from torchkvops.hf.sharded import fsdp2_modules

        kwargs = dict(
            attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=[5, 7, 9, 11, 13], pad_token_id=0
        )
        result["expected"] = hf(model, ids, **kwargs)
        gathers = count_parameter_gathers()
        modules = fsdp2_modules(model)
        result["units"] = len(modules)
        result["settings_before"] = [reshard_setting(m) for m in modules]
        generate_in_each_gather_mode(
            model,
            ids,
            kwargs,
            gathers,
            result,
            lambda handle: {
                "settings_after": [reshard_setting(m) for m in modules],
                "cuda_graphs": [r.config.cuda_graphs for r in handle.session.rollouts.values()],
            },
        )
        result["served"] = len(rollouts)
    elif scenario == "grad":
        sequences = torch.cat([ids, ids.flip(1)], dim=1)
        handle = torchkvops.patch_generate(model, gather_weights="once")

        def gradients():
            model.zero_grad(set_to_none=True)
            model(input_ids=sequences, labels=sequences).loss.backward()
            return [p.grad.full_tensor().clone() for p in model.parameters()]

        result["without_call"] = gradients()
        kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        model.generate(ids, **kwargs)
        result["after_call"] = gradients()
        result["gathered_bytes"] = handle.last_profile().gathered_bytes
        result["served"] = len(rollouts)
        handle.undo()
    elif scenario == "lora":
        kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        result["expected"] = hf(model, ids, **kwargs)  # PEFT's generate: the adapters unmerged, gathered per step
        from torchkvops.hf.sharded import fsdp2_modules

        for module in fsdp2_modules(model):
            module.reshard()  # FSDP keeps the root gathered after a forward; its shards are compared
        shards = {n: p.to_local().clone() for n, p in model.named_parameters()}
        handle = torchkvops.patch_generate(model, gather_weights="once")
        result["got"] = model.generate(ids, **kwargs)
        result["profile"] = handle.last_profile().to_dict()
        result["lora_layers"] = sum(type(m).__name__ == "Linear" and hasattr(m, "lora_A") for m in model.modules())
        result["changed"] = [n for n, p in model.named_parameters() if not torch.equal(p.to_local(), shards[n])]
        result["served"] = len(rollouts)
        handle.undo()
        # A budget the gathered weights fit but not with the merged LoRA copies the call adds next.
        budget = result["profile"]["gathered_bytes"] + 1
        for merge in (True, False):
            handle = torchkvops.patch_generate(model, gather_budget_bytes=budget, merge_lora=merge)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result[f"got_budget_merge_{merge}"] = model.generate(ids, **kwargs)
            result[f"warnings_budget_merge_{merge}"] = [
                str(w.message) for w in caught if "torchkvops" in str(w.message)
            ]
            result[f"gathered_budget_merge_{merge}"] = handle.last_profile().gathered_bytes
            handle.undo()
        # torchkvops.distributed.generate on the same model: gathered, merged (no LoRA module runs).
        adapter_calls = [0]
        for module in model.modules():
            if type(module).__name__ == "Linear" and hasattr(module, "lora_A"):
                for lora_a in module.lora_A.values():
                    lora_a.register_forward_hook(lambda *_: adapter_calls.__setitem__(0, adapter_calls[0] + 1))
        rollout = torchkvops.Rollout(
            model.get_base_model(), torchkvops.RolloutConfig(max_new_tokens=8, eos_token_id=[])
        )
        result["distributed_got"] = torchkvops.distributed.generate(rollout, ids, mask, gather=False).responses
        result["distributed_adapter_calls"] = adapter_calls[0]
    elif scenario == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        root = FSDP(
            FAMILIES["llama"](),
            auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        inner = root.module  # what TRL generates from: the root's parameters summoned around the call
        sequences = torch.cat([ids, ids.flip(1)], dim=1)

        def gradients():
            root.zero_grad(set_to_none=True)
            root(input_ids=sequences, labels=sequences).loss.backward()
            return [p.grad.clone() for p in root.parameters() if p.grad is not None]

        result["without_call"] = gradients()
        gathers = count_calls("all_gather")  # FSDP1's parameter all-gathers on gloo
        kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        kwargs["synced_gpus"] = True
        with FSDP.summon_full_params(root, recurse=False, writeback=False):
            result["expected"] = type(inner).generate(inner, ids, **kwargs)
            result["wrappers"] = sum(isinstance(m, FSDP) for m in inner.modules())
            generate_in_each_gather_mode(inner, ids, kwargs, gathers, result)
        result["after_call"] = gradients()
        result["served"] = len(rollouts)
        try:  # the root wrapper itself has no generate: the error names the fix
            torchkvops.patch_generate(root)
        except TypeError as e:
            result["root_error"] = str(e)
    elif scenario == "distributed":
        from torchkvops.hf.sharded import fsdp2_modules

        kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        result["expected"] = hf(model, ids, **kwargs)[:, ids.shape[1] :]  # HF on this rank's prompts
        rollout = torchkvops.Rollout(model, torchkvops.RolloutConfig(max_new_tokens=8, eos_token_id=[]))
        gathers = count_parameter_gathers()
        out = torchkvops.distributed.generate(rollout, ids, mask, gather=False)
        result["got"], result["gathers"], result["units"] = out.responses, gathers[0], len(fsdp2_modules(model))
        try:
            torchkvops.distributed.generate(rollout, ids, mask, gather_weights="per_step")
        except RuntimeError as e:  # raised on every rank, naming each rank's error
            result["per_step_error"] = str(e)
    elif scenario == "train":
        kwargs = dict(
            attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0, synced_gpus=False
        )  # no EOS: every rank runs as many forwards
        handle = torchkvops.patch_generate(model)
        result["got"] = model.generate(ids, **kwargs)  # the model's first forwards: FSDP allocates in them
        result["expected"] = hf(model, ids, **kwargs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model.train()
        sequences = result["got"]
        loss = model(input_ids=sequences, labels=sequences).loss  # raised on every rank after a served call
        loss.backward()
        optimizer.step()
        model.eval()
        result["loss"] = loss.detach()
        result["expected_after_step"] = hf(model, ids, **kwargs)
        result["got_after_step"] = model.generate(ids, **kwargs)
        result["served"] = len(rollouts)
        handle.undo()
    torchkvops.Rollout.generate_rows = original  # (the next scenario counts its own)
    return result


if __name__ == "__main__":
    main()
