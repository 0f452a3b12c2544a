"""The decode loop: one statically shaped step, run eagerly, compiled, or replayed from a CUDA graph.

A step feeds every row's last token, writes its K/V at `write_pos`, samples the next token with the
`sample_tokens` operator (`sample_tokens_with_logprobs` when log-probabilities are asked for) and
records it; it reads and updates only tensors that keep their addresses
for the whole rollout (`DecodeState`, the KV buffers, the model's parameters) and never syncs with the
host, so on CUDA it is captured once per decode shape and replayed (`DecodeRunner`).

Graph keys. A captured graph replays kernels on fixed addresses: it is keyed by the decode shape and
by the address of every tensor it reads, the model's parameters and buffers included, so that a
parameter replaced by a new tensor (FSDP/ZeRO-3 gathering weights into new storage,
`load_state_dict(assign=True)`, `model.to(...)`) re-captures instead of replaying on stale memory.
Parameters updated in place (an optimizer step) keep their addresses, and the graph reads the new
values.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

from .hf import ModelAdapter
from .kv_cache import RolloutKVCache
from .sampling import SamplingParams, sample, sample_with_logprobs

__all__ = ["DecodeState", "DecodeStep", "DecodeRunner"]

# How many captured graphs a rollout keeps (least recently used dropped first); they share one memory
# pool, in which a step's temporaries (all freed by the step's end) reuse the same blocks. Compaction
# (torchkvops.compaction) adds the shapes of the compacted batches: a few per rollout configuration.
MAX_CUDA_GRAPHS = 48
_RecompileLimitHit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", RuntimeError)


class DecodeState:
    """Statically shaped tensors that the decode step reads and updates in place."""

    def __init__(self, rows: int, mask_len: int, max_new_tokens: int, dtype: torch.dtype, device: torch.device,
                 prompts: int = 0, prompt_len: int = 0, logprobs: bool = False, slots: int = 0):
        self.shape = (rows, mask_len, max_new_tokens, dtype, prompts, prompt_len, logprobs, slots)
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)  # the token fed next
        self.position_ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        # Additive bias over the decode buffer's keys: 0 where a row may attend, -inf elsewhere.
        self.bias = torch.zeros(rows, 1, 1, mask_len, dtype=dtype, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # index of the token sampled next
        self.keys = torch.zeros(rows, dtype=torch.long, device=device)  # per-row sampling keys
        # The first step at which a live row's logits could not be sampled from (NaN, +inf, or all -inf:
        # HF's sampling raises there); -1 while none. Read at the all-ended check and after decode.
        self.nonfinite_step = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.responses = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=device)
        # With logprobs: each sampled token's log-probability (0 once the row has ended), as responses.
        self.logprobs = torch.zeros(rows, max_new_tokens, dtype=torch.float32, device=device) if logprobs else None
        # Prefix layout only: the bias over each prompt's shared KV [prompts, 1, 1, prompt_len].
        self.prompt_bias = torch.zeros(prompts, 1, 1, prompt_len, dtype=dtype, device=device) if prompts else None
        # Prefix layout of a compacted batch (slots > 0): the shared-prefix attention's query slots, S per
        # prompt (torchkvops.compaction): the row at each slot [prompts * slots], and each row's slot as
        # (prompt, sample) [rows] each.
        self.slot_rows = torch.zeros(prompts * slots, dtype=torch.long, device=device) if slots else None
        self.row_prompt = torch.zeros(rows, dtype=torch.long, device=device) if slots else None
        self.row_sample = torch.zeros(rows, dtype=torch.long, device=device) if slots else None

    @property
    def rows(self) -> int:
        return self.shape[0]

    def tensors(self) -> list[Tensor]:
        return [t for t in vars(self).values() if isinstance(t, Tensor)]


class DecodeStep:
    """One decode step over every row; `bind()` points it at a rollout's state first."""

    def __init__(self, adapter: ModelAdapter, cache: RolloutKVCache, params: SamplingParams, pad_id: int,
                 eos: Tensor | None, min_new_tokens: int = 0, logprobs: bool = False):
        self.adapter, self.cache, self.params, self.pad_id, self.eos = adapter, cache, params, pad_id, eos
        self.logprobs = logprobs  # also record each token's log-probability (DecodeState.logprobs)
        self.min_new_tokens = min_new_tokens if eos is not None else 0
        self.eos_mask: Tensor | None = None  # [vocab] bool, True at the EOS ids (only with min_new_tokens)
        self.state: DecodeState | None = None
        self.kwargs: dict = {}

    def bind(self, state: DecodeState) -> None:
        self.state = state
        # Built once per rollout, not per step: the same tensors every step.
        self.kwargs = self.adapter.forward_kwargs(self.cache, state.bias, state.position_ids, self.cache.write_pos)

    def __call__(self) -> None:
        s, cache = self.state, self.cache
        s.bias.index_fill_(-1, cache.write_pos, 0.0)  # the key written this step becomes visible
        logits = self.adapter.model(input_ids=s.tokens, **self.kwargs).logits[:, -1, :]
        self.draw(logits)
        s.position_ids.add_(1)
        cache.write_pos.add_(1)

    def draw(self, logits: Tensor) -> None:
        """Sample every row's next token from its logits [rows, vocab] (with its log-probability when
        asked) and record it."""
        logits = self.suppress_eos(logits)
        if not self.params.greedy:
            self.watch_nonfinite(logits)
        if self.logprobs:
            self.accept(*sample_with_logprobs(logits, self.params, self.state.keys, self.state.step))
        else:
            self.accept(sample(logits, self.params, self.state.keys, self.state.step))

    def suppress_eos(self, logits: Tensor) -> Tensor:
        """While fewer than min_new_tokens tokens exist, EOS ids cannot be sampled (as HF's
        MinNewTokensLengthLogitsProcessor): their logits are -inf. Without min_new_tokens, no op."""
        if not self.min_new_tokens:
            return logits
        if self.eos_mask is None or self.eos_mask.shape[0] != logits.shape[-1]:
            self.eos_mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            self.eos_mask[self.eos] = True
        return logits.masked_fill(self.eos_mask & (self.state.step < self.min_new_tokens), float("-inf"))

    def watch_nonfinite(self, logits: Tensor) -> None:
        """Record the step at which a live row's logits / temperature first hold a NaN or +inf or are all
        -inf (softmax gives NaN: HF's sampling raises "probability tensor contains either inf, nan or
        element < 0"). One max per row, no host sync: the rollout reads the record at its checks."""
        s = self.state
        top = logits.amax(dim=-1).float() / self.params.temperature  # NaN if any NaN; +inf if any +inf
        bad = ~torch.isfinite(top) & ~s.finished & (s.nonfinite_step < 0)
        s.nonfinite_step.copy_(torch.where(bad, s.step, s.nonfinite_step))

    def accept(self, sampled: Tensor, logprob: Tensor | None = None) -> None:
        """Record sampled tokens [rows] (and their log-probabilities) at index `step`; rows that
        already ended get the pad id (and 0)."""
        s = self.state
        token = sampled if self.eos is None else torch.where(s.finished, self.pad_id, sampled)
        s.responses.index_copy_(1, s.step, token[:, None])
        if logprob is not None:
            s.logprobs.index_copy_(1, s.step, torch.where(s.finished, 0.0, logprob)[:, None])
        if self.eos is not None:
            # A comparison, not torch.isin: isin sorts (and syncs) when there are many EOS ids.
            s.finished.logical_or_((token[:, None] == self.eos).any(dim=1))
        s.tokens.copy_(token[:, None])
        s.step.add_(1)


