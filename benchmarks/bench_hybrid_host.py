"""Host time per decode-layer call of the hybrid expert tier (CPU-only microbenchmark, issue 10).

What the GPU machine cannot hide behind the device: the Python/numpy bookkeeping of `HybridExperts._decode`
(id transfer, distinct experts, directory lookup, split, fetch allocation, table writes, counters, split
controller) and of `_resident`. The expert compute itself is stubbed out (the CPU kernel and the pool
kernel return a preallocated zero tensor), so the table shows only the per-layer fixed cost that sits on
the critical path between two CUDA-graph pieces. The "pool" is a CPU tensor, as in tests/test_hybrid_*.py.

Routing is controlled: each token takes round(hit * K) of its K experts from the layer's resident half
(a pinned hot set) and the rest from the other half; promotion is off and misses stay on the CPU
(split "cpu"), so every call sees the same hit rate. `--split fetch` puts misses on the fetch path instead
(pool slots churn: allocate, evict, copy, table writes). Blocks are small (hidden 64, width 64: 8 KiB), so
a fetch's copy costs little here: the fetch rows are bookkeeping, not PCIe. The `_resident` rows use a
tier with every expert of every layer pinned (the sync-free path).

    python benchmarks/bench_hybrid_host.py                       # the table
    python benchmarks/bench_hybrid_host.py --save after.json --compare before.json
    python benchmarks/bench_hybrid_host.py --profile 1 0.5       # cProfile of batch 1 at 50 % hits

Shapes: L layers, E experts, K per token, T tokens.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runtime.experts.host_store import HostExpertStore  # noqa: E402
from runtime.experts.hybrid import HybridExperts, HybridOptions  # noqa: E402
from runtime.experts.interface import ExpertSpec  # noqa: E402


def build(*, layers: int, experts: int, top_k: int, split: str, hidden: int, everything: bool = False) -> HybridExperts:
    """A tier whose first half of every layer's experts (or every expert) is pinned in the pool; compute
    stubbed out."""
    store = HostExpertStore.synthetic(layers=layers, num_experts=experts, hidden=hidden, intermediate=64,
                                      codec="int4", group=64)
    resident = experts if everything else experts // 2
    hot = tuple((layer, e) for layer in range(layers) for e in range(resident))
    extra = 2 * top_k * 4 if split == "fetch" else 0          # room for fetched misses to churn through
    hybrid = HybridExperts(store, ExpertSpec(), device="cpu", dtype=torch.float32,
                           options=HybridOptions(slots=len(hot) + extra, top_k=top_k, hot_set=hot, split=split,
                                                 promote_bytes_per_call=0))
    zeros = {}

    def stub(t: int) -> torch.Tensor:
        if t not in zeros:
            zeros[t] = torch.zeros(t, hidden)
        return zeros[t]

    # the compute is not what this measures: both kernels return a preallocated result at once
    hybrid._pool_forward = lambda pool, layout, spec, x, slots, w: stub(x.shape[0])
    hybrid.cpu.run = lambda layer, x, tokens, ids, weights: stub(x.shape[0])
    return hybrid


def routing(rng: np.random.Generator, *, calls: int, tokens: int, experts: int, top_k: int, hit: float):
    """Per call: ids [T, K] (distinct per token) with round(hit * K) from the resident half, and weights."""
    half = experts // 2
    n_hit = int(round(hit * top_k))
    out = []
    for _ in range(calls):
        ids = np.empty((tokens, top_k), dtype=np.int64)
        for t in range(tokens):
            ids[t, :n_hit] = rng.choice(half, n_hit, replace=False)
            ids[t, n_hit:] = half + rng.choice(experts - half, top_k - n_hit, replace=False)
        w = rng.random((tokens, top_k), dtype=np.float32)
        out.append((torch.from_numpy(ids), torch.from_numpy(w / w.sum(1, keepdims=True))))
    return out


def measure(hybrid: HybridExperts, calls: list, *, layers: int, hidden: int) -> dict:
    x = {t: torch.randn(t, hidden) for t in {ids.shape[0] for ids, _ in calls}}
    for i, (ids, w) in enumerate(calls[:200]):                   # warm-up: caches, allocator, numpy paths
        hybrid(i % layers, x[ids.shape[0]], ids, w)
    times = []
    for i, (ids, w) in enumerate(calls):
        xt = x[ids.shape[0]]
        t0 = time.perf_counter_ns()
        hybrid(i % layers, xt, ids, w)
        times.append(time.perf_counter_ns() - t0)
    c = hybrid.counters.total
    return {"median_us": statistics.median(times) / 1e3, "mean_us": statistics.fmean(times) / 1e3,
            "p90_us": float(np.percentile(times, 90)) / 1e3, "hit_rate": round(c.hit_rate, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (the stubbed compute ignores it)")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--split", choices=("cpu", "fetch"), default="cpu")
    ap.add_argument("--save", type=Path, help="write the rows as JSON")
    ap.add_argument("--compare", type=Path, help="a JSON saved earlier (e.g. before a change): printed beside")
    ap.add_argument("--profile", nargs=2, type=float, metavar=("BATCH", "HIT"), help="cProfile one case instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    kw = dict(layers=args.layers, experts=args.experts, top_k=args.top_k, split=args.split, hidden=args.hidden)

    if args.profile:
        batch, hit = int(args.profile[0]), args.profile[1]
        hybrid = build(**kw)
        calls = routing(rng, calls=args.calls, tokens=batch, experts=args.experts, top_k=args.top_k, hit=hit)
        prof = cProfile.Profile()
        prof.enable()
        measure(hybrid, calls, layers=args.layers, hidden=args.hidden)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return 0

    before = {}
    if args.compare:
        before = {(r["batch"], r["hit"], r["path"]): r for r in json.loads(args.compare.read_text())["rows"]}
    rows = []
    for batch in (1, 4):
        for hit in (0.0, 0.25, 0.5, 1.0):
            calls = routing(rng, calls=args.calls, tokens=batch, experts=args.experts, top_k=args.top_k, hit=hit)
            rows.append({"batch": batch, "hit": hit, "path": "_decode",
                         **measure(build(**kw), calls, layers=args.layers, hidden=args.hidden)})
        calls = routing(rng, calls=args.calls, tokens=batch, experts=args.experts, top_k=args.top_k, hit=1.0)
        rows.append({"batch": batch, "hit": 1.0, "path": "_resident",
                     **measure(build(**kw, everything=True), calls, layers=args.layers, hidden=args.hidden)})

    head = f"{'path':<10} {'batch':>5} {'hits':>5} {'measured hit rate':>17} {'median µs':>10} {'mean µs':>8} {'p90 µs':>7}"
    if before:
        head += f" {'before µs':>10} {'speed-up':>8}"
    print(f"host time per layer call ({args.split} split; compute stubbed), {args.calls} calls, "
          f"L={args.layers} E={args.experts} K={args.top_k}")
    print(head)
    for r in rows:
        line = (f"{r['path']:<10} {r['batch']:>5} {r['hit']:>5.0%} {r['hit_rate']:>17.2f} {r['median_us']:>10.1f} "
                f"{r['mean_us']:>8.1f} {r['p90_us']:>7.1f}")
        old = before.get((r["batch"], r["hit"], r["path"]))
        if old:
            line += f" {old['median_us']:>10.1f} {old['median_us'] / r['median_us']:>7.1f}x"
        print(line)
    if args.save:
        args.save.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
