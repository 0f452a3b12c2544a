"""The arguments more than one command takes, and the names they choose from, spelled out so that parsing
needs neither torch nor transformers (tests/test_cli.py and tests/test_bench_train.py check that they
agree with the library's own tables).

  add_model_group   --model, --model-shape, --dtype, --device, --compile, --max-rows, --max-kv-tokens,
                    --seed, --threads: the model `rollout` and `bench` run
  add_shape_arguments  --model-shape, --device, --dtype: a named shape with random weights (bench-train,
                    bench-turns), with run_header, the JSON header of such a run
"""

from __future__ import annotations

import argparse

from .checks import CLIError, device_name, int_in
from .launch import add_threads_argument, resolve_device, set_threads
from .model import DTYPE_NAMES, resolve_dtype

__all__ = [
    "MODEL_POSITIONS",
    "MODEL_SHAPE_NAMES",
    "MODE_NAMES",
    "DEFAULT_MODES",
    "LENGTH_PROFILE_NAMES",
    "MAX_SEED",
    "add_model_group",
    "add_shape_arguments",
    "check_shape_positions",
    "shape_device_and_dtype",
    "run_header",
]

# torchkvops.models.MODEL_SHAPES in its order, each with its positions (max_position_embeddings): what a
# command checks a length against before any model is built.
MODEL_POSITIONS = {
    "tiny": 2048,
    "llama-small": 8192,
    "gemma3-small": 8192,
    "gpt-oss-small": 131072,
    "qwen3.5-small": 32768,
    "opt-125m": 2048,
    "gpt2": 1024,
    "qwen3-0.6b": 40960,
    "opt-6.7b": 2048,
}
MODEL_SHAPE_NAMES = tuple(MODEL_POSITIONS)
# torchkvops.bench.cases.MODES and DEFAULT_MODES.
MODE_NAMES = (
    "expanded",
    "shared",
    "prefix",
    "paged",
    "hf-generate",
    "hf-static",
    "shared-nocompact",
    "prefix-nocompact",
)
DEFAULT_MODES = ("expanded", "shared", "prefix", "hf-generate")
# torchkvops.bench.lengths.LENGTH_PROFILES.
LENGTH_PROFILE_NAMES = ("fixed", "geometric", "eos-rate", "log-normal")
MAX_SEED = 2**63 - 1
DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda when available, else cpu)"


def add_model_group(p: argparse.ArgumentParser) -> None:
    """The model `rollout` and `bench` run, and how: a checkpoint or a named shape, its dtype and device,
    compiled or not, the row and KV budgets, the seed and the threads."""
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        metavar="PATH_OR_NAME",
        help="a local Hugging Face checkpoint folder, a GGUF file, or a name already in the local cache; "
        "loaded offline. Default: a model built from --model-shape with random weights",
    )
    g.add_argument(
        "--model-shape",
        choices=MODEL_SHAPE_NAMES,
        default="opt-125m",
        help="shape of the random-weight model used without --model",
    )
    g.add_argument("--dtype", choices=list(DTYPE_NAMES), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    g.add_argument("--device", type=device_name, default=None, help=DEVICE_HELP)
    g.add_argument("--compile", action="store_true", help="torch.compile the rollout's prefill and decode")
    g.add_argument(
        "--max-rows",
        type=int_in(1),
        default=None,
        help="the most sample rows decoded at once (RolloutConfig.max_rows): more are streamed, prompts "
        "admitted as others' rows end; default: every row at once",
    )
    g.add_argument(
        "--max-kv-tokens",
        type=int_in(1),
        default=None,
        help="the most KV tokens the rows hold at once (RolloutConfig.max_kv_tokens, the paged layout; bench: "
        "its paged mode): rows start while blocks are free, the newest preempted when they run short; "
        "default: no bound",
    )
    g.add_argument("--seed", type=int_in(0, MAX_SEED, " (2**63 - 1)"), default=0, help="sampling and prompt seed")
    add_threads_argument(g)


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """--model-shape, --device and --dtype: a model of a named shape with random weights."""
    p.add_argument(
        "--model-shape", choices=list(MODEL_POSITIONS), default="llama-small", help="a torchkvops.models shape"
    )
    p.add_argument("--device", type=device_name, default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", choices=list(DTYPE_NAMES), default="fp32", help="the weights' dtype")


def check_shape_positions(args: argparse.Namespace, longest: int, what: str) -> None:
    """`what` (the flags whose sum it is) reaching `longest` tokens fits the --model-shape's positions."""
    limit = MODEL_POSITIONS[args.model_shape]
    if longest > limit:
        raise CLIError(f"{what} reach {longest} tokens, more than the {args.model_shape} shape's {limit} positions")


def shape_device_and_dtype(args: argparse.Namespace):
    """A model-shape benchmark's set-up: --threads applied, then its (device, dtype)."""
    set_threads(args)
    device = resolve_device(args.device)
    _, dtype = resolve_dtype(args.dtype, device)
    return device, dtype


def run_header(args: argparse.Namespace, device, notes: dict, **more) -> dict:
    """The JSON header of a run of a model-shape benchmark (add_shape_arguments, --warmup, --iterations)."""
    import torch

    return {
        "model_shape": args.model_shape,
        "device": str(device),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "warmup": args.warmup,
        "iterations": args.iterations,
        **more,
        "notes": notes,
    }
