"""What the decode loop does at each all-ended check, decided on the host and returned to the loop.

Every FINISHED_CHECK_INTERVAL steps the loop (`Decoder.run`) reads which rows have ended (its one host
sync) and asks its scheduler; the scheduler looks at that and at the batch's row -> sample map only, and
returns `Decisions`: rows to retire (or preempt), prompts to prefill (or let go of), samples to start in
free rows, whether to compact and whether to stop. The loop carries them out through the batch (`DecodeBatch.retire`,
`admit`, `compact`) and, for prefills and starts, the call's admission (streaming's `Admission`). No
scheduler touches a tensor, the model or the KV cache, so each is tested alone.

- `UntilEnded`: a call (generate, extend): decode until every row has its tokens or has ended (on every
  process, when the check is a collective), compacting as rows end while a check interval is left.
- `Refill`: a rollout larger than the row budget (`RolloutConfig.max_rows`) or under a budget of KV tokens
  (`RolloutConfig.max_kv_tokens`): ended rows leave, waiting samples take the free rows (a prompt prefilled
  once, as its first sample gets a row; under a KV budget, while blocks are free, and the newest rows
  preempted when the live rows' next interval does not fit: `kv_budget`), and once nothing waits the rows
  still decoding are compacted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["Decisions", "UntilEnded", "Refill"]


@dataclasses.dataclass
class Decisions:
    """What the loop does, in this order: `retire` these batch rows (ended: their tokens go to their
    samples' places); `preempt` these batch rows (a budget of KV tokens ran short: their blocks go back and
    their samples start again later, nothing of them kept); `forget` these prompts (the KV kept for their
    samples that wait goes, before any prefill: they will be prefilled again); `prefill` these prompts
    (once each, in order); `start` samples in free rows: (prompt, its samples' output rows, the batch rows
    they take); `release` these prompts (every sample that waited for them has started: the KV kept for
    them goes); `compact`: go on without the rows marked True ([rows] host bools, after the retirements
    and starts; None: no compaction), the batch's tokens so far kept up to `compact_tokens`; then `stop`
    or go on."""

    retire: list[int] = dataclasses.field(default_factory=list)
    prefill: list[int] = dataclasses.field(default_factory=list)
    start: list[tuple[int, list[int], list[int]]] = dataclasses.field(default_factory=list)
    compact: list[bool] | None = None
    compact_tokens: int = 0
    stop: bool = False
    preempt: list[int] = dataclasses.field(default_factory=list)
    forget: list[int] = dataclasses.field(default_factory=list)
    release: list[int] = dataclasses.field(default_factory=list)


class UntilEnded:
    """A call's scheduler (module docstring). `interval`: steps between checks (compacting later saves
    too little to pay for the gather)."""

    def __init__(
        self,
        max_new_tokens: int,
        compacts: bool,
        interval: int,
        ended_everywhere: Callable[[bool], bool] | None = None,
    ):
        self.max_steps = max_new_tokens - 1  # the first token is sampled from prefill's logits
        self.compacts, self.interval, self.ended_everywhere = compacts, interval, ended_everywhere

    def decide(
        self, samples: list[int], finished: list[bool], steps: int, columns: list[int] | None = None
    ) -> Decisions:
        """`samples`: each batch row's sample (unused here: every row of a call is one); `finished`: each
        batch row has ended; `steps`: decode steps so far; `columns`: each row's next column (unused here)."""
        ended = all(finished)
        if self.ended_everywhere is not None:  # a collective: every process asks at every check
            ended = self.ended_everywhere(ended)
        if ended:
            return Decisions(stop=True)
        if self.compacts and self.max_steps - steps >= self.interval and any(finished):
            return Decisions(compact=list(finished), compact_tokens=steps + 1)
        return Decisions()


