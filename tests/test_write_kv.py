"""write_kv_ against its reference, opcheck, and its errors."""

import pytest
import torch

import torchkvops
from torchkvops import reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make(device, dtype=torch.float32, rows=3, q=4, start=2, layer=1):
    g = torch.Generator().manual_seed(rows * 100 + q)
    cache = torch.randn(2, 2, 5, 3, 12, 8, generator=g).to(device, dtype)
    key = torch.randn(rows, 3, q, 8, generator=g).to(device, dtype)
    value = torch.randn(rows, 3, q, 8, generator=g).to(device, dtype)
    return cache, key, value, layer, torch.tensor([start], device=device)


@pytest.mark.parametrize("device", [pytest.param(d, marks=pytest.mark.cuda) if d == "cuda" else d for d in DEVICES])
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


@pytest.mark.parametrize("device", [pytest.param(d, marks=pytest.mark.cuda) if d == "cuda" else d for d in DEVICES])
def test_opcheck(device):
    for args in (make(device, q=4), make(device, q=1, start=7)):
        torch.library.opcheck(torch.ops.torchkvops.write_kv_.default, args)


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
        (lambda a: (*a[:4], torch.tensor([1, 2])), "start must be a 1-element int64"),
        (lambda a: (*a[:4], torch.tensor([1.0])), "start must be a 1-element int64"),
    ],
)
def test_bad_inputs(change, match):
    with pytest.raises((ValueError, TypeError), match=match):
        torchkvops.ops.write_kv_(*change(make("cpu")))
