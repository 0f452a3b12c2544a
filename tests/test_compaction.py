"""Compaction of the decode batch as responses end (issue #19): the same tokens and log-probabilities as a
rollout that decodes every row to the end (itself held to HF generate in test_rollout.py), in both KV
layouts, greedy and seeded, with padded prompts, rows ending at many different steps, filler rows
(torchkvops.generate) and compiled decode; in-place KV gathering; the plans; a bounded number of
decode shapes; no host sync in the steps; and on CUDA, graphs replayed across calls."""

import warnings

import conftest
import pytest
import torch
from devices import CUDA
from models import FAMILIES, prompts
from torch.utils._python_dispatch import TorchDispatchMode

import torchkvops
from torchkvops import Rollout, RolloutConfig
from torchkvops.rollout import compaction
from torchkvops.rollout.graphs import DecodeRunner
from torchkvops.rollout.kv_cache import KVShape, RolloutKVCache
from torchkvops.rollout.layouts import DenseLayout

LAYOUTS = ["copy", "prefix", "paged"]
SAMPLING = {"greedy": dict(), "seeded": dict(temperature=1.0, seed=3)}
# Three prompts, two of them left-padded, 4 samples each; long enough for many checks (every 8 steps).
N, NEW = 4, 64


def _prompts():
    return prompts(3, 9, seed=1, left_pad=[0, 3, 1])


def spread_eos(model, ids, mask, **cfg) -> list[int]:
    """EOS ids that end the rows at many different steps: the two tokens whose first occurrences in
    responses decoded without EOS are spread the widest (every token's first step, from that run)."""
    free = Rollout(model, RolloutConfig(eos_token_id=[], **cfg)).generate(ids, mask).responses
    firsts = {}
    for token in free.unique().tolist():
        hit = (free == token).int()
        first = torch.where(hit.any(dim=1), hit.argmax(dim=1), -1)
        firsts[token] = set(first.tolist()) - {-1}
    return sorted(firsts, key=lambda t: len(firsts[t]), reverse=True)[:2]


def both(model, ids, mask, **cfg):
    """(compacted, full) outputs and profiles of one configuration."""
    outs = []
    for compact in (True, False):
        r = Rollout(model, RolloutConfig(compact_finished_rows=compact, enable_profiling=True, **cfg))
        outs.append((r.generate(ids, mask), r.get_last_profile()))
    return outs


def assert_same_output(a, b):
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.response_mask, b.response_mask)
    if a.logprobs is not None:  # the batch shape changes the logits' last bits (GEMM blocking), not the tokens
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_tokens_and_logprobs_equal_without_compaction(llama, layout, sampling):
    ids, mask = _prompts()
    cfg = dict(samples_per_prompt=N, max_new_tokens=NEW, kv_sharing=layout, return_logprobs=True, **SAMPLING[sampling])
    eos = spread_eos(llama, ids, mask, **cfg)
    (on, p_on), (off, p_off) = both(llama, ids, mask, eos_token_id=eos, **cfg)
    assert_same_output(on, off)
    lengths = on.response_mask.sum(dim=1)
    assert len(set(lengths.tolist())) >= 3, lengths  # rows ended at several different steps
    # Compaction happened, and the profile says what was computed and what was useful.
    rows, length = ids.shape[0] * N, on.responses.shape[1]
    assert p_off.computed_row_steps == rows * length
    assert p_on.useful_row_steps == p_off.useful_row_steps == int(lengths.sum())
    assert p_on.useful_row_steps <= p_on.computed_row_steps < p_off.computed_row_steps
    assert p_on.useful_fraction > p_off.useful_fraction


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_ending_at_every_check_with_min_new_tokens(llama, layout):
    """Eight prompts whose rows end at many steps (sampling, three EOS ids), min_new_tokens holding EOS
    back for the first steps: the batch shrinks check after check, down to the smallest sizes."""
    ids, mask = prompts(8, 6, seed=5, left_pad=[0, 2, 0, 4, 1, 0, 3, 0])
    cfg = dict(
        samples_per_prompt=2,
        max_new_tokens=80,
        kv_sharing=layout,
        temperature=1.3,
        seed=11,
        min_new_tokens=3,
        return_logprobs=True,
    )
    eos = spread_eos(llama, ids, mask, **cfg) + [7]
    (on, p_on), (off, _) = both(llama, ids, mask, eos_token_id=eos, **cfg)
    assert_same_output(on, off)
    assert bool((on.response_mask.sum(dim=1) >= 3).all())
    assert len(set(on.response_mask.sum(dim=1).tolist())) >= 6
    assert p_on.computed_row_steps < 16 * on.responses.shape[1]


