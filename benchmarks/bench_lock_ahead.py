"""Does page-locking host memory on another thread slow the thread that drives the GPU?

The prefix cache's copies land in page-locked memory (runtime/host_arena.py); locking fresh memory runs at
~2.8 GB/s (s33a), so a conversation's first store spends ~0.35 s a GB inside an engine step (qwen3.6's 30K
snapshot: 0.54 s of its time to first token, s33b). Locking ahead, on another thread while the prompt prefills,
would take that out of the step - unless the lock holds the CUDA driver (or Python's GIL) against the engine's
thread. This replays a decode-like CUDA graph (48 small GEMMs, then a sync and a little Python work, as a decode
step does) while another thread locks N slabs, by each way the arena could lock them, and prints the step times.

    python3 benchmarks/bench_lock_ahead.py --slabs 12 --slab-mib 256
"""
import argparse
import json
import statistics
import threading
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))       # the repository, for runtime/


def lock_cuda_host_alloc(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)      # torch's pinned allocator: cudaHostAlloc


def lock_host_register(nbytes: int) -> torch.Tensor:
    """Ordinary memory, touched, then registered with the driver (what pinned_use_cuda_host_register does)."""
    t = torch.zeros(nbytes, dtype=torch.uint8)
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister returned {rc}")
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slabs", type=int, default=12)
    ap.add_argument("--slab-mib", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(48)]

    def layers():
        h = x
        for w in ws:
            h = h @ w
        return h

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            layers()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()

    def step() -> None:
        graph.replay()
        torch.cuda.synchronize()
        sum(range(3000))                                  # the engine's Python between steps (sampling, events)

    for _ in range(50):
        step()
    rows, keep = [], []
    from runtime.host_arena import registered_slab
    ways = [("none", None), ("cudaHostAlloc (torch pinned)", lock_cuda_host_alloc),
            ("touch + cudaHostRegister", lock_host_register),
            ("the arena's registered_slab (private mapping, huge pages)", registered_slab)]
    for name, lock in ways:
        done = threading.Event()
        bg = {"seconds": 0.0, "bytes": 0}

        def locker():
            t0 = time.perf_counter()
            for _ in range(a.slabs):
                keep.append(lock(a.slab_mib << 20))
                bg["bytes"] += a.slab_mib << 20
            bg["seconds"] = time.perf_counter() - t0
            done.set()

        times = []
        thread = threading.Thread(target=locker, daemon=True) if lock else None
        if thread:
            thread.start()
        t_start = time.perf_counter()
        while True:                   # without a locker: --steps steps; with one: for as long as it locks
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            if (done.is_set() if thread else len(times) >= a.steps):
                break
        span = time.perf_counter() - t_start
        if thread:
            thread.join()
        times.sort()
        rows.append({"background": name, "steps": len(times), "span_s": round(span, 3),
                     "p50_ms": round(statistics.median(times) * 1e3, 3),
                     "p99_ms": round(times[int(0.99 * (len(times) - 1))] * 1e3, 3),
                     "max_ms": round(times[-1] * 1e3, 3),
                     "locked_GB": round(bg["bytes"] / 1e9, 3), "lock_s": round(bg["seconds"], 3),
                     "lock_GBps": round(bg["bytes"] / 1e9 / bg["seconds"], 2) if bg["seconds"] else None})
    print("| on another thread | decode-like steps | p50 ms | p99 ms | max ms | GB locked | in s | GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['background']} | {r['steps']} | {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} | "
              f"{r['locked_GB']} | {r['lock_s']} | {r['lock_GBps']} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
