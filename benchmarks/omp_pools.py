"""What a second libgomp pool costs a thread's parallel regions (the CPU-share worker's situation).

    python benchmarks/omp_pools.py MAIN_THREADS WORKER_THREADS [torch] [private]
    python benchmarks/omp_pools.py alternate THREADS [private]

numba's OpenMP layer gives every thread that runs a parallel region its own pool of threads, kept until that
thread ends. libgomp counts the threads of every pool; once they outnumber the cores it stops spinning between
regions ("throttled"), so each region wakes its sleeping threads. Here a worker thread runs 300 small parallel
regions 0.4 ms apart (a decode step's layer calls) after the main thread ran one with MAIN_THREADS threads (1: no
main pool). Prints the median and p90 µs per region. The hybrid tier's load-time compile used to leave such a
main pool (fixed in 766334e: it now runs on one thread).

`torch`: the main thread's pool is torch's intra-op pool instead (a torch reduction on MAIN_THREADS threads, as
the planner's bandwidth probe runs one). torch's wheel ships its own libgomp in the global symbol scope, and
numba's OpenMP calls bind to it, so the two runtimes' pools are counted together. `private`: numba's OpenMP
layer is loaded first with `runtime.experts.openmp.load_private_openmp` (its own libgomp), as the expert
kernels now do.

`alternate`: a CPU engine's pattern instead - one thread alternates a torch op and a numba region on THREADS
threads each (a dense layer, then its experts), 300 times; prints µs per pair. With one shared libgomp the two
pools throttle each other (wake-ups); with two instances each one's threads spin after its region while the
other's run. This is why the private binding is only taken where the CPU-share worker runs (zero-copy decode on
a GPU, where torch runs no CPU ops between layers).
"""
from __future__ import annotations

import sys
import threading
import time

import numba
import numpy as np
from numba import njit, prange

REGIONS = 300
GAP_S = 0.0004              # between regions: the GPU's part of a layer at 8 GiB


@njit(parallel=True, nogil=True)
def _work(a):
    s = 0.0
    for i in prange(a.shape[0]):
        s += a[i] * 2.0
    return s


def _median_p90(times: list[float]) -> str:
    times = sorted(times)
    return f"median {1e6 * times[len(times) // 2]:.1f} µs, p90 {1e6 * times[int(0.9 * len(times))]:.1f} µs"


def alternate(threads: int, private: bool) -> int:
    import torch
    if private:
        from runtime.experts.openmp import load_private_openmp
        print("numba's OpenMP layer:", load_private_openmp())
    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    a, w, x = np.ones(200_000), torch.randn(512, 512), torch.randn(64, 512)
    _work(a)
    times = []
    for _ in range(REGIONS):
        t0 = time.perf_counter()
        torch.mm(x, w)
        _work(a)
        times.append(time.perf_counter() - t0)
    print(f"threading layer {numba.threading_layer()}; torch op + numba region on {threads} threads each"
          f"{', numba private' if private else ', one libgomp'}: {_median_p90(times)} per pair")
    return 0


def main(argv: list[str]) -> int:
    if argv[0] == "alternate":
        return alternate(int(argv[1]), "private" in argv[2:])
    main_threads, worker_threads = int(argv[0]), int(argv[1])
    torch_main, private = "torch" in argv[2:], "private" in argv[2:]
    if private:
        from runtime.experts.openmp import load_private_openmp
        print("numba's OpenMP layer:", load_private_openmp())
    a = np.ones(20000)
    if torch_main:
        import torch
        torch.set_num_threads(main_threads)
        torch.ones(1 << 24).sum()               # torch's pool, kept by the main thread
        numba.set_num_threads(1)
    else:
        numba.set_num_threads(main_threads)
    _work(a)                                    # compiles; with main_threads > 1 the main thread keeps a pool
    times: list[float] = []

    def worker() -> None:
        numba.set_num_threads(worker_threads)
        for _ in range(REGIONS):
            t0 = time.perf_counter()
            _work(a)
            times.append(time.perf_counter() - t0)
            until = time.perf_counter() + GAP_S
            while time.perf_counter() < until:
                pass

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    print(f"threading layer {numba.threading_layer()}; main pool of {main_threads}{' (torch)' if torch_main else ''}"
          f"{', numba private' if private else ''}, worker pool of {worker_threads}: {_median_p90(times)} per region")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["1", "2"]))