class Refill:
    """A streaming batch's scheduler (module docstring): `prompts` prompts of `samples` samples each (sample
    s of prompt p is output row p * samples + s), over a batch whose rows start free; `budget`:
    a budget of KV tokens (`kv_budget.BlockBudget`; None: rows are the only bound), under which samples
    start while blocks are free and the newest rows are preempted when the live rows' next interval does
    not fit."""

    max_steps = None  # rows join later: only the scheduler stops

    def __init__(self, prompts: int, samples: int, *, compacts: bool, budget=None):
        self.samples, self.compacts, self.budget = samples, compacts, budget
        # Samples that wait for a prefill of their prompt, in order: every prompt's at first; preempted
        # samples and those of a forgotten prompt go to the front.
        self.queue: list[tuple[int, list[int]]] = [
            (p, [p * samples + j for j in range(samples)]) for p in range(prompts)
        ]
        self.held: dict[int, list[int]] = {}  # prefilled prompts -> their samples without a row yet, in order
        self.left: dict[int, int] = {}  # prompts in the batch -> their samples not ended yet
        self.order: list[int] = []  # (a budget) the samples decoding, oldest started first
        self.refills = 0  # prompts prefilled after the start
        self.preemptions = 0  # samples preempted (a budget)

    def decide(
        self, samples: list[int], finished: list[bool], steps: int, columns: list[int] | None = None
    ) -> Decisions:
        """`samples`: each batch row's sample (-1: free); `finished`: each batch row has ended (free rows
        count as ended); `steps`: decode steps so far; `columns`: each row's next column (a budget: what its
        next interval's blocks follow)."""
        n = self.samples
        d = Decisions(retire=[r for r, s in enumerate(samples) if s >= 0 and finished[r]])
        occupant = list(samples)
        for r in d.retire:
            self._ended(samples[r])
            occupant[r] = -1
        avail = None if self.budget is None else self._make_room(d, samples, occupant, columns)
        # Rows preempted or prompts let go of: nothing starts at this check (as vLLM's scheduler admits none in
        # a step that preempts), or the blocks just freed would restart the samples just stopped.
        free = [] if d.preempt or d.forget else [r for r, s in enumerate(occupant) if s < 0]
        # Samples take free rows in order: those of prompts held first, then those waiting for a prefill
        # (one prefill a prompt, when its first sample starts).
        candidates = [(p, rest, False) for p, rest in self.held.items()] + [(p, rest, True) for p, rest in self.queue]
        for prompt, rest, prefill in candidates:
            if not free:
                break
            k = min(len(free), len(rest))
            if avail is not None:  # blocks for the prompt's table when it must be prefilled, and each sample's own
                k = min(k, (avail - (self.budget.prompt_blocks if prefill else 0)) // self.budget.sample_blocks)
            if k < 1:
                break  # in order: the samples after it wait too
            if prefill:
                d.prefill.append(prompt)
                self.queue = [(p, r) for p, r in self.queue if p != prompt]
                self.held[prompt] = rest
                self.left.setdefault(prompt, n)
                avail = None if avail is None else avail - self.budget.prompt_blocks
            take, rows = rest[:k], free[:k]
            d.start.append((prompt, take, rows))
            for row, sample in zip(rows, take):
                occupant[row] = sample
            self.order += take
            free, rest[:] = free[k:], rest[k:]
            avail = None if avail is None else avail - k * self.budget.sample_blocks
            if not rest:
                del self.held[prompt]
                d.release.append(prompt)
        self.refills += len(d.prefill) if steps > 0 else 0
        if self.queue or self.held:
            return d
        if all(s < 0 for s in occupant):
            d.stop = True  # every sample has ended
        elif self.compacts and any(s < 0 for s in occupant):
            d.compact = [s < 0 for s in occupant]
        return d

    def _ended(self, sample: int) -> None:
        prompt = sample // self.samples
        self.left[prompt] -= 1
        if not self.left[prompt]:
            del self.left[prompt]
        if self.budget is not None:
            self.order.remove(sample)

    def _make_room(self, d: Decisions, samples: list[int], occupant: list[int], columns: list[int]) -> int:
        """A budget: blocks for every live row's next interval, letting go of held prompts (newest first) and
        then preempting the newest rows until they fit (decisions into `d`, `occupant` updated). Returns the
        blocks left for samples to start."""
        budget = self.budget
        released = [samples[r] for r in d.retire]
        row_of = {s: r for r, s in enumerate(occupant) if s >= 0}
        growth = {s: budget.growth(s, columns[r]) for s, r in row_of.items()}
        avail = budget.free(released) - sum(growth.values())
        while avail < 0:
            if self.held:  # a prompt kept for samples that wait: they will prefill it again
                prompt, rest = self.held.popitem()
                d.forget.append(prompt)
                released.append(budget.prompt_table(prompt))
                self._requeue(prompt, rest)
            else:
                if len(self.order) <= 1:
                    raise AssertionError("torchkvops: one row alone outgrows the KV budget (check_budget)")
                victim = self.order.pop()
                row = row_of.pop(victim)
                d.preempt.append(row)
                occupant[row] = -1
                released.append(victim)
                del growth[victim]
                self._requeue(victim // self.samples, [victim])
                self.preemptions += 1
            avail = budget.free(released) - sum(growth.values())
        return avail

    def _requeue(self, prompt: int, samples: list[int]) -> None:
        """`samples` of `prompt` wait for a new prefill of it, at the front of the queue (with any of its
        samples that wait there already: one prefill serves them all)."""
        waiting = [rest for p, rest in self.queue if p == prompt]
        self.queue = [(p, rest) for p, rest in self.queue if p != prompt]
        self.queue.insert(0, (prompt, sorted(samples + (waiting[0] if waiting else []))))
