"""One process of a data-parallel test, launched by torchrun (tests/test_distributed.py):

    torchrun --nproc-per-node 2 tests/dist_worker.py SCENARIO[,SCENARIO...] OUT_DIR

Each rank writes OUT_DIR/rank<r>_<scenario>.pt with what it saw; the test compares it with a single-process rollout.
Scenarios: "equivalence" (uneven shards, one of them empty in the last case; greedy and sampled;
gather on and off), "failure" (rank 1 passes bad input: both ranks must raise), "absent" (rank 1 exits
without calling: rank 0 must get an error within the group's timeout), "mismatch" (rank 1 runs another
N, temperature or gather: both ranks must raise the same error before generating).
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from models import FAMILIES, prompts  # noqa: E402
from worker_exit import end_worker  # noqa: E402

import torchkvops  # noqa: E402
import torchkvops.distributed  # noqa: E402
from torchkvops import Rollout, RolloutConfig  # noqa: E402

# Shards of (batch, prompt length, left pads) per rank, per case; the single-process reference
# concatenates them in rank order.
CASES = {
    "uneven": [(2, 7, [0, 3]), (1, 11, [2])],
    "rank1-empty": [(3, 6, [1, 0, 2]), (0, 0, [])],
}
CONFIGS = {
    "greedy": dict(samples_per_prompt=2, max_new_tokens=6, eos_token_id=[]),
    "sampled": dict(samples_per_prompt=3, max_new_tokens=6, eos_token_id=[], temperature=1.0, top_k=30, seed=5),
    "sampled-eos": dict(
        samples_per_prompt=2, max_new_tokens=12, eos_token_id=[7, 9, 11], temperature=1.0, seed=1, return_logprobs=True
    ),
    "prefix": dict(
        samples_per_prompt=2, max_new_tokens=6, eos_token_id=[], temperature=1.0, seed=3, kv_sharing="prefix"
    ),
    # Each shard streamed within a budget of one prompt's rows (RolloutConfig.max_rows).
    "budgeted": dict(
        samples_per_prompt=2, max_new_tokens=16, eos_token_id=[5, 7, 9, 11], temperature=1.0, seed=4, max_rows=2
    ),
    # Each shard streamed within a budget of KV tokens (RolloutConfig.max_kv_tokens): a prompt and one row at
    # its longest, rows preempted and restarted.
    "kv-budgeted": dict(
        samples_per_prompt=2,
        max_new_tokens=16,
        eos_token_id=[5, 7, 9, 11],
        temperature=1.0,
        seed=4,
        kv_sharing="paged",
        max_kv_tokens=64,
    ),
    # Long enough, with enough EOS ids, that each shard's batch is compacted as its rows end (issue #19).
    "compacted": dict(
        samples_per_prompt=4,
        max_new_tokens=40,
        eos_token_id=[5, 7, 9, 11, 13],
        temperature=1.0,
        seed=2,
        kv_sharing="prefix",
        return_logprobs=True,
        enable_profiling=True,
    ),
}


def shard(case: str, rank: int):
    batch, length, pads = CASES[case][rank]
    if batch == 0:
        return None, None
    return prompts(batch, length, seed=10 * rank + length, left_pad=pads)


def main() -> None:
    scenarios, out_dir = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("DIST_TIMEOUT_S", "20"))))
    rank = dist.get_rank()
    for scenario in scenarios:  # (one launch runs several scenarios: each process imports torch once)
        print(f"scenario {scenario}", file=sys.stderr, flush=True)  # (which one failed, in the log)
        result = run(scenario, rank, out_dir)
        torch.save(result, os.path.join(out_dir, f"rank{rank}_{scenario}.pt"))
    end_worker(barrier=False)


def run(scenario: str, rank: int, out_dir: str) -> dict:
    """One scenario's record on this rank ("absent" breaks the group: it writes its record and exits)."""
    model = FAMILIES["llama"]()
    result = {"rank": rank, "world": dist.get_world_size()}
    if scenario == "equivalence":
        for case in CASES:
            ids, mask = shard(case, rank)
            for name, cfg in CONFIGS.items():
                rollout = Rollout(model, RolloutConfig(**cfg))
                result[f"{case}/{name}/gathered"] = torchkvops.distributed.generate(rollout, ids, mask)
                result[f"{case}/{name}/local"] = torchkvops.distributed.generate(rollout, ids, mask, gather=False)
                if cfg.get("enable_profiling") and ids is not None:
                    result[f"{case}/{name}/profile"] = rollout.get_last_profile()
    elif scenario == "failure":
        ids, mask = shard("uneven", rank)
        if rank == 1:
            ids = ids.clone()
            ids[0, -1] = 10_000  # outside the vocabulary: this rank's generate fails its input check
        start = time.monotonic()
        try:
            torchkvops.distributed.generate(Rollout(model, RolloutConfig(max_new_tokens=4)), ids, mask)
            result["error"] = None
        except RuntimeError as e:
            result["error"] = str(e)
        result["seconds"] = time.monotonic() - start
        # The group still works afterwards: a good call succeeds on both ranks.
        ids, mask = shard("uneven", rank)
        result["after"] = torchkvops.distributed.generate(Rollout(model, RolloutConfig(max_new_tokens=2)), ids, mask)
    elif scenario == "mismatch":
        ids, mask = shard("uneven", rank)
        generated = []  # every local generation: a mismatch must be caught before any
        real_generate = Rollout.generate_rows
        Rollout.generate_rows = lambda self, *a, **k: generated.append(1) or real_generate(self, *a, **k)
        settings = {
            "samples_per_prompt": ({"samples_per_prompt": 2}, {"samples_per_prompt": 3}),
            "temperature": ({"temperature": 1.0, "seed": 1}, {"temperature": 0.7, "seed": 1}),
            "gather": ({}, {}),
            # Each decides a collective (the log-probabilities' gather) or the values gathered.
            "return_logprobs": ({"return_logprobs": True}, {}),
            "lm_head_dtype": ({"lm_head_dtype": torch.float32}, {}),
        }
        result["errors"] = {}
        for name, per_rank in settings.items():
            cfg = RolloutConfig(max_new_tokens=3, eos_token_id=[], **per_rank[rank])
            try:
                torchkvops.distributed.generate(Rollout(model, cfg), ids, mask, gather=rank == 0 or name != "gather")
                result["errors"][name] = None
            except Exception as e:  # noqa: BLE001 - what the caller sees
                result["errors"][name] = f"{type(e).__name__}: {e}"
        result["generated"] = len(generated)
        Rollout.generate_rows = real_generate
        result["after"] = torchkvops.distributed.generate(Rollout(model, RolloutConfig(max_new_tokens=2)), ids, mask)
    elif scenario == "absent":
        if rank == 1:
            torch.save(result, os.path.join(out_dir, f"rank{rank}_{scenario}.pt"))
            os._exit(0)  # never calls, never says goodbye
        start = time.monotonic()
        try:
            torchkvops.distributed.generate(Rollout(model, RolloutConfig(max_new_tokens=2)), *shard("uneven", 0))
            result["error"] = None
        except Exception as e:  # noqa: BLE001 - what the user sees
            result["error"] = f"{type(e).__name__}: {e}"
        result["seconds"] = time.monotonic() - start
        torch.save(result, os.path.join(out_dir, f"rank{rank}_{scenario}.pt"))
        os._exit(0)  # the group is broken: no clean shutdown to wait for
    return result


if __name__ == "__main__":
    main()
