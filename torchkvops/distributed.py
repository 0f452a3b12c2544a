"""Data-parallel rollouts on torch.distributed: each process generates its own prompts, and the samples
do not depend on the world size.

    torch.distributed.init_process_group(...)        # torchrun / accelerate launch set it up
    out = torchkvops.distributed.generate(rollout, my_prompts, my_mask)   # every process's samples

Each process passes ITS OWN prompts (a data loader's shard; shards may differ in size and prompt
length, and may be empty). A row's sampling key comes from its GLOBAL index (the rows of lower ranks
first, then its own), and the seed from rank 0, so every sample equals the one a single-process
`Rollout.generate` gives over all processes' prompts concatenated in rank order (left-padded to the
longest): greedy tokens exactly, seeded samples up to the floating-point rounding of different batch
shapes.

With `gather=True` every process receives the whole result in rank order: prompts left-padded to the
longest prompt with the pad id (`prompt_length` = that length), responses right-padded to the longest
response with the pad id and `response_mask` 0 there. With `gather=False`, its own result only. A
process with no prompts generates nothing and gets, with `gather=False`, an output with no rows.

Everything moves as tensors through the group's collectives (`all_gather` of padded tensors), on the
CPU for gloo and on the current CUDA device for NCCL. Before and after generating, the processes
exchange a status: if any of them failed (bad input, out of memory, ...), EVERY process raises a
RuntimeError naming the rank and its error, instead of waiting in a collective for a process that
will never come. The first status also carries each process's settings (the rollout configuration
fields that change the gathered result, the EOS and pad ids resolved from the model, and `gather`):
if they differ, EVERY process raises the same ValueError naming each field that differs and its value
on each rank, before anything is generated (a different N would otherwise abort gloo or hang NCCL, and
a different temperature silently mix two configurations in one result). A process that dies or never
calls leaves the others waiting until the group's timeout (`init_process_group(timeout=...)`), after
which torch.distributed raises.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import all_min, ended_everywhere, initialized
from .hf.call_weights import WeightOptions, call_weights
from .hf.sharded import is_sharded
from .rollout import Rollout, RolloutOutput

__all__ = ["generate", "initialized", "all_min", "ended_everywhere"]

# Bytes of an error message carried to the other processes.
_ERROR_BYTES = 2048
# Bytes of a process's settings (JSON) carried to the others; a longer EOS list is sent as its digest.
_SETTINGS_BYTES = 1024
# RolloutConfig fields the processes need not agree on: the seed is rank 0's whatever the others say;
# compile, CUDA graphs, profiling and compaction change no token, log-probability or collective.
LOCAL_FIELDS = frozenset({"seed", "compile", "cuda_graphs", "enable_profiling", "compact_finished_rows"})


def generate(
    rollout: Rollout,
    input_ids: Tensor | None,
    attention_mask: Tensor | None = None,
    *,
    group=None,
    gather: bool = True,
    gather_weights: str = "auto",
    gather_budget_bytes: int | None = None,
    merge_lora: bool = True,
) -> RolloutOutput:
    """Data-parallel `rollout.generate`: see the module docstring. Every process of `group` (default:
    the world) must call it, with the same rollout configuration. `gather_weights`, `gather_budget_bytes`
    and `merge_lora`: as patch_generate's (hf.call_weights), except that a model sharded with FSDP2 or
    ZeRO-3 is always gathered once ("auto" as "once"; "per_step" refused): each process decodes its own rows for
    as many steps as they need, so FSDP's per-step gathers would wait for processes that are done."""
    where = "torchkvops.distributed.generate"
    if not isinstance(rollout, Rollout):
        raise TypeError(f"{where}: rollout must be a Rollout, got {type(rollout).__name__}")
    weights = WeightOptions(gather_weights, gather_budget_bytes, merge_lora).check(where)
    sharded = is_sharded(rollout.model)
    if sharded and gather_weights == "auto":
        weights = dataclasses.replace(weights, gather_weights="once")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torchkvops.distributed.generate: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first (torchrun sets up its environment)"
        )
    exchange = _Exchange(group, rollout.device)
    n = rollout.config.samples_per_prompt

    # 1. Every process's batch size, prompt length and seed (rank 0's is used), or its error; and its settings.
    local = None
    try:
        if sharded and gather_weights == "per_step":
            raise ValueError(
                f"{where}: gather_weights='per_step' cannot serve a sharded model (processes decode "
                "different numbers of steps, and each step's gather waits for all of them); use 'auto' or 'once'"
            )
        input_ids, attention_mask = _local_inputs(input_ids, attention_mask)
        seed = rollout.config.seed if rollout.config.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        local = (input_ids.shape[0], input_ids.shape[1], seed)
    except Exception as e:  # noqa: BLE001 - reported to every process below
        exchange.fail(e)
    batches, prompt_lengths, seeds = exchange.gather_status(
        local, "checking its prompts", settings=_settings(rollout, gather, weights)
    )
    rank = exchange.rank
    first_row = sum(batches[:rank]) * n
    seed = seeds[0]

    # 2. Gather a sharded model's weights (a collective every process joins, prompts or not), generate
    # locally (no collective inside), then every process's response length, or its error.
    out = None
    try:
        with call_weights(rollout.model, weights):
            if batches[rank]:
                rows = torch.arange(first_row, first_row + batches[rank] * n, device=rollout.device)
                out = rollout.generate_rows(input_ids, attention_mask, row_ids=rows, seed=seed)
    except Exception as e:  # noqa: BLE001
        exchange.fail(e)
    status = None if exchange.error else (0 if out is None else out.responses.shape[1], 0, 0)
    response_lengths, _, _ = exchange.gather_status(status, "generating")

    if not gather:
        return out if out is not None else _empty(rollout, input_ids.shape[1])
    return _gather(exchange, rollout, out, [b * n for b in batches], max(prompt_lengths), max(response_lengths))


