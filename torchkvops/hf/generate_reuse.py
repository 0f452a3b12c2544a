"""What `patch_generate` keeps from one served call for the next: multi-turn calls that prefill only what
a turn appends.

An agent loop (TRL's GRPOTrainer with `tools=`, an environment) calls `generate` again on the rows that
made a tool call, each row its prompt, its completion through EOS and the tool's answer, left-padded.
`KeptCall` remembers the rollout of the last served call and, for each of its rows, the tokens after
padding (prompt and history through EOS). A new call whose every row begins with a distinct kept row's
tokens is served by `Rollout.extend` on that rollout: only the tokens after the kept ones are prefilled.

Never stale: the kept state is used only if the model's weights are what they were when it was made.
`weights_fingerprint` reads every parameter and buffer: where it lives and its version counter (which
an optimizer step, `load_state_dict` and any in-place op bump), its dtype and shape, a checksum of its
values (sum and sum of squares, which catch writes through `.data` that bump no version), and the PEFT
adapters active. One read of the weights per served call, about a decode step's weight traffic, and
one host sync. Anything the session checks (`hf.model_state`) that changes releases the session's
rollouts, and the kept call with them.

Memory: the kept KV is the last served call's rollout's own buffers, which the session keeps between
calls anyway (at most _MAX_ROLLOUTS rollouts); what is added is each row's token ids and a [rows, keys]
bool mask. `GeneratePatch.release()` frees it all; `patch_generate(model, reuse_kv=False)` turns this off.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ..rollout.engine import Rollout


def weights_fingerprint(model: nn.Module, adapter_state: tuple) -> tuple:
    """What the rollout's KV was computed from (module docstring): equal before and after only if no
    weight changed. The checksums accumulate in float32 without a copy of any weight."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.numel()]
    where = tuple((t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for t in tensors)
    by_device: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    checksums = []
    with torch.no_grad():
        for group in by_device.values():  # one host sync per device
            sums = [torch.stack([t.sum(dtype=torch.float32), torch.linalg.vector_norm(t).float()]) for t in group]
            checksums.extend(torch.stack(sums).flatten().tolist())
    return where, tuple(checksums), adapter_state


@dataclasses.dataclass
class Match:
    """How a call extends the kept rows: call row i continues rollout row `rows[i]` with `appended[i]`."""

    rows: list[int]
    appended: list[Tensor]


class KeptCall:
    """The last served call's rollout and its rows' tokens (module docstring)."""

    def __init__(self, rollout: Rollout, settings: tuple, candidates: list[int], fingerprint: tuple):
        self.rollout, self.settings, self.fingerprint = rollout, settings, fingerprint
        self.candidates = candidates  # the rollout's rows that are rows of a call (not filler rows)
        history = rollout._history
        self.output = history.output
        # tokens -> the rows that hold them (rows with equal histories hold equal KV: any one serves)
        self.rows: dict[tuple[int, ...], list[int]] = {}
        for r in candidates:
            prompt = history.prompts[r][history.prompt_mask[r // rollout.config.samples_per_prompt].bool()]
            self.rows.setdefault(tuple(torch.cat([prompt, history.tokens[r]]).tolist()), []).append(r)
        self.lengths = sorted({len(k) for k in self.rows}, reverse=True)

    def is_current(self) -> bool:
        """Whether the rollout still holds this call's KV (no other call, no release since)."""
        history = self.rollout._history
        return history is not None and history.output is self.output

    def match(self, input_ids: Tensor, attention_mask: Tensor) -> Match | None:
        """The kept rows that the call's rows extend, each a distinct one, or None when some row extends
        none (its tokens after padding do not begin with a kept row's). Where several kept rows would do,
        the longest kept history is taken."""
        ids = input_ids.tolist()
        real = attention_mask.bool().tolist()  # left-padded (the contract checked it)
        rows, appended, taken = [], [], set()
        for row_ids, row_real in zip(ids, real):
            tokens = tuple(t for t, keep in zip(row_ids, row_real) if keep)
            n = next((n for n in self.lengths if n <= len(tokens) and tokens[:n] in self.rows), None)
            free = [] if n is None else [r for r in self.rows[tokens[:n]] if r not in taken]
            if not free:
                return None
            taken.add(free[0])
            rows.append(free[0])
            appended.append(torch.tensor(tokens[n:], dtype=torch.long))
        return Match(rows, appended)
