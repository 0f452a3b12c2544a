"""A budget in KV tokens (torchkvops.rollout.kv_budget) without a model: a simulated streaming decode in
which each sample's tokens are a function of (sample, step), as the rollout's sampling keys make them,
so that a preempted sample restarted from its prompt must give the same tokens; the pool never holds more
than the budget, every block comes back, and the budget holds several times the rows `max_rows` holds in
the same bytes when responses end early at spread lengths."""

import math
import random

import pytest

from torchkvops.rollout.block_pool import blocks_for
from torchkvops.rollout.kv_budget import KVBudget, check_budget

INTERVAL = 8  # the decode loop's checks (FINISHED_CHECK_INTERVAL's role)


def token(sample: int, step: int) -> int:
    return hash((sample, step)) % 50_000  # what the sampler draws: keyed by the sample and its own step


def simulate(lengths: list[int], prompt_len: int, samples: int, rows: int, budget: KVBudget | None):
    """Decode every sample (sample s of prompt s // samples runs lengths[s] steps) in `rows` rows, under
    `budget` (None: a row budget: `rows` rows, each admitted at its longest). Returns (each sample's
    tokens, the live rows at each step and whether samples waited to start, the most tokens the pool held)."""
    waiting = list(range(len(lengths)))
    row_sample: dict[int, int] = {}
    progress: dict[int, list[int]] = {}
    out: dict[int, list[int]] = {}
    live_per_step, peak_tokens = [], 0
    steps = 0
    while waiting or row_sample:
        # The check: ended rows leave, the live ones get their next interval (or are preempted), then
        # waiting samples take free rows.
        for row, s in list(row_sample.items()):
            if len(progress[row]) >= lengths[s]:
                out[s] = progress.pop(row)[: lengths[s]]
                del row_sample[row]
                if budget is not None:
                    budget.end(row)
        if budget is not None:
            for row in budget.step():
                waiting.insert(0, row_sample.pop(row))
                del progress[row]
            waiting.sort()
        for row in range(rows):
            if row in row_sample or not waiting:
                continue
            s = waiting[0]
            if budget is not None and budget.start(s // samples, prompt_len, row) is None:
                break  # in order: a sample that does not fit waits, and so do the ones after it
            waiting.pop(0)
            row_sample[row], progress[row] = s, []
        if budget is not None:
            peak_tokens = max(peak_tokens, budget.tokens_held)
            for row, s in row_sample.items():  # every token a row writes in this interval has a block
                assert budget.tables.lengths[row] >= prompt_len + len(progress[row]) + INTERVAL
        for _ in range(INTERVAL):
            live_per_step.append((sum(len(progress[r]) < lengths[s] for r, s in row_sample.items()), bool(waiting)))
            for row, s in row_sample.items():
                if len(progress[row]) < lengths[s]:
                    progress[row].append(token(s, len(progress[row])))
            steps += 1
    return out, live_per_step, peak_tokens


def lognormal_lengths(n: int, max_new_tokens: int, seed: int) -> list[int]:
    """RL-like response lengths: log-normal with a median of max_new_tokens / 16, capped at the budget."""
    rng = random.Random(seed)
    median = max_new_tokens / 16
    return [min(max_new_tokens, max(1, round(rng.lognormvariate(math.log(median), 1.0)))) for _ in range(n)]


def test_the_same_tokens_under_a_tight_budget_with_preemption_and_every_block_back():
    prompt_len, samples, max_new, bs = 37, 4, 200, 16
    lengths = lognormal_lengths(32, max_new, seed=1)
    expected, _, _ = simulate(lengths, prompt_len, samples, rows=32, budget=None)
    least = (blocks_for(prompt_len, bs) + blocks_for(prompt_len + max_new + INTERVAL, bs)) * bs
    blocks = check_budget(least + 2 * bs, bs, prompt_len, max_new, INTERVAL)
    budget = KVBudget(32, 8, blocks, bs, max_blocks=blocks_for(prompt_len + max_new + INTERVAL, bs), interval=INTERVAL)
    got, _, peak = simulate(lengths, prompt_len, samples, rows=32, budget=budget)
    assert got == expected
    assert budget.preemptions > 0  # the budget was tight enough to preempt: the restarts gave the same tokens
    assert peak <= blocks * bs
    assert budget.pool.num_free == budget.pool.num_blocks and not budget.order and not budget.live


def test_a_budget_too_small_for_one_row_at_its_longest_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"max_kv_tokens=300 holds 18 blocks of 16 tokens.*at least 352"):
        check_budget(300, 16, prompt_len=40, max_new_tokens=256, interval=INTERVAL)


def test_a_token_budget_holds_over_three_times_the_rows_max_rows_holds_in_the_same_bytes():
    """#52's goal, on the scheduling alone: 128 prompts x 8 samples, log-normal lengths under a 2,048-token
    budget, KV bytes for 16 rows at their longest (what max_rows=16 allocates); while samples wait to
    start, the token budget keeps at least 3x as many rows decoding as the row budget does."""
    prompt_len, samples, max_new, bs = 128, 8, 2048, 16
    lengths = lognormal_lengths(1024, max_new, seed=2)
    max_rows = 16
    kv_tokens = max_rows * (prompt_len + max_new)
    expected, rows_live, _ = simulate(lengths, prompt_len, samples, rows=max_rows, budget=None)
    blocks = check_budget(kv_tokens, bs, prompt_len, max_new, INTERVAL)
    budget = KVBudget(
        1024, 128, blocks, bs, max_blocks=blocks_for(prompt_len + max_new + INTERVAL, bs), interval=INTERVAL
    )
    got, tokens_live, peak = simulate(lengths, prompt_len, samples, rows=1024, budget=budget)
    assert got == expected and peak <= kv_tokens
    rows_mean, tokens_mean = (
        sum(n for n, waited in live if waited) / sum(waited for _, waited in live) for live in (rows_live, tokens_live)
    )
    assert tokens_mean >= 3 * rows_mean, (tokens_mean, rows_mean)
