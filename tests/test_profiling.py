"""StageTimer (torchkvops.rollout.profiling) on CUDA, with torch.cuda's event, stream and memory calls
stood in for on this CPU: the events that time a rollout's stages are recorded on the stream of the
model's device, which for a model on cuda:1 is not the current device's."""

import torch

from torchkvops.rollout.profiling import StageTimer


class FakeEvent:
    def __init__(self, enable_timing=False):
        self.stream = "the current device's stream (no stream passed)"

    def record(self, stream=None):
        if stream is not None:
            self.stream = stream

    def elapsed_time(self, other):
        return 1.0


def test_stage_events_are_recorded_on_the_models_device_stream(monkeypatch):
    events = []

    def event(enable_timing=False):
        events.append(FakeEvent(enable_timing))
        return events[-1]

    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {torch.device(device)}")
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    timer = StageTimer(torch.device("cuda", 1), enabled=True)
    timer.start()
    with timer.stage("prefill"):
        pass
    with timer.stage("decode"):
        pass
    assert timer.elapsed_ms()["total"] == 1.0
    assert [e.stream for e in events] == ["stream of cuda:1"] * 4
