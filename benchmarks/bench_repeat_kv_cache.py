"""Bandwidth of torchkvops.repeat_kv_cache_ against a copy roofline, repeat_interleave and a row loop.

Thin entry point: the same as `torchkvops bench-op ARGS` (the measurement is torchkvops/bench/op.py,
the command torchkvops/cli/bench_op.py).
Example: .venv/bin/python benchmarks/bench_repeat_kv_cache.py --device cpu --dtype fp16 --output out/bench_repeat_kv_cache.json
"""

import sys

from torchkvops.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main(["bench-op", *sys.argv[1:]]))
