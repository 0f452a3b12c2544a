"""Every TRL trainer that samples from the policy, besides GRPO (tests/test_trl.py): RLOOTrainer,
DistillationTrainer and the experimental SDFT, SDPO, IW-OPD, GOLD, Online DPO, GKD and A2PO trainers, each run
for two optimizer steps on a tiny Llama (tests/models.py: no dropout, peaked logits) on the CPU, with
`torchkvops.patch_generate` on the policy and `torchkvops.patch_forward` on the policy and on its teacher or
reference model, against the same run without the patch that can change results:

- Where the trainer lets its generation be greedy without losing its learning signal (DistillationTrainer:
  `generation_kwargs={"do_sample": False}`), the oracle is the run with no patch at all: HF's greedy tokens,
  HF's forward.
- Everywhere else the trainer samples (GKD, GOLD, IW-OPD and A2PO hard-code do_sample=True; greedy RLOO, SDPO
  and Online DPO would give every completion of a prompt the same reward and no gradient; greedy SDFT would
  make a group's rows identical, which leaves the shared forward nothing but whole rows to share). The
  rollout's sampler is not HF's random stream, so no unpatched run draws the same tokens: the oracle is the
  run with patch_generate only (as tests/test_trl.py's hybrid test does). Both runs then draw the same tokens
  (asserted), and the only difference left is patch_forward.

Each test asserts (1) the final weights are the oracle's up to float rounding, and training moved them;
(2) every generate (or generate_batch) call the trainer made was served by the rollout: as many calls as the
oracle run made, none reached HF's own generate or generate_batch; (3) every forward the trainer ran outside
generation, on the policy and on the teacher or reference model (counted by a hook on each backbone, in both
runs), was served by the shared path, none fell back. Every prompt starts with the same ten-word "system
prompt" (SYSTEM), so rows share a prefix in every pass, also in trainers that sample one completion per
prompt; where a trainer samples several per prompt, they share the whole prompt.

Optimizer: SGD (an update proportional to the gradient); Adam would turn the passes' rounding noise into
updates of the learning rate's size wherever a gradient is near 0 (see tests/test_trl.py).
"""

import dataclasses
import functools
import random
import warnings
from collections import Counter

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from models import FAMILIES  # noqa: E402
from test_trl import load_example  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationMixin  # noqa: E402
from transformers.generation.continuous_batching.continuous_api import ContinuousMixin  # noqa: E402

import torchkvops  # noqa: E402
from torchkvops.hf import generate_patch  # noqa: E402

SYSTEM = "the cat sat on the big red dog and then"  # every prompt's first ten words (all in the example's WORDS)
MIN_SHARED = 4  # patch_forward's min_shared_tokens: SYSTEM alone is 10 tokens
MAX_NEW = 8
STEPS = 2
# A chat template for the trainers that read `messages` (GKD, GOLD, IW-OPD): the prompt's rendering is a prefix
# of the whole conversation's, in words the tokenizer knows.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% if m['role'] == 'user' %}and then {% endif %}{% endfor %}"
# The final weights of two runs differ by float rounding only. Measured on this (2-core x86) CPU: at most 1.2e-7
# absolutely, and at most 4.9e-5 of the largest update (A2PO, whose update is the smallest, 6e-4; the others
# 6e-6 to 2.8e-5 of updates of 4e-3 to 2e-2). 2e-4 of the largest update leaves 4x room above that, and fails
# every test when the shared forward's output for one row of each pass is off by 1% (all but SDFT at 0.1%).
TOLERANCE = 2e-4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def example():
    """examples/grpo_trl.py as a module: its offline word-level tokenizer and its WORDS."""
    return load_example()


def build_tokenizer(example, config, padding_side="right"):
    tokenizer = example.build_tokenizer(config)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = padding_side
    return tokenizer


@pytest.fixture(scope="module")
def checkpoints(example, tmp_path_factory):
    """The policy's checkpoint (SDFT, SDPO and RLOO load their teacher or reference model from the policy's
    path) and a teacher's (other weights, the same vocabulary; IW-OPD also loads its tokenizer from there)."""
    root = tmp_path_factory.mktemp("trl_trainers")
    paths = {"policy": str(root / "policy"), "teacher": str(root / "teacher")}
    policy = FAMILIES["llama"]()
    torch.manual_seed(1)
    teacher = type(policy)(policy.config).eval()
    for name, model in (("policy", policy), ("teacher", teacher)):
        model.save_pretrained(paths[name])
        build_tokenizer(example, model.config).save_pretrained(paths[name])
    return paths


