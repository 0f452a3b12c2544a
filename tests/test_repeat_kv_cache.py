"""Tests of torchkvops.repeat_kv_cache_ (in place) and torchkvops.repeat_kv_cache (functional).

The oracle is torchkvops.reference. Results are compared byte for byte (random bytes fill every
buffer, so float NaN payloads and float8 values, which lack equality ops, are compared exactly), and
the in-place op is always checked over the whole underlying buffer, not only the view it was given:
nothing outside rows [0, batch*repeats) x positions [0, num_tokens) may change.

Each test that runs an op on a device has one body, parametrized by device (tests/devices.py: `cpu`,
and `cuda`, marked `cuda` and skipped without a GPU). Where the devices need different cases,
devices.per_device gives each its own list: the CUDA kernel's 16-byte vector path gets a larger shape.
CUDA-graph capture is CUDA only; the build checks (CUDA kernels compiled in, OpenMP) need no device.
"""

import os
import sys

import pytest
import torch
from devices import DEVICES, per_device, requires_gpu
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile

import torchkvops
from torchkvops import reference

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
ONE_BYTE_DTYPES = [d for d in DTYPES if d.itemsize == 1]

# Layouts of the cache handed to the op, each viewed from a larger random buffer:
#   contiguous   - the buffer itself
#   token_slice  - positions [1, 1+max_tokens) of a buffer with 3 more positions
#   row_slice    - rows [1, 1+rows) of a buffer with 2 more rows
#   head_slice   - head_dim elements [1, 1+head_dim) of a buffer with a wider head: runs are one
#                  head wide and every run starts one element off the buffer's alignment
#   heads_inner  - stored [..., rows, tokens, heads, head_dim] (the HF [B, T, H, D] layout), transposed
#   rows_inner   - stored [..., heads, tokens, rows, head_dim]: rows are the innermost but one dim
LAYOUTS = ["contiguous", "token_slice", "row_slice", "head_slice", "heads_inner", "rows_inner"]


# ----------------------------------------------------------------------------------------------------
# helpers


