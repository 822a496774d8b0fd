"""What a batch-1 decode step launches, kernel by kernel (GPU machine), and what its pieces cost in a CUDA graph.

    python benchmarks/profile_decode_step.py [--layers 4] [--context 1024]

Prints: the CUDA kernels of one decode step of the qwen3-30b-a3b shape (eager static path, so every kernel is
visible to the profiler), grouped by name with counts per layer and GPU time; then the replay time of the
recorded step; then two micro-benchmarks that decide the next fusions: decode attention (SDPA with a mask vs
explicit GQA matmuls) and the pool expert kernel at batch 1 (µs per layer, GB/s of expert weights read).
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def record_graph(fn, *, warmup: int = 1) -> "torch.cuda.CUDAGraph":
    """fn recorded as a CUDA graph, after `warmup` eager calls on a side stream (compiles and cuBLAS set-up happen
    there, outside the capture, as runtime/decode_graph.py does)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def best_replay_us(fn, *, calls: int, replays: int) -> float:
    """µs per call of fn (which makes `calls` calls) recorded as one CUDA graph: the best of `replays` replays,
    each timed by CUDA events."""
    g = record_graph(fn)                        # compiled and warmed up outside the capture
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def graph_time(fn, *, repeats: int = 50) -> float:
    """Seconds per call of fn recorded as a CUDA graph (warmed on a side stream first)."""
    g = record_graph(fn, warmup=3)
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def profile_step(layers: int, context: int) -> None:
    from runtime.decode_graph import DecodeGraphs
    from runtime.experts.bench import CONFIGS, SHAPES
    from runtime.experts.bench_model import NoExperts, prefill, random_model
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.hybrid import HybridExperts, HybridOptions
    from runtime.experts.interface import ExpertSpec

    name = "qwen3-30b-a3b"
    _, e, k, d, i, codec, group = SHAPES[name]
    cfg = dict(CONFIGS[name], num_hidden_layers=layers, max_position_embeddings=65536)
    dev = torch.device("cuda")
    model = random_model(cfg, device=dev, dtype=torch.bfloat16)
    store = HostExpertStore.synthetic(layers=layers, num_experts=e, hidden=d, intermediate=i, codec=codec, group=group)
    hybrid = HybridExperts(store, ExpertSpec(), device=dev, dtype=torch.bfloat16, options=HybridOptions(
        slots=layers * e, top_k=k, hot_set=tuple((lay, x) for lay in range(layers) for x in range(e))))
    for label, experts in (("no experts", NoExperts()), ("resident int4 experts", hybrid)):
        model.set_experts(experts)
        cache = model.new_cache(device=dev, dtype=torch.bfloat16)
        with torch.inference_mode():
            prefill(model, cache, context, chunk=8192, device=dev)
            eager = DecodeGraphs(model, device=dev, capture=False)
            for _ in range(3):
                eager.decode(5, cache)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                eager.decode(5, cache)
                torch.cuda.synchronize()
            counts, times = collections.Counter(), collections.Counter()
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    key = ev.name[:70]
                    counts[key] += 1
                    times[key] += ev.device_time_total
            total = sum(counts.values())
            print(f"\n== {label}: {total} kernels per step ({total / layers:.1f} per layer incl. head), "
                  f"GPU busy {sum(times.values()) / 1e3:.3f} ms over {layers} layers")
            for key, n in counts.most_common(40):
                print(f"  {n:5d}  {n / layers:5.1f}/layer  {times[key] / n:8.2f} us  {key}")
            graphs = DecodeGraphs(model, device=dev)
            for _ in range(3):
                graphs.decode(5, cache)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(30):
                graphs.decode(5, cache)
            torch.cuda.synchronize()
            print(f"  recorded step: {(time.perf_counter() - t0) / 30 * 1e3:.3f} ms for {layers} layers "
                  f"({(time.perf_counter() - t0) / 30 / layers * 1e6:.1f} us per layer incl. head)")


