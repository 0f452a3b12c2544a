"""torchkvops.rollout.batch.DecodeBatch on its own, without a model: rows join (`admit`), the batch is
compacted (`compact`: every per-row field and the rows' KV move with their rows, the rows that leave keep
their tokens in the output), streaming rows leave (`retire`) and the batch ends (`finish`: tokens in
output order, KV home). The oracle is the same fields read back by row."""

import torch

from torchkvops.models.adapter import KVShape
from torchkvops.rollout import compaction
from torchkvops.rollout.batch import DecodeBatch, visible_bias
from torchkvops.rollout.decode import DecodeStep
from torchkvops.rollout.kv_cache import RolloutKVCache
from torchkvops.rollout.layouts import DenseLayout
from torchkvops.rollout.sampling import SamplingParams
from torchkvops.rollout.state import DecodeShape, DecodeState

PAD, VOCAB, ROWS, COLUMNS, NEW = 0, 11, 8, 16, 6


def make_batch(keeps_left: bool = True, output=None):
    """A greedy batch of ROWS rows (4 prompts x 2 samples) over a dense cache (DenseLayout) whose row r's KV holds
    the value r everywhere (so that a moved row shows where it came from)."""
    cache = RolloutKVCache(KVShape(2, 1, 4), torch.float32, torch.device("cpu"))
    layout = DenseLayout(2)
    cache.prepare(layout, 4, ROWS, (COLUMNS,))
    for r in range(ROWS):
        cache.groups[0].decode_kv[:, :, r] = float(r)
    states = {}

    def state_for(shape: DecodeShape) -> DecodeState:
        return states.setdefault(shape, DecodeState(shape, torch.device("cpu")))

    step = DecodeStep(None, cache, SamplingParams(0.0, 0, 1.0), PAD, torch.tensor([1]))

    def draw(state: DecodeState, logits: torch.Tensor) -> None:
        step.state = state
        step.draw(logits)

    shape = DecodeShape(ROWS, COLUMNS, NEW, torch.float32)
    batch = DecodeBatch(
        cache,
        layout,
        state_for(shape),
        compaction.BatchMap(ROWS) if keeps_left else layout.stream_map(ROWS),  # (a streaming batch's: every row free)
        pad_id=PAD,
        make_state=state_for,
        draw=draw,
        keeps_left=keeps_left,
        output=output,
    )
    return batch, draw


def free_rows(batch: DecodeBatch) -> list[int]:
    """The batch rows no sample holds (the batch's map gives them the output row -1)."""
    return (batch.map.original < 0).nonzero().flatten().tolist()


def one_hot(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).float()


def admit_every_row(batch: DecodeBatch, first: list[int]) -> None:
    """Row r sees columns [2, 5 + r) and writes column 5 + r first."""
    index = torch.arange(COLUMNS)
    visible = (index >= 2) & (index[None, :] < (torch.arange(ROWS) + 5)[:, None])
    batch.admit(
        None,
        torch.arange(ROWS),
        one_hot(first),
        sample_keys=torch.arange(ROWS),
        positions=torch.full((ROWS,), 3),
        columns=torch.arange(ROWS) + 5,
        bias=visible_bias(visible, COLUMNS),
    )


def test_admit_sets_every_row_and_draws_its_first_token():
    batch, _ = make_batch()
    first = [3, 4, 1, 5, 6, 7, 8, 9]  # row 2 draws EOS (1)
    admit_every_row(batch, first)
    s = batch.state
    assert s.kv_start.tolist() == [2] * ROWS
    assert s.tokens[:, 0].tolist() == first and s.responses[:, 0].tolist() == first
    assert s.step.tolist() == [1] * ROWS and s.position_ids[:, 0].tolist() == [3] * ROWS
    assert s.column.tolist() == list(range(5, 13))
    assert s.finished.tolist() == [r == 2 for r in range(ROWS)]
    assert torch.isinf(s.bias[:, 0, 0, :2]).all() and (s.bias[:, 0, 0, 2:5] == 0).all()
    assert batch.map.original.tolist() == list(range(ROWS)) and batch.row_steps == ROWS


