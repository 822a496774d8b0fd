"""The hybrid expert tier: hot experts in a VRAM slot pool, misses on the CPU or fetched over PCIe.

`HybridExperts(layer, hidden, topk_ids, topk_weights)` is the `Experts` interface (interface.py). Per call:

  few tokens (decode)                              many tokens (prefill, >= stream_threshold)
  1. ids -> host (one small sync per layer)        1. the layer's blocks stream into one of two device
  2. host: split this layer's distinct experts        buffers on the copy stream (the next layer's copy
     into hits / misses (SlotDirectory)               is enqueued before this one computes: double-buffered)
  3. misses -> fetch over PCIe (into pool slots)   2. grouped compute over the buffer, one matmul chain
     or CPU, in the share SplitController learns      per expert on all its tokens
  4. GPU: table lookup (no sync) + compute of
     every resident expert; CPU: the rest, at
     the same time (cpu_executor, one call)
  5. sum; promote hot CPU-computed experts on
     the copy stream under a byte budget

Placement (how many slots, which backend) comes from the planner (planner.py); `hybrid_experts_factory` is
the engine's seam (runtime/engine.py `experts_factory`).

Shapes: T tokens, K experts per token, D hidden, E experts per layer.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.experts.cpu_executor import CpuExecutor
from runtime.experts.cpu_share import HAVE_NUMBA as CPU_SHARE_COMPILED
from runtime.experts.cpu_share import (HOST_ONLY, CpuShareWorker, Mailbox, collect_reference, cpu_share_counts,
                                       default_worker_threads, handoff_reference, split_row_parts, split_unit_rows)
from runtime.experts.host_store import HostExpertStore
from runtime.experts.interface import ExpertSpec
from runtime.experts.openmp import load_private_openmp, warn_if_private_beside_torch
from runtime.experts.planner import DECODE_SCRATCH_TOKENS
from runtime.experts.policy import (SHARE_GRID, SPLIT_SHARE_GRID, Key, RoutingStats, ShareController, ShareMemory,
                                    SlotDirectory, SplitController, cpu_model_name, make_policy, model_fingerprint,
                                    share_state_path)
from runtime.experts.promotion_budget import PromotionBudget
from runtime.experts.slot_cache import SlotCache
from runtime.experts.stats import ExpertStats
from runtime.experts.transport import Transport, ready_event
from runtime.kernels import gather_triton, handoff_triton, int4_pool_triton
from runtime.kernels.expert_pool import blocks_forward, pool_forward, pool_forward_grouped

log = logging.getLogger(__name__)

ZERO_COPY_MAX_TOKENS = DECODE_SCRATCH_TOKENS   # zero-copy moves an expert per assignment: only a few tokens
NEVER_STREAM = 1 << 62                 # a stream threshold no call reaches
SHARE_RESCAN_STEPS = 200               # the learned CPU share measures again once warm (policy.ShareController)
ZERO_COPY_OF_H2D = 0.83                # zero-copy decode's gather beside the CPU's reads: ~45 of ~54 GB/s (H200,
                                       # session 14)
CPU_KERNEL_OF_READ = 0.62              # the int8 CPU kernel on a decode request of ~3 experts: ~55 of ~88 GB/s of
                                       # the host's read bandwidth (H200, session 14; a whole layer's 8: ~0.85)
STREAM_TOKENS_PER_ACTIVE_SHARE = 32   # stream a layer when tokens >= 32 * E / K (each byte serves enough tokens)
MIN_STREAM_TOKENS = 32                # ...or sooner, when the CPU would take longer than the stream (below)
CPU_EXPERT_FLOPS = 0.3e12             # the int8 CPU kernel on mid-size batches: ~0.3 TFLOP/s measured on the
                                      # H200 host's 16 cores (a 200-token turn: ~15 GFLOP per layer in 47 ms)
CPU_EXPERT_FLOPS_THREADS = 16         # ...with this many kernel threads (session 2, before a worker kept cores)
STREAM_SPLIT_MIN_PART = 32            # a split stream leaves the CPU at least 1/32 of the experts, or none
CPU_COST_MEMORY = 0.3                 # the learned CPU cost per assignment: weight of the newest call (an EMA)
LOG_COPIES = 4                        # zero-copy decode: steps whose routing logs may be on their way to the host


def _env_threads(name: str) -> int | None:
    """A thread count from the environment variable `name`: None when unset; a value that is not a positive
    integer is ignored with a warning, and one above this machine's cores is capped there (numba refuses more)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    cores = os.cpu_count() or 1
    if not raw.isdigit() or int(raw) < 1:
        log.warning("%s=%r is not a positive whole number of threads; ignored", name, raw)
        return None
    if int(raw) > cores:
        log.warning("%s=%s is more threads than this machine's %d cores; using %d", name, raw, cores, cores)
    return min(int(raw), cores)


def stream_threshold_tokens(*, num_experts: int, top_k: int, block_nbytes: int, hidden: int, intermediate: int,
                            h2d_gbps: float) -> int:
    """Tokens from which a layer call streams every expert of the layer to the GPU instead of splitting misses.

    The issue's rule, 32 x E/K tokens, assumes the CPU handles misses at memory speed. That holds for a few
    tokens; for tens of tokens the CPU is bound by arithmetic (T x K x 6 D I flops), and a 200-token turn took
    47 ms per layer on the few-token path where streaming the layer takes ~6 ms over the H200's link. So stream
    from the batch size where the CPU's arithmetic alone would outlast the stream (at this link's measured
    rate), never below MIN_STREAM_TOKENS (decode batches stay on the few-token path) and never above the rule."""
    rule = STREAM_TOKENS_PER_ACTIVE_SHARE * num_experts // max(1, top_k)
    if h2d_gbps <= 0:
        return rule
    stream_s = num_experts * block_nbytes / (h2d_gbps * 1e9)
    cpu_s_per_token = top_k * 6 * hidden * intermediate / CPU_EXPERT_FLOPS
    return int(min(rule, max(MIN_STREAM_TOKENS, math.ceil(stream_s / cpu_s_per_token))))


@dataclass(frozen=True)
class HybridOptions:
    slots: int                                  # VRAM pool slots (0: everything on the CPU)
    policy: str = "lru"                         # "lru" | "frequency"
    hot_set: tuple[Key, ...] = ()               # pinned in the pool from the start (persisted routing stats)
    cpu_threads: int | None = None
    cpu_gbps: float = 20.0                      # startup estimates; the split controller re-learns them
    h2d_gbps: float = 20.0
    promote_bytes_per_call: int = 8 << 20       # background promotion budget per layer call
    stream_threshold: int | None = None         # tokens from which a layer streams (None: stream_threshold_tokens)
    top_k: int = 8
    split: str = "auto"                         # "auto" | "cpu" | "fetch": force a pure strategy (benchmarks)
    stream_on_cpu: bool = False                 # run the streaming path on a CPU device too (tests)
    prefetch_bytes_per_call: int = 16 << 20     # copy budget for next-layer predictions (with a prefetcher)
    zero_copy: bool | None = None               # decode misses read by the GPU in place from page-locked host
                                                # memory (None: on CUDA when possible and split is auto/fetch)
    promote_bytes_per_step: int = 16 << 20      # zero-copy mode: promotions decided once per decode step
    cpu_share: float | None = None              # zero-copy mode: the CPU's share of misses; None: learned from
                                                # step times (policy.ShareController), starting at the bandwidth
                                                # balance or, with a share_memory, where the last load ended; a number:
                                                # fixed (0: the GPU reads every miss; < 0: the bandwidth balance)
    fill_pool: bool | None = None               # fill free slots at load (None: on a GPU; CPU tests keep the
                                                # pool to its hot set so they can reason about its contents)
    zero_copy_gather: bool = True               # zero-copy misses copied into VRAM scratch by one copy kernel
                                                # before the pool kernels run (False: read in place over PCIe)
    adaptive_promotions: bool = True            # zero-copy mode: the step's promotion budget falls while
                                                # promoted experts are hit no more than residents are
                                                # (promotion_budget.py; False: always the byte budget's blocks)
    hits_beside: bool = True                    # zero-copy decode on CUDA: the hits' pool kernels on a stream
                                                # of their own, beside the misses' reads over PCIe (a branch of
                                                # the step's graph), not after them (run s13c-f: +3 to +16 %)
    share_start: float | None = None            # a first load's learned share starts here (None: the bandwidth
                                                # balance, `_default_cpu_share`; benchmarks compare it with 0)
    split_gather: bool = True                   # zero-copy decode on CUDA with the gather: the misses' blocks
                                                # gathered in two launches, gate/up parts then down parts, the
                                                # gate/up kernel on the side stream beside the second (session 14)
    collect_warps: int = 4                      # zero-copy decode on CUDA: collect's program a token, one thread
                                                # polling for the CPU's answer (handoff_triton.collect; s19a
                                                # measured 4); 0: every warp polls (sessions 9-18)
    expert_split: bool = False                  # zero-copy decode with a compiled CPU worker: one-token calls split
                                                # one miss between the sides by rows (cpu_share.py, session 16).
                                                # Off: no steady gain on the H200 (session 17: 4-8 % ahead at
                                                # fixed shares on one host, 3-15 % behind learned on another)
    cpu_early_x: bool | None = None             # the compiled CPU worker's early plan (cpu_kernels_int8.serve_layers:
                                                # a one-token request's x quantized while its lanes ask for their
                                                # first rows); None: CpuShareWorker's default (on)
    host_only_layers: tuple[int, ...] = ()      # on a CPU device (tests): layer indices treated as a GPU's host-only
                                                # ones (on CUDA: the layers the store could not page-lock)
    stream_split: bool | None = None            # a streamed call of mid size copies only a prefix of the layer's
                                                # experts; the CPU computes the assignments to the rest beside the
                                                # copy (`_stream_prefix`, session 41). None: FREETOKEN_STREAM_SPLIT=1
                                                # turns it on - off until a GPU A/B has measured it


