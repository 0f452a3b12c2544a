"""Smoke test of the repeat_kv_cache_ bandwidth benchmark (torchkvops.bench.op, and its command torchkvops.cli.bench_op): tiny sizes, one
timed round; checks the byte accounting, the size plan and the table, not the speed. (Its flags'
checks at parse time are in tests/test_cli.py, with the other commands'.)"""

import json
import math

import pytest

from torchkvops.bench import op as bench_op
from torchkvops.cli import bench_op as cli_bench_op
from torchkvops.cli import main as cli


def parse_args(argv):
    return cli.parse_args(["bench-op", *argv])


def run(argv, **kwargs):
    return cli_bench_op.run(parse_args(argv), **kwargs)


def test_cache_shape_hits_the_target_size():
    for mib in (1, 4, 16, 64, 256, 1024):
        shape = bench_op.cache_shape(mib << 20, rows=32, kv_heads=8, head_dim=128, itemsize=2)
        layers, two, rows, heads, tokens, hd = shape
        assert (two, rows, heads, hd) == (2, 32, 8, 128)
        nbytes = layers * two * rows * heads * tokens * hd * 2
        assert nbytes == mib << 20


def test_run_and_main_cpu(tmp_path, capsys):
    argv = ["--device", "cpu", "--max-mib", "4", "--warmup", "1", "--iters", "2", "--batch", "3", "--repeats", "2"]
    rows = run(argv)
    assert [r["cache_mib"] for r in rows] == pytest.approx([1, 4], rel=0.05)
    for r in rows:
        layers, _, nrows, heads, _, hd = r["shape"]
        assert nrows == 6
        assert r["bytes"] == 2 * (6 - 1) * layers * 2 * heads * r["num_tokens"] * hd * 2
        for m in ("op", "copy", "interleave", "loop"):
            assert r[f"{m}_gbps"] > 0 and r[f"{m}_s"] > 0
        assert r["op_over_copy"] == pytest.approx(r["op_gbps"] / r["copy_gbps"])

    out = tmp_path / "bench.json"
    assert cli.main(["bench-op", *argv, "--methods", "op,copy", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| cache MiB |" in printed and "op/copy" in printed
    saved = json.loads(out.read_text())
    assert len(saved) == 2 and "op_gbps" in saved[0] and "loop_gbps" not in saved[0]
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # written through a temporary file


def test_rows_are_reported_after_each_size():
    seen = []
    rows = run(
        [
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--max-mib",
            "4",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--methods",
            "op",
            "--batch",
            "2",
            "--repeats",
            "2",
        ],
        on_row=lambda r: seen.append(len(r)),
    )
    assert seen == [1, 2] and len(rows) == 2


def test_size_plan_and_peak_memory():
    args = parse_args(
        [
            "--device",
            "cpu",
            "--min-mib",
            "1",
            "--max-mib",
            "64",
            "--factor",
            "4",
            "--batch",
            "2",
            "--repeats",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "64",
        ]
    )
    plan = bench_op.plan(args)
    assert [mib for mib, _, _ in plan] == [1, 4, 16, 64]
    for mib, shape, num_tokens in plan:
        assert math.prod(shape) * 2 == mib * (1 << 20) and num_tokens == shape[4] // 2
    _, shape, t = plan[-1]
    layers, _, rows, heads, _, hd = shape
    row_bytes = layers * 2 * heads * t * hd * 2
    cache = 64 << 20
    assert bench_op.peak_bytes(shape, t, 2, ["op"], check=True) == cache + 3 * rows * row_bytes
    assert bench_op.peak_bytes(shape, t, 2, ["op", "copy", "interleave"], check=False) == (
        cache + 2 * (rows - 1) * row_bytes + rows * row_bytes
    )
    with pytest.raises(ValueError, match="factor >= 2"):  # the loop that never ended (issue #7)
        bench_op._sizes(1, 4, 1)
    with pytest.raises(ValueError, match="min_mib > 0"):
        bench_op._sizes(0, 4, 2)


def test_bad_arguments():
    with pytest.raises(SystemExit):
        run(["--device", "cpu", "--methods", "op,nope"])
    with pytest.raises(SystemExit):
        run(["--device", "cpu", "--repeats", "1"])
