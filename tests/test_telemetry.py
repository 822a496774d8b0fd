"""Telemetry: real psutil readings, NVML degrading to "not available", the 5-minute ring buffer."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.telemetry import BUFFER_SAMPLES, GpuSensors, RingBuffer, Sample, TelemetryMonitor, TelemetrySampler


class FakeNvml:
    """Two GPUs as NVML reports them; the second has no power sensor (as many laptop GPUs)."""

    NVML_TEMPERATURE_GPU = 0

    class NotSupported(Exception):
        pass

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA GeForce RTX 4090" if h == 0 else "NVIDIA GeForce RTX 3060"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=(h + 1) * 2**30, total=(h + 1) * 12 * 2**30)

    def nvmlDeviceGetTemperature(self, h, kind):
        return 60 + 10 * h

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1:
            raise self.NotSupported("power not supported")
        return 250_000   # milliwatts

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=40 + 20 * h)


class BrokenNvml(FakeNvml):
    def nvmlInit(self):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")


def test_this_machine_reads_ram_and_cpu():
    sample = TelemetrySampler().sample()
    assert sample.ram_total and 0 < sample.ram_used <= sample.ram_total
    assert sample.cpu_percent is not None and 0.0 <= sample.cpu_percent <= 100.0 * 64


def test_missing_driver_degrades_to_not_available():
    sampler = TelemetrySampler(gpu=GpuSensors(BrokenNvml()))
    sample = sampler.sample()
    assert not sampler.gpu.available
    assert "libnvidia-ml" in sampler.gpu_reason
    assert (sample.vram_used, sample.vram_total, sample.gpu_temp_c, sample.gpu_power_w, sample.gpu_util_pct) == (
        None, None, None, None, None)
    assert sample.ram_total is not None   # the rest still works


def test_gpus_are_combined_and_missing_sensors_skipped():
    gpu = GpuSensors(FakeNvml())
    assert gpu.names == ["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 3060"]
    reading = gpu.read()
    assert reading["vram_used"] == 3 * 2**30 and reading["vram_total"] == 36 * 2**30
    assert reading["gpu_temp_c"] == 70.0           # the hottest
    assert reading["gpu_power_w"] == pytest.approx(250.0)   # the one that reports, in watts
    assert reading["gpu_util_pct"] == pytest.approx(50.0)


def test_ring_buffer_keeps_five_minutes():
    buf = RingBuffer()
    for i in range(BUFFER_SAMPLES + 50):
        buf.append(Sample(t=float(i), ram_used=i, gpu_temp_c=None if i % 2 else 50.0))
    assert len(buf) == BUFFER_SAMPLES == 300
    assert buf.samples()[0].t == 50.0 and buf.latest().t == BUFFER_SAMPLES + 49
    xs, ys = buf.series("ram_used")
    assert xs[-1] == 0.0 and xs[0] == -(BUFFER_SAMPLES - 1) and ys[-1] == BUFFER_SAMPLES + 49
    xs, ys = buf.series("gpu_temp_c", window_s=10)
    assert len(xs) == 5 and all(-10 <= x <= 0 for x in xs)   # only even seconds had a reading
    assert RingBuffer().series("ram_used") == ([], [])


def test_monitor_samples_on_its_timer(qtbot):
    monitor = TelemetryMonitor(TelemetrySampler(gpu=GpuSensors(BrokenNvml())), interval_ms=20)
    seen = []
    monitor.sampled.connect(seen.append)
    monitor.start()
    qtbot.waitUntil(lambda: len(seen) >= 3, timeout=3000)
    monitor.stop()
    count = len(monitor.buffer)
    qtbot.wait(80)
    assert not monitor.active and len(monitor.buffer) == count
    assert all(isinstance(s, Sample) and s.ram_total for s in seen)
    assert [s.t for s in seen] == sorted(s.t for s in seen)
