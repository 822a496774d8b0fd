"""Decode steps replayed from CUDA graphs: one launch for the dense work instead of hundreds.

Why: at batch 1 a decode step of a 48-layer MoE model is ~1,000 small kernels; launched one by one from
Python that costs ~5-15 µs of host time each, so the step is bound by the host, not by the GPU (docs/hybrid.md
measured ~0.44 ms of fixed cost per MoE layer). A CUDA graph replays the recorded kernels in one call.

How: a step of one sequence decoding one token runs over *static* tensors (token id, position, a key mask) and
over that sequence's KV buffers viewed at a fixed length (the bucket: the cache's length rounded up to
`BUCKET` tokens, masked beyond the current position). The recorded kernels depend only on addresses and
shapes, so a graph is keyed by the addresses of the sequence's KV buffers and the bucket: any cache whose
buffers sit at those addresses can replay it, and a new bucket or a grown buffer captures a new graph.

Experts that need the host (the hybrid tier reads the router's choice to split hits from misses) cut the
step into pieces: piece i ends with layer i's router output in static tensors, the experts run eagerly on
them and write a static output, piece i+1 continues from it. Experts whose `graph_safe` is true (every expert
resident on the GPU, no host decision) are recorded inside the graph, and the whole step is one replay.

On a CPU device (tests) or with `capture=False` the same static path runs eagerly, which is how it is tested
against the ordinary forward. Which models: attention without a sliding window or sinks (Qwen3-MoE,
Mixtral without a window) and Gated DeltaNet layers whose states live in a slot pool (Qwen3-Next, Qwen3.5/3.6:
read and written in place in the slot); others (gpt-oss) decode eagerly. Batch 1 only (the desktop case); batches of
several sequences decode eagerly.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from runtime.models.base import Batch, CausalLM
from runtime.models.blocks import Attention

log = logging.getLogger(__name__)

BUCKET = 1024          # KV tokens attended per graph: a new graph every BUCKET tokens of a conversation
MAX_GRAPHS = 8         # captured graphs kept (least recently used dropped first)


class GraphCaptureError(RuntimeError):
    """Recording a decode step failed (an op that cannot be captured): the caller decodes eagerly from then on."""


@dataclass
class StaticKV:
    """What the static attention path reads instead of host integers: the row to write, the visible keys."""
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
    logits: torch.Tensor                       # [1, V] written by the last piece
    keep: list = field(default_factory=list)   # tensors the pieces read (kept alive with the graph)


class _CuttingExperts:
    """Stands in for the experts while a step is recorded: ends the current piece at each host-needing
    expert call, hands back a static output (filled at replay time) and starts the next piece."""

    def __init__(self, runner: "DecodeGraphs", inner):
        self.runner, self.inner = runner, inner

    def __call__(self, layer, hidden, topk_ids, topk_weights):
        if graph_safe(self.inner, layer):
            return self.inner(layer, hidden, topk_ids, topk_weights)
        return self.runner._cut(layer, hidden, topk_ids, topk_weights)


def _addresses(layer) -> tuple[int, ...]:
    """Where a layer cache's tensors live: KV buffers, or a state slot's conv and recurrent views."""
    if hasattr(layer, "keys"):
        return layer.keys.data_ptr(), layer.values.data_ptr()
    return tuple(t.data_ptr() for t in layer.states.values())


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


class DecodeGraphs:
    """Batch-1 decode through recorded graphs (CUDA) or the same static path run eagerly (`capture=False`)."""

    def __init__(self, model: CausalLM, *, device: torch.device, capture: bool | None = None,
                 bucket: int = BUCKET, max_graphs: int = MAX_GRAPHS):
        self.model, self.device = model, torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.bucket, self.max_graphs = bucket, max_graphs
        self.input_ids = torch.zeros(1, dtype=torch.long, device=self.device)      # [1]
        self.positions = torch.zeros(1, dtype=torch.long, device=self.device)      # [1]
        self._key_pos: dict[int, torch.Tensor] = {}
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._recording: dict | None = None
        self._stream = None
        self.counters = dict(steps=0, captures=0, pieces=0, failures=0)
        self.disabled: str | None = None

    # --------------------------------------------------------------------------------------- public
    def decode(self, token: int, cache) -> torch.Tensor:
        """Logits [1, V] fp32 for `token` appended to `cache` (a SequenceCache at offset = its position);
        advances the cache by one token, as the ordinary forward does."""
        pos = cache.offset
        bucket = -(-(pos + 1) // self.bucket) * self.bucket
        for layer in cache.layers:
            if hasattr(layer, "reserve"):            # KV buffers; state slots have a fixed size
                layer.reserve(bucket)
        self.input_ids.fill_(int(token))
        self.positions.fill_(pos)
        if self.capture:
            key = (bucket, tuple(p for layer in cache.layers for p in _addresses(layer)))
            graph = self._graphs.get(key)
            if graph is None:
                # a new shape: this step runs eagerly on the capture stream (its warm-up: cuBLAS and Triton
                # initialise there, outside any recording), then the step is recorded for the next tokens
                stream = self._capture_stream()
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    logits = self._forward(cache, bucket, self.model.experts)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                try:
                    self._graphs[key] = self._record(cache, bucket)
                except Exception as exc:                           # noqa: BLE001  (reported, decode goes on)
                    self.counters["failures"] += 1
                    _advance(cache)                                # the eager step did run: count its token
                    err = GraphCaptureError(f"recording the decode step as a CUDA graph failed: {exc}")
                    err.logits = logits.float()
                    raise err from exc
                while len(self._graphs) > self.max_graphs:
                    self._graphs.popitem(last=False)
            else:
                self._graphs.move_to_end(key)
                # an expert tier that keeps its books between steps (hybrid zero-copy: its calls are inside
                # the graph, so it never sees them) gets a hook before the step is enqueued and one after
                experts = self.model.experts
                _hook(experts, "begin_step")
                logits = self._replay(graph)
                _hook(experts, "end_step")
        else:
            logits = self._forward(cache, bucket, self.model.experts)
        _advance(cache)
        self.counters["steps"] += 1
        return logits.float()

    def stats(self) -> dict:
        return {**self.counters, "graphs": len(self._graphs), "bucket": self.bucket, "captured": self.capture,
                "disabled": self.disabled}

    # ------------------------------------------------------------------------------------- internals
    def _static_batch(self, cache, bucket: int) -> Batch:
        key_pos = self._key_pos.get(bucket)
        if key_pos is None:
            key_pos = self._key_pos[bucket] = torch.arange(bucket, device=self.device)
        static = StaticKV(write_at=self.positions, key_pos=key_pos, bucket=bucket)
        return Batch(self.input_ids, self.positions, [1], [cache], static_kv=static)

    def _forward(self, cache, bucket: int, experts) -> torch.Tensor:
        batch = self._static_batch(cache, bucket)
        batch.static_kv.mask = (batch.static_kv.key_pos <= batch.static_kv.write_at)[None, :]   # [1, bucket]
        real = self.model.experts
        self.model.set_experts(experts)
        try:
            return self.model(batch, all_logits=True)                # N = 1: every row is the last
        finally:
            self.model.set_experts(real)

    def _capture_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _record(self, cache, bucket: int) -> _Captured:
        """Capture one step as graph pieces cut at host-needing expert calls (nothing runs while recording)."""
        stream = self._capture_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self._recording = {"pieces": [torch.cuda.CUDAGraph()], "boundaries": []}
        try:
            with torch.cuda.stream(stream):
                self._recording["pieces"][0].capture_begin(pool=self._pool)
                try:
                    logits = self._forward(cache, bucket, _CuttingExperts(self, self.model.experts))
                finally:
                    self._recording["pieces"][-1].capture_end()
        finally:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            rec, self._recording = self._recording, None
        self.counters["captures"] += 1
        self.counters["pieces"] += len(rec["pieces"])
        return _Captured(pieces=rec["pieces"], boundaries=rec["boundaries"], logits=logits)

    def _cut(self, layer, hidden, topk_ids, topk_weights) -> torch.Tensor:
        rec = self._recording
        out = torch.empty_like(hidden)        # inside the pool: stable, written at replay by the eager call
        rec["pieces"][-1].capture_end()
        rec["boundaries"].append(_Boundary(layer, hidden, topk_ids, topk_weights, out))
        nxt = torch.cuda.CUDAGraph()
        rec["pieces"].append(nxt)
        nxt.capture_begin(pool=self._pool)
        return out

    def _replay(self, graph: _Captured) -> torch.Tensor:
        experts = self.model.experts
        graph.pieces[0].replay()
        for b, piece in zip(graph.boundaries, graph.pieces[1:]):
            b.out.copy_(experts(b.layer, b.hidden, b.topk_ids, b.topk_weights))
            piece.replay()
        return graph.logits
