"""A short GRPO run with TRL's GRPOTrainer and a tool, with torchkvops in the two places a multi-turn GRPO
step spends its time:

    torchkvops.patch_generate(model)            # generation: each prompt prefilled once, and each tool
                                                # turn prefills only what it appends
    torchkvops.patch_forward(model)             # the loss pass: each shared prefix computed once

With `tools=[multiply]`, TRL's tool loop (GRPOTrainer._tool_call_loop) parses each completion; for the rows
that called a tool it runs the tool and calls `model.generate` again on prompt + completion + the tool's
answer (the chat template's tool turn), up to max_tool_calling_iterations times. Each such row begins
with a row of the call before, through its EOS: the patched generate serves the call from the KV it kept
(torchkvops.hf.generate_reuse) and prefills only the appended tokens. The script prints, per generate
call TRL made, its rows, their tokens (padding excluded), and from `handle.last_profile()` the positions
its prefill computed (`prefill_tokens`) and those whose KV came from the call before (`reused_tokens`);
then what patch_forward shared.

Everything is built in memory, nothing is downloaded:
- a byte-level tokenizer (each byte one token, so any text round-trips) with Qwen3's chat template,
  which TRL knows how to parse tool calls from (trl.chat_template_utils.add_response_schema), and added
  tokens for the generation prompt and the three pieces of one tool call:
  "<tool_call>\\n", '{"name": "multiply", "arguments": {"a": 3, "b": 4}}', "\\n</tool_call>";
- a tiny random Llama whose embeddings and LM head make it follow a chain with a huge logit margin: the
  generation prompt's last token -> the three pieces -> EOS. Its layers are random (default init) and
  add too little to the residual stream to move the argmax, so even sampling at temperature 1 calls
  multiply(3, 4) at every turn;
- a few questions about 3 x 4 as conversational prompts, and a reward for an answer of 12 from the tool.

Every completion of a prompt is then the same: GRPO's advantages are 0 and the weights do not move (this
is a demonstration of the turns, not of learning). On CPU (9 s on this project's 2-core machine, 2026-12-07):

    .venv/bin/python examples/grpo_trl_tools.py
    .venv/bin/python examples/grpo_trl_tools.py --max-tool-calling-iterations 4 --max-completion-length 256
    .venv/bin/python examples/grpo_trl_tools.py --no-reuse-kv   # every turn prefilled anew, to compare

TRL's output_dir is --output-dir (default out/grpo_trl_tools); with save_strategy "no" nothing is saved.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from datasets import Dataset
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_chat_template

import torchkvops

PAD, IM_START, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
GENERATION_PROMPT = "<|im_start|>assistant\n"  # how Qwen3's template ends a prompt (add_generation_prompt)
TOOL_CALL = ("<tool_call>\n", '{"name": "multiply", "arguments": {"a": 3, "b": 4}}', "\n</tool_call>")
QUESTIONS = (
    "What is 3 times 4?",
    "Multiply 3 by 4.",
    "Please compute 3 * 4 for me.",
    "3 x 4?",
    "I need the product of 3 and 4; use the tool.",
    "How much is three times four?",
    "Give me 3 multiplied by 4.",
    "Use multiply on 3 and 4, then tell me the result.",
)
LOGIT_SCALE = 50.0  # the chain's logit margin is about LOGIT_SCALE * sqrt(hidden_size)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges (ids 0-255: the bytes; decode gives back the exact text), the chat
    template's special tokens, then the generation prompt and the tool call's pieces as added tokens
    (matched before the bytes, longest first: "<|im_start|>assistant\\n" is one token)."""
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, IM_START, EOS)])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in (GENERATION_PROMPT, *TOOL_CALL)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS, chat_template=qwen3_chat_template
    )


def chain_ids(tokenizer) -> list[int]:
    """The tokens the model follows, each to the next: the generation prompt's last, the call, EOS."""
    return tokenizer.convert_tokens_to_ids([GENERATION_PROMPT, *TOOL_CALL, EOS])


def build_model(tokenizer, hidden_size: int = 32, layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama (default init) whose embeddings and LM head make a bigram model on the chain: the
    chain's k-th token embeds as sqrt(hidden) * e_k (basis vector k; the other tokens' embeddings are
    random in the other dimensions) and the LM head's row for the (k+1)-th is LOGIT_SCALE * e_k (every
    other row is 0). The layers' default-init output is a few percent of the residual stream."""
    chain = chain_ids(tokenizer)
    if hidden_size <= len(chain):
        raise ValueError(f"hidden_size must exceed the chain's {len(chain)} tokens, got {hidden_size}")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    embed = torch.randn(len(tokenizer), hidden_size, generator=generator)
    embed[:, : len(chain)] = 0
    head = torch.zeros(len(tokenizer), hidden_size)
    for k, token in enumerate(chain):
        embed[token] = 0
        embed[token, k] = hidden_size**0.5
        if k + 1 < len(chain):
            head[chain[k + 1], k] = LOGIT_SCALE
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
    return model


