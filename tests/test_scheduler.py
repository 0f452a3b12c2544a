"""torchkvops.rollout.scheduler alone, without a model: the decisions each scheduler returns at the loop's
all-ended checks, replayed against a plain simulation of the batch's rows (which sample each row holds)
that applies them as the loop does. The loop carrying them out through a model: tests/test_streaming.py,
test_compaction.py, test_rollout.py."""

import pytest

from torchkvops.rollout.scheduler import Decisions, Refill, UntilEnded


def test_a_call_stops_when_every_row_has_ended():
    scheduler = UntilEnded(max_new_tokens=64, compacts=True, interval=8)
    assert scheduler.max_steps == 63
    assert scheduler.decide([0, 1, 2], [True, True, True], 8) == Decisions(stop=True)


def test_a_call_compacts_its_ended_rows_while_an_interval_is_left():
    scheduler = UntilEnded(max_new_tokens=64, compacts=True, interval=8)
    d = scheduler.decide([0, 1, 2, 3], [True, False, True, False], 16)
    assert d.compact == [True, False, True, False] and d.compact_tokens == 17 and not d.stop
    # Fewer than 8 steps left: not worth a gather.
    assert scheduler.decide([0, 1, 2, 3], [True, False, True, False], 56).compact is None
    # No row ended: nothing to compact.
    assert scheduler.decide([0, 1], [False, False], 8) == Decisions()
    # Compaction off.
    assert UntilEnded(64, False, 8).decide([0, 1], [True, False], 8) == Decisions()


@pytest.mark.parametrize("local,everywhere", [(True, False), (False, True), (True, True)])
def test_a_lockstep_call_stops_only_when_every_process_has_ended(local, everywhere):
    asked = []

    def ended_everywhere(ended: bool) -> bool:
        asked.append(ended)
        return ended and everywhere

    scheduler = UntilEnded(64, compacts=False, interval=8, ended_everywhere=ended_everywhere)
    d = scheduler.decide([0, 1], [local, local], 8)
    assert asked == [local]  # asked at every check, whatever this process found (a collective)
    assert d.stop == (local and everywhere)


class Simulation:
    """The rows of a streaming batch as the loop leaves them after each decision: which sample each row
    holds (-1: free), every prompt prefilled and every sample started, checked as it goes."""

    def __init__(self, rows: int, samples: int, lengths: dict[int, int]):
        self.occupant = [-1] * rows
        self.samples, self.lengths = samples, lengths  # sample -> steps it decodes before it ends
        self.started_at: dict[int, int] = {}
        self.prefilled: list[int] = []
        self.retired: list[int] = []

    def finished(self, steps: int) -> list[bool]:
        return [s < 0 or steps - self.started_at[s] >= self.lengths[s] for s in self.occupant]

    def apply(self, d: Decisions, steps: int) -> None:
        for r in d.retire:
            assert self.occupant[r] >= 0
            self.retired.append(self.occupant[r])
            self.occupant[r] = -1
        self.prefilled += d.prefill
        for prompt, samples, rows in d.start:
            assert prompt in self.prefilled and len(samples) == len(rows)
            for sample, row in zip(samples, rows):
                assert sample // self.samples == prompt and self.occupant[row] == -1
                self.occupant[row] = sample
                self.started_at[sample] = steps
        if d.compact is not None:
            assert d.compact == [s < 0 for s in self.occupant]  # only free rows are compacted away
            kept = [s for s in self.occupant if s >= 0]
            self.occupant = kept


def run(scheduler: Refill, sim: Simulation, interval: int = 8, limit: int = 1000):
    """The loop: a first decision with every row free, then one per check until the scheduler stops.
    Returns the most prompts that had samples in the batch at once and the checks run."""
    steps, most = 0, 0
    sim.apply(scheduler.decide(list(sim.occupant), [True] * len(sim.occupant), 0), 0)
    while steps < limit:
        steps += interval
        d = scheduler.decide(list(sim.occupant), sim.finished(steps), steps)
        sim.apply(d, steps)
        resident = {s // sim.samples for s in sim.occupant if s >= 0}
        most = max(most, len(resident))
        if d.stop:
            return most, steps
    raise AssertionError("the scheduler never stopped")


@pytest.mark.parametrize("compacts", [False, True])
def test_every_sample_is_started_once_ended_once_and_every_prompt_prefilled_once(compacts):
    prompts, samples, rows = 5, 2, 4
    lengths = {s: 8 * (1 + (s * 7) % 5) for s in range(prompts * samples)}  # ends at different checks
    scheduler = Refill(prompts, samples, compacts=compacts)
    sim = Simulation(rows, samples, lengths)
    most, _ = run(scheduler, sim)
    assert sim.prefilled == list(range(prompts))  # each once, in order
    assert sorted(sim.retired) == list(range(prompts * samples))  # each sample ended once
    assert sorted(sim.started_at) == list(range(prompts * samples))
    assert most <= rows  # each prompt with samples in the batch holds a row of it
    assert scheduler.refills == prompts - rows // samples  # those prefilled after the start


def test_a_prompt_is_prefilled_when_its_first_sample_gets_a_row_and_its_others_wait_for_rows():
    """3 rows, 2 samples per prompt: the second prompt's first sample takes the third row at once, its
    second sample waits for the next free row (its prompt is not prefilled again)."""
    scheduler = Refill(prompts=2, samples=2, compacts=False)
    d = scheduler.decide([-1, -1, -1], [True] * 3, 0)
    assert d.prefill == [0, 1] and d.start == [(0, [0, 1], [0, 1]), (1, [2], [2])]
    d = scheduler.decide([0, 1, 2], [False, True, False], 8)
    assert d.retire == [1] and d.prefill == [] and d.start == [(1, [3], [1])] and not d.stop


def test_once_nothing_waits_the_free_rows_are_compacted_away():
    scheduler = Refill(prompts=1, samples=2, compacts=True)
    scheduler.decide([-1] * 4, [True] * 4, 0)
    d = scheduler.decide([0, 1, -1, -1], [False, False, True, True], 8)
    assert d.compact == [False, False, True, True] and not d.stop
    d = scheduler.decide([0, 1], [True, True], 16)
    assert d.retire == [0, 1] and d.stop
