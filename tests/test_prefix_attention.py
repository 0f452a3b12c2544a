"""torchkvops.training.prefix_attention alone: the shared-prefix attention (prefix causally, suffixes against the
prefix and themselves, merged by log-sum-exp), forward and backward, against dense masked attention in
float64, on the CPU, on the CUDA branch against the emulated memory-efficient kernels
(tests/mem_eff_emulator.py) and on a GPU. Through a model: tests/test_shared_forward.py."""

import contextlib

import pytest
import torch
from devices import CUDA
from mem_eff_emulator import emulated_cuda_branch

from torchkvops.fused_attention import MASKED_KEY_BIAS
from torchkvops.training.prefix_attention import shared_prefix_attention

# "emulated": CPU tensors through fused_attention's CUDA branch, against the emulated kernels.
DEVICES = ["cpu", "emulated", CUDA]


def dense_causal_attention(q, k, v, allowed, window=None, sinks=None, softcap=None):
    """Reference in float64: q [R, H, L, D], k, v [R, Hkv, L, D], allowed [R, L] key mask; `window`: a
    query at column i sees keys at columns j with i - window < j <= i; `sinks` [H]: a logit per head that
    joins every softmax with no value (gpt-oss's eager attention)."""
    per_kv = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(per_kv, 1).double(), v.repeat_interleave(per_kv, 1).double()
    length = q.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if window is not None:
        causal &= ~torch.ones(length, length, dtype=torch.bool).tril(-window)
    visible = causal & allowed[:, None, None, :]
    scores = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[None, :, None, None].expand(*scores.shape[:3], 1)
        return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1] @ v
    return torch.nan_to_num(scores.softmax(-1)) @ v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "groups,rows,prefix,suffix,heads,kv_heads",
    [(2, 3, 5, 4, 4, 2), (1, 8, 7, 3, 4, 1), (3, 2, 4, 0, 2, 2), (2, 1, 6, 5, 6, 3), (1, 2, 1, 9, 2, 2)],
)
def test_shared_prefix_attention_matches_dense_attention(groups, rows, prefix, suffix, heads, kv_heads, dtype, device):
    """Forward and backward (the merged-lse backward) against dense masked attention in float64, with
    left padding in the prefix and right padding in some suffixes."""
    g = torch.Generator().manual_seed(0)
    length, dim, total = prefix + suffix, 8, groups * rows

    def rand(h):
        t = torch.randn(groups, rows, h, length, dim, generator=g, dtype=torch.float64)
        t[:, 1:, :, :prefix] = t[:, :1, :, :prefix]  # the rows of a group share their prefix
        return t.view(total, h, length, dim)

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    allowed = torch.ones(total, length, dtype=torch.bool)
    allowed[:, : min(2, prefix - 1)] = False
    if suffix > 1:
        allowed[::2, -1] = False
    context = emulated_cuda_branch if device == "emulated" else contextlib.nullcontext
    device = "cpu" if device == "emulated" else device
    leaf = lambda t: t.to(device, dtype).requires_grad_()  # noqa: E731
    first = slice(0, total, rows)  # each group's first row holds the shared prefix
    q_pre, k_pre, v_pre = (leaf(t[first, :, :prefix]) for t in (q, k, v))
    q_suf, k_suf, v_suf = (leaf(t[:, :, prefix:]) for t in (q, k, v))
    masked = MASKED_KEY_BIAS
    bias_pre = torch.zeros(groups, 1, 1, prefix, dtype=dtype).masked_fill(~allowed[first, None, None, :prefix], masked)
    bias_suf = torch.zeros(total, 1, 1, suffix, dtype=dtype).masked_fill(~allowed[:, None, None, prefix:], masked)
    with context():
        out_pre, out_suf = shared_prefix_attention(
            q_pre, k_pre, v_pre, q_suf, k_suf, v_suf, bias_pre.to(device), bias_suf.to(device)
        )
    out = torch.cat([out_pre.repeat_interleave(rows, 0), out_suf], dim=2).cpu()

    reference_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = dense_causal_attention(*reference_inputs, allowed)
    real = allowed[:, None, :, None]  # queries at padding positions are not compared (nor given a gradient)
    grad = torch.randn(reference.shape, generator=g, dtype=torch.float64) * real
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close((out.double() * real), reference * real, **tol)
    with context():
        out.backward(grad.to(dtype))  # (through .cpu(): the gradients land on the device)
    dq, dk, dv = torch.autograd.grad(reference, reference_inputs, grad)

    def shared_part(t):  # the prefix's gradient is the sum over the group's rows
        return t.view(groups, rows, *t.shape[1:])[:, :, :, :prefix].sum(1)

    for got, want in (
        (q_pre.grad, shared_part(dq)),
        (k_pre.grad, shared_part(dk)),
        (v_pre.grad, shared_part(dv)),
        (q_suf.grad, dq[:, :, prefix:]),
        (k_suf.grad, dk[:, :, prefix:]),
        (v_suf.grad, dv[:, :, prefix:]),
    ):
        torch.testing.assert_close(got.cpu().double(), want, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [None, 1.5], ids=["", "softcap"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_a_common_prefix_then_groups_then_rows_match_dense_attention(kv_heads, window, sinks, softcap, device):
    """Three levels (a system prompt common to every row wherever its left padding puts it, each group's
    prompt, each row's completion), packed by pack_layout: forward and backward against dense masked
    causal attention over each row in float64, the rows read from the packed tokens they share; with a
    sliding window of 4 (counted in each row's own columns) too, which cuts across all three levels."""
    from torchkvops.training.prefix_attention import packed_attention
    from torchkvops.training.prefix_groups import Grouping, PrefixGroup, pack_layout

    g = torch.Generator().manual_seed(0)
    pads, common, length = torch.tensor([0, 0, 0, 2, 2, 1, 1, 1, 1]), 5, 14
    rows, heads, dim = len(pads), 4, 8
    allowed = torch.arange(length)[None] >= pads[:, None]
    allowed[1, -2:] = allowed[4, -1] = False  # right padding of some completions
    groups = [PrefixGroup((0, 1, 2), 6), PrefixGroup((3, 4), 7), PrefixGroup((5, 6, 7, 8), 6)]
    grouping = Grouping(groups, length, common, pads.numpy())
    context = emulated_cuda_branch if device == "emulated" else contextlib.nullcontext
    device = "cpu" if device == "emulated" else device
    layout = pack_layout(grouping, allowed.to(device))
    assert layout.tokens == common + (6 + 3 * 3) + (7 + 2 * 2) + (6 + 4 * 3)

    def rand(h):
        return torch.randn(1, h, layout.tokens, dim, generator=g, dtype=torch.float64)

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    sink = torch.randn(heads, generator=g, dtype=torch.float64) if sinks else None
    leaves = [t.to(device, torch.float32).requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sink is None else sink.to(device, torch.float32).requires_grad_()
    with context():
        out = packed_attention(*leaves, layout, None, window, sink_leaf, softcap)
    out = out[0].cpu().double()  # [T, H, D]

    reference_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    if sink is not None:
        reference_inputs.append(sink.clone().requires_grad_())

    def per_row(t):  # [1, h, T, D] -> [rows, h, length, D]: each row's tokens, from the packed ones
        return t[0][:, layout.dest.cpu()].unflatten(1, (rows, length)).transpose(0, 1)

    reference = dense_causal_attention(
        *(per_row(t) for t in reference_inputs[:3]),
        allowed,
        window,
        None if sink is None else reference_inputs[3],
        softcap,
    )  # [rows, H, L, D]
    got = out[layout.dest.cpu()].view(rows, length, heads, dim).transpose(1, 2)
    real = allowed[:, None, :, None]
    torch.testing.assert_close(got * real, reference * real, rtol=1e-4, atol=1e-5)
    # A gradient on each real query's output of each row; a shared token's is the sum over its rows.
    grad = torch.randn(reference.shape, generator=g, dtype=torch.float64) * real
    with context():
        (got * grad).sum().backward()
    got_leaves = leaves + ([] if sink_leaf is None else [sink_leaf])
    for got_grad, want in zip(got_leaves, torch.autograd.grad(reference, reference_inputs, grad)):
        torch.testing.assert_close(got_grad.grad.cpu().double(), want, rtol=1e-4, atol=1e-5)
