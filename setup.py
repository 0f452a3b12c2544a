"""Builds torchkvops._C: the C++ kernels always, the CUDA kernels whenever torch is a CUDA build and a
CUDA toolkit is found (no GPU is needed to compile them). DEBUG=1 builds with -O0 -g; MAX_JOBS caps
ninja; TORCH_CUDA_ARCH_LIST overrides the default sm_80;sm_90+PTX when no GPU is visible."""

import glob
import os
import shutil
import sys

from setuptools import setup


def find_cuda_home():
    """The CUDA toolkit's root, or None.

    torch guesses it from the `nvcc` on PATH, but that can be a wrapper script outside the toolkit
    (it is on our CI machines), and then torch links against the wrong folder. Take the first
    candidate that really holds a toolkit: bin/nvcc and include/cuda_runtime.h."""

    def is_toolkit(path):
        return (
            bool(path)
            and os.path.isfile(os.path.join(path, "bin", "nvcc"))
            and os.path.isfile(os.path.join(path, "include", "cuda_runtime.h"))
        )

    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True), "/opt/cuda"]
    return next((c for c in candidates if is_toolkit(c)), None)


def wants_cuda(torch):
    if os.environ.get("TORCHKVOPS_NO_CUDA") == "1" or torch.version.cuda is None:
        return False
    cuda_home = find_cuda_home()
    if cuda_home is None:
        print("torchkvops: torch is a CUDA build but no CUDA toolkit was found; building the CPU kernels only")
        return False
    # torch.utils.cpp_extension reads CUDA_HOME once, when it is first imported.
    os.environ["CUDA_HOME"] = cuda_home
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
    print(
        f"torchkvops: building the CUDA kernels with the toolkit in {cuda_home}, "
        f"archs {os.environ.get('TORCH_CUDA_ARCH_LIST', 'of the visible GPUs')}"
    )
    return True


def extensions():
    import torch

    use_cuda = wants_cuda(torch)
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    here = os.path.dirname(os.path.abspath(__file__))
    csrc = os.path.join("torchkvops", "csrc")
    sources = sorted(glob.glob(os.path.join(csrc, "*.cpp")) + glob.glob(os.path.join(csrc, "cpu", "*.cpp")))
    # at::parallel_for is a header template: without -fopenmp it compiles to a serial loop, and the
    # CPU kernels would run on one thread whatever torch.get_num_threads() says. Linking -fopenmp
    # resolves to the libgomp that torch has already loaded (same soname), as torchao does.
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    extra = {"cxx": opt + openmp}  # the C++ standard is the one torch asks for
    if use_cuda:
        sources += sorted(glob.glob(os.path.join(csrc, "cuda", "*.cu")))
        extra["nvcc"] = opt + ["-lineinfo"]
        ext_class = CUDAExtension
    else:
        ext_class = CppExtension
    return [
        ext_class(
            "torchkvops._C",
            sources,
            extra_compile_args=extra,
            extra_link_args=openmp,
            include_dirs=[os.path.join(here, csrc)],
        )
    ]


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=True)


# TORCHKVOPS_PREBUILT=1: scripts/setup.sh has put a build of these same sources in place (its build cache):
# the install leaves the extension out instead of compiling it again.
prebuilt = os.environ.get("TORCHKVOPS_PREBUILT") == "1"
setup(ext_modules=[] if prebuilt else extensions(), cmdclass={} if prebuilt else {"build_ext": build_ext_class()})