def random_bytes_(t: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """Fill all of t's storage with random bytes (valid for every dtype, float8 included)."""
    storage_bytes(t).random_(0, 256, generator=gen)
    return t


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage behind t, as a 1-D uint8 tensor sharing it."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    a, e = as_bytes(actual), as_bytes(expected)
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        raise AssertionError(f"{bad.shape[0]} of {a.numel()} bytes differ, first at byte index {bad[0].tolist()}")


def make_cache(shape, dtype, layout="contiguous", device="cpu", gen=None) -> torch.Tensor:
    """A view of shape `shape` [*lead, rows, heads, tokens, head_dim] with the given layout over a
    buffer of random bytes, on `device`. The buffer is reachable as the view's storage. The bytes come
    from the CPU generator `gen`, so a seed gives the same bytes on every device."""
    *lead, rows, heads, tokens, hd = shape
    lead = list(lead)
    if layout == "contiguous":
        buf = torch.empty(shape, dtype=dtype)
        view = buf
    elif layout == "token_slice":
        buf = torch.empty(lead + [rows, heads, tokens + 3, hd], dtype=dtype)
        view = buf[..., 1 : 1 + tokens, :]
    elif layout == "row_slice":
        buf = torch.empty(lead + [rows + 2, heads, tokens, hd], dtype=dtype)
        view = buf[..., 1 : 1 + rows, :, :, :]
    elif layout == "head_slice":
        buf = torch.empty(lead + [rows, heads, tokens, hd + 3], dtype=dtype)
        view = buf[..., 1 : 1 + hd]
    elif layout == "heads_inner":
        buf = torch.empty(lead + [rows, tokens, heads, hd], dtype=dtype)
        view = buf.transpose(-3, -2)
    elif layout == "rows_inner":
        buf = torch.empty(lead + [heads, tokens, rows, hd], dtype=dtype)
        n = buf.dim()
        view = buf.permute(*range(n - 4), n - 2, n - 4, n - 3, n - 1)
    else:
        raise ValueError(layout)
    assert tuple(view.shape) == tuple(shape), (view.shape, shape)
    random_bytes_(view, gen)
    return _on(view, device)


def _on(t, device):
    """t with its whole buffer moved to device, same strides and offset (Tensor.to would compact it)."""
    if t.device == torch.device(device):
        return t
    moved = storage_bytes(t).to(device)
    return torch.empty(0, dtype=t.dtype, device=device).set_(
        moved.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


def twin(view: torch.Tensor) -> torch.Tensor:
    """A byte-identical copy of view's whole buffer, viewed the same way."""
    storage = view.untyped_storage()
    copy = torch.empty(0, dtype=view.dtype, device=view.device).set_(
        storage.clone(), view.storage_offset(), view.shape, view.stride()
    )
    assert torch.equal(storage_bytes(copy), storage_bytes(view))
    return copy


def check_inplace(cache: torch.Tensor, batch: int, repeats: int, num_tokens: int) -> None:
    """Run the op and the reference on twin buffers; compare whole buffers byte for byte."""
    expected = twin(cache)
    reference.repeat_kv_cache_(expected, batch, repeats, num_tokens)
    ptr, storage_ptr = cache.data_ptr(), cache.untyped_storage().data_ptr()
    shape, stride = cache.shape, cache.stride()
    out = torchkvops.repeat_kv_cache_(cache, batch, repeats, num_tokens)
    assert out is None
    assert cache.data_ptr() == ptr and cache.untyped_storage().data_ptr() == storage_ptr
    assert cache.shape == shape and cache.stride() == stride
    assert_same_bytes(cache, expected)
    # Nothing outside the view changed either.
    assert torch.equal(storage_bytes(cache), storage_bytes(expected))


def check_functional(cache: torch.Tensor, repeats: int) -> None:
    before = twin(cache)
    out = torchkvops.repeat_kv_cache(cache, repeats)
    assert out.is_contiguous()
    assert out.device == cache.device
    if out.numel() > 0:
        assert out.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr()
    assert_same_bytes(out, reference.repeat_kv_cache(cache, repeats))
    assert torch.equal(storage_bytes(cache), storage_bytes(before))  # input untouched


# ----------------------------------------------------------------------------------------------------
# correctness against the reference


@st.composite
def inplace_cases(draw):
    batch = draw(st.integers(1, 6))
    repeats = draw(st.integers(1, 6))
    rows = batch * repeats + draw(st.integers(0, 3))
    max_tokens = draw(st.integers(1, 9))
    num_tokens = draw(st.integers(1, max_tokens))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    heads = draw(st.integers(1, 3))
    # 1, 3, 5, 7, 17, 33 break 16-byte vectors for every dtype; 8, 16, 64 allow them for wider dtypes.
    head_dim = draw(st.sampled_from([1, 2, 3, 5, 7, 8, 16, 17, 33, 64]))
    dtype = draw(st.sampled_from(DTYPES))
    layout = draw(st.sampled_from(LAYOUTS))
    return [*lead, rows, heads, max_tokens, head_dim], dtype, layout, batch, repeats, num_tokens


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inplace_cases(), st.randoms(use_true_random=False))
def test_inplace_matches_reference_property(device, case, rnd):
    shape, dtype, layout, batch, repeats, num_tokens = case
    gen = torch.Generator().manual_seed(rnd.getrandbits(32))
    check_inplace(make_cache(shape, dtype, layout, device, gen), batch, repeats, num_tokens)


@st.composite
def functional_cases(draw):
    rows = draw(st.integers(0, 5))
    repeats = draw(st.integers(1, 5))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    heads = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 6))
    head_dim = draw(st.sampled_from([0, 1, 3, 5, 8, 17, 32]))
    dtype = draw(st.sampled_from(DTYPES))
    layout = draw(st.sampled_from(LAYOUTS))
    return [*lead, rows, heads, tokens, head_dim], dtype, layout, repeats


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(functional_cases(), st.randoms(use_true_random=False))
def test_functional_matches_reference_property(case, rnd):
    shape, dtype, layout, repeats = case
    gen = torch.Generator().manual_seed(rnd.getrandbits(32))
    check_functional(make_cache(shape, dtype, layout, gen=gen), repeats)


