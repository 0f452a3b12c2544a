"""CUDA-graph decode without torch.compile (needs a GPU; every test is marked `cuda`): the same tokens as
plain eager decode, replays across calls with other prompts, re-capture on a new shape or new weights,
a clean fallback when capture fails, and no host sync inside decode."""

import warnings

import pytest
import torch
from models import FAMILIES, prompts

from torchkvops import Rollout, RolloutConfig
from torchkvops.rollout.decode import Decoder

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NO_EOS = []


@pytest.fixture(scope="module")
def model():
    return FAMILIES["llama"]().cuda()


def rollouts(model, **cfg):
    graphs = Rollout(model, RolloutConfig(cuda_graphs=True, **cfg))
    eager = Rollout(model, RolloutConfig(cuda_graphs=False, **cfg))
    return graphs, eager


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
@pytest.mark.parametrize(
    "sampling", [dict(), dict(temperature=0.9, top_k=20, top_p=0.9, seed=4)], ids=["greedy", "seeded"]
)
def test_graph_decode_gives_the_eager_tokens_across_calls_and_shapes(model, kv_sharing, sampling):
    graphs, eager = rollouts(
        model, samples_per_prompt=3, max_new_tokens=12, eos_token_id=NO_EOS, kv_sharing=kv_sharing, **sampling
    )
    # The largest shape first: a larger one later would grow the KV storage, and the smaller shapes
    # would then be captured once more on its new addresses.
    cases = [
        (3, 20, [1, 0, 4], 4),
        (2, 9, [0, 3], 1),
        (2, 9, [2, 0], 2),
        (2, 9, None, 3),  # a new shape: one capture, then replays
        (3, 20, [1, 2, 0], 5),
    ]  # the first shape comes back: its graph replays
    for batch, length, pads, seed in cases:
        ids, mask = prompts(batch, length, seed=seed, left_pad=pads)
        ids, mask = ids.cuda(), mask.cuda()
        assert torch.equal(graphs.generate(ids, mask).sequences, eager.generate(ids, mask).sequences)
    assert graphs.decode_counters().captured_graphs == 2  # one per decode shape
    assert not eager.decode_counters().captured_graphs


def test_graphs_follow_weights_updated_in_place_and_replaced(model):
    model = FAMILIES["llama"]().cuda()
    graphs, eager = rollouts(model, samples_per_prompt=2, max_new_tokens=8, eos_token_id=NO_EOS)
    ids, mask = prompts(2, 9, seed=6)
    ids, mask = ids.cuda(), mask.cuda()
    graphs.generate(ids, mask)
    graphs.generate(ids, mask)  # captured and replayed
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.5)  # in place: same addresses, the graph reads the new values
    assert torch.equal(graphs.generate(ids, mask).sequences, eager.generate(ids, mask).sequences)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight * 0.5)  # new storage: re-capture
    assert torch.equal(graphs.generate(ids, mask).sequences, eager.generate(ids, mask).sequences)


def assert_cuda_state_is_clean():
    """What a failed capture can leave behind: the caller's stream switched, and the default generator
    in capture mode (every eager random op then raises "Offset increment outside graph capture")."""
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.randn(4, device="cuda")
    torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5, training=True)
    torch.cuda.synchronize()


# A model whose forward syncs with the host at every call (as data-dependent routing does), and one that
# does only while a capture is under way (so that the capture itself fails).
SYNCS = {
    "always": lambda mod, args, kwargs: bool(kwargs["position_ids"].max() > -1) and None,
    "while_capturing": lambda mod, args, kwargs: (
        torch.cuda.synchronize() if torch.cuda.is_current_stream_capturing() else None
    ),
}


@pytest.mark.parametrize("sync", list(SYNCS))
def test_a_step_that_cannot_be_captured_falls_back_to_eager_with_one_warning(model, sync):
    """A syncing step is seen during the warm-up step and never captured; a capture that fails anyway is
    cleaned up. Either way: one warning, the eager tokens, and torch's CUDA state as it was."""
    synced = FAMILIES["llama"]().cuda()
    synced.load_state_dict(model.state_dict())
    handle = synced.model.register_forward_pre_hook(SYNCS[sync], with_kwargs=True)
    try:
        graphs, _ = rollouts(synced, samples_per_prompt=2, max_new_tokens=10, eos_token_id=NO_EOS)
        _, eager = rollouts(model, samples_per_prompt=2, max_new_tokens=10, eos_token_id=NO_EOS)
        ids, mask = prompts(2, 9, seed=7)
        ids, mask = ids.cuda(), mask.cuda()
        reason = "syncs with the host" if sync == "always" else "CUDA-graph capture failed"
        with pytest.warns(RuntimeWarning, match=f"decode runs without CUDA graphs .*{reason}"):
            out = graphs.generate(ids, mask)
        assert_cuda_state_is_clean()
        assert torch.equal(out.sequences, eager.generate(ids, mask).sequences)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only
            assert torch.equal(graphs.generate(ids, mask).sequences, eager.generate(ids, mask).sequences)
        assert not graphs.decode_counters().captured_graphs
    finally:
        handle.remove()
    ok, _ = rollouts(model, samples_per_prompt=2, max_new_tokens=10, eos_token_id=NO_EOS)
    assert torch.equal(ok.generate(ids, mask).sequences, out.sequences)
    assert torch.equal(ok.generate(ids, mask).sequences, out.sequences)
    assert ok.decode_counters().captured_graphs == 1  # later rollouts still capture


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_no_host_sync_inside_decode(model, kv_sharing):
    """The decode loop (no EOS ids: no all-ended check) runs with sync debug mode set to error, graphs
    and plain eager steps alike."""
    for cuda_graphs in (False, True):
        r = Rollout(
            model,
            RolloutConfig(
                samples_per_prompt=2,
                max_new_tokens=10,
                eos_token_id=NO_EOS,
                cuda_graphs=cuda_graphs,
                kv_sharing=kv_sharing,
                temperature=1.0,
                top_k=10,
                top_p=0.9,
                seed=1,
                return_logprobs=True,
            ),
        )
        ids, mask = prompts(2, 9, seed=8, left_pad=[0, 2])
        ids, mask = ids.cuda(), mask.cuda()
        r.generate(ids, mask)  # warm-up and capture happen outside the checked region
        original = Decoder.run

        def checked(self, *args, **kwargs):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return original(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Decoder, "run", checked)
            r.generate(ids, mask)
