"""What the command line refuses before any work, each time with one line (CLIError: exit code 2).

At parse time, the argument types check their ranges. Then, before torch is imported: output paths
writable, the token ids of the largest size fitting in memory, --model a checkpoint folder or a name
to look up in the local cache. Once the model's config is read, before the model is built: prompt
plus response within the model's positions, and the KV cache within the memory free on the device.
No torch at import time, so that --help and bad arguments answer at once.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "CLIError",
    "int_in",
    "positive_int",
    "non_negative_int",
    "float_in",
    "temperature",
    "top_p",
    "device_name",
    "available_memory_bytes",
    "gib",
    "check_output_file",
    "check_output_dir",
    "check_plot_path",
    "model_source",
    "check_max_rows",
    "check_token_memory",
    "check_positions",
    "check_kv_memory",
    "check_bench_kv_memory",
]

PLOT_HINT = "pip install matplotlib  (or, in a clone of torchkvops: pip install -e '.[plot]')"


class CLIError(Exception):
    """Bad input: printed as one line, exit code 2."""


# --- argument types ------------------------------------------------------------------------------
def int_in(lo: int, hi: int | None = None, hi_note: str = ""):
    """An argparse type: an integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}{hi_note}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


positive_int, non_negative_int = int_in(1), int_in(0)


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return v


def float_in(lo: float, hi: float | None = None, lo_open: bool = False):
    """An argparse type: a finite number >= lo (> lo when lo_open) and <= hi."""

    def parse(text: str) -> float:
        v = _float(text)
        if v < lo or (lo_open and v == lo) or (hi is not None and v > hi):
            rng = f"{'(' if lo_open else '['}{lo:.10g}, {'inf)' if hi is None else f'{hi:.10g}]'}"
            raise argparse.ArgumentTypeError(f"must be in {rng}, got {v:g}")
        return v

    parse.__name__ = "float"
    return parse


def temperature(text: str) -> float:
    v = _float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is greedy), got {v}")
    return v


def top_p(text: str) -> float:
    v = _float(text)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {v}")
    return v


def length_sigma(text: str) -> float:
    v = _float(text)
    if not 0.0 < v <= 4.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 4], got {v}")
    return v


