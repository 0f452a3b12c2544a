"""The CUDA sampler's row body on the CPU: torchkvops::_sample_tokens_cuda_emulated runs the code that
csrc/cuda/sample_tokens.cu runs for one row (csrc/sample_tokens_row.h's `sample_row`), over an
emulated 512-thread block (csrc/cpu/sample_tokens_emulated.cpp): the same strided loops (16-byte
vectors on contiguous aligned rows, strided reads otherwise), radix-select histograms and suffix scans,
the same draw and log-probability finish, and reductions in cub's order. These tests hold it to the
reference exactly as tests/test_sample_tokens.py holds the CPU kernel (its assertion helpers).

Temperature: the emulator applies it as CUDA does, l = x * float32(1 / T), where the reference and the
CPU kernel divide, l = x / T, and the two can round differently (rollout/sampling.py). So the
reference is given `logits.float() * float32(1 / T)` at temperature 1.0 (`reference_inputs`): the
scaled logits the GPU computes, compared in the reference's own terms. Greedy takes the raw logits.
"""

import math
import random

import pytest
import torch
from test_sample_tokens import (
    DTYPES,
    MODES,
    assert_logprobs_close,
    assert_matches_reference,
    assert_within_3_sd,
    key_and_step_for_word,
    make_logits,
    special_rows,
    tail_logits,
    unhash32,
)

from torchkvops import ops, reference
from torchkvops.reference import LOW_SALT, STEP_SALT, TOKEN_SALT, hash32
from torchkvops.rollout.sampling import row_keys

EMULATED = torch.ops.torchkvops._sample_tokens_cuda_emulated.default


def emulated(logits, keys, step, temperature, top_k, top_p):
    """The emulated CUDA kernel's tokens, as sample_tokens returns them."""
    tokens, logprobs = EMULATED(logits, keys, step, temperature, top_k, top_p, False)
    assert logprobs.shape == (0,)
    return tokens


def emulated_with_logprobs(logits, keys, step, temperature, top_k, top_p):
    tokens, logprobs = EMULATED(logits, keys, step, temperature, top_k, top_p, True)
    # The same tokens with and without the log-probabilities (another instantiation of the row body).
    assert torch.equal(tokens, emulated(logits, keys, step, temperature, top_k, top_p))
    return tokens, logprobs


def reciprocal(temperature):
    """The CUDA kernel's float32 1 / T (SampleParams::inv_temperature)."""
    return torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)


def reference_inputs(logits, temperature):
    """(logits, temperature) that make the reference compute the emulator's (the GPU's) scaled logits:
    x * float32(1 / T) in float32, at temperature 1.0. Greedy: unchanged."""
    if temperature == 0.0:
        return logits, 0.0
    return logits.float() * reciprocal(temperature), 1.0


def assert_emulated_matches_reference(logits, keys, step, temperature, top_k, top_p):
    """Tokens (with and without log-probabilities) and log-probabilities against the reference, by
    test_sample_tokens' rules (near-ties and the top-p cut aside; greedy exactly)."""
    tokens, logprobs = emulated_with_logprobs(logits, keys, step, temperature, top_k, top_p)
    ref_logits, ref_temperature = reference_inputs(logits, temperature)
    assert_matches_reference(tokens, ref_logits, keys, step, ref_temperature, top_k, top_p)
    assert_logprobs_close(tokens, logprobs, ref_logits, ref_temperature, top_k, top_p)
    return tokens, logprobs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 2), (40, 97), (5, 1023), (4, 513), (16, 3000), (3, 4100)])
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(dtype, rows, vocab, mode):
    """Vocabularies below, at and past the block's 512 threads, and not multiples of the 4 or 8
    elements of a 16-byte vector (a tail after the vectors)."""
    temperature, top_k, top_p = MODES[mode]
    logits = make_logits(rows, vocab, dtype, "cpu")
    keys = row_keys(3, torch.arange(rows))
    for step in (0, 7):
        assert_emulated_matches_reference(logits, keys, torch.tensor([step]), temperature, top_k, top_p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference_large_vocab(dtype):
    rows, vocab = 2, 151936  # every radix digit, and 297 vectors per thread
    logits = make_logits(rows, vocab, dtype, "cpu", scale=2.0)
    keys = row_keys(11, torch.arange(rows))
    for temperature, top_k, top_p in MODES.values():
        assert_emulated_matches_reference(logits, keys, torch.tensor([5]), temperature, top_k, top_p)


def misaligned(logits):
    """A copy of `logits` whose rows are contiguous but start 1 element past a 16-byte boundary."""
    rows, vocab = logits.shape
    storage = torch.empty(rows * vocab + 1, dtype=logits.dtype)
    out = storage[1:].view(rows, vocab)
    out.copy_(logits)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["aligned", "misaligned", "row_strided", "column_strided", "expanded_keys"])
