"""The decode loop: one statically shaped step, run eagerly, compiled, or replayed from a CUDA graph, and
the `Decoder` that owns a rollout's decode.

`Decoder` holds everything decode keeps: the decode states (one per `DecodeShape`, kept across calls so
that a shape that comes back finds the addresses its graph was captured on), the step, the runner and
the attention context, which it builds from the state it decodes (`DecodeAttention.load`). `start()`
resets a state and samples every row's first token; `run()` is the loop: steps, the all-ended check
every FINISHED_CHECK_INTERVAL steps, compaction (`torchkvops.compaction` plans it; the decoder applies
it: state, KV cache, attention context, write-back of the rows left behind).

Per-row state is declared once (`DecodeState.FIELDS`): what each tensor holds, its shape, and how it
moves when the batch is compacted, so that a new field cannot be forgotten by the code that moves rows.

A step feeds every row's last token, writes its K/V at `write_pos`, samples the next token with the
`sample_tokens` operator (`sample_tokens_with_logprobs` when log-probabilities are asked for) and
records it; it reads and updates only tensors that keep their addresses
for the whole rollout (`DecodeState`, the KV buffers, the model's parameters) and never syncs with the
host, so on CUDA it is captured once per decode shape and replayed (`DecodeRunner`).

Graph keys. A captured graph replays kernels on fixed addresses: it is keyed by the decode shape and
by the address of every tensor it reads that may be made anew while the graph is kept (the state, the
KV views, the cache's position tensors, the model's parameters and buffers), so that a tensor replaced
by a new one (the KV buffers grown by a larger call or an extend, FSDP/ZeRO-3 gathering weights into
new storage, `load_state_dict(assign=True)`, `model.to(...)`) re-captures instead of replaying on freed
memory; what the key leaves out lives as long as the rollout (the EOS ids, the sampling constants).
Python values the step bakes into a graph are keyed too (the adapters' state and scales).
tests/test_graph_keys.py records every address a step reads and checks this.
Parameters updated in place (an optimizer step) keep their addresses, and the graph reads the new
values.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict  # (the bounded record of graph keys)
from collections.abc import Callable

import torch
from torch import Tensor

from ..hf.adapter import ModelAdapter
from ..hf.integration import LRU
from . import attention, compaction
from .kv_cache import RolloutKVCache
from .sampling import SamplingParams, row_keys, sample, sample_with_logprobs

__all__ = [
    "DecodeShape",
    "DecodeState",
    "DecodeStep",
    "DecodeRunner",
    "Decoder",
    "DecodeCounters",
    "NonFiniteLogitsError",
    "FINISHED_CHECK_INTERVAL",
    "MAX_DECODE_STATES",
]

# The all-rows-ended check syncs with the host, so decode makes it only every this many steps.
FINISHED_CHECK_INTERVAL = 8
# Decode states (and so decode graphs) kept for this many distinct decode shapes: with compaction, a
# rollout configuration of R rows has up to 8 + 4 log2(R / 8) of them (torchkvops.compaction).
MAX_DECODE_STATES = 48

# How many captured graphs a rollout keeps (least recently used dropped first); they share one memory
# pool, in which a step's temporaries (all freed by the step's end) reuse the same blocks. Compaction
# (torchkvops.compaction) adds the shapes of the compacted batches: a few per rollout configuration.
MAX_CUDA_GRAPHS = 48
_RecompileLimitHit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", RuntimeError)


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """What fixes a decode step's tensors (and so its graph): rows, the decode buffer's key length, the
    response length, the model's dtype; in the prefix layout the prompts and their key length, and for a
    compacted prefix-layout batch its query slots per prompt (torchkvops.compaction); whether
    log-probabilities are recorded."""

    rows: int
    mask_len: int
    max_new_tokens: int
    dtype: torch.dtype
    prompts: int = 0
    prompt_len: int = 0
    logprobs: bool = False
    slots: int = 0


@dataclasses.dataclass(frozen=True)
class _Field:
    """One tensor of a DecodeState. `per`: what its first dim indexes, and so how compaction moves it:
    "row" (gathered with its row), "prompt" (gathered with its prompt group), "slot" (set from the
    compaction's plan)."""

    name: str
    per: str
    dims: Callable[[DecodeShape], tuple[int, ...] | None]  # its shape, or None when the shape has none
    dtype: torch.dtype | None = torch.long  # None: the model's dtype
    doc: str = ""


def _if(condition: bool, dims: tuple[int, ...]) -> tuple[int, ...] | None:
    return dims if condition else None


class DecodeState:
    """Statically shaped tensors that the decode step reads and updates in place, one set per DecodeShape."""

    FIELDS = (
        _Field("tokens", "row", lambda s: (s.rows, 1), doc="the token fed next"),
        _Field("position_ids", "row", lambda s: (s.rows, 1)),
        _Field(
            "bias",
            "row",
            lambda s: (s.rows, 1, 1, s.mask_len),
            None,
            "additive bias over the decode buffer's keys: 0 where a row may attend, -inf elsewhere",
        ),
        _Field("finished", "row", lambda s: (s.rows,), torch.bool),
        _Field("keys", "row", lambda s: (s.rows,), doc="per-row sampling keys"),
        _Field(
            "nonfinite_step",
            "row",
            lambda s: (s.rows,),
            doc="the first step at which a live row's logits could not be sampled from (NaN, +inf, or all "
            "-inf: HF's sampling raises there); -1 while none",
        ),
        # One spare column: where a row that has its max_new_tokens tokens writes (the pad id) while others
        # go on (rows that joined a streaming batch later, torchkvops.rollout.streaming).
        _Field("responses", "row", lambda s: (s.rows, s.max_new_tokens + 1)),
        _Field(
            "logprobs",
            "row",
            lambda s: _if(s.logprobs, (s.rows, s.max_new_tokens + 1)),
            torch.float32,
            "each sampled token's log-probability (0 once the row has ended), as responses",
        ),
        _Field(
            "prompt_bias",
            "prompt",
            lambda s: _if(s.prompts > 0, (s.prompts, 1, 1, s.prompt_len)),
            None,
            "prefix layout: the bias over each prompt's shared KV",
        ),
        # A compacted prefix-layout batch (slots > 0): the shared-prefix attention's query slots, S per
        # prompt: the row at each slot, and each row's slot as (prompt, sample).
        _Field("slot_rows", "slot", lambda s: _if(s.slots > 0, (s.prompts * s.slots,))),
        _Field("row_prompt", "slot", lambda s: _if(s.slots > 0, (s.rows,))),
        _Field("row_sample", "slot", lambda s: _if(s.slots > 0, (s.rows,))),
        _Field(
            "step",
            "row",
            lambda s: (s.rows,),
            doc="each row's index of the token it samples next: its own step, which keys its sampling noise",
        ),
    )

    def __init__(self, shape: DecodeShape, device: torch.device):
        self.shape = shape
        for f in self.FIELDS:
            dims = f.dims(shape)
            value = None if dims is None else torch.zeros(dims, dtype=f.dtype or shape.dtype, device=device)
            setattr(self, f.name, value)

    @property
    def rows(self) -> int:
        return self.shape.rows

    def scatter_rows_from(self, sub: DecodeState, rows: Tensor) -> None:
        """The "row" fields of `sub` (a state of len(rows) rows) into rows `rows` of this one."""
        for f in self.FIELDS:
            if f.per == "row" and getattr(self, f.name) is not None:
                getattr(self, f.name).index_copy_(0, rows, getattr(sub, f.name))

    def tensors(self) -> list[Tensor]:
        return [t for t in (getattr(self, f.name) for f in self.FIELDS) if t is not None]

    def gather_into(self, new: DecodeState, rows: Tensor, groups: Tensor | None) -> None:
        """Move the rows `rows` (device int64) into `new`, and (prefix layout) the prompt groups `groups`:
        every field as its declaration says; "slot" fields are the caller's (they come from a plan)."""
        for f in self.FIELDS:
            src = getattr(self, f.name)
            if src is None or f.per == "slot":
                continue
            if f.per == "row" or groups is not None:
                torch.index_select(src, 0, rows if f.per == "row" else groups, out=getattr(new, f.name))


class DecodeStep:
    """One decode step over every row; `bind()` points it at a rollout's state first."""

    def __init__(
        self,
        adapter: ModelAdapter,
        cache: RolloutKVCache,
        params: SamplingParams,
        pad_id: int,
        eos: Tensor | None,
        min_new_tokens: int = 0,
        logprobs: bool = False,
    ):
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
        # The decode buffer is a ring: a streaming batch's rows start at other columns (each row spans at
        # most its length, so it never meets its own keys); a call that starts every row at once never wraps.
        cache.write_pos.add_(1).remainder_(cache.decode_kv.shape[4])

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
        early = (self.state.step < self.min_new_tokens)[:, None]
        return logits.masked_fill(self.eos_mask & early, float("-inf"))

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
        last = s.shape.max_new_tokens - 1  # a row's last token
        column = s.step.clamp(max=last + 1)[:, None]  # past its last: the spare column
        s.responses.scatter_(1, column, token[:, None])
        if logprob is not None:
            s.logprobs.scatter_(1, column, torch.where(s.finished, 0.0, logprob)[:, None])
        if self.eos is not None:
            # A comparison, not torch.isin: isin sorts (and syncs) when there are many EOS ids.
            s.finished.logical_or_((token[:, None] == self.eos).any(dim=1))
        s.finished.logical_or_(s.step >= last)  # a row with max_new_tokens tokens has ended
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
        self.graphs: LRU[tuple, torch.cuda.CUDAGraph] = LRU(MAX_CUDA_GRAPHS)
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


class NonFiniteLogitsError(RuntimeError):
    """Sampling met logits holding NaN or +inf (or only -inf) on a live row, where Hugging Face's sampling
    raises "probability tensor contains either inf, nan or element < 0". Greedy decoding takes the
    argmax as HF does and never raises this."""


@dataclasses.dataclass(frozen=True)
class DecodeCounters:
    """What a rollout's decode has built and done so far (for tests and benchmarks, instead of reading
    private attributes): decode states kept (one per decode shape), distinct graph keys met (a shape and
    the addresses its step reads), CUDA graphs captured and kept, compactions applied, and the key of
    the last decode."""

    decode_shapes: int
    graph_keys: int
    captured_graphs: int
    compactions: int
    graph_key: tuple | None


_KEYS_KEPT = 4096  # DecodeCounters.graph_keys counts among the last this many keys (a bounded record)


class Decoder:
    """A rollout's decode: its states, step, runner and attention context, and the loop (module docstring).

    `layout`: the KV layout ("copy" or "prefix"); `samples`: rows per prompt; `compacts`: compact the
    batch as rows end (needs EOS ids); `graph_extra`: more addresses a step reads (a float32 LM head's)."""

    def __init__(
        self,
        adapter: ModelAdapter,
        cache: RolloutKVCache,
        params: SamplingParams,
        pad_id: int,
        eos: Tensor | None,
        *,
        min_new_tokens: int,
        logprobs: bool,
        layout: str,
        samples: int,
        compile: bool,
        cuda_graphs: bool,
        compacts: bool,
        graph_extra: Callable[[], tuple] = tuple,
    ):
        self.adapter, self.cache, self.params, self.pad_id, self.eos = adapter, cache, params, pad_id, eos
        self.logprobs, self.layout, self.samples = logprobs, layout, samples
        self.compacts = compacts and eos is not None  # compaction happens at the all-ended check
        self.leaves_out_ended = compacts  # initial_plan needs no EOS ids: the caller knows which rows ended
        self.graph_extra = graph_extra
        self.step = DecodeStep(adapter, cache, params, pad_id, eos, min_new_tokens, logprobs=logprobs)
        self.runner = DecodeRunner(self.step, compile, cuda_graphs, adapter.device)
        self.context = attention.DecodeAttention(layout)
        self.states: LRU[DecodeShape, DecodeState] = LRU(MAX_DECODE_STATES)
        self._graph_keys: OrderedDict[int, None] = OrderedDict()  # hashes of the last _KEYS_KEPT keys met
        self._compactions = 0

    @property
    def counters(self) -> DecodeCounters:
        return DecodeCounters(
            len(self.states), len(self._graph_keys), len(self.runner.graphs), self._compactions, self.runner.key
        )

    def release(self) -> None:
        """Forget every state and graph, and the last call's views of the KV cache."""
        self.states.clear()
        self.runner.reset()
        self.step.state, self.step.kwargs = None, {}
        self.context = attention.DecodeAttention(self.layout)

    # --- a call ----------------------------------------------------------------------------------
    def start(
        self,
        first_logits: Tensor,
        seed: int,
        row_ids: Tensor,
        live: Tensor | None,
        *,
        visible: Tensor,
        positions: Tensor,
        write_start: int,
        max_new_tokens: int,
        prompt_visible: Tensor | None = None,
    ) -> DecodeState:
        """Reset the decode state for a call and sample every row's first token from `first_logits`
        [rows, vocab]. What each row sees: `visible` [rows, C] (bool) over the decode buffer's first C
        columns, and in the prefix layout `prompt_visible` [prompts, P'] over its prompt's KV; `positions`
        [rows]: the position of the token each row feeds first; decode writes from column `write_start`
        on. `live` [rows] (bool, optional): False for rows that have ended before they start (filler
        rows, rows an extend leaves alone), which only ever hold the pad id."""
        cache = self.cache
        prefix = self.layout == "prefix"
        rows = first_logits.shape[0]
        s = self._state(
            DecodeShape(
                rows,
                cache.decode_kv.shape[4],
                max_new_tokens,
                self.adapter.dtype,
                prompt_visible.shape[0] if prefix else 0,
                cache.prompt_kv.shape[4] if prefix else 0,
                self.logprobs,
            )
        )
        s.bias.fill_(float("-inf"))
        s.bias[:, 0, 0, : visible.shape[1]].masked_fill_(visible, 0.0)
        if prefix:  # the prompts are seen through the prefix part
            s.prompt_bias.fill_(float("-inf"))
            s.prompt_bias[:, 0, 0, : prompt_visible.shape[1]].masked_fill_(prompt_visible, 0.0)
        s.position_ids.copy_(positions[:, None])
        s.finished.zero_()
        if live is not None:
            s.finished.copy_(~live.to(s.finished.device, torch.bool))
        s.step.zero_()
        s.nonfinite_step.fill_(-1)
        s.keys.copy_(row_keys(seed, row_ids.to(s.keys.device, torch.long)))
        self.step.bind(s)
        self.step.draw(first_logits)
        cache.start_decode(write_start)
        return s

    def initial_plan(self, ended: Tensor) -> compaction.Plan | None:
        """The compaction that leaves out the rows that have ended before a call's decode starts (host
        bool [rows]; Rollout.extend's rows that generate nothing), or None when it would not save enough
        or the decoder does not compact. The caller gathers the KV cache (and computes only those rows'
        first logits); `run(..., initial_plan=)` gathers the state."""
        if not self.leaves_out_ended or not bool(ended.any()) or bool(ended.all()):
            return None
        return compaction.plan(
            ended, compaction.BatchMap(ended.numel(), self.samples if self.layout == "prefix" else None)
        )

    def run(
        self,
        first: DecodeState,
        ended_everywhere: Callable[[bool], bool] | None = None,
        initial_plan: compaction.Plan | None = None,
    ) -> tuple[int, int]:
        """Decode steps until every row has max_new_tokens tokens or has ended (on every process, with
        `ended_everywhere`: a collective), compacting the batch as rows end; `first`'s responses (and
        logprobs) then hold every row's tokens. Returns the step count and the row-steps computed (rows
        sampled, summed over the tokens). Raises NonFiniteLogitsError at the first check after a live
        row's logits could not be sampled from. `initial_plan` (see `initial_plan()`): decode starts with
        the batch it keeps, the KV cache already gathered."""
        new_tokens = first.shape.max_new_tokens
        state, steps, row_steps = first, 0, first.rows
        batch = (
            compaction.BatchMap(first.rows, self.samples if self.layout == "prefix" else None)
            if self.compacts or initial_plan is not None
            else None
        )
        if initial_plan is not None:  # the KV cache is gathered already (initial_plan)
            state = self._compact(first, state, batch, initial_plan, 1, cache_gathered=True)
            row_steps = initial_plan.size  # the rows whose first token was computed
        self._bind(state)
        with attention.decode_attention(self.adapter.model, self.context):
            while steps + 1 < new_tokens:
                self.runner()
                steps += 1
                row_steps += state.rows
                if self.eos is None or steps % FINISHED_CHECK_INTERVAL:
                    continue
                # Host sync: reads `finished` (and the non-finite record) every few steps to stop early and
                # to compact; not made without EOS ids. Compaction (planned on the host from these flags)
                # adds no other sync.
                flags = torch.stack([state.finished.long(), state.nonfinite_step]).cpu()
                finished = flags[0].bool()
                _raise_on_nonfinite(flags[1])
                ended = bool(finished.all())
                if ended_everywhere is not None:
                    ended = ended_everywhere(ended)
                if ended:
                    break
                if batch is not None and new_tokens - 1 - steps >= FINISHED_CHECK_INTERVAL:
                    plan = compaction.plan(finished, batch)
                    if plan is not None:
                        state = self._compact(first, state, batch, plan, steps + 1)
                        self._bind(state)
        if state is not first:
            self._write_back(first, state, batch, steps + 1)
        self.cache.finish_decode(None if batch is None else batch.original.to(first.tokens.device))
        return steps, row_steps

    def check_nonfinite(self, state: DecodeState) -> None:
        """After `run`, in sampling: raise NonFiniteLogitsError if any live row met logits it could not
        sample from since the last check. Host sync: one read, once per call."""
        if not self.params.greedy:
            _raise_on_nonfinite(state.nonfinite_step.cpu())

    # --- a streaming batch (torchkvops.rollout.streaming) ------------------------------------------
    def state_for(self, shape: DecodeShape) -> DecodeState:
        """The decode state of this shape (kept across calls, as every decode shape's)."""
        return self._state(shape)

    def bind(self, state: DecodeState) -> None:
        """Decode `state` from now on (see `_bind`)."""
        self._bind(state)

    def decoding(self):
        """The context in which the model's attention is the decode attention (`run` enters it itself)."""
        return attention.decode_attention(self.adapter.model, self.context)

    def draw_rows(self, rows: Tensor, logits: Tensor) -> None:
        """Sample the first token of the bound state's rows `rows` (device int64) from `logits`
        [len(rows), vocab], leaving the other rows as they are: rows that join a running batch."""
        state = self.step.state
        sub = DecodeState(dataclasses.replace(state.shape, rows=rows.numel(), prompts=0, slots=0), state.tokens.device)
        state.gather_into(sub, rows, None)
        self.step.state = sub
        try:
            self.step.draw(logits)
        finally:
            self.step.state = state
        state.scatter_rows_from(sub, rows)

    # --- states, compaction, binding ---------------------------------------------------------------
    def _state(self, shape: DecodeShape) -> DecodeState:
        """The decode state of this shape, kept (least recently used dropped past MAX_DECODE_STATES)."""
        return self.states.put(shape, self.states.get(shape) or DecodeState(shape, self.adapter.device))

    def _compact(
        self,
        first: DecodeState,
        state: DecodeState,
        batch: compaction.BatchMap,
        plan: compaction.Plan,
        tokens: int,
        cache_gathered: bool = False,
    ) -> DecodeState:
        """Go on with the rows of `plan` (torchkvops.compaction) after `tokens` tokens: a state of the
        compacted shape holds them, the KV cache keeps theirs, `first` keeps the others'."""
        device = state.tokens.device
        rows = plan.rows.to(device)
        groups = None if plan.groups is None else plan.groups.to(device)
        new = self._state(dataclasses.replace(state.shape, rows=plan.size, prompts=plan.prompts, slots=plan.slots))
        state.gather_into(new, rows, groups)
        if plan.slot_rows is not None:
            new.slot_rows.copy_(plan.slot_rows)
            new.row_prompt.copy_(plan.row_slot // plan.slots)
            new.row_sample.copy_(plan.row_slot % plan.slots)
        if not cache_gathered:
            self.cache.compact(rows, groups, batch.original.to(device))
        if state is not first:
            self._write_back(first, state, batch, tokens)
        # Rows that end here hold the pad id (and log-probability 0) from now on, as in a full batch; the
        # others are written back again later.
        first.responses[:, tokens:].fill_(self.pad_id)
        if first.logprobs is not None:
            first.logprobs[:, tokens:].zero_()
        batch.apply(plan)
        self._compactions += 1
        return new

    def _write_back(self, first: DecodeState, state: DecodeState, batch: compaction.BatchMap, tokens: int) -> None:
        """The first `tokens` tokens (and logprobs) of the compacted batch's rows, into their original rows."""
        original = batch.original.to(first.responses.device)
        first.responses[:, :tokens].index_copy_(0, original, state.responses[:, :tokens])
        if first.logprobs is not None:
            first.logprobs[:, :tokens].index_copy_(0, original, state.logprobs[:, :tokens])

    def _bind(self, state: DecodeState) -> None:
        """Point the step, the attention context and the runner's graph key at `state` and the KV cache's
        current views."""
        self.step.bind(state)
        cache = self.cache
        self.context.load(state, cache.prompt_kv if self.layout == "prefix" else None)
        dynamic = [(t, (0,)) for t in state.tensors()] + [(state.bias, (0, 3)), (cache.decode_kv, (2, 4))]
        if self.layout == "prefix":
            dynamic += [(cache.prompt_kv, (2, 4)), (state.prompt_bias, (0, 3))]
        # Once per tensor, with every dim it was listed with (rows, and for some the key length).
        merged: dict[int, tuple[Tensor, set[int]]] = {}
        for t, dims in dynamic:
            merged.setdefault(id(t), (t, set()))[1].update(dims)
        dynamic = [(t, tuple(sorted(dims))) for t, dims in merged.values()]
        addresses = tuple(t.data_ptr() for t, _ in dynamic) + cache.position_addresses()
        key = (
            state.shape,
            self.layout,
            addresses,
            self.adapter.weight_addresses() + self.graph_extra(),
            self.adapter.adapter_state(),
        )
        self._graph_keys[hash(key)] = None
        self._graph_keys.move_to_end(hash(key))
        while len(self._graph_keys) > _KEYS_KEPT:
            self._graph_keys.popitem(last=False)
        self.runner.start(dynamic, graph_key=key)


def _raise_on_nonfinite(nonfinite_step: Tensor) -> None:
    """nonfinite_step (host [rows]): DecodeState's record."""
    bad = nonfinite_step[nonfinite_step >= 0]
    if bad.numel():
        raise NonFiniteLogitsError(
            f"torchkvops: the logits of {bad.numel()} row(s) hold NaN or inf at new token {int(bad.min())} (counting "
            "from 0), so there is no distribution to sample from; Hugging Face's generate raises here too "
            '("probability tensor contains either inf, nan or element < 0"). Check the model\'s weights and inputs '
            "(a half-precision overflow?)"
        )
