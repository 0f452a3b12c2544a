"""Operators dispatched per eager decode step: torchkvops' Rollout against Hugging Face generate.

Every ATen operator that reaches the dispatcher (a TorchDispatchMode sees it) is counted, except views
(`aten.view`, `aten.transpose`, `aten.slice`, ...: no kernel runs for them). A generation of R1 and one
of R2 new tokens are counted; the difference divided by R2 - R1 is the count of one decode step, with
prefill and set-up cancelling out. Greedy and temperature + top-k + top-p sampling, on an OPT-style
(multi-head) and a Llama-style (grouped-query) model with random weights, on the CPU.

    .venv/bin/python benchmarks/count_decode_ops.py [--layers 4] [--r1 8] [--r2 24]
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from torchkvops import Rollout, RolloutConfig


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.view_copy not in func.tags and not func.is_view:
            self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def build(family: str, layers: int):
    torch.manual_seed(0)
    if family == "opt":
        cfg = OPTConfig(
            vocab_size=1000,
            hidden_size=128,
            ffn_dim=256,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=512,
            word_embed_proj_dim=128,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=2,
        )
        return OPTForCausalLM(cfg).eval()
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


def count(fn) -> collections.Counter:
    with OpCounter() as counter:
        fn()
    return counter.counts


def per_step(make_fn, r1: int, r2: int) -> tuple[float, collections.Counter]:
    make_fn(r1)()  # warm-up (lazy inits outside the count)
    a, b = count(make_fn(r1)), count(make_fn(r2))
    diff = collections.Counter({k: b[k] - a[k] for k in b | a if b[k] != a[k]})
    return sum(diff.values()) / (r2 - r1), diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--r1", type=int, default=8)
    p.add_argument("--r2", type=int, default=24)
    p.add_argument("--detail", action="store_true", help="print the per-op difference of every case")
    args = p.parse_args()
    prompts = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    samplings = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_k=50, top_p=0.9)}
    print(
        f"decode ops per step ({args.layers} layers, B=2 prompts x N=4 samples, slope between R={args.r1} and R={args.r2})"
    )
    print("| model | sampling | torchkvops | HF generate | torchkvops / HF |")
    print("|---|---|---:|---:|---:|")
    for family in ("opt", "llama"):
        model = build(family, args.layers)
        for name, sampling in samplings.items():

            def ours(r, sampling=sampling):
                rollout = Rollout(
                    model, RolloutConfig(samples_per_prompt=4, max_new_tokens=r, eos_token_id=[], seed=0, **sampling)
                )
                return lambda: rollout.generate(prompts)

            def hf(r, sampling=sampling):
                kwargs = dict(max_new_tokens=r, min_new_tokens=r, eos_token_id=None, pad_token_id=0)
                if sampling["temperature"] == 0:
                    ids, kwargs = prompts.repeat_interleave(4, dim=0), dict(kwargs, do_sample=False)
                else:
                    ids, kwargs = prompts, dict(kwargs, do_sample=True, num_return_sequences=4, **sampling)
                return lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)

            with torch.inference_mode():
                n_ours, d_ours = per_step(ours, args.r1, args.r2)
                n_hf, d_hf = per_step(hf, args.r1, args.r2)
            print(f"| {family} | {name} | {n_ours:.1f} | {n_hf:.1f} | {n_ours / n_hf:.2f} |")
            if args.detail:
                print("  torchkvops:", dict(sorted(d_ours.items(), key=lambda kv: -kv[1])))
                print("  HF:", dict(sorted(d_hf.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