def prompts(example, n, seed=0):
    """SYSTEM, then 3 to 6 random words: left-padded to different lengths, sharing their first ten tokens."""
    rng = random.Random(seed)
    return [f"{SYSTEM} " + " ".join(rng.choice(example.WORDS) for _ in range(rng.randint(3, 6))) for _ in range(n)]


def prompt_dataset(example, n, **columns):
    return Dataset.from_dict({"prompt": prompts(example, n), **columns})


def messages_dataset(example, n):
    """Conversations (a user prompt, an assistant answer) for the SFT-style trainers (GKD, GOLD, IW-OPD)."""
    rng = random.Random(1)
    answers = [" ".join(rng.choice(example.WORDS) for _ in range(rng.randint(2, 6))) for _ in range(n)]
    conversations = [
        [{"role": "user", "content": p}, {"role": "assistant", "content": a}]
        for p, a in zip(prompts(example, n), answers)
    ]
    return Dataset.from_dict({"messages": conversations})


def length_reward(completions, **kwargs):
    """Dense: completions of one prompt rarely tie, so advantages and gradients are not 0."""
    return [len(text) / 100.0 for text in completions]


def parity_reward(completions, **kwargs):
    """Binary (SDPO's successful rollouts, A2PO's assumption): 1 for an odd number of words."""
    return [float(len(text.split()) % 2) for text in completions]


# --- what each run did -------------------------------------------------------------------------------------


