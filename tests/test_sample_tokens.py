"""sample_tokens against the Python sampler (reference.sample_tokens), its distribution, opcheck,
torch.compile and its errors.

How the op may differ from the reference, and what these tests allow for it:
- The op computes each token's Gumbel noise with the C library's (or CUDA's) logf, torch with its own
  vectorized log, so the noise can differ in the last bit: two tokens whose perturbed scores are
  within TIE_TOL can come out in either order.
- The top-p cut is summed differently (exact 64-bit fixed point in the op, a float32 softmax and
  cumsum in the reference; both keep every token tied at the cut). So a token whose position against
  the cut is within MASS_TOL of top_p can be kept by one and dropped by the other.
A row may disagree only for one of these reasons, checked row by row below from the reference's own
perturbed scores and a float64 recomputation of the cut; every other row must match exactly, and
greedy rows must always match exactly.
"""

import itertools
import math
import random

import pytest
import torch
from devices import DEVICES, requires_gpu
from torch._subclasses.fake_tensor import FakeTensorMode

import torchkvops
from torchkvops import ops, reference
from torchkvops.reference import LOW_SALT, STEP_SALT, TOKEN_SALT, hash32
from torchkvops.rollout.sampling import SamplingParams, row_keys, sample, sample_with_logprobs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

TIE_TOL = 1e-5  # perturbed scores closer than this (absolute, in logit/temperature units) are a tie
MASS_TOL = 1e-5  # probability mass closer than this to top_p is on the cut

# (temperature, top_k, top_p)
MODES = {
    "greedy": (0.0, 0, 1.0),
    "temperature": (1.0, 0, 1.0),
    "cold": (0.4, 0, 1.0),
    "top_k": (1.0, 50, 1.0),
    "top_p": (1.0, 0, 0.9),
    "top_k_top_p": (0.8, 20, 0.8),
    "hot_top_p": (2.5, 0, 0.5),
}


def make_logits(rows, vocab, dtype, device, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed * 1000 + rows * 7 + vocab)
    return (torch.randn(rows, vocab, generator=g) * scale).to(device=device, dtype=dtype)


def on_top_p_cut(l, token, top_k, top_p):
    """Whether the op's and the reference's top-p rules may disagree on keeping `token` of one row of
    scaled logits `l`: the probability of the tokens with a larger value is within MASS_TOL of top_p."""
    if top_p >= 1.0:
        return False
    l = l.double().cpu()
    kept = torch.ones_like(l, dtype=torch.bool)
    if 0 < top_k < l.numel():
        kept = l >= torch.topk(l, top_k).values[-1]
    probs = torch.where(kept, l, float("-inf")).softmax(dim=0)
    v = l[token]
    larger = probs[l > v].sum().item()
    return abs(larger - top_p) < MASS_TOL


