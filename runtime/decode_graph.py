"""Decode steps replayed from CUDA graphs: one launch for the dense work instead of hundreds.

Why: at batch 1 a decode step of a 48-layer MoE model is ~1,000 small kernels; launched one by one from
Python that costs ~5-15 µs of host time each, so the step is bound by the host, not by the GPU (docs/hybrid.md
measured ~0.44 ms of fixed cost per MoE layer). A CUDA graph replays the recorded kernels in one call. The same
holds for a step of B sequences decoding together (sub-agents, parallel tool calls): eagerly it costs what a
batch-1 step costs plus per-sequence attention launches; recorded, it costs one replay.

How: a step of B sequences each decoding one token runs over *static* tensors (token ids, positions, per-sequence
key masks) and over each sequence's KV buffers viewed at a fixed length (its bucket: its cache's length rounded
up to `BUCKET` tokens - or to BUCKET times a power of two where the attention reads only up to the query's row,
`bucket_of` - masked beyond its current position). The recorded kernels depend only on addresses and
shapes, so a graph is keyed by B, every sequence's bucket and the addresses of every sequence's KV buffers and
state slot: any caches whose buffers sit at those addresses can replay it, and a new bucket, a grown buffer or
a different set of sequences records a new graph.

Why one graph per exact B rather than B rounded up to 1/2/4/8 with dummy rows: the key names every sequence's
buffers anyway, so a sequence that finishes (or joins) changes the key whatever B is padded to, and a padded
graph would never be reused across batch sizes. Padding would only add work: a dummy row needs a KV buffer and a
state slot of its own (the engine reserves one slot per sequence it may run), and its token is routed to K
experts, which in the hybrid tier are real misses read over PCIe.

Experts that need the host (the hybrid tier reads the router's choice to split hits from misses), or that cannot
take B tokens inside a graph (`graph_tokens`, below: the zero-copy tier covers a few tokens per call), cut the
step into pieces: piece i ends with layer i's router output in static tensors, the experts run eagerly on them
and write a static output, piece i+1 continues from it. Experts whose calls may be recorded (every expert
resident on the GPU, or zero-copy reads for a few tokens) are recorded inside the graph, and the whole step is
one replay.

On a CPU device (tests) or with `capture=False` the same static path runs eagerly, which is how it is tested
against the ordinary forward. Which models: attention without a sliding window or sinks (Qwen3-MoE,
Mixtral without a window) and Gated DeltaNet layers whose states live in a slot pool (Qwen3-Next, Qwen3.5/3.6:
read and written in place in the slots); others (gpt-oss) decode eagerly.
"""
from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from runtime.cuda_capture import CAPTURE_MODE, RECORDING
from runtime.kernels import decode_attention_triton
from runtime.models.base import Batch, CausalLM
from runtime.models.blocks import Attention

log = logging.getLogger(__name__)

BUCKET = 1024          # KV tokens attended per graph: a new graph every BUCKET tokens of a conversation
MAX_GRAPHS = 8         # captured graphs kept (least recently used dropped first)
MAX_BATCH = 8          # sequences a recorded step may hold (the engine passes its own max_batch)


class GraphCaptureError(RuntimeError):
    """Recording a decode step failed (an op that cannot be captured): the caller decodes eagerly from then on."""


@dataclass
class StaticKV:
    """What the static attention path reads for one sequence instead of host integers: the row to write, the
    visible keys. A step of B sequences carries B of them (`Batch.static_kv`), each viewing its own row of the
    step's position buffer."""
    write_at: torch.Tensor             # [1] int64: the new token's row in the KV buffers (= its position)
    key_pos: torch.Tensor              # [bucket] int64: 0..bucket-1
    bucket: int
    mask: torch.Tensor | None = None   # [1, bucket] bool, computed inside the step: key_pos <= write_at


@dataclass
class _Boundary:
    """An eager expert call between two graph pieces, on tensors that live in the graph's memory pool."""
    layer: int
    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    out: torch.Tensor


@dataclass
class _Captured:
    pieces: list                               # CUDAGraph per piece (len(boundaries) + 1)
    boundaries: list[_Boundary]
    logits: torch.Tensor                       # [B, V] written by the last piece
    keep: list = field(default_factory=list)   # tensors the pieces read (kept alive with the graph)


class _CuttingExperts:
    """Stands in for the experts while a step is recorded: ends the current piece at each expert call that cannot
    be recorded (the tier needs the host, or cannot take this many tokens inside a graph), hands back a static
    output (filled at replay time) and starts the next piece."""

    def __init__(self, runner: "DecodeGraphs", inner):
        self.runner, self.inner = runner, inner

    def __call__(self, layer, hidden, topk_ids, topk_weights):
        if graph_takes(self.inner, layer, hidden.shape[0]):
            return self.inner(layer, hidden, topk_ids, topk_weights)
        return self.runner._cut(layer, hidden, topk_ids, topk_weights)


