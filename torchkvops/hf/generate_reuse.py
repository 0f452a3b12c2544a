"""What `patch_generate` keeps from one served call for the next: multi-turn calls that prefill only what
a turn appends.

An agent loop (TRL's GRPOTrainer with `tools=`, an environment) calls `generate` again on the rows that
made a tool call, each row its prompt, its completion through EOS and the tool's answer, left-padded.
`KeptCall` remembers the rollout of the last served call and, for each of its rows, the tokens after
padding (prompt and history through EOS). A new call whose every row begins with a distinct kept row's
tokens is served by `Rollout.extend` on that rollout: only the tokens after the kept ones are prefilled.

Never stale: the kept state is used only if everything its KV was computed from is what it was when it
was made. `kv_fingerprint` reads:
- every parameter and buffer: where it lives, its version counter (which an optimizer step,
  `load_state_dict` and any in-place op outside `.data` bump), dtype and shape, and a hash of its bits
  that depends on every element's value and position (`value_hashes`), which catches writes through
  `.data` that bump no version and keep the sum and norm (a permutation, a sign flip, one ulp);
- every module's plain attributes (bool, int, float, str, None: the training flag, dropout
  probabilities, epsilons, the rotary embedding's `attention_scaling`, an attention's `scaling`);
- the attention implementation of the config and its sub-configs, and the PEFT adapters active, merged
  or disabled, with their scales (`ModelAdapter.adapter_state`).
What it does not see: state the forward reads from elsewhere (a global, a config field other than the
attention implementation, a module attribute that is a container or an object, a hook), which
`patch_generate(model, reuse_kv=False)` covers. One read of the weights per served call (cost:
docs/benchmarks.md) and one host sync per device. Anything the session checks (`models.model_state`) that
changes releases the session's rollouts, and the kept call with them.

Memory: the kept KV is the last served call's rollout's own buffers, which the session keeps between
calls anyway (at most _MAX_ROLLOUTS rollouts); what is added is each row's token ids and a [rows, keys]
bool mask. `GeneratePatch.release()` frees it all; `patch_generate(model, reuse_kv=False)` turns this off.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ..rollout import Rollout

# The hash of a tensor's bits: its bytes as 32-bit words w_i, and per chunk of _CHUNK words the sum of
# (w_i ^ a_i) * b_i, all mod 2^32 (a_i, b_i: fixed pseudo-random words, b_i odd). A change of any one
# word changes its term ((w ^ a) is a bijection, and an odd b is invertible mod 2^32) and so its chunk's
# sum: single-element edits are always seen. A permutation is missed only when its terms cancel (about
# 2^-32 for pseudo-random a and b). int32 products and sums wrap, as two's complement does on every
# device torch runs on (tests/test_generate_reuse.py checks it); an int32 sum is also 13x faster than
# an int64 one on a CPU. Chunks stay small enough to be hashed in cache, in one scratch buffer.
_CHUNK = 1 << 18
_HASH_SEED = 0x6B76_7370
_mixers: dict[torch.device, tuple[Tensor, Tensor]] = {}


def _mixer(device: torch.device) -> tuple[Tensor, Tensor]:
    """(a, b): [_CHUNK] int32 each, the same on every device and in every process; b odd."""
    if device not in _mixers:
        g = torch.Generator().manual_seed(_HASH_SEED)
        a, b = torch.randint(-(2**31), 2**31, (2, _CHUNK), dtype=torch.int64, generator=g)
        _mixers[device] = (a.to(torch.int32).to(device), (b | 1).to(torch.int32).to(device))
    return _mixers[device]


def _words(t: Tensor) -> Tensor:
    """t's bytes as 32-bit words (1-D int32): a view when its bytes allow, else its bytes widened."""
    raw = t.detach().reshape(-1).view(torch.uint8)
    if raw.numel() % 4 == 0 and raw.storage_offset() % 4 == 0:
        return raw.view(torch.int32)
    return raw.to(torch.int32)


def value_hashes(tensors: list[Tensor]) -> list[Tensor]:
    """One int32 0-d tensor per chunk of _CHUNK words of each tensor (tensors on one device), in order:
    equal before and after only if no element changed its bits or place (up to a 2^-32 chance for a
    permutation). No host sync."""
    if not tensors:
        return []
    device = tensors[0].device
    a, b = _mixer(device)
    scratch = torch.empty(_CHUNK, dtype=torch.int32, device=device)
    hashes = []
    with torch.no_grad():
        for t in tensors:
            words = _words(t)
            for start in range(0, words.numel(), _CHUNK):
                chunk = words[start : start + _CHUNK]
                n = chunk.numel()
                mixed = torch.bitwise_xor(chunk, a[:n], out=scratch[:n]).mul_(b[:n])
                hashes.append(mixed.sum(dtype=torch.int32))
    return hashes


_PLAIN = (bool, int, float, str, type(None))


def module_attributes(model: nn.Module) -> tuple:
    """Every module's public plain attributes (bool, int, float, str, None), by module name: what a
    forward reads besides tensors (the training flag, dropout probabilities, epsilons, scalings)."""
    return tuple(
        (name, tuple((k, v) for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, _PLAIN)))
        for name, m in model.named_modules()
    )


def attention_implementations(model: nn.Module) -> tuple:
    """The attention implementation of the model's config and of each of its sub-configs."""
    config = getattr(model, "config", None)
    found = [getattr(config, "_attn_implementation", None)]
    for key in getattr(config, "sub_configs", {}) or {}:
        found.append((key, getattr(getattr(config, key, None), "_attn_implementation", None)))
    return tuple(found)


def kv_fingerprint(model: nn.Module, adapter_state: tuple) -> tuple:
    """What the rollout's KV was computed from (module docstring): equal before and after only if none of
    it changed. One host sync per device the weights are on."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.numel()]
    where = tuple((t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for t in tensors)
    by_device: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    hashes = []
    for group in by_device.values():  # one host sync per device
        hashes.extend(torch.stack(value_hashes(group)).tolist())
    return where, tuple(hashes), module_attributes(model), attention_implementations(model), adapter_state


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
        history = rollout.history
        self.output = history.output
        # tokens -> the rows that hold them (rows with equal histories hold equal KV: any one serves)
        self.rows: dict[tuple[int, ...], list[int]] = {}
        for r in candidates:
            prompt = history.prompts[r][history.prompt_mask[r // rollout.config.samples_per_prompt].bool()]
            self.rows.setdefault(tuple(torch.cat([prompt, history.tokens[r]]).tolist()), []).append(r)
        self.lengths = sorted({len(k) for k in self.rows}, reverse=True)

    def is_current(self) -> bool:
        """Whether the rollout still holds this call's KV (no other call, no release since)."""
        history = self.rollout.history
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
