"""The benchmark's metrics (torchkvops.bench.metrics), called directly: the weight and KV bytes a step
reads, the CPU peak memory of a call."""

import pytest
import torch
from cli_helpers import error_lines, run_cli

from torchkvops.bench import metrics as bench_metrics


def test_weight_bytes_count_each_storage_once_and_kv_bytes_per_step():
    first, second = torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(4, 8, bias=False)
    second.weight = torch.nn.Parameter(first.weight.data)  # another Parameter on the same storage: tied
    model = torch.nn.Sequential(first, second)
    model.register_buffer("scale", torch.ones(3))
    assert bench_metrics.model_weight_bytes(model) == 8 * 4 * 4 + 3 * 4
    t = bench_metrics.Traffic(weight_bytes=100, kv_bytes_per_token=10)
    # B=2 prompts of P=5, N=3, 3 decode steps attending to P+1, P+2, P+3 keys: on average P+2.
    assert t.kv_bytes_per_step("shared", 2, 3, 5, 3) == 10 * 6 * (5 + 2)
    assert t.kv_bytes_per_step("hf-generate", 2, 3, 5, 3) == 10 * 6 * (5 + 2)
    assert t.kv_bytes_per_step("prefix", 2, 3, 5, 3) == 10 * (2 * 5 + 6 * 2)  # each prompt's keys once
    assert t.kv_bytes_per_step("shared", 2, 3, 5, 0) is None  # R=1: no decode step
    p = t.annotate("prefix", dict(decode_steps=3, decode_ms=6.0, batch_size=2, samples_per_prompt=3, prompt_length=5))
    assert p["decode_ms_per_step"] == 2.0 and p["achieved_gbps"] == (100 + 220) / 2.0 / 1e6
    assert p["roofline_fraction"] is None
    with_roofline = bench_metrics.Traffic(100, 10, roofline_gbps=0.0004)
    p = with_roofline.annotate(
        "shared", dict(decode_steps=3, decode_ms=6.0, batch_size=2, samples_per_prompt=3, prompt_length=5)
    )
    assert p["roofline_fraction"] == pytest.approx((100 + 420) / 2.0 / 1e6 / 0.0004)


def test_a_hybrids_traffic_counts_its_attention_layers_kv_and_every_rows_states():
    """tests/families.py's tiny Qwen3.5: one attention layer (2 KV heads of 16) and one Gated DeltaNet layer
    (a convolution window of 64 channels x 4, a state of 4 value heads x 8 x 8), float32."""
    from families import tiny_model, unavailable

    model = tiny_model("qwen3_5_text")
    if model is None:
        pytest.skip(unavailable("qwen3_5_text"))
    t = bench_metrics.Traffic.of(model)
    assert t.kv_bytes_per_token == 1 * 2 * 2 * 16 * 4  # the attention layer only
    assert t.state_bytes_per_row == (64 * 4 + 4 * 8 * 8) * 4
    # 6 rows: every row's states once a step, besides the keys.
    assert t.kv_bytes_per_step("shared", 2, 3, 5, 3) == 256 * 6 * (5 + 2) + 6 * 2048
    assert t.kv_bytes_per_step("prefix", 2, 3, 5, 3) == 256 * (2 * 5 + 6 * 2) + 6 * 2048


def test_cpu_peak_memory_counts_allocations_inside_ops():
    mib = 1 << 20

    def work():
        a = torch.ones(mib, dtype=torch.uint8)  # 1 MiB
        b = torch.ones(2 * mib, dtype=torch.uint8)  # 3 MiB held
        del a
        c = torch.ones(4 * mib, dtype=torch.uint8)  # 6 MiB held: the peak
        del b, c
        d = torch.ones(mib, dtype=torch.uint8)
        del d

    peak = bench_metrics.cpu_peak_memory_bytes(work)
    assert 6 * mib <= peak < 6 * mib + 64 * 1024


def test_cpu_peak_memory_drops_the_allocators_unknown_block_warning_only():
    """Freeing, inside the measured call, a block allocated before it (as a rollout's previous decode
    state is) makes torch's CPU allocator print a warning in the middle of the bench's progress bar: it
    is dropped, the call's own stderr is kept. Each in a fresh process (torch prints it once per 1000)."""
    code = (
        "import sys, torch\n"
        "from torch.profiler import ProfilerActivity, profile\n"
        "from torchkvops.bench import metrics\n"
        "held = [torch.ones(1 << 16)]\n"
        "def work():\n"
        "    held.clear()\n"
        "    print('the call says this', file=sys.stderr)\n"
        "if sys.argv[1] == 'raw':\n"
        "    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):\n"
        "        work()\n"
        "else:\n"
        "    metrics.cpu_peak_memory_bytes(work)\n"
    )
    raw = run_cli("raw", code=code)
    assert raw.returncode == 0, raw.stderr
    assert bench_metrics.UNKNOWN_BLOCK in raw.stderr  # the control: torch does print it
    measured = run_cli("measured", code=code)
    assert measured.returncode == 0, measured.stderr
    assert bench_metrics.UNKNOWN_BLOCK not in measured.stderr
    assert error_lines(measured) == ["the call says this"]
