"""merge_attention_states: the oracle is attention over the concatenated keys.

Random q attends to keys and values split in two parts; each part's output and natural-log lse come
from plain PyTorch in float64 (softmax of the scores, torch.logsumexp of the scores), the op merges
them, and the result must equal attention over all keys. Beside that: agreement with
torchkvops.reference on strided layouts, the -inf / NaN / +inf edge cases, opcheck, torch.compile,
and an error naming the argument for every bad input.
"""

import math

import pytest
import torch
from devices import DEVICES, requires_gpu

import torchkvops
from torchkvops import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Attention outputs in float64 are rounded once to the input dtype and once more on output.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
OP = torch.ops.torchkvops.merge_attention_states.default


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(D)) v and logsumexp of the scores. q [B, H, Lq, D], k and v [B, H, Lk, D].
    Over no keys (Lk = 0): output 0 and lse -inf."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(max(q.shape[-1], 1))
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def to_op_layout(x: torch.Tensor, lead: list[int], dtype: torch.dtype, permuted: bool) -> torch.Tensor:
    """[B, H, Lq, (D)] float64 -> [*lead, H, (D)] in dtype, where lead = [*batch, Lq]: a view of the
    [B, H, Lq, D] buffer (as SDPA's output transposed to [B, Lq, H, D]) or a contiguous copy."""
    y = x.to(dtype).transpose(1, 2)  # [B, Lq, H, (D)], not contiguous when H, Lq > 1
    if not permuted:
        y = y.contiguous()
    return y.view(*lead, *y.shape[2:])


def attention_case(lead, heads, head_dim, dtype_a, dtype_b, permuted, device, seed, keys=(None, None)):
    """Op inputs (out_a, lse_a, out_b, lse_b) of a random attention split in two key parts, and the
    expected (out, lse) of attention over all keys in float64, shaped [*lead, heads, (head_dim)]."""
    g = torch.Generator().manual_seed(seed)
    batch, lq = math.prod(lead[:-1]), (lead[-1] if lead else 1)
    lens = [n if n is not None else int(torch.randint(1, 12, (), generator=g)) for n in keys]
    # A spread of score scales, so the two parts' lse differ by a lot in some rows and little in others.
    q = torch.randn(batch, heads, lq, head_dim, dtype=torch.float64, generator=g)
    q = q * torch.rand(batch, heads, lq, 1, dtype=torch.float64, generator=g) * 6
    k = torch.randn(batch, heads, sum(lens), head_dim, dtype=torch.float64, generator=g)
    v = torch.randn(batch, heads, sum(lens), head_dim, dtype=torch.float64, generator=g)
    out_a, lse_a = attention(q, k[:, :, : lens[0]], v[:, :, : lens[0]])
    out_b, lse_b = attention(q, k[:, :, lens[0] :], v[:, :, lens[0] :])
    out, lse = attention(q, k, v)
    inputs = (
        to_op_layout(out_a, lead, dtype_a, permuted),
        to_op_layout(lse_a, lead, torch.float32, permuted),
        to_op_layout(out_b, lead, dtype_b, permuted),
        to_op_layout(lse_b, lead, torch.float32, permuted),
    )
    expected = to_op_layout(out, lead, torch.float64, False), to_op_layout(lse, lead, torch.float64, False)
    return [t.to(device) for t in inputs], expected


def check_outputs(out, lse, out_a):
    assert out.dtype == out_a.dtype and out.shape == out_a.shape and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == out_a.shape[:-1] and lse.is_contiguous()
    assert out.device == lse.device == out_a.device


def check_against_attention(inputs, expected, tol):
    out_a = inputs[0]
    out, lse = torchkvops.merge_attention_states(*inputs)
    check_outputs(out, lse, out_a)
    torch.testing.assert_close(out.cpu().double(), expected[0], atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu().double(), expected[1], atol=1e-5, rtol=1e-5)
    # The reference gives the same, to an ulp of the output dtype.
    ref_out, ref_lse = reference.merge_attention_states(*inputs)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


