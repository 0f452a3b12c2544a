"""Pure-PyTorch references of the torchkvops operators: the oracle the tests compare against."""

from torch import Tensor


def repeat_kv_cache_(cache: Tensor, batch: int, repeats: int, num_tokens: int) -> None:
    prompts = cache[..., :batch, :, :num_tokens, :].clone()
    cache[..., : batch * repeats, :, :num_tokens, :] = prompts.repeat_interleave(repeats, dim=-4)


def repeat_kv_cache(cache: Tensor, repeats: int) -> Tensor:
    return cache.repeat_interleave(repeats, dim=-4)


def write_kv_(cache: Tensor, key: Tensor, value: Tensor, layer: int, start: Tensor) -> None:
    rows, tokens, first = key.shape[0], key.shape[2], int(start.reshape(()))
    cache[layer, 0, :rows, :, first : first + tokens] = key
    cache[layer, 1, :rows, :, first : first + tokens] = value
