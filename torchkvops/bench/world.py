"""The processes a bench runs on, and how their results become one: alone, or every process of
torch.distributed's default group (WORLD_NOTE). They agree after every call on which modes still run
(World.failures), and each iteration's record is the slowest process's (merge_ranks).
"""

from __future__ import annotations

import math
import socket
from collections.abc import Sequence

import torch
from torch import Tensor

from .cases import INT_FIELDS

__all__ = ["WORLD_NOTE", "World", "merge_ranks"]

WORLD_NOTE = (
    "torch.distributed: every process runs every case on its own B prompts (global batch = B x world_size), "
    "in lockstep (a status exchange after every call; a call that fails on one process fails that mode on "
    "all). Each iteration's record is the profile of the process with the largest total_ms in that "
    "iteration (slowest_rank), with generated_tokens = the tokens of all processes and tokens_per_second "
    "= that / the slowest total (global tokens/s); modes[].ranks holds every process's own iterations, "
    "peak_memory_bytes is the largest of the processes' (rank_peak_memory_bytes)"
)


class World:
    """The processes a bench runs on: this one alone, or every process of torch.distributed's default
    group when it is initialized. Everything moves as tensors through all_gather (on the CPU for gloo,
    on the current CUDA device for NCCL); with one process nothing moves."""

    ERROR_BYTES = 1024
    TEXT_BYTES = 256

    def __init__(self):
        import torch.distributed as dist

        self._dist = dist
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.size = dist.get_world_size() if self.active else 1
        self.backend = str(dist.get_backend()) if self.active else None
        nccl = self.active and "nccl" in self.backend.lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather(self, t: Tensor) -> list[Tensor]:
        if not self.active:
            return [t]
        t = t.to(self.device).contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._dist.all_gather(parts, t)
        return [p.cpu() for p in parts]  # host sync: outside the timed region

    def _encode(self, text: str, nbytes: int) -> Tensor:
        data = text.encode()[:nbytes]
        t = torch.zeros(nbytes, dtype=torch.long)
        t[: len(data)] = torch.tensor(list(data), dtype=torch.long)
        return t

    @staticmethod
    def _decode(t: Tensor) -> str:
        return bytes(t.tolist()).rstrip(b"\0").decode(errors="replace")

    def failures(self, error: str | None) -> list[tuple[int, str]]:
        """Every process's error of the step all of them just took: [(rank, error)], [] when none failed."""
        if not self.active:
            return [] if error is None else [(0, error)]
        status = torch.cat([torch.tensor([int(error is not None)]), self._encode(error or "", self.ERROR_BYTES)])
        return [(r, self._decode(p[1:])) for r, p in enumerate(self.all_gather(status)) if p[0]]

    def describe(self, failures: list[tuple[int, str]]) -> str:
        if self.size == 1:
            return failures[0][1]
        return "; ".join(f"rank {r}: {text}" for r, text in failures)

    def gather_text(self, text: str) -> list[str]:
        return (
            [self._decode(p) for p in self.all_gather(self._encode(text, self.TEXT_BYTES))] if self.active else [text]
        )

    def gather_records(self, records: Sequence[dict], fields: Sequence[str]) -> list[list[dict]]:
        """Every process's records (the same count on each), as a float64 vector per record (None as NaN)."""
        if not self.active:
            return [list(records)]
        t = torch.tensor(
            [[math.nan if r.get(f) is None else float(r[f]) for f in fields] for r in records], dtype=torch.float64
        ).reshape(len(records), len(fields))
        out = []
        for part in self.all_gather(t):
            rows = []
            for row in part.tolist():
                rows.append(
                    {f: None if math.isnan(v) else int(v) if f in INT_FIELDS else v for f, v in zip(fields, row)}
                )
            out.append(rows)
        return out

    def combine_agreement(self, pairs: dict[str, bool | None]) -> dict[str, bool | None]:
        """Per pair: False if it is False on any process (comparability is the same on all)."""
        if not self.active or not pairs:
            return pairs
        codes = torch.tensor([-1 if v is None else int(v) for v in pairs.values()], dtype=torch.long)
        parts = torch.stack(self.all_gather(codes))
        return {k: None if int(parts[:, i].min()) < 0 else bool(parts[:, i].min()) for i, k in enumerate(pairs)}

    def device_description(self, device: torch.device, name: str) -> list[str]:
        """Per process: its device, the device's name and the host."""
        return self.gather_text(f"{device} ({name}) on {socket.gethostname()}")


def merge_ranks(per_rank: Sequence[Sequence[dict]]) -> list[dict]:
    """One record per iteration from every process's iterations of one mode (WORLD_NOTE): the profile of
    the process with the largest total_ms (`slowest_rank`), with generated_tokens summed over the
    processes and tokens_per_second = that sum / the slowest total."""
    merged = []
    for its in zip(*per_rank, strict=True):
        slowest = max(range(len(its)), key=lambda r: its[r]["total_ms"])
        m = dict(its[slowest], slowest_rank=slowest)
        m["generated_tokens"] = sum(it["generated_tokens"] for it in its)
        m["tokens_per_second"] = m["generated_tokens"] / (m["total_ms"] / 1e3) if m["total_ms"] > 0 else 0.0
        merged.append(m)
    return merged