def test_both_row_reader_paths(dtype, layout):
    """RowReader reads 16-byte vectors when a row is contiguous and 16-byte aligned (thread t: vectors
    t, t + 512, ...), and single elements strided otherwise (thread t: tokens t, t + 512, ...). Both
    paths against the reference, and the same tokens from both on the same values (a thread's tokens
    differ between the paths, the draw must not)."""
    rows, vocab = 9, 2048 + 40  # whole vectors on every row, 5 passes of 512 vectors' threads for fp32
    base = make_logits(rows, vocab, dtype, "cpu", seed=4)
    keys = row_keys(2, torch.arange(rows))
    if layout == "aligned":
        logits = base
        assert logits.data_ptr() % 16 == 0 and (vocab * logits.element_size()) % 16 == 0
    elif layout == "misaligned":
        logits = misaligned(base)
        assert logits.is_contiguous() and logits.data_ptr() % 16 != 0
    elif layout == "row_strided":  # the last position of [rows, positions, vocab], as a model returns it
        logits = torch.stack([base, base, base], dim=1)[:, -1]
    else:  # vocab not innermost
        logits = base.t().contiguous().t()
    if layout == "expanded_keys":
        keys = row_keys(2, torch.arange(2 * rows))[::2]
    step = torch.tensor([3])
    for temperature, top_k, top_p in MODES.values():
        tokens, logprobs = assert_emulated_matches_reference(logits, keys, step, temperature, top_k, top_p)
        if layout != "expanded_keys":
            vector_tokens, vector_logprobs = emulated_with_logprobs(base, keys, step, temperature, top_k, top_p)
            assert torch.equal(tokens, vector_tokens)
            # Each thread sums other tokens' exp in float: the same sum to rounding.
            torch.testing.assert_close(logprobs, vector_logprobs, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_greedy_is_argmax_on_ties_and_special_values_anywhere():
    """Rows of every length around the vector width and the block's 512 threads, from a few values
    (ties common) with NaN, +-inf and +-0.0 anywhere: the emulated kernel equals torch.argmax on every
    row, through both RowReader paths; its greedy log-probability equals log_softmax's."""
    g = torch.Generator().manual_seed(7)
    values = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1.0, -1.0, 2.5, 2.5, 2.5])
    step = torch.zeros(1, dtype=torch.long)
    for dtype in DTYPES:
        for vocab in (1, 2, 15, 16, 17, 31, 33, 100, 257, 511, 512, 513, 1025, 2049):
            for nan_rate in (0.0, 0.01):
                weights = torch.tensor([nan_rate, 0.02, 0.05, 0.2, 0.2, 0.2, 0.2, 0.01, 0.01, 0.01])
                picks = torch.multinomial(weights, 16 * vocab, replacement=True, generator=g)
                logits = values[picks].view(16, vocab).to(dtype)
                keys = torch.arange(16)
                for layout in (logits, logits.t().contiguous().t(), misaligned(logits)):
                    tokens, logprobs = emulated_with_logprobs(layout, keys, step, 0.0, 0, 1.0)
                    assert torch.equal(tokens, logits.argmax(dim=-1)), (dtype, vocab)
                    assert_logprobs_close(tokens, logprobs, logits, 0.0, 0, 1.0)


def test_special_rows():
    """Rows with ties, -inf, NaN and +inf in every mode: the reference's tokens and log-probabilities
    (NaN where it has NaN), and -inf tokens never drawn while a finite one is left."""
    step = torch.tensor([3])
    for dtype in DTYPES:
        for vocab in (4, 257, 1031):
            logits = special_rows(vocab).to(dtype)
            keys = row_keys(5, torch.arange(logits.shape[0]))
            for temperature, top_k, top_p in MODES.values():
                assert_emulated_matches_reference(logits, keys, step, temperature, top_k, top_p)
    logits = torch.tensor([[-math.inf, 0.5, -math.inf, -math.inf]] * 64)
    for top_k, top_p in [(0, 1.0), (2, 1.0), (0, 0.5), (3, 0.9)]:
        out = emulated(logits, torch.arange(64), step, 1.0, top_k, top_p)
        assert torch.equal(out, torch.ones_like(out))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_logprobs_match_reference(dtype, mode):
    """test_sample_tokens' log-probability cases: random rows (bf16 / fp16 ones full of ties), rows of
    few values (ties at the top-k and top-p cuts), row-strided, vocab not innermost, a large row."""
    temperature, top_k, top_p = MODES[mode]
    step = torch.tensor([3])
    few_values = (torch.randint(0, 6, (32, 300), generator=torch.Generator().manual_seed(1)) * 0.5).to(dtype)
    cases = [
        make_logits(24, 3000, dtype, "cpu"),
        few_values,
        make_logits(16, 3 * 1001, dtype, "cpu").view(16, 3, 1001)[:, -1],
        make_logits(1001, 9, dtype, "cpu").t(),
        make_logits(1, 50000, dtype, "cpu", scale=2.0),
    ]
    for logits in cases:
        keys = row_keys(5, torch.arange(logits.shape[0]))
        assert_emulated_matches_reference(logits, keys, step, temperature, top_k, top_p)


