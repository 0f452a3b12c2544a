"""The bench's runners (torchkvops.bench.runners): HF generate's timing hook is on the model only during
that runner's own calls, since the rollout's modes share the model and their compiled decode (one graph,
`bench --compile`) cannot call a hook that runs outside graphs."""

from __future__ import annotations

import torch
from models import FAMILIES

from torchkvops.bench.cases import Case, Settings
from torchkvops.bench.runners import make_runner
from torchkvops.rollout.profiling import Clock


def test_hf_generates_timing_hook_is_registered_only_during_its_calls():
    model = FAMILIES["llama"]()
    case = Case(batch_size=2, samples_per_prompt=2, prompt_length=8, response_length=4)
    prompts = torch.randint(5, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(len(module._forward_pre_hooks)))
    runner = make_runner(
        "hf-generate", model, case, Settings(), prompts, pad_token_id=0, clock=Clock(torch.device("cpu"))
    )
    assert len(model._forward_pre_hooks) == 1  # only this test's
    responses = runner.run()
    assert responses.shape == (4, 4)
    assert seen and all(n == 2 for n in seen)  # the runner's hook beside this test's in every forward
    assert len(runner.marks) == len(seen)  # one mark per forward: prefill and 3 decode steps
    assert len(model._forward_pre_hooks) == 1  # gone after the call
    runner.close()
