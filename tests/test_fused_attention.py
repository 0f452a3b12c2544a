"""torchkvops.fused_attention, the one dispatcher of torch's fused attention kernels for decode and
training: forward and log-sum-exp against a float64 reference (causal or not, grouped-query heads,
masks of every width), backward against autograd through the reference, and the CUDA alignment rule
(a bias whose rows do not start at 16-byte boundaries is copied; one that does is used as it is)."""

import pytest
import torch
from devices import DEVICES

from torchkvops.fused_attention import _cuda_bias, attend, attend_backward


def reference(q, k, v, bias, causal, scale):
    heads = q.shape[1]
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1).double() for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale + bias.double()
    if causal:
        m, n = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(m, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("length", [5, 8, 13])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_forward_and_backward_equal_the_reference(device, causal, length, heads, kv_heads):
    g = torch.Generator().manual_seed(length)
    queries = length if causal else 3
    q = torch.randn(3, heads, queries, 16, generator=g).to(device).requires_grad_()
    k, v = (torch.randn(3, kv_heads, length, 16, generator=g).to(device).requires_grad_() for _ in range(2))
    bias = torch.zeros(3, 1, 1, length, device=device)
    bias[1, ..., : length // 2] = torch.finfo(torch.float32).min  # row 1 cannot see its first keys
    scale = 16**-0.5
    out, lse = attend(q.detach(), k.detach(), v.detach(), bias, causal=causal, scale=scale)
    ref_out, ref_lse = reference(q, k, v, bias, causal, scale)
    real = ref_lse > -1e30  # queries that see a key (a causal row 1 query before its first key sees none)
    torch.testing.assert_close(out[real].double(), ref_out.detach()[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[real].double(), ref_lse.detach()[real], atol=1e-5, rtol=1e-5)
    grad = torch.randn(out.shape, generator=g).to(device) * real[..., None]
    dq, dk, dv = attend_backward(
        grad, q.detach(), k.detach(), v.detach(), bias, causal=causal, scale=scale, out=out, lse=lse
    )
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), grad.double())
    for got, want in zip((dq, dk, dv), ref_grads):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "dtype,length,copied",
    [(torch.bfloat16, 8, False), (torch.bfloat16, 5, True), (torch.float32, 4, False), (torch.float32, 6, True)],
)
def test_the_cuda_bias_is_copied_only_when_its_rows_are_misaligned(dtype, length, copied):
    bias = torch.randn(3, 1, 1, length).to(dtype)
    view = _cuda_bias(bias, heads=4, queries=2)
    assert view.shape == (3, 4, 2, length) and torch.equal(view[:, 0, 0], bias[:, 0, 0])
    assert (view.data_ptr() != bias.data_ptr()) == copied
    assert view.stride(0) * view.element_size() % 16 == 0  # every row starts on a 16-byte boundary