def test_no_eos_ids_never_compacts(llama):
    ids, mask = _prompts()
    (on, p_on), (off, p_off) = both(llama, ids, mask, samples_per_prompt=2, max_new_tokens=20, eos_token_id=[])
    assert_same_output(on, off)
    assert p_on.computed_row_steps == p_off.computed_row_steps == 6 * 20 == p_on.useful_row_steps


@pytest.mark.parametrize("layout", LAYOUTS)
def test_filler_rows_of_uneven_groups_through_generate(llama, layout):
    """torchkvops.generate pads groups of identical prompts to one size with filler rows: they have ended
    before the first step, and compaction drops them; the caller's rows and their order are unchanged."""
    from transformers import GenerationConfig

    ids, mask = prompts(3, 8, seed=2, left_pad=[0, 2, 1])
    # Groups of 1, 4 and 2 identical rows: 4 slots each, 5 of the 12 are filler.
    rows = torch.tensor([0, 1, 1, 1, 1, 2, 2])
    ids, mask = ids[rows], mask[rows]
    gen = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=48, eos_token_id=[41, 60], pad_token_id=0)
    outs = []
    for compact in (True, False):
        model = FAMILIES["llama"]()
        with torchkvops.patch_generate(model, kv_sharing=layout, compact_finished_rows=compact):
            torch.manual_seed(0)
            outs.append(model.generate(ids, attention_mask=mask, generation_config=gen))
    assert torch.equal(outs[0], outs[1])
    assert outs[0].shape[0] == 7 and torch.equal(outs[0][:, :8], ids)


# --- pieces --------------------------------------------------------------------------------------
def test_bucket_sizes_are_few_and_pad_at_most_a_quarter():
    sizes = [compaction.bucket(n) for n in range(1, 2049)]
    assert all(s >= n for n, s in zip(range(1, 2049), sizes))
    assert all(s <= max(n, 1.25 * n) for n, s in zip(range(1, 2049), sizes))
    assert sizes == sorted(sizes)  # more live rows never get a smaller batch
    assert len(set(sizes)) == 8 + 4 * 8  # every size up to 8, then four per octave up to 2048
    assert compaction.bucket_sizes(64) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64]


def test_a_plan_always_makes_the_batch_smaller(monkeypatch):
    """Even when told to compact at any saving (a fraction of 1), a batch with no ended row, or one whose
    bucket is its own size, is left as it is: the compacted state would be the state it is gathered from."""
    monkeypatch.setattr(compaction, "COMPACT_FRACTION", 1.0)
    for rows, ended in ((8, 0), (10, 1), (2, 1)):  # bucket(9) = 10; the smallest batch made is 2 rows
        finished = torch.zeros(rows, dtype=torch.bool)
        finished[:ended] = True
        assert compaction.plan(finished, compaction.BatchMap(rows)) is None, (rows, ended)
    finished = torch.zeros(8, dtype=torch.bool)
    finished[3] = True
    assert compaction.plan(finished, compaction.BatchMap(8)).size == 7


def test_grouped_plan_gives_each_live_row_a_slot_of_its_prompt():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        prompts_, samples = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        batch = compaction.BatchMap(prompts_ * samples, samples)
        finished = torch.rand(prompts_ * samples, generator=g) < 0.8
        if bool(finished.all()):
            continue
        plan = compaction.plan(finished, batch)
        if plan is None:
            continue
        live = (~finished[plan.rows]).nonzero().flatten()
        assert set(plan.rows.tolist()) >= set((~finished).nonzero().flatten().tolist())  # every live row kept
        assert len(set(plan.rows.tolist())) == plan.size  # each row once
        assert plan.slot_rows.numel() == plan.prompts * plan.slots
        for r in live.tolist():
            prompt = int(batch.group[plan.rows[r]])
            new_prompt = int(plan.row_group[r])
            assert int(plan.groups[new_prompt]) == prompt  # reads its own prompt's KV
            assert int(plan.slot_rows[plan.row_slot[r]]) == r  # owns its slot
            assert int(plan.row_slot[r]) // plan.slots == new_prompt  # a slot of that prompt


