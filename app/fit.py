"""Will a model run on this machine, and how fast? The library's fit badge.

Memory: the engine's own planner decides (`runtime.experts.planner`: `ModelShape.from_config`,
`plan_memory`), with the KV cache sized for the context the user chose, so the badge and the real
load agree: runs fully on the GPU / hybrid with N% of the experts cached in VRAM / CPU only / does
not fit, needs X GB more RAM (or VRAM).

Speed: an *estimate*, shown as a range. Decode is bandwidth-bound: per token the missed experts are
read by the CPU kernel (and fetched over PCIe, which adds bandwidth), the cached experts and the dense
weights by the GPU. Prefill on the hybrid path streams the uncached experts over PCIe once per chunk
and computes 2 x active-params FLOPs per token. The efficiencies that turn peak rates into real ones
are `CostModel`'s fields, calibrated from measured numbers (docs/library.md, "Calibration", says which
rows of docs/benchmarks.md each comes from and how to refit them).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.catalog import CatalogEntry, count_parameters, load_catalog
from app.hardware import HardwareReport

log = logging.getLogger(__name__)

GB = 1e9
GPU, HYBRID, CPU, NO_FIT, UNKNOWN = "gpu", "hybrid", "cpu", "does_not_fit", "unknown"


@dataclass(frozen=True)
class CostModel:
    """Peak rates x efficiencies (low, high). Every pair is a calibration; see docs/library.md."""
    # Refitted on the fourteenth hybrid pass (docs/hybrid.md, "Fourteenth session"; H200 + 16-core Xeon,
    # 2026-12-03, commits 877e2fd-d619f4c): the decode ranges bracket the measured rows, qwen3-30b-a3b int4 b1
    # 70.3-82.8 tok/s at 4 GiB, 84.5-98.0 at 8 GiB, 272-301 all in VRAM (sessions 4-6), qwen3.6-35b-a3b MXFP4 at
    # 8 GiB 93.4-98.0; prefill (fourth pass) at 8 GiB 19,019 (16K) - 21,636 (8K) tok/s. Re-fit when those rows
    # change (docs/library.md).
    # Share of the machine's measured memory-read bandwidth the CPU expert kernel reaches when the CPU computes
    # every miss (CPU-only plans; first pass: 21.8 of 106 GB/s at 16 threads, whole steps at 14% of their
    # ceiling; not re-measured since the int8 kernel).
    cpu_kernel_efficiency: tuple[float, float] = (0.14, 0.21)
    # ...and the bandwidth a GPU plan's CPU share adds beside the GPU's own reads. Refitted in session 14: the
    # worker now takes 40-50 % of the misses at ~55 GB/s of the H200 host's ~88 GB/s read (a decode request of ~3
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
    # Share of the PCIe link that layer-by-layer expert streaming reaches in prefill (per uncached byte).
    prefill_stream_efficiency: tuple[float, float] = (0.55, 0.65)
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


@dataclass
class FitEstimate:
    id: str
    name: str
    verdict: str                          # "gpu" | "hybrid" | "cpu" | "does_not_fit" | "unknown"
    badge: str                            # one line for the library
    context_length: int
    experts_cached_pct: float = 0.0       # of all (layer, expert) blocks, in VRAM
    decode_tok_s: tuple[float, float] | None = None
    prefill_tok_s: tuple[float, float] | None = None
    shortfall_bytes: int = 0
    short_of: str = ""                    # "ram" | "vram"
    codec: str = ""
    plan: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def speed_text(self) -> str:
        if not self.decode_tok_s:
            return ""
        lo, hi = self.decode_tok_s
        text = f"decode ~{_fmt_rate(lo)}–{_fmt_rate(hi)} tok/s"
        if self.prefill_tok_s:
            text += f", prefill ~{_fmt_rate(self.prefill_tok_s[0])}–{_fmt_rate(self.prefill_tok_s[1])} tok/s"
        return text + " (estimate)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fmt_rate(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:,.0f}"


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


@dataclass(frozen=True)
class Machine:
    """What the estimate needs beyond the planner's Hardware: peak rates from the probe."""
    hardware: Any                         # runtime.experts.planner.Hardware
    gpu_gbps: float                       # peak VRAM bandwidth
    gpu_tflops: float
    cpu_cores: int
    cpu_read_gbps: float                  # measured (planner.measure_cpu_gbps) or given


def machine_from_report(report: HardwareReport, *, cpu_read_gbps: float | None = None,
                        cost: CostModel = CostModel()) -> Machine:
    """The machine for estimates. Without `cpu_read_gbps` the planner's own read-bandwidth run measures it."""
    if cpu_read_gbps is None:
        from runtime.experts.planner import measure_cpu_gbps

        cpu_read_gbps = measure_cpu_gbps(nbytes=128 * 1024 ** 2, repeats=3)
    gpu = report.gpus[0] if report.gpus else None
    return Machine(hardware=report.planner_hardware(cpu_gbps=cpu_read_gbps),
                   gpu_gbps=(gpu.memory_gbps if gpu and gpu.memory_gbps else cost.gpu_gbps_default),
                   gpu_tflops=cost.gpu_tflops_default, cpu_cores=report.cpu.physical_cores or 1,
                   cpu_read_gbps=cpu_read_gbps)


