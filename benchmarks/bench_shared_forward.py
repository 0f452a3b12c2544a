"""Forward + backward of completion log-probabilities: the plain forward against torchkvops.patch_forward's
shared-prefix forward (issue #17), interleaved, with time, activation and peak memory per case.

Thin entry point: the same as `torchkvops bench-train ARGS` (the measurement is torchkvops/bench/train.py,
the command torchkvops/cli/bench_train.py).
Example: python benchmarks/bench_shared_forward.py --model-shape llama-small --prompt-lengths 1024 \
    --completion-lengths 128 --group-sizes 8 --threads 1 --output out/bench_shared_forward.json
"""

import sys

from torchkvops.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main(["bench-train", *sys.argv[1:]]))
