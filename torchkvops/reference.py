"""Pure-PyTorch references of the torchkvops operators: the oracle the tests compare against."""

import torch
from torch import Tensor

# The sampler's counter-based hash (torchkvops.rollout.sampling.row_keys and the sample_tokens oracle).
MASK32 = 0xFFFFFFFF
# The salts of the per-step and per-token hashes; the C++ kernels use the same (csrc/sample_tokens.h).
STEP_SALT = 0x5BD1E995
TOKEN_SALT = 0x27D4EB2F
LOW_SALT = 0x165667B1


def hash32(x):
    """A 32-bit integer mix of a tensor or a Python int (multipliers below 2**31, so int64 products
    never overflow)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & MASK32
    x = x ^ (x >> 16)
    return x


def repeat_kv_cache_(cache: Tensor, batch: int, repeats: int, num_tokens: int) -> None:
    prompts = cache[..., :batch, :, :num_tokens, :].clone()
    cache[..., : batch * repeats, :, :num_tokens, :] = prompts.repeat_interleave(repeats, dim=-4)


def repeat_kv_cache(cache: Tensor, repeats: int) -> Tensor:
    return cache.repeat_interleave(repeats, dim=-4)


def write_kv_(cache: Tensor, key: Tensor, value: Tensor, layer: int, start: Tensor) -> None:
    rows, tokens = key.shape[0], key.shape[2]
    starts = start.reshape(-1).tolist() * (rows if start.numel() == 1 else 1)
    for row, first in enumerate(starts):
        cache[layer, 0, row, :, first : first + tokens] = key[row]
        cache[layer, 1, row, :, first : first + tokens] = value[row]


def write_kv_slots_(cache: Tensor, key: Tensor, value: Tensor, layer: int, slots: Tensor) -> None:
    block_size = cache.shape[4]
    for row, row_slots in enumerate(slots.reshape(key.shape[0], key.shape[2]).tolist()):
        for token, slot in enumerate(row_slots):
            cache[layer, 0, slot // block_size, :, slot % block_size] = key[row, :, token]
            cache[layer, 1, slot // block_size, :, slot % block_size] = value[row, :, token]


def merge_attention_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """ops.merge_attention_states in eager PyTorch, with the same edge cases (see its docstring)."""
    a, b = out_a.float(), out_b.float()
    bad = lse_a.isnan() | lse_b.isnan() | (lse_a == float("inf")) | (lse_b == float("inf"))
    m = torch.maximum(lse_a, lse_b)
    both_empty = m == float("-inf")
    m = torch.where(both_empty | bad, 0.0, m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)  # both empty: 0 and 0
    s = wa + wb
    lse = torch.where(bad, float("nan"), m + torch.log(s))  # both empty: log(0) = -inf
    s = torch.where(both_empty, 1.0, s)
    ca, cb = torch.where(bad, float("nan"), wa / s), torch.where(bad, float("nan"), wb / s)
    ca, cb = ca.unsqueeze(-1), cb.unsqueeze(-1)
    # A zero weight drops its term: the empty part's output is never read (it may be NaN).
    out = torch.where(ca == 0, b, torch.where(cb == 0, a, ca * a + cb * b))
    out = torch.where(both_empty.unsqueeze(-1), 0.0, out)
    return out.to(out_a.dtype), lse


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_positions: Tensor | None = None,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    seq_starts: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Row by row: gather the row's keys [start, length) from its blocks, then dense attention in float32
    over the keys it sees (out 0 and lse -inf where it sees none)."""
    rows, heads, dim = query.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    scale = dim**-0.5 if scale is None else scale
    out = torch.zeros(rows, heads, dim, dtype=torch.float32)
    lse = torch.full((rows, heads), float("-inf"))
    for r in range(rows):
        length = int(seq_lens[r])
        start = 0 if seq_starts is None else int(seq_starts[r])
        t = torch.arange(start, length)
        blocks = block_tables[r, t // block_size].long()
        k = key_cache[blocks, :, t % block_size].float().cpu()  # [length, kv_heads, dim]
        v = value_cache[blocks, :, t % block_size].float().cpu()
        per_kv = heads // kv_heads
        k, v = k.repeat_interleave(per_kv, dim=1), v.repeat_interleave(per_kv, dim=1)  # [length, heads, dim]
        scores = torch.einsum("hd,thd->ht", query[r].float().cpu(), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        position = torch.full((heads,), length - 1) if query_positions is None else query_positions[r].cpu().long()
        seen = t[None, :] <= position[:, None]
        if window > 0:
            seen &= position[:, None] - t[None, :] < window
        scores = scores.masked_fill(~seen, float("-inf"))
        any_seen = seen.any(dim=1)
        lse[r] = torch.where(any_seen, torch.logsumexp(scores, dim=1), float("-inf"))
        weights = torch.softmax(scores, dim=1).nan_to_num(0.0)
        out[r] = torch.einsum("ht,thd->hd", weights, v)
    return out.to(query.dtype), lse


def noise_words(keys: Tensor, step: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """The high and low 32 bits of each token's 64-bit noise word at decode step `step` (a 1-element
    tensor, or [rows]: one step per row): two [rows, vocab] int64 tensors holding values in [0, 2^32).
    For one token the map from (key, step) (their low 32 bits) to the word is a bijection."""
    step = step.reshape(()) if step.numel() == 1 else step  # one step for every row, or one per row
    row_high = hash32(keys ^ hash32(step + STEP_SALT))  # [rows]
    row_low = hash32(step ^ hash32(row_high + LOW_SALT))  # [rows]
    token = torch.arange(vocab, dtype=torch.long, device=keys.device)
    high = hash32(row_high[:, None] ^ hash32((token + TOKEN_SALT)[None, :] ^ row_low[:, None]))
    return high, hash32(row_low[:, None] ^ high)


def gumbel_from_words(high: Tensor, low: Tensor) -> Tensor:
    """Gumbel noise -log(-log(u)) of u = (x + 1/2) 2^-64, x = high * 2^32 + low, in float32 as the kernels
    compute it: -log(u) from u itself when u < 1/2, from its complement (~x + 1/2) 2^-64 with log1p
    otherwise, so both tails keep float32's relative precision. In [-3.81, 45.06]."""
    upper = high >= 2**31
    y_high = torch.where(upper, high ^ 0xFFFFFFFF, high)  # < 2^31: exact in float32 products below
    y_low = torch.where(upper, low ^ 0xFFFFFFFF, low)
    v = (y_high.to(torch.float32) * 4294967296.0 + (y_low.to(torch.float32) + 0.5)) * 2.0**-64
    e = torch.where(upper, -torch.log1p(-v), -torch.log(v))
    return -torch.log(e)


def gumbel_noise(keys: Tensor, step: Tensor, vocab: int) -> Tensor:
    """The sampler's Gumbel noise [rows, vocab] at decode step `step` (1 element or [rows]), float32."""
    return gumbel_from_words(*noise_words(keys, step, vocab))


def processed_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """What sample_tokens draws from, as float32 logits [..., vocab]: the raw logits when greedy
    (temperature 0), else logits / temperature with the tokens that top-k / top-p drop set to -inf."""
    logits = logits.float()
    if temperature == 0.0:
        return logits
    logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, _ = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays),
        # then keep every token tied with the smallest kept value: a token is kept exactly when the
        # tokens with a strictly larger value hold less than top_p, as the kernels decide. (NaN
        # probabilities, from a NaN or an infinite logit, drop nothing.)
        kept_sorted = ~((probs.cumsum(dim=-1) - probs) >= top_p)
        smallest_kept = sorted_logits.masked_fill(~kept_sorted, float("inf")).amin(dim=-1, keepdim=True)
        logits = logits.masked_fill(logits < smallest_kept, float("-inf"))
    return logits


def perturbed_scores(
    logits: Tensor, keys: Tensor, step: Tensor, temperature: float, top_k: int, top_p: float
) -> Tensor:
    """What sample_tokens takes the argmax of when temperature > 0: the scaled logits with the tokens
    that top-k / top-p drop set to -inf, plus the Gumbel noise. [rows, vocab] float32."""
    return processed_logits(logits, temperature, top_k, top_p) + gumbel_noise(keys, step, logits.shape[-1])


def sample_tokens(logits: Tensor, keys: Tensor, step: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """Next token per row: logits [rows, vocab] -> [rows] int64. Greedy when temperature == 0."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    return perturbed_scores(logits, keys, step, temperature, top_k, top_p).argmax(dim=-1)


def processed_logprobs(logits: Tensor, tokens: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """The log-probability of `tokens` [...] under the distribution sample_tokens draws from given
    `logits` [..., vocab] (vLLM's processed logprobs): log_softmax of processed_logits. float32 [...]."""
    logprobs = processed_logits(logits, temperature, top_k, top_p).log_softmax(dim=-1)
    return logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sample_tokens_with_logprobs(
    logits: Tensor, keys: Tensor, step: Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[Tensor, Tensor]:
    """sample_tokens and the drawn tokens' processed log-probabilities: ([rows] int64, [rows] float32)."""
    tokens = sample_tokens(logits, keys, step, temperature, top_k, top_p)
    return tokens, processed_logprobs(logits, tokens, temperature, top_k, top_p)
