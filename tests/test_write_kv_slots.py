"""write_kv_slots_ (the paged layout's writes, each token at its pool slot) against its reference, opcheck,
compiled, and its errors."""

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

BLOCKS, KV_HEADS, HEAD_DIM = 6, 3, 8


def make(device, dtype=torch.float32, rows=3, tokens=2, block_size=4, layer=1, seed=0):
    """A pool of 2 layers, random K/V, and distinct random slots [rows, tokens] of the pool."""
    g = torch.Generator().manual_seed(seed * 1000 + rows * 10 + tokens)
    cache = torch.randn(2, 2, BLOCKS, KV_HEADS, block_size, HEAD_DIM, generator=g).to(device, dtype)
    key = torch.randn(rows, KV_HEADS, tokens, HEAD_DIM, generator=g).to(device, dtype)
    value = torch.randn(rows, KV_HEADS, tokens, HEAD_DIM, generator=g).to(device, dtype)
    slots = torch.randperm(BLOCKS * block_size, generator=g)[: rows * tokens].reshape(rows, tokens)
    return cache, key, value, layer, slots.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,tokens,block_size", [(3, 2, 4), (5, 1, 1), (1, 9, 16), (4, 6, 4), (2, 0, 4)])
def test_matches_reference(device, dtype, rows, tokens, block_size):
    cache, key, value, layer, slots = make(device, dtype, rows, tokens, block_size)
    expected = cache.clone()
    reference.write_kv_slots_(expected, key, value, layer, slots)
    ptr = cache.data_ptr()
    torchkvops.ops.write_kv_slots_(cache, key, value, layer, slots)
    assert cache.data_ptr() == ptr
    assert torch.equal(cache, expected)
    # What the reference wrote, read back slot by slot (and the other layer untouched).
    for row, row_slots in enumerate(slots.tolist()):
        for token, slot in enumerate(row_slots):
            block, offset = divmod(slot, block_size)
            assert torch.equal(cache[layer, 0, block, :, offset], key[row, :, token])
            assert torch.equal(cache[layer, 1, block, :, offset], value[row, :, token])


@pytest.mark.parametrize("device", DEVICES)
def test_one_slot_a_row_and_strided_key_and_value(device):
    """Decode's write: one token a row, slots [rows]; K and V as views of a projection's output (not
    contiguous), as a layer hands them over."""
    cache, _, _, layer, slots = make(device, rows=5, tokens=1)
    g = torch.Generator().manual_seed(7)
    projected = torch.randn(5, 1, 2 * KV_HEADS, HEAD_DIM, generator=g).to(device)
    key, value = projected[:, :, :KV_HEADS].transpose(1, 2), projected[:, :, KV_HEADS:].transpose(1, 2)
    assert not key.is_contiguous()
    expected = cache.clone()
    reference.write_kv_slots_(expected, key, value, layer, slots)
    torchkvops.ops.write_kv_slots_(cache, key, value, layer, slots[:, 0].contiguous())
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for args in (make(device), make(device, rows=4, tokens=1), make(device, rows=2, tokens=5, block_size=2)):
        torch.library.opcheck(torch.ops.torchkvops.write_kv_slots_.default, args)
    cache, key, value, layer, slots = make(device, rows=4, tokens=1)
    torch.library.opcheck(torch.ops.torchkvops.write_kv_slots_.default, (cache, key, value, layer, slots[:, 0]))


def test_compiled_write_stays_in_place_for_any_slots():
    """A compiled decode step writes through it for every step's slots without recompiling on them."""
    cache, key, value, layer, _ = make("cpu", rows=3, tokens=1)

    @torch.compile(fullgraph=True, dynamic=True)
    def step(c, k, v, s):
        torchkvops.ops.write_kv_slots_(c, k, v, layer, s)
        return c[layer, 0].sum()

    for slots in ([1, 22, 9], [0, 5, 23]):
        expected = cache.clone()
        s = torch.tensor(slots)
        reference.write_kv_slots_(expected, key, value, layer, s)
        total = step(cache, key, value, s)
        assert torch.equal(cache, expected)
        assert torch.allclose(total, expected[layer, 0].sum())


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: (a[0][0], *a[1:]), r"cache must be \[layers, 2, blocks, kv_heads, block_size, head_dim\]"),
        (
            lambda a: (a[0], a[1][:, :2], a[2][:, :2], *a[3:]),
            r"does not fit the cache .* \(kv_heads and head_dim differ\)",
        ),
        (lambda a: (a[0], a[1], a[2][:, :, :1], *a[3:]), "key and value must both be"),
        (lambda a: (*a[:3], 2, a[4]), "layer must be in"),
        (lambda a: (a[0], a[1].half(), a[2].half(), *a[3:]), "dtype"),
        (lambda a: (*a[:4], a[4][:, :1]), r"slots must be .* of shape \[3, 2\] .* got Long of shape \[3, 1\]"),
        (lambda a: (*a[:4], a[4].reshape(-1)), r"slots must be .* of shape \[3, 2\]"),
        (lambda a: (*a[:4], a[4].int()), "slots must be a contiguous int64 tensor"),
        (lambda a: (*a[:4], a[4].t().contiguous().t()), "slots must be a contiguous int64 tensor"),
        (lambda a: (*a[:4], a[4].index_fill(1, torch.tensor([1]), 24)), r"slots must be in \[0, 24\).* got 24"),
        (lambda a: (*a[:4], a[4].index_fill(0, torch.tensor([2]), -1)), r"got -1 \(row 2, token 0\)"),
    ],
)
def test_bad_inputs_raise_before_anything_is_written(change, match):
    args = change(make("cpu"))
    before = args[0].clone()
    with pytest.raises((ValueError, TypeError), match=match):
        torchkvops.ops.write_kv_slots_(*args)
    assert torch.equal(args[0], before)


def test_write_bumps_the_version_counter():
    """A write autograd can see: a tensor saved for backward before it is caught after it."""
    cache, key, value, layer, slots = make("cpu")
    version = cache._version
    torchkvops.ops.write_kv_slots_(cache, key, value, layer, slots)
    assert cache._version == version + 1


def test_the_paged_write_helper_is_the_reference_write():
    """paged_kv.write_slots (what every paged write calls: decode, prefill, packed turns) casts K and V to
    the pool's dtype and writes each token at its slot."""
    from torchkvops.rollout.paged_kv import write_slots

    cache, key, value, layer, slots = make("cpu", dtype=torch.bfloat16, rows=4, tokens=3)
    expected = cache.clone()
    reference.write_kv_slots_(expected, key, value, layer, slots)
    write_slots(cache, layer, key.float(), value.float(), slots)
    assert torch.equal(cache, expected)


@pytest.mark.cuda
@requires_gpu
def test_cuda_slot_out_of_range_trips_the_device_side_assert():
    """On CUDA the slots are checked by the kernel (no host sync per call). A device-side assert leaves the
    process's CUDA context unusable, so it runs in its own process."""
    script = """
import torch, torchkvops
cache = torch.zeros(2, 2, 4, 2, 8, 4, device="cuda")
key = torch.ones(2, 2, 1, 4, device="cuda")
torchkvops.ops.write_kv_slots_(cache, key, key.clone(), 0, torch.tensor([3, 32], device="cuda"))
torch.cuda.synchronize()
"""
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode != 0 and "device-side assert" in proc.stderr, proc.stderr[-2000:]