# (shape, batch, repeats, num_tokens), run on every dtype and layout. The first is a whole
# [layers, 2, rows, kv_heads, max_tokens, head_dim] buffer; head_dim 19 is odd.
EVERY_DTYPE_CASES = [
    ([2, 2, 13, 3, 11, 19], 3, 4, 7),
    ([9, 1, 17, 33], 1, 9, 17),
    ([35, 2, 3, 8], 17, 2, 2),
]
# CUDA only: its kernel moves runs in 16-byte vectors where alignment allows, as this shape does for
# every dtype. The CPU kernel memcpys whole runs (large ones: test_rows_of_several_copy_tiles).
VECTOR_CASES = [([2, 2, 16, 4, 64, 64], 4, 4, 50)]
# (shape, repeats) for the functional op: its own small case, then the shapes above
FUNCTIONAL_CASES = [([2, 3, 2, 5, 19], 3)] + [(shape, repeats) for shape, _, repeats, _ in EVERY_DTYPE_CASES]
FUNCTIONAL_VECTOR_CASES = [(shape, repeats) for shape, _, repeats, _ in VECTOR_CASES]


def _id(value):
    """Test ids for per_device params: the device, or a case's shape and arguments."""
    if isinstance(value, str):
        return value
    shape, *args = value
    return "x".join(map(str, shape)) + "".join(f"-{a}" for a in args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("device,case", per_device(EVERY_DTYPE_CASES, EVERY_DTYPE_CASES + VECTOR_CASES), ids=_id)
def test_inplace_every_dtype_and_layout(device, case, dtype, layout):
    shape, batch, repeats, num_tokens = case
    gen = torch.Generator().manual_seed(0)
    check_inplace(make_cache(shape, dtype, layout, device, gen), batch, repeats, num_tokens)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "device,case", per_device(FUNCTIONAL_CASES, FUNCTIONAL_CASES + FUNCTIONAL_VECTOR_CASES), ids=_id
)
def test_functional_every_dtype_and_layout(device, case, dtype, layout):
    shape, repeats = case
    gen = torch.Generator().manual_seed(0)
    check_functional(make_cache(shape, dtype, layout, device, gen), repeats)


# (dtype, offset in elements, head_dim)
UNALIGNED_CASES = [
    # one-byte dtypes, head_dim 13 bytes: no vector width above 1 fits
    *[(dtype, offset, 13) for dtype in ONE_BYTE_DTYPES for offset in [0, 1, 3, 7, 15]],
    # head_dim 16: the offset alone sets the widest vector that fits (16 bytes at offset 0)
    *[(dtype, offset, 16) for dtype in ONE_BYTE_DTYPES + [torch.float16] for offset in [0, 1, 2, 4, 8]],
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,offset,head_dim", UNALIGNED_CASES, ids=str)
def test_unaligned(device, dtype, offset, head_dim):
    # A [9, 2, 10, head_dim] view starting `offset` elements into its buffer.
    n = 9 * 2 * 10 * head_dim
    buf = _on(random_bytes_(torch.empty(n + 16, dtype=dtype), torch.Generator().manual_seed(offset)), device)
    cache = buf[offset : offset + n].view(9, 2, 10, head_dim)
    check_inplace(cache, 2, 4, 9)
    check_functional(cache, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "token_slice", "heads_inner", "rows_inner"])