def build_dataset(num_prompts: int) -> Dataset:
    """Conversational prompts (a list of messages each: TRL renders them with the tools' schemas)."""
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(num_prompts)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions]})


def tool_answered_12(completions, **kwargs) -> list[float]:
    """1 for a completion in which the tool answered 12 (each completion is a list of messages)."""
    return [float(any(m["role"] == "tool" and m["content"] == "12" for m in messages)) for messages in completions]


def grpo_config(args, output_dir: str) -> GRPOConfig:
    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=args.seed,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )


def record_calls(model, handle, trainer) -> list[dict]:
    """Wrap model.generate: for each call TRL makes, its step, rows, real tokens, wall time and profile."""
    calls: list[dict] = []
    generate = model.generate

    def recorded(*args, **kwargs):
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        ms = (time.perf_counter() - start) * 1e3
        mask = kwargs["attention_mask"]
        step = trainer.state.global_step + 1
        turn = sum(c["step"] == step for c in calls)
        calls.append(
            dict(step=step, turn=turn, rows=mask.shape[0], tokens=int(mask.sum()), ms=ms, profile=handle.last_profile())
        )
        return out

    model.generate = recorded
    return calls


def table(calls: list[dict]) -> str:
    header = ("step", "turn", "rows", "row tokens", "prefill tokens", "reused tokens", "generate ms")
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for c in calls:
        p = c["profile"]
        prefill, reused = ("fell back", "-") if p is None else (p.prefill_tokens, p.reused_tokens)
        cells = (c["step"], c["turn"], c["rows"], c["tokens"], prefill, reused, f"{c['ms']:.0f}")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="GRPO optimizer steps")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="per-device train batch size, in completions (a multiple of N)"
    )
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt (N)")
    parser.add_argument("--max-tool-calling-iterations", type=int, default=2, help="tool turns after the first")
    parser.add_argument(
        "--max-completion-length",
        type=int,
        default=160,
        help="completion budget, tool answers included (each turn adds about 50 tokens)",
    )
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--no-reuse-kv", action="store_true", help="patch_generate(model, reuse_kv=False)")
    parser.add_argument("--output-dir", default=os.path.join("out", "grpo_trl_tools"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads, 0 for torch's default")
    args = parser.parse_args(argv)
    if args.batch_size % args.num_generations:
        parser.error(
            f"--batch-size ({args.batch_size}) must be a multiple of --num-generations ({args.num_generations})"
        )
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes, from TRL's calls

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.hidden_size, args.layers, args.seed)
    handle = torchkvops.patch_generate(model, reuse_kv=not args.no_reuse_kv)  # <- the two lines that differ
    forward = torchkvops.patch_forward(model)  # <- from a plain TRL script
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=tool_answered_12,
        args=grpo_config(args, args.output_dir),
        train_dataset=build_dataset(max(8, args.steps * args.batch_size // args.num_generations)),
        processing_class=tokenizer,
        tools=[multiply],
    )
    calls = record_calls(model, handle, trainer)
    print(
        f"--- GRPO with tools=[multiply]: {args.steps} steps of {args.batch_size // args.num_generations} prompts "
        f"x {args.num_generations} completions, up to {args.max_tool_calling_iterations} tool turns, "
        f"reuse_kv={not args.no_reuse_kv}",
        flush=True,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainer.train()
    ours = ("torchkvops.generate:", "torchkvops.patch_forward:")
    fallbacks = sorted({str(w.message) for w in caught if str(w.message).startswith(ours)})
    for w in caught:
        if not str(w.message).startswith(ours):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)

    print("turn 0 is each step's first call (prompts only); turns 1+ are TRL's tool turns")
    print(table(calls))
    for step in sorted({c["step"] for c in calls}):
        turns = [c for c in calls if c["step"] == step and c["turn"] > 0 and c["profile"] is not None]
        if turns:
            prefill, total = sum(c["profile"].prefill_tokens for c in turns), sum(c["tokens"] for c in turns)
            print(f"step {step} tool turns: prefilled {prefill} of their rows' {total} tokens ({prefill / total:.1%})")
    logs = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry]
    print("tool calls per completion, per step: " + ", ".join(f"{e['tools/call_frequency']:g}" for e in logs))
    print("mean reward per step: " + ", ".join(f"{e['reward']:.3f}" for e in logs))
    stats = forward.stats
    print(
        f"shared forward: {stats.shared_calls} passes shared, {stats.fallback_calls} fell back, "
        f"{stats.computed_tokens} of {stats.row_tokens} tokens computed"
    )
    for message in fallbacks:
        print(f"NOTE: some calls fell back: {message}")


if __name__ == "__main__":
    main()
