"""Where a host-driven decode call's time goes, for a page-locked store and a pageable (staged) one side by side.

    python benchmarks/profile_host_decode.py [--layers 8] [--calls 400] [--slots-share 0.25] [--out prof.json]

The host-driven path (runtime/experts/hybrid.py `_decode`: a sync for the ids, the CPU's misses on the decoding
thread, fetches and promotions through runtime/experts/transport.py) is what a store that could not be page-locked
decodes with. Session 25's mapped row spent ~2.4 ms of a ~4.7 ms layer call outside every timed phase ("other").
This runs the same calls (one token, uniform routing, no dense model) against both stores, in one process, with
the zero-copy path off so both take `_decode`; per store it prints the tier's host line of two runs (and, with
`--profile`, the second's top functions under cProfile), so the two can be compared. (s26b also ran the pageable
store with decode's blocks copied by the ring's eight copy threads: no faster; that option is gone since.)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.experts.bench import SHAPES  # noqa: E402


def run(store, *, slots: int, calls: int, top_k: int, profile: bool, seed: int = 0) -> dict:
    from runtime.experts.bench_model import host_breakdown
    from runtime.experts.hybrid import HybridExperts, HybridOptions
    from runtime.experts.interface import ExpertSpec

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tier = HybridExperts(store, ExpertSpec(), device=dev, dtype=torch.bfloat16,
                         options=HybridOptions(slots=slots, top_k=top_k, zero_copy=False))
    rng = np.random.default_rng(seed)
    e, d = store.num_experts, store.layout.hidden
    x = torch.randn((1, d), dtype=torch.bfloat16, device=dev)
    w = torch.full((1, top_k), 1.0 / top_k, dtype=torch.float32, device=dev)
    ids = [torch.from_numpy(rng.choice(e, top_k, replace=False)[None].astype(np.int64)).to(dev)
           for _ in range(calls)]

    def calls_once():
        for n in range(calls):
            tier(store.layers[n % len(store.layers)], x, ids[n], w)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    calls_once()                                        # warm-up: kernels compiled, ring pinned, pool filled
    before = dict(tier.counters.total.__dict__)
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    calls_once()
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    after = tier.counters.total.__dict__
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    out = {"us_per_call": 1e6 * wall / calls, "host_us": host_breakdown(delta),
           "hit_rate": delta["hits"] / max(1, delta["hits"] + delta["misses"]),
           "cpu_experts_per_call": delta["cpu_experts"] / calls, "fetched_per_call": delta["fetched_experts"] / calls}
    if prof:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
        out["profile"] = text.getvalue()
    tier.close()
    tier.transport.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from runtime.experts.host_store import HostExpertStore

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--calls", type=int, default=400, help="timed layer calls a store (and as many to warm up)")
    ap.add_argument("--slots-share", type=float, default=0.25, help="VRAM slots as a share of the store's blocks")
    ap.add_argument("--stores", nargs="+", default=["pinned", "mapped"], choices=["pinned", "mapped"])
    ap.add_argument("--profile", action="store_true", help="the second run of each under cProfile (decoding thread)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    _, e, k, d, i, codec, group = SHAPES[args.model]
    results = {}
    for kind in args.stores:
        store = HostExpertStore.synthetic(layers=args.layers, num_experts=e, hidden=d, intermediate=i, codec=codec,
                                          group=group, pin=kind == "pinned" and torch.cuda.is_available())
        slots = int(args.slots_share * store.n_blocks)
        plain = run(store, slots=slots, calls=args.calls, top_k=k, profile=False)
        profiled = run(store, slots=slots, calls=args.calls, top_k=k, profile=args.profile)
        results[kind] = {"plain": plain, "profiled": profiled}
        print(f"== {kind} store: {args.layers} layers, {slots} slots; {plain['us_per_call']:.0f} µs a call "
              f"(again {profiled['us_per_call']:.0f}); hit rate {plain['hit_rate']:.2f}, CPU experts "
              f"{plain['cpu_experts_per_call']:.2f}, fetched {plain['fetched_per_call']:.2f} a call", flush=True)
        for r in (plain, profiled):
            print("   host µs: " + "  ".join(f"{key} {v:.0f}" for key, v in r["host_us"].items()), flush=True)
        if args.profile:
            print(profiled["profile"], flush=True)
        del store
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