def estimate(config: dict, *, codec: str, machine: Machine, context_length: int, max_sequences: int = 1,
             vram_budget: int | None = None, cost: CostModel = CostModel(), id: str = "", name: str = "",
             block_nbytes: int | None = None, group_size: int = 64) -> FitEstimate:
    """Fit of one model config on `machine` at `context_length` tokens of KV cache. `block_nbytes` is a
    converted package's real expert block size (its manifest), used instead of the codec's formula."""
    from runtime.experts.planner import DENSE_INT8_CODECS, ModelShape, plan_memory

    try:
        # a GPU engine keeps a quantized model's dense weights in int8 (runtime/engine.py, _wants_int8_dense)
        shape = ModelShape.from_config(config, codec=codec, group_size=group_size, block_nbytes=block_nbytes,
                                       dense_int8=machine.hardware.has_cuda and codec in DENSE_INT8_CODECS)
        plan = plan_memory(shape, machine.hardware, context_length=context_length, max_sequences=max_sequences,
                           vram_budget=vram_budget)
    except (ValueError, KeyError) as exc:
        return FitEstimate(id=id, name=name, verdict=UNKNOWN, badge=f"cannot estimate: {exc}",
                           context_length=context_length, codec=codec)
    cached = 100.0 * plan.expert_slots / plan.expert_total if plan.expert_total else 0.0
    fit = FitEstimate(id=id, name=name, verdict=plan.backend, badge="", context_length=context_length,
                      experts_cached_pct=cached, shortfall_bytes=plan.shortfall_bytes, short_of=plan.short_of,
                      codec=codec, plan=plan.to_dict(), notes=list(plan.notes))
    if plan.backend == NO_FIT:
        fit.badge = f"Does not fit: needs {_gb(plan.shortfall_bytes)} more {plan.short_of.upper() or 'memory'}"
        return fit
    try:
        counts = count_parameters(config)
    except (ValueError, KeyError) as exc:      # a family the catalog cannot count: placement only, no speed
        fit.notes.append(f"no speed estimate: {exc}")
        fit.badge = {GPU: "Runs fully on the GPU", HYBRID: f"Hybrid: {cached:.0f}% of experts in VRAM"}.get(
            plan.backend, "CPU only")
        return fit
    active = counts.active
    # dense weights a token reads: all but the input embedding table (one row of it) and the vision tower/MTP
    dense_read = (max(0, (counts.active - shape.moe_layers * shape.top_k * counts.per_expert))
                  * shape.dense_read_bytes_per_param)
    fit.decode_tok_s = _decode_range(shape, plan, machine, cost, dense_read)
    fit.prefill_tok_s = _prefill_range(shape, plan, machine, cost, active,
                                       expert_params=shape.moe_layers * shape.top_k * counts.per_expert)
    if plan.backend == GPU:
        fit.badge = "Runs fully on the GPU"
    elif plan.backend == HYBRID:
        fit.badge = f"Hybrid: {cached:.0f}% of experts in VRAM, the rest on the CPU"
    else:
        fit.badge = "CPU only (no usable GPU)" if not machine.hardware.has_cuda else "CPU only"
    if plan.experts_on_disk_bytes:
        fit.badge += f"; {_gb(plan.experts_on_disk_bytes)} of experts read from disk (slow)"
    return fit


def _decode_range(shape, plan, machine: Machine, cost: CostModel, dense_read: float) -> tuple[float, float]:
    """tokens/s at batch 1: (slow end, fast end). Misses: CPU kernel + PCIe fetches in parallel; hits and
    dense weights: VRAM bandwidth; the two sides overlap at best (fast end) or add up (slow end). A hybrid
    plan is never faster than the same model all in VRAM would be."""
    hw = machine.hardware
    total = shape.total_experts or 1
    per_token_blocks = shape.moe_layers * shape.top_k
    miss_share = 1.0 - plan.expert_slots / total
    miss_bytes = per_token_blocks * miss_share * shape.expert_block_bytes
    # under uniform routing a miss lands in the on-disk tail in proportion to its size
    disk_share = plan.experts_on_disk_bytes / plan.experts_bytes if plan.experts_bytes else 0.0
    disk_bytes = miss_bytes * disk_share
    gpu_bytes = (per_token_blocks * (1 - miss_share) * shape.expert_block_bytes + dense_read
                 if plan.dense_on == "cuda" else 0.0)
    all_on_gpu = per_token_blocks * shape.expert_block_bytes + dense_read
    cpu_dense = dense_read if plan.dense_on == "cpu" else 0.0
    rates = []
    gpu_plan = hw.has_cuda and plan.dense_on == "cuda"
    # a plan pinned in part (the pinnable share short of the experts: Windows locks about half the RAM) gives every
    # miss of its unpinned layers to the CPU; the GPU reads only the pinned layers' over PCIe
    pinned = plan.experts_pinned_layers / shape.moe_layers if gpu_plan and miss_bytes and shape.moe_layers else 1.0
    for i in (0, 1):
        cpu_bw = machine.cpu_read_gbps * cost.cpu_kernel_efficiency[i] * GB
        pcie = hw.h2d_gbps * cost.h2d_efficiency[i] * GB if hw.has_cuda else 0.0
        # a GPU plan reads misses over PCIe and hands the CPU only the share that pays; a CPU plan's kernel
        # computes every miss
        miss_cpu_bw = machine.cpu_read_gbps * cost.cpu_share_efficiency[i] * GB if gpu_plan else cpu_bw
        gpu_bw = machine.gpu_gbps * cost.gpu_bandwidth_efficiency[i] * GB
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


