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

import dataclasses
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.catalog import CatalogEntry, count_parameters, load_catalog
from app.hardware import HardwareReport
from runtime.experts.estimate import CostModel, decode_range

log = logging.getLogger(__name__)

GB = 1e9
GPU, HYBRID, CPU, NO_FIT, UNKNOWN = "gpu", "hybrid", "cpu", "does_not_fit", "unknown"


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
    # the load's plan carries the same estimate (experts/estimate.py); computed again here for this machine's
    # VRAM bandwidth and the caller's cost model
    fit.decode_tok_s = decode_range(shape, plan, dataclasses.replace(machine.hardware, cpu_gbps=machine.cpu_read_gbps),
                                    gpu_gbps=machine.gpu_gbps, cost=cost)
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


def _prefill_range(shape, plan, machine: Machine, cost: CostModel, active_params: int, *,
                   expert_params: int = 0) -> tuple[float, float]:
    """tokens/s over a long prompt. GPU paths: compute, or the PCIe stream of uncached experts per chunk,
    whichever is slower; a hybrid plan without room for the stream buffers computes its experts on the cores.
    CPU only: compute on the cores."""
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
        chunk = plan.prefill_chunk                                # the planner's streaming unit
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
