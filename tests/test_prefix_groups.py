"""torchkvops.training.prefix_groups alone: which rows share a prefix (wherever they are in the batch), how long a
prefix each group shares, and what makes two rows' columns match (ids, padding, position ids). Through a
model: tests/test_shared_forward.py."""

import numpy as np
import pytest
import torch

from torchkvops.training.prefix_groups import (
    PrefixGroup,
    common_prefix,
    find_prefix_groups,
    grouping_keys,
    plan_grouping,
)


def keys(rows):
    return np.array(rows, dtype=">u4")


@pytest.mark.parametrize("order", ["adjacent", "interleaved", "halves"])
def test_groups_are_found_wherever_their_rows_are(order):
    prompts = [[5, 6, 7, 8], [9, 9, 9, 9], [4, 3, 2, 1]]
    completion = {0: [10, 11], 1: [12, 13]}
    rows = [(p, s) for p in range(3) for s in range(2)]
    if order != "adjacent":
        rows = sorted(rows, key=lambda r: (r[1], r[0]))  # interleaved: p0 p1 p2 p0 p1 p2; halves: the same
    groups = find_prefix_groups(keys([prompts[p] + completion[s] for p, s in rows]), min_shared=2)
    expected = {tuple(sorted(i for i, (p, _) in enumerate(rows) if p == q)) for q in range(3)}
    assert {g.rows for g in groups} == expected
    assert all(g.prefix == 4 for g in groups)


def test_the_longest_prefix_runs_past_the_prompt_and_identical_rows_share_everything():
    groups = find_prefix_groups(
        keys([[1, 2, 3, 7, 7, 1], [1, 2, 3, 7, 7, 2], [4, 4, 4, 4, 4, 4], [4, 4, 4, 4, 4, 4]]), min_shared=1
    )
    assert groups == [PrefixGroup((0, 1), 5), PrefixGroup((2, 3), 6)]


def test_a_deeper_pair_keeps_its_prefix_while_the_rest_of_the_group_shares_the_shorter_one():
    rows = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8], [1, 2, 9, 9, 9, 9, 9], [1, 2, 8, 8, 8, 8, 8]]
    assert find_prefix_groups(keys(rows), min_shared=1) == [PrefixGroup((0, 1), 6), PrefixGroup((2, 3), 2)]


def test_groups_need_min_shared_columns():
    rows = keys([[1, 2, 3], [1, 2, 4], [5, 5, 5]])
    assert find_prefix_groups(rows, min_shared=2) == [PrefixGroup((0, 1), 2), PrefixGroup((2,), 3)]
    assert find_prefix_groups(rows, min_shared=3) == [PrefixGroup((0,), 3), PrefixGroup((1,), 3), PrefixGroup((2,), 3)]


def test_padding_ids_count_and_so_do_position_ids():
    """A padding position's own output (the logit that predicts a row's first real token) is computed
    from its id: rows share a padding column only when its ids agree; a real column with a padding one
    never."""
    ids = torch.tensor([[0, 5, 6, 7], [3, 5, 6, 8], [0, 5, 6, 9], [0, 5, 6, 10]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    groups = find_prefix_groups(grouping_keys(ids, mask, None), 1)
    assert PrefixGroup((0, 3), 3) in groups and all(1 not in g.rows or len(g.rows) == 1 for g in groups)
    positions = torch.tensor([[0, 0, 1, 2], [0, 0, 5, 6], [0, 1, 2, 3], [0, 0, 5, 6]])
    assert PrefixGroup((0, 3), 2) in find_prefix_groups(grouping_keys(ids, mask, positions), 1)


def test_a_common_prefix_is_found_from_each_rows_first_real_column():
    """Rows of different left padding that all start with the same real tokens (a system prompt): the run
    ends where one row differs or has padding."""
    ids = torch.tensor([[0, 0, 7, 8, 9, 1, 2], [7, 8, 9, 1, 5, 5, 5], [0, 7, 8, 9, 1, 3, 3], [0, 7, 8, 9, 0, 0, 0]])
    mask = (ids != 0).long()
    common, starts = common_prefix(grouping_keys(ids, mask, None))
    assert common == 3 and starts.tolist() == [2, 0, 1, 1]  # row 3's fourth real column is padding
    assert common_prefix(grouping_keys(ids[:3], mask[:3], None))[0] == 4
    no_real = mask.clone()
    no_real[3] = 0
    assert common_prefix(grouping_keys(ids, no_real, None))[0] == 0


def trainer_batch(pads, system, own, completions, seed=0):
    """One left-padded prompt per group (`pads[i]` padding, then `system`, then `own` tokens of its own),
    each followed by its group's completions (`completions` rows of 3 tokens that differ at once)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p in pads:
        prompt = [0] * p + system + torch.randint(10, 99, (own - p,), generator=g).tolist()
        rows += [prompt + torch.randint(100, 199, (3,), generator=g).tolist() for _ in range(completions)]
    ids = torch.tensor(rows)
    return ids, (ids != 0).long()


def test_each_prompts_rows_nest_under_a_system_prompt_common_to_all_whatever_their_padding():
    """The grouping of a trainer's batch: the system prompt computed once, then each prompt's rows as a
    group (never two prompts joined by their equal padding), fewer tokens than groups per prompt alone."""
    system = [5, 6, 7, 8, 9, 10]
    ids, mask = trainer_batch(pads=[0, 2, 1, 2], system=system, own=5, completions=3)
    keys = grouping_keys(ids, mask, None)
    flat = plan_grouping(keys, None, min_shared=2)
    nested = plan_grouping(keys, keys, min_shared=2)
    assert nested.common == len(system)
    assert nested.starts.tolist() == [0] * 3 + [2] * 3 + [1] * 3 + [2] * 3
    # Each prompt's 3 rows form a group that shares its padding and own tokens: 2 + 5 - 2 columns.
    assert sorted(g.rows for g in nested.groups) == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11)]
    assert all(g.prefix == 5 for g in nested.groups)
    assert nested.tokens == 6 + 4 * (5 + 3 * 3)
    # Without nesting, the best partition joins the two prompts of equal padding by their padding and
    # system prompt (8 columns, 6 rows) and computes the system prompt three times.
    assert flat.common == 0 and sorted(g.rows for g in flat.groups)[1] == (3, 4, 5, 9, 10, 11)
    assert flat.tokens == 2 * (11 + 3 * 3) + (8 + 6 * 6) > nested.tokens
    # Below min_shared, no common prefix.
    assert plan_grouping(keys, keys, min_shared=7).common == 0


def test_rows_all_the_same_and_unpadded_are_one_group_not_a_common_prefix_with_nothing_after_it():
    """Greedy samples of one prompt (DeepSpeed's OPSD batch at temperature 0): every row equal, no padding.
    The common prefix would be the whole row and leave nothing to group (numpy refused the empty reshape):
    the flat grouping, one group sharing every column."""
    rows = keys([[4, 5, 6, 7, 8]] * 4)
    grouping = plan_grouping(rows, rows, min_shared=2)
    assert grouping.common == 0 and [g.rows for g in grouping.groups] == [(0, 1, 2, 3)]
    assert grouping.groups[0].prefix == 5 and grouping.tokens == 5
