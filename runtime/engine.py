"""The engine: load an FTW package, take requests, and step them all forward together.

    eng = Engine.load(path, device="auto")
    rid = eng.add_request(prompt_ids, SamplingParams(temperature=0), on_prefill=callback(done, total))
    while eng.has_work():
        for event in eng.step(): ...          # TokenEvent per sampled token (and per finished request)
    eng.generate(prompt_ids, sampling) -> GenerationResult

A step reads like a sentence: admit waiting requests (restoring what the prefix cache holds for
them), schedule (every decoding sequence plus prefill chunks within a token budget), run the model
once over that ragged batch, then sample, detokenize, check stops and emit events. Finished
sequences leave and their caches go to the prefix cache. Only one thread may call an Engine.

Shapes: B sequences in a step, N tokens in a step, V vocabulary.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from runtime.experts.interface import Experts, ExpertSpec
from runtime.host_arena import HostArena, plain_slab, registered_slab
from runtime.kv_buffers import KVBufferPool
from runtime.kv_cache import SequenceCache
from runtime.loading import build_empty_model, load_dense_weights
from runtime.models.base import Batch, CausalLM, UnsupportedModelError
from runtime.prefix_cache import PrefixCache
from runtime.sampling import RequestSampler, SamplingParams, StopMatcher, sample_batch
from runtime.scheduler import Scheduler, SchedulerConfig, Sequence

__all__ = ["Engine", "EngineError", "SamplingParams", "TokenEvent", "GenerationResult"]

log = logging.getLogger(__name__)

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30        # prefix cache on the compute device (CPU engines)
HOST_PREFIX_CACHE_BYTES = 4 << 30           # prefix cache of a GPU engine, kept in host RAM (when no planner
                                            # sized it: the planner gives it what RAM the plan leaves, up to this)
CPU_PREFILL_CHUNK = 512        # prompt tokens per step on a CPU device (GPU: the planner's chunk)
ROUTING_STATS_FILE = "routing.json"     # in a load's state_dir: the expert tier's routing statistics
MAX_KEPT_RESULTS = 1024          # finished requests whose GenerationResult waits for result()
LOCK_AHEAD_TOKENS = 512         # a request's answer counted when locking its store's host memory ahead
# A prompt's last token, when it goes alone (a linear-attention model's snapshot is taken one token before the end, or
# a chunk boundary), replays a decode graph only where its step's recording exists - a new conversation in the last
# one's KV buffers and state slot (runtime/kv_buffers.py) has the same graph key - and else runs eagerly: recording
# there would sit inside the time to first token, and the first decode step records the same key anyway, after the
# first token is out. (qwen3.6's 40 layers: the eager tail 0.115 s, s37b; replayed 0.017, s40b.) True: every
# tail through the graphs, recording where needed (before session 33; benchmarks' --graph-prompt-tails).
GRAPH_PROMPT_TAILS = False

ProgressFn = Callable[[int, int, str], None]      # (done, total, stage)
PrefillFn = Callable[[int, int], None]            # (done, total) prompt tokens
# experts_factory(package, spec, *, device, dtype, vram_budget, cpu_experts_per_layer, progress,
#                 stage_progress, context_length, max_sequences, dense_bytes_on_device) -> Experts
# (progress: the "experts" stage's (done, total); stage_progress(name): another stage's, for steps of its own)
ExpertsFactory = Callable[..., Experts]


class EngineError(ValueError):
    """A request or model the engine cannot serve; the message says why in a user's words."""


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int | None          # None on an event that only reports an end (cancelled, max_tokens=0)
    text: str                     # the text this token completes ("" while a character or stop is pending)
    finished: bool = False
    finish_reason: str | None = None   # "stop" | "length" | "cancelled" | "error" (the model raised)
    stop_sequence: str | None = None   # the stop string that ended the request, when one did


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0        # prompt tokens the prefix cache supplied
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    ttft: float = 0.0             # seconds from add_request to the first token
    error: str | None = None      # why the request failed (finish_reason "error")

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens_per_s

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens_per_s


@dataclass
class _Request:
    """The engine's state for one request (the scheduler's Sequence carries it as payload)."""
    params: SamplingParams
    sampler: RequestSampler
    stop_ids: frozenset[int]
    matcher: StopMatcher
    decoder: Any                              # StreamDecoder
    on_prefill: PrefillFn | None
    cache: SequenceCache | None = None
    cached_tokens: int = 0
    text: list[str] = field(default_factory=list)
    t_added: float = 0.0
    t_prefill_start: float | None = None
    t_first: float | None = None
    t_end: float | None = None
    finish_reason: str | None = None
    error: str | None = None


