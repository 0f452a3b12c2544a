"""The benchmark's cases (torchkvops.bench.cases), called directly: the plan and its run order, the
synthetic prompts."""

import torch

from torchkvops.bench import cases as bench_cases


def test_run_order_is_largest_first_and_stable():
    cases = bench_cases.plan_cases([1, 8], [4, 16], [32], [8, 16])
    assert [c.name for c in cases][:3] == ["B1_N4_P32_R8", "B1_N4_P32_R16", "B1_N16_P32_R8"]
    order = [cases[i] for i in bench_cases.run_order(cases)]
    assert [c.rows for c in order] == sorted((c.rows for c in cases), reverse=True)
    assert order[0].name == "B8_N16_P32_R16" and order[1].name == "B8_N16_P32_R8"
    assert bench_cases.plan_cases([2, 2], [1], [3], [4]) == [bench_cases.Case(2, 1, 3, 4)]  # duplicates dropped


def test_synthetic_prompts_are_seeded_and_avoid_special_ids():
    case = bench_cases.Case(3, 2, 50, 4)
    a = bench_cases.synthetic_prompts(case, 8, {0, 1, 2}, seed=5, device=torch.device("cpu"))
    b = bench_cases.synthetic_prompts(case, 8, {0, 1, 2}, seed=5, device=torch.device("cpu"))
    c = bench_cases.synthetic_prompts(case, 8, {0, 1, 2}, seed=6, device=torch.device("cpu"))
    assert a.shape == (3, 50) and a.dtype == torch.long and torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.min()) >= 3 and int(a.max()) <= 7
    # Cases that differ only in N or R (the budget) get the same prompts; another P, other prompts.
    for other in (bench_cases.Case(3, 5, 50, 4000), bench_cases.Case(3, 2, 50, 8)):
        assert torch.equal(bench_cases.synthetic_prompts(other, 8, {0, 1, 2}, seed=5, device=torch.device("cpu")), a)
    longer = bench_cases.synthetic_prompts(bench_cases.Case(3, 2, 51, 4), 8, {0, 1, 2}, 5, torch.device("cpu"))
    assert not torch.equal(longer[:, :50], a)
