"""`freetoken bench model`: the engine's own model code at a real shape, experts in the hybrid tier.

Where `freetoken bench hybrid` times the expert tier under a stand-in for the dense work, this runs the family's
real model (attention over a real KV cache, norms, routers, LM head; random bf16 weights) through the same paths
the engine takes: prefill in chunks, batch-1 decode through runtime/decode_graph.py (CUDA graphs) or eagerly,
the warm turn of an agent (a long conversation resent with a few new tokens: the KV comes back from host RAM as
the engine's prefix cache brings it). Experts live in `HybridExperts` over a synthetic store at each VRAM budget;
routing is the benchmark's (uniform: the worst case; skewed: Zipf popularity with temporal locality), because a
random model routes nearly every token to the same few experts.

Ceiling (decode, issue 10's "physical ceiling") = miss bytes per token / (PCIe + CPU-kernel bandwidth) + the dense
time, where the CPU-kernel bandwidth is the CPU-share worker's on a layer's every expert missed and cold
(`cpu_kernel_gbps`) and the dense time is the recorded step with experts that cost nothing. Sessions 1-13 put the
CPU's read probe in that sum instead (83-130 GB/s on the GPU machine's hosts, against the kernel's ~65-72): rows
print that ratio too, as "read probe". And "together" (session 17): the same over the two bandwidths measured at
once - the CPU kernel timed while the gather streams over PCIe (`GatherTraffic`) - since both read one DRAM and the
issue's sum of rates measured apart can exceed what a host serves to both. Rows print as they are measured and go
to JSON.
Options: runtime/experts/bench.py (`freetoken bench model --help`).
"""
from __future__ import annotations

import json
import time

import numpy as np
import torch

from runtime.decode_graph import DecodeGraphs, graph_safe, graph_tokens
from runtime.experts.bench import CONFIGS, SHAPES, Router
from runtime.host_wait import wait_quietly
from runtime.models.base import Batch

GiB = 1 << 30
SHARE_WARMUP_MAX_STEPS = 960    # `--cpu-share auto`: decode steps at most before a row is timed (simulated
                                # H200 and laptop curves settle in 50-200; tests/test_share_controller.py)


class RoutedExperts:
    """The benchmark's routing instead of the router's: decode ids come from a device table indexed by a device
    step counter (so a recorded graph reads the right row at every replay); prefill ids from a per-layer table."""

    def __init__(self, inner, layers: list[int], decode_ids: torch.Tensor, prefill_ids: torch.Tensor,
                 batch_ids: torch.Tensor | None = None):
        self.inner = inner
        self.index = {layer: i for i, layer in enumerate(layers)}
        self.decode_ids = decode_ids            # [S, L, 1, K] int64 on the device
        self.prefill_ids = prefill_ids          # [L, Tmax, K] int64 on the device
        self.batch_ids = batch_ids              # [S, L, B, K]: a decode step of B sequences (or None)
        self.step = torch.zeros(1, dtype=torch.long, device=decode_ids.device)

    def __call__(self, layer, hidden, topk_ids, topk_weights):
        i = self.index[layer]
        t = hidden.shape[0]
        if t == 1:
            ids = self.decode_ids.index_select(0, self.step)[0, i]                          # [1, K]
        elif self.batch_ids is not None and t == self.batch_ids.shape[2]:
            ids = self.batch_ids.index_select(0, self.step)[0, i]                           # [B, K]
        else:
            ids = self.prefill_ids[i, :t]                                                    # [T, K]
        return self.inner(layer, hidden, ids, topk_weights)

    def graph_safe(self, layer: int) -> bool:
        return graph_safe(self.inner, layer)

    def graph_tokens(self, layer: int) -> int | None:
        return graph_tokens(self.inner, layer)

    def begin_step(self) -> None:
        self.inner.begin_step()

    def end_step(self) -> None:
        self.inner.end_step()


class NoExperts:
    """Experts that cost nothing (graph-safe): what the dense time of the ceiling is measured with."""

    def __call__(self, layer, hidden, topk_ids, topk_weights):
        return torch.zeros_like(hidden)

    def graph_safe(self, layer: int) -> bool:
        return True

    def graph_tokens(self, layer: int) -> int | None:
        return None


