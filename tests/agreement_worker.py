"""One process of a test of what every process must agree on, launched by torchrun (tests/test_agreement.py):

    torchrun --nproc-per-node 2 tests/agreement_worker.py SCENARIO[,SCENARIO...] OUT_DIR

Tiny Llamas sharded with FSDP2 on CPU over gloo, with a short process-group timeout (DIST_TIMEOUT_S), so that
a collective one process waits in alone ends the scenario with an error instead of a hang. The oracle is
HF's generate (the model class's) on the same wrapper. A rank's call "falls back" where its attention
mask is right-padded (which the rollout refuses and HF's generate takes). Each rank writes
OUT_DIR/rank<r>_<scenario>.pt. Scenarios:
- "unsynced_mixed": synced_gpus resolved False (decoder layers sharded, the model not: HF then resolves
  False), or the root sharded with synced_gpus=False; rank 0's call can be served, rank 1's falls back;
  then a training step.
- "eos_one_rank": synced generation where only rank 0's call has EOS ids, gathered once and per step.
- "multi_root": every decoder layer fully_shard-ed, the model not; the first call on the fresh model.
- "common_prefix_one_rank": synced generation where only rank 0's prompts begin with a common prefix
  (a system prompt), gathered per step and once.
- "hooks": FSDP2 with a bf16 mixed-precision policy: how many of FSDP's forward hooks run inside decode
  steps (what a CUDA graph would capture) with the weights gathered once and per step; the dtype the
  rollout's KV cache is built in, by patch_generate and by a Rollout made before the gather.
- "combinations": every combination of served/fallback on each rank x synced/unsynced x EOS ids on
  each rank x gather mode, each call followed by a training step's forward and backward.
- "nccl_graphs" (BACKEND=nccl, one process, a GPU): FSDP2 with a bf16 mixed-precision policy on CUDA,
  gathered once, decoded from CUDA graphs: HF's tokens, graphs captured and replayed, no FSDP hook in the
  call, then a training step and HF's generate on FSDP's own streams, and a call after them.
"""

import datetime
import itertools
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_worker import llama, sharded_llama  # noqa: E402
from models import VOCAB, prompts  # noqa: E402
from worker_exit import end_worker  # noqa: E402

import torchkvops  # noqa: E402

EOS = [5, 7, 9, 11, 13]


def layers_sharded():
    """Every decoder layer sharded, the model not (several FSDP roots; not FSDP-managed for HF)."""
    model = llama()
    for layer in model.get_decoder().layers:
        fully_shard(layer)
    return model


def training_step(model, sequences, lr: float = 1e-3) -> torch.Tensor:
    """One SGD step on `sequences` (FSDP's gathers in the forward, its reduce-scatters in the backward:
    they fail if a call left the process group broken); lr=0 leaves the weights as they were."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=sequences, labels=sequences).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None and lr:
                p.add_(p.grad, alpha=-lr)
    model.zero_grad(set_to_none=True)
    model.eval()
    return loss.detach()


def count_rollouts() -> list[int]:
    count = [0]
    original = torchkvops.Rollout.generate_rows

    def counted(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    torchkvops.Rollout.generate_rows = counted
    return count


def inputs(rank: int, falls_back: bool):
    """This rank's prompts (rank 1's longer and more of them); right-padded where the call must fall back."""
    ids, mask = prompts(2 + 2 * rank, 6 + 3 * rank, seed=40 + rank, left_pad=[0, 1] + [2, 0] * rank)
    if falls_back:
        mask = mask.flip(1)  # right padding: refused by the rollout, taken by HF's generate
    return ids, mask


def greedy(mask, eos_token_id=None, synced_gpus=None, max_new_tokens=8) -> dict:
    """generate's arguments for a greedy call of `max_new_tokens` tokens."""
    return dict(
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        synced_gpus=synced_gpus,
    )


