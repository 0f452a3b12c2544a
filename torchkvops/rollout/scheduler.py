"""What the decode loop does at each all-ended check, decided on the host and returned to the loop.

Every FINISHED_CHECK_INTERVAL steps the loop (`Decoder.run`) reads which rows have ended (its one host
sync) and asks its scheduler; the scheduler looks at that and at the batch's row -> sample map only, and
returns `Decisions`: rows to retire, prompts to prefill, samples to start in free rows, whether to
compact and whether to stop. The loop carries them out through the batch (`DecodeBatch.retire`,
`admit`, `compact`) and, for prefills and starts, the call's admission (streaming's `Admission`). No
scheduler touches a tensor, the model or the KV cache, so each is tested alone.

- `UntilEnded`: a call (generate, extend): decode until every row has its tokens or has ended (on every
  process, when the check is a collective), compacting as rows end while a check interval is left.
- `Refill`: a rollout larger than the row budget (`RolloutConfig.max_rows`): ended rows leave, waiting
  samples take the free rows (a prompt prefilled once, as its first sample gets a row; at most
  `prompt_slots` prompts with samples in the batch at once, when the layout keeps prompts in slots), and
  once nothing waits the rows still decoding are compacted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["Decisions", "UntilEnded", "Refill"]


@dataclasses.dataclass
class Decisions:
    """What the loop does, in this order: `retire` these batch rows (ended: their tokens go to their
    samples' places); `prefill` these prompts (once each, in order); `start` samples in free rows:
    (prompt, its samples' output rows, the batch rows they take); `compact`: go on without the rows
    marked True ([rows] host bools, after the retirements and starts; None: no compaction), the batch's
    tokens so far kept up to `compact_tokens`; then `stop` or go on."""

    retire: list[int] = dataclasses.field(default_factory=list)
    prefill: list[int] = dataclasses.field(default_factory=list)
    start: list[tuple[int, list[int], list[int]]] = dataclasses.field(default_factory=list)
    compact: list[bool] | None = None
    compact_tokens: int = 0
    stop: bool = False


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

    def decide(self, samples: list[int], finished: list[bool], steps: int) -> Decisions:
        """`samples`: each batch row's sample (unused here: every row of a call is one); `finished`: each
        batch row has ended; `steps`: decode steps so far."""
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
    s of prompt p is output row p * samples + s), over a batch whose rows start free; `prompt_slots`:
    how many prompts may have samples in the batch at once (None: no bound besides the rows)."""

    max_steps = None  # rows join later: only the scheduler stops

    def __init__(self, prompts: int, samples: int, *, prompt_slots: int | None, compacts: bool):
        self.samples, self.prompt_slots, self.compacts = samples, prompt_slots, compacts
        self.waiting = list(range(prompts))  # prompts not prefilled yet, in order
        self.unstarted: list[tuple[int, list[int]]] = []  # prefilled prompts' samples without a row yet
        self.left: dict[int, int] = {}  # prompts in the batch -> their samples not ended yet
        self.refills = 0  # prompts prefilled after the start

    def decide(self, samples: list[int], finished: list[bool], steps: int) -> Decisions:
        """`samples`: each batch row's sample (-1: free); `finished`: each batch row has ended (free rows
        count as ended); `steps`: decode steps so far."""
        n = self.samples
        retire = [r for r, s in enumerate(samples) if s >= 0 and finished[r]]
        for r in retire:
            prompt = samples[r] // n
            self.left[prompt] -= 1
            if not self.left[prompt]:
                del self.left[prompt]
        occupant = [-1 if r in set(retire) else s for r, s in enumerate(samples)]
        free = [r for r, s in enumerate(occupant) if s < 0]
        # Prompts to prefill: enough for the free rows that samples prefilled already will not take, as
        # slots allow (a prompt holds its slot until every sample of it has ended).
        unstarted = sum(len(rest) for _, rest in self.unstarted)
        wanted = -(-max(0, len(free) - unstarted) // n)
        if self.prompt_slots is not None:
            wanted = min(wanted, self.prompt_slots - len(self.left))
        prefill = self.waiting[: max(0, wanted)]
        del self.waiting[: len(prefill)]
        self.refills += len(prefill) if steps > 0 else 0
        for prompt in prefill:
            self.left[prompt] = n
            self.unstarted.append((prompt, [prompt * n + j for j in range(n)]))
        start = []
        while free and self.unstarted:
            prompt, rest = self.unstarted[0]
            take, rows = rest[: len(free)], free[: len(rest)]
            start.append((prompt, take, rows))
            for row, sample in zip(rows, take):
                occupant[row] = sample
            free, rest[:] = free[len(take) :], rest[len(take) :]
            if not rest:
                self.unstarted.pop(0)
        if self.waiting or self.unstarted:
            return Decisions(retire, prefill, start)
        if all(s < 0 for s in occupant):
            return Decisions(retire, prefill, start, stop=True)  # every sample has ended
        compact = [s < 0 for s in occupant] if self.compacts and any(s < 0 for s in occupant) else None
        return Decisions(retire, prefill, start, compact=compact)
