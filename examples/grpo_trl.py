"""A short GRPO run with TRL's GRPOTrainer, generating with torchkvops: the one line a TRL user adds is

    torchkvops.patch_generate(model)

Everything else is a plain TRL script: a random-weight model of a named shape (nothing is downloaded),
a word-level tokenizer built in memory, an in-memory dataset of prompts and a toy reward (the share of
a completion's words that are "lucky": a fixed quarter of the vocabulary, picked by hash). TRL's RepeatSampler puts the num_generations copies of each
prompt next to each other, so the patched generate prefills each prompt once and decodes its
num_generations samples from one expanded KV cache.

The script runs the same GRPO steps twice, from the same initial weights and seed: once with the
patched generate, once with Hugging Face's, and prints each step's generate time and whole-step time
side by side (with medians). On CPU:

    .venv/bin/python examples/grpo_trl.py                        # tiny model, both paths (~30 s)
    .venv/bin/python examples/grpo_trl.py --model-shape opt-125m --steps 3 --batch-size 16 \\
        --max-completion-length 32                                # ~3 min
    .venv/bin/python examples/grpo_trl.py --generate torchkvops  # one path only

Generate times are the wall time of each `model.generate` call TRL makes (TRL's own "transformers.generate"
profiling reaches only wandb, mlflow or trackio); step times run from the trainer's on_step_begin to its
on_step_end, so they include that step's generation, reward, loss, backward and optimizer step.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
import warnings
import zlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

import torchkvops
from torchkvops.models import MODEL_SHAPES, build_model

# The prompts' words; the rest of the vocabulary is filler ("w1234").
WORDS = ("apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum", "the", "a", "cat", "dog", "sat",
         "ran", "on", "under", "red", "blue", "big", "small", "and", "then")


def build_tokenizer(config) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose ids are the model's: its pad/bos/eos ids are the model config's,
    and every id the model can produce decodes to some word (the corpus words first, then filler)."""
    vocab_size = config.vocab_size
    ids = {"eos": config.eos_token_id, "bos": config.bos_token_id, "pad": config.pad_token_id}
    if ids["pad"] is None:  # GPT-2 has no pad token: pad with EOS, as is usual
        ids["pad"] = ids["eos"]
    specials = {}  # name -> id; roles that share an id (OPT's bos and eos) share a token
    for role, token_id in ids.items():
        name = next((n for n, i in specials.items() if i == token_id), f"<{role}>")
        specials[name] = token_id
    taken = set(specials.values())
    free = (i for i in range(vocab_size) if i not in taken)
    vocab = dict(specials)
    vocab["<unk>"] = next(free)
    for word in WORDS:
        vocab[word] = next(free)
    for i in free:
        vocab[f"w{i}"] = i
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    names = {i: n for n, i in specials.items()}
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token=names[ids["pad"]],
                                   bos_token=names[ids["bos"]], eos_token=names[ids["eos"]])


def build_dataset(num_prompts: int, prompt_length: int, seed: int = 0) -> Dataset:
    """Prompts of prompt_length // 2 to prompt_length words (so TRL left-pads them)."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(max(1, prompt_length // 2), prompt_length)))
               for _ in range(num_prompts)]
    return Dataset.from_dict({"prompt": prompts})


def is_lucky(word: str) -> bool:
    return zlib.crc32(word.encode()) % 4 == 0


def lucky_word_reward(completions, **kwargs) -> list[float]:
    """The share of a completion's words that are lucky (0 for an empty completion): dense enough at
    any vocabulary size that the completions of one prompt rarely tie, so GRPO's advantages are not 0."""
    rewards = []
    for text in completions:
        words = text.split()
        rewards.append(sum(map(is_lucky, words)) / len(words) if words else 0.0)
    return rewards


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (which includes that step's generation)."""

    def __init__(self):
        self.step_ms: list[float] = []
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ms.append((time.perf_counter() - self._start) * 1e3)


def time_generate(model) -> list[float]:
    """Wrap model.generate (whichever it is now) to record each call's wall time."""
    inner, times = model.generate, []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        times.append((time.perf_counter() - start) * 1e3)
        return out

    model.generate = timed
    return times


def run(path: str, args, output_dir: str) -> dict:
    model = build_model(args.model_shape, seed=args.seed)
    tokenizer = build_tokenizer(model.config)
    if path == "torchkvops":
        torchkvops.patch_generate(model)  # <- the one line that differs from a plain TRL script
    generate_ms = time_generate(model)
    step_timer = StepTimer()
    config = GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=args.seed,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    dataset = build_dataset(max(8, args.steps * args.batch_size), args.prompt_length, seed=args.seed)
    trainer = GRPOTrainer(model=model, reward_funcs=lucky_word_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[step_timer])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainer.train()
    # torchkvops says (once per cause) when a call went to HF's generate instead; pass the rest on.
    fallbacks = sorted({str(w.message) for w in caught if str(w.message).startswith("torchkvops.generate:")})
    for w in caught:
        if not str(w.message).startswith("torchkvops.generate:"):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    return {"generate_ms": generate_ms, "step_ms": step_timer.step_ms, "reward": rewards, "fallbacks": fallbacks}


def table(results: dict, steps: int) -> str:
    paths = list(results)
    header = ["step"] + [f"generate ms ({p})" for p in paths] + [f"step ms ({p})" for p in paths]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]

    def cell(values, i):
        return f"{values[i]:.0f}" if i < len(values) else "-"

    for i in range(steps):
        row = [str(i + 1)] + [cell(results[p]["generate_ms"], i) for p in paths] + \
              [cell(results[p]["step_ms"], i) for p in paths]
        lines.append("| " + " | ".join(row) + " |")
    medians = ["median"] + [f"{statistics.median(results[p]['generate_ms']):.0f}" for p in paths] + \
              [f"{statistics.median(results[p]['step_ms']):.0f}" for p in paths]
    lines.append("| " + " | ".join(medians) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model-shape", default="tiny", choices=list(MODEL_SHAPES))
    parser.add_argument("--generate", default="both", choices=["both", "torchkvops", "hf"])
    parser.add_argument("--steps", type=int, default=8, help="GRPO optimizer steps per path")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="per-device train batch size, in completions (a multiple of --num-generations)")
    parser.add_argument("--num-generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=128, help="longest prompt, in words (= tokens)")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads, 0 for torch's default (default 1: a small model's ops gain little\n"
                             "from more, and on a busy machine OpenMP threads stall each op by milliseconds)")
    args = parser.parse_args(argv)
    if args.batch_size % args.num_generations:
        parser.error(f"--batch-size ({args.batch_size}) must be a multiple of --num-generations ({args.num_generations})")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes, from TRL's calls

    paths = ["torchkvops", "hf"] if args.generate == "both" else [args.generate]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            print(f"--- GRPO with {path} generate: {args.steps} steps of {args.batch_size // args.num_generations} prompts "
                  f"x {args.num_generations} completions, model {args.model_shape}", flush=True)
            results[path] = run(path, args, os.path.join(tmp, path))
    print()
    print(f"model {args.model_shape}, {args.batch_size // args.num_generations} prompts x {args.num_generations} "
          f"completions per step, prompts <= {args.prompt_length} tokens, <= {args.max_completion_length} new tokens, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(table(results, args.steps))
    for path in paths:
        print(f"mean reward per step ({path}): " + ", ".join(f"{r:.3f}" for r in results[path]["reward"]))
        for message in results[path]["fallbacks"]:
            print(f"NOTE: some {path} calls ran HF's generate: {message}")


if __name__ == "__main__":
    main()
