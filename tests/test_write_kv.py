"""write_kv_ against its reference, opcheck, and its errors."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from devices import DEVICES, requires_gpu
from timeouts import TIMEOUT

import torchkvops
from torchkvops import reference


def make(device, dtype=torch.float32, rows=3, q=4, start=2, layer=1):
    g = torch.Generator().manual_seed(rows * 100 + q)
    cache = torch.randn(2, 2, 5, 3, 12, 8, generator=g).to(device, dtype)
    key = torch.randn(rows, 3, q, 8, generator=g).to(device, dtype)
    value = torch.randn(rows, 3, q, 8, generator=g).to(device, dtype)
    return cache, key, value, layer, torch.tensor([start], device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,q,start", [(3, 4, 2), (5, 1, 11), (1, 12, 0)])
def test_matches_reference(device, dtype, rows, q, start):
    cache, key, value, layer, start_t = make(device, dtype, rows, q, start)
    expected = cache.clone()
    reference.write_kv_(expected, key, value, layer, start_t)
    ptr = cache.data_ptr()
    torchkvops.ops.write_kv_(cache, key, value, layer, start_t)
    assert cache.data_ptr() == ptr
    assert torch.equal(cache, expected)


def per_row(args, starts):
    """make()'s arguments with one start per row of key."""
    return (*args[:4], torch.tensor(starts, device=args[4].device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,q,starts", [(3, 1, [0, 11, 5]), (5, 2, [10, 0, 3, 3, 7]), (2, 0, [12, 4]), (1, 4, [8])])
def test_each_row_writes_at_its_own_start(device, dtype, rows, q, starts):
    """A start per row: rows of one batch at different columns (decode after a packed turn, a streaming
    batch's rows admitted at other steps); the columns of other rows and positions are untouched."""
    args = per_row(make(device, dtype, rows, q), starts)
    expected = args[0].clone()
    reference.write_kv_(expected, *args[1:])
    torchkvops.ops.write_kv_(*args)
    assert torch.equal(args[0], expected)
    for row, first in enumerate(starts):  # the reference writes the row's own columns only
        assert torch.equal(expected[args[3], 0, row, :, first : first + q], args[1][row])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for args in (make(device, q=4), make(device, q=1, start=7), per_row(make(device, q=1), [3, 0, 11])):
        torch.library.opcheck(torch.ops.torchkvops.write_kv_.default, args)


def test_compiled_per_row_write_stays_in_place_for_any_starts():
    cache, key, value, layer, _ = make("cpu", q=1)

    @torch.compile(fullgraph=True, dynamic=True)
    def step(c, k, v, s):
        torchkvops.ops.write_kv_(c, k, v, layer, s)
        return c[layer, 0].sum()

    for starts in ([1, 2, 3], [11, 0, 6]):
        expected = cache.clone()
        start = torch.tensor(starts)
        reference.write_kv_(expected, key, value, layer, start)
        step(cache, key, value, start)
        assert torch.equal(cache, expected)


def test_compiled_write_stays_in_place():
    cache, key, value, layer, start = make("cpu", q=1, start=5)
    expected = cache.clone()
    reference.write_kv_(expected, key, value, layer, start)

    @torch.compile(fullgraph=True)
    def step(c, k, v, s):
        torchkvops.ops.write_kv_(c, k, v, layer, s)
        return c[layer, 0].sum()

    step(cache, key, value, start)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: (a[0][0], *a[1:]), "cache must be"),
        (lambda a: (a[0], a[1][:, :2], *a[2:]), "key and value must both be"),
        (lambda a: (a[0], a[1][..., :4], a[2][..., :4], *a[3:]), "does not fit"),
        (lambda a: (*a[:3], 2, a[4]), "layer must be in"),
        (lambda a: (a[0], a[1].half(), a[2].half(), *a[3:]), "dtype"),
        (
            lambda a: (*a[:4], torch.tensor([1, 2])),
            r"start must be an int64 tensor .* of 1 element .* or of 3 elements",
        ),
        (lambda a: (*a[:4], torch.tensor([[1, 2, 3]])), r"start must be an int64 tensor .* got Long of shape \[1, 3\]"),
        (lambda a: (*a[:4], torch.tensor([1.0])), "start must be an int64 tensor"),
        (lambda a: (*a[:4], torch.tensor([0, 9, 1])), r"start must be in \[0, 8\].* got 9 \(row 1\)"),
        (lambda a: (*a[:4], torch.tensor([0, 1, -2])), r"start must be in \[0, 8\].* got -2 \(row 2\)"),
        (lambda a: (*a[:4], torch.tensor([9])), r"start must be in \[0, 8\] so that its 4 token\(s\) fit .* got 9"),
        (lambda a: (*a[:4], torch.tensor([-1])), r"start must be in \[0, 8\].* got -1"),
    ],
)
def test_bad_inputs_raise_before_anything_is_written(change, match):
    args = change(make("cpu"))
    before = args[0].clone()
    with pytest.raises((ValueError, TypeError), match=match):
        torchkvops.ops.write_kv_(*args)
    assert torch.equal(args[0], before)


