"""DecodeRunner's CUDA-graph control flow, on the CPU: torch.cuda's stream, graph and sync-debug API is
replaced by a recorder, so that the order of warm-up, capture, replay and fallback is tested where no
GPU is. A fake graph records the steps run while it captures and runs them on each replay, as a CUDA
graph does with kernels; a fake sync warns in sync-debug "warn" mode and, during a capture, fails and
invalidates it, as CUDA does. What only a GPU can show (the kernels, torch's own state after a failed
capture) is tested in tests/test_cuda_graphs.py."""

import contextlib
import warnings

import pytest
import torch

from torchkvops.rollout import graphs

KEY_A, KEY_B = ("shape A",), ("shape B",)


class FakeStream:
    def __init__(self, device=None):
        self.device = device

    def wait_stream(self, other):
        pass


class FakeCuda:
    def __init__(self):
        self.default = self.stream = FakeStream()
        self.mode = 0  # sync debug mode: 0 default, 1 warn, 2 error
        self.capturing = None
        self.captures = 0
        self.pool_calls = []
        self.generator_resets = 0

    def synced(self):
        if self.capturing is not None:
            self.capturing.invalidated = True
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        if self.mode == 1:
            warnings.warn("called a synchronizing CUDA operation", UserWarning)
        if self.mode == 2:
            raise RuntimeError("called a synchronizing CUDA operation")

    def install(self, monkeypatch):
        fake = self

        class Graph:
            def __init__(self):
                self.ops, self.invalidated = [], False

            def capture_begin(self, pool=None, capture_error_mode="global"):
                assert fake.stream is not fake.default, "capture must run on a side stream"
                assert capture_error_mode == "thread_local"
                fake.capturing, fake.captures = self, fake.captures + 1

            def capture_end(self):
                fake.capturing = None
                if self.invalidated:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

            def replay(self):
                for op in self.ops:
                    op()

        @contextlib.contextmanager
        def stream(s):
            previous, fake.stream = fake.stream, s
            try:
                yield
            finally:
                fake.stream = previous

        modes = {"default": 0, "warn": 1, "error": 2}
        for name, value in {
            "Stream": FakeStream,
            "CUDAGraph": Graph,
            "stream": stream,
            "current_stream": lambda device=None: fake.stream,
            "synchronize": lambda device=None: None,
            "graph_pool_handle": lambda: ("pool", 1),
            "current_device": lambda: 0,
            "get_sync_debug_mode": lambda: fake.mode,
            "set_sync_debug_mode": lambda mode: setattr(fake, "mode", modes.get(mode, mode)),
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(
            torch._C, "_cuda_endAllocateToPool", lambda d, p: fake.pool_calls.append(("end", d, p)), raising=False
        )
        monkeypatch.setattr(
            torch._C, "_cuda_releasePool", lambda d, p: fake.pool_calls.append(("release", d, p)), raising=False
        )
        monkeypatch.setattr(
            graphs,
            "_end_generator_capture",
            lambda stream, device: setattr(fake, "generator_resets", fake.generator_resets + 1),
        )
        return self


class Step:
    """A decode step that counts the times it really ran. sync: None, "always" (the model syncs in its
    forward) or "while_capturing" (only a capture fails)."""

    def __init__(self, fake: FakeCuda, sync=None, other_warning=False):
        self.fake, self.sync, self.other_warning, self.runs = fake, sync, other_warning, 0

    def __call__(self):
        if self.sync == "always" or (self.sync == "while_capturing" and self.fake.capturing is not None):
            self.fake.synced()
        if self.other_warning:
            warnings.warn("a warning of the model's own", DeprecationWarning)
        if self.fake.capturing is not None:
            self.fake.capturing.ops.append(self.run)
        else:
            self.run()

    def run(self):
        self.runs += 1


@pytest.fixture
def fake(monkeypatch):
    return FakeCuda().install(monkeypatch)


def runner_for(step):
    return graphs.DecodeRunner(step, compile=False, cuda_graphs=True, device=torch.device("cuda", 0))


def steps(runner, key, count):
    runner.start([], graph_key=key)
    for _ in range(count):
        runner()


def test_warm_up_then_one_capture_per_key_then_replays(fake):
    step = Step(fake)
    runner = runner_for(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steps(runner, KEY_A, 5)  # warm-up (runs), capture (records, then one replay), three replays
        assert step.runs == 5 and fake.captures == 1
        steps(runner, KEY_B, 3)  # a new key: its own warm-up and capture
        assert step.runs == 8 and fake.captures == 2
        steps(runner, KEY_A, 2)  # the first key's graph replays
        assert step.runs == 10 and fake.captures == 2
    assert list(runner.graphs) == [KEY_B, KEY_A]  # least recently used first
    assert fake.stream is fake.default and fake.mode == 0


def test_a_step_that_syncs_is_seen_in_the_warm_up_and_never_captured(fake):
    step = Step(fake, sync="always")
    runner = runner_for(step)
    with pytest.warns(
        RuntimeWarning,
        match=r"runs without CUDA graphs .* syncs with the host "
        r"\(called a synchronizing CUDA operation\)",
    ):
        steps(runner, KEY_A, 4)
    assert step.runs == 4 and fake.captures == 0 and not runner.graphs
    assert fake.stream is fake.default and fake.mode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per rollout, not per call
        steps(runner, KEY_B, 2)
    assert step.runs == 6 and fake.captures == 0


def test_a_failed_capture_is_cleaned_up_and_reported_with_its_first_error(fake):
    step = Step(fake, sync="while_capturing")
    runner = runner_for(step)
    with pytest.warns(
        RuntimeWarning,
        match=r"CUDA-graph capture failed \(RuntimeError: CUDA error: operation "
        r"not permitted when stream is capturing\)",
    ):
        steps(runner, KEY_A, 4)
    assert step.runs == 4 and fake.captures == 1 and not runner.graphs
    assert fake.stream is fake.default  # the caller's stream, although capture_end raised
    assert fake.pool_calls == [("end", 0, ("pool", 1)), ("release", 0, ("pool", 1))]
    assert fake.generator_resets == 1
    assert len(runner._failed_graphs) == 1  # kept alive: torch's allocator may still point at it


def test_other_warnings_of_the_warm_up_step_are_passed_on(fake):
    runner = runner_for(Step(fake, other_warning=True))
    with pytest.warns(DeprecationWarning, match="a warning of the model's own"):
        steps(runner, KEY_A, 1)
    assert fake.mode == 0


def test_a_callers_sync_debug_mode_is_left_as_it_is(fake):
    fake.mode = 2  # "error", set by the caller: a step that syncs raises, as the caller asked
    runner = runner_for(Step(fake))
    steps(runner, KEY_A, 3)
    assert fake.mode == 2 and fake.captures == 1
    with pytest.raises(RuntimeError, match="synchronizing"):
        steps(runner_for(Step(fake, sync="always")), KEY_A, 1)
    assert fake.mode == 2


def test_the_pool_is_released_only_when_no_captured_graph_shares_it(fake):
    """Graphs of one rollout share a memory pool: after a failed capture, the pool is not released on
    behalf of the failed graph while an earlier graph holds it too (a torch that released it itself
    would otherwise count it released twice). The rollout then runs without graphs and drops them."""
    step = Step(fake)
    runner = runner_for(step)
    steps(runner, KEY_A, 3)  # captured
    step.sync = "while_capturing"
    with pytest.warns(RuntimeWarning, match="CUDA-graph capture failed"):
        steps(runner, KEY_B, 3)
    assert fake.pool_calls == [("end", 0, ("pool", 1))]
    assert not runner.graphs
    runs = step.runs
    steps(runner, KEY_A, 2)  # eager from now on
    assert step.runs == runs + 2 and fake.captures == 2
