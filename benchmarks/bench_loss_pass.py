"""The loss pass outside TRL on the shapes of examples/grpo_trl.py's real-model breakdown: a checkpoint
folder with its tokenizer (examples/grpo_trl.py's save_checkpoint writes one from a .gguf file), 2 chat
prompts of <= --prompt-length words x 8 rows, 48 random completion tokens each; loss = -sum of the
completion log-probs (the HF forward with logits_to_keep); forward + backward, gradient checkpointing
(non-reentrant) off and on; plain and patch_forward interleaved, 3 rounds, medians. On this CPU:

    .venv/bin/python benchmarks/bench_loss_pass.py CHECKPOINT_FOLDER
"""

import importlib.util
import os
import statistics
import sys
import time

import torch

import torchkvops

spec = importlib.util.spec_from_file_location(
    "ex", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "grpo_trl.py")
)
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)
torch.set_num_threads(2)
model, tok = ex.load_model(sys.argv[1])
ex.disable_dropout(model)
model.train()
ds = ex.build_dataset(2, 440, seed=0, chat=True)
texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in ds["prompt"]]
enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
g = torch.Generator().manual_seed(0)
C, G = 48, 8
ids = enc.input_ids.repeat_interleave(G, 0)
mask = enc.attention_mask.repeat_interleave(G, 0)
comp = torch.randint(100, 40000, (ids.shape[0], C), generator=g)
ids = torch.cat([ids, comp], 1)
mask = torch.cat([mask, torch.ones_like(comp)], 1)
print("batch", tuple(ids.shape))


def step():
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, logits_to_keep=C + 1)
    lp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, -C:, None])
    (-lp.sum()).backward()


for gc in (False, True):
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    times = {"plain": [], "shared": []}
    for r in range(3):
        for mode in ("plain", "shared"):
            h = torchkvops.patch_forward(model) if mode == "shared" else None
            t = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - t)
            if h:
                h.undo()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"checkpointing {gc}: plain {med['plain']:.2f} s, shared {med['shared']:.2f} s, ratio {med['plain'] / med['shared']:.2f}x",
        times,
    )