def test_extreme_noise_words_are_finite_and_masked():
    """test_sample_tokens' extreme words on the emulated kernel: the largest noise (45.05) wins unless
    top-k / top-p drop its token; the smallest (-3.81) is finite. Exactly the reference's tokens."""
    vocab, token = 2048, 1234
    logits = make_logits(1, vocab, torch.float32, "cpu")
    logits[0, token] = -30.0
    for word, noise in [((0xFFFFFFFF, 0xFFFFFFFF), 65 * math.log(2)), ((0, 0), -math.log(65 * math.log(2)))]:
        key, step = key_and_step_for_word(token, *word)
        keys, step_t = torch.tensor([key]), torch.tensor([step])
        assert float(reference.gumbel_noise(keys, step_t, vocab)[0, token]) == pytest.approx(noise, abs=1e-5)
        for temperature, top_k, top_p in [(1.0, 0, 1.0), (1.0, 5, 1.0), (0.7, 0, 0.5), (1.0, 3, 0.9)]:
            out = emulated(logits, keys, step_t, temperature, top_k, top_p)
            ref_logits, ref_temperature = reference_inputs(logits, temperature)
            assert torch.equal(out, reference.sample_tokens(ref_logits, keys, step_t, ref_temperature, top_k, top_p))
            if noise > 0:
                assert (int(out) == token) == (top_k == 0 and top_p == 1.0)