def random_model(config: dict, *, device, dtype):
    """The family's model at this config with random weights (std 0.02; norms 1)."""
    from runtime.loading import build_empty_model

    model = build_empty_model(config, experts=NoExperts(), device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dtype.is_floating_point:
                p.normal_(0.0, 0.02, generator=gen)
    if torch.device(device).type == "cuda":
        model.fuse_projections()                       # as the engine does after loading
    return model


def decode_rate(model, graphs, cache, *, steps: int, warmup: int, experts=None, use_graphs: bool,
                device, trace: list | None = None, probe=None, host_wait: str = "spin") -> float:
    """Decode tok/s at batch 1 over `steps` tokens after `warmup` (each step samples: one sync per token).
    `trace`: gets (seconds, probe()) for every step, warm-up included (`--step-times`: how a row warms up).
    `host_wait`: "spin" (CUDA's default sync reading the token) or "sleep" (runtime/host_wait.py: the token is
    read once an event says the step is done, the thread napping meanwhile) or "chain" (the token is never read:
    each step is launched while the GPU still runs the last one, so the GPU never waits for the host between
    steps; the bound that launching a step ahead of its token, as vLLM's async scheduling does, could reach)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    token = 100
    t0 = None
    last = time.perf_counter()
    for s in range(warmup + steps):
        if s == warmup:
            sync()
            t0 = time.perf_counter()
        if experts is not None:
            experts.step.fill_(s)
        if use_graphs:
            logits = graphs.decode(token, cache)
        else:
            logits = model(Batch.build([([token], cache)], device=device))
        chosen = logits.argmax()
        if host_wait == "sleep":
            wait_quietly(device)
        if host_wait != "chain":
            token = int(chosen) % 1000
        if trace is not None:                      # the argmax synced: the step is over
            now = time.perf_counter()
            trace.append((now - last, probe() if probe else None))
            last = now
    sync()
    return steps / (time.perf_counter() - t0)


STEP_PHASES = (8, 32, 96)      # `--step-times`: the medians are printed for steps [0, 8), [8, 32), [32, 96), [96, ...)


def phase_line(trace: list, bounds: tuple[int, ...] = STEP_PHASES) -> str:
    """One line from a decode_rate trace with worker_counts probes: the median step (ms) of each phase and the
    CPU-share worker's µs a request over it (from seeing a request to answering it; '-' without requests)."""
    edges = [0, *[b for b in bounds if b < len(trace)], len(trace)]
    parts = []
    for a, b in zip(edges, edges[1:]):
        ms = sorted(1e3 * t for t, _ in trace[a:b])
        med = ms[len(ms) // 2]
        before = trace[a - 1][1] if a else None
        after = trace[b - 1][1]
        us = "-"
        if after is not None:
            served0, _, kernel0 = before[:3] if before is not None else (0, 0.0, 0.0)
            served = after[0] - served0
            if served > 0 and after[2]:
                us = f"{1e6 * (after[2] - kernel0) / served:.0f}"
        parts.append(f"{a}-{b - 1}: {med:.2f} ms, {us} µs")
    return "    steps (median, worker µs a request): " + " | ".join(parts)


def decode_rate_batch(model, graphs, caches, *, steps: int, warmup: int, experts, use_graphs: bool,
                      device) -> float:
    """Decode tok/s (all sequences together) for len(caches) sequences stepping together, as the engine steps
    them: through the recorded graphs of B sequences (runtime/decode_graph.py) or the eager ragged forward. Each
    step samples every sequence (one sync per step)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokens = [100 + i for i in range(len(caches))]
    t0 = None
    for s in range(warmup + steps):
        if s == warmup:
            sync()
            t0 = time.perf_counter()
        experts.step.fill_(s)
        if use_graphs:
            logits = graphs.decode_batch(tokens, caches)
        else:
            logits = model(Batch.build([([tok], c) for tok, c in zip(tokens, caches)], device=device))
        tokens = [int(x) % 1000 for x in logits.argmax(-1).tolist()]
    sync()
    return steps * len(caches) / (time.perf_counter() - t0)


def prefill(model, cache, n: int, *, chunk: int, device) -> float:
    """Seconds to prefill n tokens in chunks (the engine's way), to the first token's logits."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    done = 0
    while done < n:
        t = min(chunk, n - done)
        logits = model(Batch.build([([7] * t, cache)], device=device))
        done += t
    int(logits.argmax())
    return time.perf_counter() - t0


def fresh_prefill(model, n: int, *, chunk: int, device, dtype) -> float:
    """`prefill` of n tokens into a cache of its own, released after: seconds (an untimed warm run's, or the
    dense floor's)."""
    cache = model.new_cache(device=device, dtype=dtype)
    try:
        return prefill(model, cache, n, chunk=chunk, device=device)
    finally:
        cache.release()


def time_requests(worker, box, store, *, experts: int, calls: int, gap_s: float, hot: bool,
                  seed: int = 0) -> tuple[list[float], float]:
    """The real CPU-share worker (compiled serving loop) answering `calls` requests of one token and `experts`
    distinct experts, sent through the mailbox by the CPU stand-in of the GPU's handoff: (round trips in seconds,
    the worker's own mean seconds a request from seeing it to answering, by its cycle counter)."""
    from runtime.experts.cpu_share import collect_reference, handoff_reference

    rng = np.random.default_rng(seed)
    layers, e, d, k = store.layers, store.num_experts, store.layout.hidden, box.top_k
    # a token's k experts: `experts` misses for the CPU, the other k - experts resident (hits, never the CPU's):
    # the mailbox's row holds all k, as the GPU's handoff writes it (sessions 8-12 sent a shorter row, and the
    # worker read the rest of the row's stale ids: expert 0 for every padding entry, an extra expert and seven
    # assignments in the "1 expert" rows)
    resident = np.arange(e - (k - experts), e, dtype=np.int64)
    table = torch.full((e,), -1, dtype=torch.int64)
    table[torch.from_numpy(resident)] = 0
    fixed = rng.choice(e - len(resident), experts, replace=False).astype(np.int64)
    work = [(i % len(layers) if not hot else 0,
             torch.from_numpy(np.concatenate([fixed if hot else rng.choice(e - len(resident), experts,
                                                                            replace=False), resident])[None]))
            for i in range(calls + 10)]
    x = torch.from_numpy(rng.standard_normal((1, d), dtype=np.float32))
    w = torch.full((1, k), 1.0 / k)
    out = torch.zeros(1, d)
    trips = []
    for i, (li, ids) in enumerate(work):
        if i == 10:
            served, busy = worker.kernel_requests, worker.kernel_seconds or 0.0
        t0 = time.perf_counter()
        handoff_reference(li, ids, w, x, table, box)
        collect_reference(out, box)
        t1 = time.perf_counter()
        trips.append(t1 - t0)
        while time.perf_counter() - t1 < gap_s:      # the GPU's part of the layer: the worker spins meanwhile
            pass
    n = worker.kernel_requests - served
    return trips[10:], ((worker.kernel_seconds or 0.0) - busy) / max(n, 1)


class GatherTraffic:
    """The GPU's side of a decode step without its compute: `blocks` random blocks of page-locked host memory
    (`hosts`: [E, nbytes] uint8 tensors, a store's layers) copied into VRAM scratch by the gather kernel (zero-copy
    decode's: SM loads over PCIe) or, with `copy_engine`, by cudaMemcpyAsync per block - launch after launch on a
    stream of its own, queued up front; `rate()` gives the GB/s moved between two `mark()`s. With the CPU kernel
    timed between the same marks, the two bandwidths are measured together (`cpu_kernel_gbps(beside=)`): both read
    one DRAM, which the issue's ceiling, adding them measured apart, does not see (docs/hybrid.md, seventeenth
    session). benchmarks/bench_mailbox_latency.py times the mailbox beside it."""

    def __init__(self, hosts: list[torch.Tensor], device: torch.device, *, blocks: int, launches: int = 600,
                 copy_engine: bool = False, seed: int = 0):
        from runtime.kernels.gather_triton import gather_blocks

        self._gather, self.hosts, self.copy_engine = gather_blocks, hosts, copy_engine
        experts, nbytes = hosts[0].shape
        self.scratch = torch.empty((blocks, nbytes), dtype=torch.uint8, device=device)
        g = torch.Generator().manual_seed(seed)
        # every launch's rows made up front (a pageable copy a launch would hold the host back)
        self.rows = torch.stack([torch.randperm(experts, generator=g)[:blocks] for _ in range(launches)])
        self.rows_dev = self.rows.view(launches, 1, blocks).to(device)
        self.stream = torch.cuda.Stream(device)
        self.launch_bytes = blocks * nbytes
        self.events: list = []
        self._marks: list[tuple[float, int]] = []

    @classmethod
    def of_store(cls, store, device: torch.device, **kwargs) -> GatherTraffic:
        return cls([torch.from_numpy(store.layer_buffer(layer)) for layer in store.layers], device, **kwargs)

    def start(self) -> None:
        with torch.cuda.stream(self.stream):
            for j in range(self.rows.shape[0]):
                src = self.hosts[j % len(self.hosts)]
                if self.copy_engine:
                    for slot, r in enumerate(self.rows[j].tolist()):
                        self.scratch[slot].copy_(src[r], non_blocking=True)
                else:
                    self._gather(src, self.rows_dev[j], self.scratch)
                self.events.append(self.stream.record_event())

    def _done(self) -> int:
        """Launches finished so far (they finish in stream order: a binary search over their events)."""
        lo, hi = 0, len(self.events)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.events[mid].query():
                lo = mid + 1
            else:
                hi = mid
        return lo

    def mark(self) -> None:
        self._marks.append((time.perf_counter(), self._done()))

    def rate(self) -> float:
        """GB/s between the first and the last mark; 0 when the queue ran dry before the last (too short to say)."""
        (t0, n0), (t1, n1) = self._marks[0], self._marks[-1]
        if n1 >= len(self.events) or t1 <= t0:
            return 0.0
        return (n1 - n0) * self.launch_bytes / (t1 - t0) / 1e9


def cpu_kernel_gbps(store, *, top_k: int, threads: int, calls: int | None = None, gap_s: float = 100e-6,
                    rounds: int = 3, beside: GatherTraffic | None = None, experts: int | None = None,
                    seed: int = 0) -> float:
    """The CPU-kernel bandwidth in issue 10's physical ceiling, GB/s of expert bytes: the CPU-share worker (the
    compiled loop that decode's CPU share runs in, at its thread count) answering one-token requests of a whole
    layer's `top_k` experts, every one a miss and cold (request i reads layer i of the store, past the caches), over
    the worker's own time a request. The kernel's best case in decode (a layer's every expert at once: the fixed
    cost of a request is spread over the most bytes), and the best of `rounds` rounds (one process measured
    67.0-78.7 GB/s in session 14), so the ceiling it gives is the highest the kernel allows. 0.0 where the int8
    kernel or the worker's cycle clock is not available. `beside`: GPU traffic started before the timed rounds and
    marked around them (then the mean of the rounds, requests back to back: the rate while both read). `experts`:
    fewer cold misses a request than the layer's `top_k` (a decode step's CPU share; benchmarks/bench_store_pages.py),
    `seed`: the first round's routing seed."""
    from runtime.experts.cpu_executor import CpuExecutor
    from runtime.experts.cpu_share import CpuShareWorker, Mailbox
    from runtime.experts.interface import ExpertSpec
    from runtime.experts.openmp import load_private_openmp

    load_private_openmp()                       # as the tier does before its worker's threads exist
    cpu = CpuExecutor(store, ExpertSpec())
    if not cpu.int8:
        return 0.0
    cpu.warm_up(store.layers[0])                # compiled on this thread, alone, as the tier does
    box = Mailbox(max_tokens=1, top_k=top_k, hidden=store.layout.hidden, device=torch.device("cpu"), share=1.0)
    worker = CpuShareWorker(box, None, int8_args=cpu.int8_args(), threads=threads)
    try:
        if beside is not None:
            beside.start()
            time.sleep(0.01)                    # (the link's reads in full flow first)
            beside.mark()
        per_round = [time_requests(worker, box, store, experts=experts or top_k, calls=calls or 2 * len(store.layers),
                                   gap_s=gap_s if beside is None else 0.0, hot=False, seed=seed + r)[1]
                     for r in range(rounds)]
        if beside is not None:
            beside.mark()
            torch.cuda.synchronize()
    finally:
        worker.close()                          # its thread ends, and with it its OpenMP pool
    busy = min(per_round) if beside is None else float(np.mean(per_round))
    return (experts or top_k) * store.block_nbytes / busy / 1e9 if busy > 0 else 0.0


def ceiling_tok_s(misses_per_step: float, block_nbytes: int, gbps: float, dense_s: float, sequences: int = 1) -> float:
    """Issue 10's physical ceiling of a decode row: a step's miss bytes over the links' summed rate, plus the dense
    step; tokens a second over `sequences` sequences."""
    return sequences / (misses_per_step * block_nbytes / (gbps * 1e9) + dense_s)


def partial_ceiling_tok_s(misses_per_step: float, block_nbytes: int, *, h2d_gbps: float, cpu_gbps: float,
                          pinned: float, dense_s: float, sequences: int = 1) -> float:
    """`ceiling_tok_s` for a store pinned in part: the `pinned` fraction of the layers' misses over both links'
    summed rate, the rest over the CPU kernel's alone (the GPU cannot read those layers' host memory)."""
    miss_bytes = misses_per_step * block_nbytes
    seconds = miss_bytes * (pinned / ((h2d_gbps + cpu_gbps) * 1e9) + (1 - pinned) / (cpu_gbps * 1e9))
    return sequences / (seconds + dense_s)


def prefill_ceiling_s(*, moved_bytes: float, h2d_gbps: float, dense_s: float, expert_flops: float,
                      matmul_tflops: float) -> float:
    """Issue 10's streaming ceiling of a prefill row, in seconds: the slower of moving its experts' bytes over PCIe
    (every expert once a chunk) and the chunk's compute - the dense forward (measured with experts that cost
    nothing) plus the experts' matmuls at the GPU's bf16 GEMM rate. 0 when neither side is known."""
    move = moved_bytes / (h2d_gbps * 1e9) if h2d_gbps else 0.0
    compute = dense_s + (expert_flops / (matmul_tflops * 1e12) if matmul_tflops else 0.0)
    return max(move, compute)


def expert_flops(tokens: int, *, top_k: int, hidden: int, intermediate: int, layers: int) -> float:
    """The routed experts' multiply-adds of `tokens` tokens, counted as 2 flops each: gate, up and down."""
    return 2.0 * 3 * tokens * top_k * hidden * intermediate * layers


def measure_matmul_tflops(device) -> float:
    """bf16 GEMM throughput of this GPU (8192^3, best of ten after a warm one); 0 on a CPU device."""
    if device.type != "cuda":
        return 0.0
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192 ** 3 / (time.perf_counter() - t0) / 1e12


def probe_after_row(row: dict, store, *, top_k: int, threads: int, h2d_gbps: float, dense_s: float) -> None:
    """The ceiling's CPU-kernel probe run again right after a decode row (its tier idle: the worker's spin over),
    and the row held to the ceiling it gives, beside the one from the probe at the process's start: the probe read
    78.1 and then 94.8 GB/s in two processes minutes apart on one host (session 21, s21c/s21d) while the rows moved
    less, so a probe taken once per process says as much about that moment as about the row."""
    time.sleep(0.2)                 # the tier's worker leaves its region after a 5 ms spin, its pool then sleeps
    after = cpu_kernel_gbps(store, top_k=top_k, threads=threads)
    if not after:
        return
    ceiling = ceiling_tok_s(row["misses_per_token"], store.block_nbytes, h2d_gbps + after, dense_s)
    row.update(kernel_gbps_after=after, ceiling_after_tok_s=ceiling, of_ceiling_after=row["tok_s"] / ceiling)
    print(f"    CPU kernel right after the row: {after:.1f} GB/s -> ceiling {ceiling:.1f} tok/s, "
          f"{100 * row['of_ceiling_after']:.1f} % (the process's start probe: {100 * row['of_ceiling']:.1f} %)",
          flush=True)


def run_model(name: str, args, hw, report: dict) -> None:
    from runtime.experts.cpu_share import default_worker_threads
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.hybrid import HybridExperts, HybridOptions, costly_hot_set
    from runtime.experts.interface import ExpertSpec
    from runtime.experts.planner import PREFILL_CHUNK_TOKENS, ModelShape, plan_memory
    from runtime.experts.policy import RoutingStats
    from runtime.experts.stats import host_rss

    layers, e, k, d, i, codec, group = SHAPES[name]
    layers = args.layers or layers
    cfg = dict(CONFIGS[name], num_hidden_layers=layers, max_position_embeddings=65536)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # `--store mapped`: the experts stay pageable, as a package the planner could not page-lock (Windows pins about
    # half the RAM) - misses are fetched and layers streamed through the staging ring (staging.py)
    store_kind = getattr(args, "store", "pinned") if device.type == "cuda" else "pageable"
    store = HostExpertStore.synthetic(layers=layers, num_experts=e, hidden=d, intermediate=i, codec=codec,
                                      group=group, pin=store_kind == "pinned")
    huge = store.huge_page_bytes()
    if huge is not None:
        report.setdefault("huge_page_gib", {})[name] = huge / GiB
        print(f"{name} store {store.nbytes / GiB:.2f} GiB {store_kind}, {huge / GiB:.2f} GiB in transparent huge pages",
              flush=True)
    part = getattr(args, "pinned_layers", 0) if store_kind == "mapped" else 0
    if part:    # `--pinned-layers`: the first layers copied and page-locked, as a plan pinned in part loads them
        synthetic = store._owner
        store = store.pinned_copy(layers=store.layers[:part])
        # the synthetic buffer's own copies of those layers go back to the OS, as a real load releases the file's
        # pages of the layers it copied: RSS is then the plan's
        released = synthetic.discard(0, part * store.layer_buffer(store.layers[0]).nbytes)
        print(f"{name} store: layers {store.layers[0]}-{store.layers[part - 1]} page-locked "
              f"({'yes' if store.pinned_layers else 'refused'}), the rest pageable"
              + ("" if released else " (the synthetic copies of the pinned layers stay: RSS is not the plan's)"),
              flush=True)
    shape = ModelShape.from_config(cfg, codec=codec, group_size=group, block_size=group,
                                   block_nbytes=store.block_nbytes)
    # issue 10's ceiling is over the CPU kernel's bandwidth (measured here, on this store, at the worker's threads);
    # the read probe's (hw.cpu_gbps) is kept beside it: the bar the kernel itself is held to
    # (on a GPU only: a CPU-only engine keeps one OpenMP instance, which the worker measured here would split)
    worker_threads = default_worker_threads()
    kernel_gbps = cpu_kernel_gbps(store, top_k=k, threads=worker_threads) if device.type == "cuda" else 0.0
    report.setdefault("cpu_kernel_gbps", {})[name] = kernel_gbps
    kernel = f"{kernel_gbps:.1f} GB/s (a layer's {k} experts cold, one token, {worker_threads} threads)" \
        if kernel_gbps else "not measured (the ceiling takes the read probe)"
    print(f"{name} CPU kernel {kernel}; read probe {hw.cpu_gbps:.1f} GB/s, PCIe {hw.h2d_gbps:.1f} GB/s", flush=True)
    # a row with another thread count (`--cpu-threads`) is held to the kernel measured at its own count: more lanes
    # raise the kernel's bandwidth, and with it that row's ceiling
    kernel_at = {worker_threads: kernel_gbps}
    for threads in getattr(args, "cpu_threads", [0]):
        if kernel_gbps and threads and threads not in kernel_at:
            kernel_at[threads] = cpu_kernel_gbps(store, top_k=k, threads=threads)
            print(f"{name} CPU kernel {kernel_at[threads]:.1f} GB/s at {threads} threads", flush=True)
    report.setdefault("cpu_kernel_gbps_at", {})[name] = {str(t): g for t, g in kernel_at.items()}
    joint_gbps = 0.0
    if kernel_gbps and store_kind == "mapped":      # the gather reads page-locked memory: a mapped store has none
        print(f"{name} together: not measured (the GPU reads a pageable store only through the staging ring)",
              flush=True)
    elif kernel_gbps:
        try:            # both at once: what this host's DRAM serves to the two sides together
            traffic = GatherTraffic.of_store(store, device, blocks=k)
            cpu_beside = cpu_kernel_gbps(store, top_k=k, threads=worker_threads, rounds=2, beside=traffic)
            gpu_beside = traffic.rate()
            if cpu_beside and gpu_beside:
                joint_gbps = cpu_beside + gpu_beside
                print(f"{name} together: CPU kernel {cpu_beside:.1f} GB/s beside the gather's {gpu_beside:.1f} GB/s "
                      f"= {joint_gbps:.1f} (apart: {kernel_gbps:.1f} + {hw.h2d_gbps:.1f} = "
                      f"{kernel_gbps + hw.h2d_gbps:.1f})", flush=True)
        except Exception as exc:     # noqa: BLE001  (a measurement beside the issue's; the rows go on without it)
            torch.cuda.synchronize()     # (the traffic's queue drained before any row is timed)
            print(f"{name} together: not measured ({type(exc).__name__}: {exc})", flush=True)
    report.setdefault("joint_gbps", {})[name] = joint_gbps
    model = random_model(cfg, device=device, dtype=dtype)
    dense = "bf16" if dtype == torch.bfloat16 else str(dtype).replace("torch.", "")
    if getattr(args, "dense_int8", False):
        from dataclasses import replace

        from runtime.models.quantized import quantize_dense_
        swapped = quantize_dense_(model)     # as the engine does for a hybrid GPU plan
        shape, dense = replace(shape, dense_nbytes=swapped["dense_bytes"]), "int8"
    if callable(getattr(model, "attach_state_pool", None)):
        model.attach_state_pool(max(2, args.batch), device=device, dtype=dtype)   # as the engine does: states in slots
    moe_layers = store.layers
    graphs = DecodeGraphs(model, device=device, max_batch=max(1, args.batch))
    steps = args.warmup + args.tokens

    # the dense floor: the recorded step with experts that cost nothing
    cache = model.new_cache(device=device, dtype=dtype)
    prefill(model, cache, args.context, chunk=args.chunk, device=device)
    dense_tok_s = decode_rate(model, graphs, cache, steps=args.tokens, warmup=args.warmup, use_graphs=graphs.capture,
                              device=device)
    dense_s = 1.0 / dense_tok_s
    print(json.dumps({"model": name, "dense_ms_per_token": dense_s * 1e3, "graphs": graphs.capture, "dense": dense,
                      "dense_gib": shape.dense_bytes / GiB}), flush=True)
    cache.release()
    del cache
    # the prefill rows' streaming ceiling: each prompt's dense forward with free experts (once untimed first: its
    # kernels compile), and the GPU's GEMM rate for the experts' matmuls
    dense_prefill_s, tflops = {}, 0.0
    chunks = getattr(args, "prefill_chunks", None) or [args.chunk]
    if device.type == "cuda" and any(b in args.prefill_budgets for b in args.budgets):
        tflops = measure_matmul_tflops(device)
        for chunk in chunks:
            for n in args.prefill:
                fresh_prefill(model, n, chunk=chunk, device=device, dtype=dtype)
                dense_prefill_s[chunk, n] = fresh_prefill(model, n, chunk=chunk, device=device, dtype=dtype)
        print(json.dumps({"model": name, "matmul_tflops": tflops,
                          "dense_prefill_s": {f"{n} (chunk {c})": t for (c, n), t in dense_prefill_s.items()}}),
              flush=True)
    report.setdefault("matmul_tflops", {})[name] = tflops
    rows = []
    plan_chunks = getattr(args, "plan_chunks", None) or [PREFILL_CHUNK_TOKENS]
    context = getattr(args, "plan_context", 0) or max(8192, args.ttft_context + 1024)
    for budget_gib, plan_chunk in [(b, c) for b in args.budgets for c in plan_chunks]:
        budget = None if budget_gib == 0 else int(budget_gib * GiB)
        plan = plan_memory(shape, hw, context_length=context, max_sequences=1, vram_budget=budget,
                           prefill_chunk=plan_chunk)
        slots = plan.expert_slots if plan.backend != "cpu" else 0
        if plan.backend == "gpu":
            slots = layers * e
        label = ("unlimited" if budget is None else f"{budget_gib:g} GiB") + \
            (f" c{plan.prefill_chunk // 1024}K" if len(plan_chunks) > 1 else "")
        # what the load's plan (and the library's badge) would have promised, to read beside the measured rows
        slow, fast = plan.estimated_decode_tok_s
        print(f"{name} {label}: planner's decode estimate {slow:.1f}-{fast:.1f} tok/s b1 ({plan.expert_slots} slots; "
              f"read probe {hw.cpu_gbps:.1f}, PCIe {hw.h2d_gbps:.1f}, VRAM peak {hw.vram_gbps:.0f} GB/s)", flush=True)
        costly = ()           # a store pinned in part: the pool pinned as the factory pins it (`--costly-hot`)
        if part and getattr(args, "costly_hot", "on") == "on" and device.type == "cuda":
            costly = costly_hot_set(RoutingStats(), slots, layers=moe_layers, num_experts=e,
                                    costly=[lay for lay in moe_layers if lay not in store.pinned_layers],
                                    cpu_gbps=kernel_gbps or hw.cpu_gbps, h2d_gbps=hw.h2d_gbps)
            print(f"{name} {label}: {len(costly)} of {slots} slots pinned to the unpinned layers' experts", flush=True)
        splits = args.split if slots < layers * e else args.split[:1]     # a split needs misses
        shares = list(args.cpu_share)
        gathers, thread_counts = getattr(args, "gather", ["on"]), getattr(args, "cpu_threads", [0])
        waits, hits_modes = getattr(args, "host_wait", ["spin"]), getattr(args, "hits", ["beside"])
        promotions = getattr(args, "promotions", ["adaptive"])
        parts_modes = getattr(args, "gather_parts", ["two"])
        starts = getattr(args, "share_start", ["balance"])
        expert_splits = getattr(args, "expert_split", ["off"])
        collect_warps = getattr(args, "collect_warps", [4])
        early_xs = getattr(args, "early_x", ["on"])
        for routing, split, share, gather, threads, host_wait, hits_mode, promotion, parts, start, esplit, cwarps, \
                early_x in [
                (r, sp, sh, g, th, hw_, hm, pm, pa, st, es, cw, ex) for r in args.routings for sp in splits
                for sh in (shares if sp == "auto" else shares[:1]) for g in gathers
                for th in (thread_counts if sh != 0 else thread_counts[:1]) for hw_ in waits for hm in hits_modes
                for pm in promotions for pa in parts_modes for st in (starts if sh is None else starts[:1])
                for es in (expert_splits if sh != 0 else expert_splits[:1])
                for cw in (collect_warps if sh != 0 else collect_warps[:1])
                for ex in (early_xs if sh != 0 else early_xs[:1])]:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            hybrid = HybridExperts(store, ExpertSpec(), device=device, dtype=dtype, options=HybridOptions(
                slots=slots, top_k=k, cpu_gbps=hw.cpu_gbps, h2d_gbps=hw.h2d_gbps, split=split, cpu_share=share,
                zero_copy_gather=gather == "on", cpu_threads=threads or None, hits_beside=hits_mode == "beside",
                adaptive_promotions=promotion == "adaptive", split_gather=parts == "two", expert_split=esplit == "on",
                collect_warps=cwarps, cpu_early_x=early_x == "on",
                share_start=None if start == "balance" else float(start),
                hot_set=tuple((lay, x) for lay in moe_layers for x in range(e)) if slots >= layers * e else costly))
            router = Router(routing, layers=layers, experts=e, k=k, seed=1)
            dec = np.stack([np.stack([router.route(lay, 1) for lay in range(layers)]) for _ in range(steps)])
            pre = np.stack([router.route(lay, args.chunk) for lay in range(layers)])
            bat = None
            if args.batch > 1:
                bat = torch.from_numpy(np.stack([np.stack([router.route(lay, args.batch) for lay in range(layers)])
                                                 for _ in range(steps)])).to(device)                # [S, L, B, K]
            experts = RoutedExperts(hybrid, moe_layers, torch.from_numpy(dec).to(device),
                                    torch.from_numpy(pre).to(device), bat)

            def decode_row(c: dict, tok_s: float, sequences: int, kind: str, split_label: str) -> dict:
                """A decode row from the tier's counters over the row's `steps` steps of `sequences` tokens; the
                ceiling is the step's miss bytes over both links' rates plus the dense step."""
                misses = (c["cpu_experts"] + c["fetched_experts"]) / steps                     # per step
                over = lambda gbps: ceiling_tok_s(misses, store.block_nbytes, gbps, dense_s, sequences)  # noqa: E731
                # the issue's: the CPU kernel's bandwidth (or the read probe's where it could not be measured)
                ceiling = over(hw.h2d_gbps + (kernel_at.get(threads or worker_threads, 0.0) or hw.cpu_gbps))
                ceiling_read, laptop = over(hw.h2d_gbps + hw.cpu_gbps), over(LAPTOP_LINKS_GBPS)
                # beside it, over the two bandwidths measured together (0: not measured)
                joint = over(joint_gbps) if joint_gbps else 0.0
                # a store pinned in part: its unpinned layers' misses can only be the CPU's
                cpu_rate = kernel_at.get(threads or worker_threads, 0.0) or hw.cpu_gbps
                # (the share of misses in pinned layers as counted: the costly hot set keeps unpinned layers' low)
                pinned_share = 1.0 - c["host_only_misses"] / max(1, c["misses"])
                partial = partial_ceiling_tok_s(misses, store.block_nbytes, h2d_gbps=hw.h2d_gbps, cpu_gbps=cpu_rate,
                                                pinned=pinned_share, dense_s=dense_s, sequences=sequences) \
                    if part and cpu_rate else 0.0
                return {"model": name, "budget": label, "routing": routing, "kind": kind, "slots": slots, "dense": dense,
                        "tok_s": tok_s, "ceiling_tok_s": ceiling, "of_ceiling": tok_s / ceiling,
                        "ceiling_read_tok_s": ceiling_read, "of_ceiling_read": tok_s / ceiling_read,
                        "ceiling_joint_tok_s": joint, "of_ceiling_joint": tok_s / joint if joint else 0.0,
                        "ceiling_partial_tok_s": partial, "of_ceiling_partial": tok_s / partial if partial else 0.0,
                        # issue 10's projection: the same share of a ceiling with a laptop's links
                        "laptop_tok_s": laptop * tok_s / ceiling,
                        "hit_rate": c["hit_rate"], "cpu_share": c["cpu_share"], "split": split_label,
                        "peak_vram_gib": torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else 0,
                        "host_rss_gib": host_rss() / GiB, "host_us_per_call": host_breakdown(c),
                        "misses_per_token": misses / sequences,
                        "distinct_per_layer": distinct_per_layer(dec if sequences == 1 else bat.cpu().numpy())}
            model.set_experts(experts)
            modes = [m == "graphs" for m in args.modes if graphs.capture or m == "eager"]
            ctl = hybrid.share_controller                 # --cpu-share auto on zero-copy: learned, else None
            warm = 0                                      # warm-up steps of a learned share (none: --first-load)
            if ctl is not None:
                print(f"    learned CPU share starts at {ctl.share:.2f} ({start})", flush=True)
            if ctl is not None and modes and not getattr(args, "first_load", False):
                warm = warm_up_share(ctl, model, graphs, experts, router, args, layers=layers, steps=steps,
                                     use_graphs=modes[0], device=device, dtype=dtype)
                print(f"    learned CPU share: {'settled' if ctl.settled else 'NOT settled'} at "
                      f"{ctl.held_share:.2f} after {warm} warm-up steps (" + ", ".join(
                          f"{ctl.grid[i]:g}: {1e3 * t:.2f} ms" for i, t in sorted(ctl.medians.items())) + ")",
                      flush=True)
                print("    its trials (share on trial against the held one, ms a step, the margin): " + "; ".join(
                    f"{t['trial']:g} {1e3 * t['trial_s']:.2f} vs {t['held']:g} {1e3 * t['held_s']:.2f} "
                    f"({100 * t['margin']:.0f} %) {t['verdict']}" for t in getattr(ctl, "trials", [])), flush=True)
            for use_graphs in modes:
                cache = model.new_cache(device=device, dtype=dtype)
                prefill(model, cache, args.context, chunk=args.chunk, device=device)
                hybrid.counters.end_step()
                used = ShareLog(ctl) if ctl is not None else None
                clock_before = clock_sample(hybrid, device)
                worker_before = worker_counts(hybrid)
                trace = [] if getattr(args, "step_times", False) else None
                tok_s = decode_rate(model, graphs, cache, steps=args.tokens, warmup=args.warmup, experts=experts,
                                    use_graphs=use_graphs, device=device, trace=trace,
                                    probe=lambda: worker_counts(hybrid), host_wait=host_wait)
                hybrid.flush_step_log()
                c = hybrid.counters.end_step()
                rows.append(decode_row(c, tok_s, 1, "decode b1 " + ("graphs" if use_graphs else "eager"),
                                       (f"zero-copy{'' if gather == 'on' else ' in place'} cpu "
                                        f"{hybrid.cpu_share:.2f}{'*' if share is None else ''}"
                                        + (f" {threads} thr" if threads else "")
                                        + ({"sleep": " sleep-wait", "chain": " chained"}.get(host_wait, ""))
                                        + ("" if hits_mode == "beside" else " hits after")
                                        + ("" if promotion == "adaptive" else " fixed promotions")
                                        + ("" if parts == "two" else " one gather")
                                        + (" split expert" if esplit == "on" else "")
                                        + ({4: "", 0: " every warp polls"}.get(cwarps, f" collect {cwarps} warps"))
                                        + ("" if early_x == "on" else " x before plan")
                                        + ("" if share is not None or start == "balance" else f" from {start}")
                                        if hybrid.zero_copy else hybrid.split.mode)
                                       + ("" if split == "auto" else " (forced)")))
                print(_fmt(rows[-1]), flush=True)
                print_worker_line(hybrid, worker_before, rows[-1], steps=args.tokens + args.warmup,
                                  clock=clock_map(clock_before, clock_sample(hybrid, device)))
                if kernel_gbps and hybrid.zero_copy and slots < layers * e:
                    probe_after_row(rows[-1], store, top_k=k, threads=threads or worker_threads,
                                    h2d_gbps=hw.h2d_gbps, dense_s=dense_s)
                if trace:
                    # relative to the row's start: the worker's counters before the row are the baseline
                    trace = [(t, None if c is None else tuple(x - y for x, y in zip(c, worker_before)))
                             for t, c in trace]
                    rows[-1]["step_ms"] = [round(1e3 * t, 3) for t, _ in trace]
                    print(phase_line(trace), flush=True)
                if used is not None:
                    counts, text = used.close(untimed=args.warmup)
                    rows[-1].update(share_warmup_steps=warm, share_settled=ctl.settled, share_steps=counts)
                    print(f"    learned CPU share used: {text}; the CPU took {100 * c['cpu_share']:.1f} % of the "
                          "misses", flush=True)
                line = host_line(rows[-1]["host_us_per_call"]) if c["decode_calls"] else None
                if line:
                    print(line, flush=True)
                now = store.huge_page_bytes()
                if huge is not None and now is not None and now != huge:
                    # (a process's first rows ran ~40 % slower on the CPU side than its later ones, s19a: does
                    # the kernel's khugepaged fold the store into huge pages while the rows run?)
                    rows[-1]["huge_page_gib"] = now / GiB
                    print(f"    store now {now / GiB:.2f} GiB in transparent huge pages ({huge / GiB:.2f} at the "
                          "start)", flush=True)
                if getattr(args, "profile", 0) and slots < layers * e:
                    profile_decode(model, graphs, cache, experts, use_graphs=use_graphs, device=device,
                                   steps=args.profile, out=args.out and args.out / f"profile_{name}_{label.replace(' ', '')}.txt")
                if use_graphs and args.trace and args.out and slots < layers * e:
                    trace_decode(graphs, cache, experts, args.trace, args.out / (
                        f"trace_{name}_{label.replace(' ', '')}_{routing}_{split}{share}_{hits_mode}_{promotion}"
                        f"{'_split' if esplit == 'on' else ''}.json.gz"))
                cache.release()                 # a state slot goes back to the pool
                del cache
            for use_graphs in [m == "graphs" for m in args.modes if args.batch > 1 and (graphs.capture or m == "eager")]:
                caches = [model.new_cache(device=device, dtype=dtype) for _ in range(args.batch)]
                for c_ in caches:
                    prefill(model, c_, args.context, chunk=args.chunk, device=device)
                hybrid.counters.end_step()
                captures = graphs.counters["captures"]
                worker_before = worker_counts(hybrid)
                tok_s = decode_rate_batch(model, graphs, caches, steps=args.tokens, warmup=args.warmup,
                                          experts=experts, use_graphs=use_graphs, device=device)
                hybrid.flush_step_log()
                c = hybrid.counters.end_step()
                # honest label: a graph row whose experts cannot take B tokens inside a graph is piece-wise
                whole = all(graph_tokens(experts, layer) is None or graph_tokens(experts, layer) >= args.batch
                            for layer in moe_layers)
                kind = f"decode b{args.batch} " + (("graphs" if whole else "pieces") if use_graphs else "eager")
                rows.append(decode_row(c, tok_s, args.batch, kind,
                                       f"zero-copy{'' if gather == 'on' else ' in place'} cpu {hybrid.cpu_share:.2f}"
                                       + (f" {threads} thr" if threads else "") if hybrid.zero_copy
                                       else hybrid.split.mode))
                rows[-1]["captures"] = graphs.counters["captures"] - captures
                print(_fmt(rows[-1]), flush=True)
                print_worker_line(hybrid, worker_before, rows[-1], steps=args.tokens + args.warmup)
                for c_ in caches:
                    c_.release()
                del caches
            first = (routing, split, share, gather, threads) == (args.routings[0], splits[0], shares[0], gathers[0],
                                                                  thread_counts[0])
            if first and budget_gib in args.prefill_budgets:
                for chunk, n in [(c, n) for c in chunks for n in args.prefill]:
                    # once untimed first: a process's first prefill of a shape compiles its Triton kernels (the
                    # expert pool's, fla-core's linear attention with its autotuning) - seconds that s26e's
                    # partial-store row counted as prefill (1,559 tok/s; 27,770 once warm, s27a); Triton keeps them
                    # on disk, so only a machine's first prompt pays them
                    if device.type == "cuda":     # each row's own peak (the pool and dense weights stay in it)
                        torch.cuda.reset_peak_memory_stats()
                    first_s = fresh_prefill(model, n, chunk=chunk, device=device, dtype=dtype)
                    cache = model.new_cache(device=device, dtype=dtype)
                    hybrid.counters.end_step()
                    ring_before = staging_times(hybrid)
                    s = prefill(model, cache, n, chunk=chunk, device=device)
                    c = hybrid.counters.end_step()
                    flops = expert_flops(n, top_k=k, hidden=d, intermediate=i, layers=len(moe_layers))
                    # (a GPU's: on a CPU device the experts' time is the CPU kernel's, which this does not model)
                    streaming = dict(moved_bytes=c["bytes_h2d"], dense_s=dense_prefill_s.get((chunk, n), 0.0),
                                     expert_flops=flops, matmul_tflops=tflops)
                    ceiling_s = prefill_ceiling_s(h2d_gbps=hw.h2d_gbps, **streaming) \
                        if device.type == "cuda" else 0.0
                    # issue 10's laptop projection: the same share of the ceiling a laptop's link sets (same GPU)
                    laptop_s = prefill_ceiling_s(h2d_gbps=LAPTOP_PCIE_GBPS, **streaming) if ceiling_s else 0.0
                    kind = f"prefill {n}" + ("" if chunk == args.chunk else f" c{chunk // 1024}K" if chunk >= 1024
                                             else f" c{chunk}")
                    rows.append({"model": name, "budget": label, "routing": routing, "kind": kind, "chunk": chunk,
                                 "slots": slots, "tok_s": n / s, "ceiling_tok_s": n / ceiling_s if ceiling_s else 0,
                                 "of_ceiling": ceiling_s / s if ceiling_s else 0,
                                 "hit_rate": c["hit_rate"], "cpu_share": c["cpu_share"],
                                 "split": "stream" if c["stream_calls"] else hybrid.split.mode,
                                 "peak_vram_gib": torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else 0,
                                 "host_rss_gib": host_rss() / GiB, "distinct_per_layer": distinct_per_layer(pre[None]),
                                 "first_s": first_s,
                                 "laptop_tok_s": n / laptop_s * (ceiling_s / s) if laptop_s else 0.0})
                    print(_fmt(rows[-1]), flush=True)
                    print(f"    the same prefill untimed just before: {first_s:.3f} s ({n / first_s:,.0f} tok/s; a "
                          "process's first includes its kernels' compiles)", flush=True)
                    past = max(0, shape.kv_bytes(n, 1) - shape.kv_bytes(context, 1))
                    rows[-1]["kv_past_plan_gib"] = past / GiB
                    if past and device.type == "cuda":   # the engine's plan holds the context its prompts fill
                        print(f"    its peak VRAM holds {past / GiB:.2f} GiB of KV past the plan's {context:,}-token "
                              "context (bench_cold_load.py --long-prompts measures the engine's own plan)", flush=True)
                    if ceiling_s:
                        print(f"    streaming ceiling {ceiling_s:.3f} s: the slower of moving {c['bytes_h2d'] / 1e9:.2f} GB "
                              f"at {hw.h2d_gbps:.1f} GB/s ({c['bytes_h2d'] / (hw.h2d_gbps * 1e9) if hw.h2d_gbps else 0:.3f} "
                              f"s) and the compute: dense {dense_prefill_s.get((chunk, n), 0.0):.3f} s + experts "
                              f"{flops / (tflops * 1e12) if tflops else 0:.3f} s ({tflops:.0f} TFLOPS bf16)", flush=True)
                    print_staging_line(ring_before, staging_times(hybrid), seconds=s)
                    cache.release()                 # a state slot goes back to the pool
                    del cache
                if args.ttft_context:
                    rows.extend(ttft_rows(model, graphs, experts, hybrid, args, name=name, label=label, slots=slots,
                                          device=device, dtype=dtype))
            model.set_experts(NoExperts())
            hybrid.close()
            del experts, hybrid
    for r in rows:
        r["store"] = store_kind + (f" ({part} layers pinned)" if part else "")
    report.setdefault("rows", []).extend(rows)
    report.setdefault("models", {})[name] = {"dense_ms_per_token": dense_s * 1e3, "store_gib": store.nbytes / GiB,
                                             "dense": dense, "dense_gib": shape.dense_bytes / GiB}


class ShareLog:
    """The CPU share each decode step of a row ran at: wraps the learned controller's `observe` (called at every
    step boundary with the step that just ended) until `close`."""

    def __init__(self, ctl):
        self.ctl, self.shares = ctl, []
        observe = ctl.observe

        def logged(step_seconds: float) -> float:
            self.shares.append(ctl.share)
            return observe(step_seconds)

        ctl.observe = logged

    def close(self, *, untimed: int) -> tuple[dict[str, int], str]:
        """Give the controller its own observe back; ({share: timed steps}, "0.3 in 31 of 31 timed steps, ...").
        Entry i is step i - 1 (a step is timed at the next one's boundary; entry 0 is the step before the row),
        so the first `untimed` + 1 entries are left out, and the row's last step, never closed, is not counted."""
        del self.ctl.observe
        timed = self.shares[untimed + 1:]
        counts: dict[str, int] = {}
        for s in timed:
            counts[f"{s:g}"] = counts.get(f"{s:g}", 0) + 1
        parts = [f"{s} in {n}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1])]
        text = (parts[0] + f" of {len(timed)} timed steps" + "".join(", " + p for p in parts[1:])) if parts else \
            "no step boundary seen"
        return counts, text


def settle_share(ctl, run_round, *, max_steps: int = SHARE_WARMUP_MAX_STEPS) -> int:
    """Decode rounds (`run_round()` runs some steps and returns how many) until the learned CPU share has settled
    (both neighbours of its share and both pure modes tried, nothing left on trial, its rescan once warm done) or
    `max_steps` ran; returns
    the steps run. The row then times the converged controller, as a user's second minute sees it, not its
    first steps (where trials cost time and it has not moved yet)."""
    done = 0
    while done < max_steps and (not ctl.settled or getattr(ctl, "rescan_pending", False)):
        ran = run_round()
        if ran <= 0:
            break
        done += ran
    return done


def warm_up_share(ctl, model, graphs, experts, router, args, *, layers: int, steps: int, use_graphs: bool, device,
                  dtype) -> int:
    """`settle_share` over rounds of `steps` decode steps on one cache (`--context` tokens, then growing: a
    graph is recorded once per KV bucket, not once per round), each round with fresh routing from the row's
    router: more of the same traffic. The table the recorded graphs read is written in place and restored
    afterwards, so the timed steps see the row's routing."""

    timed_ids = experts.decode_ids.clone()
    cache = model.new_cache(device=device, dtype=dtype)
    prefill(model, cache, args.context, chunk=args.chunk, device=device)

    def run_round() -> int:
        ids = np.stack([np.stack([router.route(lay, 1) for lay in range(layers)]) for _ in range(steps)])
        experts.decode_ids.copy_(torch.from_numpy(ids))
        decode_rate(model, graphs, cache, steps=steps - args.warmup, warmup=args.warmup, experts=experts,
                    use_graphs=use_graphs, device=device)
        return steps

    try:
        return settle_share(ctl, run_round)
    finally:
        cache.release()                       # a state slot goes back to the pool
        experts.decode_ids.copy_(timed_ids)


def worker_counts(hybrid) -> tuple:
    """(requests answered, seconds in its serving calls, seconds from seeing requests to answering them: 0 where
    the cycle counter is unavailable, the kernel's phase marks so far, requests of its finished serving calls, the
    mailbox's last ticket) of the tier's CPU-share worker; zeros without one. The first and third are current; the
    second and fifth are added to only when a serving call ends (its spin runs out), so they go together."""
    w, box = getattr(hybrid, "_worker", None), getattr(hybrid, "_box", None)
    if w is None:
        return (0, 0.0, 0.0, np.zeros(1, dtype=np.int64), 0, 0)
    return (w.requests, w.busy_seconds, w.kernel_seconds or 0.0, w.phase_marks(), w.served,
            int(box.ticket[0]) if box is not None else 0)


def phases_line(worker, before: np.ndarray) -> str | None:
    """The kernel's mean µs a request from its start to each mark, over the requests since `before` (the
    worker's `phase_marks()` then): where a request's time goes."""
    marks = worker.kernel_phases(since=before)
    if marks is None:
        return None
    return "    CPU kernel marks (µs from a request's start): " + ", ".join(f"{n} {u:.0f}" for n, u in marks.items())


_CLOCK_SYNC: dict = {}


def clock_sample(hybrid, device: torch.device):
    """The worker's cycle counter against the GPU's clock now (mailbox_clock.GpuClockSync, one per process), or
    None: no CPU share, no GPU, or the sample failed (said, and the row goes on without it)."""
    if getattr(hybrid, "_box", None) is None or device.type != "cuda":
        return None
    try:
        from runtime.experts.mailbox_clock import GpuClockSync

        if device not in _CLOCK_SYNC:
            _CLOCK_SYNC[device] = GpuClockSync(device)
        return _CLOCK_SYNC[device].sample()
    except Exception as exc:                   # noqa: BLE001  (a bench line lost, not the row)
        print(f"    (the worker's clock against the GPU's: not sampled - {exc})", flush=True)
        return None


def clock_map(before, after):
    """mailbox_clock.ClockMap through two clock_sample()s taken around a row, or None."""
    from runtime.experts.mailbox_clock import ClockMap

    return ClockMap.fit(before, after) if before is not None and after is not None else None


def staging_times(hybrid) -> dict | None:
    """The staging ring's cumulative timing (staging.StagingRing.timing plus the decoding thread's waits for staged
    layers), or None when the store needs no ring (every layer page-locked)."""
    return hybrid.stats_dict().get("staging")


def print_staging_line(before: dict | None, after: dict | None, *, seconds: float) -> None:
    """Where a prefill row's pageable layers spent their time on the ring's thread: its host copy (GB/s), its
    waits for a slot's last DMA, and the decoding thread's waits for a staged layer."""
    if before is None or after is None:
        return
    d = {k: after[k] - before[k] for k in after}
    if not d["layers"]:
        return
    gb = d["bytes"] / 1e9
    print(f"    ring: {d['layers']} layers + {d['blocks']} blocks, {gb:.2f} GB; host copy {d['copy_s']:.3f} s "
          f"({gb / max(d['copy_s'], 1e-9):.1f} GB/s), slot waits {d['wait_s']:.3f} s, DMA enqueue "
          f"{d['ship_s']:.3f} s; the decoding thread waited {d['caller_wait_s']:.3f} s of the row's {seconds:.3f} s",
          flush=True)


def print_worker_line(hybrid, before: tuple, row: dict, *, steps: int, clock=None) -> None:
    """Under a row with a CPU share: the worker's requests and the µs each took from the worker seeing it to its
    answer (the compiled loop's cycle counter: the kernel and the answer, not the wait), beside the step's time
    per layer, so a reader sees whether the CPU's part bounds a layer; also the µs of its serving calls, waits
    included (close to the layer time when requests come back to back)."""
    requests, busy, kernel, _, served, _ = worker_counts(hybrid)
    n = requests - before[0]
    if n <= 0:
        return
    finished = served - before[4]                  # requests of the serving calls that ended since `before`
    us = 1e6 * (busy - before[1]) / finished if finished > 0 else float("nan")
    kernel_us = 1e6 * (kernel - before[2]) / n
    per_layer = 1e6 / max(row["tok_s"], 1e-9) * (int(row["kind"].split()[1][1:]) if row["kind"].startswith("decode b")
                                                 else 1) / max(1, len(hybrid.store.layers))
    row.update(worker_requests=n, worker_us_per_request=us, worker_kernel_us_per_request=kernel_us)
    print(f"    CPU worker: {n} requests ({n / steps:.1f} per step), {kernel_us:.0f} µs each from seeing it to "
          f"answering (cycle counter; {us:.0f} µs with the waits); a layer's share of the step: {per_layer:.0f} µs",
          flush=True)
    line = phases_line(hybrid._worker, before[3])
    if line:
        print(line, flush=True)
    box = getattr(hybrid, "_box", None)
    spans = box.timeline(before[5], clock=clock) if box is not None else None
    if spans:            # the GPU's side of the same requests: what the two crossings of the link add
        row["mailbox_us"] = spans
        print(f"    mailbox (GPU clock, µs after the request, medians of {spans['requests']}): collect starts "
              f"{spans['request to collect']:.1f}, sees the answer {spans['request to answer seen']:.1f} (mean "
              f"{spans['request to answer seen, mean']:.1f}: {spans['request to answer seen, mean'] - kernel_us:.1f} "
              f"beside the worker's {kernel_us:.1f}), then adds its rows in "
              f"{spans['answer seen to rows added']:.1f}; collect waited {spans['collect waited']:.1f}", flush=True)
    if spans and "worker" in spans:   # the worker's stamps on the GPU's clock: the round trip split at the worker
        print(f"    round trip (medians of {spans['worker stamps']}, ±{spans['clock error']:.1f} µs): the request "
              f"reaches the worker after {spans['request to worker']:.1f} µs, the worker takes "
              f"{spans['worker']:.1f}, collect sees its answer {spans['worker done to answer seen']:.1f} after its "
              f"end", flush=True)
    lanes = hybrid._worker.lane_counts(since=before[3])
    if lanes:            # a lane's first task of a stage against its others (cold rows, late lanes, the split's)
        print("    CPU lanes, µs a task (first of the stage / all): " + ", ".join(
            f"{name} {c['first_task_us']:.1f} / {c['us_per_task']:.1f}" for name, c in lanes.items()
            if c["tasks_per_lane"] > 0), flush=True)


def host_line(us: dict[str, float]) -> str | None:
    """The "host µs per decode call" line, or None when every value would print as 0 (zero-copy graphs: the
    calls run inside the recorded step, nothing times them on the host)."""
    if not any(round(v) for v in us.values()):
        return None
    return "    host µs per decode call: " + "  ".join(f"{key} {v:.0f}" for key, v in us.items())


def host_breakdown(c: dict) -> dict:
    """µs per decode-layer call: waiting for the ids, bookkeeping, fetch submission, the CPU kernel, the upload,
    starting promotions, the rest of the call, and the whole call (from the tier's counters over a row)."""
    n = max(1, c["decode_calls"])
    parts = {"wait": c["host_wait_seconds"], "book": c["host_book_seconds"], "fetch": c["host_fetch_seconds"],
             "cpu": c["cpu_seconds"], "upload": c["host_upload_seconds"], "promote": c.get("host_promote_seconds", 0.0)}
    parts["other"] = c["decode_seconds"] - sum(parts.values())
    parts["call"] = c["decode_seconds"]
    return {key: 1e6 * v / n for key, v in parts.items()}


def profile_decode(model, graphs, cache, experts, *, use_graphs: bool, device, steps: int, out=None) -> None:
    """`steps` more decode steps under cProfile (the decoding thread, wall time): its 25 costliest functions by
    own time, printed and written to `out` - where a host-driven call's untimed "other" goes."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    decode_rate(model, graphs, cache, steps=steps, warmup=0, experts=experts, use_graphs=use_graphs, device=device)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(f"    cProfile over {steps} more steps (decoding thread):", text.getvalue(), sep="\n", flush=True)
    if out is not None:
        out.write_text(text.getvalue())


def trace_decode(graphs, cache, experts, steps: int, path) -> None:
    """A Chrome trace (gzipped) of `steps` more graph decode steps: where the GPU waits for the host and why."""
    import gzip
    import shutil
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    path.parent.mkdir(parents=True, exist_ok=True)
    token = 100
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for s in range(steps):
            experts.step.fill_(s)
            token = int(graphs.decode(token, cache).argmax()) % 1000
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        with open(tmp.name, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30), flush=True)   # GPU kernels first


def ttft_rows(model, graphs, experts, hybrid, args, *, name, label, slots, device, dtype) -> list[dict]:
    """An agent's turn: a `ttft_context`-token conversation, then the same resent with `ttft_new` new tokens.
    Cold = prefilling everything; warm = the KV restored from host RAM (the engine's prefix cache keeps a GPU
    engine's caches there) plus prefilling only the new tokens, to the first token."""
    rows = []
    cache = model.new_cache(device=device, dtype=dtype)
    cold = prefill(model, cache, args.ttft_context + args.ttft_new, chunk=args.chunk, device=device)
    cache.release()
    cache = model.new_cache(device=device, dtype=dtype)
    prefill(model, cache, args.ttft_context, chunk=args.chunk, device=device)
    stored = cache.copy().to("cpu")                             # what the prefix cache holds after the turn
    cache.release()
    del cache
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    cache = model.new_cache(device=device, dtype=dtype)
    cache.load(stored.to(device))
    restore = time.perf_counter() - t0
    warm = restore + prefill(model, cache, args.ttft_new, chunk=args.chunk, device=device)
    cache.release()
    for kind, s in (("TTFT cold", cold), ("TTFT warm", warm)):
        rows.append({"model": name, "budget": label, "routing": "uniform", "kind": kind, "slots": slots,
                     "tok_s": 0, "seconds": s, "restore_seconds": restore, "ceiling_tok_s": 0, "of_ceiling": 0,
                     "hit_rate": 0, "cpu_share": 0, "split": "", "peak_vram_gib": 0, "host_rss_gib": 0})
        print(f"{name:<16} {label:>9} {kind:<12} {s:8.3f} s  (KV restore {restore:.3f} s; "
              f"{args.ttft_context} + {args.ttft_new} tokens)", flush=True)
    return rows


LAPTOP_PCIE_GBPS = 12.0             # a laptop's PCIe 4.0 x8 (issue 10's projection)...
LAPTOP_LINKS_GBPS = LAPTOP_PCIE_GBPS + 60.0     # ...beside DDR5, same dense step


def distinct_per_layer(ids) -> float:
    """ids [S, L, T, K] (S steps or chunks, L layers, T tokens of a call, K experts each) -> the mean number of
    distinct experts one layer call touches: what a cache and a stream see (issue 10 asks for it beside every
    figure: a routing that sends every token to the same few experts flatters both)."""

    ids = np.asarray(ids)
    flat = ids.reshape(ids.shape[0] * ids.shape[1], -1)                     # [S*L, T*K]
    return float(np.mean([len(np.unique(row)) for row in flat])) if flat.size else 0.0


def _fmt(r: dict) -> str:
    distinct = f"  E/layer {r['distinct_per_layer']:>5.1f}" if "distinct_per_layer" in r else ""
    if r.get("dense") == "int8":
        distinct += "  dense int8"
    if r.get("ceiling_read_tok_s"):
        distinct += f"  (read probe: ceiling {r['ceiling_read_tok_s']:.1f}, {100 * r['of_ceiling_read']:.1f}%)"
    if r.get("ceiling_joint_tok_s"):
        distinct += f"  (together: ceiling {r['ceiling_joint_tok_s']:.1f}, {100 * r['of_ceiling_joint']:.1f}%)"
    if r.get("ceiling_partial_tok_s"):
        distinct += (f"  (unpinned layers on the CPU alone: ceiling {r['ceiling_partial_tok_s']:.1f}, "
                     f"{100 * r['of_ceiling_partial']:.1f}%)")
    if r.get("laptop_tok_s"):
        distinct += f"  laptop {r['laptop_tok_s']:>6.1f} tok/s"
    return (f"{r['model']:<16} {r['budget']:>9} {r['routing']:<7} {r['kind']:<18} slots {r['slots']:>5}  "
            f"{r['tok_s']:>9.1f} tok/s  ceiling {r['ceiling_tok_s']:>8.1f}  {100 * r['of_ceiling']:>5.1f}%  "
            f"hit {100 * r['hit_rate']:>5.1f}%  cpu {100 * r['cpu_share']:>5.1f}%  split {r['split']:<8} "
            f"VRAM {r['peak_vram_gib']:>6.2f} GiB  RSS {r['host_rss_gib']:>6.2f} GiB{distinct}")


def cmd_model(args) -> dict:
    import os
    import platform

    from runtime.experts.planner import Hardware, measure_cpu_gbps, measure_h2d_gbps

    hw = Hardware.probe(measure=False)
    h2d = measure_h2d_gbps() if hw.has_cuda else 0.0
    cpu = args.cpu_gbps or measure_cpu_gbps(nbytes=1 << 30)
    hw = Hardware(**{**hw.__dict__, "h2d_gbps": h2d, "cpu_gbps": cpu})
    report = {"machine": platform.node(), "cpus": os.cpu_count(), "gpu": hw.gpu_name, "h2d_gbps": h2d,
              "cpu_gbps": cpu, "torch": torch.__version__}
    print(json.dumps(report), flush=True)
    with torch.inference_mode():
        for name in args.models:
            run_model(name, args, hw, report)
    return report
