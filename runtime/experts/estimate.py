"""How fast a plan decodes: the one calibrated estimate the load's plan and the library's fit badge both show.

Decode at batch 1 is bandwidth-bound: per token the missed experts are read by the CPU kernel (and fetched over
PCIe, which adds bandwidth), the cached experts and the dense weights by the GPU, and every layer adds a fixed
cost (kernel gaps, small kernels) that no bandwidth hides. `CostModel` holds the efficiencies that turn the
machine's peak rates into real ones, each pair calibrated from measured rows (docs/library.md, "Calibration",
says which and how to refit them). Until session 29 the plan carried its own figure - miss bytes over the sum of
the two links, with no dense time and no per-layer cost - and printed 393 tok/s at load for a qwen3.6 plan that
decodes at ~106: one estimate now, in one place.
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class CostModel:
    """Peak rates x efficiencies (slow end, fast end). Every pair is a calibration; see docs/library.md."""
    # Refitted on the fourteenth hybrid pass (docs/hybrid.md, "Fourteenth session"; H200 + 16-core Xeon,
    # 2026-12-03, commits 877e2fd-d619f4c): the decode ranges bracket the measured rows, qwen3-30b-a3b int4 b1
    # 70.3-82.8 tok/s at 4 GiB, 84.5-98.0 at 8 GiB, 272-301 all in VRAM (sessions 4-6), qwen3.6-35b-a3b MXFP4 at
    # 8 GiB 93.4-98.0; prefill (fourth pass) at 8 GiB 19,019 (16K) - 21,636 (8K) tok/s. Checked again in session 29
    # against the H100 hosts' later rows (qwen3-30b-a3b 8 GiB 108.8-110.9, qwen3.6-35b-a3b 106.3 at ~101 GB/s read,
    # 55.1 GB/s PCIe): still bracketed, no refit. Re-fit when those rows change (docs/library.md).
    # Share of the machine's measured memory-read bandwidth the CPU expert kernel reaches when the CPU computes
    # every miss (CPU-only plans; first pass: 21.8 of 106 GB/s at 16 threads, whole steps at 14% of their
    # ceiling; not re-measured since the int8 kernel).
    cpu_kernel_efficiency: tuple[float, float] = (0.14, 0.21)
    # ...and the bandwidth a GPU plan's CPU share adds beside the GPU's own reads. Refitted in session 14: the
    # worker took 40-50 % of the misses at ~55 GB/s of the H200 host's ~88 GB/s read (a decode request of ~3
    # experts), where session 4's share added 3-6 %.
    cpu_share_efficiency: tuple[float, float] = (0.40, 0.55)
    # Share of the PCIe link estimate (lanes x per-lane rate) that decode's missed experts reach: the zero-copy
    # gather kernel moves 48.8 GB/s with its compute on the H200's 51.2 GB/s estimate.
    h2d_efficiency: tuple[float, float] = (0.93, 0.97)
    # Share of peak VRAM bandwidth a batch-1 decode step reaches (small GEMVs, attention, launches).
    gpu_bandwidth_efficiency: tuple[float, float] = (0.45, 0.75)
    # Fixed cost of one MoE layer in a decode step beyond its bytes (kernel gaps inside the step's CUDA graph,
    # small kernels), seconds: (slow end, fast end). It is what bounds the all-in-VRAM rows.
    decode_layer_overhead_s: tuple[float, float] = (0.060e-3, 0.040e-3)
    # ...and what a linear-attention (Gated DeltaNet) layer adds to it: its convolution and recurrent-state update
    # kernels. qwen3.6-35b-a3b's recorded dense step (experts costing nothing) took 3.9 ms for 40 layers against
    # qwen3-30b-a3b's 2.2 ms for 48 (session 14's ceilings): ~70 µs a GDN layer more.
    linear_layer_overhead_s: tuple[float, float] = (0.080e-3, 0.060e-3)
    # Share of the PCIe link that layer-by-layer expert streaming reaches in prefill (per uncached byte), the chunk's
    # compute that does not overlap the stream included. Session 29 widened the slow end from 0.55 to 0.42: 16K chunks
    # (the default since) are closer to compute-bound - qwen3-30b at 8 GiB, a 16K prompt 30,397 tok/s in one 16K
    # chunk against ~0.28 s of link (0.52 of it); in 8K chunks 16,653-18,366 (0.55-0.61)
    prefill_stream_efficiency: tuple[float, float] = (0.42, 0.65)
    # Dense bf16 tensor throughput for prefill when NVML cannot tell (TFLOP/s), and the share reached.
    gpu_tflops_default: float = 40.0
    gpu_flops_efficiency: tuple[float, float] = (0.30, 0.60)
    # CPU matmul throughput per physical core (GFLOP/s) for CPU-only prefill: AVX2 low, AVX-512/AMX high.
    cpu_gflops_per_core: tuple[float, float] = (20.0, 80.0)
    # VRAM bandwidth assumed when NVML cannot tell (GB/s).
    gpu_gbps_default: float = 300.0
    # Page-cache misses over the mapped expert file when RAM cannot hold every expert (GB/s): a SATA SSD
    # to a good NVMe drive, reading whole 4 KiB-aligned expert blocks.
    disk_gbps: tuple[float, float] = (0.5, 3.0)


def decode_range(shape, plan, hw, *, gpu_gbps: float = 0.0, cost: CostModel = CostModel()) -> tuple[float, float]:
    """tokens/s at batch 1 under uniform routing: (slow end, fast end); (0, 0) when the CPU's read bandwidth is
    unknown. `shape`: planner.ModelShape, `plan`: planner.Plan, `hw`: planner.Hardware (its cpu_gbps is the
    machine's measured read bandwidth, h2d_gbps the link's); `gpu_gbps`: peak VRAM bandwidth (else hw.vram_gbps,
    else the cost model's default).

    Misses: CPU kernel + PCIe fetches in parallel; hits and dense weights: VRAM bandwidth; the two sides overlap
    at best (fast end) or add up (slow end). A hybrid plan is never faster than the same model all in VRAM."""
    if hw.cpu_gbps <= 0 or plan.backend == "does_not_fit":
        return 0.0, 0.0
    gpu_gbps = gpu_gbps or hw.vram_gbps or cost.gpu_gbps_default
    total = shape.total_experts or 1
    per_token_blocks = shape.moe_layers * shape.top_k
    miss_share = 1.0 - plan.expert_slots / total
    miss_bytes = per_token_blocks * miss_share * shape.expert_block_bytes
    dense_read = shape.dense_read_bytes
    # under uniform routing a miss lands in the on-disk tail in proportion to its size
    disk_share = plan.experts_on_disk_bytes / plan.experts_bytes if plan.experts_bytes else 0.0
    disk_bytes = miss_bytes * disk_share
    gpu_bytes = (per_token_blocks * (1 - miss_share) * shape.expert_block_bytes + dense_read
                 if plan.dense_on == "cuda" else 0.0)
    all_on_gpu = per_token_blocks * shape.expert_block_bytes + dense_read
    cpu_dense = dense_read if plan.dense_on == "cpu" else 0.0
    gpu_plan = hw.has_cuda and plan.dense_on == "cuda"
    # a plan pinned in part (the pinnable share short of the experts: Windows locks about half the RAM) gives every
    # miss of its unpinned layers to the CPU; the GPU reads only the pinned layers' over PCIe
    pinned = plan.experts_pinned_layers / shape.moe_layers if gpu_plan and miss_bytes and shape.moe_layers else 1.0
    rates = []
    for i in (0, 1):
        cpu_bw = hw.cpu_gbps * cost.cpu_kernel_efficiency[i] * GB
        pcie = hw.h2d_gbps * cost.h2d_efficiency[i] * GB if hw.has_cuda else 0.0
        # a GPU plan reads misses over PCIe and hands the CPU only the share that pays; a CPU plan's kernel
        # computes every miss
        miss_cpu_bw = hw.cpu_gbps * cost.cpu_share_efficiency[i] * GB if gpu_plan else cpu_bw
        gpu_bw = gpu_gbps * cost.gpu_bandwidth_efficiency[i] * GB
        t_miss = miss_bytes * (pinned / (miss_cpu_bw + pcie) + (1 - pinned) / cpu_bw) if miss_bytes else 0.0
        t_cpu_dense = cpu_dense / cpu_bw if cpu_dense else 0.0
        t_gpu = gpu_bytes / gpu_bw if gpu_bytes else 0.0
        t_disk = disk_bytes / (cost.disk_gbps[i] * GB) if disk_bytes else 0.0
        t = (t_miss + t_cpu_dense + t_disk + t_gpu) if i == 0 else max(t_miss + t_cpu_dense + t_disk, t_gpu)
        if hw.has_cuda:
            t = max(t, all_on_gpu / gpu_bw)
        t += shape.moe_layers * cost.decode_layer_overhead_s[i] + \
            shape.linear_attention_layers * cost.linear_layer_overhead_s[i]
        rates.append(1.0 / t if t > 0 else 0.0)
    return rates[0], rates[1]
