"""The model a command runs: its dtype (resolve_dtype); its config, read before the model is built so
that the sizes can be checked against it (load_config); the model and its tokenizer (load_model:
random weights of a named shape, or a local checkpoint loaded offline); and the token ids they imply
(special_ids, vocab_size, pad_id). No torch or transformers at import time.
"""

from __future__ import annotations

import importlib.util
import sys

from .checks import CLIError, model_source
from .launch import current_rank, say

__all__ = ["DTYPE_NAMES", "resolve_dtype", "load_config", "load_model", "special_ids", "vocab_size", "pad_id", "eos_id"]

DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def resolve_dtype(name: str | None, device):
    import torch

    if name is None:
        name = "fp32" if device.type == "cpu" else "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    dtype = getattr(torch, DTYPE_NAMES[name])
    try:  # the models need matmul in this dtype on this device
        a = torch.ones(8, 8, dtype=dtype, device=device)
        (a @ a).sum().item()
    except RuntimeError as e:
        raise CLIError(f"--dtype {name} is not supported for matmul on {device}: {' '.join(str(e).split())}") from None
    if (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise CLIError(f"--dtype bf16: {torch.cuda.get_device_name(device)} has no native bf16; use fp16")
    if device.type == "cpu" and dtype == torch.float16:
        if current_rank() == 0:
            print(
                "torchkvops: note: fp16 on CPU works but is slow on most CPUs; fp32 or bf16 are faster", file=sys.stderr
            )
    return name, dtype


def load_config(args):
    """(config, source): the model's config, read before the model is built so that the sizes can be
    checked against it. source is the checkpoint folder or cached name, None for --model-shape."""
    if not args.model:
        from ..models import model_config

        return model_config(args.model_shape), None
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr is for errors
    source, is_name = model_source(args.model)
    try:
        folder, gguf = _gguf_parts(source)
        config = AutoConfig.from_pretrained(folder, local_files_only=True, **gguf)
    except OSError as e:
        if is_name:  # a name: transformers' message is about the network, say it plainly
            raise CLIError(
                f"--model {args.model}: no such folder, and no such model in the local Hugging Face "
                "cache (offline: nothing is downloaded)"
            ) from None
        raise CLIError(f"--model {args.model}: cannot read its config: {' '.join(str(e).split())}") from None
    except (ValueError, TypeError, KeyError) as e:
        raise CLIError(f"--model {args.model}: cannot read its config: {' '.join(str(e).split())}") from None
    return config, source


def _gguf_parts(source: str) -> tuple[str, dict]:
    """(folder, {"gguf_file": name}) for a GGUF file, as transformers takes it (which needs the `gguf`
    package); (source, {}) for a checkpoint folder or a name."""
    from ..models.gguf import is_gguf, split_gguf

    if not is_gguf(source):
        return source, {}
    if importlib.util.find_spec("gguf") is None:
        raise CLIError(f"--model {source}: a GGUF file needs the gguf package (pip install gguf)")
    folder, name = split_gguf(source)
    return folder, {"gguf_file": name}


def load_model(args, config, source, device, dtype):
    """(model, tokenizer or None, description). Without --model: random weights of --model-shape."""
    if source is None:
        from ..models import build_model

        model = build_model(args.model_shape, dtype, device, seed=0)  # --seed changes prompts and sampling only
        say(
            f"model: {args.model_shape} shape with RANDOM weights (built in memory, nothing downloaded); "
            "its tokens are not meaningful text"
        )
        return model, None, f"{args.model_shape} (random weights)"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models.gguf import is_gguf

    try:
        if is_gguf(source):  # dequantized, as a plain model
            from ..models.gguf import load_gguf

            model, tokenizer = load_gguf(source, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise CLIError(f"--model {args.model}: cannot load a causal LM: {' '.join(str(e).split())}") from None
    model = model.to(device).eval()
    if not is_gguf(source):
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, padding_side="left")
        except (OSError, ValueError, TypeError, KeyError):
            tokenizer = None
    if tokenizer is not None and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    params = sum(p.numel() for p in model.parameters())
    size = (
        f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M" if params >= 1e6 else f"{params / 1e3:.1f}k"
    )
    say(
        f"model: {args.model} ({type(model).__name__}, {size} parameters"
        f"{'' if tokenizer is not None else ', no tokenizer'})"
    )
    return model, tokenizer, str(args.model)


def special_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
            v = getattr(cfg, attr, None)
            ids.update([v] if isinstance(v, int) else [i for i in (v or []) if isinstance(i, int)])
    if tokenizer is not None:
        ids.update(tokenizer.all_special_ids)
    return ids


def vocab_size(model, tokenizer) -> int:
    n = model.get_input_embeddings().num_embeddings
    return min(n, len(tokenizer)) if tokenizer is not None else n


def pad_id(model, tokenizer) -> int:
    """The pad id for model.generate: the tokenizer's, else the generation config's or the model
    config's pad id, else its first EOS id, else 0."""
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    gen = getattr(model, "generation_config", None)
    for cfg, attr in (
        (gen, "pad_token_id"),
        (model.config, "pad_token_id"),
        (gen, "eos_token_id"),
        (model.config, "eos_token_id"),
    ):
        v = getattr(cfg, attr, None)
        v = v[0] if isinstance(v, (list, tuple)) and v else v
        if isinstance(v, int):
            return v
    return 0


def eos_id(model, tokenizer) -> int | None:
    """The EOS id responses end with: the tokenizer's, else the generation config's or the model
    config's first; None when none is known."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    for cfg in (getattr(model, "generation_config", None), model.config):
        v = getattr(cfg, "eos_token_id", None)
        v = v[0] if isinstance(v, (list, tuple)) and v else v
        if isinstance(v, int):
            return v
    return None
