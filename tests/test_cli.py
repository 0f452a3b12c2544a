"""The `torchkvops` command line, run as a user runs it: `python -m torchkvops ...` in a subprocess
(offline), on the tiny random-weight shape with small sizes; plus the benchmark's statistics and
bookkeeping directly."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchkvops import bench, cli

ROOT = Path(__file__).absolute().parents[1]
HAS_GPU = torch.cuda.is_available()
TINY = ["--model-shape", "tiny"]
SMALL_BENCH = ["bench", *TINY, "--device", "cpu", "--warmup", "1", "--iterations", "3", "--no-progress"]


def run_cli(*args: str, timeout: float = 120, code: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    env.pop("TORCHKVOPS_DEBUG", None)
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "torchkvops", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """stderr's non-blank lines (the profiler's native start/stop chatter must not be among them)."""
    return [line for line in proc.stderr.splitlines() if line.strip()]


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("torchkvops: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --- the statistics and bookkeeping, directly ----------------------------------------------------
def test_summary_math():
    s = bench.summarize(list(range(1, 21)))
    assert s == {"mean": 10.5, "p50": 10.5, "p95": 19}
    assert bench.summarize([3, 1, 2]) == {"mean": 2.0, "p50": 2, "p95": 3}
    assert bench.summarize([5.0]) == {"mean": 5.0, "p50": 5.0, "p95": 5.0}
    # nearest rank: the value at rank ceil(0.95 n) of the sorted values
    values = [float(v) for v in range(100, 0, -1)]
    assert bench.summarize(values)["p95"] == 95.0
    assert bench.summarize([None, None]) is None
    with pytest.raises(ValueError, match="None"):
        bench.summarize([1.0, None, 2.0])
    with pytest.raises(ValueError):
        bench.summarize([])
    profiles = [{"a": float(i), "b": None, "c": 7} for i in range(1, 21)]
    assert bench.summarize_profiles(profiles) == {"a": {"mean": 10.5, "p50": 10.5, "p95": 19.0}, "b": None,
                                                  "c": {"mean": 7.0, "p50": 7, "p95": 7}}


def test_run_order_is_largest_first_and_stable():
    cases = bench.plan_cases([1, 8], [4, 16], [32], [8, 16])
    assert [c.name for c in cases][:3] == ["B1_N4_P32_R8", "B1_N4_P32_R16", "B1_N16_P32_R8"]
    order = [cases[i] for i in bench.run_order(cases)]
    assert [c.rows for c in order] == sorted((c.rows for c in cases), reverse=True)
    assert order[0].name == "B8_N16_P32_R16" and order[1].name == "B8_N16_P32_R8"
    assert bench.plan_cases([2, 2], [1], [3], [4]) == [bench.Case(2, 1, 3, 4)]  # duplicates dropped


def test_token_agreement_rules():
    same = {"expanded": "h", "shared": "h", "hf-generate": "h"}
    greedy = bench.token_agreement(same, greedy=True)
    assert greedy["all_agree"] is True and all(v is True for v in greedy["pairs"].values())
    sampled = bench.token_agreement({"expanded": "h", "shared": "x", "hf-generate": "y"}, greedy=False)
    assert sampled["pairs"] == {"expanded vs shared": False, "expanded vs hf-generate": None,
                                "shared vs hf-generate": None}
    assert sampled["all_agree"] is False and "not comparable" in sampled["notes"]["expanded vs hf-generate"]
    assert bench.token_agreement({"shared": "h", "hf-generate": "y"}, greedy=False)["all_agree"] is None
    assert bench.token_agreement({"shared": "h", "expanded": None}, greedy=True)["pairs"] == {}


def test_tokens_hash_is_of_int64_bytes():
    t = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    import hashlib

    assert bench.tokens_sha256(t) == hashlib.sha256(t.long().numpy().tobytes()).hexdigest()


def test_synthetic_prompts_are_seeded_and_avoid_special_ids():
    case = bench.Case(3, 2, 50, 4)
    a = bench.synthetic_prompts(case, 8, {0, 1, 2}, seed=5, device=torch.device("cpu"))
    b = bench.synthetic_prompts(case, 8, {0, 1, 2}, seed=5, device=torch.device("cpu"))
    c = bench.synthetic_prompts(case, 8, {0, 1, 2}, seed=6, device=torch.device("cpu"))
    assert a.shape == (3, 50) and a.dtype == torch.long and torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.min()) >= 3 and int(a.max()) <= 7


def test_cpu_peak_memory_counts_allocations_inside_ops():
    mib = 1 << 20

    def work():
        a = torch.ones(mib, dtype=torch.uint8)  # 1 MiB
        b = torch.ones(2 * mib, dtype=torch.uint8)  # 3 MiB held
        del a
        c = torch.ones(4 * mib, dtype=torch.uint8)  # 6 MiB held: the peak
        del b, c
        d = torch.ones(mib, dtype=torch.uint8)
        del d

    peak = bench.cpu_peak_memory_bytes(work)
    assert 6 * mib <= peak < 6 * mib + 64 * 1024


def test_default_command_parses_to_a_short_bench():
    args = cli.build_parser().parse_args(["bench", *cli.DEFAULT_BENCH_ARGS])
    assert args.command == "bench" and args.model_shape in ("tiny", "opt-125m")
    assert args.warmup + args.iterations <= 6
    full = cli.build_parser().parse_args(["bench"])
    assert (full.warmup, full.iterations, full.modes) == (5, 20, ["expanded", "shared", "hf-generate"])


def test_a_failing_case_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    from torchkvops.rollout import Rollout

    real_generate = Rollout.generate

    def generate(self, input_ids, attention_mask=None):
        if input_ids.shape[0] * self.config.samples_per_prompt >= 4:
            raise torch.OutOfMemoryError("simulated: out of memory")
        return real_generate(self, input_ids, attention_mask)

    monkeypatch.setattr(Rollout, "generate", generate)
    out = tmp_path / "bench.json"
    rc = cli.main(SMALL_BENCH + ["--batch-sizes", "1", "2", "--samples-per-prompt", "2", "--prompt-lengths", "6",
                                 "--response-lengths", "3", "--iterations", "1", "--output", str(out)])
    assert rc == 1
    captured = capsys.readouterr()
    assert "1 case(s) failed: B2_N2_P6_R3" in captured.err
    cases = json.loads(out.read_text())["cases"]
    ok, bad = cases
    assert bad["case"] == "B2_N2_P6_R3" and bad["run_order"] == 0 and "OutOfMemoryError" in bad["error"]
    assert "simulated" in bad["modes"]["shared"]["error"] and bad["modes"]["shared"]["iterations"] == []
    assert bad["modes"]["hf-generate"]["error"] is None  # the other modes of the case still ran
    assert ok["error"] is None and all(e["error"] is None for e in ok["modes"].values())
    assert "failed: OutOfMemoryError" in captured.out


# --- bench ---------------------------------------------------------------------------------------
def test_bench_json_tables_trace_and_order(tmp_path):
    out, trace = tmp_path / "bench.json", tmp_path / "trace"
    proc = run_cli("bench", *TINY, "--device", "cpu", "--warmup", "1", "--iterations", "3", "--temperature", "0",
                   "--batch-sizes", "1", "2", "--samples-per-prompt", "3", "--prompt-lengths", "6",
                   "--response-lengths", "4", "--output", str(out), "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM weights" in proc.stdout
    assert "B2_N3_P6_R4 expanded" in proc.stderr and "/36 [" in proc.stderr  # the progress bar: 2x3x(1+3+1+1) calls
    for name in ("B1_N3_P6_R4", "B2_N3_P6_R4"):
        assert name in proc.stdout
    assert "| mode | prefill ms | kv_expand ms | decode ms | total ms | tokens/s | peak MiB | total / expanded |" in proc.stdout
    assert proc.stdout.count("| shared |") == 2 and proc.stdout.count("| hf-generate |") == 2

    data = json.loads(out.read_text())
    h = data["header"]
    for key in ("model", "model_shape", "dtype", "device", "device_name", "torch_version", "transformers_version",
                "torchkvops_version", "flags", "peak_memory_method"):
        assert key in h
    assert h["model_shape"] == "tiny" and h["random_weights"] and h["dtype"] == "fp32"
    assert h["torch_version"] == torch.__version__ and h["peak_memory_method"] == "cpu_profiler"
    assert h["flags"]["iterations"] == 3 and h["flags"]["batch_sizes"] == [1, 2]

    cases = data["cases"]
    assert [c["case"] for c in cases] == ["B1_N3_P6_R4", "B2_N3_P6_R4"]  # the requested order ...
    assert [c["run_order"] for c in cases] == [1, 0]  # ... but the most rows ran first
    assert h["cases_run_order"] == ["B2_N3_P6_R4", "B1_N3_P6_R4"]
    for c in cases:
        assert c["error"] is None and list(c["modes"]) == ["expanded", "shared", "hf-generate"]
        rows = c["batch_size"] * c["samples_per_prompt"]
        for mode, e in c["modes"].items():
            assert e["error"] is None and len(e["iterations"]) == 3
            assert set(e["summary"]) == set(bench.PROFILE_FIELDS)
            for field, s in e["summary"].items():
                values = [p[field] for p in e["iterations"]]
                if s is None:
                    assert all(v is None for v in values)
                    continue
                ordered = sorted(values)
                assert s["p50"] == ordered[1] and s["p95"] == ordered[math.ceil(0.95 * 3) - 1]
                assert s["mean"] == pytest.approx(sum(values) / 3)
            assert e["summary"]["response_length"]["p50"] == 4
            assert e["summary"]["generated_tokens"]["p50"] == rows * 4
            assert e["summary"]["total_ms"]["p50"] > 0
            assert e["peak_memory_method"] == "cpu_profiler" and e["peak_memory_bytes"] > 0
            assert len(e["tokens_sha256"]) == 64
            stages = ("prefill_ms", "kv_expand_ms", "decode_ms")
            if mode == "hf-generate":
                assert all(e["summary"][f] is None for f in stages)
            else:
                assert all(e["summary"][f] is not None for f in stages)
            trace_file = Path(e["trace"])
            assert trace_file.parent == trace and trace_file.name == f"{c['case']}_{mode}.json"
            text = trace_file.read_text()
            json.loads(text)
            if mode != "hf-generate":
                assert '"torchkvops.prefill"' in text and '"torchkvops.decode"' in text
        # Greedy: every mode must give the same tokens (rows in repeat_interleave order).
        assert c["tokens_agree"]["all_agree"] is True
        assert set(c["tokens_agree"]["pairs"].values()) == {True}
        assert len({e["tokens_sha256"] for e in c["modes"].values()}) == 1
    assert c["modes"]["shared"]["summary"]["kv_expand_ms"]["p50"] > 0


def test_bench_sampling_agreement_and_mode_subset(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli(*SMALL_BENCH, "--iterations", "1", "--warmup", "0", "--temperature", "0.8", "--top-p", "0.9",
                   "--batch-sizes", "2", "--samples-per-prompt", "2", "--prompt-lengths", "5",
                   "--response-lengths", "3", "--modes", "shared", "hf-generate", "expanded", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    (case,) = json.loads(out.read_text())["cases"]
    assert list(case["modes"]) == ["shared", "hf-generate", "expanded"]
    pairs = case["tokens_agree"]["pairs"]
    assert pairs["shared vs expanded"] is True  # same seed: the rollout's sampler ignores how prefill was batched
    assert pairs["shared vs hf-generate"] is None and pairs["hf-generate vs expanded"] is None
    assert "not comparable" in case["tokens_agree"]["notes"]["shared vs hf-generate"]
    assert "not comparable" in proc.stdout


def test_plot_without_matplotlib_fails_at_startup_with_the_install_hint(tmp_path):
    block = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'matplotlib':\n"
        "            raise ModuleNotFoundError(\"No module named 'matplotlib'\")\n"
        "sys.meta_path.insert(0, Block())\n"
        "from torchkvops.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = run_cli(*SMALL_BENCH, "--plot", str(tmp_path / "p.png"), code=block)
    assert_one_line_error(proc, "pip install matplotlib", "torchkvops[plot]")
    assert "bench:" not in proc.stdout and "model:" not in proc.stdout  # nothing ran before the check
    assert not (tmp_path / "p.png").exists()


def test_plot_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "stages.png"
    proc = run_cli(*SMALL_BENCH, "--iterations", "1", "--batch-sizes", "1", "2", "--samples-per-prompt", "2",
                   "--prompt-lengths", "4", "--response-lengths", "2", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- rollout -------------------------------------------------------------------------------------
def test_rollout_synthetic_prompts_print_and_jsonl(tmp_path):
    out = tmp_path / "samples.jsonl"
    proc = run_cli("rollout", *TINY, "--device", "cpu", "--prompt-length", "5", "--num-prompts", "2", "-n", "3",
                   "--max-new-tokens", "4", "--seed", "3", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM weights" in proc.stdout and "=== prompt 1" in proc.stdout and "--- sample 2" in proc.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in records] == [(i, j) for i in range(2) for j in range(3)]
    for r in records:
        assert len(r["prompt_token_ids"]) == 5 and 1 <= len(r["token_ids"]) <= 4
        assert r["text"] is None and r["prompt"] is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama and a word-level tokenizer, saved with save_pretrained: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + "the a cat dog sat on mat ran fast slow big red and is was".split()
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # No pad token: the command must fall back to EOS.
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("checkpoint")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def test_rollout_from_a_checkpoint_left_pads_and_matches_hf_greedy(tmp_path, checkpoint):
    path, model, tokenizer = checkpoint
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"prompt": "a big red dog ran fast and the cat sat"}) + "\n")
    out = tmp_path / "samples.jsonl"
    proc = run_cli("rollout", "--model", str(path), "--device", "cpu", "--prompt", "the cat", "--prompts",
                   str(prompts_file), "-n", "2", "--max-new-tokens", "6", "--temperature", "0", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM" not in proc.stdout and "=== prompt 1: 'a big red dog" in proc.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4
    texts = ["the cat", "a big red dog ran fast and the cat sat"]
    for r in records:
        prompt = texts[r["prompt_index"]]
        assert r["prompt"] == prompt and isinstance(r["text"], str)
        assert r["prompt_token_ids"] == tokenizer(prompt)["input_ids"]  # the padding is not part of it
        # Each prompt alone through HF's greedy generate: the left-padded batch must give the same tokens.
        ids = torch.tensor([r["prompt_token_ids"]])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                             pad_token_id=2)[0, ids.shape[1]:].tolist()
        if 2 in ref:
            ref = ref[: ref.index(2) + 1]
        assert r["token_ids"] == ref
        assert r["text"] == tokenizer.decode(ref, skip_special_tokens=True)


def test_prompts_files_plain_and_jsonl(tmp_path):
    plain = tmp_path / "prompts.txt"
    plain.write_text("the cat\n\n{not json} the dog ran\n")
    assert cli.read_prompts(str(plain)) == ["the cat", "{not json} the dog ran"]
    jsonl = tmp_path / "prompts.data"
    jsonl.write_text('{"prompt": "a", "id": 1}\n\n{"prompt": "b c"}\n')
    assert cli.read_prompts(str(jsonl)) == ["a", "b c"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(cli.CLIError, match=r"bad.jsonl:2: .*\"prompt\" field"):
        cli.read_prompts(str(bad))
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(cli.CLIError, match="no prompts"):
        cli.read_prompts(str(tmp_path / "empty.txt"))


# --- bad input -----------------------------------------------------------------------------------
BAD = {
    "missing model path": (["rollout", "--model", "/nonexistent/checkpoint"], ["no such folder"]),
    "folder that is not a checkpoint": (["rollout", "--model", "{tmp}"], ["not a Hugging Face checkpoint"]),
    "zero batch size": (["bench", "--batch-sizes", "1", "0"], ["--batch-sizes", ">= 1"]),
    "text prompt without a model": (["rollout", "--prompt", "hello"], ["--model"]),
    "prompt longer than the model allows": (["bench", *TINY, "--device", "cpu", "--prompt-lengths", "2048"],
                                            ["2048 positions"]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_and_non_zero(name, tmp_path):
    args, needles = BAD[name]
    assert_one_line_error(run_cli(*[a.replace("{tmp}", str(tmp_path)) for a in args]), *needles)


@pytest.mark.parametrize("args,needle", [
    (["bench", "--response-lengths", "-4"], "--response-lengths: must be >= 1, got -4"),
    (["bench", "--samples-per-prompt", "4", "x"], "--samples-per-prompt: expected an integer"),
    (["bench", "--iterations", "0"], "--iterations"),
    (["bench", "--warmup", "-1"], "--warmup"),
    (["bench", "--modes", "beam"], "--modes"),
    (["bench", "--top-p", "1.5"], "--top-p: must be in (0, 1]"),
    (["bench", "--dtype", "fp64"], "--dtype"),
    (["rollout", "--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["rollout", "--temperature", "-1"], "--temperature"),
    (["rollout", "--temperature", "nan"], "must be finite"),
    (["rollout", "-n", "0"], "--samples-per-prompt"),
    (["rollout", "--top-k", "-1"], "--top-k"),
    (["rollout", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["nope"], "invalid choice"),
])
def test_bad_numbers_are_argparse_errors_on_one_line(args, needle, capsys):
    # The same parser as in the subprocess tests above, in-process to keep the file fast.
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torchkvops: error: ") and needle in err, err


def test_prompt_longer_than_the_checkpoint_allows(checkpoint):
    path, _, _ = checkpoint
    proc = run_cli("rollout", "--model", str(path), "--device", "cpu", "--prompt", "the cat sat", "--max-new-tokens",
                   "62")
    assert_one_line_error(proc, "64 positions", "--max-new-tokens")


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_cuda_without_a_gpu_fails_clearly():
    assert_one_line_error(run_cli("bench", *TINY, "--device", "cuda"), "no CUDA GPU")


# --- bench-op and the console script -------------------------------------------------------------
def test_bench_op_delegates():
    pytest.importorskip("torchkvops.bench_op")
    proc = run_cli("bench-op", "--device", "cpu", "--dtype", "fp32", "--max-mib", "1", "--warmup", "0", "--iters", "1",
                   "--methods", "op,copy", "--batch", "2", "--repeats", "2")
    assert proc.returncode == 0, proc.stderr
    assert "| cache MiB |" in proc.stdout


def test_console_script_help():
    script = shutil.which("torchkvops", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the torchkvops console script is not installed in this environment")
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and all(c in proc.stdout for c in ("rollout", "bench", "bench-op"))


# --- CUDA (run by scripts/gpu_check.sh on a GPU machine) -----------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_bench_on_cuda(tmp_path, dtype):
    out = tmp_path / "bench.json"
    proc = run_cli("bench", *TINY, "--device", "cuda", "--dtype", dtype, "--warmup", "1", "--iterations", "3",
                   "--temperature", "0", "--batch-sizes", "2", "--samples-per-prompt", "4", "--prompt-lengths", "16",
                   "--response-lengths", "8", "--output", str(out), "--trace", str(tmp_path / "trace"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["header"]["peak_memory_method"] == "cuda_allocator"
    (case,) = data["cases"]
    for e in case["modes"].values():
        assert e["error"] is None and e["peak_memory_bytes"] > 0
        assert all(p["peak_memory_bytes"] > 0 for p in e["iterations"])
    assert case["tokens_agree"]["pairs"]["expanded vs shared"] is True
    assert '"torchkvops.kv_expand"' in Path(case["modes"]["shared"]["trace"]).read_text()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_rollout_on_cuda(tmp_path, checkpoint):
    path, _, _ = checkpoint
    out = tmp_path / "samples.jsonl"
    proc = run_cli("rollout", "--model", str(path), "--device", "cuda", "--prompt", "the cat", "--prompt",
                   "a big dog ran", "-n", "4", "--max-new-tokens", "8", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 8
