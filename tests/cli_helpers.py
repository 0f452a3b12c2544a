"""What tests/test_cli.py shares with the tests of the modules behind it: the repository's root, the command
line run as a user runs it (`python -m torchkvops ...` in an offline subprocess, or `python -c CODE`) and
its stderr's lines, and one timed iteration's record of a bench mode."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from timeouts import TIMEOUT

ROOT = Path(__file__).absolute().parents[1]


def cli_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    env.pop("TORCHKVOPS_DEBUG", None)
    return env


def run_cli(
    *args: str, timeout: float = TIMEOUT, code: str | None = None, python_flags: Sequence[str] = ()
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *python_flags] + (["-c", code, *args] if code else ["-m", "torchkvops", *args])
    return subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=timeout)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """stderr's non-blank lines (the profiler's native start/stop chatter must not be among them)."""
    return [line for line in proc.stderr.splitlines() if line.strip()]


def _iteration(total, prefill, decode, kv=0.5, expansion=0.25, post=0.125, tokens=8):
    return {
        "total_ms": total,
        "prompt_expansion_ms": expansion,
        "prefill_ms": prefill,
        "kv_expand_ms": kv,
        "decode_ms": decode,
        "post_processing_ms": post,
        "generated_tokens": tokens,
    }
