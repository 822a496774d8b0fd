"""Hybrid expert tier benchmarks (run on the GPU machine; every number printed with its VRAM budget).

    freetoken bench probe  [--out DIR]     # bandwidths and CPU expert-kernel rates
    freetoken bench hybrid [--out DIR]     # decode/prefill over synthetic full-shape models
    (or python benchmarks/bench_hybrid.py ...)

`probe` measures what the planner and the CPU-kernel choice rest on: pinned host->device bandwidth (one big
copy, and expert-sized block copies), the CPU's memory read bandwidth, stock torch's CPU kernels for one
expert at batch 1 (bf16 matmul, `_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`), and our numba kernels
over all of a layer's missed experts in one call, at 1..N threads, over a store larger than the caches.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

GB = 1e9
SHAPES = {
    # name: (layers, experts, top_k, hidden, expert width, codec, group)
    "qwen3-30b-a3b": (48, 128, 8, 2048, 768, "int4", 128),
    "qwen3.6-35b-a3b": (40, 256, 8, 2048, 512, "fp4", 32),
}


def _median_time(fn, *, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_bandwidths(report: dict) -> None:
    import numpy as np
    import torch

    from runtime.experts.planner import measure_cpu_gbps, measure_h2d_gbps

    report["cpu_read_gbps_torch_sum"] = measure_cpu_gbps(nbytes=2 << 30)
    big = np.ones(2 << 30 >> 3, dtype=np.float64)
    report["cpu_read_gbps_numpy_sum_1thread"] = big.nbytes / _median_time(big.sum, repeats=3, warmup=1) / GB
    if torch.cuda.is_available():
        report["h2d_gbps_256MiB"] = measure_h2d_gbps(nbytes=256 << 20)
        # expert-sized copies (2.4 MiB), 64 in flight on one stream: what transport really sees
        block = 2_506_752
        src = torch.empty((64, block), dtype=torch.uint8, pin_memory=True)
        dst = torch.empty((64, block), dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()

        def copies():
            with torch.cuda.stream(stream):
                for i in range(64):
                    dst[i].copy_(src[i], non_blocking=True)
            stream.synchronize()
        report["h2d_gbps_expert_blocks"] = 64 * block / _median_time(copies, repeats=10) / GB
        pageable = torch.empty(256 << 20, dtype=torch.uint8)
        d2 = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

        def pageable_copy():
            d2.copy_(pageable)
            torch.cuda.synchronize()
        report["h2d_gbps_pageable"] = (256 << 20) / _median_time(pageable_copy, repeats=5) / GB


def probe_torch_cpu_kernels(report: dict, *, d: int, i: int, threads: int) -> None:
    """One expert (gate, up, down) at M=1 and M=16 through stock torch CPU kernels."""
    import torch

    torch.set_num_threads(threads)
    res = {}
    for m in (1, 16):
        x = torch.randn(m, d, dtype=torch.bfloat16)
        n_sets = 64                                 # rotate over 64 experts so caches do not serve the weights
        ws = [(torch.randn(i, d, dtype=torch.bfloat16), torch.randn(i, d, dtype=torch.bfloat16),
               torch.randn(d, i, dtype=torch.bfloat16)) for _ in range(n_sets)]
        k = iter(range(10 ** 9))

        def bf16():
            g, u, dn = ws[next(k) % n_sets]
            h = torch.nn.functional.silu(torch.nn.functional.linear(x, g)) * torch.nn.functional.linear(x, u)
            torch.nn.functional.linear(h, dn)
        t = _median_time(bf16, repeats=50)
        res[f"bf16_matmul_M{m}"] = {"us_per_expert": t * 1e6, "gbps": 3 * i * d * 2 / t / GB}
        try:
            packs = []
            for g, u, dn in ws[:16]:
                pk = []
                for w in (g, u, dn):
                    q = torch.randint(0, 16, w.shape, dtype=torch.int32)
                    pk.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8))
                packs.append(pk)
            sz = [torch.rand(d // 128, i, 2, dtype=torch.bfloat16), torch.rand(i // 128, d, 2, dtype=torch.bfloat16)]
            k2 = iter(range(10 ** 9))

            def int4():
                pg, pu, pd = packs[next(k2) % 16]
                h = torch.nn.functional.silu(torch.ops.aten._weight_int4pack_mm_for_cpu(x, pg, 128, sz[0])) * \
                    torch.ops.aten._weight_int4pack_mm_for_cpu(x, pu, 128, sz[0])
                torch.ops.aten._weight_int4pack_mm_for_cpu(h, pd, 128, sz[1])
            t = _median_time(int4, repeats=50)
            res[f"int4pack_M{m}"] = {"us_per_expert": t * 1e6, "gbps": 3 * i * d / 2 / t / GB}
        except (RuntimeError, AttributeError) as exc:
            res[f"int4pack_M{m}"] = {"error": str(exc)[:200]}
        try:
            w8 = [(torch.randint(-128, 127, (i, d), dtype=torch.int8), torch.randint(-128, 127, (i, d), dtype=torch.int8),
                   torch.randint(-128, 127, (d, i), dtype=torch.int8)) for _ in range(16)]
            s_i, s_d = torch.rand(i, dtype=torch.bfloat16), torch.rand(d, dtype=torch.bfloat16)
            k3 = iter(range(10 ** 9))

            def int8():
                g, u, dn = w8[next(k3) % 16]
                h = torch.nn.functional.silu(torch.ops.aten._weight_int8pack_mm(x, g, s_i)) * \
                    torch.ops.aten._weight_int8pack_mm(x, u, s_i)
                torch.ops.aten._weight_int8pack_mm(h, dn, s_d)
            t = _median_time(int8, repeats=50)
            res[f"int8pack_M{m}"] = {"us_per_expert": t * 1e6, "gbps": 3 * i * d / t / GB}
        except (RuntimeError, AttributeError) as exc:
            res[f"int8pack_M{m}"] = {"error": str(exc)[:200]}
    report[f"torch_cpu_kernels_{threads}threads"] = res


@functools.cache
def _read_kernel():
    """A parallel sum over uint64 words (compiled once): memory read bandwidth at numba's thread count."""
    import numba
    import numpy as np

    from runtime.experts.openmp import load_private_openmp
    load_private_openmp()                    # the kernels' OpenMP instance, not torch's

    @numba.njit(parallel=True, fastmath=True)
    def total(words):
        acc = np.uint64(0)
        for c in numba.prange(words.shape[0] // 4096):
            s = np.uint64(0)
            b = np.uint64(c * 4096)
            for j in range(4096):              # unsigned index: no wraparound check, so it vectorizes
                s += words[b + np.uint64(j)]
            acc += s
        return acc
    return total


def _numba_read_gbps(store, threads: int) -> float:
    """Memory read bandwidth at `threads` numba threads: a parallel sum over every layer of the store (the
    bar the expert kernels are held to: the same bytes, the same thread pool)."""
    import numba
    import numpy as np

    total = _read_kernel()
    numba.set_num_threads(threads)
    views = [store.layer_buffer(layer).reshape(-1).view(np.uint64) for layer in store.layers]
    total(views[0][:4096])

    def sweep():
        for v in views:
            total(v)
    return store.nbytes / _median_time(sweep, repeats=3, warmup=1) / GB


def probe_numba_kernels(report: dict, *, name: str, layers: int, thread_counts: list[int]) -> None:
    """Our kernels over all of a layer's misses in one call, cycling layers of a store bigger than the caches:
    the int8-activation kernels (the default) and the exact float ones, beside the read bandwidth at the same
    thread count. int4 shapes also run at group 64 (the converter's default) when SHAPES says otherwise."""
    _, e, k, d, i, codec, group = SHAPES[name]
    for g in ([group, 64] if codec == "int4" and group != 64 else [group]):
        key = f"numba_{name}" if g == group else f"numba_{name}_g{g}"
        report[key] = _probe_numba_shape(name=name, group=g, layers=layers, thread_counts=thread_counts)


def _probe_numba_shape(*, name: str, group: int, layers: int, thread_counts: list[int], rounds: int = 3) -> dict:
    import numpy as np
    import torch

    from runtime.experts import cpu_kernels as ck
    from runtime.experts import cpu_kernels_int8 as ck8
    from runtime.experts.cpu_executor import CpuExecutor
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.interface import ExpertSpec

    _, e, k, d, i, codec, _ = SHAPES[name]
    t0 = time.perf_counter()
    store = HostExpertStore.synthetic(layers=layers, num_experts=e, hidden=d, intermediate=i, codec=codec, group=group)
    build_s = time.perf_counter() - t0
    kernels = {"int8": CpuExecutor(store, ExpertSpec(), int8=True), "exact": CpuExecutor(store, ExpertSpec(), int8=False)}
    out = {"store_gb": store.nbytes / GB, "build_s": build_s, "codec": codec, "group": group, "dot_isa": ck8.ISA}
    rng = np.random.default_rng(0)
    steps = 60
    # routing drawn up front: uniform, K distinct experts per token (what the timed loop must not pay for)
    routes = {batch: [(s % layers, np.repeat(np.arange(batch), k),
                       np.stack([rng.choice(e, k, replace=False) for _ in range(batch)]).reshape(-1))
                      for s in range(steps + 1)] for batch in (1, 4)}
    for threads in thread_counts:
        read = max(_numba_read_gbps(store, threads) for _ in range(rounds))
        out[f"read_gbps_threads{threads}"] = read
        ck.numba.set_num_threads(threads)
        for batch in (1, 4):
            x = torch.randn(batch, d)
            w = np.full(batch * k, 1 / k, dtype=np.float32)
            nbytes = sum(len(np.unique(ids)) for _, _, ids in routes[batch][:steps]) * store.block_nbytes
            best = {label: float("inf") for label in kernels}
            for _ in range(rounds):                # interleaved rounds, best kept: a shared machine's noise
                for label, ex in kernels.items():
                    layer, tokens, ids = routes[batch][-1]
                    ex.run(layer, x, tokens, ids, w)                   # compile / warm up
                    t0 = time.perf_counter()
                    for layer, tokens, ids in routes[batch][:steps]:
                        ex.run(layer, x, tokens, ids, w)
                    best[label] = min(best[label], time.perf_counter() - t0)
            for label, dt in best.items():
                gbps = nbytes / dt / GB
                out[f"{label}_batch{batch}_threads{threads}"] = {
                    "us_per_layer": dt / steps * 1e6, "gbps": gbps, "gbps_per_thread": gbps / threads,
                    "of_read_bandwidth": gbps / read}
                print(f"{name} {codec} g{group} {label:5s} b{batch} {threads:3d} thr: {dt / steps * 1e6:8.0f} us/layer "
                      f"{gbps:6.1f} GB/s = {gbps / read:4.0%} of {read:.1f} GB/s read", flush=True)
    out["threading_layer"] = ck.numba.threading_layer()     # omp / tbb / workqueue: launch costs differ 30x
    return out


ROUTINGS = {
    "uniform": "each token picks K distinct experts uniformly at random, per layer (the worst case)",
    "skewed": "Zipf(0.8) popularity over a per-layer random order of experts; 40% of a token's experts repeat "
              "the previous token's at that layer (temporal locality as in published routing traces)",
}


class Router:
    """Controlled routing: [T, K] expert ids per layer, uniform or skewed with temporal locality."""

    def __init__(self, kind: str, *, layers: int, experts: int, k: int, seed: int = 0):
        import numpy as np

        self.kind, self.e, self.k = kind, experts, k
        self.rng = np.random.default_rng(seed)
        ranks = np.arange(1, experts + 1, dtype=np.float64) ** -0.8
        self.p = [np.asarray(ranks[self.rng.permutation(experts)] / ranks.sum()) for _ in range(layers)]
        self.prev: dict[int, "np.ndarray"] = {}

    def route(self, layer: int, t: int):
        import numpy as np

        out = np.empty((t, self.k), dtype=np.int64)
        for i in range(t):
            if self.kind == "uniform":
                out[i] = self.rng.choice(self.e, self.k, replace=False)
                continue
            keep = []
            prev = self.prev.get(layer)
            if prev is not None:
                keep = [int(x) for x in prev if self.rng.random() < 0.4]
            p = self.p[layer].copy()
            p[keep] = 0
            fresh = self.rng.choice(self.e, self.k - len(keep), replace=False, p=p / p.sum())
            out[i] = np.concatenate([np.array(keep, dtype=np.int64), fresh])
            self.prev[layer] = out[i]
        return out


class DenseStandIn:
    """Per-layer dense work at the model's real size (attention projections + router) and the LM head, so
    timings include what the GPU does besides experts. Attention over the KV cache is not modelled."""

    def __init__(self, *, hidden: int, layer_params: int, vocab: int, experts: int, device, dtype):
        import torch

        width = max(1, layer_params // (2 * hidden))       # in and out projections of the layer's dense size
        self.w = torch.randn(hidden, width, device=device, dtype=dtype) * 0.01
        self.back = torch.randn(width, hidden, device=device, dtype=dtype) * 0.01
        self.router = torch.randn(experts, hidden, device=device, dtype=dtype) * 0.01
        self.head = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.01

    def layer(self, h):
        import torch
        torch.softmax(h @ self.router.T, dim=-1)
        return h + (h @ self.w) @ self.back * 0.01

    def lm_head(self, h):
        return (h[-1:] @ self.head.T).argmax(-1)


def run_model_shape(name: str, args, hw, report: dict) -> None:
    import numpy as np
    import torch

    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.hybrid import HybridExperts, HybridOptions
    from runtime.experts.interface import ExpertSpec
    from runtime.experts.planner import GiB, ModelShape, plan_memory
    from runtime.experts.stats import host_rss

    layers, e, k, d, i, codec, group = SHAPES[name]
    layers = args.layers or layers
    cfg = CONFIGS[name]
    cfg = dict(cfg, num_hidden_layers=layers)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    store = HostExpertStore.synthetic(layers=layers, num_experts=e, hidden=d, intermediate=i, codec=codec,
                                      group=group, pin=device.type == "cuda")
    build_s = time.perf_counter() - t0
    shape = ModelShape.from_config(cfg, codec=codec, group_size=group, block_size=group,
                                   block_nbytes=store.block_nbytes)
    spec = ExpertSpec()
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed = int(cfg["vocab_size"]) * d * 2
    dense = DenseStandIn(hidden=d, layer_params=(shape.dense_params - embed) // layers, vocab=int(cfg["vocab_size"]),
                         experts=e, device=device, dtype=dt)
    rows = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def routes(router, steps, t):
        """All steps' routing drawn before timing, on the device: [steps, L, T, K]."""
        r = np.stack([np.stack([router.route(layer, t) for layer in range(layers)]) for _ in range(steps)])
        return torch.from_numpy(r).to(device)

    def forward(experts, ids_all, t, h):
        w = torch.full((t, k), 1.0 / k, device=device, dtype=dt)
        for layer in range(layers):
            h = dense.layer(h)
            if experts is not None:
                h = h + experts(layer, h, ids_all[layer], w) * 0.01
        return dense.lm_head(h)

    # dense-only time per token (the ceiling's fixed part)
    h1 = torch.randn(1, d, device=device, dtype=dt)
    r0 = routes(Router("uniform", layers=layers, experts=e, k=k), 1, 1)[0]
    for _ in range(3):
        forward(None, r0, 1, h1)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        forward(None, r0, 1, h1)
    sync()
    dense_s = (time.perf_counter() - t0) / 10
    for budget_gib in args.budgets:
        budget = None if budget_gib == 0 else int(budget_gib * GiB)
        plan = plan_memory(shape, hw, context_length=8192, max_sequences=4, vram_budget=budget)
        slots = plan.expert_slots if plan.backend != "cpu" else 0
        label = "unlimited" if budget is None else f"{budget_gib:g} GiB"
        for routing in args.routings:
            torch.cuda.empty_cache() if device.type == "cuda" else None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            experts = HybridExperts(store, spec, device=device, dtype=dt, options=HybridOptions(
                slots=slots, top_k=k, cpu_gbps=hw.cpu_gbps, h2d_gbps=hw.h2d_gbps, split=args.split,
                hot_set=tuple((l, x) for l in range(layers) for x in range(e)) if slots >= layers * e else ()))
            for batch in args.batches:
                router = Router(routing, layers=layers, experts=e, k=k, seed=batch)
                all_ids = routes(router, args.warmup + args.tokens, batch)
                h = torch.randn(batch, d, device=device, dtype=dt)
                for step in range(args.warmup):
                    forward(experts, all_ids[step], batch, h)
                sync()
                experts.counters.end_step()
                t0 = time.perf_counter()
                for step in range(args.warmup, args.warmup + args.tokens):
                    forward(experts, all_ids[step], batch, h)
                sync()
                el = time.perf_counter() - t0
                c = experts.counters.end_step()
                miss_bytes_tok = (c["cpu_experts"] + c["fetched_experts"]) * store.block_nbytes / args.tokens
                ceiling_s = miss_bytes_tok / ((hw.h2d_gbps + hw.cpu_gbps) * 1e9) + dense_s
                tok_s = batch * args.tokens / el
                rows.append({"model": name, "budget": label, "routing": routing, "kind": f"decode b{batch}",
                             "slots": slots, "tok_s": tok_s, "ceiling_tok_s": batch / ceiling_s,
                             "of_ceiling": (batch / ceiling_s and tok_s / (batch / ceiling_s)),
                             "hit_rate": c["hit_rate"], "cpu_share": c["cpu_share"],
                             "distinct_per_layer": (c["hits"] + c["misses"]) / (args.tokens * layers),
                             "fetched_per_tok": c["fetched_experts"] / args.tokens,
                             "cpu_per_tok": c["cpu_experts"] / args.tokens,
                             "split": experts.split.mode,
                             "peak_vram_gib": torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else 0,
                             "host_rss_gib": host_rss() / GiB})
                print(_fmt_row(rows[-1]), flush=True)
            if budget_gib in args.prefill_budgets and routing == args.routings[0]:
                for n in args.prefill:
                    router = Router(routing, layers=layers, experts=e, k=k, seed=7)
                    chunk = min(n, args.chunk)
                    x = torch.randn(chunk, d, device=device, dtype=dt)
                    all_ids = routes(router, 1, chunk)[0]        # one chunk's routing, reused per chunk
                    experts.counters.end_step()
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(0, n, chunk):
                        forward(experts, all_ids, chunk, x)
                    sync()
                    el = time.perf_counter() - t0
                    c = experts.counters.end_step()
                    # streaming ceiling: the slower of moving the bytes once and the chunk's expert matmuls
                    moved = c["bytes_h2d"]
                    flops = n * k * 3 * 2 * d * i * layers
                    ceiling_s = max(moved / (hw.h2d_gbps * 1e9) if hw.h2d_gbps else 0.0,
                                    flops / (report["matmul_tflops"] * 1e12) if report.get("matmul_tflops") else 0.0)
                    rows.append({"model": name, "budget": label, "routing": routing, "kind": f"prefill {n}",
                                 "slots": slots, "tok_s": n / el, "ceiling_tok_s": n / ceiling_s if ceiling_s else 0,
                                 "of_ceiling": (ceiling_s / el) if ceiling_s else 0, "hit_rate": c["hit_rate"],
                                 "cpu_share": c["cpu_share"], "distinct_per_layer": 0, "fetched_per_tok": 0,
                                 "cpu_per_tok": 0, "split": "stream" if c["stream_calls"] else experts.split.mode,
                                 "peak_vram_gib": torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else 0,
                                 "host_rss_gib": host_rss() / GiB})
                    print(_fmt_row(rows[-1]), flush=True)
            del experts
    report.setdefault("rows", []).extend(rows)
    report.setdefault("models", {})[name] = {"store_gib": store.nbytes / GiB, "build_s": build_s,
                                             "dense_ms_per_token": dense_s * 1e3, "block_bytes": store.block_nbytes}


def _fmt_row(r: dict) -> str:
    return (f"{r['model']:<16} {r['budget']:>9} {r['routing']:<7} {r['kind']:<13} slots {r['slots']:>5}  "
            f"{r['tok_s']:>8.1f} tok/s  ceiling {r['ceiling_tok_s']:>8.1f}  {100 * r['of_ceiling']:>5.1f}%  "
            f"hit {100 * r['hit_rate']:>5.1f}%  cpu {100 * r['cpu_share']:>5.1f}%  distinct/layer "
            f"{r['distinct_per_layer']:>5.1f}  split {r['split']:<8} VRAM {r['peak_vram_gib']:>6.2f} GiB  "
            f"RSS {r['host_rss_gib']:>6.2f} GiB")


CONFIGS = {
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_experts": 128,
                      "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
                      "vocab_size": 151936, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "tie_word_embeddings": False},
    "qwen3.6-35b-a3b": {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 40, "hidden_size": 2048,
                        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                        "shared_expert_intermediate_size": 512, "vocab_size": 248320, "num_attention_heads": 16,
                        "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
                        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False},
}


def cmd_hybrid(args) -> dict:
    import torch

    from runtime.experts.planner import Hardware, measure_cpu_gbps, measure_h2d_gbps

    hw = Hardware.probe(measure=False)
    h2d = measure_h2d_gbps() if hw.has_cuda else 0.0
    cpu = args.cpu_gbps or measure_cpu_gbps(nbytes=1 << 30)
    hw = Hardware(**{**hw.__dict__, "h2d_gbps": h2d, "cpu_gbps": cpu, "vram_free": hw.vram_free})
    report = {"machine": platform.node(), "cpus": os.cpu_count(), "gpu": hw.gpu_name, "h2d_gbps": h2d,
              "cpu_gbps_used_for_ceiling": cpu, "routings": {r: ROUTINGS[r] for r in args.routings},
              "torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, list, type(None)))}}
    if hw.has_cuda:
        from runtime.experts.bench_model import measure_matmul_tflops
        report["matmul_tflops"] = measure_matmul_tflops(torch.device("cuda"))
    print(json.dumps({k: v for k, v in report.items() if k != "routings"}), flush=True)
    for name in args.models:
        run_model_shape(name, args, hw, report)
        if args.out:                      # keep what was measured even if a later model runs out of time
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "hybrid.partial.json").write_text(json.dumps(report, indent=1))
    return report


def cmd_probe(args) -> dict:
    import torch

    report = {"machine": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    try:
        import numba
        report["numba"] = numba.__version__
        report["numba_threads"] = numba.config.NUMBA_NUM_THREADS
    except ImportError:
        report["numba"] = None
    n = os.cpu_count() or 1
    if not args.only_numba:
        probe_bandwidths(report)
        print(json.dumps(report, indent=1), flush=True)
        probe_torch_cpu_kernels(report, d=2048, i=768, threads=n)
        print(json.dumps(report[f"torch_cpu_kernels_{n}threads"], indent=1), flush=True)
    threads = sorted({1, max(1, n // 4), max(1, n // 2), n})
    for name in SHAPES:
        probe_numba_kernels(report, name=name, layers=args.layers, thread_counts=threads)
        print(json.dumps(report[f"numba_{name}"], indent=1), flush=True)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by this module's main and `freetoken bench`)."""
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe", help="bandwidths and CPU expert-kernel rates")
    p.add_argument("--layers", type=int, default=12, help="layers in the synthetic store (default 12: ~3 GB)")
    p.add_argument("--only-numba", action="store_true", help="only our CPU kernels")
    p.add_argument("--out", type=Path, default=None)
    h = sub.add_parser("hybrid", help="decode and prefill over synthetic full-shape models")
    h.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    h.add_argument("--layers", type=int, default=0, help="fewer layers than the real model (quick runs)")
    h.add_argument("--budgets", nargs="+", type=float, default=[4, 8, 12, 24, 0], help="VRAM budgets in GiB, 0 = unlimited")
    h.add_argument("--routings", nargs="+", default=["uniform", "skewed"], choices=list(ROUTINGS))
    h.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    h.add_argument("--tokens", type=int, default=24, help="measured decode steps per row")
    h.add_argument("--warmup", type=int, default=16)
    h.add_argument("--prefill", nargs="+", type=int, default=[1024, 8192, 16384, 32768])
    h.add_argument("--prefill-budgets", nargs="+", type=float, default=[8, 0])
    h.add_argument("--chunk", type=int, default=8192, help="prefill chunk (tokens)")
    h.add_argument("--split", default="auto", choices=["auto", "cpu", "fetch"])
    h.add_argument("--cpu-gbps", type=float, default=0.0, help="CPU kernel bandwidth for the ceiling (0: measure reads)")
    h.add_argument("--out", type=Path, default=None)
    m = sub.add_parser("model", help="the real model code at a full shape (runtime/experts/bench_model.py): "
                                     "decode (CUDA graphs vs eager), prefill and an agent turn's TTFT at VRAM budgets")
    m.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"], choices=list(SHAPES))
    m.add_argument("--layers", type=int, default=0, help="fewer layers than the real model (quick runs)")
    m.add_argument("--budgets", nargs="+", type=float, default=[4, 8, 12, 24, 0], help="GiB, 0 = unlimited")
    m.add_argument("--routings", nargs="+", default=["uniform", "skewed"], choices=list(ROUTINGS))
    m.add_argument("--tokens", type=int, default=32, help="measured decode steps per row")
    m.add_argument("--warmup", type=int, default=16)
    m.add_argument("--context", type=int, default=512, help="tokens in the KV cache before decode is timed")
    m.add_argument("--chunk", type=int, default=16384,
                   help="prefill chunk (tokens; the engine's on a GPU, planner.PREFILL_CHUNK_TOKENS, since session 29)")
    m.add_argument("--prefill-chunks", nargs="+", type=int, default=None,
                   help="the prefill rows again at each of these chunks (default: --chunk's alone)")
    m.add_argument("--plan-context", type=int, default=0,
                   help="context the rows' plan is made for (0: 8K, or the TTFT conversation's if longer)")
    m.add_argument("--plan-chunks", nargs="+", type=int, default=None,
                   help="the rows again with a plan for each of these prefill chunks (its workspace: fewer slots)")
    m.add_argument("--prefill", nargs="+", type=int, default=[1024, 8192, 16384])
    m.add_argument("--prefill-budgets", nargs="+", type=float, default=[8, 0])
    m.add_argument("--ttft-context", type=int, default=20000, help="the agent turn's conversation (0: skip)")
    m.add_argument("--ttft-new", type=int, default=200, help="new tokens of the resent turn")
    m.add_argument("--cpu-gbps", type=float, default=0.0, help="CPU bandwidth for the ceiling (0: measure reads)")
    m.add_argument("--split", nargs="+", default=["auto"], choices=["auto", "balanced", "cpu", "fetch"],
                   help="how decode misses are split between PCIe and the CPU (auto: learned online); several: "
                        "a decode row for each")
    m.add_argument("--batch", type=int, default=0, help="also a decode row of this many sequences (eager; 0: none)")
    m.add_argument("--modes", nargs="+", default=["graphs", "eager"], choices=["graphs", "eager"],
                   help="decode rows through recorded graphs, the eager forward, or both")
    m.add_argument("--cpu-share", nargs="+", type=_share, default=[None],
                   help="zero-copy decode: the CPU's share of misses: auto (learned from step times, the default), "
                        "a number (fixed), -1 (balance the two bandwidths); several: a row each")
    m.add_argument("--gather", nargs="+", default=["on"], choices=["on", "off"],
                   help="zero-copy decode: missed blocks copied into VRAM by one copy kernel before the pool "
                        "kernels (on) or read in place by them over PCIe (off); both: a row each")
    m.add_argument("--hits", nargs="+", default=["beside"], choices=["beside", "after"],
                   help="zero-copy decode on CUDA: the hits' pool kernels on a stream of their own beside the "
                        "misses' gather (beside) or after it on the step's stream (after); both: a row each")
    m.add_argument("--gather-parts", dest="gather_parts", nargs="+", default=["two"], choices=["two", "one"],
                   help="zero-copy decode on CUDA: the misses' blocks gathered in two parts, the gate/up kernel beside "
                        "the down parts' copy (two), or in one launch before both kernels (one); both: a row each")
    m.add_argument("--expert-split", dest="expert_split", nargs="+", default=["off"], choices=["on", "off"],
                   help="zero-copy decode with a CPU share: a one-token call splits one miss between the sides by "
                        "gate/up rows (on) or hands out whole experts only (off); both: a row each")
    m.add_argument("--collect-warps", dest="collect_warps", nargs="+", type=int, default=[4],
                   choices=[0, 1, 2, 4, 8, 16],       # (handoff_triton.COLLECT_WARPS: not imported, the CLI
                                                       # parser is built for every command and must not load torch)
                   help="zero-copy decode on CUDA: the warps of collect's program a token, one thread polling for the "
                        "CPU's answer (4: s19a's); 0: every warp of 256-column programs polls (sessions 9-18); "
                        "several: a row each")
    m.add_argument("--early-x", dest="early_x", nargs="+", choices=["on", "off"], default=["on"],
                   help="zero-copy decode's CPU worker: a one-token request's x quantized while the lanes ask for "
                        "their first rows (on, the default) or before its plan is published (off); both: a row each")
    m.add_argument("--promotions", nargs="+", default=["adaptive"], choices=["adaptive", "fixed"],
                   help="zero-copy decode: the step's promotion budget learned from what promotions buy (adaptive) "
                        "or always the byte budget's blocks (fixed); both: a row each")
    m.add_argument("--cpu-threads", nargs="+", type=int, default=[0],
                   help="threads of the CPU kernel for rows with a CPU share (0: numba's default, every core); "
                        "several: a row each")
    m.add_argument("--host-wait", nargs="+", choices=("spin", "sleep", "chain"), default=["spin"],
                   help="how the decoding thread waits for each b1 step's token: CUDA's spinning sync, an event "
                        "polled between naps (runtime/host_wait.py), or not at all (chain: each step launched "
                        "while the last still runs: the GPU's time without the host's gap); several: a row each")
    m.add_argument("--trace", type=int, default=0,
                   help="record this many graph decode steps of each hybrid row with torch.profiler (Chrome "
                        "trace, gzipped, under --out)")
    m.add_argument("--profile", type=int, default=0,
                   help="run this many more decode steps of each hybrid row under cProfile and print the decoding "
                        "thread's costliest functions (where the host line's 'other' goes)")
    m.add_argument("--first-load", action="store_true",
                   help="--cpu-share auto: time the learned share from its first step, as a first load decodes (with "
                        "--step-times: per phase), instead of warming it up until it settles")
    m.add_argument("--share-start", nargs="+", default=["balance"],
                   help="where a learned share starts: balance (the two sides' bandwidths, the default) or a number; "
                        "several: a row each")
    m.add_argument("--step-times", action="store_true",
                   help="time every b1 step (warm-up included): medians per phase and the worker's µs a request")
    m.add_argument("--dense-int8", action="store_true",
                   help="dense projections and LM head in int8 (runtime/models/quantized.py), as a hybrid GPU plan loads")
    m.add_argument("--store", default="pinned", choices=["pinned", "mapped"],
                   help="experts page-locked (Linux with RAM to spare) or pageable, staged through the pinned ring "
                        "(what Windows' pinnable half of RAM or a RAM-short host gets)")
    m.add_argument("--pinned-layers", dest="pinned_layers", type=int, default=0,
                   help="with --store mapped: page-lock this many first layers (a plan pinned in part: the GPU "
                        "reads those layers' misses in place, the CPU computes all the others')")
    m.add_argument("--costly-hot", dest="costly_hot", choices=["on", "off"], default="on",
                   help="with --pinned-layers: pin 3/4 of the pool to the unpinned layers' experts, whose misses run "
                        "on the CPU alone (on: what the factory does, hybrid.costly_hot_set), or spread the pool "
                        "evenly (off: before session 27)")
    m.add_argument("--out", type=Path, default=None)


def _share(text: str) -> float | None:
    return None if text == "auto" else float(text)


def run(args) -> int:
    if args.cmd == "model":
        from runtime.experts.bench_model import cmd_model
        report = cmd_model(args)
    else:
        report = cmd_probe(args) if args.cmd == "probe" else cmd_hybrid(args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.cmd}.json").write_text(json.dumps(report, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