def _settings(rollout: Rollout, gather: bool, weights: WeightOptions) -> dict:
    """What every process must agree on: every RolloutConfig field except those that change no token,
    log-probability or collective (LOCAL_FIELDS), the EOS and pad ids as the rollout resolved them from
    its model, `gather` (a process that does not gather would leave the others waiting in the
    collective) and how the weights are gathered (a process that gathers joins collectives the others
    would not). Read from the config's fields, so that a field added later is checked too."""
    c = rollout.config
    eos: list[int] | str = sorted(set(rollout.eos_ids))
    if len(json.dumps(eos)) > _SETTINGS_BYTES // 2:
        eos = f"{len(eos)} ids, sha256 {hashlib.sha256(json.dumps(eos).encode()).hexdigest()[:16]}"
    settings = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in LOCAL_FIELDS}
    settings.update(
        temperature=float(c.temperature),
        top_p=float(c.top_p),
        eos_token_id=eos,
        pad_token_id=rollout.pad_id,
        gather=bool(gather),
        gather_weights=weights.gather_weights,
    )
    if c.lm_head_dtype is not None:
        settings["lm_head_dtype"] = str(c.lm_head_dtype)
    return settings


def _settings_mismatch(settings: list[dict]) -> str | None:
    """'field: value on rank(s) ...; value on rank(s) ...' for each field whose value differs, or None."""
    differing = []
    for name in settings[0]:
        ranks_by_value: dict[str, list[int]] = {}
        for rank, values in enumerate(settings):
            ranks_by_value.setdefault(json.dumps(values.get(name)), []).append(rank)
        if len(ranks_by_value) > 1:
            parts = [
                f"{json.loads(value)!r} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                for value, ranks in ranks_by_value.items()
            ]
            differing.append(f"{name}: {'; '.join(parts)}")
    return " | ".join(differing) or None


def _local_inputs(input_ids, attention_mask) -> tuple[Tensor, Tensor | None]:
    if input_ids is None:
        return torch.zeros(0, 0, dtype=torch.long), None
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(
            "torchkvops.distributed.generate: input_ids must be a 2-D tensor [batch, prompt_length] "
            f"(or None for no prompts), got {getattr(input_ids, 'shape', type(input_ids).__name__)}"
        )
    return input_ids, attention_mask


def _empty(rollout: Rollout, prompt_length: int) -> RolloutOutput:
    z = torch.zeros(0, prompt_length, dtype=torch.long, device=rollout.device)
    r = torch.zeros(0, 0, dtype=torch.long, device=rollout.device)
    logprobs = r.float() if rollout.config.return_logprobs else None
    return RolloutOutput(z, r, r.clone(), prompt_length, logprobs)


