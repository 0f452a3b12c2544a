"""Generate on an FSDP2-sharded model (fully_shard on CPU with gloo, 2 processes on 127.0.0.1, launched by
torchrun; tests/fsdp_worker.py): with synced_gpus (HF's resolution for an FSDP-managed model) the call is
served on every rank, each rank's tokens equal HF's generate on the same wrapper although the ranks' rows
end at different steps, and a call one rank cannot serve falls back on every rank; with synced_gpus=False
a served call leaves the model trainable (it ran under inference mode, and FSDP's unsharded parameters
broke the next training step), and the next call follows the trained weights. Every launch is bounded by
a timeout."""

import importlib.util
import subprocess
from pathlib import Path

import pytest
import torch
from test_distributed import env, free_port, torchrun
from timeouts import TIMEOUT

ROOT = Path(__file__).absolute().parents[1]
WORKER = str(Path(__file__).with_name("fsdp_worker.py"))

pytest.importorskip("torch.distributed.fsdp")


def run_scenarios(scenarios: list[str], out: Path, worker: str = WORKER, nproc: int = 2, **extra_env) -> dict:
    """Each scenario's ranks' records (`{scenario: [rank 0's, rank 1's, ...]}`) of one launch of `worker
    SCENARIO,SCENARIO,... OUT` on `nproc` processes (torchrun, 127.0.0.1), which runs them one after
    another: each process imports torch, transformers and the library once, not once a scenario.
    `extra_env`: more environment variables for the workers."""
    cmd = torchrun(
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        worker,
        ",".join(scenarios),
        str(out),
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env(**extra_env), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {s: [torch.load(out / f"rank{r}_{s}.pt", weights_only=False) for r in range(nproc)] for s in scenarios}


def run_scenario(scenario: str, out: Path, worker: str = WORKER, nproc: int = 2, **extra_env) -> list[dict]:
    """Each rank's record of `scenario` alone, in a launch of its own."""
    return run_scenarios([scenario], out, worker, nproc, **extra_env)[scenario]


def launched_once(worker: str, scenarios: list[str], **extra_env):
    """A module's fixture: its scenarios run in one launch, the first time a test asks for one of them (a
    failing scenario's stderr, which names it, is then every test's failure)."""

    @pytest.fixture(scope="module")
    def records(tmp_path_factory):
        launched: dict = {}

        def of(scenario: str) -> list[dict]:
            if not launched:
                launched.update(run_scenarios(scenarios, tmp_path_factory.mktemp("ranks"), worker, **extra_env))
            return launched[scenario]

        return of

    return records


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


SCENARIOS = ["synced", "train", "gather", "grad", *(["lora"] if installed("peft") else []), "distributed", "fsdp1"]
records = launched_once(WORKER, SCENARIOS)


def test_synced_generation_is_served_on_every_rank_with_hfs_tokens(records):
    ranks = records("synced")
    for r in ranks:
        assert r["served"] == 1, r["rank"]
        assert torch.equal(r["got"], r["expected"]), r["rank"]
        # One rank cannot serve the second call: every rank fell back to HF's generate, with its output.
        assert r["served_after_fallback"] == 1 and torch.equal(r["fallback_got"], r["fallback_expected"])
    # The ranks' rows ended at different steps (HF trims each rank's output where its own rows ended), so
    # the rank that ended first decoded filler steps until the other was done.
    assert ranks[0]["got"].shape[1] - 6 != ranks[1]["got"].shape[1] - 9


def test_a_served_call_leaves_the_sharded_model_trainable(records):
    for r in records("train"):
        assert r["served"] == 2 and torch.isfinite(r["loss"])
        assert torch.equal(r["got"], r["expected"])
        assert not torch.equal(r["expected_after_step"], r["expected"])  # the step changed the tokens ...
        assert torch.equal(r["got_after_step"], r["expected_after_step"])  # ... and the rollout follows


def test_weights_are_gathered_once_per_call_with_hfs_tokens(records):
    """gather_weights="once": one parameter all-gather per FSDP unit for the whole call (not one per unit
    per step), HF's tokens, FSDP's reshard-after-forward settings as before; a budget the weights do not
    fit keeps the per-step gathers, with one warning that says why."""
    for r in records("gather"):
        assert r["served"] == 3
        for mode in ("per_step", "once", "auto"):
            assert torch.equal(r[f"got_{mode}"], r["expected"]), (r["rank"], mode)
            assert r[f"settings_after_{mode}"] == r["settings_before"], mode
        assert 0 < r["gathers_once"] <= r["units"] < r["gathers_per_step"]
        # The budget of 1 byte: gathered per step (the root unit once more: the gathered call resharded it,
        # where FSDP keeps the root unsharded after a forward).
        assert r["gathers_per_step"] <= r["gathers_auto"] <= r["gathers_per_step"] + 1
        assert r["warnings_per_step"] == [] and r["warnings_once"] == []
        assert len(r["warnings_auto"]) == 1 and "exceed gather_budget_bytes" in r["warnings_auto"][0]
        assert r["profile_once"]["gathered_bytes"] > 0 and r["profile_once"]["gather_ms"] > 0
        assert r["profile_per_step"]["gathered_bytes"] == 0 == r["profile_auto"]["gathered_bytes"]
        # CUDA graphs (a no-op on this CPU) stay allowed only where the weights stay gathered for the call:
        # replayed per step, a graph would skip FSDP's gathers.
        assert r["cuda_graphs_once"] == [True] and r["cuda_graphs_per_step"] == [False] == r["cuda_graphs_auto"]


def test_a_training_step_after_a_gathered_call_has_the_gradients_of_one_after_no_call(records):
    for r in records("grad"):
        assert r["served"] == 1 and r["gathered_bytes"] > 0
        for before, after in zip(r["without_call"], r["after_call"]):
            assert torch.equal(before, after)


def test_a_sharded_lora_model_is_gathered_then_merged_and_left_bit_identical(records):
    """LoRA on every linear layer of the sharded model: the call gathers, merges the adapters into the
    gathered weights, gives PEFT's own (unmerged, per-step gathered) generate's tokens, and leaves every
    rank's shards bit-identical; torchkvops.distributed.generate does the same."""
    pytest.importorskip("peft")
    for r in records("lora"):
        assert r["served"] == 1 and torch.equal(r["got"], r["expected"]), r["rank"]
        assert r["profile"]["gathered_bytes"] > 0 and r["profile"]["merged_lora_layers"] == r["lora_layers"] == 14
        assert r["changed"] == []
        # The merged copies count against the budget: a budget of the gathered weights alone keeps the
        # per-step gathers (one warning saying why) where the call merges, and gathers where it does not.
        assert r["gathered_budget_merge_True"] == 0 and r["gathered_budget_merge_False"] > 0
        assert len(r["warnings_budget_merge_True"]) == 1 and "merged LoRA copies" in r["warnings_budget_merge_True"][0]
        assert r["warnings_budget_merge_False"] == []
        assert torch.equal(r["got_budget_merge_True"], r["expected"]) and torch.equal(
            r["got_budget_merge_False"], r["expected"]
        )
        # torchkvops.distributed.generate: the same tokens, with the adapters merged (none of them ran).
        assert torch.equal(r["distributed_got"], r["expected"][:, -8:]) and r["distributed_adapter_calls"] == 0


def test_distributed_generate_gathers_a_sharded_model_once(records):
    """torchkvops.distributed.generate: the ranks decode different numbers of rows and prompt lengths with
    no collective between the gather and the results (at most one all-gather per FSDP unit, then the
    result exchange's); each rank's tokens are HF's on its own prompts; per-step gathers are refused."""
    for r in records("distributed"):
        assert torch.equal(r["got"], r["expected"]), r["rank"]
        assert 0 < r["gathers"] <= r["units"]
        assert "gather_weights='per_step' cannot serve" in r["per_step_error"]


def test_fsdp1_wrappers_are_summoned_once_per_call_with_hfs_tokens(records):
    """FSDP1 (the wrappers inside the model TRL generates from, the root's parameters summoned around the
    call): one all-gather per wrapper for the call instead of one per wrapper and forward, HF's tokens,
    the budget fallback with one warning, and a training step after the calls has the gradients of one
    before them."""
    for r in records("fsdp1"):
        assert r["served"] == 3
        for mode in ("per_step", "once", "auto"):
            assert torch.equal(r[f"got_{mode}"], r["expected"]), (r["rank"], mode)
        assert r["gathers_once"] == r["wrappers"] == 2 and r["gathers_per_step"] == r["wrappers"] * 8
        assert r["gathers_auto"] == r["gathers_per_step"] and r["warnings_per_step"] == r["warnings_once"] == []
        assert len(r["warnings_auto"]) == 1 and "exceed gather_budget_bytes" in r["warnings_auto"][0]
        assert r["profile_once"]["gathered_bytes"] > 0 == r["profile_auto"]["gathered_bytes"]
        assert "patch_generate(model.module)" in r["root_error"] and "summon_full_params" in r["root_error"]
        assert "ForCausalLM" not in r["root_error"]  # (it named a class that does not exist)
        assert len(r["after_call"]) == len(r["without_call"]) > 0
        for before, after in zip(r["without_call"], r["after_call"]):
            assert torch.equal(before, after)