class DecodeRunner:
    """Runs `DecodeStep`s eagerly, compiled (torch.compile, fullgraph, with the row and key-length dims
    dynamic so that new batch sizes and lengths reuse the graph) and, on CUDA, from captured graphs."""

    def __init__(self, step: DecodeStep, compile: bool, cuda_graphs: bool, device: torch.device):
        self.step = step
        self.fn: Callable[[], None] = torch.compile(step.__call__, fullgraph=True) if compile else step.__call__
        self.compiled = compile
        self.use_graphs = cuda_graphs and device.type == "cuda"
        self.device = device
        self.graphs: OrderedDict[tuple, torch.cuda.CUDAGraph] = OrderedDict()
        self.warmed: set[tuple] = set()
        self.eager_keys: set[tuple] = set()  # shapes whose compile or capture failed: run eagerly
        self._pool = None
        self._stream = None
        self._failed_graphs: list[torch.cuda.CUDAGraph] = []  # see _recover_from_failed_capture
        self.key: tuple | None = None

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
            self.graphs.move_to_end(key)
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
            return self.fn()
        except _RecompileLimitHit as e:
            # Dynamo refuses to compile this shape again (its recompile limit, counted over every
            # rollout compiled in this process): never fail a rollout for it; run it eagerly.
            warnings.warn(f"torchkvops: compiled decode hit torch._dynamo's recompile limit ({e}); this decode "
                          "shape runs eagerly. Raise torch._dynamo.config.recompile_limit to compile it.",
                          RuntimeWarning, stacklevel=3)
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
            self._give_up_graphs(key, f"its CUDA-graph capture failed ({type(error).__name__}: "
                                      f"{' '.join(str(error).split())[:300]})")
            return None
        self.graphs[key] = graph
        while len(self.graphs) > MAX_CUDA_GRAPHS:
            self.graphs.popitem(last=False)
        return graph

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
        warnings.warn(f"torchkvops: decode runs without CUDA graphs for this rollout, because {reason}",
                      RuntimeWarning, stacklevel=4)
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