def _wants_int8_dense(dev: torch.device, package, dense_bytes: int, vram_budget: int | None) -> bool:
    """The default of `dense_int8` on a GPU: a package whose experts are quantized (int4, fp4: the user chose a
    quantized model, and int8 dense weights are far finer than its experts; a decode step reads ~40 % fewer
    bytes), or a budget that can not hold every expert beside the bf16 dense weights (the hybrid tier, where each
    byte the dense weights give back is an expert slot). A package of bf16/f32 experts that fits keeps the
    checkpoint's precision; a CPU always does (there the int8 path dequantizes per call: slower, not faster)."""
    if dev.type != "cuda":
        return False
    experts = getattr(package, "experts", None)
    if experts is None or not getattr(experts, "layers", None):
        return False
    from runtime.experts.planner import DENSE_INT8_CODECS

    if str(getattr(experts, "codec", "bf16")) in DENSE_INT8_CODECS:
        return True
    expert_bytes = len(experts.layers) * int(experts.num_experts) * int(experts.block_nbytes)
    free, _total = torch.cuda.mem_get_info(dev)
    room = free + dense_bytes                     # the dense weights are on the device already
    if vram_budget is not None:
        room = min(room, vram_budget)
    return dense_bytes + expert_bytes > 0.9 * room


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("device 'cuda' was asked for but this machine has no usable CUDA GPU "
                          "(or torch was installed without CUDA)")
    return dev


def _use_expandable_segments() -> None:
    """Let torch's CUDA allocator grow segments in place instead of keeping blocks of many sizes: long prompts'
    transients of changing size left 0.6-1.3 GiB reserved beyond what was allocated, which on a real 8 GB card is
    VRAM the plan counted on (s32e -> s33a: a 30K prompt at 8 GiB reserved 9.32 -> 8.59 GiB; decode graphs
    unchanged). A user's own PYTORCH_CUDA_ALLOC_CONF wins."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return
    # torch names the setter per accelerator now (the CUDA one warns at every load that it is deprecated)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    try:
        setter("expandable_segments:True")
    except (AttributeError, RuntimeError) as exc:       # an older or newer torch without it: only fragmentation
        log.info("could not turn on expandable CUDA segments: %s", exc)


def _eos_ids(package) -> tuple[int, ...]:
    """EOS ids from generation_config, falling back to config.json."""
    for source in (package.generation_config or {}, package.config):
        value = source.get("eos_token_id")
        if value is None:
            continue
        return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return ()


def kv_bytes_per_sequence(model: CausalLM, tokens: int, dtype: torch.dtype) -> int:
    """KV bytes of one sequence of `tokens` tokens (a sliding-window layer holds at most ~2 windows)."""
    c = model.config
    per_token = 2 * c.num_key_value_heads * c.head_dim * torch.empty((), dtype=dtype).element_size()
    total = 0
    for layer, kind in enumerate(model.layer_kinds):
        if kind == "attention":
            window = model.kv_window(layer)
            total += per_token * (tokens if window is None else min(tokens, 2 * window))
    return total


def _decode_graphs(model: CausalLM, device: torch.device, wanted: bool | None, max_batch: int):
    """The decode-graph runner (steps of 1..max_batch decoding sequences) when asked for (or by default on CUDA)
    and the model is covered."""
    from runtime.decode_graph import DecodeGraphs, supports

    if wanted is False or (wanted is None and device.type != "cuda"):
        return None
    why_not = supports(model)
    if why_not is not None:
        log.info("decode steps run without CUDA graphs: %s", why_not)
        return None
    return DecodeGraphs(model, device=device, max_batch=max_batch)


# the load-progress stage of a GPU's prefill kernels (compiled at a machine's first load of such a model: seconds)
GPU_KERNELS_STAGE = "GPU kernels (compiled on a machine's first load)"


def _warm_up_gpu_kernels(model, progress=None) -> None:
    """Compile the prefill kernels a model's first prompt would otherwise wait for (fla-core's linear attention:
    ~30 s on a fresh machine, ~4 s on later loads, s29d), as a stage of the load. A failure here is logged, not
    raised: the first prompt then meets it and reports it as a request's error."""
    from runtime.models.gated_deltanet import GatedDeltaNet, warm_up_prefill_kernels

    if not any(isinstance(m, GatedDeltaNet) for m in model.modules()):
        return
    if progress:
        progress(0, 1)
    t0 = time.perf_counter()
    try:
        warmed = warm_up_prefill_kernels(model)
        if torch.cuda.is_available():
            torch.cuda.synchronize()         # (its compiles are host work; the launches' errors show here)
    except Exception as exc:  # noqa: BLE001  (a warm-up; the real call raises where the user sees it)
        log.warning("could not prepare this model's linear-attention GPU kernels while loading (%s): the first "
                    "prompt compiles them, so its answer may start later (up to a minute on a machine's first "
                    "load)", exc)
        warmed = 0
    if warmed:
        log.info("linear-attention prefill kernels warmed in %.2f s", time.perf_counter() - t0)
    if progress:
        progress(1, 1)


def _planner_of(experts_plan: dict | None) -> dict:
    """The planner's own plan inside what an expert tier reports: a hybrid tier carries it under "planner", a
    resident tier the planner placed is that plan itself; {} when no planner ran (a CPU engine, a test's tier)."""
    if not experts_plan:
        return {}
    if isinstance(experts_plan.get("planner"), dict):
        return experts_plan["planner"]
    return experts_plan if "expert_slots" in experts_plan and "host_bytes" in experts_plan else {}


