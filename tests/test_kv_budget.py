"""A budget in KV tokens (RolloutConfig.max_kv_tokens: torchkvops.rollout.kv_budget and the streaming
scheduler, `scheduler.Refill`).

Without a model: the scheduler's decisions carried out on a real `PagedStore` (its host tables; tiny
pools) by a loop that does what the decode loop does, each sample's tokens a function of (sample, step) as
the rollout's sampling keys make them. A preempted sample restarted from its prompt must then give the
same tokens, every reservation must fit the budget (a capped store raises when it does not), every
block comes back, and the budget holds several times the rows `max_rows` holds in the same bytes when
responses end early at spread lengths (#52's goal).

With a model: the same tokens (and log-probabilities) as the rollout without a budget, on a budget tight
enough to preempt, in a plain and a hybrid family; the bytes held within the budget; bad settings named."""

import math
import random

import pytest
import torch
from devices import DEVICES
from families import tiny_model, unavailable
from models import FAMILIES, prompts

from torchkvops import Rollout, RolloutConfig
from torchkvops.models.adapter import KVShape
from torchkvops.rollout.block_pool import blocks_for
from torchkvops.rollout.kv_budget import BlockBudget, check_budget
from torchkvops.rollout.paged_store import PagedStore
from torchkvops.rollout.scheduler import Refill

INTERVAL = 8  # the decode loop's checks (FINISHED_CHECK_INTERVAL)
BLOCK = 16


def token(sample: int, step: int) -> int:
    return hash((sample, step)) % 50_000  # what the sampler draws: keyed by the sample and its own step


class Loop:
    """The decode loop and the admission around a `Refill`, on a store's tables: `rows` batch rows, prompts
    of `prompt_len` columns with `samples` samples each, sample s decoding `lengths[s]` tokens."""

    def __init__(self, lengths, prompt_len, samples, rows, max_kv_tokens=None):
        self.lengths, self.prompt_len, self.rows = lengths, prompt_len, rows
        prompts_ = len(lengths) // samples
        self.store = PagedStore([KVShape(layers=1, kv_heads=1, head_dim=1)], torch.float32, torch.device("cpu"), BLOCK)
        blocks = None
        if max_kv_tokens is not None:
            blocks = check_budget(max_kv_tokens, BLOCK, prompt_len, max(lengths), INTERVAL)
        columns = prompt_len + max(lengths) + INTERVAL
        self.store.prepare(len(lengths) + prompts_, columns, 64, samples=len(lengths), limit=blocks)
        budget = None if blocks is None else BlockBudget(self.store, prompt_len, INTERVAL)
        self.scheduler = Refill(prompts_, samples, compacts=False, budget=budget)
        self.occupant = [-1] * rows
        self.progress: dict[int, list[int]] = {}
        self.out: dict[int, list[int]] = {}
        self.live_per_step: list[tuple[int, bool]] = []  # (rows decoding, whether samples wait)
        self.peak_blocks = 0
        self.forgotten = 0  # prompts let go of while samples of them waited

    def ended(self, row: int) -> bool:
        s = self.occupant[row]
        return s < 0 or len(self.progress[s]) >= self.lengths[s]

    def apply(self, d) -> None:
        tables = self.store.tables
        # A check that preempts (or lets a prompt go) starts nothing: the samples just stopped would restart.
        assert not ((d.preempt or d.forget) and d.start), d
        for r in d.retire:
            s = self.occupant[r]
            self.out[s] = self.progress.pop(s)
            tables.release(s)
            self.occupant[r] = -1
        for r in d.preempt:
            s = self.occupant[r]
            assert s not in self.out and not self.ended(r)
            del self.progress[s]
            tables.release(s)
            self.occupant[r] = -1
        for p in d.forget:
            self.store.release_prompt(p)
            self.forgotten += 1
        for p in d.prefill:
            self.store.reserve([self.store.prompt_table(p)], [self.prompt_len])
        for p, samples, rows in d.start:
            self.store.fork_to(p, samples)
            for s, r in zip(samples, rows):
                assert self.occupant[r] == -1
                self.occupant[r], self.progress[s] = s, []
        for p in d.release:
            self.store.release_prompt(p)

    def run(self) -> None:
        steps = 0
        self.apply(self.scheduler.decide(list(self.occupant), [True] * self.rows, 0, [0] * self.rows))
        while True:
            live = [r for r in range(self.rows) if not self.ended(r)]
            columns = {r: self.prompt_len + len(self.progress[self.occupant[r]]) for r in live}
            # The next interval's blocks (`Decoder._reserve_blocks`): a capped store raises past the budget.
            self.store.reserve([self.occupant[r] for r in live], [columns[r] + INTERVAL for r in live])
            self.peak_blocks = max(self.peak_blocks, self.store.pool.num_held - 1)  # (not the scratch block)
            waiting = bool(self.scheduler.queue or self.scheduler.held)
            for _ in range(INTERVAL):
                self.live_per_step.append((sum(not self.ended(r) for r in range(self.rows)), waiting))
                for r in range(self.rows):
                    if not self.ended(r):
                        s = self.occupant[r]
                        self.progress[s].append(token(s, len(self.progress[s])))
            steps += INTERVAL
            finished = [self.ended(r) for r in range(self.rows)]
            columns = [self.prompt_len + len(self.progress.get(s, [])) for s in self.occupant]
            d = self.scheduler.decide(list(self.occupant), finished, steps, columns)
            self.apply(d)
            if d.stop:
                return