def _layout(cache, bucket: int) -> tuple[int, ...]:
    """Room for `bucket` rows in every KV buffer of a sequence, then where its layer caches live and how they are
    laid out (one pass over the layers: this runs for every sequence at every step, on the host's critical path).
    KV buffers: their addresses and capacity (which sets the strides the recorded kernels use: a finished
    sequence's buffer address may come back for a new one of another size). A state slot: its pool's tensors and
    the slot (the views it hands out are fixed by those; making them would cost a tensor view per layer)."""
    out: list[int] = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is not None:
            if keys.shape[1] < bucket:
                layer.reserve(bucket)                # grows (moves) the buffers: a new key, a new graph
                keys = layer.keys
            out += (keys.data_ptr(), layer.values.data_ptr(), keys.shape[1])
        elif hasattr(layer, "slot"):
            out += (layer.pool.conv.data_ptr(), layer.pool.recurrent.data_ptr(), layer.slot, layer.layer)
        else:
            out += (t.data_ptr() for t in layer.states.values())
    return tuple(out)


def _advance(cache) -> None:
    """One token more in every layer (the static path never touches the host-side offsets itself)."""
    for layer in cache.layers:
        advance = getattr(layer, "advance", None)
        if callable(advance):
            advance(1)                               # a state slot also records it in its pool
        else:
            layer.offset += 1


def _hook(experts, name: str) -> None:
    fn = getattr(experts, name, None)
    if callable(fn):
        fn()


def graph_safe(experts, layer: int) -> bool:
    """Whether an expert tier says a call for `layer` may be recorded inside a CUDA graph (False if it says nothing)."""
    safe = getattr(experts, "graph_safe", None)
    return bool(safe(layer)) if callable(safe) else False


def graph_tokens(experts, layer: int) -> int | None:
    """How many tokens one call for `layer` may carry inside a CUDA graph: None for any number, 0 for none.
    A tier says so with an optional `graph_tokens` (a method of the layer, or a plain attribute); one that only
    says `graph_safe` promises what batch-1 decode needs, a single token (docs/contracts.md)."""
    if not hasattr(experts, "graph_tokens"):
        return 1 if graph_safe(experts, layer) else 0
    tokens = experts.graph_tokens
    return tokens(layer) if callable(tokens) else tokens


def graph_takes(experts, layer: int, tokens: int) -> bool:
    """Whether a call of `tokens` tokens for `layer` may be recorded inside a CUDA graph."""
    limit = graph_tokens(experts, layer)
    return limit is None or tokens <= limit


def supports(model: CausalLM) -> str | None:
    """None when the static decode path covers this model, else why not (for the log)."""
    if any(kind == "linear_attention" for kind in model.layer_kinds) and getattr(model, "state_pool", None) is None:
        return "its linear-attention states have no slot pool (their addresses would move every step)"
    if any(kind not in ("attention", "linear_attention") for kind in model.layer_kinds):
        return "it has layers of a kind the static path does not know"
    if any(model.kv_window(i) is not None for i in range(len(model.layer_kinds))):
        return "it has sliding-window attention"
    for module in model.modules():
        if isinstance(module, Attention) and (module.sinks is not None or module.sliding_window is not None):
            return "its attention has sinks or a window"
    return None


