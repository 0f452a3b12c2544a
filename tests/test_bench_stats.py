"""The benchmark's statistics (torchkvops.bench.stats), called directly: the summaries, the token
agreement between modes, the tokens' hash and the stage breakdown of the median-total iteration."""

import pytest
import torch
from cli_helpers import _iteration

from torchkvops.bench import cases as bench_cases
from torchkvops.bench import report as bench_report
from torchkvops.bench import stats as bench_stats


def test_summary_math():
    s = bench_stats.summarize(list(range(1, 21)))
    assert s == {"mean": 10.5, "p50": 10.5, "p95": 19}
    assert bench_stats.summarize([3, 1, 2]) == {"mean": 2.0, "p50": 2, "p95": 3}
    assert bench_stats.summarize([5.0]) == {"mean": 5.0, "p50": 5.0, "p95": 5.0}
    # nearest rank: the value at rank ceil(0.95 n) of the sorted values
    values = [float(v) for v in range(100, 0, -1)]
    assert bench_stats.summarize(values)["p95"] == 95.0
    assert bench_stats.summarize([None, None]) is None
    with pytest.raises(ValueError, match="None"):
        bench_stats.summarize([1.0, None, 2.0])
    with pytest.raises(ValueError):
        bench_stats.summarize([])
    profiles = [{"a": float(i), "b": None, "c": 7} for i in range(1, 21)]
    assert bench_stats.summarize_profiles(profiles) == {
        "a": {"mean": 10.5, "p50": 10.5, "p95": 19.0},
        "b": None,
        "c": {"mean": 7.0, "p50": 7, "p95": 7},
    }


def test_token_agreement_rules():
    same = {"expanded": "h", "shared": "h", "hf-generate": "h"}
    greedy = bench_stats.token_agreement(same, greedy=True)
    assert greedy["all_agree"] is True and all(v is True for v in greedy["pairs"].values())
    sampled = bench_stats.token_agreement({"expanded": "h", "shared": "x", "hf-generate": "y"}, greedy=False)
    assert sampled["pairs"] == {
        "expanded vs shared": False,
        "expanded vs hf-generate": None,
        "shared vs hf-generate": None,
    }
    assert sampled["all_agree"] is False and "not comparable" in sampled["notes"]["expanded vs hf-generate"]
    assert bench_stats.token_agreement({"shared": "h", "hf-generate": "y"}, greedy=False)["all_agree"] is None
    assert bench_stats.token_agreement({"shared": "h", "expanded": None}, greedy=True)["pairs"] == {}


def test_token_agreement_rules_for_the_prefix_and_static_modes():
    sampled = bench_stats.token_agreement(
        {"shared": "h", "prefix": "h", "hf-generate": "y", "hf-static": "y"}, greedy=False
    )
    assert sampled["pairs"] == {
        "shared vs prefix": True,
        "shared vs hf-generate": None,
        "shared vs hf-static": None,
        "prefix vs hf-generate": None,
        "prefix vs hf-static": None,
        "hf-generate vs hf-static": None,
    }
    assert sampled["all_agree"] is True and "--temperature 0" in sampled["notes"]["hf-generate vs hf-static"]
    greedy = bench_stats.token_agreement({"prefix": "h", "hf-static": "x"}, greedy=True)
    assert greedy["pairs"] == {"prefix vs hf-static": False} and greedy["all_agree"] is False


def test_tokens_hash_is_of_int64_bytes():
    t = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    import hashlib

    assert bench_stats.tokens_sha256(t) == hashlib.sha256(t.long().numpy().tobytes()).hexdigest()


def test_stage_breakdown_adds_up_to_the_median_total():
    # Per-field medians (prefill 35, decode 30) would stack to about 66; the median total is 61.
    its = [_iteration(61.0, 10.0, 50.0), _iteration(60.5, 40.0, 20.0), _iteration(66.0, 35.0, 30.0)]
    entry = {"error": None, "iterations": its, "summary": bench_stats.summarize_profiles(its)}
    split = bench_stats.stage_breakdown(entry)
    assert split["iterations"] == [0] and split["total_ms"] == entry["summary"]["total_ms"]["p50"] == 61.0
    assert (split["prefill_ms"], split["decode_ms"]) == (10.0, 50.0)
    stages = sum(split[f] for f in bench_cases.STAGE_FIELDS)
    assert split["other_ms"] == pytest.approx(61.0 - stages) and stages + split["other_ms"] == pytest.approx(61.0)
    assert split["tokens_per_second"] == pytest.approx(8 / 0.061)
    segments = bench_report.plot_segments(entry)
    assert [label for label, _ in segments] == [
        "prompt_expansion",
        "prefill",
        "kv_expand",
        "decode",
        "post_processing",
        "other",
    ]
    assert sum(v for _, v in segments) == pytest.approx(61.0)

    # An even count: the mean of the two middle iterations, whose mean total is the median.
    its.append(_iteration(70.0, 1.0, 60.0))
    entry = {"error": None, "iterations": its, "summary": bench_stats.summarize_profiles(its)}
    split = bench_stats.stage_breakdown(entry)
    assert sorted(split["iterations"]) == [0, 2] and split["total_ms"] == entry["summary"]["total_ms"]["p50"] == 63.5
    assert split["prefill_ms"] == 22.5 and split["decode_ms"] == 40.0
    assert sum(v for _, v in bench_report.plot_segments(entry)) == pytest.approx(63.5)

    # A mode without stages (hf-generate): its total alone.
    hf = [
        dict(
            _iteration(t, 0, 0),
            prefill_ms=None,
            decode_ms=None,
            kv_expand_ms=None,
            prompt_expansion_ms=None,
            post_processing_ms=None,
        )
        for t in (80.0, 90.0, 85.0)
    ]
    entry = {"error": None, "iterations": hf, "summary": bench_stats.summarize_profiles(hf)}
    assert bench_report.plot_segments(entry) == [("total (not split)", 85.0)]
    assert bench_report.plot_segments({"error": "boom", "iterations": [], "median_stages": None}) == []