def lognormal_lengths(n: int, max_new_tokens: int, seed: int) -> list[int]:
    """RL-like response lengths: log-normal with a median of max_new_tokens / 16, capped at the budget."""
    rng = random.Random(seed)
    median = max_new_tokens / 16
    return [min(max_new_tokens, max(1, round(rng.lognormvariate(math.log(median), 1.0)))) for _ in range(n)]


def least_budget(prompt_len: int, max_new: int) -> int:
    """The smallest budget `check_budget` takes: a prompt's blocks and one row's at its longest."""
    return (blocks_for(prompt_len, BLOCK) + blocks_for(prompt_len + max_new + INTERVAL, BLOCK)) * BLOCK


def expected_tokens(lengths):
    return {s: [token(s, i) for i in range(n)] for s, n in enumerate(lengths)}


def test_the_same_tokens_under_a_tight_budget_with_preemption_and_every_block_back():
    prompt_len, samples, max_new = 37, 4, 200
    lengths = lognormal_lengths(32, max_new, seed=1)
    lengths[5] = max_new  # one row at its longest
    least = least_budget(prompt_len, max_new)
    loop = Loop(lengths, prompt_len, samples, rows=32, max_kv_tokens=least + 2 * BLOCK)
    loop.run()
    assert loop.out == expected_tokens(lengths)  # every sample ended once, its restarts drawing the same tokens
    assert loop.scheduler.preemptions > 0  # the budget was tight enough to preempt
    assert loop.peak_blocks <= (least + 2 * BLOCK) // BLOCK
    assert loop.store.pool.num_held == 1  # every block back but the scratch block


def test_prompts_kept_for_waiting_samples_are_let_go_before_any_row_is_preempted():
    """Three rows of a long prompt's four samples under the smallest budget: the prompt, kept for its
    fourth sample, is the first to give its blocks back when the rows outgrow the budget; that sample
    prefills it again."""
    prompt_len, samples, max_new = 100, 4, 64
    lengths = [64, 64, 64, 8] * 4
    loop = Loop(lengths, prompt_len, samples, rows=3, max_kv_tokens=least_budget(prompt_len, max_new))
    loop.run()
    assert loop.out == expected_tokens(lengths)
    assert loop.forgotten > 0
    assert loop.store.pool.num_held == 1


def test_a_budget_too_small_for_one_row_at_its_longest_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"max_kv_tokens=300 holds 18 blocks of 16 tokens.*at least 352"):
        check_budget(300, 16, prompt_len=40, max_new_tokens=256, interval=INTERVAL)