def test_compaction_moves_each_row_with_its_state_its_kv_and_keeps_the_tokens_of_rows_that_leave():
    batch, draw = make_batch()
    admit_every_row(batch, [3, 4, 5, 6, 7, 8, 9, 10])
    draw(batch.state, one_hot([2, 1, 2, 1, 2, 1, 2, 1]))  # odd rows draw EOS at their second token
    ended = batch.state.finished.clone()
    plan = batch.plan(ended)
    assert plan is not None and plan.size == 4
    before = {name: getattr(batch.state, name).clone() for name in ("tokens", "column", "sample_keys", "position_ids")}
    batch.compact(plan, tokens=2)
    kept = plan.rows
    assert batch.rows == 4 and batch.map.original.tolist() == kept.tolist() == [0, 2, 4, 6]
    for name, value in before.items():
        assert torch.equal(getattr(batch.state, name), value[kept]), name
    assert torch.equal(batch.cache.groups[0].decode_kv[0, 0, :, 0, 0, 0], kept.float())  # each row's KV came along
    # The rows that left keep their two tokens (then the pad id) in the output, in their own rows.
    assert batch.responses[1, :2].tolist() == [4, 1] and batch.responses[1, 2:].eq(PAD).all()


def test_a_streaming_batch_retires_rows_into_their_samples_places():
    output = (torch.full((12, NEW), PAD), None)
    batch, _ = make_batch(keeps_left=False, output=output)
    batch.clear()
    assert free_rows(batch) == list(range(ROWS)) and bool(batch.state.finished.all())
    rows = torch.tensor([1, 4])
    batch.admit(
        rows,
        [10, 7],  # the samples (output rows) they start
        one_hot([5, 6]),
        sample_keys=torch.tensor([10, 7]),
        positions=torch.tensor([2, 2]),
        columns=torch.tensor([4, 4]),
        bias=visible_bias(torch.ones(2, 4, dtype=torch.bool), COLUMNS),
    )
    assert free_rows(batch) == [0, 2, 3, 5, 6, 7]
    assert batch.state.tokens[rows, 0].tolist() == [5, 6] and not batch.state.finished[rows].any()
    batch.retire([4])
    assert output[0][7, 0].item() == 6 and free_rows(batch) == [0, 2, 3, 4, 5, 6, 7]


def test_finish_puts_every_row_home_in_output_order():
    batch, draw = make_batch()
    admit_every_row(batch, [3, 4, 5, 6, 7, 8, 9, 10])
    draw(batch.state, one_hot([2, 1, 2, 1, 2, 1, 2, 1]))
    batch.compact(batch.plan(batch.state.finished.clone()), tokens=2)
    draw(batch.state, one_hot([9, 9, 9, 9]))
    batch.finish(tokens=3)
    assert batch.responses[:, :3].tolist() == [
        [3, 2, 9],
        [4, 1, 0],
        [5, 2, 9],
        [6, 1, 0],
        [7, 2, 9],
        [8, 1, 0],
        [9, 2, 9],
        [10, 1, 0],
    ]
    assert not batch.cache.compacted  # the KV of every row is back in its home row
    assert torch.equal(batch.cache.groups[0].decode_kv[0, 0, :, 0, 0, 0], torch.arange(ROWS).float())


def test_admit_reads_from_each_rows_first_visible_column_and_refuses_a_gap():
    """The decode attention reads each row's columns [kv_start, column]: a row's start is its first visible
    column (or the column it writes first, when it sees none); a live row whose visible columns are not one
    run up to that column is refused (it would read keys it must not see), a row that is not live is not."""
    batch, _ = make_batch()
    columns = torch.tensor([5, 5, 0, 9, 5, 5, 5, 5])
    visible = torch.zeros(ROWS, COLUMNS, dtype=torch.bool)
    visible[0, :5] = visible[1, 3:5] = visible[3, 6:9] = True  # row 2 sees nothing yet
    visible[4:, 1:5] = True
    first = [3] * ROWS
    kwargs = dict(sample_keys=torch.arange(ROWS), positions=torch.full((ROWS,), 3), columns=columns)
    batch.admit(None, torch.arange(ROWS), one_hot(first), bias=visible_bias(visible, COLUMNS), **kwargs)
    assert batch.state.kv_start.tolist() == [0, 3, 0, 6, 1, 1, 1, 1]
    visible[5, 2] = False  # a hole in a live row's history
    try:
        batch.admit(None, torch.arange(ROWS), one_hot(first), bias=visible_bias(visible, COLUMNS), **kwargs)
    except AssertionError as error:
        assert "not one run" in str(error)
    else:
        raise AssertionError("a gap in a live row's visible columns was taken")
    live = torch.ones(ROWS, dtype=torch.bool)
    live[5] = False
    batch.admit(None, torch.arange(ROWS), one_hot(first), bias=visible_bias(visible, COLUMNS), live=live, **kwargs)