def _prefill_range(shape, plan, machine: Machine, cost: CostModel, active_params: int, *,
                   expert_params: int = 0) -> tuple[float, float]:
    """tokens/s over a long prompt. GPU paths: compute, or the PCIe stream of uncached experts per chunk,
    whichever is slower; a hybrid plan without room for the stream buffers computes its experts on the cores.
    CPU only: compute on the cores."""
    from runtime.experts.planner import PREFILL_CHUNK_TOKENS

    hw = machine.hardware
    flops_per_token = 2.0 * active_params
    rates = []
    for i in (0, 1):
        if plan.backend == CPU:
            gflops = machine.cpu_cores * cost.cpu_gflops_per_core[i]
            rates.append(gflops * 1e9 / flops_per_token)
            continue
        t_compute = flops_per_token / (machine.gpu_tflops * cost.gpu_flops_efficiency[i] * 1e12)
        if plan.backend == HYBRID and not getattr(plan, "prefill_streaming", True):
            cpu_flops = machine.cpu_cores * cost.cpu_gflops_per_core[i] * 1e9
            rates.append(1.0 / max(t_compute, 2.0 * expert_params * (1 - plan.expert_slots / plan.expert_total)
                                   / cpu_flops))
            continue
        chunk = min(PREFILL_CHUNK_TOKENS, plan.kv_tokens)      # the planner's streaming unit
        streamed = max(0, plan.experts_bytes - plan.pool_bytes)
        t_stream = (streamed / (hw.h2d_gbps * cost.prefill_stream_efficiency[i] * GB) / chunk
                    if streamed and hw.h2d_gbps else 0.0)
        rates.append(1.0 / max(t_compute, t_stream))
    return rates[0], rates[1]


def fit_catalog(report: HardwareReport, *, context_length: int, max_sequences: int = 1,
                vram_budget: int | None = None, cpu_read_gbps: float | None = None,
                entries: list[CatalogEntry] | None = None, cost: CostModel = CostModel(),
                machine: Machine | None = None) -> list[FitEstimate]:
    """The fit of every catalog model on the probed machine (or on `machine` when given)."""
    machine = machine or machine_from_report(report, cpu_read_gbps=cpu_read_gbps, cost=cost)
    out = []
    for entry in entries if entries is not None else load_catalog():
        out.append(estimate(entry.config(), codec=entry.codec, machine=machine, context_length=context_length,
                            max_sequences=max_sequences, vram_budget=vram_budget, cost=cost, id=entry.id,
                            name=entry.name))
    return out


def local_fit_inputs(source_dir: Path | None, package_dir: Path | None) -> tuple[dict, dict] | None:
    """(config, estimate options) for a local model not in the catalog: a converted package's manifest
    (its codec and real block size), else the checkpoint's config.json with the codec the converter
    would pick (fp4 for MXFP4/NVFP4 sources, int4 otherwise). None when neither can be read."""
    import json

    from app.catalog import CatalogError, checkpoint_format

    if package_dir is not None:
        try:
            manifest = json.loads((package_dir / "manifest.json").read_text(encoding="utf-8"))
            experts = manifest["experts"]
            return manifest["config"], {"codec": experts["codec"], "block_nbytes": int(experts["block_nbytes"]),
                                        "group_size": int(experts.get("group_size") or 64)}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("cannot read %s/manifest.json for a fit estimate: %s", package_dir, exc)
    if source_dir is not None:
        try:
            config = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
            codec = "fp4" if checkpoint_format(config) in ("mxfp4", "nvfp4") else "int4"
            return config, {"codec": codec}
        except (OSError, ValueError, CatalogError) as exc:
            log.warning("cannot read %s/config.json for a fit estimate: %s", source_dir, exc)
    return None
