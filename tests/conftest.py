import os
import sys

# tests/models.py is shared by test modules; make it importable as `models`.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# DeepSpeed's ZeRO-3 workers JIT-build its shared-memory comm op with torch's cpp_extension, into one folder
# per user by default, which every environment on the machine shares (a floor venv's torch 2.11, CI's fresh
# clone, this checkout's venv: each rebuilds it over the others), locked by a file that a killed build leaves
# behind: every later build then waits on it until the test's timeout. One folder per environment, inherited
# by every worker the tests launch.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


import pytest  # noqa: E402
import torch  # noqa: E402
from models import FAMILIES  # noqa: E402


def compiled(rollout) -> bool:
    """Whether every decode step of `rollout` so far ran compiled: some did, and no graph key fell back to
    eager decode (Dynamo's recompile limit, a failed compile): a compiled-vs-eager comparison compares that."""
    counters = rollout.decode_counters()
    return counters.compiled_steps > 0 and counters.eager_keys == 0


# Dynamo's recompile limit counts the graphs of one code object over the whole process: the decode step of
# every compiled rollout the suite builds (hundreds of models and configurations, where a training process
# builds a few). Past it, compiled tests would decode eagerly and compare eager with eager (they assert
# `compiled(rollout)`); the one test of the limit itself patches it back down.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

# Under pytest-xdist (the README's test command runs `-n 2`) each worker is a process of its own: the
# workers' threads together are the machine's cores, not each worker's (two workers of two OpenMP threads
# each on a 2-core machine stall each other's small ops).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="module")
def family_models():
    """One model of each family (tests/models.py), built once per test module."""
    return {name: build() for name, build in FAMILIES.items()}


@pytest.fixture(scope="module")
def llama(family_models):
    return family_models["llama"]


@pytest.fixture
def one_thread():
    """A GRPO step on a tiny model is hundreds of small ops; two OpenMP threads on a busy 2-core
    machine stall each of them by milliseconds (the example scripts' --threads default to 1 for the same
    reason). Used by the TRL tests (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
