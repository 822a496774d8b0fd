"""`freetoken bench`: the hybrid expert tier's benchmarks (runtime/experts/bench.py; results in docs/benchmarks.md).

    freetoken bench probe  [--out DIR]   # pinned H2D and CPU read bandwidth, CPU expert-kernel rates
    freetoken bench hybrid [--out DIR]   # decode/prefill over synthetic full-shape models at VRAM budgets
"""
from __future__ import annotations


def register(sub) -> None:
    from runtime.experts.bench import add_arguments

    p = sub.add_parser("bench", help="measure the hybrid expert tier on this machine (prints a table, writes JSON)")
    add_arguments(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from runtime.experts.bench import run as run_bench

    return run_bench(args)
