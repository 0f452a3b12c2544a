"""Runs decode steps eagerly, compiled, or replayed from CUDA graphs (`DecodeRunner`).

A captured graph replays kernels on fixed addresses: it is keyed by the decode shape and by the address
of every tensor it reads that may be made anew while the graph is kept (the decoder builds the key,
`Decoder._bind`). Graphs share one memory pool, in which a step's temporaries (all freed by the step's
end) reuse the same blocks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from ..utils import LRU

__all__ = ["DecodeRunner", "MAX_CUDA_GRAPHS"]

# How many captured graphs a rollout keeps (least recently used dropped first); they share one memory
# pool, in which a step's temporaries (all freed by the step's end) reuse the same blocks. Compaction
# (torchkvops.rollout.compaction) adds the shapes of the compacted batches: a few per rollout configuration.
MAX_CUDA_GRAPHS = 48
_RecompileLimitHit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", RuntimeError)


class DecodeRunner:
    """Runs `DecodeStep`s eagerly, compiled (torch.compile, fullgraph, with the row and key-length dims
    dynamic so that new batch sizes and lengths reuse the graph) and, on CUDA, from captured graphs."""

    def __init__(self, step: Callable[[], None], compile: bool, cuda_graphs: bool, device: torch.device):
        self.step = step
        self.fn: Callable[[], None] = torch.compile(step.__call__, fullgraph=True) if compile else step.__call__
        self.compiled = compile
        self.use_graphs = cuda_graphs and device.type == "cuda"
        self.device = device
        self.graphs: LRU[tuple, torch.cuda.CUDAGraph] = LRU(MAX_CUDA_GRAPHS)
        self.warmed: set[tuple] = set()
        self.eager_keys: set[tuple] = set()  # shapes whose compile or capture failed: run eagerly
        self._pool = None
        self._stream = None
        self._failed_graphs: list[torch.cuda.CUDAGraph] = []  # see _recover_from_failed_capture
        self.key: tuple | None = None
        self.compiled_steps = 0  # steps that ran (or were captured) compiled

    def start(self, dynamic_tensors: list[tuple[Tensor, tuple[int, ...]]], graph_key: tuple) -> None:
        """Before a rollout's first step: mark the dims that vary between rollouts as dynamic for the
        compiler, and pick the graph key (shape and addresses) of this rollout."""
        if self.compiled:
            for t, dims in dynamic_tensors:
                for d in dims:
                    torch._dynamo.maybe_mark_dynamic(t, d)
        self.key = graph_key

    def __call__(self) -> None:
        key = self.key
        if key in self.eager_keys:
            return self.step()
        if not self.use_graphs:
            return self._run_compiled_or_eager(key)
        graph = self.graphs.get(key)
        if graph is not None:
            return graph.replay()
        if key not in self.warmed:  # the first step of a new key runs for real, on the capture stream
            self._warm_up(key)
            self.warmed.add(key)
            return None
        graph = self._capture(key)
        if graph is None:
            return self.step()
        graph.replay()  # capturing recorded the step without running it
        return None

    def _run_compiled_or_eager(self, key) -> None:
        if not self.compiled:
            return self.step()
        try:
            out = self.fn()
            self.compiled_steps += 1
            return out
        except _RecompileLimitHit as e:
            # Dynamo refuses to compile this shape again (its recompile limit, counted over every
            # rollout compiled in this process): never fail a rollout for it; run it eagerly.
            warnings.warn(
                f"torchkvops: compiled decode hit torch._dynamo's recompile limit ({e}); this decode "
                "shape runs eagerly. Raise torch._dynamo.config.recompile_limit to compile it.",
                RuntimeWarning,
                stacklevel=3,
            )
            self.eager_keys.add(key)
            return self.step()

    def _warm_up(self, key) -> None:
        """Run the first step of a new key for real on the capture stream. Eager steps are watched for
        host syncs (the model's own, e.g. data-dependent routing): a step that syncs cannot be captured,
        and a failed capture leaves torch's CUDA state half torn down, so such a model runs without
        graphs and no capture is tried. (Compiled steps are not watched: compiling copies constants to
        the device once, and a model that syncs does not compile with fullgraph=True anyway.)"""

        def run() -> None:
            self._on_side_stream(lambda: self._run_compiled_or_eager(key))

        if self.compiled:
            return run()
        sync = _first_host_sync(run)
        if sync is not None:
            self._give_up_graphs(key, f"the decode step syncs with the host ({sync})")

    def _side_stream(self) -> torch.cuda.Stream:
        """The stream that warm-up and capture run on, on the model's device (not the current one)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def _on_side_stream(self, fn: Callable[[], None]) -> None:
        current = torch.cuda.current_stream(self.device)
        self._side_stream().wait_stream(current)
        with torch.cuda.stream(self._side_stream()):  # also makes the stream's device current
            fn()
        current.wait_stream(self._side_stream())

    def _capture(self, key) -> torch.cuda.CUDAGraph | None:
        """Capture one step on the side stream (torch.cuda.graph's steps, written out so that a failed
        capture still restores the caller's stream; torch 2.11's graph context skips that when
        capture_end raises)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        error: BaseException | None = None
        with torch.cuda.stream(self._side_stream()):
            # thread_local: unsafe CUDA calls of other threads (a data loader's pinned-memory thread)
            # do not invalidate this capture.
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                self._run_compiled_or_eager(key)
            except Exception as e:  # noqa: BLE001 - reported below, after the capture is ended
                error = e
            try:
                graph.capture_end()
            except Exception as e:  # noqa: BLE001 - an invalidated capture; the first error is the cause
                error = error or e
        if error is not None:
            self._recover_from_failed_capture(graph)
            self._give_up_graphs(
                key, f"its CUDA-graph capture failed ({type(error).__name__}: {' '.join(str(error).split())[:300]})"
            )
            return None
        return self.graphs.put(key, graph)

    def _recover_from_failed_capture(self, graph: torch.cuda.CUDAGraph) -> None:
        """Undo what a failed capture leaves behind (torch 2.11's capture_end raises before its own
        clean-up): the caching allocator still routes this capture's allocations to the pool and holds
        a filter that points at `graph` (kept alive here, so that it never dangles), and the default
        CUDA generator stays in capture mode, so that every later eager random op (dropout, HF's
        sampling) would raise "Offset increment outside graph capture". The allocator calls are the
        ones torch.cuda.use_mem_pool makes on leaving; a capture that succeeds resets the generator."""
        self._failed_graphs.append(graph)
        device = self.device.index if self.device.index is not None else torch.cuda.current_device()
        try:
            torch._C._cuda_endAllocateToPool(device, self._pool)  # a no-op where torch already did it
            if not self.graphs:
                # The failed capture's hold on the pool, released only when no captured graph shares
                # the pool: a torch that released it itself must never see it released twice while
                # live graphs use it (this leaks the pool's memory then, rather than freeing it early).
                torch._C._cuda_releasePool(device, self._pool)
        except Exception:  # noqa: BLE001 - best effort: a torch that cleaned up itself may refuse these
            pass
        self._pool = None  # the graphs captured so far keep theirs alive; new captures use a new one
        _end_generator_capture(self._side_stream(), self.device)

    def _give_up_graphs(self, key, reason: str) -> None:
        warnings.warn(
            f"torchkvops: decode runs without CUDA graphs for this rollout, because {reason}",
            RuntimeWarning,
            stacklevel=4,
        )
        self.use_graphs = False
        self.eager_keys.add(key)
        self.graphs.clear()  # never replayed again: free their memory

    def reset(self) -> None:
        """Forget every captured graph (their pool memory is freed once no graph uses it)."""
        self.graphs.clear()
        self.warmed.clear()
        self._pool = None


def _end_generator_capture(stream: torch.cuda.Stream, device: torch.device) -> None:
    """Take the default CUDA generator out of capture mode after a failed capture: a capture that
    succeeds ends with it out of capture mode."""
    probe, scratch = torch.cuda.CUDAGraph(), torch.zeros(1, device=device)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(stream):
        probe.capture_begin(capture_error_mode="thread_local")
        scratch.add_(1)
        probe.capture_end()
    torch.cuda.synchronize(device)


def _first_host_sync(fn: Callable[[], None]) -> str | None:
    """Run `fn` with torch's CUDA sync debug mode on; the first host sync it made (torch's warning), or
    None. Other warnings `fn` raises are passed on. A caller's own sync debug mode is left alone (and
    nothing is watched then: "error" raises at the sync anyway)."""
    if torch.cuda.get_sync_debug_mode() != 0:
        fn()
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    for w in caught:
        if w not in syncs:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return str(syncs[0].message).splitlines()[0] if syncs else None
