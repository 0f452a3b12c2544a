"""Decode of a LoRA model: adapters merged for the call (`merge_lora=True`, models.lora) vs PEFT's
unmerged adapters (`merge_lora=False`) vs the same model without adapters.

One process, a model of a torchkvops.bench shape with random weights; LoRA of rank --rank (random B, so
that the adapters change the tokens) on every linear layer of the decoder. Each mode generates N greedy
rows for each of B prompts (N copies in a row, prefilled once; no EOS: R tokens each) with
`torchkvops.generate`; the modes run interleaved (no_adapter, unmerged, merged, no_adapter, ...) for
--rounds rounds after a warm-up. Prints per mode the median decode ms per step (RolloutProfile's
decode_ms / decode_steps), the median whole call, the merge's ms and bytes, and whether the merged
tokens equal the unmerged ones; and checks that every parameter is bit-identical after the merged
calls. On this CPU:

    .venv/bin/python benchmarks/bench_lora_rollout.py --rounds 7 --output out/lora_rollout.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model

import torchkvops
from torchkvops.models import build_model

MODES = ("no_adapter", "unmerged", "merged")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="llama-small")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank r")
    p.add_argument("--prompts", type=int, default=2, help="B")
    p.add_argument("--samples", type=int, default=4, help="N")
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--response-length", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--output", default=None)
    args = p.parse_args()

    plain = build_model(args.model_shape)
    torch.manual_seed(1)
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", init_lora_weights=False)
    lora = get_peft_model(build_model(args.model_shape), config).eval()
    models = {"no_adapter": plain, "unmerged": lora, "merged": lora}
    before = {n: t.detach().clone() for n, t in lora.named_parameters()}

    g = torch.Generator().manual_seed(100)
    vocab = plain.config.vocab_size
    ids = torch.randint(3, vocab, (args.prompts, args.prompt_length), generator=g).repeat_interleave(args.samples, 0)
    kwargs = dict(max_new_tokens=args.response_length, do_sample=False, eos_token_id=None, pad_token_id=0)
    per_step: dict[str, list[float]] = {m: [] for m in MODES}
    total: dict[str, list[float]] = {m: [] for m in MODES}
    record: dict[str, dict] = {}
    for round_ in range(args.warmup + args.rounds):
        for mode in MODES:
            with torchkvops.patch_generate(models[mode], merge_lora=mode == "merged") as handle:
                start = time.perf_counter()
                tokens = models[mode].generate(ids, **kwargs)
                elapsed = (time.perf_counter() - start) * 1e3
                profile = handle.last_profile()
            if round_ >= args.warmup:
                per_step[mode].append(profile.decode_ms / profile.decode_steps)
                total[mode].append(elapsed)
                record[mode] = {"merge_ms": profile.merge_ms, "merged_layers": profile.merged_lora_layers}
                record[mode]["tokens"] = tokens
    merged_bytes = sum(m.base_layer.weight.nbytes for m in lora.modules() if hasattr(m, "lora_A"))
    identical = all(torch.equal(t, before[n]) for n, t in lora.named_parameters())
    result = {"args": vars(args), "parameters_bit_identical_after": identical, "modes": {}}
    base = statistics.median(per_step["no_adapter"])
    for mode in MODES:
        step = statistics.median(per_step[mode])
        result["modes"][mode] = {
            "decode_ms_per_step": step,
            "decode_ms_per_step_all": per_step[mode],
            "call_ms": statistics.median(total[mode]),
            "vs_no_adapter": step / base,
            "merge_ms": record[mode]["merge_ms"],
            "merged_layers": record[mode]["merged_layers"],
            "merged_bytes": merged_bytes if mode == "merged" else 0,
        }
        print(
            f"{mode:>10}: decode {step:7.2f} ms/step ({step / base:.3f}x no adapter)  call "
            f"{result['modes'][mode]['call_ms']:8.1f} ms  merge {record[mode]['merge_ms']:6.1f} ms "
            f"({record[mode]['merged_layers']} layers)"
        )
    same = bool(torch.equal(record["merged"]["tokens"], record["unmerged"]["tokens"]))
    result["merged_tokens_equal_unmerged"] = same
    print(f"merged tokens equal unmerged: {same}; parameters bit-identical after the merged calls: {identical}")
    if args.output:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
