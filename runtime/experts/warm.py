"""Compile the CPU expert kernels into numba's cache before a model needs them.

A machine's first load that runs experts on the CPU (a hybrid plan, or no GPU) compiles them inside the load: ~58 s
on the 2-core dev VM, 82 s for the worker's loop alone on the GPU machine's host before 1be4ae6 (docs/hybrid.md,
session 34). numba keys its cache by the CPU and the source, so no install can ship it compiled. The desktop app
runs `freetoken warm-kernels` once per version in the background at a low priority (app/kernel_warmup.py), so the
first load usually finds them compiled. Also `benchmarks/warm_cpu_kernels.py`, which times it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmReport:
    isa: str                    # the dot-product flavour compiled for (cpu_kernels_int8.ISA)
    layers: int
    import_s: float
    layer_kernel_s: float       # the per-call kernel (CpuExecutor), compiled or loaded from the cache
    worker_loop_s: float        # the CPU-share worker's loop and its first answer
    stage_variants: int         # `_stages` compiled in this process (1 on a fresh cache; 0: all from the cache)


def warm_cpu_kernels(layers: int = 48) -> WarmReport:
    """Compile (or load from numba's cache) the int8 CPU kernels and the CPU-share worker's loop, on a tiny random
    store, on the CPU. The kernels' types do not depend on the model's shapes (the layer count only names a
    variant of the worker's buffers, which compiles in well under a second once the rest is cached)."""
    t0 = time.perf_counter()
    import torch

    from runtime.experts import cpu_kernels_int8
    from runtime.experts.cpu_executor import CpuExecutor
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.hybrid import HybridExperts, HybridOptions
    from runtime.experts.interface import ExpertSpec
    from runtime.experts.openmp import load_private_openmp

    load_private_openmp()       # as the tier does before any numba thread exists (else the tier below warns)
    t1 = time.perf_counter()
    store = HostExpertStore.synthetic(layers=layers, num_experts=4, hidden=512, intermediate=512, codec="int4",
                                      group=64, weight_std=0.05, seed=1)
    CpuExecutor(store, ExpertSpec(), threads=1).warm_up(0)
    t2 = time.perf_counter()
    tier = HybridExperts(store, ExpertSpec(), device=torch.device("cpu"), dtype=torch.float32,
                         options=HybridOptions(slots=0, top_k=2, zero_copy=True, cpu_share=1.0))
    try:
        tier(0, torch.randn(1, 512), torch.tensor([[0, 1]]), torch.full((1, 2), 0.5))
    finally:
        tier.close()
    t3 = time.perf_counter()
    return WarmReport(cpu_kernels_int8.ISA, layers, t1 - t0, t2 - t1, t3 - t2,
                      len(cpu_kernels_int8._stages.signatures))
