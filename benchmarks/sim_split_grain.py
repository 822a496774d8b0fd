"""How much a split of a layer's misses finer than whole experts could save in zero-copy decode (issue 10).

    python benchmarks/sim_split_grain.py [--hit-rate 0.31] [--k 8]

Why: the handoff gives the CPU round(n_miss x share) whole experts and the GPU the rest, so a layer waits for the
slower side, and with ~5.5 misses a layer one expert is ~20 % of either side's work. A split inside one expert (the
CPU takes the first rows of its intermediate dimension, the GPU the rest; both sum partial down products) would
balance the sides to a fraction of an expert. This prints the expected MoE time of a layer under three rules, over
the binomial number of misses at batch 1 (K distinct experts, each a hit with the pool's hit rate), with the
per-expert costs measured on the H200 (docs/benchmarks.md, thirteenth and fourteenth passes): the CPU request
12 + 39 µs an expert (1-3 experts cold: 51, 90, 128 µs), the GPU's gather 55 µs an expert (2.5 MB at ~45 GB/s)
plus 17 µs of pool kernels and launches. A model of the costs, not a measurement of a split that does not exist.
"""
from __future__ import annotations

import argparse
from math import comb


def cpu_us(experts: float) -> float:
    return 0.0 if experts <= 0 else 12.0 + 39.0 * experts


def gpu_us(experts: float) -> float:
    return 0.0 if experts <= 0 else 17.0 + 55.0 * experts


def layer_us(n: int, *, rule: str, share: float = 0.6, grain: int = 6) -> float:
    """A layer's MoE time (the slower side) for n misses: the handoff's rule at `share`, the best whole-expert
    split, or the best split in steps of 1/grain of an expert (6: the int4 g128 groups of I = 768)."""
    if rule == "handoff":
        c = int(n * share + 0.5)
        return max(cpu_us(c), gpu_us(n - c))
    if rule == "whole":
        return min(max(cpu_us(c), gpu_us(n - c)) for c in range(n + 1))
    return min(max(cpu_us(c / grain), gpu_us(n - c / grain)) for c in range(grain * n + 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hit-rate", type=float, default=0.31, help="the pool's hit rate (8 GiB row: 0.31)")
    p.add_argument("--k", type=int, default=8, help="experts a token (distinct at batch 1)")
    args = p.parse_args(argv)
    miss = 1.0 - args.hit_rate
    weights = [comb(args.k, n) * miss ** n * (1 - miss) ** (args.k - n) for n in range(args.k + 1)]
    print(f"{'rule':<34} {'µs a layer (MoE part)':>22}")
    for label, kw in [(f"handoff, share {s}", dict(rule="handoff", share=s)) for s in (0.4, 0.5, 0.6, 0.7)] + [
            ("best whole-expert split", dict(rule="whole")), ("best split in 1/6 of an expert", dict(rule="fine"))]:
        mean = sum(w * layer_us(n, **kw) for n, w in enumerate(weights))
        print(f"{label:<34} {mean:>22.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