class Calls:
    """What one run did, recorded by spies on the classes (so that copies of a model are seen too): each call
    that reached a torchkvops patch (generate or generate_batch), each call the rollout served (the patch's
    `_run`), each rollout prefill (Rollout.generate_rows: distinct prompts, samples per prompt), each call that
    ran transformers' own generate or generate_batch (a fallback, or a model without the patch), and the
    forwards each backbone ran outside any generate call (by a hook on the backbones the run names)."""

    def __init__(self):
        self.patched: list[tuple[object, str]] = []  # (model, "generate" or "generate_batch")
        self.served: list[tuple[object, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (model, ids, mask, out)
        self.prefills: list[tuple[int, int]] = []
        self.hf: list[tuple[object, torch.Tensor]] = []  # (model, sequences)
        self.hf_batch: list[object] = []
        self.passes: Counter = Counter()  # role -> forwards outside generation
        self.depth = 0  # > 0 inside a generate call

    def generating(self, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            self.depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.depth -= 1

        return wrapper

    def count_passes(self, role: str, model) -> None:
        def hook(module, args, kwargs):
            if self.depth == 0:
                self.passes[role] += 1

        model.base_model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.fixture
def spy(monkeypatch):
    """A function that starts a new Calls record (one per run); the spies stay for the whole test."""
    current = [Calls()]

    def calls() -> Calls:
        return current[0]

    patched_generate = generate_patch._PatchedGenerate.__call__
    patched_batch = generate_patch._PatchedGenerateBatch.__call__
    run = generate_patch._run
    rows = torchkvops.Rollout.generate_rows
    hf_generate = GenerationMixin.generate
    hf_batch = ContinuousMixin.generate_batch

    def patched_generate_spy(self, *args, **kwargs):
        calls().patched.append((self.__self__, "generate"))
        return calls().generating(patched_generate)(self, *args, **kwargs)

    def patched_batch_spy(self, *args, **kwargs):
        calls().patched.append((self.__self__, "generate_batch"))
        return calls().generating(patched_batch)(self, *args, **kwargs)

    def run_spy(session, model, call, *args, **kwargs):
        out = run(session, model, call, *args, **kwargs)
        calls().served.append((model, call.input_ids.clone(), call.attention_mask.clone(), out.clone()))
        return out

    def rows_spy(self, input_ids, *args, **kwargs):
        calls().prefills.append((input_ids.shape[0], self.config.samples_per_prompt))
        return rows(self, input_ids, *args, **kwargs)

    @functools.wraps(hf_generate)
    def hf_generate_spy(model, *args, **kwargs):
        out = calls().generating(hf_generate)(model, *args, **kwargs)
        calls().hf.append((model, (out if isinstance(out, torch.Tensor) else out.sequences).clone()))
        return out

    @functools.wraps(hf_batch)
    def hf_batch_spy(model, *args, **kwargs):
        calls().hf_batch.append(model)
        return calls().generating(hf_batch)(model, *args, **kwargs)

    monkeypatch.setattr(generate_patch._PatchedGenerate, "__call__", patched_generate_spy)
    monkeypatch.setattr(generate_patch._PatchedGenerateBatch, "__call__", patched_batch_spy)
    monkeypatch.setattr(generate_patch, "_run", run_spy)
    monkeypatch.setattr(torchkvops.Rollout, "generate_rows", rows_spy)
    # (installed before any model is patched: a patch falls back to the generate it found, this spy)
    monkeypatch.setattr(GenerationMixin, "generate", hf_generate_spy)
    monkeypatch.setattr(ContinuousMixin, "generate_batch", hf_batch_spy)

    def start() -> Calls:
        current[0] = Calls()
        return current[0]

    return start


@dataclasses.dataclass
class Run:
    calls: Calls
    weights: dict
    trainer: object
    stats: dict  # role -> SharedForwardStats ("both" runs only)


def train(spy, checkpoints, build, patches: str, teacher: str | None = None) -> Run:
    """Build the trainer with `build(policy)` and train it. patches: "both" (patch_generate on the policy before
    the trainer is built, so that copies the trainer makes of it are patched too; patch_forward on the policy
    and on the trainer's `teacher` attribute, its teacher or reference model, once built), "generate"
    (patch_generate only) or "none"."""
    calls = spy()
    policy = AutoModelForCausalLM.from_pretrained(checkpoints["policy"])
    if patches in ("both", "generate"):
        torchkvops.patch_generate(policy)
    trainer = build(policy)
    models = {"policy": trainer.model}
    if teacher is not None:
        models["teacher"] = getattr(trainer, teacher)
    stats = {}
    for role, model in models.items():
        calls.count_passes(role, model)
        if patches == "both":
            stats[role] = torchkvops.patch_forward(model, min_shared_tokens=MIN_SHARED).stats
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainer.train()
    assert not [str(w.message) for w in caught if "torchkvops" in str(w.message)]
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return Run(calls, weights, trainer, stats)


def distinct_prompts(ids: torch.Tensor, mask: torch.Tensor) -> int:
    return torch.unique(torch.cat([ids, mask], dim=1), dim=0).shape[0]


def sequences(run: Run) -> list[torch.Tensor]:
    """The sequences each generate call returned, served or HF's."""
    return [out for *_, out in run.calls.served] + [out for _, out in run.calls.hf]


def check(checkpoints, both: Run, oracle: Run) -> None:
    """The assertions every trainer's test makes: the `both` run's generate calls were all served, its forwards
    all shared, and it ended with the oracle run's weights."""
    done, expected = both.calls, oracle.calls
    # (2) Every generate call the trainer made went through the rollout: as many as the oracle run made, each
    # served; none reached transformers' own generate or generate_batch.
    assert done.hf == [] and done.hf_batch == []
    assert len(done.patched) == len(done.served) == len(expected.patched) + len(expected.hf) > 0
    assert expected.patched == [] or (expected.hf == [] and len(expected.served) == len(expected.patched))
    # Each call prefilled each of its distinct prompts once (copies of a prompt, adjacent or not, share a prefill).
    assert [rows for rows, _ in done.prefills] == [distinct_prompts(ids, mask) for _, ids, mask, _ in done.served]
    # Both runs generated the same tokens (the oracle's own: HF's greedy ones, or the rollout's samples).
    assert len(sequences(both)) == len(sequences(oracle))
    for got, want in zip(sequences(both), sequences(oracle)):
        assert torch.equal(got, want)
    # (3) Every forward outside generation, on the policy and on the teacher or reference model, was served by
    # the shared path: as many as the oracle run ran, none fell back.
    for role, stats in both.stats.items():
        assert done.passes[role] == expected.passes[role] > 0, role
        assert (stats.shared_calls, stats.fallback_calls) == (done.passes[role], 0), role
        assert stats.computed_tokens < stats.row_tokens, role
    # (1) Training moved the weights, and both runs moved them alike (float rounding of the passes, no more).
    initial = AutoModelForCausalLM.from_pretrained(checkpoints["policy"]).state_dict()
    update = max((oracle.weights[name] - initial[name]).abs().max().item() for name in oracle.weights)
    assert update > 1e-4
    for name in oracle.weights:
        torch.testing.assert_close(both.weights[name], oracle.weights[name], rtol=0, atol=TOLERANCE * update, msg=name)


def config(cls, tmp_path, name, **overrides):
    settings = dict(
        output_dir=str(tmp_path / name),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        max_steps=STEPS,
        optim="sgd",
        learning_rate=0.1,
    )
    settings.update(overrides)
    return cls(**settings)


# --- the trainers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("continuous_batching", [False, True], ids=["generate", "generate_batch"])
def test_rloo(example, checkpoints, spy, tmp_path, continuous_batching):
    """RLOO, 2 prompts x 4 samples per step, the reference pass on (beta > 0, the reference model loaded from
    the policy's path). With use_transformers_continuous_batching TRL calls model.generate_batch (a list of
    prompt-id lists), which the patch serves too; the oracle then runs with it as well."""
    from trl import RLOOConfig, RLOOTrainer

    prompts_per_step, samples = 2, 4

    def build(name):
        def trainer(model):
            args = config(
                RLOOConfig,
                tmp_path,
                name,
                per_device_train_batch_size=prompts_per_step * samples,
                num_generations=samples,
                max_completion_length=MAX_NEW,
                beta=0.04,
                use_transformers_continuous_batching=continuous_batching,
            )
            return RLOOTrainer(
                model=model,
                reward_funcs=length_reward,
                args=args,
                train_dataset=prompt_dataset(example, 16),
                processing_class=build_tokenizer(example, model.config),
            )

        return trainer

    oracle = train(spy, checkpoints, build("generate"), "generate", teacher="ref_model")
    both = train(spy, checkpoints, build("both"), "both", teacher="ref_model")
    check(checkpoints, both, oracle)
    kind = "generate_batch" if continuous_batching else "generate"
    assert [k for _, k in both.calls.patched] == [kind] * STEPS  # one generation batch per step
    assert both.calls.prefills == [(prompts_per_step, samples)] * STEPS  # each prompt prefilled once


def test_distillation(example, checkpoints, spy, tmp_path):
    """DistillationTrainer (one completion per prompt; a teacher with other weights), greedy through its
    generation_kwargs: the oracle is the run with no patch at all, whose generate is HF's."""
    from trl import DistillationConfig, DistillationTrainer

    def build(name):
        def trainer(model):
            args = config(
                DistillationConfig,
                tmp_path,
                name,
                per_device_train_batch_size=4,
                max_completion_length=MAX_NEW,
                generation_kwargs={"do_sample": False},
            )
            return DistillationTrainer(
                model=model,
                teacher_model=AutoModelForCausalLM.from_pretrained(checkpoints["teacher"]),
                args=args,
                train_dataset=prompt_dataset(example, 16),
                processing_class=build_tokenizer(example, model.config),
            )

        return trainer

    plain = train(spy, checkpoints, build("plain"), "none", teacher="teacher_model")
    both = train(spy, checkpoints, build("both"), "both", teacher="teacher_model")
    assert len(plain.calls.hf) == STEPS and plain.calls.served == []  # the oracle's generate is HF's
    check(checkpoints, both, plain)
    assert both.calls.prefills == [(4, 1)] * STEPS


def test_sdft(example, checkpoints, spy, tmp_path):
    """SDFT: 2 prompts x 4 samples per step; the teacher (teacher_model_kind="base": the initial policy, loaded
    from its path) reads the prompt with its privileged context and the policy's completion."""
    from trl.experimental.sdft import SDFTConfig, SDFTTrainer

    contexts = [" ".join(random.Random(i).choice(example.WORDS) for _ in range(4)) for i in range(16)]

    def build(name):
        def trainer(model):
            args = config(
                SDFTConfig,
                tmp_path,
                name,
                per_device_train_batch_size=8,
                num_generations=4,
                max_completion_length=MAX_NEW,
                distillation_topk=20,  # (its default, 100, is more than the tiny vocabulary)
            )
            return SDFTTrainer(
                model=model,
                args=args,
                train_dataset=prompt_dataset(example, 16, privileged_context=contexts),
                processing_class=build_tokenizer(example, model.config),
            )

        return trainer

    oracle = train(spy, checkpoints, build("generate"), "generate", teacher="teacher_model")
    both = train(spy, checkpoints, build("both"), "both", teacher="teacher_model")
    assert both.trainer.teacher_model is not both.trainer.model
    check(checkpoints, both, oracle)
    assert both.calls.prefills == [(2, 4)] * STEPS


def test_sdpo(example, checkpoints, spy, tmp_path):
    """SDPO: 2 prompts x 4 samples per step, a binary reward; the EMA teacher (loaded from the policy's path,
    synchronized after each step) reads the prompt reprompted with a successful sample."""
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    def build(name):
        def trainer(model):
            args = config(
                SDPOConfig,
                tmp_path,
                name,
                per_device_train_batch_size=8,
                num_generations=4,
                max_completion_length=MAX_NEW,
                distillation_topk=20,
            )
            return SDPOTrainer(
                model=model,
                reward_funcs=parity_reward,
                args=args,
                train_dataset=prompt_dataset(example, 16),
                processing_class=build_tokenizer(example, model.config),
            )

        return trainer

    oracle = train(spy, checkpoints, build("generate"), "generate", teacher="teacher_model")
    both = train(spy, checkpoints, build("both"), "both", teacher="teacher_model")
    check(checkpoints, both, oracle)
    assert both.calls.prefills == [(2, 4)] * STEPS


def test_iw_opd(example, checkpoints, spy, tmp_path):
    """IW-OPD (on-policy: lmbda=1), 2 prompts x 2 samples per step, with a teacher of other weights loaded from
    its own path (IW-OPD checks the teacher's tokenizer there)."""
    from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer

    def build(name):
        def trainer(model):
            args = config(
                IWOPDConfig,
                tmp_path,
                name,
                per_device_train_batch_size=4,
                num_generations=2,
                max_completion_length=MAX_NEW,
            )
            return IWOPDTrainer(
                model=model,
                teacher_model=AutoModelForCausalLM.from_pretrained(checkpoints["teacher"]),
                args=args,
                train_dataset=messages_dataset(example, 16),
                processing_class=build_tokenizer(example, model.config),
            )

        return trainer

    oracle = train(spy, checkpoints, build("generate"), "generate", teacher="teacher_model")
    both = train(spy, checkpoints, build("both"), "both", teacher="teacher_model")
    check(checkpoints, both, oracle)
    assert both.calls.prefills == [(2, 2)] * STEPS


def test_gold(example, checkpoints, spy, tmp_path):
    """GOLD (on-policy: lmbda=1; the same tokenizer for both models, so its JSD loss, not ULD), 4 prompts per
    step, with a teacher of other weights. use_extended_uld=False: its byte-offset tokenization needs a
    byte-level BPE tokenizer, which the offline word-level one is not."""
    from trl.experimental.gold import GOLDConfig, GOLDTrainer

    def build(name):
        def trainer(model):
            args = config(
                GOLDConfig,
                tmp_path,
                name,
                per_device_train_batch_size=4,
                lmbda=1.0,
                max_completion_length=MAX_NEW,
                use_extended_uld=False,
            )
            return GOLDTrainer(
                model=model,
                teacher_model=AutoModelForCausalLM.from_pretrained(checkpoints["teacher"]),
                args=args,
                train_dataset=messages_dataset(example, 16),
                processing_class=build_tokenizer(example, model.config),
            )

        return trainer

    oracle = train(spy, checkpoints, build("generate"), "generate", teacher="teacher_model")
    both = train(spy, checkpoints, build("both"), "both", teacher="teacher_model")
    check(checkpoints, both, oracle)
    assert both.calls.prefills == [(4, 1)] * STEPS


def test_gkd(example, checkpoints, spy, tmp_path):
    """GKD (on-policy: lmbda=1), 4 prompts per step, with a teacher of other weights."""
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    def build(name):
        def trainer(model):
            args = config(GKDConfig, tmp_path, name, per_device_train_batch_size=4, lmbda=1.0, max_new_tokens=MAX_NEW)
            return GKDTrainer(
                model=model,
                teacher_model=AutoModelForCausalLM.from_pretrained(checkpoints["teacher"]),
                args=args,
                train_dataset=messages_dataset(example, 16),
                processing_class=build_tokenizer(example, model.config),
            )

        return trainer

    oracle = train(spy, checkpoints, build("generate"), "generate", teacher="teacher_model")
    both = train(spy, checkpoints, build("both"), "both", teacher="teacher_model")
    check(checkpoints, both, oracle)
    assert both.calls.prefills == [(4, 1)] * STEPS


def test_online_dpo(example, checkpoints, spy, tmp_path):
    """Online DPO, 4 prompts per step; its reference model is TRL's copy of the policy (made after
    patch_generate). It samples two completions per prompt from the batch repeated with repeat(2, 1): each
    prompt's copies are 4 rows apart, and each is prefilled once per call."""
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    batch = 4

    def build(name):
        def trainer(model):
            args = config(OnlineDPOConfig, tmp_path, name, per_device_train_batch_size=batch, max_new_tokens=MAX_NEW)
            return OnlineDPOTrainer(
                model=model,
                reward_funcs=length_reward,
                args=args,
                train_dataset=prompt_dataset(example, 16),
                processing_class=build_tokenizer(example, model.config),
            )

        return trainer

    oracle = train(spy, checkpoints, build("generate"), "generate", teacher="ref_model")
    both = train(spy, checkpoints, build("both"), "both", teacher="ref_model")
    check(checkpoints, both, oracle)
    for _, ids, mask, _ in both.calls.served:  # the batch twice over: each prompt's copies 4 rows apart
        assert ids.shape[0] == 2 * batch and distinct_prompts(ids, mask) == batch
        assert torch.equal(ids[:batch], ids[batch:]) and torch.equal(mask[:batch], mask[batch:])
    # One prefill per distinct prompt: 4 prompts, 2 samples each, per call.
    assert both.calls.prefills == [(batch, 2)] * STEPS


def test_a2po(example, checkpoints, spy, tmp_path):
    """A2PO: before training, its reference model (TRL's deep copy of the policy, made after patch_generate)
    samples num_value_samples completions per training prompt to estimate V*; then the policy samples one per
    prompt per step. The copy is patched too (GeneratePatch.of is its handle, with its own session), and every
    generate call of both models is served."""
    from trl.experimental.a2po import A2POConfig, A2POTrainer

    batch, value_samples, dataset_size = 4, 4, 8

    def build(name):
        def trainer(model):
            args = config(
                A2POConfig,
                tmp_path,
                name,
                per_device_train_batch_size=batch,
                num_value_samples=value_samples,
                max_completion_length=MAX_NEW,
            )
            return A2POTrainer(
                model=model,
                reward_funcs=parity_reward,
                args=args,
                train_dataset=prompt_dataset(example, dataset_size),
                # (A2PO pads with the tokenizer: left, as it sets it when it loads one itself)
                processing_class=build_tokenizer(example, model.config, padding_side="left"),
            )

        return trainer

    oracle = train(spy, checkpoints, build("generate"), "generate", teacher="ref_model")
    both = train(spy, checkpoints, build("both"), "both", teacher="ref_model")
    check(checkpoints, both, oracle)
    policy, reference = both.trainer.model, both.trainer.ref_model
    copy_patch, policy_patch = torchkvops.GeneratePatch.of(reference), torchkvops.GeneratePatch.of(policy)
    assert copy_patch is not None and policy_patch is not None and copy_patch.session is not policy_patch.session
    value_calls = dataset_size // batch
    served_by = [model for model, *_ in both.calls.served]
    assert [model for model, _ in both.calls.patched] == served_by
    assert served_by == [reference] * value_calls + [policy] * STEPS
    # The reference model's calls: 4 prompts, num_value_samples each (num_return_sequences); the policy's: one
    # completion per prompt (prompts whose value samples all scored 0 are filtered out of training, as A2PO's
    # filter_all_incorrect does by default: fewer than 4 in a call).
    assert both.calls.prefills[:value_calls] == [(batch, value_samples)] * value_calls
    assert [samples for _, samples in both.calls.prefills[value_calls:]] == [1] * STEPS
