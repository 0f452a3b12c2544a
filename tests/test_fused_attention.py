"""torchkvops.fused_attention, the one dispatcher of torch's fused attention kernels for decode and
training: forward and log-sum-exp against a float64 reference (causal or not, grouped-query heads,
masks of every width), backward against autograd through the reference, and the CUDA branch on the CPU
against an emulator of the memory-efficient kernels' contract (tests/mem_eff_emulator.py): the layout
of `out` the backward assumes, the +inf padding of the log-sum-exp, the float32 overflow of a masked
key's bias, the bias's alignment (a bias whose start or rows are not 16-byte aligned is copied; one that
is aligned is used as it is)."""

import pytest
import torch
from devices import DEVICES
from mem_eff_emulator import ContractError, MemoryEfficientEmulator, emulated_cuda_branch

from torchkvops.fused_attention import MASKED_KEY_BIAS, _cuda_bias, attend, attend_backward


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


# --- the CUDA branch on the CPU, against the emulator ------------------------------------------------
MASKED_ROWS = ["nan", "zero"]  # what the kernel gives a query whose every key is -inf (mem_eff_emulator)


def inputs(dtype, heads, kv_heads, queries, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, heads, queries, 16, generator=g).to(dtype)
    k, v = (torch.randn(3, kv_heads, length, 16, generator=g).to(dtype) for _ in range(2))
    return q, k, v, g


@pytest.mark.parametrize("masked_rows", MASKED_ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_the_cuda_branch_equals_the_reference_on_the_emulated_kernels(heads, kv_heads, causal, dtype, masked_rows):
    """Forward, log-sum-exp and backward of the CUDA branch, with a left-padded row (a causal query before
    its first key sees no key at all) masked by MASKED_KEY_BIAS: finite everywhere, and equal to float64
    autograd at every query that sees a key."""
    length = 37  # past one 32-query tile: the backward reads a second, padded tile
    queries = length if causal else 5
    q, k, v, g = inputs(dtype, heads, kv_heads, queries, length)
    bias = torch.zeros(3, 1, 1, length, dtype=dtype)
    bias[1, ..., :6] = MASKED_KEY_BIAS
    scale = 16**-0.5
    with emulated_cuda_branch(masked_rows) as emulator:
        out, lse = attend(q, k, v, bias, causal=causal, scale=scale)
        sees_a_key = torch.ones(3, 1, queries, 1, dtype=torch.bool)
        if causal:
            sees_a_key[1, :, :6] = False
        grad = torch.randn(out.shape, generator=g).to(dtype) * sees_a_key  # packed_attention zeroes the others
        dq, dk, dv = attend_backward(grad, q, k, v, bias, causal=causal, scale=scale, out=out, lse=lse)
    assert emulator.calls == [("forward", dtype), ("backward", dtype)]
    for t in (out, lse, dq, dk, dv):
        assert torch.isfinite(t).all()
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, bias, causal, scale)
    real = sees_a_key.expand_as(out)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.03, rtol=0.03)
    torch.testing.assert_close(out[real].double(), ref_out.detach()[real], **tol)
    torch.testing.assert_close(lse[real[..., 0]].double(), ref_lse.detach()[real[..., 0]], **tol)
    for got, want in zip((dq, dk, dv), torch.autograd.grad(ref_out, leaves, grad.double())):
        torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_backward_gets_out_in_the_forwards_layout(dtype):
    """The half-precision backward kernel reads `out` with query stride heads * head_dim: an `out` laid out
    as [X, H, M, D] (what a merge or a fold returns) must reach it in the forward's [X, M, H, D] layout,
    or dq and dk come out wrong (dv stays right)."""
    q, k, v, g = inputs(dtype, 4, 4, 9, 9)
    bias = torch.zeros(3, 1, 1, 9, dtype=dtype)
    grad = torch.randn(q.shape, generator=g).to(dtype)
    with emulated_cuda_branch():
        out, lse = attend(q, k, v, bias, causal=True)
        natural = attend_backward(grad, q, k, v, bias, causal=True, scale=None, out=out, lse=lse)
        relaid = attend_backward(grad, q, k, v, bias, causal=True, scale=None, out=out.contiguous(), lse=lse)
    assert out.stride(2) == 4 * 16 and out.contiguous().stride(2) == 16  # the two layouts differ
    for a, b in zip(natural, relaid):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_backward_pads_the_log_sum_exp_with_inf_as_the_forward_does():
    """The emulated backward reads the whole 32-query tile and refuses padding other than +inf (the
    forward's): attend_backward's own padding must pass, for a log-sum-exp given unpadded."""
    q, k, v, g = inputs(torch.float32, 2, 2, 8, 8)
    bias = torch.zeros(3, 1, 1, 8)
    emulator = MemoryEfficientEmulator()
    out, padded, _, _ = emulator.forward(q, k, v, bias.expand(3, 2, 8, 8), True, 0.0, True)
    assert padded.shape[-1] == 32 and torch.isinf(padded[..., 8:]).all()
    zeros = padded.clone()
    zeros[..., 8:] = 0
    with pytest.raises(ContractError, match=r"must be \+inf"):
        emulator.backward(out, q, k, v, bias.expand(3, 2, 8, 8), out, zeros, None, None, 0.0, [True] * 3, True)
    with emulated_cuda_branch():
        dq, _, _ = attend_backward(
            torch.ones_like(out), q, k, v, bias, causal=True, scale=None, out=out, lse=padded[..., :8]
        )
    assert torch.isfinite(dq).all()