def device_name(text: str) -> str:
    """cpu, cuda or cuda:N (syntax only: whether the GPU exists is checked once torch is loaded)."""
    if re.fullmatch(r"cpu|cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


# --- checks before any work (no torch needed) ----------------------------------------------------
def available_memory_bytes() -> int | None:
    """The host memory available now (MemAvailable), or None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def check_token_memory(batch: int, samples: int, prompt_len: int, new_tokens: int, what: str, hint: str) -> None:
    """Refuse sizes whose token-id tensors alone (int64: the prompts, and the B*N output sequences of
    P+R ids) would not fit in the memory available."""
    need = 8 * (batch * prompt_len + batch * samples * (prompt_len + new_tokens))
    have = available_memory_bytes()
    if have is not None and need > have:
        raise CLIError(
            f"{what}: the token ids alone (int64 prompts and outputs) take {gib(need)}, more than the "
            f"{gib(have)} of memory available here; {hint}"
        )


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_can_create_in(folder: Path, flag: str, path: str) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise CLIError(f"{flag} {path}: cannot create files in {folder}: {e.strerror or e}") from None


def check_output_file(path: str | None, flag: str) -> None:
    """Before any work: `path` can be written. Its folder exists and takes new files (the file is
    written through a temporary file in that folder), it is not a folder, and an existing file is
    writable (opened for appending, which changes nothing)."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise CLIError(f"{flag} {path}: is a folder; give a file name")
    parent = p.absolute().parent
    if not parent.is_dir():
        raise CLIError(f"{flag} {path}: the folder {parent} does not exist")
    if p.exists():
        try:
            with open(p, "a"):
                pass
        except OSError as e:
            raise CLIError(f"{flag} {path}: cannot write the file: {e.strerror or e}") from None
    _check_can_create_in(parent, flag, path)


def check_output_dir(path: str | None, flag: str) -> None:
    """Before any work: `path` is a writable folder, or one that can be created."""
    if path is None:
        return
    p = Path(path).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise CLIError(f"{flag} {path}: is a file, not a folder")
    base = _nearest_existing(p)
    if not base.is_dir():
        raise CLIError(f"{flag} {path}: {base} is a file, not a folder")
    _check_can_create_in(base, flag, path)


def check_plot_path(path: str | None) -> None:
    if path is None:
        return
    try:  # at startup, not after minutes of benchmarking
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise CLIError(f"--plot needs matplotlib, which is not installed: {PLOT_HINT}") from None
    suffix = Path(path).suffix.lower().lstrip(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise CLIError(
            f"--plot {path}: matplotlib cannot write .{suffix} files; use one of "
            f"{', '.join('.' + f for f in sorted(formats))}"
        )
    check_output_file(path, "--plot")


def model_source(model: str) -> tuple[str, bool]:
    """(what to load, whether it is a hub name) for --model: an existing checkpoint folder, a GGUF file
    (transformers' `gguf_file=`), or a name to look up in the local Hugging Face cache; a path that does not
    exist is an error."""
    path = Path(model).expanduser()
    if path.exists():
        if path.is_file() and path.suffix.lower() == ".gguf":
            return str(path), False
        if not path.is_dir():
            raise CLIError(f"--model {model}: is a file, neither a checkpoint folder nor a .gguf file")
        if not (path / "config.json").is_file():
            raise CLIError(f"--model {model}: not a Hugging Face checkpoint (no config.json in the folder)")
        return str(path), False
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or os.sep != "/" and os.sep in model:
        raise CLIError(f"--model {model}: no such folder")
    return model, True  # a hub name: only from the local cache


def check_max_rows(args, samples: int) -> None:
    if args.max_rows is not None and args.max_rows < samples:
        raise CLIError(
            f"--max-rows {args.max_rows} is smaller than one prompt's {samples} samples (--samples-per-prompt): "
            "a prompt's samples decode together"
        )


# --- checks before the model is built (its config read, torch loaded) ----------------------------
def kv_cache_bytes(config, rows: int, length: int, itemsize: int) -> int | None:
    """About how large the rollout's KV buffer is: layers x (K, V) x rows x length x kv_heads x
    head_dim x itemsize, from the config; None when the config does not say."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    hidden = getattr(config, "hidden_size", None)
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads
    if not all(isinstance(v, int) and v > 0 for v in (layers, kv_heads, head_dim)):
        return None
    return 2 * layers * rows * length * kv_heads * head_dim * itemsize


def device_memory_bytes(device) -> int | None:
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory_bytes()


def check_positions(config, total: int, what: str, hint: str) -> None:
    """Before the model is built: prompt + response fit the model's positions (the rollout checks
    again, with its own message; this one names the flags)."""
    max_positions = getattr(config, "max_position_embeddings", None)
    if isinstance(max_positions, int) and total > max_positions:
        raise CLIError(
            f"{what} = {total} tokens, more than the model's {max_positions} positions "
            f"(max_position_embeddings); {hint}"
        )


def check_kv_memory(config, device, dtype, rows: int, total: int, what: str, hint: str) -> None:
    """Before the model is built: the KV cache fits in the memory free on the device. An estimate
    that leaves out weights and activations, so it refuses only what cannot work."""
    need = kv_cache_bytes(config, rows, total, dtype.itemsize)
    have = device_memory_bytes(device)
    if need is not None and have is not None and need > have:
        raise CLIError(
            f"{what}: the KV cache of {rows} rows x {total} tokens takes about {gib(need)}, more than the "
            f"{gib(have)} free on {device}; {hint}"
        )


def bench_kv_bytes(config, case, modes: Sequence[str], itemsize: int) -> int | None:
    """About how much KV memory a bench case holds at once: the rollout modes' buffers stay allocated
    through the interleaved rounds (expanded and shared: rows x (P+R) tokens each; prefix: B x P + rows
    x R), plus the largest Hugging Face cache (rows x (P+R)), allocated during its own call. None when
    the config does not say."""
    b, rows, p, r = case.batch_size, case.rows, case.prompt_length, case.response_length
    parts = {
        "expanded": (kv_cache_bytes(config, rows, p + r, itemsize),),
        "shared": (kv_cache_bytes(config, rows, p + r, itemsize),),
        "prefix": (kv_cache_bytes(config, b, p, itemsize), kv_cache_bytes(config, rows, r, itemsize)),
    }
    modes = [m.removesuffix("-nocompact") for m in modes]  # the same buffers as their layout's
    sizes = [size for m in modes if m in parts for size in parts[m]]
    if any(m not in parts for m in modes):
        sizes.append(kv_cache_bytes(config, rows, p + r, itemsize))
    return None if any(v is None for v in sizes) else sum(sizes)


def check_bench_kv_memory(config, device, dtype, cases, modes: Sequence[str]) -> None:
    """Before the model is built: the largest case's KV caches, held at once (bench_kv_bytes), fit in
    the memory free on the device (an estimate without weights and activations)."""
    needs = [(bench_kv_bytes(config, c, modes, dtype.itemsize), c) for c in cases]
    needs = [(need, c) for need, c in needs if need is not None]
    if not needs:
        return
    need, case = max(needs, key=lambda nc: nc[0])
    have = device_memory_bytes(device)
    if have is not None and need > have:
        raise CLIError(
            f"case {case.name}: the KV caches of the modes {', '.join(modes)} take about {gib(need)} held "
            f"at once (the rollout modes' buffers stay allocated while the modes interleave), more than the "
            f"{gib(have)} free on {device}; lower --batch-sizes, --samples-per-prompt, --prompt-lengths or "
            "--response-lengths, or time fewer --modes per run"
        )