def test_rows_of_several_copy_tiles(dtype, layout):
    # Rows whose prompt region spans several of the CPU kernel's 256 KiB copy tiles, the last one
    # partial (e.g. fp32 contiguous: 36 runs of 16.5 KiB per row in tiles of 15, 15 and 6 runs).
    gen = torch.Generator().manual_seed(11)
    check_inplace(make_cache([3, 2, 7, 6, 40, 128], dtype, layout, gen=gen), 2, 3, 33)
    check_functional(make_cache([3, 2, 3, 6, 33, 128], dtype, layout, gen=gen), 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,head_dim,token_counts",
    [(torch.float32, 3, (1, 4)), (torch.float16, 8, (3,))],
    ids=["fp32-hd3", "fp16-hd8"],
)
def test_every_batch_and_repeats_level_order(device, dtype, head_dim, token_counts):
    # Exhaustive over the level order of the in-place expansion: B in 1..17, N in 1..9.
    gen = torch.Generator().manual_seed(0)
    for batch in range(1, 18):
        for repeats in range(1, 10):
            rows = batch * repeats + 1
            for num_tokens in token_counts:
                cache = make_cache([2, rows, 2, 4, head_dim], dtype, device=device, gen=gen)
                check_inplace(cache, batch, repeats, num_tokens)


def test_full_rows_and_full_tokens():
    # batch * repeats == rows and num_tokens == max_tokens: the whole cache is rewritten.
    cache = make_cache([12, 2, 6, 8], torch.float16, gen=torch.Generator().manual_seed(1))
    check_inplace(cache, 3, 4, 6)
    prompts = twin(cache)
    torchkvops.repeat_kv_cache_(cache, 12, 1, 6)  # repeats == 1: nothing changes
    assert torch.equal(storage_bytes(cache), storage_bytes(prompts))


def test_inplace_only_touches_the_expanded_region():
    # The region rule stated directly, not only through the reference.
    gen = torch.Generator().manual_seed(2)
    cache = make_cache([2, 2, 10, 3, 8, 5], torch.bfloat16, gen=gen)
    before = twin(cache)
    batch, repeats, num_tokens = 2, 3, 5
    torchkvops.repeat_kv_cache_(cache, batch, repeats, num_tokens)
    expanded = before[..., :batch, :, :num_tokens, :].repeat_interleave(repeats, dim=-4)
    assert_same_bytes(cache[..., : batch * repeats, :, :num_tokens, :], expanded)
    assert_same_bytes(cache[..., batch * repeats :, :, :, :], before[..., batch * repeats :, :, :, :])
    assert_same_bytes(cache[..., :, :, num_tokens:, :], before[..., :, :, num_tokens:, :])


# ----------------------------------------------------------------------------------------------------
# in place: no temporary copy of the cache


