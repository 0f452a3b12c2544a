"""A row budget (RolloutConfig.max_rows) on the realistic length workload: the same prompts

  all      every row at once (the unbudgeted rollout, compacting as rows end)
  budget   max_rows rows, the rows of finished prompts refilled from the waiting ones
  chunks   sequential chunks of max_rows rows (what a user does today to fit memory), each unbudgeted
  hf       HF generate in the same chunks (num_return_sequences=N, sampling)

interleaved (all, budget, chunks, hf, all, ...) for --rounds rounds, on the bench's geometric lengths
(torchkvops.bench.lengths: EOS with probability 4/R at every step, lengths geometric with mean R/4,
capped at R). Per mode: the median tokens/s (generated tokens / the whole call's time), the useful
fraction of computed row-steps, the KV bytes the rollout's buffers held; and whether the tokens equal
`all`'s (budget and chunks sample every row with its global row's key, so they must). On this CPU:

    .venv/bin/python benchmarks/bench_row_budget.py --threads 2 --rounds 3 --output out/row_budget.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from torchkvops import Rollout, RolloutConfig
from torchkvops.bench import lengths
from torchkvops.models import build_model

MODES = ("all", "budget", "chunks", "hf")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="llama-small")
    p.add_argument("--prompts", type=int, default=8, help="B")
    p.add_argument("--samples", type=int, default=8, help="N")
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--response-length", type=int, default=256, help="R, the most tokens per row")
    p.add_argument("--max-rows", type=int, default=16)
    p.add_argument("--kv-sharing", choices=["copy", "prefix"], default="copy", help="the rollout's KV layout")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="JSON results")
    return p.parse_args()


def make_runners(args, model, ids, eos: int) -> dict:
    """Each mode as a function of the round's seed: (its outputs, its profiles; hf: tokens, None)."""
    n = args.samples
    per_chunk = args.max_rows // n
    config = dict(
        samples_per_prompt=n,
        max_new_tokens=args.response_length,
        temperature=1.0,
        eos_token_id=[eos],
        pad_token_id=0,
        enable_profiling=True,
        kv_sharing=args.kv_sharing,
    )
    unbudgeted = Rollout(model, RolloutConfig(**config))
    budgeted = Rollout(model, RolloutConfig(max_rows=args.max_rows, **config))

    def run_all(seed):
        out = unbudgeted.generate_rows(ids, None, seed=seed)
        return out, [unbudgeted.get_last_profile()]

    def run_budget(seed):
        out = budgeted.generate_rows(ids, None, seed=seed)
        return out, [budgeted.get_last_profile()]

    def run_chunks(seed):
        outs, profiles = [], []
        for start in range(0, args.prompts, per_chunk):
            chunk = ids[start : start + per_chunk]
            row_ids = torch.arange(start * n, (start + chunk.shape[0]) * n)  # each row keeps its global key
            outs.append(unbudgeted.generate_rows(chunk, None, row_ids=row_ids, seed=seed))
            profiles.append(unbudgeted.get_last_profile())
        return outs, profiles

    def run_hf(seed):
        torch.manual_seed(seed)
        generated = 0
        for start in range(0, args.prompts, per_chunk):
            with torch.no_grad():
                out = model.generate(
                    ids[start : start + per_chunk],
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    num_return_sequences=n,
                    max_new_tokens=args.response_length,
                    eos_token_id=eos,
                    pad_token_id=0,
                )
            new = out[:, args.prompt_length :]
            is_eos = new == eos
            generated += int(((is_eos.cumsum(dim=1) - is_eos.long()) == 0).sum())
        return generated, None

    return {"all": run_all, "budget": run_budget, "chunks": run_chunks, "hf": run_hf}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.model_shape, seed=args.seed)
    eos = model.config.eos_token_id if model.config.eos_token_id is not None else 2
    lengths.install(model, "geometric", eos, temperature=1.0)
    lengths.set_response_length(model, args.response_length)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(3, model.config.vocab_size, (args.prompts, args.prompt_length), generator=g)
    samples, same_tokens = run_rounds(args, make_runners(args, model, ids, eos))
    report(args, samples, same_tokens)


