"""What promotions buy in zero-copy decode: hit rate and blocks copied a step, with the adaptive budget and without.

    python benchmarks/bench_promotions.py [--steps 400] [--layers 48] [--experts 128] [--top-k 8] [--slots 1912]
                                          [--blocks-per-step 7] [--block-mb 2.36]

The real tier (`HybridExperts`, zero-copy decode on the CPU device: the same books, policy, admission and
promotion budget as on the GPU) over a store of the model's layer and expert counts with tiny experts, fed the
benchmark's routings (`bench.Router`: uniform, and skewed with temporal locality). Prints, per routing and budget:
the hit rate over the steps after the first quarter, promotions a step, the MB a step they would copy over PCIe
at the real block size (`--block-mb`; qwen3-30b-a3b int4: 2.36), and the budget and yield at the end. The
defaults are the 8 GiB qwen3-30b row's: 1,912 slots, 16 MiB a step = 7 blocks. CPU only; no GPU needed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(routing: str, adaptive: bool, args) -> dict:
    from runtime.experts.bench import Router
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.hybrid import HybridExperts, HybridOptions
    from runtime.experts.interface import ExpertSpec

    store = HostExpertStore.synthetic(layers=args.layers, num_experts=args.experts, hidden=64, intermediate=64,
                                      codec="int4", seed=1)
    tier = HybridExperts(store, ExpertSpec(), device=torch.device("cpu"), dtype=torch.float32, options=HybridOptions(
        slots=args.slots, top_k=args.top_k, zero_copy=True, cpu_share=0.0, fill_pool=True,
        promote_bytes_per_step=args.blocks_per_step * store.block_nbytes, adaptive_promotions=adaptive))
    router = Router(routing, layers=args.layers, experts=args.experts, k=args.top_k, seed=2)
    x, w = torch.randn(1, 64), torch.full((1, args.top_k), 1.0 / args.top_k)
    skip = args.steps // 4
    for step in range(args.steps):
        if step == skip:
            before = tier.counters.total.hits, tier.counters.total.misses, tier.counters.total.promoted_experts
        for layer in store.layers:
            tier._zero_copy_decode(layer, x, torch.from_numpy(router.route(layer, 1)), w)
    tier.begin_step()                                # the last step's books
    tier.end_step()
    c = tier.counters.total
    hits, misses, promoted = c.hits - before[0], c.misses - before[1], c.promoted_experts - before[2]
    steps = args.steps - skip
    budget = tier._promotion_budget
    return {"routing": routing, "adaptive": adaptive, "hit_rate": hits / max(1, hits + misses),
            "promoted_per_step": promoted / steps, "mb_per_step": promoted / steps * args.block_mb,
            "budget": budget.blocks, "yield": budget.yield_ratio}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--slots", type=int, default=1912)
    p.add_argument("--blocks-per-step", type=int, default=7)
    p.add_argument("--block-mb", type=float, default=2.36)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'routing':<8} {'budget':<9} {'hit rate':>8} {'promoted/step':>13} {'MB/step':>8} "
          f"{'end budget':>10} {'yield':>6}", flush=True)
    for routing in ("uniform", "skewed"):
        for adaptive in (False, True):
            r = run(routing, adaptive, args)
            y = "-" if r["yield"] is None else f"{r['yield']:.2f}"
            print(f"{routing:<8} {'adaptive' if adaptive else 'fixed':<9} {r['hit_rate']:>8.1%} "
                  f"{r['promoted_per_step']:>13.2f} {r['mb_per_step']:>8.1f} {r['budget']:>10} {y:>6}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