def largest_cpu_allocation(fn) -> int:
    """The largest number of bytes any single op event allocated on the CPU while fn ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max([e.cpu_memory_usage for e in prof.events()] + [0])


def largest_allocation(device, fn) -> int:
    """Bytes allocated on device while fn ran: on the CPU the largest single allocation by one op (the
    profiler's per-event memory), on CUDA the caching allocator's peak above its level before fn."""
    if device == "cpu":
        return largest_cpu_allocation(fn)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _alloc_case(device):
    # A 2 MiB cache; the prompts (4 rows x 56 of 64 positions) are 22% of it, the expansion 88%.
    cache = make_cache([2, 2, 16, 4, 64, 32], torch.float32, device=device, gen=torch.Generator().manual_seed(3))
    return cache, 4, 4, 56


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_allocates_nothing_the_size_of_the_cache(device):
    cache, batch, repeats, num_tokens = _alloc_case(device)
    limit = cache.nbytes // 16
    largest = largest_allocation(device, lambda: torchkvops.repeat_kv_cache_(cache, batch, repeats, num_tokens))
    assert largest < limit, f"repeat_kv_cache_ allocated {largest} bytes during the op (cache: {cache.nbytes})"


@pytest.mark.parametrize("device", DEVICES)
def test_allocation_detector_catches_copies(device):
    # The check above is honest: it flags the reference (which clones the prompts and materialises
    # the repeat_interleave), a whole-cache clone, and the functional op (a new output).
    cache, batch, repeats, num_tokens = _alloc_case(device)
    limit = cache.nbytes // 16
    assert largest_allocation(device, lambda: reference.repeat_kv_cache_(cache, batch, repeats, num_tokens)) >= limit
    assert largest_allocation(device, lambda: cache.clone()) >= cache.nbytes
    assert largest_allocation(device, lambda: torchkvops.repeat_kv_cache(cache, 2)) >= 2 * cache.nbytes


# ----------------------------------------------------------------------------------------------------
# functional op: empty inputs, autograd


@pytest.mark.parametrize(
    "shape", [[0, 2, 3, 4], [2, 0, 3, 4], [2, 2, 0, 4], [2, 2, 3, 0], [3, 0, 2, 3, 4], [0, 0, 0, 0]]
)
@pytest.mark.parametrize("repeats", [1, 3])
def test_functional_empty(shape, repeats):
    cache = torch.empty(shape, dtype=torch.float16)
    out = torchkvops.repeat_kv_cache(cache, repeats)
    expected_shape = list(shape)
    expected_shape[-4] *= repeats
    assert list(out.shape) == expected_shape and out.dtype == cache.dtype and out.is_contiguous()


def test_inplace_zero_head_dim():
    cache = torch.empty(6, 2, 3, 0)
    torchkvops.repeat_kv_cache_(cache, 2, 3, 3)
    assert cache.shape == (6, 2, 3, 0)


def test_functional_repeats_one_is_a_copy():
    cache = make_cache([3, 2, 4, 5], torch.float32, "token_slice", gen=torch.Generator().manual_seed(4))
    out = torchkvops.repeat_kv_cache(cache, 1)
    assert out.is_contiguous() and out.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr()
    assert_same_bytes(out, cache)


@pytest.mark.parametrize("layout", ["contiguous", "heads_inner", "token_slice"])
def test_gradcheck(layout):
    x = make_cache([2, 3, 2, 3, 4], torch.float64, layout).normal_().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: torchkvops.repeat_kv_cache(t, 3), (x,))
    assert torch.autograd.gradgradcheck(lambda t: torchkvops.repeat_kv_cache(t, 3), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_grad_sums_each_group_of_repeats(dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 3, 5, 6, generator=gen).to(dtype).requires_grad_()
    grad_out = torch.randn(2, 12, 3, 5, 6, generator=gen).to(dtype)
    (g,) = torch.autograd.grad(torchkvops.repeat_kv_cache(x, 3), x, grad_out)
    (g_ref,) = torch.autograd.grad(x.repeat_interleave(3, dim=-4), x, grad_out)
    torch.testing.assert_close(g, g_ref)
    # Stated directly in float64: input row i gets the sum of output rows [3i, 3i+3).
    expected = grad_out.double().unflatten(-4, (4, 3)).sum(-4)
    torch.testing.assert_close(g.double(), expected, atol=1e-2, rtol=1e-2)
    assert g.dtype == dtype and g.shape == x.shape


# ----------------------------------------------------------------------------------------------------
# opcheck


def opcheck_samples(device):
    gen = torch.Generator().manual_seed(6)

    def cache(shape, dtype=torch.float32, layout="contiguous"):
        # Finite values: opcheck compares with assert_close, for which random-byte NaNs differ.
        return _on(make_cache(shape, dtype, layout, gen=gen).normal_(generator=gen), device)

    inplace = [
        (cache([6, 2, 5, 4]), 2, 3, 4),
        (cache([2, 2, 9, 3, 7, 8], torch.float16), 2, 4, 7),
        (cache([2, 7, 3, 5, 9], torch.bfloat16, "heads_inner"), 3, 2, 1),
        (cache([5, 2, 6, 4], torch.float32, "token_slice"), 1, 5, 6),
        # A recurrent cache group's states: [layers, 1, rows, 1, 1, width], one "position" per row.
        (cache([3, 1, 8, 1, 1, 40], torch.bfloat16), 2, 4, 1),
    ]
    functional = [
        (cache([3, 2, 5, 4]), 2),
        (cache([3, 1, 2, 1, 1, 40]), 4),  # a recurrent group's states, one "position" a row
        (cache([2, 3, 2, 5, 4], torch.float16, "heads_inner"), 3),
        (cache([2, 3, 2, 4], torch.float64).requires_grad_(), 2),
        (cache([2, 3, 2, 5, 4], torch.float64, "token_slice").requires_grad_(), 3),
        (cache([0, 2, 3, 4]), 2),
    ]
    return inplace, functional


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    inplace, functional = opcheck_samples(device)
    for args in inplace:
        torch.library.opcheck(torch.ops.torchkvops.repeat_kv_cache_.default, args, raise_exception=True)
    for args in functional:
        torch.library.opcheck(torch.ops.torchkvops.repeat_kv_cache.default, args, raise_exception=True)


# ----------------------------------------------------------------------------------------------------
# torch.compile


def test_torch_compile_fullgraph_matches_eager():
    """One compiled function calls both ops: the in-place one mutates a graph input (the whole
    cache buffer, as the conventions ask), the functional one feeds further compute. The compiled
    in-place op must neither copy the cache (a functionalized mutation may turn into a clone plus a
    copy-back) nor change what the eager op does."""
    batch, repeats, num_tokens = 2, 3, 5

    def step(cache, kv):
        torchkvops.repeat_kv_cache_(cache, batch, repeats, num_tokens)
        return torchkvops.repeat_kv_cache(kv, repeats) * 2 + 1

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(7)
    for call in range(2):  # the first call compiles, the second reuses the graph with new data
        cache = torch.randn(2, 2, 8, 4, 64, 32, generator=gen)
        kv = torch.randn(2, 3, 9, 8, generator=gen)
        eager_cache, ref_cache = cache.clone(), cache.clone()
        eager_out = step(eager_cache, kv)
        reference.repeat_kv_cache_(ref_cache, batch, repeats, num_tokens)
        ptr = cache.data_ptr()
        outs = []
        largest = largest_cpu_allocation(lambda: outs.append(compiled(cache, kv)))
        if call == 1:
            assert largest < cache.nbytes // 16, f"compiled step allocated {largest} bytes (cache: {cache.nbytes})"
        assert cache.data_ptr() == ptr
        assert torch.equal(cache, eager_cache) and torch.equal(cache, ref_cache)
        assert torch.equal(outs[0], eager_out)
        assert torch.equal(outs[0], reference.repeat_kv_cache(kv, repeats) * 2 + 1)


# ----------------------------------------------------------------------------------------------------
# bad inputs: a clear error naming the argument, raised before anything is written


def _bad_inplace_cases():
    ok = lambda: torch.randn(6, 2, 5, 4)  # noqa: E731
    return [
        ("batch0", ok, (0, 3, 4), ValueError, r"repeat_kv_cache_: batch must be >= 1, got 0"),
        ("batch_neg", ok, (-2, 3, 4), ValueError, r"batch must be >= 1, got -2"),
        ("repeats0", ok, (2, 0, 4), ValueError, r"repeats must be >= 1, got 0"),
        (
            "too_many_rows",
            ok,
            (4, 2, 4),
            ValueError,
            r"batch \* repeats must be <= the cache's rows .*batch=4, repeats=2",
        ),
        ("huge_repeats", ok, (2, 2**62, 4), ValueError, r"batch \* repeats must be <="),
        ("tokens0", ok, (2, 3, 0), ValueError, r"num_tokens must be in \[1, max_tokens=5\].*got 0"),
        ("tokens_over", ok, (2, 3, 6), ValueError, r"num_tokens must be in \[1, max_tokens=5\].*got 6"),
        ("dim3", lambda: torch.randn(6, 5, 4), (2, 3, 4), ValueError, r"cache must have at least 4 dims"),
        ("int64", lambda: torch.zeros(6, 2, 5, 4, dtype=torch.int64), (2, 3, 4), TypeError, r"cache dtype .*Long"),
        ("int32", lambda: torch.zeros(6, 2, 5, 4, dtype=torch.int32), (2, 3, 4), TypeError, r"cache dtype"),
        ("bool", lambda: torch.zeros(6, 2, 5, 4, dtype=torch.bool), (2, 3, 4), TypeError, r"cache dtype .*Bool"),
        (
            "complex",
            lambda: torch.zeros(6, 2, 5, 4, dtype=torch.complex64),
            (2, 3, 4),
            TypeError,
            r"cache dtype .*Complex",
        ),
        (
            "expanded",
            lambda: torch.randn(1, 2, 5, 4).expand(6, 2, 5, 4),
            (1, 3, 4),
            ValueError,
            r"cache must not have overlapping memory",
        ),
        (
            "too_many_strided_dims",
            # 5 leading dims, each a step-2 slice, cannot merge: 8 strided dims per row > 6.
            lambda: torch.randn(4, 4, 4, 4, 4, 6, 4, 6, 4)[::2, ::2, ::2, ::2, ::2, :, ::2, :, ::2],
            (2, 3, 4),
            ValueError,
            r"strided dims per row",
        ),
    ]


@pytest.mark.parametrize("case", _bad_inplace_cases(), ids=lambda c: c[0])
def test_inplace_bad_inputs(case):
    _, make, args, exc, match = case
    cache = make()
    before = cache.clone()
    with pytest.raises(exc, match=match):
        torchkvops.repeat_kv_cache_(cache, *args)
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    "make,repeats,exc,match",
    [
        (lambda: torch.randn(6, 2, 5, 4), 0, ValueError, r"repeat_kv_cache: repeats must be >= 1, got 0"),
        (lambda: torch.randn(6, 2, 5, 4), -1, ValueError, r"repeats must be >= 1, got -1"),
        (lambda: torch.randn(5, 4, 3), 2, ValueError, r"repeat_kv_cache: cache must have at least 4 dims"),
        (lambda: torch.zeros(2, 2, 5, 4, dtype=torch.int64), 2, TypeError, r"repeat_kv_cache: cache dtype"),
        (lambda: torch.zeros(2, 2, 5, 4, dtype=torch.bool), 2, TypeError, r"cache dtype"),
        (lambda: torch.zeros(2, 2, 5, 4, dtype=torch.complex128), 2, TypeError, r"cache dtype"),
    ],
    ids=["repeats0", "repeats_neg", "dim3", "int64", "bool", "complex"],
)
def test_functional_bad_inputs(make, repeats, exc, match):
    with pytest.raises(exc, match=match):
        torchkvops.repeat_kv_cache(make(), repeats)


@pytest.mark.parametrize("repeats", [2**62 + 1, 2**61, 2**59], ids=["2^62+1", "2^61", "bytes-2^65"])
def test_functional_refuses_sizes_that_overflow(repeats):
    """rows * repeats (and its bytes) must fit in int64: no wrapped-around shape, no bogus error."""
    cache = torch.randn(1, 4, 1, 2, 2)
    with pytest.raises(ValueError, match=f"repeat_kv_cache: repeats={repeats} .*more bytes than int64"):
        torchkvops.repeat_kv_cache(cache, repeats)
    with FakeTensorMode() as fake, pytest.raises(ValueError, match="more bytes than int64"):  # torch.compile's view
        torchkvops.repeat_kv_cache(fake.from_tensor(cache), repeats)


# ----------------------------------------------------------------------------------------------------
# autograd: the in-place op behaves like a built-in in-place op


def test_inplace_bumps_the_version_so_a_stale_backward_raises():
    weight = torch.randn(4, 1, 2, 2, requires_grad=True)
    cache = torch.randn(4, 1, 2, 2)
    loss = (weight * cache).sum()  # saves `cache` for the backward
    version = cache._version
    torchkvops.repeat_kv_cache_(cache, 2, 2, 2)
    assert cache._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inplace_refuses_an_inference_tensor_outside_inference_mode():
    with torch.inference_mode():
        cache = torch.randn(4, 1, 2, 2)
    before = cache.clone()
    with pytest.raises(RuntimeError, match="repeat_kv_cache_: cache is an inference tensor"):
        torchkvops.repeat_kv_cache_(cache, 2, 2, 2)
    assert torch.equal(cache, before)  # refused before anything was written
    with torch.inference_mode():  # inside inference mode it is fine, as for built-in ops
        torchkvops.repeat_kv_cache_(cache, 2, 2, 2)
    assert torch.equal(cache[:, :, :2], before[:2].repeat_interleave(2, dim=0)[:, :, :2])


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non-leaf"])
def test_inplace_refuses_a_tensor_that_requires_grad(leaf):
    base = torch.randn(4, 1, 2, 2, requires_grad=True)
    cache = base if leaf else base * 1
    with pytest.raises(
        RuntimeError, match="repeat_kv_cache_: cache requires grad, but this in-place op has no derivative"
    ):
        torchkvops.repeat_kv_cache_(cache, 2, 2, 2)
    with torch.no_grad():  # as optimizers update parameters in place
        version = cache._version
        torchkvops.repeat_kv_cache_(cache, 2, 2, 2)
        assert cache._version > version


def test_functional_expanded_input_is_fine():
    # The functional op only reads its input, so a broadcast view is a valid input.
    cache = torch.randn(1, 2, 5, 4).expand(3, 2, 5, 4)
    assert_same_bytes(torchkvops.repeat_kv_cache(cache, 2), cache.repeat_interleave(2, dim=-4))


# ----------------------------------------------------------------------------------------------------
# build


@pytest.mark.skipif(
    torch.version.cuda is None
    or not os.path.isfile("/usr/local/cuda/bin/nvcc")
    or os.environ.get("TORCHKVOPS_NO_CUDA") == "1",
    reason="needs a CUDA build of torch and a CUDA toolkit in /usr/local/cuda",
)
def test_cuda_kernels_are_compiled_in():
    # No GPU is needed to compile them: CI must not silently ship a CPU-only build.
    assert torchkvops.has_cuda_kernels()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenMP build flag is set on Linux only")
def test_cpu_kernels_are_built_with_openmp():
    # at::parallel_for is a header template that compiles to a plain serial loop unless the extension
    # itself is built with -fopenmp; then the CPU kernels silently use one thread. The library must
    # call into the OpenMP runtime.
    with open(torchkvops._C.__file__, "rb") as fh:
        blob = fh.read()
    assert b"GOMP_parallel" in blob or b"__kmpc_fork_call" in blob


# ----------------------------------------------------------------------------------------------------
# CUDA only (skipped without a GPU)


@pytest.mark.cuda
@requires_gpu
def test_cuda_graph_capture_and_replay():
    batch, repeats, num_tokens = 3, 4, 37
    gen = torch.Generator().manual_seed(10)
    static = _on(make_cache([2, 2, 13, 4, 48, 64], torch.bfloat16, gen=gen), "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture
        torchkvops.repeat_kv_cache_(static, batch, repeats, num_tokens)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torchkvops.repeat_kv_cache_(static, batch, repeats, num_tokens)
    for _ in range(3):  # new prompts each replay
        fresh = _on(make_cache(list(static.shape), static.dtype, gen=gen), "cuda")
        static.copy_(fresh)
        expected = twin(static)
        reference.repeat_kv_cache_(expected, batch, repeats, num_tokens)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bytes(static, expected)