def assert_matches_reference(out, logits, keys, step, temperature, top_k, top_p):
    expected = reference.sample_tokens(logits, keys, step, temperature, top_k, top_p)
    assert out.dtype == torch.long and out.device == logits.device and out.shape == expected.shape
    if temperature == 0.0:
        assert torch.equal(out, expected)
        return
    rows = (out != expected).nonzero().flatten().tolist()
    if not rows:
        return
    scores = reference.perturbed_scores(logits, keys, step, temperature, top_k, top_p)
    scaled = logits.float() / temperature
    for r in rows:
        a, b = int(out[r]), int(expected[r])
        sa, sb = scores[r, a].item(), scores[r, b].item()
        near_tie = abs(sa - sb) <= TIE_TOL * max(1.0, abs(sb))  # False when either is -inf or NaN
        on_cut = on_top_p_cut(scaled[r], a, top_k, top_p) or on_top_p_cut(scaled[r], b, top_k, top_p)
        assert near_tie or on_cut, (
            f"row {r}: op {a} (score {sa}), reference {b} (score {sb}); neither a near-tie nor on the top-p cut"
        )
    # Both explanations are rare events: a disagreeing row now and then, never a pattern.
    assert len(rows) <= max(1, out.numel() // 20), f"{len(rows)} of {out.numel()} rows disagree"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 2), (40, 97), (16, 3000)])
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(device, dtype, rows, vocab, mode):
    temperature, top_k, top_p = MODES[mode]
    logits = make_logits(rows, vocab, dtype, device)
    keys = row_keys(3, torch.arange(rows, device=device))
    for step in (0, 7):
        step_t = torch.tensor([step], device=device)
        out = ops.sample_tokens(logits, keys, step_t, temperature, top_k, top_p)
        assert_matches_reference(out, logits, keys, step_t, temperature, top_k, top_p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference_large_vocab(device, dtype):
    rows, vocab = 3, 151936  # past 65536 and 2^17: every radix digit and a long row
    logits = make_logits(rows, vocab, dtype, device, scale=2.0)
    keys = row_keys(11, torch.arange(rows, device=device))
    step = torch.tensor([5], device=device)
    for temperature, top_k, top_p in MODES.values():
        out = ops.sample_tokens(logits, keys, step, temperature, top_k, top_p)
        assert_matches_reference(out, logits, keys, step, temperature, top_k, top_p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["row_strided", "column_strided", "expanded_keys"])
def test_matches_reference_non_contiguous(device, layout):
    rows, vocab = 9, 1001
    g = torch.Generator().manual_seed(5)
    if layout == "row_strided":  # the last position of [rows, positions, vocab], as a model returns it
        logits = (torch.randn(rows, 3, vocab, generator=g) * 3).to(device)[:, -1]
    else:  # vocab not innermost
        logits = (torch.randn(vocab, rows, generator=g) * 3).to(device).t()
    keys = row_keys(2, torch.arange(rows, device=device))
    if layout == "expanded_keys":
        keys = row_keys(2, torch.arange(2 * rows, device=device))[::2]
    assert not logits.is_contiguous()
    step = torch.tensor([3], device=device)
    for temperature, top_k, top_p in MODES.values():
        out = ops.sample_tokens(logits, keys, step, temperature, top_k, top_p)
        assert_matches_reference(out, logits, keys, step, temperature, top_k, top_p)
        for other_step in (step[0], step[None]):  # any 1-element shape
            assert torch.equal(ops.sample_tokens(logits, keys, other_step, temperature, top_k, top_p), out)


@pytest.mark.parametrize("device", DEVICES)
def test_no_rows(device):
    for vocab in (0, 5):
        logits = torch.empty(0, vocab, device=device)
        out = ops.sample_tokens(
            logits,
            torch.empty(0, dtype=torch.long, device=device),
            torch.zeros(1, dtype=torch.long, device=device),
            0.7,
            3,
            0.5,
        )
        assert out.shape == (0,) and out.dtype == torch.long and out.device == logits.device


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_ties_and_special_values(device):
    """Greedy is torch.argmax exactly: the first of tied maxima, NaN above everything, -inf rows."""
    inf, nan = float("inf"), float("nan")
    rows = [
        [1.0, 3.0, 3.0, 2.0],
        [-inf, -inf, -inf, -inf],
        [0.0, nan, 5.0, nan],
        [-0.0, 0.0, -1.0, -0.0],
        [inf, 1.0, inf, 2.0],
    ]
    keys = torch.arange(len(rows), device=device)
    step = torch.zeros(1, dtype=torch.long, device=device)
    for dtype in DTYPES:
        logits = torch.tensor(rows, dtype=dtype, device=device)
        assert torch.equal(ops.sample_tokens(logits, keys, step, 0.0, 0, 1.0), logits.argmax(dim=-1))
    # Sampling: -inf tokens are never drawn while a finite one is left (top-k keeps the -inf ties).
    logits = torch.tensor([[-inf, 0.5, -inf, -inf]] * 64, device=device)
    keys = torch.arange(64, device=device)
    for top_k, top_p in [(0, 1.0), (2, 1.0), (0, 0.5), (3, 0.9)]:
        out = ops.sample_tokens(logits, keys, step, 1.0, top_k, top_p)
        assert torch.equal(out, torch.ones_like(out))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_is_argmax_on_ties_and_special_values_anywhere(device, dtype):
    """Rows of every length around the kernels' block sizes, drawn from a few values (so that ties are
    common) with NaN, +-inf and +-0.0 at random places: the op equals torch.argmax on every row,
    contiguous or not."""
    g = torch.Generator().manual_seed(7)
    values = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1.0, -1.0, 2.5, 2.5, 2.5])
    for vocab in (1, 2, 15, 16, 17, 31, 33, 64, 100, 257):
        for nan_rate in (0.0, 0.01):
            weights = torch.tensor([nan_rate, 0.02, 0.05, 0.2, 0.2, 0.2, 0.2, 0.01, 0.01, 0.01])
            picks = torch.multinomial(weights, 64 * vocab, replacement=True, generator=g)
            logits = values[picks].view(64, vocab).to(device=device, dtype=dtype)
            keys, step = torch.arange(64, device=device), torch.zeros(1, dtype=torch.long, device=device)
            assert torch.equal(ops.sample_tokens(logits, keys, step, 0.0, 0, 1.0), logits.argmax(dim=-1))
            strided = logits.t().contiguous().t()
            assert torch.equal(ops.sample_tokens(strided, keys, step, 0.0, 0, 1.0), logits.argmax(dim=-1))