def served_per_step_and_once(model, ids, kwargs, result: dict, rollouts: list[int], **options) -> None:
    """patch_generate(model, gather_weights=mode, **options) for mode "per_step" then "once", one call each:
    its tokens in result["got_<mode>"], the rollouts it ran in result["served_<mode>"]."""
    for mode in ("per_step", "once"):
        handle = torchkvops.patch_generate(model, gather_weights=mode, **options)
        before = rollouts[0]
        result[f"got_{mode}"] = model.generate(ids, **kwargs)
        result[f"served_{mode}"] = rollouts[0] - before
        handle.undo()


def unused_token(model, rank: int) -> int:
    """A token id that neither rank's greedy output contains (synced HF generate, no EOS): an EOS id that
    never ends a row, so that unsynced calls run as many forwards on every rank (HF's own generate would
    otherwise leave a rank in a forward's all-gather alone)."""
    seen = torch.zeros(VOCAB, dtype=torch.long)
    for falls_back in (False, True):
        ids, mask = inputs(rank, falls_back)
        out = type(model).generate(model, ids, **greedy(mask, synced_gpus=True))
        seen[out.flatten()] = 1
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return int((seen[3:] == 0).nonzero()[0]) + 3


def main() -> None:
    scenarios, out_dir = sys.argv[1].split(","), sys.argv[2]
    timeout = float(os.environ.get("DIST_TIMEOUT_S", "60"))
    backend = os.environ.get("BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    warnings.simplefilter("ignore")
    rollouts = count_rollouts()
    for scenario in scenarios:  # (one launch runs several scenarios: each process imports torch once)
        print(f"scenario {scenario}", file=sys.stderr, flush=True)  # (which one failed, in the log)
        result = run(scenario, rank, rollouts, timeout, backend)
        torch.save(result, os.path.join(out_dir, f"rank{rank}_{scenario}.pt"))
    end_worker()


def run(scenario: str, rank: int, rollouts: list[int], timeout: float, backend: str) -> dict:
    """One scenario's record on this rank."""
    rollouts[0] = 0  # (counted from this scenario's start)
    result = {"rank": rank}
    if scenario == "unsynced_mixed":
        for sharding in ("layers", "root"):
            model = layers_sharded() if sharding == "layers" else sharded_llama()
            ids, mask = inputs(rank, falls_back=rank == 1)
            kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
            if sharding == "root":
                kwargs["synced_gpus"] = False
            handle = torchkvops.patch_generate(model)
            before, start = rollouts[0], time.perf_counter()
            result[f"got_{sharding}"] = model.generate(ids, **kwargs)
            result[f"seconds_{sharding}"] = time.perf_counter() - start
            result[f"served_{sharding}"] = rollouts[0] - before
            handle.undo()
            result[f"expected_{sharding}"] = type(model).generate(model, ids, **kwargs)
            result[f"loss_{sharding}"] = training_step(model, torch.cat([ids, ids.flip(1)], dim=1))
    elif scenario == "eos_one_rank":
        model = sharded_llama()
        ids, mask = inputs(rank, falls_back=False)
        kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
        kwargs["eos_token_id"] = EOS if rank == 0 else None
        result["expected"] = type(model).generate(model, ids, **kwargs)
        served_per_step_and_once(model, ids, kwargs, result, rollouts)
        result["loss"] = training_step(model, torch.cat([ids, ids.flip(1)], dim=1))
    elif scenario == "multi_root":
        model = layers_sharded()
        ids, mask = inputs(rank, falls_back=False)
        kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        handle = torchkvops.patch_generate(model, gather_weights="once")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["got"] = model.generate(ids, **kwargs)  # the fresh model's first call
        result["warnings"] = [str(w.message) for w in caught if "torchkvops" in str(w.message)]
        result["served"] = rollouts[0]
        result["profile"] = handle.last_profile().to_dict()
        result["got_again"] = model.generate(ids, **kwargs)
        result["served_again"] = rollouts[0] - 1
        handle.undo()
        result["expected"] = type(model).generate(model, ids, **kwargs)
        result["loss"] = training_step(model, torch.cat([ids, ids.flip(1)], dim=1))
    elif scenario == "common_prefix_one_rank":
        model = sharded_llama()
        ids, mask = inputs(rank, falls_back=False)
        if rank == 0:  # a system prompt of 5 tokens in front of each of rank 0's prompts
            starts = (mask == 0).sum(dim=1)
            for row, start in enumerate(starts.tolist()):
                ids[row, start : start + 5] = torch.arange(20, 25)
        kwargs = greedy(mask, max_new_tokens=6)
        result["expected"] = type(model).generate(model, ids, **kwargs)
        served_per_step_and_once(model, ids, kwargs, result, rollouts, min_shared_tokens=4)
        result["loss"] = training_step(model, torch.cat([ids, ids.flip(1)], dim=1))
    elif scenario == "hooks":
        hooks_scenario(result, rank, rollouts)
    elif scenario == "combinations":
        combinations_scenario(result, rank, rollouts, timeout)
    elif scenario == "nccl_graphs":
        nccl_graphs_scenario(result, rank, backend)
    return result


def count_fsdp_hooks() -> tuple[list[int], list[int]]:
    """(every FSDP2 forward-hook call, those made inside a decode step): FSDP's hook methods wrapped before
    any model is sharded (fully_shard binds them), and every decode step (DecodeRunner.__call__: what a CUDA
    graph captures) marked."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from torchkvops.rollout.graphs import DecodeRunner

    calls, in_step, stepping = [0], [0], [False]
    for name in ("_pre_forward", "_post_forward", "_root_pre_forward"):
        original = getattr(FSDPState, name)

        def counted(self, *args, original=original, **kwargs):
            calls[0] += 1
            in_step[0] += stepping[0]
            return original(self, *args, **kwargs)

        setattr(FSDPState, name, counted)
    step = DecodeRunner.__call__

    def marked(self):
        stepping[0] = True
        try:
            return step(self)
        finally:
            stepping[0] = False

    DecodeRunner.__call__ = marked
    return calls, in_step


def hooks_scenario(result: dict, rank: int, rollouts: list[int]) -> None:
    calls, in_step = count_fsdp_hooks()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = llama()
    for layer in model.get_decoder().layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model._is_fsdp_managed_module = True
    ids, mask = inputs(rank, falls_back=False)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    # A Rollout made before any gather (the weights sharded fp32 DTensors): its KV cache's dtype.
    rollout = torchkvops.Rollout(model, torchkvops.RolloutConfig(max_new_tokens=10, eos_token_id=[]))
    result["rollout_dtype"] = rollout.adapter.dtype
    result["expected"] = type(model).generate(model, ids, **kwargs)
    for mode in ("once", "per_step"):
        handle = torchkvops.patch_generate(model, gather_weights=mode)
        before, before_in_step, served = calls[0], in_step[0], rollouts[0]
        result[f"got_{mode}"] = model.generate(ids, **kwargs)
        result[f"hooks_{mode}"] = calls[0] - before
        result[f"hooks_in_steps_{mode}"] = in_step[0] - before_in_step
        result[f"served_{mode}"] = rollouts[0] - served
        result[f"profile_{mode}"] = handle.last_profile().to_dict()
        result[f"adapter_dtype_{mode}"] = handle.session.adapter.dtype
        result[f"kv_dtypes_{mode}"] = sorted({str(r.cache.dtype) for r in handle.session.rollouts.values()})
        handle.undo()
    out = torchkvops.distributed.generate(rollout, ids, mask, gather=False)
    result["distributed_got"] = out.responses
    result["distributed_kv_dtype"] = str(rollout.cache.dtype)
    # The hooks are back in place: FSDP's training step runs them.
    before = calls[0]
    result["loss"] = training_step(model, torch.cat([ids, ids.flip(1)], dim=1))
    result["hooks_training"] = calls[0] - before


def nccl_graphs_scenario(result: dict, rank: int, backend: str) -> None:
    """Two models on the GPU: float32 (the tokens are HF's generate's, exactly) and bf16 mixed precision
    (the graph-replayed tokens are the same call's eager ones: HF's decode kernels round otherwise). With
    gloo, the same on the CPU (no graph: a check of the scenario itself)."""
    calls, _ = count_fsdp_hooks()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    ids, mask = (t.to(device) for t in inputs(rank, falls_back=False))
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    sequences = torch.cat([ids, ids.flip(1)], dim=1)
    for precision, policy in (("fp32", MixedPrecisionPolicy()), ("bf16", MixedPrecisionPolicy(torch.bfloat16))):
        model = llama().to(device)
        for layer in model.get_decoder().layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)

        def served(tag: str, cuda_graphs: bool = True) -> None:
            tag = f"{precision}_{tag}"
            handle = torchkvops.patch_generate(model, gather_weights="once", cuda_graphs=cuda_graphs)
            before = calls[0]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result[f"got_{tag}"] = model.generate(ids, **kwargs).cpu()
                result[f"got_again_{tag}"] = model.generate(ids, **kwargs).cpu()  # replays the graphs
            result[f"hooks_{tag}"] = calls[0] - before
            result[f"warnings_{tag}"] = [str(w.message) for w in caught if "torchkvops" in str(w.message)]
            rollout = next(iter(handle.session.rollouts.values()))
            result[f"captured_graphs_{tag}"] = rollout.decode_counters().captured_graphs
            result[f"profile_{tag}"] = handle.last_profile().to_dict()
            handle.undo()

        result[f"expected_{precision}_first"] = type(model).generate(model, ids, **kwargs).cpu()
        served("first")
        served("first_eager", cuda_graphs=False)
        # FSDP's streams and hooks after the calls: a training step, then HF's generate (per-step gathers).
        result[f"loss_{precision}"] = training_step(model, sequences).cpu()
        result[f"expected_{precision}_after"] = type(model).generate(model, ids, **kwargs).cpu()
        served("after")
        served("after_eager", cuda_graphs=False)


def combinations_scenario(result: dict, rank: int, rollouts: list[int], timeout: float) -> None:
    """Every combination, in the same order on both ranks; stops at the first error (a broken process
    group fails everything after it)."""
    model = sharded_llama()
    never = unused_token(model, rank)
    result["records"], result["error"] = [], None
    both = (True, False)
    for served, synced, eos in itertools.product(
        itertools.product(both, repeat=2), both, itertools.product(both, repeat=2)
    ):
        ids, mask = inputs(rank, falls_back=not served[rank])
        # Synced: EOS ids that end rows at different steps on each rank; unsynced: one that never ends a
        # row (else HF's own generate would leave one rank in a forward's gathers alone).
        eos_ids = (EOS if synced else [never]) if eos[rank] else None
        kwargs = greedy(mask, eos_ids, synced)
        try:
            expected = type(model).generate(model, ids, **kwargs)
            for mode in ("per_step", "once", "auto"):
                handle = torchkvops.patch_generate(model, gather_weights=mode)
                before, start = rollouts[0], time.perf_counter()
                got = model.generate(ids, **kwargs)
                seconds = time.perf_counter() - start
                handle.undo()
                loss = training_step(model, torch.cat([ids, ids.flip(1)], dim=1), lr=0.0)
                result["records"].append(
                    dict(
                        served=served,
                        synced=synced,
                        eos=eos,
                        mode=mode,
                        seconds=seconds,
                        rollouts=rollouts[0] - before,
                        equal=bool(torch.equal(got, expected)),
                        loss=float(loss),
                    )
                )
        except Exception as e:  # noqa: BLE001 - recorded: the test names the combination that failed
            result["error"] = f"{served} {synced} {eos}: {type(e).__name__}: {e}"[:2000]
            break
    result["timeout"] = timeout


if __name__ == "__main__":
    main()
