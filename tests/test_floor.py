"""What differs between the versions pyproject.toml admits, read through one helper each: FSDP2's parameter
groups (torch 2.11-2.13 keep one, later releases a list) and the cache interface of transformers' recurrent
layers (5.25's, which torchkvops implements; 5.17-5.24 call others). Each test holds on the versions
installed here and on the floor (scripts/floor_check.sh runs this file with torch 2.11 and transformers
5.17), the other version's shape simulated where the installed one lacks it."""

from __future__ import annotations

import re
import types
import warnings
from pathlib import Path

import pytest
import torch
from families import tiny_config
from transformers import AutoModelForCausalLM, Cache

import torchkvops
from torchkvops import Rollout, RolloutConfig
from torchkvops.hf import sharded
from torchkvops.models import precision, recurrent
from torchkvops.models.recurrent import RECURRENT_CACHE_METHODS, recurrent_cache_unsupported
from torchkvops.models.sharding import fsdp2_param_groups

ROOT = Path(__file__).absolute().parents[1]


# --- FSDP2's parameter groups -------------------------------------------------------------------------
def fake_fsdp2_module(version: str, param_dtype: torch.dtype | None):
    """A module whose FSDP state is shaped as `version`'s ("2.11": one `_fsdp_param_group`, "2.14": a
    list `_fsdp_param_groups`), with one group holding the module's weight (as FSDP2's sharded parameter),
    gathered in `param_dtype`."""
    module = torch.nn.Linear(4, 3)
    fsdp_param = types.SimpleNamespace(sharded_param=module.weight, _orig_size=torch.Size([6, 4]))
    group = types.SimpleNamespace(
        mp_policy=types.SimpleNamespace(param_dtype=param_dtype),
        fsdp_params=[fsdp_param],
        post_forward_mesh_info="mesh",
    )
    if version == "2.11":
        state = types.SimpleNamespace(_fsdp_param_group=group, _auto_reshard_after_forward=True)
    else:
        state = types.SimpleNamespace(_fsdp_param_groups=[group], _auto_reshard_after_forward=True)
    module._get_fsdp_state = lambda: state
    return module, group


@pytest.mark.parametrize("version", ["2.11", "2.14"])
def test_fsdp2_parameter_groups_are_read_as_each_torch_keeps_them(version):
    """torch 2.11's FSDPState has `_fsdp_param_group` (one, or None), later ones `_fsdp_param_groups`:
    every reader (the forward dtypes, the gathered bytes, the reshard settings) works on both (issue #51:
    an AttributeError on every FSDP2 model with torch 2.11-2.13)."""
    module, group = fake_fsdp2_module(version, torch.bfloat16)
    assert fsdp2_param_groups(module) == [group]
    assert precision.forward_dtypes(module) == {id(module.weight): torch.bfloat16}
    assert precision.compute_dtype(module) == torch.bfloat16
    assert sharded._unsharded_bytes([module]) == 6 * 4 * 2  # the original size, gathered in bfloat16
    saved = sharded._reshard_settings(module)
    assert saved == (True, ["mesh"])
    group.post_forward_mesh_info = None
    module._get_fsdp_state()._auto_reshard_after_forward = False
    sharded._restore_reshard_settings(module, saved)
    assert group.post_forward_mesh_info == "mesh" and module._get_fsdp_state()._auto_reshard_after_forward


def test_a_torch_2_11_state_without_a_group_has_none():
    module, _ = fake_fsdp2_module("2.11", None)
    module._get_fsdp_state()._fsdp_param_group = None
    assert fsdp2_param_groups(module) == [] and precision.forward_dtypes(module) == {}


