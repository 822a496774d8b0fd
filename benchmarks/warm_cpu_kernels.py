"""Compile (or load from numba's cache) the CPU expert kernels and the CPU-share worker's loop, and say how long
each took: what a fresh install pays at its first model load (issue 10).

    python benchmarks/warm_cpu_kernels.py [--layers 48]

FREETOKEN_CPU_ISA and NUMBA_CACHE_DIR pick the flavour and the cache as in the tier. Runs on the CPU; a tiny
random store (runtime/experts/warm.py, which the app's background warm-up runs too).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=48)
    args = p.parse_args()
    from runtime.experts.warm import warm_cpu_kernels

    r = warm_cpu_kernels(args.layers)
    print(f"CPU kernels ({r.isa}, {r.layers} layers): import {r.import_s:.1f} s, layer kernel "
          f"{r.layer_kernel_s:.1f} s, worker loop and first answer {r.worker_loop_s:.1f} s; the stages compiled in "
          f"{r.stage_variants} variant(s)")


if __name__ == "__main__":
    main()