def bucket_of(position: int, bucket: int = BUCKET, *, doubling: bool = False, limit: int | None = None) -> int:
    """KV rows a sequence attends over when its new token sits at `position`: the length rounded up to `bucket`,
    or with `doubling` to `bucket` times a power of two - but not past `limit` (the context) rounded up to
    `bucket`, which would grow the KV buffers past what the memory plan counted.

    Why doubling: each new bucket is a recording on the decode's critical path, and s39a/s39b measured a long answer
    of qwen3.6 (40 layers) stalling 0.50-0.65 s at each 1,024-token crossing (an eager step and the capture, each a
    Python forward of ~0.3 s), against 0.012 s a step. Doubling records log2(context / 1,024) times instead of
    context / 1,024 (6 against 32 for 32K), and the KV buffers' own growth doubles anyway (kv_cache._reserve),
    so it holds no more memory. Only where the attention reads the keys up to the query's row, not the whole
    bucket (decode_attention_triton): SDPA over a doubled bucket would read up to twice the KV at every step."""
    rows = -(-(position + 1) // bucket) * bucket
    if not doubling:
        return rows
    grown = bucket
    while grown < rows:
        grown *= 2
    if limit is not None:
        grown = min(grown, max(rows, -(-limit // bucket) * bucket))
    return grown


def _kv_limit(cache) -> int | None:
    """The context a sequence's KV buffers may grow to (SequenceCache.limit_growth), None when unbounded."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            return getattr(layer, "max_tokens", None)
    return None


class DecodeGraphs:
    """Decode steps of 1..max_batch sequences (one token each) through recorded graphs (CUDA), or the same static
    path run eagerly (`capture=False`)."""

    def __init__(self, model: CausalLM, *, device: torch.device, capture: bool | None = None,
                 bucket: int = BUCKET, max_graphs: int = MAX_GRAPHS, max_batch: int = MAX_BATCH,
                 doubling: bool | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.model, self.device = model, torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.bucket, self.max_graphs, self.max_batch = bucket, max_graphs, max_batch
        # buckets that double (bucket_of): None = wherever the step's attention reads only the keys up to the
        # query's row (the Triton decode attention runs here), asked at each step
        self._doubling = doubling
        # a step of B sequences: token ids in [0:B], positions in [B:2B] (one contiguous upload per step from a
        # page-locked staging copy: no host sync; a graph of B sequences reads the same addresses at every replay)
        self._inputs = torch.zeros(2 * max_batch, dtype=torch.long, device=self.device)           # [2 Bmax]
        pin = self.device.type == "cuda"
        self._staging = torch.zeros(2 * max_batch, dtype=torch.long, pin_memory=pin)              # [2 Bmax]
        self._staged = None                  # event: the last upload has left the staging copy
        self._key_pos: dict[int, torch.Tensor] = {}
        self._slot_index: dict[tuple[int, ...], torch.Tensor] = {}
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        # the expert tier the graphs in _graphs were recorded with, weakly: a strong reference kept a replaced
        # tier's slot pool alive until the next step (run n: 12.7 GiB peak at an 8 GiB budget in a bench row)
        self._recorded_with = lambda: None
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._recording: dict | None = None
        self._stream = None
        # record_seconds: host time of the captures alone (an eager run before one is the step's own work): a new
        # graph key's first step pays it. unwarmed: recordings made without that eager run (_warmed)
        self.counters = dict(steps=0, captures=0, pieces=0, failures=0, record_seconds=0.0, unwarmed=0)
        self.batch_steps: dict[int, int] = {}          # B -> steps of B sequences taken through this runner
        self.disabled: str | None = None
        self.batch_disabled: str | None = None          # why steps of several sequences stopped being recorded

    # --------------------------------------------------------------------------------------- public
    def covers(self, batch_size: int) -> bool:
        return 1 <= batch_size <= self.max_batch

    def stop_batching(self, reason: str) -> None:
        """Steps of several sequences go eagerly from now on (a batched recording failed); batch 1 keeps its
        graphs, and the batched ones are dropped (their memory goes back to the pool)."""
        self.max_batch, self.batch_disabled = 1, reason
        self._drop([key for key in self._graphs if key[0] > 1])

    def _drop(self, keys) -> None:
        """Forget these recordings. When none is left, later ones record into a fresh memory pool: the caching
        allocator retires a graph pool whose last graph is gone, and a capture into it then fails its assertion
        `use_count > 0` (run m, after a tier swap dropped every recording)."""
        for key in list(keys):
            del self._graphs[key]
        if not self._graphs and self.capture:
            self._pool = torch.cuda.graph_pool_handle()

    def decode(self, token: int, cache) -> torch.Tensor:
        """Logits [1, V] fp32 for `token` appended to `cache` (a SequenceCache at offset = its position);
        advances the cache by one token, as the ordinary forward does."""
        return self.decode_batch([token], [cache])

    def decode_batch(self, tokens: list[int], caches: list, *, replay_only: bool = False) -> torch.Tensor | None:
        """Logits [B, V] fp32, row i for `tokens[i]` appended to `caches[i]` (each at its own offset = position);
        advances every cache by one token, as the ordinary forward does. `replay_only`: only where a recording of
        this step exists - else None, nothing run or advanced (a prompt's lone last token: engine.py's
        GRAPH_PROMPT_TAILS)."""
        b = len(caches)
        if not self.covers(b) or len(tokens) != b:
            raise ValueError(f"a recorded decode step takes 1..{self.max_batch} sequences with one token each, "
                             f"got {len(tokens)} tokens for {b} caches")
        if len({id(c) for c in caches}) != b:
            raise ValueError("a sequence's cache appears twice in one decode step")
        positions = [c.offset for c in caches]
        doubling = self.doubling
        buckets = tuple(bucket_of(p, self.bucket, doubling=doubling, limit=_kv_limit(c) if doubling else None)
                        for p, c in zip(positions, caches))
        layouts = tuple(_layout(cache, bucket) for cache, bucket in zip(caches, buckets))   # reserves the buckets
        key = (b, buckets, layouts)
        if self.capture and self._recorded_with() is not self.model.experts:
            # a recording holds the expert tier it was made with (its pool, tables, mailbox): after a swap
            # (a benchmark's next row, a rebuilt tier) replaying it would run the old tier's kernels
            self._drop(self._graphs)
            self._recorded_with = weakref.ref(self.model.experts)
        if replay_only and key not in self._graphs:          # (nothing is ever recorded without capture)
            return None
        self._upload(tokens, positions)
        if self.capture:
            graph = self._graphs.get(key)
            if graph is None:
                warmed = self._warmed(b, doubling)
                if not warmed:
                    # a new shape: this step runs eagerly on the capture stream (its warm-up: cuBLAS and Triton
                    # initialise there, outside any recording), then the step is recorded for the next tokens
                    logits = self._eager_on_capture_stream(caches, buckets)
                t0 = time.perf_counter()
                try:
                    graph = self._graphs[key] = self._record(caches, buckets)
                except Exception as exc:                           # noqa: BLE001  (reported, decode goes on)
                    self.counters["failures"] += 1
                    if warmed:                                     # nothing ran yet: the step's own work
                        logits = self._eager_on_capture_stream(caches, buckets)
                    for cache in caches:
                        _advance(cache)                            # the eager step did run: count its token
                    err = GraphCaptureError(f"recording the decode step of {b} sequence(s) as a CUDA graph "
                                            f"failed: {exc}")
                    err.logits = logits.float()
                    raise err from exc
                finally:
                    self.counters["record_seconds"] += time.perf_counter() - t0
                while len(self._graphs) > self.max_graphs:
                    self._graphs.popitem(last=False)
                if warmed:
                    # recorded without the eager run (a recording does no work): the step is this first replay
                    self.counters["unwarmed"] += 1
                    logits = self._replay_hooked(graph)
            else:
                self._graphs.move_to_end(key)
                logits = self._replay_hooked(graph)
        else:
            logits = self._forward(caches, buckets, self.model.experts)
        for cache in caches:
            _advance(cache)
        self.counters["steps"] += 1
        self.batch_steps[b] = self.batch_steps.get(b, 0) + 1
        return logits.float()

    @property
    def doubling(self) -> bool:
        """Whether buckets double now (not once the Triton attention has failed: SDPA reads the whole bucket)."""
        return decode_attention_triton.runs_on(self.device) if self._doubling is None else self._doubling

    def stats(self) -> dict:
        return {**self.counters, "graphs": len(self._graphs), "bucket": self.bucket, "doubling": self.doubling,
                "buckets_seen": sorted(self._key_pos), "captured": self.capture,
                "max_batch": self.max_batch, "batch_steps": dict(sorted(self.batch_steps.items())),
                "disabled": self.disabled, "batch_disabled": self.batch_disabled}

    # ------------------------------------------------------------------------------------- internals
    def _upload(self, tokens: list[int], positions: list[int]) -> None:
        """Token ids and positions of this step into the static device buffers: one copy, no host sync."""
        b = len(tokens)
        if self._staged is not None:
            self._staged.synchronize()        # the previous upload has read the staging copy (long since, normally)
        self._staging[:2 * b] = torch.tensor(tokens + positions, dtype=torch.long)
        self._inputs[:2 * b].copy_(self._staging[:2 * b], non_blocking=True)
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record(torch.cuda.current_stream(self.device))

    def _slots(self, caches) -> torch.Tensor | None:
        """The sequences' state-slot indices [B] on the device (made once per set of slots, outside any recording:
        a graph reads it at every replay), or None for a model without state slots."""
        if len(caches) == 1:
            return None
        first = next((layer for layer in caches[0].layers if hasattr(layer, "slot")), None)
        if first is None:
            return None
        slots = []
        for cache in caches:
            layer = next(layer for layer in cache.layers if hasattr(layer, "slot"))
            slots.append(layer.slot)
        key = tuple(slots)
        index = self._slot_index.get(key)
        if index is None:
            if len(self._slot_index) >= 4 * self.max_graphs:
                self._slot_index.clear()      # graphs keep the ones they read (_Captured.keep)
            index = self._slot_index[key] = torch.tensor(slots, dtype=torch.long, device=self.device)
        return index

    def _static_batch(self, caches, buckets) -> Batch:
        b = len(caches)
        statics = []
        for i, bucket in enumerate(buckets):
            statics.append(StaticKV(write_at=self._inputs[b + i:b + i + 1], key_pos=self._key_positions(bucket),
                                    bucket=bucket))
        return Batch(self._inputs[:b], self._inputs[b:2 * b], [1] * b, list(caches), static_kv=statics,
                     static_slots=self._slots(caches))

    def _key_positions(self, bucket: int) -> torch.Tensor:
        """0..bucket-1 on the device, made once per bucket (graphs of that bucket read it at every replay)."""
        key_pos = self._key_pos.get(bucket)
        if key_pos is None:
            key_pos = self._key_pos[bucket] = torch.arange(bucket, device=self.device)
        return key_pos

    def _forward(self, caches, buckets, experts) -> torch.Tensor:
        batch = self._static_batch(caches, buckets)
        for static in batch.static_kv:
            static.mask = (static.key_pos <= static.write_at)[None, :]                     # [1, bucket]
        real = self.model.experts
        self.model.set_experts(experts)
        try:
            return self.model(batch, all_logits=True)                # N = B: every row is a last one
        finally:
            self.model.set_experts(real)

    def _warmed(self, b: int, doubling: bool) -> bool:
        """Whether a new bucket's step may be recorded without running it eagerly first: the eager run warms up
        what a recording cannot (cuBLAS workspaces, Triton compiles, first-use buffers), and with doubling
        buckets none of that depends on the bucket once a step of B sequences has been recorded with this tier
        (the Triton attention's split count is fixed from 1,024 rows on; its split length is a run-time value).
        A long answer's crossings at qwen3.6's 40 layers: 0.097 s against 0.50-0.68 with the eager run (s40b,
        s39a/b). SDPA, by contrast, may pick other kernels at another length, so fixed buckets keep the eager run."""
        return doubling and any(key[0] == b for key in self._graphs)

    def _eager_on_capture_stream(self, caches, buckets) -> torch.Tensor:
        stream = self._capture_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            logits = self._forward(caches, buckets, self.model.experts)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return logits

    def _replay_hooked(self, graph: _Captured) -> torch.Tensor:
        """A replay between the expert tier's step hooks: a tier that keeps its books between steps (hybrid
        zero-copy: its calls are inside the graph, so it never sees them) is told before the step is enqueued
        and after."""
        experts = self.model.experts
        _hook(experts, "begin_step")
        logits = self._replay(graph)
        _hook(experts, "end_step")
        return logits

    def _capture_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _record(self, caches, buckets) -> _Captured:
        """Capture one step as graph pieces cut at expert calls that cannot be recorded (nothing runs while
        recording)."""
        slots = self._slots(caches)               # made (if new) before the recording: an upload cannot be recorded
        for bucket in buckets:                    # so are the key positions (a step recorded unwarmed makes none)
            self._key_positions(bucket)
        stream = self._capture_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self._recording = {"pieces": [torch.cuda.CUDAGraph()], "boundaries": []}
        try:
            # no page-locking on another thread meanwhile (cuda_capture.py: the driver refuses it inside a capture)
            with RECORDING, torch.cuda.stream(stream):
                self._recording["pieces"][0].capture_begin(pool=self._pool, capture_error_mode=CAPTURE_MODE)
                try:
                    logits = self._forward(caches, buckets, _CuttingExperts(self, self.model.experts))
                finally:
                    self._recording["pieces"][-1].capture_end()
        finally:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            rec, self._recording = self._recording, None
        self.counters["captures"] += 1
        self.counters["pieces"] += len(rec["pieces"])
        return _Captured(pieces=rec["pieces"], boundaries=rec["boundaries"], logits=logits,
                         keep=[] if slots is None else [slots])

    def _cut(self, layer, hidden, topk_ids, topk_weights) -> torch.Tensor:
        rec = self._recording
        out = torch.empty_like(hidden)        # inside the pool: stable, written at replay by the eager call
        rec["pieces"][-1].capture_end()
        rec["boundaries"].append(_Boundary(layer, hidden, topk_ids, topk_weights, out))
        nxt = torch.cuda.CUDAGraph()
        rec["pieces"].append(nxt)
        nxt.capture_begin(pool=self._pool, capture_error_mode=CAPTURE_MODE)
        return out

    def _replay(self, graph: _Captured) -> torch.Tensor:
        experts = self.model.experts
        graph.pieces[0].replay()
        for b, piece in zip(graph.boundaries, graph.pieces[1:]):
            b.out.copy_(experts(b.layer, b.hidden, b.topk_ids, b.topk_weights))
            piece.replay()
        return graph.logits