def test_a_float32_minimum_bias_makes_nan_gradients_on_the_kernels_and_the_masked_key_bias_does_not():
    """Why masks use MASKED_KEY_BIAS: (q.k * scale + finfo.min) * log2(e) overflows to -inf in float32,
    so a query with every key masked is fully masked for the kernel: NaN out and -inf lse (torch before
    the masked-row fix), and NaN gradients. MASKED_KEY_BIAS keeps the row finite."""
    q, k, v, g = inputs(torch.float32, 2, 2, 4, 4)
    grad = torch.zeros(q.shape)  # the blind query's output is zeroed downstream: no gradient reaches it
    grad[0] = 1.0

    def grads(masked):
        bias = torch.zeros(3, 1, 1, 4)
        bias[1] = masked  # row 1 sees no key
        with emulated_cuda_branch("nan"):
            out, lse = attend(q, k, v, bias, scale=None)
            return attend_backward(grad, q, k, v, bias, causal=False, scale=None, out=out, lse=lse)

    assert not all(torch.isfinite(t).all() for t in grads(torch.finfo(torch.float32).min))
    assert all(torch.isfinite(t).all() for t in grads(MASKED_KEY_BIAS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_masked_key_bias_is_finite_in_every_dtype_and_masks_exactly(dtype):
    value = torch.tensor(MASKED_KEY_BIAS, dtype=dtype)
    assert torch.isfinite(value) and value <= -6e4
    assert torch.isfinite(value.float() * 1.4426950408889634) and torch.exp(value.float() + 1000.0) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_bias_view_that_starts_off_a_16_byte_boundary_is_copied(dtype):
    """Rows 16-byte aligned relative to each other, but the view starts 2 elements into its storage: the
    kernel's 128-bit loads would fault on it (the emulator raises), so _cuda_bias copies it."""
    storage = torch.zeros(2 + 3 * 8, dtype=dtype)
    bias = storage[2:].view(3, 1, 1, 8)
    assert bias.stride(0) * bias.element_size() % 16 == 0 and bias.storage_offset() * bias.element_size() % 16
    view = _cuda_bias(bias, heads=2, queries=1)
    assert view.data_ptr() % 16 == 0 and torch.equal(view[:, 0, 0], bias[:, 0, 0])
    q, k, v, _ = inputs(dtype, 2, 2, 1, 8)
    with pytest.raises(ContractError, match="misaligned"):
        MemoryEfficientEmulator().forward(q, k, v, bias.expand(3, 2, 1, 8), False)
    with emulated_cuda_branch():
        out, _ = attend(q, k, v, bias)
    assert torch.isfinite(out).all()