def test_far_tail_is_drawn_at_its_probability():
    """test_sample_tokens' far-tail test (issue #20: the 23-bit noise drew tokens below ~1e-7 too
    rarely) on the emulated kernel, at its smaller size: 8191 tokens of probability 1e-7 each, 50,000
    rows in all; the rows that draw a tail token within 3 standard deviations of softmax's count."""
    p_each, vocab, rows, steps = 1e-7, 8192, 10_000, 5
    logits, tail = tail_logits(rows, vocab, p_each, top=vocab // 2, device="cpu")
    keys = row_keys(20, torch.arange(rows))
    hits = 0
    for step in range(steps):
        out = emulated(logits, keys, torch.tensor([step]), 1.0, 0, 1.0)
        hits += int((out != vocab // 2).sum())
    assert_within_3_sd(hits, rows * steps, tail)


def test_tail_of_1e_10_is_drawn_at_its_probability():
    """test_sample_tokens' stratified 1e-10 tail (rows [0, -c] whose token-1 word has ~high < 64) on
    the emulated kernel, all rows in one call (a step per row)."""
    c = -math.log(1e-10 / (1 - 1e-10))
    low = float(torch.tensor(-c, dtype=torch.float32))
    p = math.exp(low) / (1 + math.exp(low))
    strata, rows = 64, 8192
    rng = random.Random(10)
    keys, steps = [], []
    for row in range(rows):
        row_low = rng.getrandbits(32)
        row_high = unhash32(0xFFFFFFFF - row % strata) ^ hash32((1 + TOKEN_SALT) ^ row_low)
        step = unhash32(row_low) ^ hash32(row_high + LOW_SALT)
        keys.append(unhash32(row_high) ^ hash32(step + STEP_SALT))
        steps.append(step)
    logits = torch.tensor([[0.0, low]]).expand(rows, 2)
    hits = int(emulated(logits, torch.tensor(keys), torch.tensor(steps), 1.0, 0, 1.0).sum())
    assert_within_3_sd(hits, rows, p * 2**32 / strata)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (40, 1.0), (0, 0.8), (20, 0.9)])
def test_same_tokens_as_the_cpu_kernel_at_power_of_two_temperatures(temperature, top_k, top_p):
    """At a power-of-two temperature x / T and x * (1 / T) are the same float, and on one machine the
    two kernels' noise is the same (one libm): they keep the same tokens (exact integer masses) and
    take the argmax of the same scores, so every token must be identical, near-ties included (their
    only differences are the loops' order, the CPU kernel's noise_bound pre-filter and its double
    sums, none of which reaches a token). Their log-probabilities agree to float32 rounding."""
    cases = [
        make_logits(64, 3000, torch.float32, "cpu"),
        make_logits(16, 1023, torch.bfloat16, "cpu"),
        (torch.randint(0, 6, (32, 300), generator=torch.Generator().manual_seed(1)) * 0.5).half(),
        special_rows(257),
        make_logits(2, 151936, torch.float32, "cpu", scale=2.0),
    ]
    for logits in cases:
        keys = row_keys(9, torch.arange(logits.shape[0]))
        step = torch.tensor([1, 4])[torch.arange(logits.shape[0]) % 2]  # a step per row
        tokens, logprobs = emulated_with_logprobs(logits, keys, step, temperature, top_k, top_p)
        cpu_tokens, cpu_logprobs = ops.sample_tokens_with_logprobs(logits, keys, step, temperature, top_k, top_p)
        assert torch.equal(tokens, cpu_tokens)
        torch.testing.assert_close(logprobs, cpu_logprobs, rtol=1e-5, atol=2e-5, equal_nan=True)


def division_and_reciprocal_disagree(temperature):
    """Two float32 logits x1 < x2 with x1 / T == x2 / T (the CPU's rounding) but x1 * (1 / T) <
    x2 * (1 / T) (CUDA's), T and 1 / T in float32; None if none lies in [1, 2)."""
    x = torch.arange(0x3F800000, 0x40000000, dtype=torch.int32).view(torch.float32)  # [1, 2)
    divided = x / torch.tensor(temperature, dtype=torch.float32)
    multiplied = x * reciprocal(temperature)
    hit = ((divided[1:] == divided[:-1]) & (multiplied[1:] > multiplied[:-1])).nonzero()
    return None if hit.numel() == 0 else (float(x[hit[0, 0]]), float(x[hit[0, 0] + 1]))


@pytest.mark.parametrize("temperature", [0.7, 1.3, 3.0])
def test_each_device_rounds_logits_over_temperature_as_torch_does(temperature):
    """What rollout/sampling.py and csrc/sample_tokens.h state: the draws follow torch's own rounding
    of `logits / temperature` on each device, which is not the same on CPU (x / T) and CUDA (x * (1 / T)
    in float32). Two logits that the division makes equal but the reciprocal's product does not, with
    top_k = 1 (which keeps every token tied with the largest): the CPU kernel keeps both and draws
    either, at log-probability log(1/2), as the reference given the division does; the emulated CUDA
    kernel keeps the larger alone, at log-probability 0, as the reference given the product does."""
    pair = division_and_reciprocal_disagree(temperature)
    assert pair is not None, f"no float32 pair in [1, 2) rounds apart for T = {temperature}"
    x1, x2 = pair
    rows = 64
    logits = torch.tensor([[x1, x2, -5.0, -6.0]] * rows)
    keys, step = row_keys(1, torch.arange(rows)), torch.tensor([0])

    cpu_tokens, cpu_logprobs = ops.sample_tokens_with_logprobs(logits, keys, step, temperature, 1, 1.0)
    assert set(cpu_tokens.tolist()) == {0, 1}  # a tie: each row draws either
    torch.testing.assert_close(cpu_logprobs, torch.full((rows,), -math.log(2.0)))
    assert torch.equal(cpu_tokens, reference.sample_tokens(logits, keys, step, temperature, 1, 1.0))

    cuda_tokens, cuda_logprobs = emulated_with_logprobs(logits, keys, step, temperature, 1, 1.0)
    assert torch.equal(cuda_tokens, torch.ones(rows, dtype=torch.long))  # the larger product alone
    assert torch.equal(cuda_logprobs, torch.zeros(rows))
    ref_logits, _ = reference_inputs(logits, temperature)
    assert torch.equal(cuda_tokens, reference.sample_tokens(ref_logits, keys, step, 1.0, 1, 1.0))


def test_checks_arguments_like_the_kernels():
    """The emulator runs the kernels' argument checks, under its own name."""
    logits, keys, step = make_logits(3, 10, torch.float32, "cpu"), torch.arange(3), torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^_sample_tokens_cuda_emulated: top_p must be in \(0, 1\]"):
        EMULATED(logits, keys, step, 1.0, 0, 1.5, False)
    with pytest.raises(TypeError, match="^_sample_tokens_cuda_emulated: logits must be float32"):
        EMULATED(logits.double(), keys, step, 1.0, 0, 1.0, True)
    tokens, logprobs = EMULATED(logits[:0], keys[:0], step, 1.0, 0, 1.0, True)
    assert tokens.shape == (0,) and logprobs.shape == (0,)
