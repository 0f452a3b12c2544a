"""What a captured decode graph reads by address is either in its key or lives as long as the rollout.

A CUDA graph replays its kernels on the addresses it was captured with. The decode runner keys each
graph by the decode shape and by addresses (torchkvops.rollout.decode, "Graph keys"); a tensor the step
reads that is neither keyed nor kept for the rollout's life can be freed and its memory handed to
something else while the graph is kept: a replay then reads and writes freed memory. Here every decode
step of a rollout runs under a dispatch mode that records the storages its ops read (the same ops a
capture records), on the CPU, across the calls that make tensors anew: a first generate, a larger one
(the KV buffers grow), an extend whose history outgrows the buffers, the first shape again (its graph
would replay), compaction, a row budget's refills, log-probabilities and min_new_tokens. A storage the
step reads that it did not make itself must hold one of the key's addresses, or be one of the storages
the rollout's first call already read unkeyed (made once, kept). The LoRA scale, a Python float baked
into a captured graph, must change the key too."""

import pytest
import torch
from models import FAMILIES, prompts
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchkvops import Rollout, RolloutConfig
from torchkvops.rollout.graphs import DecodeRunner

LAYOUTS = ["copy", "prefix", "paged"]
# Ops whose tensor input is a constant made on the spot (torch.tensor(...) in the step): not a read.
_FRESH = {"lift_fresh", "lift_fresh_copy"}


class StepReads(TorchDispatchMode):
    """The storages (address -> bytes) the ops of one step read that the step did not make itself."""

    def __init__(self):
        super().__init__()
        self.external: dict[int, int] = {}
        self.made: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ not in _FRESH:
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in self.made:
                        self.external[ptr] = max(self.external.get(ptr, 0), t.untyped_storage().nbytes())
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.external:
                self.made.add(t.untyped_storage().data_ptr())
        return out


def key_addresses(key) -> set[int]:
    return {x for x in tree_leaves(key) if isinstance(x, int) and not isinstance(x, bool)}


class Recorder:
    """Every step's external reads, with the key the runner holds for it."""

    def __init__(self, monkeypatch):
        self.steps: list[tuple[dict[int, int], set[int]]] = []
        call = DecodeRunner.__call__

        def recorded(runner):
            with StepReads() as reads:
                call(runner)
            self.steps.append((reads.external, key_addresses(runner.key)))

        monkeypatch.setattr(DecodeRunner, "__call__", recorded)

    def unkeyed(self, since: int = 0) -> set[int]:
        """The storages read by the steps from `since` on that hold none of their key's addresses."""
        found = set()
        for external, keyed in self.steps[since:]:
            for ptr, size in external.items():
                if not any(ptr <= a < ptr + size for a in keyed):
                    found.add(ptr)
        return found


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_address_a_decode_step_reads_is_keyed_or_kept(layout, monkeypatch):
    model = FAMILIES["llama"]()
    recorder = Recorder(monkeypatch)
    config = RolloutConfig(
        samples_per_prompt=2,
        max_new_tokens=20,
        min_new_tokens=2,
        kv_sharing=layout,
        temperature=1.0,
        seed=0,
        eos_token_id=[41, 60, 90],
        return_logprobs=True,
        min_shared_tokens=4,
        enable_profiling=True,
    )
    rollout = Rollout(model, config)
    small = prompts(2, 6, seed=0, left_pad=[0, 1])
    rollout.generate(*small)
    first_call = len(recorder.steps)
    assert first_call > 0
    kept = recorder.unkeyed(0)
    # A larger call (the buffers grow), an extend past the buffers' length, a call whose prompts share a
    # common prefix (computed once; the prefix layout keeps it in a buffer of its own), an extend after it,
    # and the first shape again.
    larger = rollout.generate(*prompts(3, 40, seed=1, left_pad=[0, 3, 1]))
    rollout.extend(larger, [list(range(3, 40))] * 6, max_new_tokens=12)
    ids, mask = prompts(3, 30, seed=2, left_pad=[0, 4, 9])
    for row, pads in enumerate([0, 4, 9]):
        ids[row, pads : pads + 10] = torch.arange(10, 20)  # a system prompt of 10 tokens in front of each
    common = rollout.generate(ids, mask)
    assert rollout.get_last_profile().prefill_tokens == 10 + int(mask.sum()) - 3 * 10  # the system prompt once
    rollout.extend(common, [[5, 6]] * 6, max_new_tokens=8)
    rollout.generate(*small)
    assert rollout.decode_counters().compactions > 0  # compacted shapes were decoded too
    later = recorder.unkeyed(first_call)
    assert later <= kept, (
        f"decode steps read {len(later - kept)} storage(s) that are neither in their graph's key nor made once "
        "for the rollout (the first call read them): a kept graph would replay on freed memory"
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_address_a_streamed_decode_step_reads_is_keyed_or_kept(layout, monkeypatch):
    """A row budget: prompts join the running batch as others end (refills), in one decode shape."""
    model = FAMILIES["llama"]()
    recorder = Recorder(monkeypatch)
    config = RolloutConfig(
        samples_per_prompt=2, max_new_tokens=16, kv_sharing=layout, temperature=1.0, seed=0, eos_token_id=[41, 60, 90]
    )
    rollout = Rollout(model, RolloutConfig(**{**config.__dict__, "max_rows": 4}))
    rollout.generate(*prompts(3, 6, seed=0))
    first_call = len(recorder.steps)
    kept = recorder.unkeyed(0)
    rollout.generate(*prompts(6, 30, seed=2, left_pad=[0, 2, 0, 5, 1, 0]))  # larger buffers, more refills
    rollout.generate(*prompts(3, 6, seed=0))
    later = recorder.unkeyed(first_call)
    assert later <= kept, f"streamed decode steps read {len(later - kept)} unkeyed storage(s) made anew"


def test_a_lora_scale_change_changes_the_graph_key():
    """PEFT's LoRA layers multiply by `scaling[adapter]`, a Python float: a captured graph bakes it in, so
    set_scale / scale_layer must re-capture, not replay the old scale."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        FAMILIES["llama"](), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    rollout = Rollout(model.get_base_model(), RolloutConfig(samples_per_prompt=2, max_new_tokens=4, eos_token_id=[]))
    ids, mask = prompts(2, 6, seed=0)
    keys = []
    for change in (None, lambda m: m.set_scale("default", 0.5), lambda m: m.scale_layer(3.0)):
        if change is not None:
            for module in model.modules():
                if isinstance(module, peft.tuners.lora.LoraLayer):
                    change(module)
        rollout.generate(ids, mask)
        keys.append(rollout.decode_counters().graph_key)
    assert keys[0] != keys[1] != keys[2] != keys[0]
