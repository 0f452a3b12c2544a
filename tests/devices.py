"""Device parameters shared by test modules: one test body, run once per device, as extension-cpp's
`sample_inputs(device)` does.

    @pytest.mark.parametrize("device", DEVICES)
    def test_something(device): ...

The `cuda` param is always collected, so `pytest -m cuda` selects it, and is skipped without a GPU.
"""

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, requires_gpu])
DEVICES = ["cpu", CUDA]


def per_device(cpu_cases, cuda_cases):
    """("device", case) params for a test whose case list differs by device:
    @pytest.mark.parametrize("device,case", per_device(cpu_cases, cuda_cases))."""
    return [pytest.param("cpu", case) for case in cpu_cases] + [
        pytest.param("cuda", case, marks=CUDA.marks) for case in cuda_cases
    ]
