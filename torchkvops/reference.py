"""Pure-PyTorch references of the torchkvops operators: the oracle the tests compare against."""

from torch import Tensor


def repeat_kv_cache_(cache: Tensor, batch: int, repeats: int, num_tokens: int) -> None:
    prompts = cache[..., :batch, :, :num_tokens, :].clone()
    cache[..., : batch * repeats, :, :num_tokens, :] = prompts.repeat_interleave(repeats, dim=-4)


def repeat_kv_cache(cache: Tensor, repeats: int) -> Tensor:
    return cache.repeat_interleave(repeats, dim=-4)