def prefill_bench(layers: int, chunk: int = 8192) -> None:
    """Where an 8K-token prefill chunk's time goes with every layer streamed (8 GiB-like: nothing cached):
    the dense work alone, the expert copies alone, and both together (double-buffered: ideally the max)."""
    from runtime.experts.bench import CONFIGS, SHAPES
    from runtime.experts.bench_model import NoExperts, prefill, random_model
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.hybrid import HybridExperts, HybridOptions
    from runtime.experts.interface import ExpertSpec

    name = "qwen3-30b-a3b"
    _, e, k, d, i, codec, group = SHAPES[name]
    cfg = dict(CONFIGS[name], num_hidden_layers=layers, max_position_embeddings=65536)
    dev = torch.device("cuda")
    model = random_model(cfg, device=dev, dtype=torch.bfloat16)
    store = HostExpertStore.synthetic(layers=layers, num_experts=e, hidden=d, intermediate=i, codec=codec, group=group,
                                      pin=True)
    print(f"\n== prefill of one {chunk}-token chunk, {layers} layers, every expert streamed "
          f"(store pinned: {getattr(store, 'pinned', '?')})")
    hybrid = HybridExperts(store, ExpertSpec(), device=dev, dtype=torch.bfloat16, options=HybridOptions(slots=0, top_k=k))
    with torch.inference_mode():
        for label, experts in (("dense only", NoExperts()), ("streamed experts", hybrid)):
            model.set_experts(experts)
            for rep in range(2):
                cache = model.new_cache(device=dev, dtype=torch.bfloat16)
                s = prefill(model, cache, chunk, chunk=chunk, device=dev)
            print(f"  {label:18s} {s * 1e3:8.1f} ms  ({s / layers * 1e3:6.2f} ms per layer)")
        buf = torch.empty((e, store.block_nbytes), dtype=torch.uint8, device=dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in range(layers):
            buf.copy_(torch.from_numpy(store.layer_buffer(layer)).view(e, -1), non_blocking=True)
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        print(f"  {'copies alone':18s} {s * 1e3:8.1f} ms  ({s / layers * 1e3:6.2f} ms per layer, "
              f"{layers * e * store.block_nbytes / s / 1e9:.1f} GB/s)")


def attention_bench() -> None:
    import torch.nn.functional as F
    h, hkv, hd = 32, 4, 128
    print("\n== decode attention, one layer (H 32, Hkv 4, hd 128), recorded in a graph")
    for bucket in (1024, 8192, 32768):
        q = torch.randn(1, h, 1, hd, device="cuda", dtype=torch.bfloat16)
        keys = torch.randn(1, hkv, bucket, hd, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        mask = (torch.arange(bucket, device="cuda") < bucket - 100)[None, :]

        def sdpa():
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

        def explicit():
            qg = q.view(hkv, h // hkv, hd)
            s = torch.bmm(qg, keys[0].transpose(1, 2)) * hd ** -0.5
            s = s.masked_fill(~mask, float("-inf"))
            p = torch.softmax(s.float(), dim=-1).to(values.dtype)
            return torch.bmm(p, values[0])

        print(f"  bucket {bucket:6d}: sdpa {graph_time(sdpa) * 1e6:8.1f} us   explicit {graph_time(explicit) * 1e6:8.1f} us"
              f"   (KV bytes {2 * keys.numel() * 2 / 1e6:.1f} MB)")


def pool_kernel_bench() -> None:
    from runtime.experts.bench import SHAPES
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.interface import ExpertSpec
    from runtime.kernels import int4_pool_triton

    print("\n== pool expert kernels at batch 1 (K=8 distinct experts), recorded in a graph")
    for name in SHAPES:
        _, e, k, d, i, codec, group = SHAPES[name]
        store = HostExpertStore.synthetic(layers=1, num_experts=e, hidden=d, intermediate=i, codec=codec, group=group)
        pool = torch.from_numpy(store.layer_buffer(0).copy()).cuda()
        x = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)
        slots = torch.randperm(e, device="cuda")[:k].view(1, k)
        w = torch.rand(1, k, device="cuda")

        def run():
            return int4_pool_triton.pool_forward_triton(pool, store.layout, ExpertSpec(), x, slots, w)

        t = graph_time(run)
        print(f"  {name:16s} {codec}: {t * 1e6:7.1f} us per layer, {k * store.block_nbytes / t / 1e9:7.1f} GB/s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    a = p.parse_args()
    for part in (lambda: profile_step(a.layers, a.context), lambda: prefill_bench(a.layers), attention_bench,
                 pool_kernel_bench):
        try:
            part()
        except Exception as exc:       # noqa: BLE001  (a diagnostic: report and go on to the next part)
            print(f"  failed: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