def test_only_the_helper_reads_fsdps_parameter_groups():
    """The version-dependent private is read in one place (models/sharding.py), so that the next rename is
    one change."""
    readers = [
        str(path.relative_to(ROOT))
        for folder in ("torchkvops", "tests", "benchmarks", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if re.search(r"\._fsdp_param_groups?\b", path.read_text()) and path.name != "test_floor.py"
    ]
    assert readers == ["torchkvops/models/sharding.py"]


# --- the recurrent layers' cache interface ------------------------------------------------------------
def test_both_implementations_of_the_recurrent_interface_answer_every_method_themselves():
    """The rollout's cache and a training segment's states are the one interface, RecurrentStates: each
    answers every method transformers' recurrent layers call (RECURRENT_CACHE_METHODS) with its own or the
    interface's, never transformers' Cache's (which would read cache layers neither has)."""
    from torchkvops.models.recurrent import RecurrentStates, SegmentStates
    from torchkvops.rollout.kv_cache import RolloutKVCache

    for cls in (RolloutKVCache, SegmentStates):
        assert issubclass(cls, RecurrentStates)
        for name in RECURRENT_CACHE_METHODS:
            owner = next(k for k in cls.__mro__ if name in vars(k))
            # (the state reads and writes are each storage's own: the interface's raise NotImplementedError)
            own = name in ("get_conv_state", "get_recurrent_state", "update_conv_state", "update_recurrent_state")
            assert owner is cls if own else owner in (cls, RecurrentStates), (cls.__name__, name, owner.__name__)


def reason_of_5_17() -> str:
    """What the check says of the recurrent cache interface as transformers 5.17 has it (no get_conv_state,
    get_recurrent_state, is_recording_past, get_recurrent_states_to_keep, increase_count on its Cache):
    simulated on a newer transformers, what is installed on 5.17 itself."""
    if recurrent_cache_unsupported() is not None:
        return recurrent_cache_unsupported()
    with pytest.MonkeyPatch.context() as m:
        for name in RECURRENT_CACHE_METHODS:
            if name not in ("update_conv_state", "update_recurrent_state"):
                m.delattr(Cache, name)
        return recurrent_cache_unsupported()


@pytest.fixture
def refused_interface(monkeypatch):
    """The check answering as on transformers 5.17 (simulated where the installed one is served: the
    layers themselves then still call 5.25's interface, so Hugging Face's generate runs as oracle)."""
    reason = reason_of_5_17()
    monkeypatch.setattr(recurrent, "recurrent_cache_unsupported", lambda: reason)
    return reason


def hybrid_model():
    config = tiny_config("qwen3_5_text")
    if config is None:
        pytest.skip("this transformers has no qwen3_5_text")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_the_reason_names_the_installed_transformers_and_what_its_cache_lacks():
    import transformers

    reason = reason_of_5_17()
    assert f"transformers {transformers.__version__}'s recurrent layers" in reason
    assert "get_conv_state" in reason and ">= 5.25" in reason


def test_a_hybrid_is_refused_naming_the_transformers_version_not_asserted_in_decode(refused_interface):
    """Issue #51: with 5.17's interface the layers asked `has_previous_state`, got False, took the prefill
    path in decode and reached an internal AssertionError in the cache."""
    model = hybrid_model()
    ids = torch.randint(3, 90, (2, 6))
    with pytest.raises(ValueError, match=r"transformers \S+'s recurrent layers .* >= 5\.25"):
        Rollout(model, RolloutConfig(samples_per_prompt=2, max_new_tokens=4))
    with pytest.raises(ValueError, match=r"patch_forward: transformers \S+'s recurrent layers"):
        torchkvops.patch_forward(model)
    # patch_generate: Hugging Face's own generate, with a warning that says why.
    with torch.no_grad():
        expected = model.generate(ids, do_sample=False, max_new_tokens=4, pad_token_id=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torchkvops.patch_generate(model), torch.no_grad():
            got = model.generate(ids, do_sample=False, max_new_tokens=4, pad_token_id=0)
    assert torch.equal(got, expected)
    assert any(">= 5.25" in str(w.message) for w in caught), [str(w.message) for w in caught]


# --- Gemma 3n's KV-shared layers -----------------------------------------------------------------------
@pytest.mark.parametrize("shared", [0, 1, 2, 3])
def test_kv_sharing_read_from_num_kv_shared_layers_as_transformers_computes_it(shared):
    """transformers 5.17's Gemma 3n config has no `kv_sharing_modes` (its attention layers compute which
    layer's KV they reuse from `num_kv_shared_layers`): the adapter computes the same modes, with the
    newer transformers' property as the oracle where it has one (issue #51's floor check: every row of
    the prefix layout read an unwritten layer's KV)."""
    from torchkvops.models.adapter import _kv_sharing_modes

    config = tiny_config("gemma3n_text")
    if config is None:
        pytest.skip("this transformers has no gemma3n_text")
    config.num_hidden_layers, config.layer_types = 6, ["sliding_attention", "full_attention"] * 3
    config.num_kv_shared_layers = shared
    older = types.SimpleNamespace(num_kv_shared_layers=shared)  # what 5.17's config holds
    got = _kv_sharing_modes(older, config.layer_types)
    if not hasattr(type(config), "kv_sharing_modes"):
        pytest.skip("this transformers computes no kv_sharing_modes to compare with")
    want = config.kv_sharing_modes
    assert (got or [None] * 6) == want
