"""The CPU expert kernel with one thread copying host memory beside it (the staging ring's), by kernel threads.

    python benchmarks/bench_kernel_beside_copy.py [--threads N M] [--calls 60] [--out res.json]

A host-driven decode call runs a layer's misses in one parallel kernel call while, from a pageable store, the
staging ring's thread copies promotions into page-locked memory (runtime/experts/staging.py). With the kernel on
every core that thread takes a core from one of the kernel's, and a parallel region waits for its slowest thread:
s26b measured such calls at ~180-250 µs an expert on the GPU host against ~30 in the kernel's probe. This times one
token's 8 experts of a qwen3-30b layer (the kernel's threads as given; default: every core, and one fewer) with
and without a thread copying 3 blocks at a time beside it, and prints median, mean and p90 µs a call.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.experts.bench import SHAPES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from runtime.experts.cpu_executor import CpuExecutor
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.interface import ExpertSpec

    cores = os.cpu_count() or 1
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--threads", nargs="+", type=int, default=sorted({cores, max(1, cores - 1)}, reverse=True))
    ap.add_argument("--calls", type=int, default=60, help="timed calls a cell (after 10 untimed)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    _, e, k, d, i, codec, group = SHAPES[args.model]
    store = HostExpertStore.synthetic(layers=2, num_experts=e, hidden=d, intermediate=i, codec=codec, group=group)
    ex = CpuExecutor(store, ExpertSpec())
    ex.warm_up(store.layers[0])
    x = torch.randn(1, d)
    rng = np.random.default_rng(0)

    def call(threads: int) -> float:
        experts = rng.choice(e, k, replace=False).astype(np.int64)
        t0 = time.perf_counter()
        ex.run(store.layers[int(rng.integers(2))], x, np.zeros(k, np.int64), experts, np.full(k, 1 / k, np.float32),
               threads=threads)
        return time.perf_counter() - t0

    stop = threading.Event()

    def copier():                      # the ring's thread: 3 blocks at a time (8 MiB of promotions a call)
        src, dst, n = store.layer_buffer(0), np.empty((3, store.block_nbytes), np.uint8), 0
        while not stop.is_set():
            for j in range(3):
                np.copyto(dst[j], src[(n + j) % e])
            n += 3

    rows = []
    print(f"{args.model}: a token's {k} experts, {cores} cores; µs a call")
    print(f"{'threads':>7} {'copier':>6} {'median':>7} {'mean':>7} {'p90':>7}")
    for threads in args.threads:
        for busy in (False, True):
            stop.clear()
            th = threading.Thread(target=copier, daemon=True) if busy else None
            if th:
                th.start()
            ts = [call(threads) for _ in range(args.calls + 10)][10:]
            stop.set()
            if th:
                th.join()
            us = [1e6 * t for t in ts]
            rows.append({"threads": threads, "copier": busy, "median_us": statistics.median(us),
                         "mean_us": statistics.mean(us), "p90_us": float(np.percentile(us, 90))})
            r = rows[-1]
            print(f"{threads:>7} {'on' if busy else 'off':>6} {r['median_us']:>7.0f} {r['mean_us']:>7.0f} "
                  f"{r['p90_us']:>7.0f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "cores": cores, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