def test_a_token_budget_holds_over_three_times_the_rows_max_rows_holds_in_the_same_bytes():
    """#52's goal, on the scheduling alone: 64 prompts x 8 samples, log-normal lengths under a 2,048-token
    budget, KV bytes for 16 rows at their longest (what max_rows=16 allocates); while samples wait to
    start, the token budget keeps at least 3x as many rows decoding as the row budget does."""
    prompt_len, samples, max_new = 128, 8, 2048
    lengths = lognormal_lengths(512, max_new, seed=2)
    max_rows = 16
    kv_tokens = max_rows * (prompt_len + max_new)
    by_rows = Loop(lengths, prompt_len, samples, rows=max_rows)
    by_tokens = Loop(lengths, prompt_len, samples, rows=512, max_kv_tokens=kv_tokens)
    for loop in (by_rows, by_tokens):
        loop.run()
        assert loop.out == expected_tokens(lengths)
    assert by_tokens.peak_blocks * BLOCK <= kv_tokens
    rows_mean, tokens_mean = (
        sum(n for n, waited in live if waited) / sum(waited for _, waited in live)
        for live in (by_rows.live_per_step, by_tokens.live_per_step)
    )
    assert tokens_mean >= 3 * rows_mean, (tokens_mean, rows_mean)


# --- with a model --------------------------------------------------------------------------------------------
FEW_EOS = [40, 41, 42]  # rows of the random models end at spread lengths, some at max_new_tokens


@pytest.mark.parametrize(
    "family,kv_sharing", [("llama", "paged"), ("lfm2", "paged"), ("gemma3_text", "paged"), ("llama", "prefix")]
)
def test_tokens_equal_the_unbudgeted_rollout_under_a_budget_that_preempts(family_models, family, kv_sharing):
    """Sampling with log-probabilities, prompts of different lengths, rows ending at spread lengths; a
    budget of a few rows at their longest: rows preempted and restarted from their prompts (prefilled
    again), the same tokens as without the budget; the blocks held within it. A hybrid's recurrent states
    start again with each restart; a sliding-window model's window blocks go back as rows slide, end and
    are preempted (its window of 8 is passed 7 times). kv_sharing="prefix": without the budget each prompt's
    whole block is read stacked for its rows; under it (a streaming batch, its rows' prompts coming and
    going) each row reads through its table: the same tokens either way."""
    model = family_models[family] if family in family_models else tiny_model(family)
    if model is None:
        pytest.skip(unavailable(family))
    ids, mask = prompts(4, 21, seed=3, left_pad=[0, 5, 2, 9])
    config = dict(
        samples_per_prompt=4,
        max_new_tokens=40,
        kv_sharing=kv_sharing,
        eos_token_id=FEW_EOS,
        temperature=1.0,
        seed=5,
        return_logprobs=True,
        enable_profiling=True,
    )
    unbudgeted = Rollout(model, RolloutConfig(**config)).generate(ids, mask)
    budget = least_budget(21, 40) + 2 * BLOCK  # a prompt, one row at its longest, and two blocks
    rollout = Rollout(model, RolloutConfig(max_kv_tokens=budget, **config))
    budgeted = rollout.generate(ids, mask)
    profile = rollout.get_last_profile()
    assert torch.equal(budgeted.sequences, unbudgeted.sequences)
    assert torch.equal(budgeted.response_mask, unbudgeted.response_mask)
    torch.testing.assert_close(budgeted.logprobs, unbudgeted.logprobs, rtol=0, atol=1e-4)
    assert profile.preemptions > 0, budgeted.response_mask.sum(dim=1)
    block_bytes = rollout.cache.paged.block_bytes
    assert rollout.cache.paged.peak_blocks - 1 <= budget // BLOCK  # (the scratch block apart)
    assert profile.kv_cache_bytes >= rollout.cache.paged.peak_blocks * block_bytes


def test_rows_preempted_at_a_check_in_trls_layout_end_with_the_unbudgeted_tokens(llama):
    """8 prompts x 8 samples under the bytes of 16 rows at their longest (a case that once restarted rows
    in the check that preempted them, and their reservation then read the preempted row's column): the
    budget is never passed (a capped pool raises) and the tokens are the unbudgeted ones."""
    ids, mask = prompts(8, 21, seed=3, left_pad=[0, 3, 5, 1, 0, 7, 2, 4])
    config = dict(
        samples_per_prompt=8, max_new_tokens=64, kv_sharing="paged", eos_token_id=[40, 41], temperature=1.0, seed=3
    )
    unbudgeted = Rollout(llama, RolloutConfig(**config)).generate(ids, mask)
    rollout = Rollout(llama, RolloutConfig(max_kv_tokens=16 * (21 + 64), enable_profiling=True, **config))
    assert torch.equal(rollout.generate(ids, mask).sequences, unbudgeted.sequences)
    assert rollout.get_last_profile().preemptions > 0


