"""Bandwidth of torchkvops.repeat_kv_cache_ against a copy roofline, repeat_interleave and a row loop.

Thin entry point; the implementation lives in torchkvops/bench_op.py (also `torchkvops bench-op`).
Example: python benchmarks/bench_repeat_kv_cache.py --device cpu --dtype fp16 --output out.json
"""

from torchkvops.bench_op import main

if __name__ == "__main__":
    raise SystemExit(main())