def _gather(
    exchange: _Exchange,
    rollout: Rollout,
    out: RolloutOutput | None,
    rows: list[int],
    prompt_len: int,
    response_len: int,
) -> RolloutOutput:
    """all_gather of every process's rows, padded to the same shape, then the padding rows dropped."""
    pad = rollout.pad_id
    most = max(rows)
    sequences = torch.full((most, prompt_len + response_len), pad, dtype=torch.long, device=exchange.device)
    mask = torch.zeros(most, response_len, dtype=torch.long, device=exchange.device)
    if out is not None:
        r, p, resp = out.responses.shape[0], out.prompt_length, out.responses.shape[1]
        sequences[:r, prompt_len - p : prompt_len] = out.sequences[:, :p].to(exchange.device)  # left-padded prompt
        sequences[:r, prompt_len : prompt_len + resp] = out.responses.to(exchange.device)  # right-padded response
        mask[:r, :resp] = out.response_mask.to(exchange.device)
    all_sequences = exchange.all_gather(sequences)
    all_masks = exchange.all_gather(mask)
    sequences = torch.cat([s[:r] for s, r in zip(all_sequences, rows)]).to(rollout.device)
    mask = torch.cat([m[:r] for m, r in zip(all_masks, rows)]).to(rollout.device)
    logprobs = None
    if rollout.config.return_logprobs:  # right-padded with 0, as the responses with the pad id
        logprobs = torch.zeros(most, response_len, dtype=torch.float32, device=exchange.device)
        if out is not None:
            logprobs[:r, :resp] = out.logprobs.to(exchange.device)
        logprobs = torch.cat([lp[:r] for lp, r in zip(exchange.all_gather(logprobs), rows)]).to(rollout.device)
    return RolloutOutput(sequences, sequences[:, prompt_len:], mask, prompt_len, logprobs)


class _Exchange:
    """The collectives of one call: statuses (three ints, an error message and the settings per process)
    and padded tensors, on the device the group's backend works on."""

    def __init__(self, group, rollout_device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend:
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu") if "gloo" in backend or rollout_device.type == "cpu" else rollout_device
        self.error: str | None = None

    def fail(self, e: BaseException) -> None:
        self.error = f"{type(e).__name__}: {' '.join(str(e).split())}"

    def all_gather(self, t: Tensor) -> list[Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return parts

    def gather_status(
        self, values: tuple[int, int, int] | None, stage: str, settings: dict | None = None
    ) -> tuple[list[int], list[int], list[int]]:
        """Every process's (a, b, c), or raise on every process if any process failed or, given
        `settings`, if the processes' settings differ."""
        message = (self.error or "").encode()[:_ERROR_BYTES]
        sent = json.dumps(settings).encode() if settings is not None else b""
        status = torch.zeros(4 + _ERROR_BYTES + _SETTINGS_BYTES, dtype=torch.long, device=self.device)
        status[0] = 1 if self.error else 0
        if not self.error and values is not None:
            status[1:4] = torch.tensor(values, dtype=torch.long)
        status[4 : 4 + len(message)] = torch.tensor(list(message), dtype=torch.long)
        status[4 + _ERROR_BYTES : 4 + _ERROR_BYTES + len(sent)] = torch.tensor(list(sent), dtype=torch.long)
        parts = torch.stack(self.all_gather(status)).cpu()  # host sync: the statuses, twice per call

        def text(r: int, start: int, end: int) -> str:
            return bytes(parts[r, start:end].tolist()).rstrip(b"\0").decode(errors="replace")

        failed = [r for r in range(self.world) if parts[r, 0]]
        if failed:
            r = failed[0]
            others = f" (and ranks {failed[1:]})" if len(failed) > 1 else ""
            raise RuntimeError(
                f"torchkvops.distributed.generate: rank {r}{others} failed while {stage}: "
                f"{text(r, 4, 4 + _ERROR_BYTES)}"
            )
        if settings is not None:
            end = 4 + _ERROR_BYTES + _SETTINGS_BYTES
            differing = _settings_mismatch([json.loads(text(r, 4 + _ERROR_BYTES, end)) for r in range(self.world)])
            if differing:
                raise ValueError(
                    f"torchkvops.distributed.generate: the processes' settings differ ({differing}); "
                    "every process must call it with the same RolloutConfig, model EOS and pad ids, "
                    "and gather"
                )
        return parts[:, 1].tolist(), parts[:, 2].tolist(), parts[:, 3].tolist()