def test_kv_compaction_gathers_the_rows_and_keeps_every_row_at_home():
    """The dense buffer (the expanded baseline's; the pool's KV never moves: its tables do). A compacted
    batch decodes in its own views; the second compaction gathers in place (the views overlap the ones they
    are gathered from: every layer must still get its rows); after decode every row's KV, what it had
    before the compactions and what it wrote after, is in its home row (Rollout.extend reads it there)."""
    cache = RolloutKVCache(KVShape(layers=3, kv_heads=2, head_dim=4), torch.float32, torch.device("cpu"))
    cache.prepare(DenseLayout(3), 4, 12, (10,))
    (group,) = cache.groups  # every layer's KV: one group
    group.decode_kv.copy_(torch.randn(group.decode_kv.shape))
    home_decode, expected = group.decode_kv, group.decode_kv.clone()
    rows = torch.tensor([11, 3, 4, 0, 7])
    cache.compact(rows, None, torch.arange(12))
    assert torch.equal(group.decode_kv, expected[:, :, rows])
    assert group.decode_kv.is_contiguous()
    assert torch.equal(home_decode, expected)  # the rows that left are still at home
    # Decode writes a column of the compacted rows, then compacts again to three of them.
    written = torch.randn(group.decode_kv[..., 5, :].shape)
    group.decode_kv[..., 5, :] = written
    expected[:, :, rows, :, 5] = written
    rows2 = torch.tensor([4, 0, 2])
    cache.compact(rows2, None, rows)
    assert torch.equal(group.decode_kv, expected[:, :, rows[rows2]])
    written = torch.randn(group.decode_kv[..., 6, :].shape)
    group.decode_kv[..., 6, :] = written
    expected[:, :, rows[rows2], :, 6] = written
    cache.finish_decode(rows[rows2])
    assert group.decode_kv is home_decode
    assert torch.equal(home_decode, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_shapes_stay_bounded_over_many_calls(layout, monkeypatch):
    """Calls with other prompts and seeds end their rows at other steps; the decode shapes they meet are
    compacted sizes of the first (bucket_sizes), and each comes back with its decode state."""
    model = FAMILIES["llama"]()
    r = Rollout(
        model,
        RolloutConfig(
            samples_per_prompt=4, max_new_tokens=48, kv_sharing=layout, temperature=1.0, eos_token_id=[41, 60, 90]
        ),
    )
    keys = set()
    start = DecodeRunner.start
    monkeypatch.setattr(
        DecodeRunner, "start", lambda self, dynamic, graph_key: keys.add(graph_key) or start(self, dynamic, graph_key)
    )
    ids, mask = prompts(4, 9, seed=0, left_pad=[0, 2, 0, 1])
    for seed in range(12):
        r.generate_rows(ids, mask, seed=seed)
    shapes = {key[0] for key in keys}
    assert {s.rows for s in shapes} <= set(compaction.bucket_sizes(16)) and len({s.rows for s in shapes}) > 2
    counters = r.decode_counters()
    # Rows that read no prompt stacked (copy; paged below its threshold) meet one shape per size.
    assert counters.decode_shapes == len(shapes) <= len(compaction.bucket_sizes(16)) * (8 if layout == "prefix" else 1)
    # Every shape has one key (its addresses do not change from call to call).
    assert counters.graph_keys == len(keys) == len(shapes) and counters.compactions > 12


SYNCING_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero"}


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_steps_of_a_compacting_rollout_never_read_a_value_on_the_host(llama, layout, monkeypatch):
    """The host syncs of decode are the all-ended check's reads (every 8 steps); the steps themselves,
    on compacted batches too, run no op that needs a value on the host."""
    r = Rollout(
        llama,
        RolloutConfig(
            samples_per_prompt=N,
            max_new_tokens=NEW,
            kv_sharing=layout,
            temperature=1.0,
            seed=3,
            eos_token_id=[41, 60],
            enable_profiling=True,
        ),
    )
    step, seen = DecodeRunner.__call__, set()

    def watched(self):
        with _Recorder() as rec:
            step(self)
        seen.update(rec.ops)

    monkeypatch.setattr(DecodeRunner, "__call__", watched)
    ids, mask = _prompts()
    out = r.generate(ids, mask)
    assert r.get_last_profile().computed_row_steps < 12 * out.responses.shape[1]  # compacted
    assert "index_select" in seen or "embedding" in seen  # the recorder saw the steps
    assert not seen & SYNCING_OPS


def test_compact_finished_rows_must_be_a_bool():
    with pytest.raises(ValueError, match="RolloutConfig.compact_finished_rows"):
        RolloutConfig(compact_finished_rows=1)


# --- compiled decode (last: after a compile, torch logs more, and the tests after it run slower) ---
@pytest.fixture(scope="module")
def compiled_prefix(llama):
    """One compiled rollout for the module (compiling costs ~35 s on a small CPU): the prefix layout,
    whose compacted batches also change the shared-prefix attention's slot maps."""
    return Rollout(
        llama,
        RolloutConfig(
            compile=True,
            kv_sharing="prefix",
            temperature=1.0,
            seed=3,
            samples_per_prompt=N,
            max_new_tokens=NEW,
            eos_token_id=[41, 60],
            return_logprobs=True,
            enable_profiling=True,
        ),
    )


def test_compiled_decode_gives_the_eager_uncompacted_tokens(llama, compiled_prefix):
    from torch._dynamo.utils import counters

    eager = Rollout(
        llama, RolloutConfig(**{**vars(compiled_prefix.config), "compile": False, "compact_finished_rows": False})
    )
    for seed, pads in ((1, [0, 3, 1]), (2, [2, 0, 0])):
        ids, mask = prompts(3, 9, seed=seed, left_pad=pads)
        out = compiled_prefix.generate(ids, mask)
        assert_same_output(out, eager.generate(ids, mask))
        profile = compiled_prefix.get_last_profile()
        assert profile.computed_row_steps < 12 * out.responses.shape[1]  # it compacted
        if seed == 1:
            graphs = counters["stats"]["unique_graphs"]
    # The compacted batch sizes of the second call reuse the graphs of the first (dynamic row dims).
    assert counters["stats"]["unique_graphs"] == graphs
    assert conftest.compiled(compiled_prefix)  # (else eager is compared with eager)


# --- CUDA ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_graphs_of_compacted_batches_are_replayed_across_calls(device, layout):
    model = FAMILIES["llama"]().to(device)
    cfg = dict(
        samples_per_prompt=N,
        max_new_tokens=NEW,
        kv_sharing=layout,
        temperature=1.0,
        seed=3,
        eos_token_id=[41, 60],
        return_logprobs=True,
    )
    graphs = Rollout(model, RolloutConfig(cuda_graphs=True, **cfg))
    eager = Rollout(model, RolloutConfig(cuda_graphs=False, compact_finished_rows=False, **cfg))
    ids, mask = (t.to(device) for t in _prompts())
    assert_same_output(graphs.generate(ids, mask), eager.generate(ids, mask))
    captured = graphs.decode_counters().captured_graphs
    assert captured > 1  # the first shape and compacted ones
    for _ in range(2):  # the same rows end at the same steps: every shape is replayed, none captured
        assert_same_output(graphs.generate(ids, mask), eager.generate(ids, mask))
    assert graphs.decode_counters().captured_graphs == captured


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_decode_steps_of_a_compacting_rollout_never_sync(device, layout):
    model = FAMILIES["llama"]().to(device)
    for cuda_graphs in (False, True):
        r = Rollout(
            model,
            RolloutConfig(
                samples_per_prompt=N,
                max_new_tokens=NEW,
                kv_sharing=layout,
                temperature=1.0,
                seed=3,
                eos_token_id=[41, 60],
                cuda_graphs=cuda_graphs,
                enable_profiling=True,
            ),
        )
        ids, mask = (t.to(device) for t in _prompts())
        r.generate(ids, mask)  # warm-up and capture of every shape happen outside the checked steps
        step = DecodeRunner.__call__

        def checked(self):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return step(self)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        with warnings.catch_warnings(), pytest.MonkeyPatch.context() as mp:
            mp.setattr(DecodeRunner, "__call__", checked)
            out = r.generate(ids, mask)
        assert r.get_last_profile().computed_row_steps < 12 * out.responses.shape[1]