class HybridExperts:
    backend = "hybrid"

    def __init__(self, store: HostExpertStore, spec: ExpertSpec, *, device: torch.device | str,
                 dtype: torch.dtype, options: HybridOptions, routing_stats: RoutingStats | None = None,
                 prefetcher=None, share_memory: ShareMemory | None = None):
        self.store, self.spec, self.options = store, spec, options
        self.device = torch.device(device)
        self.dtype = dtype
        self.layout = store.layout
        self.cuda = self.device.type == "cuda"
        self._box = self._worker = None         # zero-copy decode's CPU share (mailbox, worker thread)
        self._host_threads = None               # the decoding thread's kernel threads while a worker runs
        # where the learned share is remembered (keyed by the slots this tier really has), or None
        self.share_memory = None if share_memory is None else share_memory.for_slots(options.slots)
        self.cpu_share = 0.0
        directory = SlotDirectory(options.slots, make_policy(options.policy), pinned=options.hot_set)
        self.transport = Transport(store, self.device)
        total = store.n_blocks
        # the layers (indices) whose host memory the GPU cannot read: not page-locked (a store pinned in part,
        # the pinnable share being short) - zero-copy decode leaves all their misses to the CPU worker
        self._host_only = [li for li, layer in enumerate(store.layers) if layer not in self.transport.pinned_layers] \
            if self.cuda else list(options.host_only_layers)
        # a store pinned in part: a host-driven call (5+ tokens) runs every miss of an unpinned layer on the CPU - a
        # fetch would wait for the ring's host copy, and the split learned on the pinned layers' direct DMA would
        # fetch too many (a store with no layer pinned keeps learning its own split)
        self._cpu_misses = {store.layers[li] for li in self._host_only} \
            if len(self._host_only) < len(store.layers) else set()
        self.cpu = CpuExecutor(store, spec, threads=options.cpu_threads)
        want_zero_copy = options.split in ("auto", "fetch") if options.zero_copy is None else options.zero_copy
        # (host-only layers need the CPU worker, which on a GPU talks through Triton's handoff)
        worker_possible = not self.cuda or handoff_triton.HAVE_TRITON
        self.zero_copy = bool(want_zero_copy and options.slots < total and (
            options.zero_copy or (self.cuda and self.transport.pinned_layers and int4_pool_triton.supports(store.layout, spec)))
            and (worker_possible or not self._host_only) and len(self._host_only) < len(store.layers))
        self.cache = SlotCache(directory=directory, layers=store.layers, num_experts=store.num_experts,
                               block_nbytes=store.block_nbytes, device=self.device, miss_table=self.zero_copy)
        if self.zero_copy:
            # the CPU-share worker's OpenMP threads apart from torch's, before anything launches them
            load_private_openmp()
        elif not self.cuda:
            warn_if_private_beside_torch()
        if options.slots < total:
            # misses may run on the CPU: compile (or load from numba's cache) the kernel now, while the
            # model loads, not during the first answer (a first compile takes about a minute)
            self.cpu.warm_up(store.layers[0])
        self.split = SplitController(cpu_gbps=options.cpu_gbps, pcie_gbps=options.h2d_gbps if options.slots else 0.0)
        self.counters = ExpertStats()
        self.routing = routing_stats if routing_stats is not None else RoutingStats()
        self.prefetcher = prefetcher            # prefetch.NextLayerPrefetcher, or None
        self.stream_threshold = options.stream_threshold or stream_threshold_tokens(
            num_experts=store.num_experts, top_k=options.top_k, block_nbytes=store.block_nbytes,
            hidden=store.layout.hidden, intermediate=store.layout.intermediate,
            h2d_gbps=options.h2d_gbps if self.cuda and options.slots else 0.0)
        self._stage = None                      # two device buffers [E, nbytes] for prefill streaming
        self.stream_split = options.stream_split if options.stream_split is not None else \
            os.environ.get("FREETOKEN_STREAM_SPLIT", "0") == "1"
        self._cpu_assignment_s: float | None = None   # learned CPU seconds per assignment of a split stream
        # the split's kernel threads (None: the host-driven path's; an A/B of more, beside the worker's pool)
        self._split_threads = _env_threads("FREETOKEN_STREAM_SPLIT_THREADS")
        # whether another prefill chunk follows this forward (the engine says so before each; unknown: True).
        # The last layer stages the first one ahead only then: after a prompt's last chunk that copy (a layer,
        # ~330 MB for qwen3-30b) would serve nobody and hold up the copy stream's first decode promotions
        self.prefill_continues = True
        # layer -> (buffer index, copy event or Staged, experts copied: a prefix [0, k) of the layer's)
        self._staged: dict[int, tuple[int, object, int]] = {}
        self._stage_free: list[object] = [None, None]       # event after which each buffer may be overwritten
        self.stream_wait_s = 0.0                # the decoding thread's time waiting for staged layers (stats)
        self._promotions: list[tuple[Key, int, object]] = []
        self._promote_blocks = options.promote_bytes_per_call // max(1, store.block_nbytes)
        self._seen = np.zeros(store.num_experts, dtype=bool)   # scratch for a call's distinct experts
        # decode staging: page-locked host buffers and device buffers reused by every call (grown, never
        # shrunk), and the two events of the one device->host and the one host->device transfer per call
        self._pinned: dict[str, torch.Tensor] = {}
        self._on_device: dict[str, torch.Tensor] = {}
        self._staged_io = self.cuda             # decode I/O through those buffers (a test turns it on on CPU)
        self._d2h_done = torch.cuda.Event() if self.cuda else _NoEvent()
        self._h2d_done = torch.cuda.Event() if self.cuda else _NoEvent()
        # decode compute over the pool: the fused Triton kernels where they cover the codec, else torch
        self._pool_forward = int4_pool_triton.pool_forward_triton if (
            self.cuda and int4_pool_triton.supports(self.layout, spec)) else pool_forward
        self._warm_hot_set()
        if self.cuda if options.fill_pool is None else options.fill_pool:
            self._fill_free_slots()
        self._all_resident = options.slots >= total and all(
            self.cache.is_ready((layer, e)) for layer in store.layers for e in range(store.num_experts))
        if self.zero_copy:
            self._init_zero_copy()

    # ------------------------------------------------------------------ the Experts interface
    def __call__(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        if layer not in self.cache.layer_index:
            raise KeyError(f"layer {layer} has no routed experts in this model")
        t = hidden.shape[0]
        if self.zero_copy and t <= ZERO_COPY_MAX_TOKENS:
            return self._zero_copy_decode(layer, hidden, topk_ids, topk_weights)
        # a prefill or host-driven call: the time up to the next zero-copy step is no decode step's (another user's
        # prompt prefilling between two of a conversation's tokens), so the share controller does not see it
        self._step_started = None
        if self._promotions:
            self._finish_promotions()
        if t >= self.stream_threshold:
            if self._all_resident:
                # every expert lives in the pool: group over it directly, nothing to stream
                slots = self.cache.device_slots(layer, topk_ids)
                self.counters.add(tokens=t, stream_calls=1, gpu_experts=self.store.num_experts)
                return pool_forward_grouped(self.cache.pool, self.layout, self.spec, hidden.to(self.dtype), slots,
                                            topk_weights).to(hidden.dtype)
            if self.cuda or self.options.stream_on_cpu:
                self.counters.add(tokens=t)
                return self._streamed(layer, hidden, topk_ids, topk_weights)
        return self._decode(layer, hidden, topk_ids, topk_weights)

    def graph_safe(self, layer: int) -> bool:
        """A decode call needs nothing from the host, so runtime/decode_graph.py may record it: every expert
        lives in the pool for good (a device lookup and the pool kernels; counters then count the recording),
        or misses are read in place from host memory (zero-copy: the host's bookkeeping runs between steps,
        from the step's routing log, in `begin_step` / `end_step`)."""
        return self.cuda and (self._all_resident or self.zero_copy)

    def graph_tokens(self, layer: int) -> int | None:
        """Tokens one call may carry inside a CUDA graph (runtime/decode_graph.py records a step of B decoding
        sequences as one call of B tokens per layer): any when every expert lives in the pool, up to
        ZERO_COPY_MAX_TOKENS on the zero-copy path (more take the host-driven path), none otherwise."""
        if not self.graph_safe(layer):
            return 0
        return None if self._all_resident else ZERO_COPY_MAX_TOKENS

    # ------------------------------------------------------------------ few tokens, zero-copy
    def _init_zero_copy(self) -> None:
        """Zero-copy decode: the GPU computes every expert of a call itself, hits from the VRAM pool and misses
        straight from the page-locked host store over PCIe (the same Triton kernels, given the layer's host
        blocks as their "pool" and the miss table as their slot table). No host sync, no host decision per
        layer, so the whole decode step is one CUDA graph. The host keeps its books between steps: each call
        writes its expert ids into a device log [L, T, K]; `begin_step` copies the log to the host and
        publishes promotions that have landed, `end_step` (while the GPU runs the step) counts hits and
        misses, feeds the policy and routing statistics and starts promotions on the copy stream."""
        store = self.store
        # [E, nbytes] host blocks the kernels read in place; a host-only layer's are never read by the GPU (the
        # handoff gives all its misses to the CPU), so it gets a stand-in the kernels may be pointed at
        stand_in = torch.zeros((1, store.block_nbytes), dtype=torch.uint8, device=self.device) \
            if self.cuda and self._host_only else None
        only = set(self._host_only) if self.cuda else set()
        self._host_layers = [stand_in if li in only else torch.from_numpy(store.layer_buffer(layer))
                             for li, layer in enumerate(store.layers)]
        self._dead: str | None = None           # why this tier can no longer decode (a worker lost, host-only layers)
        shape = (len(store.layers), ZERO_COPY_MAX_TOKENS, self.options.top_k)
        self._log = torch.full(shape, -1, dtype=torch.int64, device=self.device)       # [L, T, K] ids of a step
        # each step's log is copied out at the next step's start into a host buffer of its own (a ring), and
        # accounted in step order once landed: a step never writes over a log not yet copied
        self._log_hosts = [torch.empty(shape, dtype=torch.int64, pin_memory=self.cuda) for _ in range(LOG_COPIES)]
        self._err_hosts = [torch.zeros(1, dtype=torch.int32, pin_memory=self.cuda) for _ in range(LOG_COPIES)]
        self._log_copies: collections.deque = collections.deque()   # (event, ring slot, table snapshot, share)
        self._log_next = 0                      # the ring slot the next copy goes to
        # a call's missed blocks, copied from host memory by gather_triton (the planner counts these bytes)
        self._scratch = torch.empty((ZERO_COPY_MAX_TOKENS * self.options.top_k, store.block_nbytes),
                                    dtype=torch.uint8, device=self.device) if self.options.zero_copy_gather else None
        self._snapshot = self.cache.host_table.copy()        # the table the current step runs against
        # where a block's down part begins, when the misses are gathered in two parts (0: one gather)
        self._split_at = int4_pool_triton.down_offset(self.layout) if (
            self.cuda and self.options.split_gather and self._scratch is not None
            and self._pool_forward is int4_pool_triton.pool_forward_triton) else 0
        # the step graph's side branch: the hits' pool kernels beside the misses' gather (`hits_beside`) and the
        # misses' gate/up kernel beside the gather of their down parts (`split_gather`)
        self._side_stream = torch.cuda.Stream(self.device) if self.cuda and (
            self.options.hits_beside or self._split_at) else None
        # the blocks a step may promote: the byte budget's while promoted experts are used more than those they evict
        most = self.options.promote_bytes_per_step // max(1, store.block_nbytes)
        self._promotion_budget = PromotionBudget(most, layers=len(store.layers), experts=store.num_experts,
                                                 floor=1 if self.options.adaptive_promotions else most)
        self._box = self._worker = self._row_skip = None
        # the finer split needs the compiled worker (it computes a split expert's rows) and, on the GPU, the
        # gather in two parts (the CPU's rows are filled into h between the gate/up and down launches)
        splits = (self.options.expert_split and self.cpu.int8 and CPU_SHARE_COMPILED and self._scratch is not None
                  and (self._split_at or not self.cuda))
        fixed = self.options.cpu_share
        self._share_control = None
        if fixed is None and (self.cpu.int8 or self.cpu.fast):
            # learned: where the last load left it, or (a first load) at the share that balances the two sides'
            # bandwidths - the H200's learned shares settled at 0.5-0.6 where the balance says ~0.55, and a start
            # at 0 ran a fresh install's first 100 steps ~20 % slower (a laptop's: ~70 %; tests/
            # test_share_controller.py); rescanned once warm: the CPU side's first ~100 steps after a load run slow
            make = self.share_memory.controller if self.share_memory else ShareController
            start = self._default_cpu_share() if self.options.share_start is None else self.options.share_start
            # (with the split, the step time is no longer flat between whole experts: a finer grid to find it)
            self._share_control = make(start=start, rescan_after=SHARE_RESCAN_STEPS,
                                       grid=SPLIT_SHARE_GRID if splits else SHARE_GRID)
        share = (self._share_control.share if self._share_control else 0.0) if fixed is None else \
            self._default_cpu_share() if fixed < 0 else float(fixed)
        self._step_started = None
        if (share > 0 or self._share_control is not None or self._host_only) and (
                not self.cuda or handoff_triton.HAVE_TRITON):
            self._box = Mailbox(max_tokens=ZERO_COPY_MAX_TOKENS, top_k=self.options.top_k,
                                hidden=store.layout.hidden, device=self.device, share=share,
                                intermediate=store.layout.intermediate,
                                layers=len(store.layers) if self._host_only else 1)
            self._box.set_host_only(self._host_only)
            # the worker thread holds the tier only weakly, and the tier's finaliser stops the thread: a model
            # that is unloaded (the service drops the engine) frees its pinned experts and VRAM pool
            tier, layers = weakref.ref(self), store.layers
            worker_threads = self.cpu.threads or default_worker_threads()

            def compute(li, x, tok, experts, w):
                me = tier()
                if me is None:
                    raise RuntimeError("the expert tier was unloaded")
                return me.cpu.run(layers[li], x, tok, experts, w, threads=worker_threads)

            self._worker = CpuShareWorker(self._box, compute, int8_args=self.cpu.int8_args() if self.cpu.int8 else None,
                                          threads=worker_threads, early_x=self.options.cpu_early_x)
            # the host-driven path's CPU work (calls of 5 tokens up to the streaming threshold) runs on the
            # decoding thread: with a pool of its own beside the worker's that outnumbered the cores, libgomp
            # would stop spinning between regions for both (benchmarks/omp_pools.py), so it gets the cores left
            self._host_threads = max(1, (os.cpu_count() or 1) - worker_threads - 1)
            weakref.finalize(self, self._worker.close)
            if splits and self._worker.compiled:
                self._row_skip = gather_triton.RowSkip.of(self._box.split, split_row_parts(self.layout))
                self._box.enable_split(split_unit_rows(self.layout))
        else:
            self._share_control = None
        self.cpu_share = share if self._box is not None else 0.0
        if self.cuda:
            try:               # a store the GPU cannot map, or a kernel that cannot read it: the host path
                probe = torch.zeros((1, store.layout.hidden), dtype=self.dtype, device=self.device)
                ids = torch.arange(min(self.options.top_k, store.num_experts), device=self.device)[None]
                self._zero_copy_forward(0, probe, ids, torch.ones(ids.shape, device=self.device))
                self._log.fill_(-1)                # (the probe's ids were logged: no step's routing)
                torch.cuda.current_stream(self.device).synchronize()
            except Exception as exc:     # noqa: BLE001  (reported; the host-driven path still works)
                log.warning("zero-copy expert reads are unavailable (%s): misses go through the host", exc)
                self.zero_copy = False
                self.close()

    @property
    def _split_unit(self) -> int:
        """Gate/up rows a whole expert weighs with the finer split on (the mailbox's); 0 without it."""
        return self._box.unit if self._box is not None else 0

    def _default_cpu_share(self) -> float:
        """The CPU's share of misses that makes both sides finish together: its kernel's rate over the sum of
        both rates (each a measured fraction of the machine's bandwidths). 0 without a CPU kernel."""
        if not self.cpu.int8 and not self.cpu.fast:
            return 0.0
        cpu = CPU_KERNEL_OF_READ * self.options.cpu_gbps
        pcie = ZERO_COPY_OF_H2D * self.options.h2d_gbps
        return cpu / (cpu + pcie) if cpu > 0 else 0.0

    def close(self) -> None:
        """Stop the CPU-share worker (the tier keeps working, the GPU then reads every miss itself)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if getattr(self, "_box", None) is not None:
            if self._host_only:
                self._box.error.fill_(1)     # no request to a stopped worker (the host-only layers' misses: dropped)
            if self._share_control is not None and self.share_memory is not None:
                self.share_memory.try_save(self._share_control)      # the medians of this run too
            self._box.set_share(0.0)
            self.cpu_share = 0.0
            self._share_control = None

    def _zero_copy_forward(self, li: int, x: torch.Tensor, topk_ids: torch.Tensor,
                           topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, D] (compute dtype) -> [T, D]: misses over PCIe from host memory and hits from the pool (beside
        them, `_beside_parts`), plus the CPU's share when a worker takes one."""
        cache = self.cache
        if self._box is not None:
            # the GPU splits the misses and hands the CPU its share (mailbox), computes the rest and the hits,
            # then waits for the CPU's rows: all in kernels, so this too records into the step's graph
            # (the handoff writes the step log's row too: one kernel fewer before the CPU starts)
            ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
            if self.cuda:
                hit, zc = handoff_triton.handoff(li, ids, topk_weights, x, cache.table_rows[li], self._box,
                                                 log=self._log[li])
            else:
                hit, zc = handoff_reference(li, ids, topk_weights, x, cache.table_rows[li], self._box,
                                            log=self._log[li])
            # (collect adds the hits' rows with the CPU's: no add kernel of their own)
            misses = lambda: self._misses(li, x, zc, topk_weights, split=self._row_skip is not None)  # noqa: E731
            out, hits = (misses(), None) if not self.options.slots else \
                self._beside_parts(misses,
                                   lambda: self._pool_forward(cache.pool, self.layout, self.spec, x, hit, topk_weights))
            if self.cuda:
                return handoff_triton.collect(out, self._box, extra=hits, warps=self.options.collect_warps)
            return collect_reference(out, self._box, extra=hits)
        self._log[li, :x.shape[0]].copy_(topk_ids)      # the step log's row (the handoff writes it above)
        misses = lambda: self._misses(li, x, topk_ids, topk_weights, table_row=cache.miss_rows[li])  # noqa: E731
        if not self.options.slots:
            return misses()
        return self._beside(misses, lambda: self._looked_up(cache.pool, x, topk_ids, topk_weights,
                                                            cache.table_rows[li]))

    def _beside(self, misses, hits) -> torch.Tensor:
        """misses() + hits() (callables, each [T, D]), computed as `_beside_parts` says: out = misses, then
        out += hits."""
        out, h = self._beside_parts(misses, hits)
        return out.add_(h)

    def _beside_parts(self, misses, hits) -> tuple[torch.Tensor, torch.Tensor]:
        """(misses(), hits()) (callables, each [T, D]), both done on the current stream when this returns. With
        `hits_beside` on CUDA the hits' pool kernels run on a stream of their own while the misses' gather waits
        on PCIe - a branch of the recorded step's graph, joined here (run s13b's trace: ~28 µs a layer of pool
        kernels after a ~142 µs gather); else one after the other."""
        if self._side_stream is None or not self.options.hits_beside:
            return misses(), hits()
        main = torch.cuda.current_stream(self.device)
        self._side_stream.wait_stream(main)             # after the handoff wrote the hits' slots
        with torch.cuda.stream(self._side_stream):
            h = hits()
        out = misses()
        main.wait_stream(self._side_stream)
        return out, h

    def _misses(self, li: int, x: torch.Tensor, rows: torch.Tensor, topk_weights: torch.Tensor, *,
                table_row: torch.Tensor | None = None, split: bool = False) -> torch.Tensor:
        """The missed experts' part of a zero-copy call: `rows` [T, K] are host rows of the layer (-1: not a
        miss the GPU computes), or expert ids looked up in `table_row`. Copied into the VRAM scratch by one
        gather launch, then computed there (a copy kernel keeps far more reads in flight over PCIe than the
        compute kernels do), or computed in place from host memory. `split`: the handoff may have split one miss
        with the CPU (`Mailbox.enable_split`): its first gate/up rows are neither gathered nor computed here."""
        host = self._host_layers[li]
        if self._scratch is None:
            if table_row is None:
                return self._pool_forward(host, self.layout, self.spec, x, rows, topk_weights)
            return self._looked_up(host, x, rows, topk_weights, table_row)
        if self._split_at:
            return self._gathered_in_two(host, x, rows, topk_weights, table_row, split=split)
        if self.cuda:
            slots = gather_triton.gather_blocks(host, rows, self._scratch, table=table_row)
            return self._pool_forward(self._scratch, self.layout, self.spec, x, slots, topk_weights)
        skip = self._row_skip if split else None
        slots = gather_triton.gather_blocks_reference(host, rows, self._scratch, table=table_row, skip=skip)
        if skip is None or int(self._box.split[0]) < 0:
            return self._pool_forward(self._scratch, self.layout, self.spec, x, slots, topk_weights)
        a = int(self._box.split[0])
        y = self._split_reference(self._scratch[int(slots.view(-1)[a])], x[a // slots.shape[1]],
                                  topk_weights.reshape(-1)[a])
        slots.view(-1)[a] = -1
        return self._pool_forward(self._scratch, self.layout, self.spec, x, slots, topk_weights).index_add_(
            0, torch.tensor([a // slots.shape[1]]), y[None].to(x.dtype))

    def _split_reference(self, block: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         timeout_s: float = 10.0) -> torch.Tensor:
        """The split expert's output on a CPU device (what the gate/up and down kernels do on CUDA): its rows
        from the gathered block, the first rows of h from the mailbox once the CPU's ticket is there."""
        box = self._box
        want, deadline = int(box.ticket[0]), time.monotonic() + timeout_s
        while int(box._np["part_resp"][0]) != want:
            if time.monotonic() > deadline:
                box.error.fill_(1)
                break
            time.sleep(0)
        part = torch.from_numpy(box._np["part"][:int(box.split[1])])[None]
        return blocks_forward(block[None], self.layout, self.spec, x[None], h_first=part)[0] * weight.to(x.dtype)

    def _gathered_in_two(self, host, x, rows, topk_weights, table_row, *, split: bool = False) -> torch.Tensor:
        """`_misses` with the blocks gathered in two launches, their gate/up parts first: the gate/up kernel runs on
        the side stream as soon as the first launch is done, beside the second's reads over PCIe, so only the down
        kernel waits for the whole gather (a traced 8 GiB layer ran ~14 µs of the misses' pool kernels after its
        ~155 µs gather, run s13b). The same kernels and sums as one gather: the same bits."""
        main, side, cut = torch.cuda.current_stream(self.device), self._side_stream, self._split_at
        slots = gather_triton.gather_blocks(host, rows, self._scratch, table=table_row, byte_range=(0, cut),
                                            skip=self._row_skip if split else None)
        if split:           # the CPU's rows of the split expert, taken while the link is quiet (take_split_rows)
            handoff_triton.take_split_rows(self._box)
        side.wait_stream(main)                          # (after the hits' kernels, when they run there too)
        with torch.cuda.stream(side):
            h, looked_up = int4_pool_triton.pool_gate_up_triton(self._scratch, self.layout, self.spec, x, slots)
            if split:                                   # the split expert's first rows: the CPU's
                handoff_triton.fill_split_rows(h, self._box)
        gather_triton.gather_blocks(host, rows, self._scratch, table=table_row,
                                    byte_range=(cut, self.store.block_nbytes))
        main.wait_stream(side)
        return int4_pool_triton.pool_down_triton(self._scratch, self.layout, h, looked_up, topk_weights,
                                                 out_dtype=x.dtype)

    def _looked_up(self, pool, x, topk_ids, topk_weights, table_row) -> torch.Tensor:
        """The pool kernels over `pool` with `table_row` [E] turning expert ids into its rows (-1: skipped); the
        Triton kernels look the ids up themselves (no gather launch)."""
        if self._pool_forward is pool_forward:
            return pool_forward(pool, self.layout, self.spec, x, table_row[topk_ids], topk_weights)
        return self._pool_forward(pool, self.layout, self.spec, x, topk_ids, topk_weights, slot_table=table_row)

    def _zero_copy_decode(self, layer, hidden, topk_ids, topk_weights) -> torch.Tensor:
        li = self.cache.layer_index[layer]
        if li == 0 and not (self.cuda and torch.cuda.is_current_stream_capturing()):
            # called eagerly: the first MoE layer's call is the step boundary (a replayed graph calls the hooks)
            self.begin_step()
            self.end_step()
        x = hidden if hidden.dtype == self.dtype else hidden.to(self.dtype)
        out = self._zero_copy_forward(li, x, topk_ids, topk_weights)
        return out if out.dtype == hidden.dtype else out.to(hidden.dtype)

    def begin_step(self) -> None:
        """Before a decode step is enqueued: publish promotions that have landed (their table writes go before
        the step), copy the previous step's routing log to the host and note the table this step will see."""
        if not self.zero_copy:
            return
        if self._dead:
            raise RuntimeError(self._dead)
        if self._promotions:
            self._finish_promotions()
        if len(self._log_copies) == LOG_COPIES:
            # the host ran LOG_COPIES steps ahead of the copies: wait for the oldest (a ring slot must be free)
            if self._log_copies[0][0] is not None:
                self._log_copies[0][0].synchronize()
            self._account_logs()
        slot = self._log_next
        self._log_next = (slot + 1) % LOG_COPIES
        self._log_hosts[slot].copy_(self._log, non_blocking=True)
        if self._box is not None:
            self._err_hosts[slot].copy_(self._box.error, non_blocking=True)
        self._log_copies.append((self._log_event(), slot, self._snapshot, self.cpu_share))
        self._log.fill_(-1)
        now = time.perf_counter()
        if self._share_control is not None and self._box is not None:
            if self._step_started is not None:
                share = self._share_control.observe(now - self._step_started)
                if share != self.cpu_share:
                    self._box.set_share(share)           # before this step's work on the stream
                    self.cpu_share = share
                if self.share_memory is not None:
                    self.share_memory.save_if_moved(self._share_control)   # a new best share outlives a crash
        self._step_started = now
        self._snapshot = self.cache.host_table.copy()

    def end_step(self) -> None:
        """After a decode step is enqueued (the GPU is busy with it): account the earlier steps' logs whose copies
        have landed, oldest first: counters, policy, routing statistics, and promotions within each step's byte
        budget."""
        if self.zero_copy:
            self._account_logs()

    def _log_event(self):
        """What marks a log copy as landed: the stream's event (None on a CPU device; tests stand in a slow one)."""
        return self._record()

    def _account_logs(self) -> None:
        while self._log_copies:
            done, slot, snapshot, share = self._log_copies[0]
            if done is not None and not done.query():
                return
            self._log_copies.popleft()
            self._account_log(self._log_hosts[slot].numpy(), self._err_hosts[slot], snapshot, share)

    def _account_log(self, ids: np.ndarray, err: torch.Tensor, snapshot: np.ndarray, share: float) -> None:
        """One step's log [L, T, K] (-1 unused) against the table it ran with, and the worker's error flag then."""
        if self._box is not None:
            lost = int(err[0]) or (self._worker is not None and self._worker.error is not None)
            if lost and self._host_only:
                # those layers' experts are where only the CPU reads them: without the worker nothing computes them
                self.close()
                self._dead = (f"the CPU expert worker stopped; {len(self._host_only)} of this model's "
                              f"{len(self.store.layers)} expert layers are in memory the GPU cannot read (the OS would "
                              "not page-lock more), so decoding cannot go on without it: reload the model")
                raise RuntimeError(self._dead)
            if int(err[0]):
                self.close()
                raise RuntimeError("the CPU expert worker did not answer the GPU in time; its share of misses "
                                   "goes back to the GPU (that step's output is wrong: retry the request)")
            if self._worker is not None and self._worker.error is not None:
                self.close()
        nb, budget = self.store.block_nbytes, self._promotion_budget.blocks
        dirc = self.cache.directory
        used_rows, evicted, promoted_before = [], [], len(self._promotions)
        host_only = set(self._host_only) if self._box is not None else set()
        for li, layer in enumerate(self.store.layers):
            row = ids[li]
            used = row >= 0
            if not used.any():
                continue
            uniq = self._distinct(row[used])                                # [U] distinct experts
            ready = snapshot[li, uniq] >= 0
            n_hits = int(np.count_nonzero(ready))
            dirc.record(layer, uniq, n_hits)
            self.routing.add_distinct(layer, uniq)
            used_rows.append((li, uniq))
            missed = uniq[~ready]
            n_cpu = 0
            layer_share = HOST_ONLY if li in host_only else share
            if layer_share > 0:    # the handoff's rule replayed per call (one call per step per layer)
                n_cpu = min(len(missed), cpu_share_counts(row[used.any(axis=1)], snapshot[li], layer_share,
                                                          unit=self._split_unit, inter=self.layout.intermediate)[0])
            self.counters.add_decode(int(used.any(axis=1).sum()), n_hits, len(missed), n_cpu, len(missed) - n_cpu,
                                     nb, 0.0)
            if li in host_only and len(missed):
                self.counters.add(host_only_misses=len(missed))
            if budget > 0 and len(missed) and self.options.slots:
                before = len(self._promotions)
                evicted += self._promote(layer, missed, budget_bytes=budget * nb)
                budget -= len(self._promotions) - before
        # this step's uses first: the experts promoted now were used now (that is why), which is no yield
        index = self.cache.layer_index
        self._promotion_budget.observe(used_rows)
        self._promotion_budget.promoted([(index[layer], e) for (layer, e), _, _ in self._promotions[promoted_before:]],
                                        [(index[layer], e) for layer, e in evicted])

    # ------------------------------------------------------------------ few tokens
    def _decode(self, layer, hidden, topk_ids, topk_weights) -> torch.Tensor:
        """Per call, in order: the device->host copies of ids, weights and hidden are enqueued, then the GPU's
        pass over the experts already in the pool (a device lookup: it needs nothing from the host, so it
        runs while the host waits for the ids and does its bookkeeping); the one sync; hits and misses from
        the host mirror of the slot table (numpy over the call's distinct experts, no per-key Python); the
        split; fetches (allocate, withdraw, copy, publish: a constant number of launches) and a second GPU
        pass over just the fetched experts; the CPU's share while the GPU runs, its result back through
        page-locked memory without a sync; promotions; the split controller."""
        cache = self.cache
        li = cache.layer_index[layer]
        if cache.resident[li] == cache.num_experts:
            return self._resident(layer, hidden, topk_ids, topk_weights)
        t0 = time.perf_counter()
        self._start_to_host(hidden, topk_ids, topk_weights)
        # GPU pass 1: whatever this call's experts have in the pool now (-1 slots are skipped by the kernels)
        slots_now = cache.device_slots(layer, topk_ids) if cache.resident[li] else None     # [T, K]
        out = self._gpu_forward(hidden, slots_now, topk_weights) if slots_now is not None else None
        t_wait = time.perf_counter()
        ids_h, w_h, x_h = self._finish_to_host(hidden, topk_ids, topk_weights)   # [T, K], [T, K], [T, D]: the sync
        t_book = time.perf_counter()
        uniq = self._distinct(ids_h)                                        # [U] sorted distinct experts
        published = cache.host_table[li]                                    # [E] slot or -1
        ready = published[uniq] >= 0                                        # [U] hits
        n_hits = int(np.count_nonzero(ready))
        dirc = cache.directory
        dirc.record(layer, uniq, n_hits)
        self.routing.add_distinct(layer, uniq)
        if self.prefetcher is not None:
            self.prefetcher.observe(layer, uniq.tolist())
        missed = uniq[~ready] if n_hits < len(uniq) else uniq[:0]            # [M]
        fetch_keys: list[Key] = []
        t_fetch = time.perf_counter()
        auto = False
        if len(missed) and self.options.slots and layer not in self._cpu_misses:
            # a promotion still in flight is a miss that runs on the CPU this time (never fetched twice)
            candidates = missed if not cache.pending else \
                np.array([e for e in missed.tolist() if (layer, e) not in cache.pending], dtype=np.int64)
            auto = self.options.split == "auto"
            if auto:
                self.split.choose()
            else:
                self.split.mode = self.options.split
            n_fetch = self.split.split(len(candidates))
            t_fetch = time.perf_counter()
            if n_fetch:
                if n_fetch < len(candidates):      # fetch the misses most worth keeping; the rest run on the CPU
                    order = np.argsort(-dirc.policy.scores(layer, candidates), kind="stable")
                    candidates = candidates[order]
                fetch_keys = self._fetch(layer, uniq, candidates[:n_fetch].tolist())
        n_fetch = len(fetch_keys)
        n_cpu = len(missed) - n_fetch
        t_fetched = time.perf_counter()
        if n_fetch:
            # GPU pass 2, enqueued before the CPU starts: only the experts this call fetched (pass 1 did the rest)
            slots_new = cache.device_slots(layer, topk_ids)
            if slots_now is not None:
                slots_new = torch.where(slots_now >= 0, -1, slots_new)
            fetched_out = self._gpu_forward(hidden, slots_new, topk_weights)
            out = fetched_out if out is None else out.add_(fetched_out)
        cpu_s = upload_s = promote_s = 0.0
        if n_cpu:
            # CPU: the assignments whose expert is still unpublished (misses not fetched, in-flight promotions)
            tok, kk = np.nonzero(published[ids_h] < 0)                          # [A]
            cpu_ids = ids_h[tok, kk]
            c0 = time.perf_counter()
            cpu_out = self.cpu.run(layer, x_h, tok, cpu_ids, w_h[tok, kk], **self._host_kernel_threads())  # [T, D]
            cpu_s = time.perf_counter() - c0
            back = self._upload(cpu_out) if self._staged_io else cpu_out.to(self.dtype)
            upload_s = time.perf_counter() - c0 - cpu_s
            # `back` lives in a reusable buffer: a CPU-only call returns a copy; otherwise the pool kernels'
            # fresh output takes the sum in place (no further allocation)
            out = back.to(hidden.dtype, copy=True) if out is None else out.add_(back)
            if self._promote_blocks and self.options.slots:
                p0 = time.perf_counter()
                self._promote(layer, missed[published[missed] < 0] if n_fetch else missed)   # [n_cpu] sorted
                promote_s = time.perf_counter() - p0
        if out is None:                          # no tokens
            out = torch.zeros_like(hidden, dtype=self.dtype)
        nb = self.store.block_nbytes
        self.counters.add_decode(hidden.shape[0], n_hits, len(missed), n_cpu, n_fetch, nb, cpu_s)
        if self.prefetcher is not None and self.options.slots:
            nxt, predicted = self.prefetcher.predict(layer, hidden)
            if nxt is not None and predicted:
                self._promote(nxt, np.asarray(predicted, dtype=np.int64),
                              budget_bytes=self.options.prefetch_bytes_per_call, admit_all=True)
        now = time.perf_counter()
        self.counters.add_decode_times(t_book - t_wait, t_fetch - t_book, t_fetched - t_fetch, upload_s, now - t0,
                                       promote_s)
        if auto:
            # wall time of this call, no device sync: the GPU part overlaps the CPU part and the next
            # call's id transfer waits for it anyway, so a slow GPU shows up in the next call's time
            self.split.observe(step_seconds=now - t0, cpu_bytes=n_cpu * nb, cpu_seconds=cpu_s,
                               pcie_bytes=n_fetch * nb,
                               pcie_seconds=(now - t0 - cpu_s) if n_fetch and not n_cpu else 0.0)
        return out if out.dtype == hidden.dtype else out.to(hidden.dtype)

    def _distinct(self, ids: np.ndarray) -> np.ndarray:
        """The sorted distinct experts [U] int64 among `ids` (any shape), through the [E] scratch (left all False)."""
        seen = self._seen
        seen[ids] = True
        uniq = np.flatnonzero(seen)
        seen[uniq] = False
        return uniq

    def _host_kernel_threads(self) -> dict:
        """The host-driven path's kernel threads (as `CpuExecutor.run`'s keyword), where its default - every core,
        or the user's count - would fight another thread: the cores the worker's lanes leave, or, beside a staging
        ring whose thread copies pageable blocks (promotions) while the kernel runs, every core but one: a parallel
        region waits for its slowest thread, and one sharing its core stalls it for whole time slices
        (benchmarks/bench_kernel_beside_copy.py, dev VM: a call's mean 1,926 µs on both cores beside the copy
        against 992 on one; s26b's GPU host: ~180-250 µs an expert against ~30 in the kernel's probe)."""
        if self._worker is not None:
            return {"threads": self._host_threads}
        if self.transport.ring is not None and not self.cpu.threads:
            return {"threads": max(1, (os.cpu_count() or 1) - 1)}
        return {}

    def _fetch(self, layer: int, uniq: np.ndarray, experts: list[int]) -> list[Key]:
        """Allocate slots for `experts` (evicting by policy; never this call's experts nor an in-flight
        promotion), copy their blocks on the copy stream and publish them once landed. Returns what was
        fetched (fewer when every slot is pinned or protected)."""
        cache, dirc = self.cache, self.cache.directory
        protected = _CallExperts(layer, uniq, cache.num_experts, cache.pending)
        keys, slots, evicted = [], [], []
        for e in experts:
            key = (layer, e)
            got = dirc.allocate(key, protected=protected)
            if got is None:                      # every slot pinned or protected: the rest run on the CPU
                break
            keys.append(key)
            slots.append(got[0])
            if got[1] is not None:
                evicted.append(got[1])
        if keys:
            cache.withdraw_many(evicted)         # before the copy may overwrite their slots
            layer_blocks = self.store.layer_buffer(layer)
            done = self.transport.submit([(layer_blocks[k[1]], cache.pool[s]) for k, s in zip(keys, slots)],
                                         after=self._record())
            self._wait(done)
            cache.publish_many(keys, slots)
        return keys

    def _resident(self, layer, hidden, topk_ids, topk_weights) -> torch.Tensor:
        """A layer whose experts are all in the pool: device lookup and compute, no host sync at all (so the
        host runs ahead and the GPU stays busy). Counted without reading the ids: a single token's K experts
        are K distinct hits; for several tokens the T*K assignments are counted (an upper bound on distinct)."""
        slots = self.cache.device_slots(layer, topk_ids)
        n = topk_ids.numel()
        self.counters.add_decode(hidden.shape[0], n, 0, 0, 0, 0, 0.0)
        self.cache.directory.counters.hits += n
        out = self._gpu_forward(hidden, slots, topk_weights)
        return out if out.dtype == hidden.dtype else out.to(hidden.dtype)

    # ------------------------------------------------------------------ host <-> device staging (decode)
    def _start_to_host(self, hidden, topk_ids, topk_weights) -> None:
        """Enqueue the one device->host transfer: three non-blocking copies into reusable page-locked buffers
        and an event (`_finish_to_host` waits on it: the only host sync of a decode call). Hidden and weights
        come along although only misses need them, because a second transfer would be a second sync. The
        buffers are overwritten by the next call's copies, which the stream orders after this call's."""
        if not self._staged_io:
            return
        self._host_buffer("ids", topk_ids.shape, topk_ids.dtype).copy_(topk_ids, non_blocking=True)
        self._host_buffer("weights", topk_weights.shape, topk_weights.dtype).copy_(topk_weights, non_blocking=True)
        self._host_buffer("hidden", hidden.shape, hidden.dtype).copy_(hidden, non_blocking=True)
        self._d2h_done.record(torch.cuda.current_stream(self.device) if self.cuda else None)

    def _finish_to_host(self, hidden, topk_ids, topk_weights) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """ids [T, K] int64 and weights [T, K] float32 as numpy, hidden [T, D] as a host tensor (its dtype)."""
        if not self._staged_io:
            ids = topk_ids if topk_ids.dtype == torch.int64 else topk_ids.to(torch.int64)
            w = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
            return ids.numpy(), w.numpy(), hidden
        self._d2h_done.synchronize()
        ids_b = self._host_buffer("ids", topk_ids.shape, topk_ids.dtype)
        w_b = self._host_buffer("weights", topk_weights.shape, topk_weights.dtype)
        ids = ids_b.numpy() if ids_b.dtype == torch.int64 else ids_b.to(torch.int64).numpy()
        w = w_b.numpy() if w_b.dtype == torch.float32 else w_b.float().numpy()
        return ids, w, self._host_buffer("hidden", hidden.shape, hidden.dtype)

    def _upload(self, cpu_out: torch.Tensor) -> torch.Tensor:
        """The CPU's result [T, D] float32 -> a device tensor [T, D] (self.dtype), through a reusable
        page-locked buffer and a non-blocking copy (a pageable source would make the copy synchronous). The
        returned view lives in a reusable device buffer: the caller consumes it in this call."""
        # the last upload out of this buffer: already done (this call's id transfer came after it on the
        # stream), so this returns at once; it only guards a caller that switched streams between calls
        self._h2d_done.synchronize()
        pin = self._host_buffer("result", cpu_out.shape, self.dtype)
        pin.copy_(cpu_out)                       # float32 -> compute dtype on the CPU
        dev = self._device_buffer("result", cpu_out.shape, self.dtype)
        dev.copy_(pin, non_blocking=True)
        self._h2d_done.record(torch.cuda.current_stream(self.device) if self.cuda else None)
        return dev

    def _host_buffer(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """A page-locked [rows, ...] buffer reused across calls, viewed at `shape` (grown when rows exceed)."""
        return _reused(self._pinned, name, shape, dtype, pin_memory=self.cuda)

    def _device_buffer(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        return _reused(self._on_device, name, shape, dtype, device=self.device)

    def _gpu_forward(self, hidden, slots, topk_weights) -> torch.Tensor:
        try:
            return self._pool_forward(self.cache.pool, self.layout, self.spec,
                                      hidden if hidden.dtype == self.dtype else hidden.to(self.dtype), slots, topk_weights)
        except Exception as exc:     # noqa: BLE001  (a Triton compile/launch failure: say so, keep serving)
            if self._pool_forward is pool_forward:
                raise
            log.warning("Triton expert kernel failed (%s); using the torch path from now on", exc)
            self._pool_forward = pool_forward
            return self._gpu_forward(hidden, slots, topk_weights)

    # ------------------------------------------------------------------ many tokens
    def _streamed(self, layer, hidden, topk_ids, topk_weights) -> torch.Tensor:
        e = self.store.num_experts
        if self._stage is None:
            self._stage = torch.empty((2, e, self.store.block_nbytes), dtype=torch.uint8, device=self.device)
        buf_idx, ready, k = self._staged.pop(layer, (None, None, e))
        if buf_idx is None:
            k = self._stream_prefix(hidden.shape[0])
            buf_idx = self._free_buffer()
            ready = self._copy_layer(layer, buf_idx, k)
        # double buffering: the next layer's experts cross PCIe while this layer computes (its call most likely
        # carries this chunk's tokens: its prefix is chosen for them)
        nxt = self._next_layer(layer)
        if nxt is not None and nxt not in self._staged:
            other, k_next = 1 - buf_idx, self._stream_prefix(hidden.shape[0])
            self._staged[nxt] = (other, self._copy_layer(nxt, other, k_next), k_next)
        if k < e:
            return self._streamed_split(layer, hidden, topk_ids, topk_weights, buf_idx, ready, k)
        t0 = time.perf_counter()
        self._wait(ready)               # (a staged layer: blocks until the ring's thread has shipped it)
        self.stream_wait_s += time.perf_counter() - t0
        self.routing.add(layer, [int(e) for e in torch.unique(topk_ids).tolist()])
        out = pool_forward_grouped(self._stage[buf_idx], self.layout, self.spec, hidden.to(self.dtype), topk_ids,
                                   topk_weights)
        self._stage_free[buf_idx] = self._record()
        e = self.store.num_experts
        self.counters.add(stream_calls=1, gpu_experts=e, bytes_h2d=e * self.store.block_nbytes,
                       bytes_streamed=e * self.store.block_nbytes)
        return out.to(hidden.dtype)

    def _streamed_split(self, layer, hidden, topk_ids, topk_weights, buf_idx, ready, k) -> torch.Tensor:
        """A mid-size call: experts [0, k) were copied (or are crossing now) into the stage; the CPU computes the
        assignments to the others beside that copy and the next layer's, then the GPU the prefix's over the stage.
        The CPU goes first because the grouped pass reads its slot list on the host (a sync): before the CPU, it
        would hold the CPU's work back until this layer's copy had landed."""
        self._start_to_host(hidden, topk_ids, topk_weights)
        ids_h, w_h, x_h = self._finish_to_host(hidden, topk_ids, topk_weights)    # [T, K], [T, K], [T, D]: a sync
        uniq = self._distinct(ids_h)                                              # [U] sorted distinct experts
        self.routing.add_distinct(layer, uniq)
        tok, kk = np.nonzero(ids_h >= k)                                          # [A] the CPU's assignments
        c0 = time.perf_counter()
        cpu_out = self.cpu.run(layer, x_h, tok, ids_h[tok, kk], w_h[tok, kk], **self._split_kernel_threads())
        cpu_s = time.perf_counter() - c0
        if len(tok):           # learned from the model's figure on (one slow first call moves it 30 %, not all the way)
            self._cpu_assignment_s = (1 - CPU_COST_MEMORY) * self._assignment_s() + CPU_COST_MEMORY * cpu_s / len(tok)
        t0 = time.perf_counter()
        self._wait(ready)
        self.stream_wait_s += time.perf_counter() - t0
        slots = torch.where(topk_ids < k, topk_ids, -1)                           # [T, K] (-1: the CPU's)
        out = pool_forward_grouped(self._stage[buf_idx], self.layout, self.spec, hidden.to(self.dtype), slots,
                                   topk_weights)
        self._stage_free[buf_idx] = self._record()
        back = self._upload(cpu_out) if self._staged_io else cpu_out.to(self.dtype)
        out = out.add_(back)
        n_cpu, nb = int(np.count_nonzero(uniq >= k)), self.store.block_nbytes
        self.counters.add(stream_calls=1, gpu_experts=k, cpu_experts=n_cpu, bytes_h2d=k * nb, bytes_streamed=k * nb,
                          bytes_cpu_read=n_cpu * nb, cpu_seconds=cpu_s)
        return out.to(hidden.dtype)

    def _stream_prefix(self, t: int) -> int:
        """How many of a layer's experts a streamed call of `t` tokens copies: a prefix [0, k), one range copy.
        With the split on, k balances the copy (k blocks at the link's rate) against the CPU's part (the
        assignments to the other E - k experts, t x K x (E - k) / E of them under uniform routing, at the cost
        per assignment the CPU's earlier split calls took, modelled before any). At the stream threshold that
        halves a layer's time; a long chunk leaves the CPU almost nothing, and under 1/STREAM_SPLIT_MIN_PART of
        the experts it gets none (the whole layer streams, as without the split)."""
        e = self.store.num_experts
        if not self.stream_split:
            return e
        copy_s = self.store.block_nbytes / (max(self.options.h2d_gbps, 1e-3) * 1e9)     # one expert over the link
        cpu_s = t * self.options.top_k / e * self._assignment_s()                   # one expert's share on the CPU
        k = math.ceil(e * cpu_s / (copy_s + cpu_s))
        return e if e - k < max(1, e // STREAM_SPLIT_MIN_PART) else k

    def _assignment_s(self) -> float:
        """The CPU's seconds per (token, expert) assignment of a split stream: learned, or modelled before any
        (6 D I flops at CPU_EXPERT_FLOPS, as `stream_threshold_tokens` prices it, for the threads it gets: beside
        the zero-copy worker's lanes the host-driven kernel gets the cores they leave - one on a 16-core host)."""
        if self._cpu_assignment_s:
            return self._cpu_assignment_s
        flops = CPU_EXPERT_FLOPS * self._split_cpu_threads() / CPU_EXPERT_FLOPS_THREADS
        return 6 * self.layout.hidden * self.layout.intermediate / flops

    def _split_kernel_threads(self) -> dict:
        """The split's CPU kernel threads, as `CpuExecutor.run`'s keyword: FREETOKEN_STREAM_SPLIT_THREADS, else the
        host-driven path's."""
        return {"threads": self._split_threads} if self._split_threads else self._host_kernel_threads()

    def _split_cpu_threads(self) -> int:
        return self._split_kernel_threads().get("threads") or self.cpu.threads or os.cpu_count() or 1

    def _copy_layer(self, layer: int, buf_idx: int, k: int):
        """Copy experts [0, k) of `layer` into stage buffer `buf_idx` (one range copy)."""
        # whatever was staged in this buffer is about to be overwritten: forget it
        for staged in [s for s, (i, _, _) in self._staged.items() if i == buf_idx]:
            del self._staged[staged]
        if k == 0:
            return None                  # nothing to copy (the CPU takes the whole layer)
        return self.transport.submit_range(self.store.layer_buffer(layer)[:k], self._stage[buf_idx][:k],
                                           after=self._stage_free[buf_idx])

    def _free_buffer(self) -> int:
        used = {i for i, _, _ in self._staged.values()}
        return 0 if 0 not in used else 1

    def _next_layer(self, layer: int) -> int | None:
        i = self.cache.layer_index[layer] + 1
        if i < len(self.store.layers):
            return self.store.layers[i]
        return self.store.layers[0] if self.prefill_continues else None

    # ------------------------------------------------------------------ promotion (off the critical path)
    def _promote(self, layer: int, experts: np.ndarray, *, budget_bytes: int | None = None,
                 admit_all: bool = False) -> list[Key]:
        """Copy `layer`'s experts most worth caching into the pool on the copy stream; they are published
        (become hits) only once their bytes have landed (`_finish_promotions`). `admit_all` (prefetch) skips
        the rule that a newcomer must have been used more than the expert it replaces. Returns the experts
        evicted for them."""
        budget = self._promote_blocks if budget_bytes is None else budget_bytes // max(1, self.store.block_nbytes)
        if not self.options.slots or not len(experts) or budget <= 0:
            return []
        cache, dirc = self.cache, self.cache.directory
        policy = dirc.policy
        scores = policy.scores(layer, experts)
        picked = experts[np.argsort(-scores, kind="stable")[:budget]] if len(experts) > 1 else experts
        started, evicted = [], []
        for e in picked.tolist():
            key = (layer, e)
            if key in dirc.slot_of:
                continue
            if not dirc.free:
                # admission: replace a cached expert only with one used more than it
                victim = policy.victim(dirc.slot_of.keys(), cache.pending)
                if victim is None or (not admit_all and policy.score(victim) >= policy.score(key)):
                    continue
            got = dirc.allocate(key, protected=cache.pending)
            if got is None:
                continue
            if got[1] is not None:
                evicted.append(got[1])
            cache.pending.add(key)
            started.append((key, got[0]))
        if started:
            cache.withdraw_many(evicted)
            blocks = self.store.layer_buffer(layer)
            done = self.transport.submit([(blocks[k[1]], cache.pool[s]) for k, s in started], after=self._record())
            self._promotions += [(key, slot, done) for key, slot in started]
            self.counters.add(promoted_experts=len(started), bytes_h2d=len(started) * self.store.block_nbytes)
        return evicted

    def _finish_promotions(self) -> None:
        still, landed, slots = [], [], []
        slot_of = self.cache.directory.slot_of
        for key, slot, done in self._promotions:
            try:
                arrived = done is None or done.query()
            except Exception as exc:     # noqa: BLE001  (staged on the ring's thread, it failed there)
                # dropped, not retried: its slot goes back to the free list and the expert stays a miss; raising
                # here would fail this call and every later one (the handle keeps its exception)
                log.warning("copying expert %d of layer %d into VRAM failed (%s); it keeps running from host memory",
                            key[1], key[0], exc)
                self.cache.pending.discard(key)
                if slot_of.get(key) == slot:
                    self.cache.directory.release(key)
                continue
            if arrived:
                if slot_of.get(key) == slot:
                    landed.append(key)
                    slots.append(slot)
                self.cache.pending.discard(key)
            else:
                still.append((key, slot, done))
        self.cache.publish_many(landed, slots)
        self._promotions = still

    def _warm_hot_set(self) -> None:
        """Load the pinned hot set (from earlier runs' routing statistics) so the cache starts warm. When it is every
        expert (the plan put them all in VRAM), slot i is block i of the file and the pool fills in large chunks
        straight from the file (`HostExpertStore.copy_to_device`: parallel reads, no mapped page touched)."""
        copies, keys, slots = [], [], []
        for key in sorted(self.cache.directory.pinned):          # file order: every expert -> slot = block index
            if key[0] not in self.cache.layer_index or not 0 <= key[1] < self.store.num_experts:
                continue
            got = self.cache.directory.allocate(key)
            if got is None:
                break
            keys.append(key)
            slots.append(got[0])
        if len(keys) == self.store.n_blocks == self.cache.pool.shape[0] \
                and slots == list(range(len(keys))):
            try:
                self.store.copy_to_device(self.cache.pool, stream=self.transport.stream)
            except RuntimeError as exc:      # a CUDA failure on the bulk path: the block-by-block one still works
                log.warning("bulk expert load failed (%s); copying block by block", exc)
            else:
                self.cache.publish_many(keys, slots)
                return
        copies = [(self.store.block(*key), self.cache.slot_view(slot)) for key, slot in zip(keys, slots)]
        if copies:
            self._wait(self.transport.submit(copies))
            self.cache.publish_many(keys, slots)

    def _fill_free_slots(self) -> None:
        """An empty slot serves nobody: fill what the pinned hot set left free before the first token, with the
        experts routing statistics rank next (earlier runs), then spread evenly over the layers (expert j of
        every layer before expert j + 1 of any). Unpinned: the policy evicts them as traffic shows what is hot.
        Before this, a zero-copy pool filled only through promotions (a budget per step), so a 30-token run
        saw 1 % hits where the pool could hold a quarter of the experts."""
        dirc = self.cache.directory
        n = len(dirc.free)
        if not n:
            return
        chosen: list[Key] = []
        taken = set(dirc.slot_of)
        for key in self.routing.hot_set(len(taken) + n):
            if len(chosen) < n and key not in taken and key[0] in self.cache.layer_index:
                chosen.append(key)
                taken.add(key)
        for e in range(self.store.num_experts):
            if len(chosen) >= n:
                break
            for layer in self.store.layers:
                if len(chosen) < n and (layer, e) not in taken:
                    chosen.append((layer, e))
        copies, keys, slots = [], [], []
        for key in chosen:
            got = dirc.allocate(key)
            if got is None:
                break
            copies.append((self.store.block(*key), self.cache.slot_view(got[0])))
            keys.append(key)
            slots.append(got[0])
        for i in range(0, len(copies), 256):         # bounded batches: the copy list, not the bytes, costs host time
            self._wait(self.transport.submit(copies[i:i + 256]))
        self.cache.publish_many(keys, slots)

    # ------------------------------------------------------------------ streams
    def _record(self):
        return torch.cuda.current_stream(self.device).record_event() if self.cuda else None

    def _wait(self, event) -> None:
        event = ready_event(event)          # a layer staged from a pageable store: its staging done first
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    # ------------------------------------------------------------------ what the engine and UI read
    def flush_step_log(self) -> None:
        """Account a pending routing log now (tests and reports; waits for its copy)."""
        if self.zero_copy:
            for done, *_ in self._log_copies:
                if done is not None:
                    done.synchronize()
            self._account_logs()

    @property
    def nbytes(self) -> int:
        scratch = getattr(self, "_scratch", None)
        return self.cache.nbytes + sum(0 if b is None else b.numel() for b in (self._stage, scratch))

    def plan(self) -> dict:
        """What the engine's plan carries under "experts" (and the planner's own plan, when it made this)."""
        return {"backend": self.backend, "slots": self.options.slots, "planner": getattr(self, "planned", None),
                "slot_total": self.store.n_blocks, "pool_bytes": self.cache.pool.numel(),
                "policy": self.options.policy, "hot_set": len(self.cache.directory.pinned),
                "stream_threshold_tokens": self.stream_threshold, "codec": self.layout.codec,
                # the layers a GPU reads in place (page-locked) of all of them: fewer where the pinnable share was short
                "pinned_layers": len(self.transport.pinned_layers), "layers": len(self.store.layers)}

    def stats_dict(self) -> dict:
        d = self.counters.to_dict(pools={"expert_pool": self.cache.pool.numel(),
                                      "stream_buffers": 0 if self._stage is None else self._stage.numel()})
        d["split"] = {"mode": self.split.mode, "cpu_gbps": round(self.split.cpu_gbps, 2),
                      "pcie_gbps": round(self.split.pcie_gbps, 2)}
        d["stream_split"] = {"on": self.stream_split, "cpu_assignment_us": None if self._cpu_assignment_s is None
                             else round(self._cpu_assignment_s * 1e6, 3)}
        if self.zero_copy:
            d["zero_copy"] = {"cpu_share": round(self.cpu_share, 3), "learned": self._share_control is not None,
                              "worker_calls": 0 if self._worker is None else self._worker.requests,
                              "worker_seconds": 0.0 if self._worker is None else round(self._worker.busy_seconds, 4),
                              "promote_blocks_per_step": self._promotion_budget.blocks,
                              "host_only_layers": len(self._host_only)}
        if self.transport.ring is not None:
            t = dict(self.transport.ring.timing)
            d["staging"] = {**t, **{k: round(v, 4) for k, v in t.items() if k.endswith("_s")},
                            "caller_wait_s": round(self.stream_wait_s, 4)}
        if self.prefetcher is not None:
            c = self.prefetcher.counters
            d["prefetch"] = {"predicted": c.predicted, "precision": round(c.precision, 4), "recall": round(c.recall, 4)}
        return d

    def stats(self) -> dict:
        """What the engine's stats() carries under "experts"."""
        return self.stats_dict()

    @property
    def share_controller(self) -> ShareController | None:
        """The learned CPU share's controller (zero-copy with a CPU kernel and no fixed share), else None."""
        return getattr(self, "_share_control", None)

    def save_routing(self, path: Path) -> None:
        """The routing statistics to `path`, and the learned CPU share where it is remembered."""
        self.routing.save(path)
        if self.share_controller is not None and self.share_memory is not None:
            self.share_memory.save(self.share_controller)


# the load-progress stage of the CPU kernels' compile (a minute at a machine's first hybrid load)
KERNELS_STAGE = "CPU expert kernels (compiled on the first load: about a minute)"


def hybrid_experts_factory(package, spec: ExpertSpec, *, device, dtype, vram_budget: int | None = None,
                           cpu_experts_per_layer: int | None = None, progress=None, context_length: int = 8192,
                           max_sequences: int = 1, hardware=None, slots: int | None = None, policy: str = "lru",
                           routing_stats_path: Path | None = None, prefetch: bool = False,
                           dense_bytes_on_device: int = 0, zero_copy: bool | None = None,
                           cpu_share: float | None = None, stage_progress=None, **_unused):
    """The engine's seam (runtime/engine.py `experts_factory`): plan, then build the tier the plan asks for.

    "gpu" -> every expert resident on the device (resident.py); "hybrid"/"cpu" -> HybridExperts with the
    planned slot count (`slots` overrides it, e.g. a CPU-device pool in tests). Routing statistics saved by
    earlier runs at `routing_stats_path` seed the pinned hot set, so the cache starts warm; beside them
    (`policy.share_state_path`) the learned CPU share of zero-copy decode is remembered per model, VRAM budget,
    slot count and machine, so a learned share (`cpu_share=None`) starts where the last load of it ended.
    `dense_bytes_on_device`: what the engine already placed on the GPU (the plan counts it itself).
    `stage_progress(name)`: the load's progress for a stage of its own (KERNELS_STAGE, while the CPU kernels
    compile or load from numba's cache - a minute the first time, which must not look like a hang)."""
    from runtime.experts.planner import Hardware, ModelShape, plan_memory
    from runtime.experts.resident import ResidentExperts

    device = torch.device(device)
    store = HostExpertStore.from_ftw(package.experts)
    shape = ModelShape.from_config(package.config, codec=store.codec if store.codec != "f32" else "bf16",
                                   group_size=store.layout.group or 64, block_size=store.layout.group or 32,
                                   block_nbytes=store.block_nbytes)
    if dense_bytes_on_device:            # what the dense weights really take (int8 projections: half the estimate)
        shape = dataclasses.replace(shape, dense_nbytes=int(dense_bytes_on_device))
    hw = hardware or Hardware.probe(device=device.type, measure=device.type == "cuda",
                                    counted_in_plan=dense_bytes_on_device)
    plan = plan_memory(shape, hw, context_length=context_length, max_sequences=max_sequences,
                       vram_budget=vram_budget, cpu_experts_per_layer=cpu_experts_per_layer)
    for line in plan.summary_lines():
        log.info("plan: %s", line)
    if plan.backend == "does_not_fit":
        raise MemoryError("; ".join(plan.summary_lines()))
    hot_all: tuple[Key, ...] = ()
    if plan.backend == "gpu" and slots is None and not store.layout.quantized:
        experts = ResidentExperts.from_store(package.experts, spec, device=device, dtype=dtype, progress=progress)
        experts.plan = plan.to_dict()
        return experts
    if plan.backend == "gpu" and slots is None:
        # quantized experts stay packed in a pool that holds them all (the plan counted packed bytes;
        # dequantizing to bf16 would need ~4x the VRAM it reserved): every layer is resident, sync-free
        slots = store.n_blocks
        hot_all = tuple((layer, e) for layer in store.layers for e in range(store.num_experts))
    part = plan.experts_pinned_layers if not plan.experts_pinned else 0
    pin_copy = bool(plan.experts_pinned or part) and device.type == "cuda" and not hot_all   # all in VRAM: no copy
    if pin_copy:
        # (in part: the first layers, as many as fit the pinnable share; the rest stay mapped from the file)
        store = store.pinned_copy(layers=store.layers[:part] if part else None)
        ls = store.load_seconds
        copied = part or len(store.layers)
        log.info("experts: %.2f GB (%s) copied into host memory in %.2f s (%s, %d threads; pinning %.2f s): %s",
                 copied * store.num_experts * store.block_nbytes / 1e9,
                 f"{part} of {len(store.layers)} layers" if part else "all layers",
                 ls["allocate"] + ls["copy"] + ls["pin"], ls["method"], ls["threads"], ls["pin"],
                 "page-locked" if ls["pinned"] else f"{ls['pinned_layers']} of those layers page-locked (the OS "
                 "refused more)")
    n_slots = plan.expert_slots if slots is None else slots
    stats = RoutingStats()
    if routing_stats_path:
        try:
            stats = RoutingStats.load(Path(routing_stats_path))
        except ValueError as exc:        # learned statistics, not the user's data: start cold, overwrite later
            log.warning("%s; the expert cache starts cold", exc)
    # the layers the GPU reads in place: those the OS locked where a copy was pinned (all, or a plan's part - the OS
    # may lock fewer), a plan's part on a CPU device (tests); a store no layer of which could be locked decodes
    # host-driven (no layer is costlier than another there)
    readable = store.pinned_layers if pin_copy else frozenset(store.layers[:part] if part else store.layers)
    cpu_gbps, h2d_gbps = hw.cpu_gbps or 20.0, hw.h2d_gbps or 20.0      # (unprobed: a guess that splits evenly)
    hot, pool_lines = _pool_hot_set(store, stats, n_slots, readable=readable, cpu_gbps=cpu_gbps, h2d_gbps=h2d_gbps)
    if hot_all:
        hot, pool_lines = hot_all, []
    options = HybridOptions(slots=n_slots, policy=policy, hot_set=hot, cpu_gbps=cpu_gbps,
                            h2d_gbps=h2d_gbps, top_k=shape.top_k, zero_copy=zero_copy,
                            cpu_share=cpu_share,
                            # no room was planned for the stream buffers: prompts' experts stay on the CPU
                            stream_threshold=None if plan.prefill_streaming else NEVER_STREAM)
    prefetcher = None
    if prefetch:
        from runtime.experts.prefetch import NextLayerPrefetcher
        prefetcher = NextLayerPrefetcher.from_package(package, store.layers, top_k=shape.top_k, device=device)
        if prefetcher is None:
            log.warning("next-layer prefetch is off: this package's router weights were not found")
    memory = None
    if routing_stats_path and cpu_share is None:
        # the learned CPU share is remembered beside the routing statistics, for this model, budget and machine
        memory = ShareMemory(share_state_path(Path(routing_stats_path)), vram_budget=vram_budget,
                             model=model_fingerprint(getattr(package, "model_type", ""), dict(package.config),
                                                     {"codec": store.codec, "block_nbytes": store.block_nbytes,
                                                      "layers": list(store.layers), "experts": store.num_experts}),
                             machine=f"{cpu_model_name()} | {hw.gpu_name or device.type}")
    # misses run on the CPU: the tier compiles its kernels as it is built
    kernels = stage_progress(KERNELS_STAGE) if stage_progress and n_slots < store.n_blocks else None
    if kernels:
        kernels(0, 1)
    experts = _build_hybrid(store, spec, device=device, dtype=dtype, options=options, routing=stats,
                            prefetcher=prefetcher, share_memory=memory)
    if kernels:
        kernels(1, 1)
    experts.planned = {**plan.to_dict(), "summary_lines": plan.summary_lines() + pool_lines}   # (the app shows them)
    if progress:
        progress(1, 1)
    return experts


def _pool_hot_set(store, stats: RoutingStats, slots: int, *, readable, cpu_gbps: float,
                  h2d_gbps: float) -> tuple[tuple[Key, ...], list[str]]:
    """The VRAM pool's pinned hot set, and what the console should say of it. A store whose every layer the GPU
    reads in place (or none of them): half the pool from earlier runs' statistics, half adaptive. A store pinned in
    part: `costly_hot_set`, said in a line."""
    costly = [layer for layer in store.layers if layer not in readable]
    if not costly or len(costly) == len(store.layers):
        return tuple(stats.hot_set(min(slots, len(stats.counts)) // 2)), []
    hot = costly_hot_set(stats, slots, layers=store.layers, costly=costly, num_experts=store.num_experts,
                         cpu_gbps=cpu_gbps, h2d_gbps=h2d_gbps)
    unread = frozenset(costly)
    line = (f"expert slots: {sum(1 for layer, _ in hot if layer in unread):,} of {slots:,} hold the experts of the "
            f"{len(costly)} layers not in pinned RAM (their misses would run on the CPU alone)")
    log.info("plan: %s", line)
    return hot, [line]


COSTLY_HOT_SHARE = 0.75     # of a partly pinned store's pool: pinned to what its misses would cost most; the rest adapts


def costly_hot_set(stats: RoutingStats, slots: int, *, layers, costly, num_experts: int, cpu_gbps: float,
                   h2d_gbps: float) -> tuple[Key, ...]:
    """The pinned hot set of a store pinned in part. Every miss of a layer the GPU cannot read (`costly`) runs on
    the CPU kernel alone; a miss elsewhere is split between the kernel and the link, so it costs
    cpu / (cpu + h2d) as much. Caching a key saves its use rate times that cost, so most of the pool
    (COSTLY_HOT_SHARE) is pinned to the keys worth most by that product (`RoutingStats.weighted_hot_set`): under
    uniform routing whole costly layers, which then never wait for the CPU (session 27's arithmetic for qwen3-30b
    with 36 of 48 layers pinned: ~13 % less expert time a token than a pool spread evenly, within 2 % of the
    fully pinned store's); the rest of the pool adapts to what traffic shows."""
    weight = (cpu_gbps + h2d_gbps) / cpu_gbps
    return tuple(stats.weighted_hot_set(int(slots * COSTLY_HOT_SHARE), layers=layers, num_experts=num_experts,
                                        weight={layer: weight for layer in costly}))


def _build_hybrid(store, spec, *, device, dtype, options, routing, prefetcher=None, share_memory=None):
    """Build, shrinking the pool when the device runs out of memory (and saying so) instead of failing."""
    slots = options.slots
    while True:
        try:
            return HybridExperts(store, spec, device=device, dtype=dtype,
                                 options=HybridOptions(**{**options.__dict__, "slots": slots}), routing_stats=routing,
                                 prefetcher=prefetcher, share_memory=share_memory)
        except torch.OutOfMemoryError:
            if slots == 0:
                raise
            smaller = slots * 3 // 4
            log.warning("CUDA out of memory with %d expert slots: retrying with %d", slots, smaller)
            slots = smaller
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _reused(buffers: dict[str, torch.Tensor], name: str, shape, dtype: torch.dtype, **alloc) -> torch.Tensor:
    """buffers[name] viewed at `shape`, (re)allocated with `alloc` when it is missing, of another dtype or row
    shape, or too short (then at least twice as many rows, so growth is rare)."""
    buf = buffers.get(name)
    if buf is None or buf.dtype != dtype or buf.shape[1:] != shape[1:] or buf.shape[0] < shape[0]:
        rows = max(shape[0], 8 if buf is None else 2 * buf.shape[0])
        buf = buffers[name] = torch.empty((rows, *shape[1:]), dtype=dtype, **alloc)
    return buf[:shape[0]]


class _NoEvent:
    """A CUDA event's record/synchronize on a CPU device, where every copy is synchronous anyway."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CallExperts:
    """`key in protected` for one decode call without building a set: this call's experts of `layer` (hits
    and fetches in progress) and every in-flight promotion keep their slots."""

    __slots__ = ("layer", "mask", "pending")

    def __init__(self, layer: int, experts: np.ndarray, num_experts: int, pending: set[Key]):
        self.layer, self.pending = layer, pending
        self.mask = np.zeros(num_experts, dtype=bool)
        self.mask[experts] = True

    def __contains__(self, key: Key) -> bool:
        return (key[0] == self.layer and bool(self.mask[key[1]])) or key in self.pending