def test_a_budget_that_holds_every_row_runs_as_a_call_and_keeps_its_kv_for_a_turn(llama):
    ids, mask = prompts(2, 9, seed=4)
    config = dict(samples_per_prompt=2, max_new_tokens=12, kv_sharing="paged", eos_token_id=[], seed=1)
    rollout = Rollout(llama, RolloutConfig(max_kv_tokens=100_000, **config))
    out = rollout.generate(ids, mask)
    assert torch.equal(out.sequences, Rollout(llama, RolloutConfig(**config)).generate(ids, mask).sequences)
    assert rollout.history is not None  # a call, not a stream: Rollout.extend can go on from it


def test_bad_budgets_are_refused_naming_the_setting(llama):
    with pytest.raises(ValueError, match=r"max_kv_tokens .*needs shared_prefill=True"):
        RolloutConfig(max_kv_tokens=4096, shared_prefill=False)
    assert RolloutConfig(max_kv_tokens=4096).kv_sharing == "paged"  # (the default layout: the one it counts)
    with pytest.raises(ValueError, match=r"max_kv_tokens must be None .*or an int >= 1"):
        RolloutConfig(max_kv_tokens=0, kv_sharing="paged")
    ids, mask = prompts(2, 9, seed=4)
    rollout = Rollout(llama, RolloutConfig(max_kv_tokens=64, max_new_tokens=32, kv_sharing="paged"))
    with pytest.raises(ValueError, match=r"max_kv_tokens=64 holds 4 blocks .*raise it to at least"):
        rollout.generate(ids, mask)


def test_patch_generate_and_generate_take_a_budget_with_the_same_tokens(llama):
    """TRL's layout (each prompt repeated): `patch_generate(max_kv_tokens=)` (the paged layout by default)
    and `torchkvops.generate(..., max_kv_tokens=)` give the tokens of the unbudgeted patch, preempting."""
    import torchkvops

    ids, mask = prompts(3, 21, seed=6, left_pad=[0, 4, 1])
    ids, mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)
    kwargs = dict(max_new_tokens=40, do_sample=True, temperature=1.0, top_k=0, eos_token_id=FEW_EOS, pad_token_id=0)
    budget = least_budget(21, 40) + 2 * BLOCK
    results, preemptions = [], []
    for options in (dict(), dict(max_kv_tokens=budget), "generate"):
        handle = torchkvops.patch_generate(llama, enable_profiling=True, **(options if options != "generate" else {}))
        torch.manual_seed(0)  # the call's sampling seed comes from torch's generator
        if options == "generate":
            results.append(torchkvops.generate(llama, ids, attention_mask=mask, max_kv_tokens=budget, **kwargs))
        else:
            results.append(llama.generate(ids, attention_mask=mask, **kwargs))
        preemptions.append(handle.last_profile().preemptions)
        handle.undo()
    assert torch.equal(results[1], results[0]) and torch.equal(results[2], results[0])
    assert preemptions[0] == 0 and preemptions[1] > 0 and preemptions[2] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_budget_that_preempts_on_each_device(device):
    """One decode shape across preemptions and restarts (without compaction); on CUDA one CUDA graph
    replayed for all of them: the pool is the budget's size from the start, so its address stays."""
    model = FAMILIES["llama"]().to(device)
    ids, mask = prompts(4, 21, seed=3, left_pad=[0, 5, 2, 9])
    config = dict(
        samples_per_prompt=4, max_new_tokens=40, kv_sharing="paged", eos_token_id=FEW_EOS, temperature=1.0, seed=5
    )
    config["compact_finished_rows"] = False
    unbudgeted = Rollout(model, RolloutConfig(**config)).generate(ids.to(device), mask.to(device))
    rollout = Rollout(
        model, RolloutConfig(max_kv_tokens=least_budget(21, 40) + 2 * BLOCK, enable_profiling=True, **config)
    )
    budgeted = rollout.generate(ids.to(device), mask.to(device))
    assert torch.equal(budgeted.sequences, unbudgeted.sequences)
    assert rollout.get_last_profile().preemptions > 0
    assert rollout.decode_counters().decode_shapes == 1
    if device == "cuda":
        assert rollout.decode_counters().captured_graphs == 1
