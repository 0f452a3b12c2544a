"""The ways of reading a prompt's blocks in a decode step, on the same pool, beside the dense buffer:

  copy      each row reads its prompt's blocks through its own table (N reads of the prompt a step)
  prefix    the prompt's whole blocks read once for its N rows' stacked queries, each row's own keys after
            them, merged by log-sum-exp
  gathered  "prefix" with the whole blocks gathered through the tables each step (a copy) instead of viewed
            in place where `PagedStore.place_prompts` laid them out: what the view saves
  paged     the default: "prefix" from `PagedLayout.stacked_tokens` tokens of whole blocks, "copy" below
  expanded  the expanded baseline (every row prefilled alone into blocks of its own in the same pool, read
            through its table): no sharing, the reference

A model of a named shape with random weights, B prompts x N samples of P tokens, R new tokens each (no EOS:
every row decodes R - 1 steps, so the step's cost is what is compared); the modes alternate (A B C A B C
...) after a warm-up round, each call's decode ms per step from its profile; medians, and each mode's ratio
to the first mode's. The same seed in every mode: the tokens agree (printed).

    .venv/bin/python benchmarks/bench_stacked_prompts.py --model-shape llama-small --batch 1 --samples 16 \\
        --prompt 2048 --new-tokens 32 --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from unittest import mock

import torch

from torchkvops import Rollout, RolloutConfig
from torchkvops.models.shapes import MODEL_SHAPES, build_model
from torchkvops.rollout.paged_store import PagedStore

MODES = ("copy", "prefix", "gathered", "paged", "expanded")


def run(model, mode: str, ids: torch.Tensor, samples: int, new_tokens: int) -> tuple[float, torch.Tensor]:
    """One call's decode ms per step and its responses."""
    config = RolloutConfig(
        samples_per_prompt=samples,
        max_new_tokens=new_tokens,
        kv_sharing={"expanded": "copy", "gathered": "prefix"}.get(mode, mode),
        shared_prefill=mode != "expanded",
        temperature=1.0,
        seed=0,
        eos_token_id=[],
        enable_profiling=True,
    )
    rollout = Rollout(model, config)
    gathered = mock.patch.object(PagedStore, "prompts_in_place", lambda *args: False)
    with gathered if mode == "gathered" else contextlib.nullcontext():
        out = rollout.generate(ids, torch.ones_like(ids))
    profile = rollout.get_last_profile()
    return profile.decode_ms / max(profile.decode_steps, 1), out.responses


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default="llama-small", choices=sorted(MODEL_SHAPES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=MODES, default=["copy", "prefix", "expanded"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=None, help="a JSON file for every call's figures")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model = build_model(a.model_shape)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (a.batch, a.prompt), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {m: [] for m in a.modes}
    tokens: dict[str, torch.Tensor] = {}
    for r in range(a.rounds + 1):  # round 0: the warm-up
        for mode in a.modes:
            ms, responses = run(model, mode, ids, a.samples, a.new_tokens)
            tokens.setdefault(mode, responses)
            if r:
                times[mode].append(ms)
    base = statistics.median(times[a.modes[0]])
    print(
        f"{a.model_shape}, B={a.batch} x N={a.samples}, P={a.prompt}, R={a.new_tokens}, "
        f"threads {torch.get_num_threads()}, medians of {a.rounds} interleaved rounds"
    )
    print(f"{'mode':<15}{'decode ms/step':>16}{'vs ' + a.modes[0]:>18}   rounds")
    for mode in a.modes:
        med = statistics.median(times[mode])
        rounds = ", ".join(f"{t:.2f}" for t in times[mode])
        print(f"{mode:<15}{med:>16.2f}{med / base:>17.2f}x   {rounds}")
    same = all(torch.equal(tokens[m], tokens[a.modes[0]]) for m in a.modes)
    print("tokens: " + ("the same in every mode" if same else "DIFFER between modes"))
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"args": vars(a), "decode_ms_per_step": times, "same_tokens": same}, f, indent=1)


if __name__ == "__main__":
    main()