def key_and_step_for_word(token: int, high: int, low: int) -> tuple[int, int]:
    """A (key, step) pair whose noise word for `token` is (high, low): reference.noise_words inverted."""
    row_low = unhash32(low) ^ high
    row_high = unhash32(high) ^ hash32((token + TOKEN_SALT) ^ row_low)
    step = unhash32(row_low) ^ hash32(row_high + LOW_SALT)
    return unhash32(row_high) ^ hash32(step + STEP_SALT), step


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_noise_words_are_finite_and_masked(device):
    """The largest word (2^64 - 1) gives the largest noise, -log(2^-65) = 45.05 (the 23-bit noise
    stopped at 16.64; a 32-bit uniform once rounded to 1.0 here and gave infinite noise, which beat
    even the tokens top-k had dropped); the smallest word gives -log(45.05) = -3.81. Both finite, the
    draws equal the reference's, and a token with the largest noise stays out when top-k drops it."""
    vocab, token = 2048, 1234
    logits = make_logits(1, vocab, torch.float32, device)
    logits[0, token] = -30.0  # 45.05 - 30 beats every other token here, unless top-k / top-p drop it
    for word, noise in [((0xFFFFFFFF, 0xFFFFFFFF), 65 * math.log(2)), ((0, 0), -math.log(65 * math.log(2)))]:
        key, step = key_and_step_for_word(token, *word)
        keys, step_t = torch.tensor([key], device=device), torch.tensor([step], device=device)
        g = reference.gumbel_noise(keys, step_t, vocab)
        assert bool(torch.isfinite(g).all())
        assert float(g[0, token]) == pytest.approx(noise, abs=1e-5)
        for temperature, top_k, top_p in [(1.0, 0, 1.0), (1.0, 5, 1.0), (0.7, 0, 0.5), (1.0, 3, 0.9)]:
            out = ops.sample_tokens(logits, keys, step_t, temperature, top_k, top_p)
            assert torch.equal(out, reference.sample_tokens(logits, keys, step_t, temperature, top_k, top_p))
            if noise > 0:
                assert (int(out) == token) == (top_k == 0 and top_p == 1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_one_and_tiny_top_p_are_greedy(device):
    logits = make_logits(64, 500, torch.float32, device, seed=1)
    keys = row_keys(4, torch.arange(64, device=device))
    greedy = logits.argmax(dim=-1)
    for step in range(3):
        step_t = torch.tensor([step], device=device)
        for temperature in (0.3, 1.0, 4.0):
            for top_k, top_p in [(1, 1.0), (0, 1e-6), (10, 1e-6), (1, 0.5)]:
                assert torch.equal(ops.sample_tokens(logits, keys, step_t, temperature, top_k, top_p), greedy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_draws_stay_in_the_kept_set(device, dtype):
    """Independent of the reference: top-k draws are among the k largest (ties included), top-p draws
    among the tokens that the tokens above them leave under top_p (checked in float64)."""
    rows, vocab = 256, 300
    logits = make_logits(rows, vocab, dtype, device, seed=2, scale=2.0)
    keys = row_keys(9, torch.arange(rows, device=device))
    step = torch.tensor([1], device=device)
    for temperature, top_k, top_p in [(1.0, 7, 1.0), (1.5, 0, 0.6), (1.0, 30, 0.5)]:
        out = ops.sample_tokens(logits, keys, step, temperature, top_k, top_p)
        scaled = (logits.float() / temperature).double().cpu()
        chosen = scaled.gather(1, out.cpu()[:, None])
        if top_k:
            assert (chosen >= scaled.topk(top_k, dim=-1).values[:, -1:]).all()
        if top_p < 1.0:
            kept = (
                scaled >= scaled.topk(top_k, dim=-1).values[:, -1:]
                if top_k
                else torch.ones_like(scaled, dtype=torch.bool)
            )
            probs = torch.where(kept, scaled, float("-inf")).softmax(dim=-1)
            larger = (probs * (scaled > chosen)).sum(dim=-1)
            assert (larger < top_p + MASS_TOL).all()
        assert len(set(out.tolist())) > 1  # the rows draw different tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 0, 1.0), (1.0, 3, 1.0), (1.2, 0, 0.7), (1.0, 4, 0.9)])
def test_frequencies_follow_the_distribution(device, temperature, top_k, top_p):
    """Over 20000 draws (4000 keys x 5 steps) the token counts fit the (truncated) softmax: a Pearson
    chi-square below 30 (df <= 5; a correct sampler exceeds it with probability ~1e-5; fixed keys, so
    the test is deterministic). A wrong temperature, a biased noise or a leaky cut fails it by far."""
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=torch.float64)
    scaled = base / temperature
    kept = torch.ones(6, dtype=torch.bool)
    if top_k:
        kept &= scaled >= scaled.topk(top_k).values[-1]
    probs = torch.where(kept, scaled, float("-inf")).softmax(dim=0)
    if top_p < 1.0:
        larger = torch.stack([probs[scaled > s].sum() for s in scaled])
        kept &= larger < top_p
        probs = torch.where(kept, scaled, float("-inf")).softmax(dim=0)
    rows, steps = 4000, 5
    logits = base.float().expand(rows, 6).to(device)
    keys = row_keys(123, torch.arange(rows, device=device))
    counts = torch.zeros(6, dtype=torch.float64)
    for step in range(steps):
        out = ops.sample_tokens(logits, keys, torch.tensor([step], device=device), temperature, top_k, top_p)
        counts += torch.bincount(out.cpu(), minlength=6).double()
    assert (counts[~kept] == 0).all()
    expected = probs[kept] * rows * steps
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
    assert chi2 < 30, (counts.tolist(), expected.tolist(), chi2)


def tail_logits(rows, vocab, p_each, top, device):
    """`rows` equal rows (one row, expanded: nothing is copied) with one token (index `top`) at logit 0
    and vocab - 1 tail tokens at one logit -c, c such that each tail token's softmax probability is
    about p_each. Returns the float32 logits and the exact total probability of the tail, computed in
    float64 from the float32 value of -c."""
    c = -math.log(p_each / (1.0 - (vocab - 1) * p_each))
    row = torch.full((vocab,), -c, dtype=torch.float32)
    row[top] = 0.0
    w = math.exp(float(row[top - 1]))
    return row.to(device).expand(rows, vocab), (vocab - 1) * w / (1.0 + (vocab - 1) * w)


def assert_within_3_sd(observed, draws, p):
    expected, sd = draws * p, math.sqrt(draws * p * (1 - p))
    assert expected >= 40, f"too few expected tail draws: {expected}"
    assert abs(observed - expected) <= 3 * sd, f"{observed} tail draws in {draws}, {expected:.1f} +- {sd:.1f} expected"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p_each,vocab,rows", [(1e-7, 49152, 10_000), (1.5e-8, 49152, 60_000)])
def test_far_tail_is_drawn_at_its_probability(device, p_each, vocab, rows):
    """Issue #20: the 23-bit noise capped the Gumbel at 16.64, and tokens of probability 1.5e-8 came
    out 5 times in 50,000 rows where 37 were due. One token at logit 0, the rest at a logit that gives
    each p_each: the rows that draw a tail token, over 5 steps, are within 3 standard deviations of
    softmax's count (>= 40 expected; fixed keys, so the test is deterministic)."""
    steps = 5
    logits, tail = tail_logits(rows // steps, vocab, p_each, top=vocab // 2, device=device)
    keys = row_keys(20, torch.arange(rows // steps, device=device))
    hits = 0
    for step in range(steps):
        out = ops.sample_tokens(logits, keys, torch.tensor([step], device=device), 1.0, 0, 1.0)
        hits += int((out != vocab // 2).sum())
    assert_within_3_sd(hits, rows // steps * steps, tail)


def unhash32(x: int) -> int:
    """The inverse of reference.hash32 on one 32-bit int."""
    x ^= x >> 16
    x = (x * pow(0x68E31DA5, -1, 2**32)) & 0xFFFFFFFF
    x ^= (x >> 15) ^ (x >> 30)
    x = (x * pow(0x7FEB352D, -1, 2**32)) & 0xFFFFFFFF
    return x ^ (x >> 16)


@pytest.mark.parametrize("device", DEVICES)
def test_tail_of_1e_10_is_drawn_at_its_probability(device):
    """A token of probability 1e-10 would need 4e11 token draws for 40 expected hits, so this samples
    only where it can win. Rows [0, -c]: token 1 has probability p = 1e-10. Its noise comes from a
    64-bit word whose high half h, with ~h >= 64, gives noise at most -log(64 * 2^-32) = 18.02; token
    0's noise is at least -3.81, and 18.02 - c < -3.81: token 1 loses. So P(token 1) = (64 / 2^32) *
    q, with q = P(token 1 | ~h < 64). For one token, (key, step) -> (its word) is a bijection built
    from invertible hashes: each row below inverts them to get a (key, step) whose word has ~h
    uniform in [0, 64) and a uniform low half (and so a uniform word given ~h < 64). Their count of
    token 1 must be within 3 standard deviations of q = p * 2^32 / 64 = 6.7e-3 per row."""
    for v in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):  # the inverse is right
        assert unhash32(hash32(v)) == v
    c = -math.log(1e-10 / (1 - 1e-10))
    low = float(torch.tensor(-c, dtype=torch.float32))
    p = math.exp(low) / (1 + math.exp(low))
    strata, rows = 64, 8192
    logits = torch.tensor([[0.0, low]], device=device)
    rng = random.Random(10)
    keys, steps = [], []
    for row in range(rows):
        # Invert noise_words for token 1: its high word h = 2^32 - 1 - (row % strata), row_low random.
        row_low = rng.getrandbits(32)
        row_high = unhash32(0xFFFFFFFF - row % strata) ^ hash32((1 + TOKEN_SALT) ^ row_low)
        step = unhash32(row_low) ^ hash32(row_high + LOW_SALT)
        keys.append(unhash32(row_high) ^ hash32(step + STEP_SALT))
        steps.append(step)
    high, _ = reference.noise_words(torch.tensor(keys[:strata]), torch.tensor([steps[0]]), 2)
    assert high[0, 1] == 0xFFFFFFFF  # the inversion is right
    hits = 0
    for key, step in zip(keys, steps):  # the operator takes one step per call
        hits += int(
            ops.sample_tokens(
                logits, torch.tensor([key], device=device), torch.tensor([step], device=device), 1.0, 0, 1.0
            )
        )
    assert_within_3_sd(hits, rows, p * 2**32 / strata)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "sampler,op", [(sample, ops.sample_tokens), (sample_with_logprobs, ops.sample_tokens_with_logprobs)]
)
def test_sample_is_the_operator(device, sampler, op):
    """sampling.sample and sample_with_logprobs (what the rollout calls) go through the operators,
    greedy included."""
    logits = make_logits(8, 100, torch.float32, device)
    keys, step = row_keys(0, torch.arange(8, device=device)), torch.tensor([2], device=device)
    for temperature, top_k, top_p in MODES.values():
        got = sampler(logits, SamplingParams(temperature, top_k, top_p), keys, step)
        torch.testing.assert_close(got, op(logits, keys, step, temperature, top_k, top_p), rtol=0, atol=0)


def top_p_uncertainty(scaled, top_k, top_p):
    """Per row of scaled logits: the probability held by tokens whose side of the top-p cut the op and
    the reference may judge differently, the mass above them being within the error of the sums that
    decide it (MASS_TOL, plus the worst case of the reference's float32 cumsum over the row). The
    normalizer of every log-probability of the row can differ by that much (relative to top_p).
    [rows] float64; 0 without top-p and on rows whose probabilities are NaN."""
    rows, vocab = scaled.shape
    if top_p >= 1.0:
        return torch.zeros(rows, dtype=torch.float64)
    l = scaled.double().cpu()
    if 0 < top_k < vocab:
        l = l.masked_fill(l < torch.topk(l, top_k, dim=-1).values[:, -1:], float("-inf"))
    ls, _ = torch.sort(l, dim=-1, descending=True)
    ps = ls.softmax(dim=-1)
    above = ps.cumsum(dim=-1) - ps
    # Tied values are judged by the mass above the first of them.
    starts = torch.ones_like(ls, dtype=torch.bool)
    starts[:, 1:] = ls[:, 1:] != ls[:, :-1]
    first = torch.where(starts, torch.arange(vocab).expand(rows, vocab), 0).cummax(dim=-1).values
    above = above.gather(-1, first)
    close = (above - top_p).abs() < MASS_TOL + vocab * 2.0**-24
    return (ps * close).sum(dim=-1).nan_to_num(0.0) / top_p


def special_rows(vocab):
    """Rows with ties, -inf, NaN and +inf, each pattern repeated to `vocab` tokens."""
    inf, nan = float("inf"), float("nan")
    patterns = [
        [1.0, 3.0, 3.0, 2.0],
        [-inf] * 4,
        [0.0, nan, 5.0, nan],
        [-0.0, 0.0, -1.0, -0.0],
        [inf, 1.0, inf, 2.0],
        [-inf, 0.5, -inf, -inf],
        [2.0] * 4,
        [0.5, -inf, 0.5, -3.0],
    ]
    return torch.tensor([(p * vocab)[:vocab] for p in patterns])


def assert_logprobs_match_reference(logits, keys, step, temperature, top_k, top_p):
    """sample_tokens_with_logprobs: the same tokens as sample_tokens, and the log-probabilities of the
    reference (log_softmax of processed_logits) at those tokens, up to float32 rounding of a sum over
    the row and the uncertainty of the top-p cut (top_p_uncertainty); NaN where the reference has NaN."""
    tokens, logprobs = ops.sample_tokens_with_logprobs(logits, keys, step, temperature, top_k, top_p)
    assert torch.equal(tokens, ops.sample_tokens(logits, keys, step, temperature, top_k, top_p))
    assert_logprobs_close(tokens, logprobs, logits, temperature, top_k, top_p)


def assert_logprobs_close(tokens, logprobs, logits, temperature, top_k, top_p):
    """The comparison of assert_logprobs_match_reference, for log-probabilities of `tokens` that a
    sampler computed from `logits` with these settings."""
    assert logprobs.dtype == torch.float32 and logprobs.shape == tokens.shape and logprobs.device == logits.device
    expected = reference.processed_logprobs(logits, tokens, temperature, top_k, top_p)
    assert torch.equal(logprobs.isnan(), expected.isnan())
    uncertain = top_p_uncertainty(logits.float() / temperature, top_k, top_p) if temperature else 0.0
    tolerance = 2e-5 * (1 + expected.abs().double().cpu().nan_to_num(0.0)) + 2 * uncertain
    diff = (logprobs - expected).abs().double().cpu().nan_to_num(0.0)
    assert (diff <= tolerance).all(), (diff.max().item(), (diff - tolerance).max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_logprobs_match_reference(device, dtype, mode):
    """Random rows (bf16 / fp16 ones full of ties), rows of few values (ties at the top-k and top-p
    cuts), rows with -inf, NaN and +inf, contiguous and not, a large vocabulary."""
    temperature, top_k, top_p = MODES[mode]
    step = torch.tensor([3], device=device)
    few_values = (torch.randint(0, 6, (32, 300), generator=torch.Generator().manual_seed(1)) * 0.5).to(device, dtype)
    cases = [
        make_logits(64, 3000, dtype, device),
        few_values,
        special_rows(257).to(device, dtype),
        make_logits(16, 3 * 1001, dtype, device).view(16, 3, 1001)[:, -1],  # row-strided
        make_logits(1001, 9, dtype, device).t(),  # vocab not innermost
        make_logits(2, 151936, dtype, device, scale=2.0),
    ]
    for logits in cases:
        keys = row_keys(5, torch.arange(logits.shape[0], device=device))
        assert_logprobs_match_reference(logits, keys, step, temperature, top_k, top_p)


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_of_the_kept_distribution(device):
    """Independent of the reference: exp(logprob) summed over the tokens the op draws with each
    setting, one row per token of a small vocabulary forced by top-k = 1 ... is a probability; and
    with top-k = 2 on [2, 1, 0, ...] the two kept tokens have log_softmax([2, 1] / T)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 64, device=device)
    keys, step = row_keys(1, torch.arange(64, device=device)), torch.zeros(1, dtype=torch.long, device=device)
    tokens, logprobs = ops.sample_tokens_with_logprobs(logits, keys, step, 0.5, 2, 1.0)
    assert set(tokens.tolist()) == {0, 1}
    expected = torch.tensor([2.0, 1.0], device=device).div(0.5).log_softmax(dim=0)[tokens]
    torch.testing.assert_close(logprobs, expected)
    _, greedy = ops.sample_tokens_with_logprobs(logits, keys, step, 0.0, 2, 0.5)  # greedy: raw logits, no cut
    torch.testing.assert_close(greedy, logits[0].log_softmax(dim=0)[0].expand(64))


def opcheck_samples(device):
    keys = row_keys(1, torch.arange(5, device=device))
    step = torch.tensor([4], device=device)
    logits = make_logits(5, 37, torch.float32, device)
    strided = make_logits(5, 3 * 37, torch.bfloat16, device).view(5, 3, 37)[:, -1]
    empty = torch.empty(0, 11, device=device)
    return [
        (logits, keys, step, 0.0, 0, 1.0),
        (logits, keys, step, 0.9, 0, 1.0),
        (strided, keys, step, 0.7, 5, 0.8),
        (logits.half(), keys, step, 1.3, 0, 0.5),
        (empty, keys[:0], step, 1.0, 2, 0.9),
        (logits, keys, torch.tensor([0, 3, 3, 7, 1], device=device), 0.9, 0, 1.0),  # a step per row
    ]


OPS = {"sample_tokens": ops.sample_tokens, "sample_tokens_with_logprobs": ops.sample_tokens_with_logprobs}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_a_step_per_row_draws_each_rows_own_steps_noise(device, op):
    """step [rows]: row r draws what it draws alone at its own step (rows that joined a batch later
    keep their samples), and the reference agrees."""
    rows, vocab = 6, 50
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(device)
    keys = row_keys(4, torch.arange(rows, device=device))
    steps = torch.tensor([0, 5, 5, 1, 9, 2**40 + 3], device=device)
    for temperature, top_k, top_p in MODES.values():
        together = OPS[op](logits, keys, steps, temperature, top_k, top_p)
        for r in range(rows):
            alone = OPS[op](logits[r : r + 1], keys[r : r + 1], steps[r : r + 1], temperature, top_k, top_p)
            for a, b in zip(
                together if isinstance(together, tuple) else (together,),
                alone if isinstance(alone, tuple) else (alone,),
            ):
                assert torch.equal(a[r : r + 1], b), (temperature, top_k, top_p, r)
        tokens = together[0] if isinstance(together, tuple) else together
        assert_matches_reference(tokens, logits, keys, steps, temperature, top_k, top_p)
        strided = torch.stack([steps, steps], dim=1)[:, 0]  # a step view with stride 2
        again = OPS[op](logits, keys, strided, temperature, top_k, top_p)
        assert torch.equal(again[0] if isinstance(again, tuple) else again, tokens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_opcheck(device, op):
    for args in opcheck_samples(device):
        torch.library.opcheck(getattr(torch.ops.torchkvops, op).default, args)


@pytest.mark.parametrize("op", OPS)
def test_compiled_matches_eager(op):
    logits = make_logits(6, 257, torch.bfloat16, "cpu")
    keys = row_keys(8, torch.arange(6))

    @torch.compile(fullgraph=True)
    def decode_sample(logits, keys, step):
        return OPS[op](logits.float() * 2.0, keys, step, 0.9, 40, 0.95)

    for step in range(3):  # step is a tensor: one graph for every step
        step_t = torch.tensor([step])
        expected = OPS[op](logits.float() * 2.0, keys, step_t, 0.9, 40, 0.95)
        torch.testing.assert_close(decode_sample(logits, keys, step_t), expected, rtol=0, atol=0)


@pytest.mark.cuda
@requires_gpu
def test_cuda_graph_capture_and_no_host_sync():
    logits = make_logits(32, 50272, torch.bfloat16, "cuda")
    keys = row_keys(6, torch.arange(32, device="cuda"))
    step = torch.zeros(1, dtype=torch.long, device="cuda")
    for (temperature, top_k, top_p), op in itertools.product(MODES.values(), OPS.values()):
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = [op(logits, keys, step + s, temperature, top_k, top_p) for s in range(2)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        step.zero_()
        with torch.cuda.graph(graph):
            out = op(logits, keys, step, temperature, top_k, top_p)
        for s in range(2):
            step.fill_(s)
            graph.replay()
            torch.testing.assert_close(out, eager[s], rtol=0, atol=0)


@pytest.mark.cuda
@requires_gpu
def test_cuda_inputs_on_other_devices():
    logits = make_logits(2, 10, torch.float32, "cuda")
    keys, step = torch.arange(2, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="keys must be on logits' device"):
        ops.sample_tokens(logits, keys.cpu(), step, 1.0, 0, 1.0)
    with pytest.raises(ValueError, match="step must be on logits' device"):
        ops.sample_tokens(logits, keys, step.cpu(), 1.0, 0, 1.0)


def bad_args():
    logits = make_logits(3, 10, torch.float32, "cpu")
    return logits, torch.arange(3), torch.zeros(1, dtype=torch.long), 1.0, 0, 1.0


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: (a[0][0], *a[1:]), ValueError, "logits must be 2-D"),
        (lambda a: (a[0][None], *a[1:]), ValueError, "logits must be 2-D"),
        (lambda a: (a[0].double(), *a[1:]), TypeError, "logits must be float32, float16 or bfloat16"),
        (lambda a: (a[0].long(), *a[1:]), TypeError, "logits must be float32, float16 or bfloat16"),
        (lambda a: (a[0][:, :0], *a[1:]), ValueError, "vocab >= 1"),
        (lambda a: (a[0], a[1].int(), *a[2:]), TypeError, "keys must be int64"),
        (lambda a: (a[0], a[1][:2], *a[2:]), ValueError, r"keys must be 1-D with one key per row \(3\)"),
        (lambda a: (a[0], a[1][None], *a[2:]), ValueError, "keys must be 1-D"),
        (lambda a: (*a[:2], torch.tensor([1, 2]), *a[3:]), ValueError, r"one step per row \(3\), got shape \[2\]"),
        (lambda a: (*a[:2], torch.zeros(3, 1, dtype=torch.long), *a[3:]), ValueError, "step must be a 1-element"),
        (lambda a: (*a[:2], torch.tensor([1.0]), *a[3:]), TypeError, "step must be an int64 tensor"),
        (lambda a: (*a[:3], -0.5, *a[4:]), ValueError, "temperature must be finite and >= 0"),
        (lambda a: (*a[:3], float("nan"), *a[4:]), ValueError, "temperature"),
        (lambda a: (*a[:3], float("inf"), *a[4:]), ValueError, "temperature"),
        (lambda a: (*a[:4], -1, a[5]), ValueError, "top_k must be >= 0"),
        (lambda a: (*a[:5], 0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (lambda a: (*a[:5], 1.5), ValueError, "top_p"),
        (lambda a: (*a[:5], float("nan")), ValueError, "top_p"),
        # The value as given (repr), not rounded to 6 digits ("got 1").
        (lambda a: (*a[:5], 1.0000001), ValueError, r"top_p must be in \(0, 1\] \(1 = off\), got 1\.0000001$"),
        (lambda a: (*a[:3], -1e-300, *a[4:]), ValueError, r"temperature .*, got -1e-300$"),
        (lambda a: (*a[:3], float("inf"), *a[4:]), ValueError, r"temperature .*, got inf$"),
    ],
)
@pytest.mark.parametrize("op", OPS)
def test_bad_inputs(change, error, match, op):
    with pytest.raises(error, match=f"^{op}: .*{match}"):
        OPS[op](*change(bad_args()))
    # Checked before anything is written, greedy or not.
    args = list(change(bad_args()))
    if args[3] == 1.0:
        args[3] = 0.0
        with pytest.raises(error, match=match):
            OPS[op](*args)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(-0.5, 0, 1.0), (float("nan"), 0, 1.0), (1.0, -2, 1.0), (1.0, 0, 1.0000001), (1.0, 0, 0.0), (1e-320, 0, 1.5)],
)
@pytest.mark.parametrize("op", OPS)
def test_fake_kernel_checks_like_the_kernels(temperature, top_k, top_p, op):
    """Under torch.compile the fake kernel sees the arguments first: it refuses what the kernels
    refuse, with the same exception type and message."""
    logits, keys, step = bad_args()[:3]
    with pytest.raises(ValueError) as real:
        OPS[op](logits, keys, step, temperature, top_k, top_p)
    with FakeTensorMode() as mode, pytest.raises(ValueError) as fake:
        OPS[op](mode.from_tensor(logits), mode.from_tensor(keys), mode.from_tensor(step), temperature, top_k, top_p)
    assert str(fake.value) == str(real.value).splitlines()[0]


def test_error_names_the_op():
    with pytest.raises(ValueError, match="^sample_tokens: top_k"):
        torchkvops.ops.sample_tokens(*bad_args()[:4], -3, 1.0)