def test_issue_example_writes_nothing_when_start_is_out_of_range():
    cache = torch.zeros(2, 2, 4, 2, 8, 4)
    with pytest.raises(ValueError, match="start must be in"):
        torchkvops.ops.write_kv_(cache, torch.ones(2, 2, 3, 4), torch.ones(2, 2, 3, 4), 0, torch.tensor([6]))
    assert not cache.any()


@pytest.mark.parametrize("tokens", [4, 0])
def test_start_out_of_range_is_refused_even_for_an_empty_write(tokens):
    cache = torch.zeros(2, 2, 4, 2, 8, 4)
    key = torch.ones(2, 2, tokens, 4)
    with pytest.raises(ValueError, match=rf"start must be in \[0, {8 - tokens}\].* got 9"):
        torchkvops.ops.write_kv_(cache, key, key.clone(), 0, torch.tensor([9]))
    assert not cache.any()


@pytest.mark.cuda
@requires_gpu
@pytest.mark.parametrize("tokens", [4, 0])
@pytest.mark.parametrize("start", [[9], [0, 9]], ids=["one", "per-row"])
def test_cuda_start_out_of_range_trips_the_device_side_assert(tokens, start):
    """On CUDA `start` is checked by the kernel (no host sync per call), also when there is nothing to
    write, and a row's own start with one per row. A device-side assert leaves the process's CUDA context
    unusable, so it runs in its own process."""
    script = f"""
import torch, torchkvops
cache = torch.zeros(2, 2, 4, 2, 8, 4, device="cuda")
key = torch.ones(2, 2, {tokens}, 4, device="cuda")
torchkvops.ops.write_kv_(cache, key, key.clone(), 0, torch.tensor({start}, device="cuda"))
torch.cuda.synchronize()
"""
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode != 0 and "device-side assert" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.cuda
@requires_gpu
@pytest.mark.parametrize("moved", ["key", "value", "start"])
def test_a_tensor_on_another_device_is_refused_before_writing(moved):
    cache, key, value, layer, start = make("cuda")
    args = {"key": key, "value": value, "start": start}
    args[moved] = args[moved].cpu()
    before = cache.clone()
    with pytest.raises(ValueError, match="write_kv_: .*device"):
        torchkvops.ops.write_kv_(cache, args["key"], args["value"], layer, args["start"])
    assert torch.equal(cache, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["head_dim_strided", "permuted"])
def test_non_contiguous_key_and_value(device, layout):
    cache, key, value, layer, start = make(device, torch.float16)
    if layout == "head_dim_strided":
        key = torch.randn(3, 3, 4, 16, device=device, dtype=torch.float16)[..., ::2]
        value = torch.randn(3, 3, 4, 16, device=device, dtype=torch.float16)[..., 1::2]
    else:  # [rows, tokens, heads, dim] transposed, as projections come out before .transpose(1, 2)
        key = torch.randn(3, 4, 3, 8, device=device, dtype=torch.float16).transpose(1, 2)
        value = torch.randn(3, 4, 3, 8, device=device, dtype=torch.float16).transpose(1, 2)
    expected = cache.clone()
    reference.write_kv_(expected, key, value, layer, start)
    torchkvops.ops.write_kv_(cache, key, value, layer, start)
    assert torch.equal(cache, expected)


def test_write_bumps_the_version_and_refuses_inference_tensors_outside_inference_mode():
    cache, key, value, layer, start = make("cpu")
    version = cache._version
    torchkvops.ops.write_kv_(cache, key, value, layer, start)
    assert cache._version > version
    with torch.inference_mode():
        frozen = cache.clone()
    with pytest.raises(RuntimeError, match="write_kv_: cache is an inference tensor"):
        torchkvops.ops.write_kv_(frozen, key, value, layer, start)
