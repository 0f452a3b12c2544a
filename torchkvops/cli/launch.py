"""How and where this process runs: alone, or as one of the data-parallel processes torchrun launched
(torchrun_env), in torch.distributed's default group from start_processes() to stop_processes(); on
which device (resolve_device); how many CPU threads torch uses (--threads: add_threads_argument,
set_threads); which contiguous shard of the prompts it takes (shard_bounds); and what only the first
process prints (say). No torch at import time.
"""

from __future__ import annotations

import argparse
import os

from .checks import CLIError, int_in

__all__ = [
    "RunError",
    "say",
    "current_rank",
    "current_world_size",
    "resolve_device",
    "torchrun_env",
    "start_processes",
    "stop_processes",
    "shard_bounds",
    "add_threads_argument",
    "set_threads",
]


class RunError(Exception):
    """A failure while running (e.g. on another process of a data-parallel run): one line, exit code 1."""


# --- torchrun: data-parallel processes -----------------------------------------------------------
# This process's rank and the number of processes, once start_processes() has run (0 and 1 alone).
_RANK, _WORLD_SIZE = 0, 1
_STARTED_GROUP = False


def say(*args, **kwargs) -> None:
    """print, on the first process only (under torchrun every process's stdout reaches the terminal)."""
    if _RANK == 0:
        print(*args, **kwargs)


def current_rank() -> int:
    """This process's rank once start_processes() has run; 0 alone."""
    return _RANK


def current_world_size() -> int:
    """The number of processes once start_processes() has run; 1 alone."""
    return _WORLD_SIZE


def torchrun_env(environ=None) -> dict | None:
    """What torchrun set for this process ({"rank", "world_size", "local_rank"}), or None when it was
    not launched by torchrun (WORLD_SIZE unset or 1 and no TORCHELASTIC_RUN_ID): one process."""
    env = os.environ if environ is None else environ

    def number(name: str, default: str | None = None) -> int:
        text = env.get(name, default)
        try:
            return int(text)
        except (TypeError, ValueError):
            raise CLIError(
                f"launched by torchrun (WORLD_SIZE / TORCHELASTIC_RUN_ID set), but {name}={text!r} is not an integer"
            ) from None

    if not env.get("TORCHELASTIC_RUN_ID") and number("WORLD_SIZE", "1") <= 1:
        return None
    out = {"world_size": number("WORLD_SIZE"), "rank": number("RANK"), "local_rank": number("LOCAL_RANK", "0")}
    if not 0 <= out["rank"] < out["world_size"]:
        raise CLIError(f"torchrun's RANK={out['rank']} is outside [0, WORLD_SIZE={out['world_size']})")
    return out


def start_processes(device_text: str | None):
    """The device to run on, after joining torch.distributed's default group when launched by torchrun:
    nccl on CUDA (this process on cuda:LOCAL_RANK), gloo on the CPU. Alone: resolve_device."""
    global _RANK, _WORLD_SIZE, _STARTED_GROUP
    launch = torchrun_env()
    device = resolve_device(device_text)
    if launch is None:
        return device
    import torch
    import torch.distributed as dist

    backend = "gloo"
    if device.type == "cuda":
        if device_text not in (None, "cuda", f"cuda:{launch['local_rank']}"):
            raise CLIError(
                f"--device {device_text}: under torchrun each process uses cuda:LOCAL_RANK (here "
                f"cuda:{launch['local_rank']}); pass --device cuda (or no --device)"
            )
        if launch["local_rank"] >= torch.cuda.device_count():
            raise CLIError(
                f"torchrun's LOCAL_RANK={launch['local_rank']}, but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s); lower --nproc-per-node"
            )
        device = torch.device("cuda", launch["local_rank"])
        torch.cuda.set_device(device)
        backend = "nccl"
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
        _STARTED_GROUP = True
    _RANK, _WORLD_SIZE = dist.get_rank(), dist.get_world_size()
    return device


def stop_processes() -> None:
    """Leave the default group if start_processes joined it."""
    global _STARTED_GROUP, _RANK, _WORLD_SIZE
    if _STARTED_GROUP:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        _STARTED_GROUP = False
    _RANK, _WORLD_SIZE = 0, 1


def shard_bounds(count: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) shards of `count` items over `world_size` processes, in rank order; sizes
    differ by at most one (the first count % world_size processes take one more), and a process may
    have none when count < world_size."""
    base, extra = divmod(count, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        end = start + base + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


# --- the device ----------------------------------------------------------------------------------
def resolve_device(text: str | None):
    """The torch.device for --device (None: cuda when available); the same errors in every command."""
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise CLIError(f"--device {text!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CLIError(
                f"--device {text}: no CUDA GPU is available here (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'})"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CLIError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise CLIError(f"--device {text}: only cpu and cuda are supported")
    return device


# --- CPU threads ---------------------------------------------------------------------------------
def add_threads_argument(parser) -> None:
    """--threads N, the same in every command (applied by set_threads before the work)."""
    cpus = os.cpu_count() or 1
    parser.add_argument(
        "--threads",
        type=int_in(1, cpus, f" (the {cpus} CPUs here)"),
        default=None,
        metavar="N",
        help="CPU threads torch uses in this process (torch.set_num_threads; default: torch's "
        "choice, one per core). On a machine other jobs share, fewer threads can be much "
        "faster",
    )


def threads_for_this_machine() -> tuple[int, str]:
    """(threads, why) for a run that was given none (the bare `torchkvops`): the CPUs other jobs leave free
    by the last minute's load average, at least one. On a 2-core machine with a job beside it, two threads
    contend for one core: the default benchmark took 4-5 minutes there and its figures were noise, against
    45 s with one thread (docs/benchmarks.md)."""
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # (no load average on this OS: torch's choice, one a core)
        return cpus, f"{cpus} CPUs"
    free = max(1, min(cpus, int(cpus - load + 0.5)))
    why = f"{cpus} CPUs, load average {load:.1f}"
    return free, why + (": more threads would contend with the other jobs" if free < cpus else "")


def set_threads(args: argparse.Namespace) -> None:
    """torch.set_num_threads(--threads), before any work; nothing without --threads."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