# ----------------------------------------------------------------------------------------------------
# against attention over all keys


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead", [[], [5], [2, 3, 4]], ids=["lead0", "lead1", "lead3"])
@pytest.mark.parametrize("head_dim", [1, 7, 24, 128])
@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
def test_matches_attention_over_all_keys(device, dtype, lead, head_dim, permuted):
    seed = len(lead) * 1000 + head_dim * 10 + permuted
    inputs, expected = attention_case(lead, 4, head_dim, dtype, dtype, permuted, device, seed)
    if permuted and len(lead) > 0:
        assert not inputs[0].is_contiguous() and not inputs[1].is_contiguous()
    check_against_attention(inputs, expected, TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype_a,dtype_b",
    [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float16)],
    ids=str,
)
def test_mixed_dtypes(device, dtype_a, dtype_b):
    inputs, expected = attention_case([2, 3], 4, 24, dtype_a, dtype_b, True, device, seed=7)
    check_against_attention(inputs, expected, max(TOL[dtype_a], TOL[dtype_b]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,head_dim", [([0], 8), ([3, 0], 24), ([0, 2], 1), ([2, 3], 0)])
def test_empty(device, dtype, lead, head_dim):
    # 0 rows, or 0 head_dim (then the lse is still merged).
    inputs, expected = attention_case(lead, 3, head_dim, dtype, dtype, True, device, seed=1)
    check_against_attention(inputs, expected, TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keys", [(0, 5), (5, 0), (0, 0)], ids=["a_empty", "b_empty", "both_empty"])
def test_attention_over_no_keys(device, keys):
    # A part over no keys has lse -inf: the merge is the other part, or 0 and -inf when both are empty.
    inputs, expected = attention_case([2, 3], 4, 24, torch.float32, torch.float32, True, device, seed=3, keys=keys)
    out, lse = torchkvops.merge_attention_states(*inputs)
    if keys == (0, 0):
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(lse, torch.full_like(lse, float("-inf")))
    else:
        out_x, lse_x = (inputs[2], inputs[3]) if keys[0] == 0 else (inputs[0], inputs[1])
        assert torch.equal(out, out_x) and torch.equal(lse, lse_x)
        torch.testing.assert_close(out.cpu().double(), expected[0], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# edge cases and layouts, against the reference


def random_states(shape, dtype_a, dtype_b, device, seed):
    """Random (out_a, lse_a, out_b, lse_b) of shape [*shape[:-1], head_dim] and shape[:-1]."""
    g = torch.Generator().manual_seed(seed)
    out_a = torch.randn(shape, generator=g).to(device, dtype_a)
    out_b = torch.randn(shape, generator=g).to(device, dtype_b)
    lse_a = (torch.randn(shape[:-1], generator=g) * 4).to(device)
    lse_b = (torch.randn(shape[:-1], generator=g) * 4).to(device)
    return out_a, lse_a, out_b, lse_b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype_a,dtype_b",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
    ids=str,
)
def test_empty_parts_and_underflow(device, dtype_a, dtype_b):
    out_a, lse_a, out_b, lse_b = random_states([6, 4, 24], dtype_a, dtype_b, device, seed=11)
    inf, nan = float("inf"), float("nan")
    # Row 0: a is empty; row 1: b is empty; row 2: both. An empty part's output is garbage (NaN).
    lse_a[0], out_a[0] = -inf, nan
    lse_b[1], out_b[1] = -inf, nan
    lse_a[2], lse_b[2], out_a[2], out_b[2] = -inf, -inf, nan, nan
    # Row 3: a's weight underflows to 0 (e^-200), so it is dropped like an empty part.
    lse_a[3], lse_b[3], out_a[3] = -150.0, 50.0, nan
    out, lse = torchkvops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    check_outputs(out, lse, out_a)
    assert torch.equal(out[0], out_b[0].to(dtype_a)) and torch.equal(lse[0], lse_b[0])
    assert torch.equal(out[1], out_a[1]) and torch.equal(lse[1], lse_a[1])
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.equal(lse[2], torch.full_like(lse[2], -inf))
    assert torch.equal(out[3], out_b[3].to(dtype_a)) and torch.equal(lse[3], lse_b[3])
    assert not out.isnan().any() and not lse.isnan().any()
    ref_out, ref_lse = reference.merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def every_value(dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern of a 16-bit float dtype; for float32, random bit patterns plus every
    float16 and bfloat16 value and the float32 values next to them and halfway between them (the
    rounding boundaries of a cast to 16 bits). Shaped [rows, 2, 64]."""
    if dtype.itemsize == 2:
        values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    else:
        g = torch.Generator().manual_seed(0)
        words = [torch.randint(-(2**31), 2**31, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)]
        for d in (torch.float16, torch.bfloat16):
            exact = every_value(d).reshape(-1).float().view(torch.int32)
            half_ulp = 1 << (12 if d == torch.float16 else 15)
            words += [exact + k for k in (-1, 1, half_ulp - 1, half_ulp, half_ulp + 1)]
        values = torch.cat(words).view(torch.float32)
        values = values[: values.numel() // 128 * 128]
    return values.reshape(-1, 2, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_a", DTYPES, ids=str)
@pytest.mark.parametrize("dtype_b", DTYPES, ids=str)
def test_lone_part_is_cast_exactly(device, dtype_a, dtype_b):
    # With lse_a = -inf the result is out_b cast to out_a's dtype, bit for bit (NaNs as NaNs): every
    # 16-bit value, and float32 values at every rounding boundary of a cast to 16 bits.
    out_b = every_value(dtype_b).to(device)
    out_a = torch.full(out_b.shape, float("nan"), dtype=dtype_a, device=device)
    lse_a = torch.full(out_b.shape[:-1], float("-inf"), device=device)
    lse_b = torch.randn(out_b.shape[:-1], device=device)
    out, lse = torchkvops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    expected = out_b.to(dtype_a)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    bits = torch.int32 if dtype_a == torch.float32 else torch.int16
    assert torch.equal(out.view(bits)[~nan], expected.view(bits)[~nan])
    assert torch.equal(lse, lse_b)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_lse(device):
    # Documented: a NaN or +inf lse on either side gives NaN out and NaN lse for that (row, head) only.
    out_a, lse_a, out_b, lse_b = random_states([5, 3, 8], torch.float32, torch.float16, device, seed=5)
    inf, nan = float("inf"), float("nan")
    lse_a[0, 0], lse_b[1, 1], lse_a[2, 2], lse_b[3, 0], lse_a[4, 1], lse_b[4, 1] = nan, nan, inf, inf, inf, -inf
    out, lse = torchkvops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    bad = torch.zeros(5, 3, dtype=torch.bool)
    bad[0, 0] = bad[1, 1] = bad[2, 2] = bad[3, 0] = bad[4, 1] = True
    assert torch.equal(lse.isnan().cpu(), bad)
    assert torch.equal(out.isnan().cpu(), bad.unsqueeze(-1).expand(5, 3, 8))
    ref_out, ref_lse = reference.merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, ref_out, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, equal_nan=True)


def relayout(t: torch.Tensor, layout: str, is_lse: bool) -> torch.Tensor:
    """The values of t in another memory layout (each a view of a larger or permuted buffer)."""
    if layout == "contiguous":
        return t.contiguous()
    if layout == "heads_outer":  # [..., H, D] stored heads first: strided leading dims
        d = -1 if is_lse else -2
        return t.movedim(d, 0).contiguous().movedim(0, d)
    if layout == "heads_strided":  # every other head of a buffer with twice the heads
        d = -1 if is_lse else -2
        buf = torch.repeat_interleave(t, 2, dim=d)
        return buf[..., ::2] if is_lse else buf[..., ::2, :]
    if layout == "head_offset":  # head_dim starts one element into a wider row: no aligned vectors
        if is_lse:
            return t
        buf = torch.nn.functional.pad(t, (1, 2), value=7.0)
        return buf[..., 1 : 1 + t.shape[-1]]
    if layout == "head_dim_strided":  # head_dim has stride 2: made contiguous first
        if is_lse:
            return t
        return torch.repeat_interleave(t, 2, dim=-1)[..., ::2]
    if layout == "expanded":  # out_b and lse_b broadcast along the first dim (stride 0)
        return t[:1].expand(t.shape)
    raise ValueError(layout)


LAYOUTS = ["contiguous", "heads_outer", "heads_strided", "head_offset", "head_dim_strided", "expanded", "mixed"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_match_reference(device, dtype, layout):
    out_a, lse_a, out_b, lse_b = random_states([3, 5, 4, 16], dtype, dtype, device, seed=2)
    if layout == "mixed":  # each input laid out differently
        layouts = ["heads_outer", "contiguous", "head_offset", "heads_strided"]
    elif layout == "expanded":  # only out_b and lse_b are broadcast
        layouts = ["contiguous", "contiguous", "expanded", "expanded"]
    else:
        layouts = [layout] * 4
    args = tuple(
        relayout(t, lay, is_lse)
        for t, lay, is_lse in zip((out_a, lse_a, out_b, lse_b), layouts, (False, True, False, True))
    )
    if layout != "contiguous":
        assert not all(t.is_contiguous() for t in args)
    out, lse = torchkvops.merge_attention_states(*args)
    check_outputs(out, lse, args[0])
    ref_out, ref_lse = reference.merge_attention_states(*(t.contiguous() for t in args))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("device", DEVICES)
def test_many_strided_leading_dims(device):
    # Seven leading dims, every one sliced with step 2: none merge, more than the kernels' plan holds,
    # so the inputs are made contiguous first. Still the reference's result.
    shape = [2] * 7 + [3, 8]
    out_a, lse_a, out_b, lse_b = random_states([4] * 7 + [3, 8], torch.float32, torch.bfloat16, device, seed=9)
    sl = (slice(None, None, 2),) * 7
    args = (out_a[sl], lse_a[sl], out_b[sl], lse_b[sl])
    assert list(args[0].shape) == shape
    out, lse = torchkvops.merge_attention_states(*args)
    ref_out, ref_lse = reference.merge_attention_states(*(t.contiguous() for t in args))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def aten_ops_called(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("aten::")}


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_read_in_place(device):
    # SDPA-style permuted views (head_dim stride 1) are read where they are: no copy. A strided
    # head_dim is made contiguous first (and the profiler sees that copy, so the check can fail).
    inputs, _ = attention_case([2, 3], 4, 24, torch.bfloat16, torch.float32, True, device, seed=6)
    assert not inputs[0].is_contiguous()
    copies = {"aten::copy_", "aten::clone", "aten::contiguous"}
    assert not aten_ops_called(lambda: torchkvops.merge_attention_states(*inputs)) & copies
    strided = relayout(inputs[0], "head_dim_strided", False)
    assert aten_ops_called(lambda: torchkvops.merge_attention_states(strided, *inputs[1:])) & copies


@pytest.mark.cuda
@requires_gpu
def test_cuda_no_host_sync_and_graph_capture():
    inputs, expected = attention_case([4, 8], 4, 128, torch.bfloat16, torch.bfloat16, True, "cuda", seed=12)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = torchkvops.merge_attention_states(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(out.cpu().double(), expected[0], atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as torch.cuda.graphs advises
        torchkvops.merge_attention_states(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_lse = torchkvops.merge_attention_states(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, out) and torch.equal(graph_lse, lse)


# ----------------------------------------------------------------------------------------------------
# opcheck and torch.compile


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    samples = [
        attention_case([2, 3], 4, 24, torch.float32, torch.float32, False, device, seed=1)[0],
        attention_case([2, 3], 4, 16, torch.bfloat16, torch.bfloat16, True, device, seed=2)[0],
        attention_case([5], 2, 7, torch.float16, torch.float32, True, device, seed=3)[0],
        attention_case([], 3, 1, torch.float32, torch.float16, False, device, seed=4)[0],
        attention_case([0, 2], 3, 8, torch.float32, torch.float32, False, device, seed=5)[0],
    ]
    for args in samples:
        torch.library.opcheck(OP, tuple(args))


def test_compiled_equals_eager():
    inputs, _ = attention_case([2, 3], 4, 24, torch.bfloat16, torch.float32, True, "cpu", seed=8)

    def f(out_a, lse_a, out_b, lse_b):
        out, lse = torchkvops.merge_attention_states(out_a, lse_a, out_b, lse_b)
        return out.float() * 2, lse - 1

    compiled = torch.compile(f, fullgraph=True)
    for got, want in zip(compiled(*inputs), f(*inputs)):
        assert torch.equal(got, want)


def test_backward_raises():
    out_a, lse_a, out_b, lse_b = random_states([3, 4, 8], torch.float32, torch.float32, "cpu", seed=0)
    out_a.requires_grad_()
    out, _ = torchkvops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    with pytest.raises(NotImplementedError, match="^merge_attention_states: not differentiable"):
        out.sum().backward()


# ----------------------------------------------------------------------------------------------------
# bad arguments


def good_args(device):
    g = torch.Generator().manual_seed(0)
    out_a = torch.randn(6, 4, 8, generator=g).to(device)
    out_b = torch.randn(6, 4, 8, generator=g).to(device)
    return out_a, torch.randn(6, 4, generator=g).to(device), out_b, torch.randn(6, 4, generator=g).to(device)


def _set(args, i, value):
    args = list(args)
    args[i] = value
    return args


BAD = [
    # (change, exception, message): the message names the argument and the value seen.
    (lambda a: _set(a, 0, a[0][0, 0]), ValueError, r"out_a must have at least 2 dims .*got shape \[8\]"),
    (lambda a: _set(a, 2, a[2][0, 0]), ValueError, r"out_b must have at least 2 dims .*got shape \[8\]"),
    (lambda a: _set(a, 2, a[2][..., :5]), ValueError, r"out_b must have out_a's shape \[6, 4, 8\], got \[6, 4, 5\]"),
    (lambda a: _set(a, 2, a[2][:, :3]), ValueError, r"out_b must have out_a's shape \[6, 4, 8\], got \[6, 3, 8\]"),
    (lambda a: _set(a, 2, a[2][None]), ValueError, r"out_b must have out_a's shape \[6, 4, 8\], got \[1, 6, 4, 8\]"),
    (
        lambda a: _set(a, 1, a[1][:, :3]),
        ValueError,
        r"lse_a must have shape out_a.shape\[:-1\] = \[6, 4\], got \[6, 3\]",
    ),
    (lambda a: _set(a, 3, a[3][..., None]), ValueError, r"lse_b must have shape .*\[6, 4\], got \[6, 4, 1\]"),
    (lambda a: _set(a, 1, a[1].double()), TypeError, r"lse_a must be float32.*got (Double|torch.float64)"),
    (lambda a: _set(a, 3, a[3].bfloat16()), TypeError, r"lse_b must be float32.*got (BFloat16|torch.bfloat16)"),
    (lambda a: _set(a, 0, a[0].double()), TypeError, r"out_a dtype (Double|torch.float64) is not supported"),
    (lambda a: _set(a, 0, a[0].int()), TypeError, r"out_a dtype (Int|torch.int32) is not supported"),
    (lambda a: _set(a, 2, a[2].double()), TypeError, r"out_b dtype (Double|torch.float64) is not supported"),
    (lambda a: _set(a, 2, a[2].long()), TypeError, r"out_b dtype (Long|torch.int64) is not supported"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"] + DEVICES[1:])  # meta: the fake kernel's checks
@pytest.mark.parametrize("change,exc,match", BAD)
def test_bad_arguments(device, change, exc, match):
    with pytest.raises(exc, match=f"^merge_attention_states: {match}"):
        torchkvops.merge_attention_states(*change(good_args(device)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("moved", [1, 2, 3], ids=["lse_a", "out_b", "lse_b"])
def test_different_devices(device, moved):
    # Without a GPU the other device is `meta`: the dispatcher then runs the fake kernel, so the CPU
    # kernel's own check is reached by redispatching to the CPU key.
    other = "meta" if device == "cpu" else "cpu"
    args = good_args(device)
    args = _set(args, moved, args[moved].to(other))
    name = ["out_a", "lse_a", "out_b", "lse_b"][moved]
    match = f"^merge_attention_states: {name} must be on out_a's device {torch.device(device)}.*, got {other}"
    with pytest.raises(ValueError, match=match):
        torchkvops.merge_attention_states(*args)
    if device == "cpu":
        with pytest.raises(ValueError, match=match):
            OP.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args)