def default_experts_factory(device: torch.device) -> "ExpertsFactory":
    """Where experts live unless the caller says: on a GPU the planner decides (every expert resident when
    they fit, the hybrid tier — VRAM slot cache, CPU misses — when they do not); on the CPU they all are
    in host memory already."""
    if torch.device(device).type == "cuda":
        from runtime.experts.hybrid import hybrid_experts_factory

        return hybrid_experts_factory
    return resident_experts_factory


def resident_experts_factory(package, spec: ExpertSpec, *, device, dtype, progress=None, **_unused) -> Experts:
    """The default expert tier: every expert dequantized once onto the compute device."""
    from runtime.experts.resident import ResidentExperts

    return ResidentExperts.from_store(package.experts, spec, device=device, dtype=dtype, progress=progress)


class Engine:
    def __init__(self, *, model: CausalLM, package, tokenizer, chat_template, device: torch.device,
                 dtype: torch.dtype, context_length: int, max_batch: int, prefix_cache_bytes: int,
                 prefill_chunk: int, plan: dict, prefix_cache_device: torch.device | None = None,
                 decode_graphs=None):
        self.model, self.package = model, package
        self.routing_stats_path: Path | None = None   # where save_learned_state writes (set by from_package)
        self.graphs = decode_graphs          # runtime.decode_graph.DecodeGraphs, or None: steps of decoding sequences
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.device, self.dtype = device, dtype
        self.context_length = context_length
        self.model_type = package.model_type
        self.model_id = Path(package.path).name
        self.plan = plan
        # generation_config's EOS ids, else config.json's, else the tokenizer's own end token
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = _eos_ids(package) or ((tok_eos,) if tok_eos is not None else ())
        self.scheduler = Scheduler(SchedulerConfig(max_batch=max_batch, prefill_chunk=prefill_chunk,
                                                   step_token_budget=max(prefill_chunk, 2 * max_batch)))
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.prefix_cache_device = prefix_cache_device or device
        self.host_arena: HostArena | None = None     # the prefix cache's host memory when it is not `device`'s
        self.kv_buffers = KVBufferPool(context_length)   # a finished sequence's KV buffers, for the next one's graphs
        self._ids = itertools.count(1)
        self._pending_events: list[TokenEvent] = []
        self._results: dict[str, GenerationResult] = {}
        self._counters = dict(requests=0, finished=0, cancelled=0, failed=0, prefill_tokens=0, decode_tokens=0,
                              prefill_step_seconds=0.0, decode_step_seconds=0.0, steps=0,
                              prefix_store_seconds=0.0)

    # ------------------------------------------------------------------------------------------ load

    @classmethod
    def load(cls, path: str | Path, *, device: str = "auto", dtype: torch.dtype | None = None,
             context_length: int | None = None, max_batch: int = 8, vram_budget: int | None = None,
             cpu_experts_per_layer: int | None = None, progress: ProgressFn | None = None,
             experts_factory: ExpertsFactory | None = None, prefix_cache_bytes: int | None = None,
             prefix_cache_device: str | None = None, prefill_chunk: int | None = None,
             cuda_graphs: bool | None = None, state_dir: str | Path | None = None,
             dense_int8: bool | None = None) -> "Engine":
        """Open an FTW package and build an engine over it (see `from_package`)."""
        from runtime.ftw.reader import FTWError, FTWPackage

        try:
            package = FTWPackage.open(path)
        except FTWError as exc:
            raise EngineError(str(exc)) from exc
        return cls.from_package(package, device=device, dtype=dtype, context_length=context_length,
                                max_batch=max_batch, vram_budget=vram_budget,
                                cpu_experts_per_layer=cpu_experts_per_layer, progress=progress,
                                experts_factory=experts_factory, prefix_cache_bytes=prefix_cache_bytes,
                                prefix_cache_device=prefix_cache_device, prefill_chunk=prefill_chunk,
                                cuda_graphs=cuda_graphs, state_dir=state_dir, dense_int8=dense_int8)

    @classmethod
    def from_package(cls, package, *, device: str = "auto", dtype: torch.dtype | None = None,
                     context_length: int | None = None, max_batch: int = 8, vram_budget: int | None = None,
                     cpu_experts_per_layer: int | None = None, progress: ProgressFn | None = None,
                     experts_factory: ExpertsFactory | None = None, prefix_cache_bytes: int | None = None,
                     prefix_cache_device: str | None = None, prefill_chunk: int | None = None,
                     cuda_graphs: bool | None = None, state_dir: str | Path | None = None,
                     dense_int8: bool | None = None) -> "Engine":
        """Build from anything FTWPackage-shaped: config, model_type, generation_config, tokenizer_dir,
        dense_names()/dense(name), experts (an ExpertStore), path.

        `cuda_graphs`: decode steps (every running sequence feeding one token) replayed from CUDA graphs
        (runtime/decode_graph.py). None: on for a CUDA device when the model is covered; True on a CPU device
        runs the same static path eagerly (what the tests compare with the ordinary forward); False: always the
        ordinary forward.

        `state_dir`: a folder for what this model's expert tier learns while it runs (routing statistics, the
        learned CPU share; `save_learned_state`), read back at the next load so its VRAM cache starts warm. The
        caller picks it per model (the app: its data folder); None keeps nothing.

        `dense_int8`: the large dense projections and the LM head in int8 with a scale per row
        (runtime/models/quantized.py): half their bytes, read every step, and VRAM for expert slots. None: on
        a GPU for a package of quantized experts or one that does not fit beside bf16 dense weights
        (`_wants_int8_dense`), off otherwise (and always off on a CPU, where the engine matches transformers'
        forward)."""
        from runtime.text.chat_template import ChatTemplate, ChatTemplateError
        from runtime.text.tokenizer import Tokenizer

        dev = _resolve_device(device)
        if dev.type == "cuda":
            _use_expandable_segments()
        # a GPU's caches are kept in host RAM: VRAM is for weights, and a conversation's KV can be GBs
        prefix_dev = torch.device(prefix_cache_device or ("cpu" if dev.type == "cuda" else dev))
        prefix_cache_given = prefix_cache_bytes is not None
        if prefix_cache_bytes is None:
            prefix_cache_bytes = HOST_PREFIX_CACHE_BYTES if prefix_dev.type == "cpu" and dev.type == "cuda" \
                else DEFAULT_PREFIX_CACHE_BYTES
        if dtype is None:
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        chunk_given = prefill_chunk is not None
        if prefill_chunk is None:
            # a GPU prefills in the chunk the planner reserved activations for: every expert byte streamed over
            # PCIe (hybrid) then serves thousands of tokens; a CPU keeps chunks short (steps stay responsive)
            from runtime.experts.planner import PREFILL_CHUNK_TOKENS
            prefill_chunk = PREFILL_CHUNK_TOKENS if dev.type == "cuda" else CPU_PREFILL_CHUNK
        if max_batch < 1 or prefill_chunk < 1:
            raise EngineError(f"max_batch and prefill_chunk must be at least 1, got {max_batch} and {prefill_chunk}")
        config = dict(package.config)
        config.setdefault("model_type", package.model_type)
        max_pos = int(config.get("max_position_embeddings") or 0)
        if context_length is None:
            context_length = max_pos or 4096
        if context_length < 1 or (max_pos and context_length > max_pos):
            raise EngineError(f"context_length {context_length} is outside what this model supports "
                              f"(1..{max_pos} tokens)")
        t0 = time.perf_counter()
        try:
            model = build_empty_model(config, experts=None, device=dev, dtype=dtype)
        except UnsupportedModelError as exc:
            raise EngineError(str(exc)) from exc
        stage = lambda name: (lambda done, total: progress(done, total, name)) if progress else None  # noqa: E731
        report = load_dense_weights(model, package, progress=stage("dense weights"))
        dense_bytes = report.nbytes
        if dev.type == "cuda":
            model.fuse_projections()          # fewer, larger GEMMs: a GPU's decode step is bound by launches
        if dense_int8 is None:
            dense_int8 = _wants_int8_dense(dev, package, dense_bytes, vram_budget)
        dense_codec = str(dtype).replace("torch.", "")
        if dense_int8:
            from runtime.models.quantized import quantize_dense_

            try:
                swapped = quantize_dense_(model)
            except ValueError as exc:         # inf/NaN weights: nothing a scale can represent
                raise EngineError(f"this model's dense weights cannot be stored in int8 ({exc}); the package may "
                                  "be damaged: convert it again, or load it with the Dense precision setting at "
                                  "'model' (freetoken serve --dense model)") from exc
            if swapped["matrices"]:
                dense_codec = "int8"        # (a tiny model's matrices all stay: under quantized.MIN_WEIGHTS)
            dense_bytes = swapped["dense_bytes"]
            log.info("dense weights: %d matrices in int8, %.2f -> %.2f GB", swapped["matrices"],
                     swapped["bytes_before"] / 1e9, swapped["bytes_after"] / 1e9)
        factory = experts_factory or default_experts_factory(dev)
        routing_path = Path(state_dir) / ROUTING_STATS_FILE if state_dir else None
        learned = {"routing_stats_path": routing_path} if routing_path else {}
        try:
            # the dense weights are on the device already; the planner counts them itself, so it is told
            experts = factory(package, model.expert_spec(), device=dev, dtype=dtype, vram_budget=vram_budget,
                              cpu_experts_per_layer=cpu_experts_per_layer, progress=stage("experts"),
                              stage_progress=stage,
                              context_length=context_length, max_sequences=max_batch,
                              dense_bytes_on_device=dense_bytes if dev.type == "cuda" else 0, **learned)
        except MemoryError as exc:   # the plan (or the device) says the experts do not fit
            raise EngineError(f"the model does not fit on this machine: {exc}") from exc
        model.set_experts(experts)
        state_bytes = 0
        if callable(getattr(model, "attach_state_pool", None)):
            # linear-attention models: one recurrent-state slot per sequence that may run at once
            state_bytes = model.attach_state_pool(max_batch, device=dev, dtype=dtype).nbytes
        if dev.type == "cuda":
            _warm_up_gpu_kernels(model, stage(GPU_KERNELS_STAGE))
        tokenizer = Tokenizer.from_dir(package.tokenizer_dir)
        try:
            chat_template = ChatTemplate.from_dir(package.tokenizer_dir)
        except ChatTemplateError as exc:
            log.warning("%s", exc)
            chat_template = None
        experts_plan = getattr(experts, "plan", None) or getattr(experts, "planned", None)
        experts_plan = experts_plan() if callable(experts_plan) else experts_plan
        planned_prefix = _planner_of(experts_plan).get("prefix_cache_bytes")
        if not prefix_cache_given and planned_prefix is not None and prefix_dev.type == "cpu":
            # host RAM: at most what the planner left beside the experts (a machine whose RAM they fill caches less
            # or nothing, rather than push the experts' pages out)
            prefix_cache_bytes = min(prefix_cache_bytes, int(planned_prefix))
        backend = (experts_plan or {}).get("backend") or getattr(experts, "backend", None) or "custom"
        plan = {"backend": "resident" if factory is resident_experts_factory else backend,
                "device": str(dev), "dtype": str(dtype).replace("torch.", ""), "context_length": context_length,
                "max_batch": max_batch, "dense_bytes": dense_bytes, "dense_codec": dense_codec,
                "expert_bytes": int(getattr(experts, "nbytes", 0)), "prefix_cache_bytes": prefix_cache_bytes,
                "prefix_cache_device": str(prefix_dev),
                "state_slots": max_batch if state_bytes else 0, "state_bytes": state_bytes,
                "dense_on": "gpu" if dev.type == "cuda" else "cpu",
                # KV of one sequence at full context (caches grow with use, up to this per sequence)
                "kv_tokens": context_length, "kv_bytes": kv_bytes_per_sequence(model, context_length, dtype),
                "expert_total": len(package.experts.layers) * package.experts.num_experts,
                "load_seconds": round(time.perf_counter() - t0, 3)}
        if experts_plan:
            plan["experts"] = experts_plan
        planned_chunk = _planner_of(experts_plan).get("prefill_chunk")
        if not chunk_given and planned_chunk and planned_chunk < prefill_chunk:
            prefill_chunk = int(planned_chunk)        # a tight VRAM budget: the workspace the planner could fit
        plan["prefill_chunk"] = prefill_chunk
        graphs = _decode_graphs(model, dev, cuda_graphs, max_batch)
        plan["decode_graphs"] = graphs is not None and graphs.capture
        engine = cls(model=model, package=package, tokenizer=tokenizer, chat_template=chat_template, device=dev,
                     dtype=dtype, context_length=context_length, max_batch=max_batch,
                     prefix_cache_bytes=prefix_cache_bytes, prefix_cache_device=prefix_dev,
                     prefill_chunk=prefill_chunk, plan=plan, decode_graphs=graphs)
        engine.routing_stats_path = routing_path
        return engine

    def save_learned_state(self) -> bool:
        """Write what the expert tier learned (routing statistics, and beside them the learned CPU share) to the
        state folder given at load, atomically, so the next load of this model starts with its hot experts in
        VRAM. False when there is nowhere to write or the tier learns nothing (every expert resident)."""
        tier = getattr(self.model, "experts", None)
        if self.routing_stats_path is None or not callable(getattr(tier, "save_routing", None)):
            return False
        tier.save_routing(self.routing_stats_path)
        return True

    # -------------------------------------------------------------------------------------- requests

    def add_request(self, prompt_ids: list[int], sampling: SamplingParams | None = None, *,
                    on_prefill: PrefillFn | None = None, request_id: str | None = None,
                    truncate: bool = False) -> str:
        """Queue a request; it joins the running batch at the next step. Returns its id.

        A prompt longer than the context is refused, unless `truncate`: then its oldest tokens are dropped
        so that it fills the context but one token (room for at least one answer token).
        """
        from runtime.text.tokenizer import StreamDecoder

        params = sampling or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise EngineError("the prompt is empty: at least one token is needed")
        if truncate and len(prompt) >= self.context_length:
            keep = max(1, self.context_length - 1)
            log.info("prompt of %d tokens truncated to its last %d", len(prompt), keep)
            prompt = prompt[-keep:]
        if len(prompt) > self.context_length:
            raise EngineError(f"the prompt is {len(prompt)} tokens long but the context holds {self.context_length}; "
                              "shorten the conversation or load the model with a longer context")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise EngineError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        rid = request_id or f"req-{next(self._ids)}"
        if self.scheduler.find(rid) is not None:
            raise EngineError(f"request id {rid!r} is already in use")
        stop_ids = frozenset(self.eos_ids if params.stop_token_ids is None else params.stop_token_ids)
        state = _Request(params=params, sampler=RequestSampler(params, prompt_ids=prompt), stop_ids=stop_ids,
                         matcher=StopMatcher(params.stop), decoder=StreamDecoder(self.tokenizer),
                         on_prefill=on_prefill, t_added=time.perf_counter())
        self.scheduler.add(Sequence(rid, list(prompt), len(prompt), payload=state))
        self._counters["requests"] += 1
        return rid

    def cancel(self, request_id: str) -> bool:
        """Stop a request between steps; its final event (finish_reason "cancelled") comes with the next step."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self._finish(seq, "cancelled", final_text="")
        self._pending_events.append(TokenEvent(request_id, None, "", True, "cancelled"))
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending_events)

    def result(self, request_id: str) -> GenerationResult | None:
        """The result of a finished request (kept until read)."""
        return self._results.pop(request_id, None)

    # ------------------------------------------------------------------------------------------ step

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        events, self._pending_events = self._pending_events, []
        for seq in self.scheduler.admit():
            self._start(seq, events)
        if self.scheduler.running:
            self.kv_buffers.clear()    # running sequences may grow into that memory: spare buffers only across idle time
        work = self.scheduler.schedule()
        if not work:
            return events
        t0 = time.perf_counter()
        for seq, _ in work:
            if seq.payload.t_prefill_start is None:
                seq.payload.t_prefill_start = t0
        try:
            logits = self._forward(work)                                 # [B, V] fp32
        except (RuntimeError, ValueError) as exc:   # e.g. out of memory: fail these requests, keep the engine
            return events + self._fail(work, exc)
        self._counters["steps"] += 1
        ready_rows, ready = [], []
        for row, (seq, n) in enumerate(work):
            was_prefilling = seq.prefilling
            seq.computed += n
            if was_prefilling:
                self._counters["prefill_tokens"] += n
                if seq.payload.on_prefill:
                    seq.payload.on_prefill(seq.computed, seq.prompt_len)
                if seq.pause_before_last and seq.computed == seq.prompt_len - 1:
                    self._snapshot_prompt(seq)
                if seq.prefilling:
                    continue
            ready_rows.append(row)
            ready.append(seq)
        if ready:
            # (a pure decode step samples every row: no index upload and gather then)
            rows = logits if len(ready_rows) == logits.shape[0] else logits[ready_rows]
            chosen = sample_batch(rows, [seq.payload.sampler for seq in ready]).tolist()
            now = time.perf_counter()
            for seq, token in zip(ready, chosen):
                events.append(self._accept(seq, int(token), now))
        # engine-wide speeds: a step with any prompt tokens counts as prefill time, else as decode time
        elapsed = time.perf_counter() - t0
        phase = "prefill" if any(seq.computed - n < seq.prompt_len for seq, n in work) else "decode"
        self._counters[f"{phase}_step_seconds"] += elapsed
        return events

    def _forward(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        """The model over this step's tokens: a step where every sequence decodes one token through the recorded
        decode graphs when they cover it, else the ordinary ragged-batch forward (also a prompt's lone last token
        unless its step's recording exists: GRAPH_PROMPT_TAILS)."""
        tails = any(seq.prefilling for seq, _ in work)
        if (self.graphs is not None and all(n == 1 for _, n in work) and self.graphs.covers(len(work))
                and (GRAPH_PROMPT_TAILS or not tails or self.graphs.capture)):
            from runtime.decode_graph import GraphCaptureError

            seqs = [seq for seq, _ in work]
            try:
                logits = self.graphs.decode_batch([seq.tokens[seq.computed] for seq in seqs],
                                                  [seq.payload.cache for seq in seqs],
                                                  replay_only=tails and not GRAPH_PROMPT_TAILS)
                if logits is not None:
                    return logits
            except GraphCaptureError as exc:
                # this step already ran (eagerly, before the recording): keep its result, stop recording. A
                # failure at B > 1 stops only the batched recordings: batch-1 decode keeps its graphs
                if len(seqs) > 1:
                    log.warning("%s; steps of several sequences decode without CUDA graphs from now on", exc)
                    self.graphs.stop_batching(str(exc))
                    return exc.logits
                log.warning("%s; decoding without CUDA graphs from now on", exc)
                self.graphs.disabled = str(exc)
                logits, self.graphs = exc.logits, None
                return logits
        batch = Batch.build([(seq.tokens[seq.computed:seq.computed + n], seq.payload.cache) for seq, n in work],
                            device=self.device)
        if hasattr(self.model.experts, "prefill_continues"):     # a streaming tier stages ahead only for a next chunk
            self.model.experts.prefill_continues = self._prefill_follows(work)
        return self.model(batch)

    def _prefill_follows(self, work: list[tuple[Sequence, int]]) -> bool:
        """Whether a later step will prefill enough tokens to stream: the prompt tokens left after this step (of
        the prompts in it, of running ones it left out, of requests still waiting) reach the tier's
        `stream_threshold`. A prompt left one token short (a recurrent model's last token, fed alone for its
        snapshot) does not count: that step reads its misses over PCIe, and a staged layer would only compete."""
        stepping = {id(seq) for seq, _ in work}
        left = sum(seq.prompt_len - seq.computed - n for seq, n in work if seq.computed + n < seq.prompt_len)
        left += sum(seq.prompt_len - seq.computed for seq in self.scheduler.running
                    if seq.prefilling and id(seq) not in stepping)
        left += sum(seq.prompt_len for seq in self.scheduler.waiting)
        return left >= getattr(self.model.experts, "stream_threshold", 1)

    def _fail(self, work: list[tuple[Sequence, int]], exc: Exception) -> list[TokenEvent]:
        """The model raised on this batch: end its requests with finish_reason "error"; the engine lives on."""
        log.error("engine step failed for %d request(s): %s", len(work), exc, exc_info=exc)
        self.kv_buffers.clear()               # spare buffers first: the allocator may need their memory back
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        message = f"the model failed on this request: {exc}"
        events = []
        for seq, _ in work:
            seq.payload.error = message
            self._finish(seq, "error", final_text="", keep_cache=False)
            events.append(TokenEvent(seq.request_id, None, "", True, "error"))
        return events

    def _start(self, seq: Sequence, events: list[TokenEvent]) -> None:
        """A newly admitted sequence gets its cache, from the prefix cache when one covers its prompt."""
        state: _Request = seq.payload
        state.cache = self.model.new_cache(device=self.device, dtype=self.dtype)
        state.cache.limit_growth(self.context_length)
        self.kv_buffers.take(state.cache, seq.prompt_len)
        # recurrent state cannot be cut back: keep it one token before the prompt's end (the engine always
        # computes at least the last prompt token), so that an identical resend reuses all the rest
        seq.pause_before_last = not state.cache.trimmable and self.prefix_cache.max_bytes > 0
        hit = self.prefix_cache.lookup(seq.tokens[:seq.prompt_len])
        if hit is not None:
            # straight from host memory into the sequence's own buffers: a GPU copy of the whole entry first held
            # its KV twice (a resent 30K conversation peaked 9.9 GiB in an 8 GiB plan, s33a)
            state.cache.load(hit.cache, hit.length)
            seq.computed = state.cached_tokens = hit.length
        self._lock_ahead(seq, hit)
        if state.params.max_tokens == 0:
            self._finish(seq, "length", final_text="")
            events.append(TokenEvent(seq.request_id, None, "", True, "length"))

    def _lock_ahead(self, seq: Sequence, hit) -> None:
        """Have the host memory this request's stores will take page-locked while its prompt prefills, on another
        thread: locking it inside the store ran at ~2.8 GB/s (qwen3.6's 30K snapshot: 0.54 s of its time to first
        token, s33b). The arena then holds what the prefix cache keeps after making room for them - a trimmable
        model's store replaces the entry it extends, and a full cache evicts its oldest (s34a: counting neither
        locked 9 slabs where 5 were needed)."""
        if not self.prefix_cache.max_bytes or self.prefix_cache_device == self.device:
            return
        cache, arena = seq.payload.cache, self._arena()
        tokens = min(self.context_length, seq.prompt_len + min(seq.payload.params.max_tokens or 0, LOCK_AHEAD_TOKENS))
        sizes = cache.stored_tensors_at(tokens) * (2 if seq.pause_before_last else 1)   # + the prompt's snapshot
        size = min(sum(sizes), self.prefix_cache.max_bytes)
        # a trimmable entry the prompt extends whole is dropped as covered by this request's store
        replaced = hit.cache if hit is not None and cache.trimmable and hit.length == hit.cache.offset else None
        arena.prepare(self.prefix_cache.kept_after_room(size, dropping=replaced) + arena.slabs_nbytes(sizes))

    def _snapshot_prompt(self, seq: Sequence) -> None:
        """For models with recurrent state, keep a copy one token before the prompt's end (it cannot be cut
        later; a resend of the same prompt, or a longer one starting with it, restores it)."""
        cache = seq.payload.cache
        if not cache.trimmable and self.prefix_cache.max_bytes:
            self._keep(seq.tokens[:seq.computed], cache, live=True)

    def _keep(self, tokens: list[int], cache: SequenceCache, *, live: bool) -> None:
        """Put a copy of `cache` (holding exactly `tokens`) in the prefix cache; `live`: the sequence goes on using it.

        First drop what the insertion would drop - the entries it makes redundant, then the least recently used past
        the budget - so that the copy can take their host memory (an agent's next turn lands where the last one
        was; s33a: a copy made first spilled 64 of 96 tensors to torch's allocator); nothing for a cache too large to
        be kept at all."""
        size = cache.stored_nbytes
        if size <= self.prefix_cache.max_bytes:
            if cache.trimmable:
                self.prefix_cache.drop_covered(tokens)
            self.prefix_cache.make_room(size)
        if self.prefix_cache_device == self.device:
            kept = cache.copy() if live else cache.detach()
        else:
            # a copy to host memory is a copy already: no second one on the GPU (its VRAM was never planned)
            kept = self._to_host(cache.detach())
        self.prefix_cache.insert(tokens, kept)

    def _arena(self) -> HostArena:
        if self.host_arena is None:
            # page-locked on a GPU engine (brought back at the link's rate); made on first use, so an engine that
            # never stores a conversation locks no host memory
            self.host_arena = HostArena(self.prefix_cache.max_bytes, allocate=registered_slab if
                                        self.device.type == "cuda" else plain_slab)
        return self.host_arena

    def _to_host(self, cache: SequenceCache) -> SequenceCache:
        # timed: the copy to host memory runs inside a step (a linear-attention prompt's snapshot inside its TTFT)
        t0 = time.perf_counter()
        moved = cache.to(self.prefix_cache_device, arena=self._arena())
        self._counters["prefix_store_seconds"] += time.perf_counter() - t0
        return moved

    def _accept(self, seq: Sequence, token: int, now: float) -> TokenEvent:
        """Record a sampled token: stream its text, check stops and limits."""
        state: _Request = seq.payload
        if state.t_first is None:
            state.t_first = now
        else:
            self._counters["decode_tokens"] += 1
        seq.tokens.append(token)
        produced = len(seq.tokens) - seq.prompt_len
        if token in state.stop_ids:
            return self._end(seq, token, "", "stop")
        visible, stopped = state.matcher.push(state.decoder.push(token))
        if stopped:
            return self._end(seq, token, visible, "stop", flush=False, stop_sequence=state.matcher.matched)
        if produced >= state.params.max_tokens or len(seq.tokens) >= self.context_length:
            return self._end(seq, token, visible, "length")
        state.text.append(visible)
        return TokenEvent(seq.request_id, token, visible)

    def _end(self, seq: Sequence, token: int, visible: str, reason: str, *, flush: bool = True,
             stop_sequence: str | None = None) -> TokenEvent:
        state: _Request = seq.payload
        if flush:
            tail, _ = state.matcher.push(state.decoder.flush())
            visible += tail + state.matcher.flush()
        self._finish(seq, reason, final_text=visible)
        return TokenEvent(seq.request_id, token, visible, True, reason, stop_sequence)

    def _finish(self, seq: Sequence, reason: str, *, final_text: str, keep_cache: bool = True) -> None:
        state: _Request = seq.payload
        state.text.append(final_text)
        state.finish_reason = reason
        state.t_end = time.perf_counter()
        self.scheduler.remove(seq)
        if state.cache is not None:
            stored = keep_cache and self.prefix_cache.max_bytes and state.cache.offset > 0
            if stored:
                # the cache holds every token fed so far: exactly tokens[:offset]
                self._keep(seq.tokens[:state.cache.offset], state.cache, live=False)
            state.cache.release()
            # spare buffers for the next sequence, unless the prefix cache kept these very ones (on the engine's own
            # device; a host one took a copy) or the step failed (an out-of-memory step gives memory back)
            if keep_cache and not (stored and self.prefix_cache_device == self.device):
                self.kv_buffers.give(state.cache)
            state.cache = None
        self._counters[{"cancelled": "cancelled", "error": "failed"}.get(reason, "finished")] += 1
        self._results[seq.request_id] = self._make_result(seq)
        while len(self._results) > MAX_KEPT_RESULTS:        # results nobody collected do not pile up
            self._results.pop(next(iter(self._results)))

    def _make_result(self, seq: Sequence) -> GenerationResult:
        state: _Request = seq.payload
        output = seq.tokens[seq.prompt_len:]
        computed = seq.prompt_len - state.cached_tokens
        prefill_s = (state.t_first - state.t_prefill_start) if state.t_first and state.t_prefill_start else 0.0
        decode_s = (state.t_end - state.t_first) if state.t_first else 0.0
        return GenerationResult(
            tokens=output, text="".join(state.text), finish_reason=state.finish_reason,
            prompt_tokens=seq.prompt_len, cached_tokens=state.cached_tokens,
            prefill_tokens_per_s=computed / prefill_s if prefill_s > 0 else 0.0,
            decode_tokens_per_s=(len(output) - 1) / decode_s if decode_s > 0 and len(output) > 1 else 0.0,
            ttft=(state.t_first - state.t_added) if state.t_first else 0.0, error=state.error)

    # ----------------------------------------------------------------------------------- convenience

    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None, *,
                 on_prefill: PrefillFn | None = None,
                 on_token: Callable[[TokenEvent], None] | None = None) -> GenerationResult:
        """Run one request to the end. Other queued requests advance alongside it, but their events are
        not returned (read their results with `result()`); a server drives add_request/step itself."""
        rid = self.add_request(prompt_ids, sampling, on_prefill=on_prefill)
        while True:
            for event in self.step():
                if event.request_id != rid:
                    continue
                if on_token:
                    on_token(event)
                if event.finished:
                    return self._results.pop(rid)

    def stats(self) -> dict:
        c = self._counters
        running = self.scheduler.running
        return {
            "model_id": self.model_id, "model_type": self.model_type, "device": str(self.device),
            "requests": c["requests"], "finished": c["finished"], "cancelled": c["cancelled"], "failed": c["failed"],
            "active_sequences": len(running), "waiting_sequences": len(self.scheduler.waiting),
            "prefill_tokens": c["prefill_tokens"], "decode_tokens": c["decode_tokens"], "steps": c["steps"],
            # over the engine's whole life, all sequences together (steps timed as a whole)
            "prefill_tokens_per_s": (c["prefill_tokens"] / c["prefill_step_seconds"]) if c["prefill_step_seconds"] else 0.0,
            "decode_tokens_per_s": (c["decode_tokens"] / c["decode_step_seconds"]) if c["decode_step_seconds"] else 0.0,
            "kv_bytes": sum(s.payload.cache.nbytes for s in running if s.payload.cache is not None),
            "prefix_cache": {**self.prefix_cache.stats(), "store_seconds": c["prefix_store_seconds"],
                             "host_arena": self.host_arena.stats() if self.host_arena is not None else None},
            "experts": self.model.experts.stats() if hasattr(self.model.experts, "stats") else {},
            "decode_graphs": self.graphs.stats() if self.graphs is not None else None,
            "kv_buffers": self.kv_buffers.stats(),
        }
