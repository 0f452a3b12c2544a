"""A CPU emulator of the contract of torch's memory-efficient attention kernels, the ones
`torchkvops.fused_attention` calls on CUDA, so that the CPU suite runs the CUDA branch's argument
preparation, layouts and masking (`fused_attention.memory_efficient_kernels(emulator.kernels, "cpu")`).

What it reproduces, read in `aten/src/ATen/native/transformers/cuda/mem_eff_attention/kernel_forward.h`,
`kernel_backward.h`, `epilogue_rescale_output.h`, `attention.cu` and `attention_backward.cu` (sm80+):
- the checks that raise: q/k/v/bias last-dim contiguous, one head count for q, k and v, the bias in q's
  dtype and of shape [B, H, M, L]; the bias read with 128-bit loads, so its start and its batch, head and
  query strides (where that dim is > 1) must be 16-byte aligned (a misaligned start is a hard "misaligned
  address" fault on the GPU: a ContractError here);
- forward scores in float32 as (q.k * scale + bias), causal keys -inf, then * log2(e), softmax by exp2:
  a bias below about -2.4e38 overflows to -inf there. A query whose every score is -inf ("fully masked")
  gets what `masked_rows` says: "nan" (torch before pytorch#131863: out NaN from 0/0, lse -inf) or
  "zero" (after it: out 0, lse 0). Probabilities are rounded to q's dtype before P @ V, as the kernel
  stores them in shared memory;
- the forward's outputs as the kernels lay them out: out [B, H, M, D] as a view of a contiguous
  [B, M, H, D] buffer, lse [B, H, ceil(M / 32) * 32] with +inf past the last query;
- backward: P = exp(q.k * scale + bias - lse) (natural exp), lse read unguarded up to the 32-row tile, so
  its padding must be the forward's +inf (anything else is a ContractError: the kernel's out-of-range
  rows would then contribute); `out` read with its batch and head strides but with the query stride
  heads * head_dim (the forward's layout), as `computeDelta` reads it: for fp16/bf16 the kernel computes
  delta = rowsum(dO * O) from that read (memory past the storage's end reads as NaN here); for float32
  torch computes delta from the tensor itself, honouring its strides.
What it cannot show: the kernels' tiling, their exact rounding (sums in another order), dropout, and
anything the hardware does; those need a GPU (tests marked `cuda`)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from torchkvops.fused_attention import MemoryEfficientKernels

LOG2E = 1.4426950408889634  # the kernel's kLog2e, as float32 below
LSE_TILE = 32  # kAlignLSE: the backward's query block
ALIGNMENT_BYTES = 16  # 128-bit loads of the bias


class ContractError(RuntimeError):
    """A call the real kernel would refuse, fault on, or answer with memory it was not given."""


@dataclasses.dataclass
class MemoryEfficientEmulator:
    masked_rows: str = "nan"  # "nan" (torch before the fully-masked-row fix) or "zero" (after it)
    calls: list = dataclasses.field(default_factory=list)  # ("forward" | "backward", dtype) per call

    @property
    def kernels(self) -> MemoryEfficientKernels:
        return MemoryEfficientKernels(self.forward, self.backward)

    # --- forward: aten._scaled_dot_product_efficient_attention ---------------------------------------
    def forward(self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
        self.calls.append(("forward", query.dtype))
        batch, heads, m, _ = query.shape
        _check_inputs(query, key, value, attn_bias, dropout_p)
        scores = _scores(query, key, attn_bias, is_causal, scale)  # [B, H, M, L] float32
        scaled = scores * torch.tensor(LOG2E, dtype=torch.float32)  # may overflow to -inf
        mi = scaled.amax(dim=-1, keepdim=True)
        masked = mi == float("-inf")
        p = torch.exp2(scaled - torch.where(masked, 0.0, mi))  # 0 everywhere in a fully masked row
        s = p.sum(dim=-1, keepdim=True)
        out = p.to(query.dtype).float() @ value.float()
        if self.masked_rows == "zero":
            out = out / torch.where(s == 0, 1.0, s)
            lse = torch.where(masked, 0.0, mi / LOG2E + torch.log(s))
        else:
            out = out / s  # 0 / 0 = NaN in a fully masked row
            lse = mi / LOG2E + torch.log(s)  # -inf there
        buffer = torch.empty(batch, m, heads, value.shape[-1], dtype=query.dtype)  # [B, M, H, D]
        buffer.copy_(out.transpose(1, 2))
        lse_len = math.ceil(m / LSE_TILE) * LSE_TILE if compute_log_sumexp else 0
        padded = torch.full((batch, heads, lse_len), float("inf"))
        if compute_log_sumexp:
            padded[..., :m] = lse[..., 0]
        seed = torch.zeros((), dtype=torch.int64)
        return buffer.transpose(1, 2), padded, seed, seed.clone()

    # --- backward: aten._scaled_dot_product_efficient_attention_backward ---------------------------
    def backward(
        self,
        grad_out,
        query,
        key,
        value,
        attn_bias,
        out,
        logsumexp,
        philox_seed,
        philox_offset,
        dropout_p,
        grad_input_mask,
        is_causal=False,
        *,
        scale=None,
    ):
        self.calls.append(("backward", query.dtype))
        batch, heads, m, dim = query.shape
        _check_inputs(query, key, value, attn_bias, dropout_p)
        lse = _read_lse(logsumexp, batch, heads, m)
        if query.dtype in (torch.float16, torch.bfloat16):  # kKernelComputesDelta: O read by the kernel
            o = _read_out_as_kernel(out, batch, heads, m, value.shape[-1])
        else:  # torch computes delta from the tensor, strides and all
            o = out.float()
        delta = (grad_out.float() * o).sum(dim=-1, keepdim=True)  # [B, H, M, 1]
        scores = _scores(query, key, attn_bias, is_causal, scale)
        p = torch.exp(scores - lse[..., None])
        d_out = grad_out.float()
        d_p = d_out @ value.float().transpose(-1, -2)
        d_s = p * (d_p - delta)
        softmax_scale = torch.tensor(_scale(query, scale), dtype=torch.float32)
        dq = (d_s @ key.float()) * softmax_scale
        dk = (d_s.transpose(-1, -2) @ query.float()) * softmax_scale
        dv = p.to(query.dtype).float().transpose(-1, -2) @ d_out
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), torch.empty(0, dtype=query.dtype)


def _scale(query: Tensor, scale: float | None) -> float:
    return query.shape[-1] ** -0.5 if scale is None else scale


def _scores(query, key, bias, causal, scale) -> Tensor:
    """q.k * scale + bias in float32, causal keys -inf (top-left aligned), as both kernels compute them."""
    scores = (query.float() @ key.float().transpose(-1, -2)) * torch.tensor(_scale(query, scale), dtype=torch.float32)
    if bias is not None:
        scores = scores + bias.float()
    if causal:
        m, n = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(m, n, dtype=torch.bool).triu(1), float("-inf"))
    return scores


def _check_inputs(query, key, value, bias, dropout_p) -> None:
    if dropout_p != 0.0:
        raise ContractError("the emulator has no dropout")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4 or t.stride(-1) != 1:
            raise ContractError(f"{name} must be 4-D with a contiguous last dim, got {tuple(t.shape)} {t.stride()}")
        if t.dtype != query.dtype or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ContractError(f"{name}: dtype {t.dtype} (query {query.dtype})")
    if key.shape[1] != query.shape[1] or value.shape[1] != query.shape[1]:
        raise ContractError(f"query, key and value must have one head count, got {query.shape[1]}, {key.shape[1]}")
    if bias is None:
        return
    batch, heads, m, _ = query.shape
    if tuple(bias.shape) != (batch, heads, m, key.shape[2]):
        raise ContractError(f"attn_bias: wrong shape {tuple(bias.shape)}, want {(batch, heads, m, key.shape[2])}")
    if bias.dtype != query.dtype:
        raise ContractError("invalid dtype for bias - should match query's dtype")
    if bias.stride(3) != 1:
        raise ContractError("attn_bias: wrong alignment (last dimension must be contiguous)")
    if bias.data_ptr() % ALIGNMENT_BYTES:
        raise ContractError(f"attn_bias starts at {bias.data_ptr()} (not 16-byte aligned): misaligned address")
    per_row = ALIGNMENT_BYTES // bias.element_size()
    for dim, (size, label) in enumerate(((batch, "strideB"), (heads, "strideH"), (m, "strideM"))):
        if size > 1 and bias.stride(dim) % per_row:
            raise ContractError(
                f"attn_bias is not correctly aligned ({label}). attn_bias.stride({dim}) = {bias.stride(dim)}, "
                f"and should be a multiple of {per_row}."
            )


def _read_lse(logsumexp: Tensor, batch: int, heads: int, m: int) -> Tensor:
    """The rows of lse the backward reads: [B, H, M]; checks the padding it reads past M."""
    tile_end = math.ceil(m / LSE_TILE) * LSE_TILE
    if logsumexp.dtype != torch.float32 or logsumexp.shape[:2] != (batch, heads) or logsumexp.stride(-1) != 1:
        raise ContractError(f"logsumexp must be float32 [B, H, >= M] with stride 1, got {tuple(logsumexp.shape)}")
    if logsumexp.shape[-1] < tile_end:
        raise ContractError(f"the backward reads logsumexp up to {tile_end} queries, it holds {logsumexp.shape[-1]}")
    if heads > 1 and logsumexp.stride(1) % 8:
        raise ContractError("LSE is not correctly aligned (strideH)")
    pad = logsumexp[..., m:tile_end]
    if not bool((pad == float("inf")).all()):
        raise ContractError(
            "logsumexp past the last query must be +inf (the forward's padding): the backward reads the whole "
            f"{LSE_TILE}-query tile, and its out-of-range rows then contribute, got {pad.unique().tolist()}"
        )
    return logsumexp[..., :m]


def _read_out_as_kernel(out: Tensor, batch: int, heads: int, m: int, dim: int) -> Tensor:
    """`out` [B, H, M, D] as computeDelta reads it: batch and head strides from the tensor, query stride
    heads * dim (the forward's [B, M, H, D] layout). Memory past the storage's end reads as NaN."""
    storage = out.untyped_storage()
    flat = torch.empty(0, dtype=out.dtype).set_(storage, 0, (storage.nbytes() // out.element_size(),), (1,))
    index = (
        out.storage_offset()
        + torch.arange(batch)[:, None, None, None] * out.stride(0)
        + torch.arange(heads)[None, :, None, None] * out.stride(1)
        + torch.arange(m)[None, None, :, None] * (heads * dim)
        + torch.arange(dim)[None, None, None, :]
    )
    inside = index < flat.numel()
    values = flat.float()[index.clamp(max=max(flat.numel() - 1, 0))]
    return torch.where(inside, values, float("nan"))


def emulated_cuda_branch(masked_rows: str = "nan"):
    """A context in which CPU tensors take fused_attention's CUDA branch, against a new emulator
    (returned by `with ... as emulator`)."""
    import contextlib

    from torchkvops.fused_attention import memory_efficient_kernels

    @contextlib.contextmanager
    def context():
        emulator = MemoryEfficientEmulator(masked_rows)
        with memory_efficient_kernels(emulator.kernels, "cpu"):
            yield emulator

    return context()


def recording_bias_copies():
    """A context in which every bias fused_attention's CUDA branch prepares is recorded: the list it yields
    gets, per bias, whether it was copied (for the kernels' alignment) rather than passed as it is."""
    import contextlib

    from torchkvops import fused_attention

    @contextlib.contextmanager
    def context():
        original, copied = fused_attention._cuda_bias, []

        def spy(bias, heads, queries):
            view = original(bias, heads, queries)
            copied.append(view.data_ptr() != bias.data_ptr())
            return view

        fused_attention._cuda_bias = spy
        try:
            yield copied
        finally:
            fused_attention._cuda_bias = original

    return context()
