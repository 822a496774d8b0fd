"""Round trip of zero-copy decode's CPU share: what a request costs beyond the kernel's own work (issue 10).

    python benchmarks/bench_cpu_share.py [--requests 300] [--threads 1] [--misses 1 8]

The GPU side is played by the main thread with the torch/numpy stand-ins of the handoff and collect kernels
(`cpu_share.handoff_reference`, `collect_reference`), over a mailbox in ordinary memory; the worker is the real
one, serving requests either through Python (`compute` = `CpuExecutor.run`) or in compiled code (`serve_int8`).
A store of the qwen3-30b-a3b expert shape (D 2048, I 768, int4 group 128; 2 layers of 128 experts, beyond the
caches) and one token per request whose `--misses` experts all go to the CPU. Printed per request: the median
round trip, the kernel alone (the executor called directly on the same work), and their difference - the
protocol's overhead, which decides whether the CPU can help the GPU at all (docs/hybrid.md, "Third session").
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    from runtime.experts.cpu_executor import CpuExecutor
    from runtime.experts.cpu_share import CpuShareWorker, Mailbox, collect_reference, handoff_reference
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.interface import ExpertSpec

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--misses", nargs="+", type=int, default=[1, 8])
    p.add_argument("--main-pool", action="store_true",
                   help="run the kernel once on the main thread with every thread first, as the tier's load-time "
                        "compile did before 766334e: the main thread keeps a libgomp pool beside the worker's")
    args = p.parse_args(argv)

    store = HostExpertStore.synthetic(layers=2, num_experts=128, hidden=2048, intermediate=768, codec="int4",
                                      group=128, seed=3)
    cpu = CpuExecutor(store, ExpertSpec(), threads=args.threads)
    import threading

    import numba
    if args.main_pool:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        cpu.run(store.layers[0], torch.zeros(1, 2048), np.zeros(1, np.int64), np.zeros(1, np.int64),
                np.ones(1, np.float32))
    else:
        cpu.warm_up(store.layers[0])
    rng = np.random.default_rng(0)
    table = torch.full((128,), -1, dtype=torch.int64)                   # nothing resident: every expert a miss
    print(f"{'worker':<10} {'misses':>6} {'round trip µs':>14} {'kernel µs':>10} {'overhead µs':>12}")
    for misses in args.misses:
        work = [(i % 2, torch.from_numpy(rng.standard_normal((1, 2048), dtype=np.float32)),
                 torch.from_numpy(rng.choice(128, misses, replace=False)[None].astype(np.int64)),
                 torch.full((1, misses), 1.0 / misses)) for i in range(args.requests)]
        kernel = []

        def time_kernel():
            # in a thread of its own, ended before the workers start: libgomp keeps a pool of threads per thread
            # that ran a parallel region, and a second pool beside the worker's would slow the worker down
            for li, x, ids, w in work:
                t0 = time.perf_counter()
                cpu.run(store.layers[li], x, np.zeros(misses, np.int64), ids[0].numpy(), w[0].numpy())
                kernel.append(time.perf_counter() - t0)

        alone = threading.Thread(target=time_kernel)
        alone.start()
        alone.join()
        for mode in ("python", "compiled"):
            box = Mailbox(max_tokens=4, top_k=misses, hidden=2048, device=torch.device("cpu"), share=1.0)
            worker = CpuShareWorker(box, lambda li, x, tok, e, w: cpu.run(store.layers[li], x, tok, e, w),
                                    int8_args=cpu.int8_args() if mode == "compiled" else None, threads=args.threads)
            trips = []
            for li, x, ids, w in work:
                t0 = time.perf_counter()
                handoff_reference(li, ids, w, x, table, box)
                collect_reference(torch.zeros(1, 2048), box)
                trips.append(time.perf_counter() - t0)
            worker.close()
            rt, kt = statistics.median(trips[10:]) * 1e6, statistics.median(kernel[10:]) * 1e6
            print(f"{mode:<10} {misses:>6} {rt:>14.0f} {kt:>10.0f} {rt - kt:>12.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
