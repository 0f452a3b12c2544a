"""One process of an FSDP2 test, launched by torchrun (tests/test_fsdp.py):

    torchrun --nproc-per-node 2 tests/fsdp_worker.py SCENARIO OUT_DIR

The model is a tiny Llama sharded with `fully_shard` (each decoder layer, then the root) and marked
FSDP-managed as accelerate marks it, so HF's generate resolves synced_gpus=True. Each rank writes
OUT_DIR/rank<r>.pt with HF's output (the model class's generate on the same wrapper: the oracle), the
patched generate's output and how many rollouts ran. Scenarios: "synced" (ranks' rows end at different
steps; then a call that one rank cannot serve: every rank falls back), "train" (synced_gpus=False: a
served generate, then a training step on its sequences, then a generate that follows the new weights).
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

import torchkvops  # noqa: E402


def sharded_llama():
    model = FAMILIES["llama"]()  # seeded: the same weights on every rank
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model._is_fsdp_managed_module = True  # what accelerate sets; HF's generate reads it for synced_gpus
    return model


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_S", "60"))))
    rank = dist.get_rank()
    warnings.simplefilter("ignore")
    model = sharded_llama()
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
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
