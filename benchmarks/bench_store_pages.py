"""The CPU-share worker over a store in 2 MiB pages against the same store in 4 KiB pages (issue 10, session 20).

    python benchmarks/bench_store_pages.py [--model qwen3-30b-a3b] [--layers 48] [--experts 3 8] [--threads 14]
                                           [--rounds 4] [--json PATH]

Why: until session 20 every store on the GPU machine sat in 4 KiB pages (`HostBuffer` mapped MAP_SHARED, which
Linux backs with shmem and keeps out of transparent huge pages). A decode request reads a few experts of ~2.4 MB
each at places scattered over a 14 GB store: in 4 KiB pages every 4 KiB of a row is a new page-table walk for a
TLB that holds a few MB; in 2 MiB pages, one walk an expert part. Two stores of the model's full shape are built
side by side in one process (one with MADV_HUGEPAGE, one with MADV_NOHUGEPAGE; both private anonymous memory,
filled alike), then the real worker (the compiled serving loop decode's CPU share runs in) answers one-token
requests of `experts` cold experts over each, alternating store by store `rounds` times so that a host's drift
falls on both. Prints each store's huge pages and a table of the worker's µs a request and GB/s.
Prediction (before it ran): 2 MiB pages 5-15 % faster at 8 experts, more at 3 (fewer bytes over the same walks).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 1 << 30


def build(model: str, layers: int | None, huge: bool):
    from runtime.experts.bench_model import SHAPES
    from runtime.experts.host_store import HostExpertStore

    n_layers, e, k, d, i, codec, group = SHAPES[model]
    return HostExpertStore.synthetic(layers=layers or n_layers, num_experts=e, hidden=d, intermediate=i,
                                     codec=codec, group=group, huge_pages=huge), k


def worker_seconds(store, *, top_k: int, experts: int, threads: int, seed: int) -> float:
    """The worker's own mean seconds a request (cycle counter), `experts` cold misses of a `top_k` row each: one
    round of the ceiling's measurement (`bench_model.cpu_kernel_gbps`), turned back into seconds."""
    from runtime.experts.bench_model import cpu_kernel_gbps

    gbps = cpu_kernel_gbps(store, top_k=top_k, experts=experts, threads=threads, rounds=1, seed=seed)
    return experts * store.block_nbytes / (gbps * 1e9) if gbps else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model's (a quick check)")
    ap.add_argument("--experts", type=int, nargs="+", default=[3, 8], help="cold experts a request")
    ap.add_argument("--threads", type=int, default=None, help="the worker's threads (default: the tier's)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from runtime.experts.cpu_share import default_worker_threads

    threads = args.threads or default_worker_threads()
    stores = {}
    for pages, huge in (("2 MiB", True), ("4 KiB", False)):
        store, k = build(args.model, args.layers, huge)
        got = store.huge_page_bytes()
        print(f"{args.model} store in {pages} pages asked: {store.nbytes / GIB:.2f} GiB, "
              f"{(got or 0) / GIB:.2f} GiB in transparent huge pages", flush=True)
        stores[pages] = store
    block = stores["2 MiB"].block_nbytes
    seconds = {(p, n): [] for p in stores for n in args.experts}
    for r in range(args.rounds):
        for n in args.experts:
            for pages, store in (stores.items() if r % 2 == 0 else reversed(stores.items())):
                seconds[(pages, n)].append(worker_seconds(store, top_k=k, experts=n, threads=threads, seed=r))
    print(f"\n{'pages':>6} {'experts':>7} {'µs a request (median)':>22} {'GB/s':>6}   every round's µs")
    rows = []
    for n in args.experts:
        for pages in stores:
            s = seconds[(pages, n)]
            med = statistics.median(s)
            gbps = n * block / med / 1e9
            rows.append({"pages": pages, "experts": n, "us": med * 1e6, "gbps": gbps, "rounds_us": [x * 1e6 for x in s]})
            print(f"{pages:>6} {n:>7} {med * 1e6:>22.1f} {gbps:>6.1f}   " + " ".join(f"{x * 1e6:.1f}" for x in s))
        a, b = statistics.median(seconds[("4 KiB", n)]), statistics.median(seconds[("2 MiB", n)])
        print(f"{'':>6} {n:>7} 2 MiB pages {100 * (a / b - 1):+.1f} % requests a second")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "threads": threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
