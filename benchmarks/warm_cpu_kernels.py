"""Compile (or load from numba's cache) the CPU expert kernels and the CPU-share worker's loop, and say how long
each took: what a fresh install pays at its first model load (issue 10).

    python benchmarks/warm_cpu_kernels.py [--layers 48]

The kernels' types do not depend on the model's shapes, except the worker's tuple of per-layer buffers, whose
length is the layer count: warm with the model's (qwen3-30b-a3b: 48, qwen3.6-35b-a3b: 40). FREETOKEN_CPU_ISA and
NUMBA_CACHE_DIR pick the flavour and the cache as in the tier. Runs on the CPU; a tiny random store.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=48)
    args = p.parse_args()
    t0 = time.perf_counter()
    from runtime.experts import cpu_kernels_int8
    from runtime.experts.cpu_executor import CpuExecutor
    from runtime.experts.hybrid import HybridExperts, HybridOptions
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.interface import ExpertSpec
    t1 = time.perf_counter()
    store = HostExpertStore.synthetic(layers=args.layers, num_experts=4, hidden=512, intermediate=512,
                                      codec="int4", group=64, weight_std=0.05, seed=1)
    CpuExecutor(store, ExpertSpec(), threads=1).warm_up(0)
    t2 = time.perf_counter()
    tier = HybridExperts(store, ExpertSpec(), device=torch.device("cpu"), dtype=torch.float32,
                         options=HybridOptions(slots=0, top_k=2, zero_copy=True, cpu_share=1.0))
    tier(0, torch.randn(1, 512), torch.tensor([[0, 1]]), torch.full((1, 2), 0.5))
    t3 = time.perf_counter()
    tier.close()
    # the shared stages compile once per distinct call signature (0: every caller came from numba's cache)
    variants = len(cpu_kernels_int8._stages.signatures)
    print(f"CPU kernels ({cpu_kernels_int8.ISA}, {args.layers} layers): import {t1 - t0:.1f} s, layer kernel "
          f"{t2 - t1:.1f} s, worker loop and first answer {t3 - t2:.1f} s; the stages compiled in {variants} "
          "variant(s)")


if __name__ == "__main__":
    main()
