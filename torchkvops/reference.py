"""Pure-PyTorch references of the torchkvops operators: the oracle the tests compare against."""

import torch
from torch import Tensor

from .sampling import STEP_SALT, TOKEN_SALT, _hash32


def repeat_kv_cache_(cache: Tensor, batch: int, repeats: int, num_tokens: int) -> None:
    prompts = cache[..., :batch, :, :num_tokens, :].clone()
    cache[..., : batch * repeats, :, :num_tokens, :] = prompts.repeat_interleave(repeats, dim=-4)


def repeat_kv_cache(cache: Tensor, repeats: int) -> Tensor:
    return cache.repeat_interleave(repeats, dim=-4)


def write_kv_(cache: Tensor, key: Tensor, value: Tensor, layer: int, start: Tensor) -> None:
    rows, tokens, first = key.shape[0], key.shape[2], int(start.reshape(()))
    cache[layer, 0, :rows, :, first : first + tokens] = key
    cache[layer, 1, :rows, :, first : first + tokens] = value


def gumbel_noise(keys: Tensor, step: Tensor, vocab: int) -> Tensor:
    """The sampler's Gumbel noise [rows, vocab] at decode step `step` (a 1-element tensor), float32."""
    step_key = _hash32(keys ^ _hash32(step + STEP_SALT))  # [rows]
    token = torch.arange(vocab, dtype=torch.long, device=keys.device)
    bits = _hash32(step_key[:, None] ^ _hash32(token + TOKEN_SALT)[None, :])
    u = (bits.to(torch.float32) + 0.5) * (1.0 / 4294967296.0)  # uniform in (0, 1]
    return -torch.log(-torch.log(u))


def perturbed_scores(logits: Tensor, keys: Tensor, step: Tensor, temperature: float, top_k: int,
                     top_p: float) -> Tensor:
    """What sample_tokens takes the argmax of when temperature > 0: the scaled logits with the tokens
    that top-k / top-p drop set to -inf, plus the Gumbel noise. [rows, vocab] float32."""
    logits = logits.float() / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits + gumbel_noise(keys, step, vocab)


def sample_tokens(logits: Tensor, keys: Tensor, step: Tensor, temperature: float, top_k: int,
                  top_p: float) -> Tensor:
    """Next token per row: logits [rows, vocab] -> [rows] int64. Greedy when temperature == 0."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    return perturbed_scores(logits, keys, step, temperature, top_k, top_p).argmax(dim=-1)
