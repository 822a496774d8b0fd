"""Live machine telemetry for the console: VRAM, RAM, GPU temperature/power/utilisation, CPU.

`TelemetrySampler.sample()` reads NVML (pynvml) and psutil once; every reading that this machine
cannot give (no NVIDIA driver, a GPU without a power sensor, ...) is None, and `gpu_reason` says
why in words, so the view writes "not available" instead of crashing. `TelemetryMonitor` samples
at 1 Hz on a QTimer and keeps a 5-minute ring buffer.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Callable

from PySide6.QtCore import QObject, QTimer, Signal

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_MS = 1000
WINDOW_S = 300                                   # the console's chart window
BUFFER_SAMPLES = WINDOW_S * 1000 // SAMPLE_INTERVAL_MS


@dataclass(frozen=True)
class Sample:
    t: float                                     # time.monotonic() seconds
    ram_used: int | None = None                  # bytes
    ram_total: int | None = None
    cpu_percent: float | None = None             # whole machine, 0..100
    vram_used: int | None = None                 # bytes, summed over NVIDIA GPUs
    vram_total: int | None = None
    gpu_temp_c: float | None = None              # hottest GPU
    gpu_power_w: float | None = None             # summed
    gpu_util_pct: float | None = None            # mean

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class GpuSensors:
    """NVML, opened once; each GPU reading degrades to None on its own."""

    def __init__(self, nvml: Any = None) -> None:
        self.handles: list[Any] = []
        self.names: list[str] = []
        self.reason = ""
        try:
            if nvml is None:
                import pynvml as nvml   # nvidia-ml-py
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
            self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self.names = [self._text(nvml.nvmlDeviceGetName(h)) for h in self.handles]
        except Exception as exc:   # NVMLError subclasses, ImportError, a missing libnvidia-ml
            self.handles = []
            self.reason = f"no NVIDIA GPU or driver ({type(exc).__name__}: {exc})"
            log.info("GPU telemetry not available: %s", self.reason)
        else:
            if not self.handles:
                self.reason = "NVIDIA driver found but no GPU"
        self._nvml = nvml if self.handles else None

    @staticmethod
    def _text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    @property
    def available(self) -> bool:
        return bool(self.handles)

    def _each(self, read: Callable[[Any], float]) -> list[float]:
        values = []
        for handle in self.handles:
            try:
                values.append(float(read(handle)))
            except Exception as exc:   # NVMLError_NotSupported and friends: this reading only
                log.debug("NVML reading unavailable: %s", exc)
        return values

    def read(self) -> dict[str, Any]:
        if not self._nvml:
            return {}
        nvml = self._nvml
        memory = []
        for handle in self.handles:
            try:
                memory.append(nvml.nvmlDeviceGetMemoryInfo(handle))
            except Exception as exc:
                log.debug("NVML memory unavailable: %s", exc)
        temps = self._each(lambda h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        power = self._each(lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)   # mW -> W
        util = self._each(lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu)
        return {
            "vram_used": sum(int(m.used) for m in memory) if memory else None,
            "vram_total": sum(int(m.total) for m in memory) if memory else None,
            "gpu_temp_c": max(temps) if temps else None,
            "gpu_power_w": sum(power) if power else None,
            "gpu_util_pct": sum(util) / len(util) if util else None,
        }


class TelemetrySampler:
    """One reading of everything; pass `gpu` to use other NVML sensors (tests, several processes)."""

    def __init__(self, *, gpu: GpuSensors | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.gpu = gpu if gpu is not None else GpuSensors()
        self.clock = clock
        self._psutil = self._open_psutil()

    @staticmethod
    def _open_psutil():
        try:
            import psutil

            psutil.cpu_percent(interval=None)   # primes the counter: the next call measures since now
            return psutil
        except Exception as exc:
            log.info("CPU/RAM telemetry not available: %s", exc)
            return None

    @property
    def gpu_reason(self) -> str:
        return self.gpu.reason

    def sample(self) -> Sample:
        values: dict[str, Any] = {}
        if self._psutil is not None:
            try:
                vm = self._psutil.virtual_memory()
                values.update(ram_used=int(vm.total - vm.available), ram_total=int(vm.total))
            except Exception as exc:
                log.debug("RAM reading unavailable: %s", exc)
            try:
                values["cpu_percent"] = float(self._psutil.cpu_percent(interval=None))
            except Exception as exc:
                log.debug("CPU reading unavailable: %s", exc)
        values.update(self.gpu.read())
        return Sample(t=self.clock(), **values)


class RingBuffer:
    """The last `capacity` samples, oldest first."""

    def __init__(self, capacity: int = BUFFER_SAMPLES) -> None:
        self._items: deque[Sample] = deque(maxlen=capacity)

    def append(self, sample: Sample) -> None:
        self._items.append(sample)

    def __len__(self) -> int:
        return len(self._items)

    def samples(self) -> list[Sample]:
        return list(self._items)

    def latest(self) -> Sample | None:
        return self._items[-1] if self._items else None

    def series(self, name: str, *, window_s: float = WINDOW_S) -> tuple[list[float], list[float]]:
        """(seconds relative to the newest sample, values) for one field; samples without it are skipped."""
        if not self._items:
            return [], []
        now = self._items[-1].t
        xs, ys = [], []
        for s in self._items:
            value = getattr(s, name)
            if value is not None and now - s.t <= window_s:
                xs.append(s.t - now)
                ys.append(float(value))
        return xs, ys


class TelemetryMonitor(QObject):
    """Samples once a second while started; `sampled(Sample)` after each reading."""

    sampled = Signal(object)

    def __init__(self, sampler: TelemetrySampler | None = None, *, interval_ms: int = SAMPLE_INTERVAL_MS,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.sampler = sampler or TelemetrySampler()
        self.buffer = RingBuffer()
        self._timer = QTimer(self)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self.tick)

    def start(self) -> None:
        if not self._timer.isActive():
            self.tick()
            self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    @property
    def active(self) -> bool:
        return self._timer.isActive()

    def tick(self) -> Sample:
        sample = self.sampler.sample()
        self.buffer.append(sample)
        self.sampled.emit(sample)
        return sample
