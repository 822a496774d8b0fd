"""One thread's speed on the kernel's serial code, alone and beside spinning threads (issue 10, session 8).

    python benchmarks/bench_serial_speed.py [--spinners 0 13]

Run r found a CPU-share request's serial start (~60-100 µs: a counting sort of a few assignments and views of
kept scratch) and each task (~20 µs for 32 KB of weights in cache) 5-10x slower on the GPU machine's host than
on the dev VM. This times the activations' int8 quantisation of one 2048-wide row (`_quantize_row`) on one
thread, alone and while `--spinners` other threads spin on an atomic load (as the kernel's idle lanes and the
worker's poll do), and right after a parallel region of `--lanes` threads (whose team then waits in libgomp, as
between the kernel's requests): if it is slow alone, the cores are slow; if only beside spinners or after a
region, they interfere.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    from numba import njit

    import numba
    from numba import prange

    from runtime.experts.cpu_kernels_int8 import _cycles, _load_acquire, _quantize_row
    from runtime.experts.cpu_share import _cycle_rate
    from runtime.experts.openmp import load_private_openmp
    load_private_openmp()

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spinners", nargs="+", type=int, default=[0, 13])
    p.add_argument("--reps", type=int, default=20000)
    p.add_argument("--lanes", nargs="+", type=int, default=[14])
    args = p.parse_args(argv)

    @njit(nogil=True)
    def quantize_many(x, xq, xs, xm, reps):
        for _ in range(reps):
            _quantize_row(x, 0, 128, xq, xs, xm)

    @njit(nogil=True)
    def spin(flag):
        n = 0
        while _load_acquire(flag, 0) == 0:
            n += 1
        return n

    @njit(parallel=True)
    def region(a):
        for j in prange(a.shape[0]):
            a[j] += 1.0

    @njit(nogil=True)
    def quantize_after(x, xq, xs, xm, reps, a):
        total = 0
        for _ in range(reps):
            region(a)
            c0 = _cycles()
            _quantize_row(x, 0, 128, xq, xs, xm)
            total += _cycles() - c0
        return total

    x = np.random.default_rng(0).standard_normal((1, 2048)).astype(np.float32)
    xq, xs, xm = np.empty(2048, np.int8), np.empty(16, np.float32), np.empty(16, np.float32)
    quantize_many(x, xq, xs, xm, 1)
    flag = np.zeros(1, dtype=np.int64)
    spin(np.ones(1, dtype=np.int64))
    print(f"{'spinners':>8} {'µs per 2048-wide row':>22}", flush=True)
    for n in args.spinners:
        flag[0] = 0
        threads = [threading.Thread(target=spin, args=(flag,)) for _ in range(n)]
        for th in threads:
            th.start()
        time.sleep(0.05)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            quantize_many(x, xq, xs, xm, args.reps)
            best = min(best, (time.perf_counter() - t0) / args.reps)
        flag[0] = 1
        for th in threads:
            th.join()
        print(f"{n:>8} {best * 1e6:>22.2f}", flush=True)
    rate = _cycle_rate()
    print(f"{'lanes':>8} {'µs per row right after a region':>32}", flush=True)
    for lanes in args.lanes:
        def after():
            numba.set_num_threads(min(lanes, numba.config.NUMBA_NUM_THREADS))
            a = np.zeros(1024, dtype=np.float64)
            quantize_after(x, xq, xs, xm, 10, a)
            reps = max(1, args.reps // 10)
            out.append(quantize_after(x, xq, xs, xm, reps, a) / reps / rate if rate else float("nan"))
        out: list[float] = []
        th = threading.Thread(target=after)         # its own thread: the region's pool ends with it
        th.start()
        th.join()
        print(f"{lanes:>8} {out[0] * 1e6:>32.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