def run_rounds(args, runners: dict) -> tuple[dict, dict]:
    """The modes interleaved for --rounds rounds after a warm-up round: each round's record per mode, and
    whether budget's and chunks' tokens equal all's in every round."""
    samples: dict[str, list[dict]] = {m: [] for m in MODES}
    same_tokens = {"budget": True, "chunks": True}
    for round_ in range(args.rounds + 1):  # round 0: warm-up
        seed = args.seed + round_
        reference = None
        for mode in MODES:
            start = time.perf_counter()
            out, profiles = runners[mode](seed)
            ms = (time.perf_counter() - start) * 1e3
            if mode == "hf":
                record = {"ms": ms, "tokens": out, "useful_fraction": None, "kv_bytes": None}
            else:
                responses = [o.responses for o in (out if isinstance(out, list) else [out])]
                width = max(r.shape[1] for r in responses)
                padded = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in responses])
                if mode == "all":
                    reference = padded
                else:
                    w = min(width, reference.shape[1])
                    same_tokens[mode] &= torch.equal(padded[:, :w], reference[:, :w])
                useful = sum(p.useful_row_steps for p in profiles)
                computed = sum(p.computed_row_steps for p in profiles)
                record = {
                    "ms": ms,
                    "tokens": useful,
                    "useful_fraction": useful / computed,
                    "kv_bytes": max(p.kv_cache_bytes for p in profiles),
                    "refills": sum(p.refills for p in profiles),
                }
            if round_:
                samples[mode].append(record)
        print(
            f"round {round_}: " + ", ".join(f"{m} {samples[m][-1]['ms']:.0f} ms" for m in MODES)
            if round_
            else "warm-up done",
            flush=True,
        )

    return samples, same_tokens


def report(args, samples: dict, same_tokens: dict) -> None:
    """Each mode's medians, the ratios, and --output's JSON."""
    rows = args.prompts * args.samples
    result = {"args": vars(args), "rows": rows, "same_tokens_as_all": same_tokens, "modes": {}}
    for mode, records in samples.items():
        tps = statistics.median(r["tokens"] / (r["ms"] / 1e3) for r in records)
        result["modes"][mode] = {
            "tokens_per_s": tps,
            "ms": statistics.median(r["ms"] for r in records),
            "useful_fraction": records[0]["useful_fraction"],
            "kv_bytes": records[0]["kv_bytes"],
            "refills": records[0].get("refills"),
        }
    m = result["modes"]
    result["budget_over_chunks"] = m["budget"]["tokens_per_s"] / m["chunks"]["tokens_per_s"]
    result["budget_over_all"] = m["budget"]["tokens_per_s"] / m["all"]["tokens_per_s"]
    result["budget_over_hf_chunks"] = m["budget"]["tokens_per_s"] / m["hf"]["tokens_per_s"]
    result["kv_bytes_budget_over_all"] = m["budget"]["kv_bytes"] / m["all"]["kv_bytes"]
    print(f"{'mode':<7} {'tokens/s':>9} {'ms':>8} {'useful':>7} {'KV MiB':>7}")
    for mode, r in m.items():
        useful = "-" if r["useful_fraction"] is None else f"{r['useful_fraction']:.3f}"
        kv = "-" if r["kv_bytes"] is None else f"{r['kv_bytes'] / 2**20:.1f}"
        print(f"{mode:<7} {r['tokens_per_s']:>9.1f} {r['ms']:>8.0f} {useful:>7} {kv:>7}")
    for key in ("budget_over_chunks", "budget_over_all", "budget_over_hf_chunks", "kv_bytes_budget_over_all"):
        print(f"{key}: {result[key]:.3f}")
    print(f"same tokens as all: {same_tokens}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
