"""The hardware probe: this machine (no GPU in CI), and stand-ins for what it lacks (NVML, AMD cards, AMX)."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from app.hardware import NA, probe, probe_cpu, probe_disk, probe_memory, probe_nvidia


class FakeNVMLError(Exception):
    pass


def fake_nvml(*, gpus=2, fail_init=False, no_power_on=1):
    """An NVML module with the functions the probe calls; GPU `no_power_on` lacks a power sensor."""
    state = {"shutdown": False}

    def init():
        if fail_init:
            raise FakeNVMLError("Driver Not Loaded")

    def handle(i):
        return i

    def power(h):
        if h == no_power_on:
            raise FakeNVMLError("Not Supported")
        return 123_456              # milliwatts

    mod = SimpleNamespace(
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=init, nvmlShutdown=lambda: state.__setitem__("shutdown", True),
        nvmlSystemGetDriverVersion=lambda: "570.86",
        nvmlSystemGetCudaDriverVersion=lambda: 12080,
        nvmlDeviceGetCount=lambda: gpus, nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetName=lambda h: b"NVIDIA GeForce RTX 4070" if h == 0 else "NVIDIA RTX A2000",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=12 * 2 ** 30, free=11 * 2 ** 30, used=2 ** 30),
        nvmlDeviceGetCudaComputeCapability=lambda h: (8, 9),
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 1,          # idle cards drop the link to gen 1
        nvmlDeviceGetCurrPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 4,
        nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetTemperature=lambda h, sensor: 41,
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 200_000,
        NVML_CLOCK_MEM=2,
        nvmlDeviceGetMemoryBusWidth=lambda h: 192,
        nvmlDeviceGetMaxClockInfo=lambda h, kind: 10501 if kind == 2 else 2475,
    )
    return mod, state


def test_probe_on_this_machine_reports_every_section(tmp_path):
    report = probe(tmp_path / "models-not-made-yet")
    data = report.to_dict()
    json.dumps(data)                                  # the report is plain data
    assert report.cpu.logical_cores and report.cpu.logical_cores >= 1
    assert report.memory.total and report.memory.available and report.memory.available <= report.memory.total
    assert report.memory.pinnable and report.memory.pinnable <= report.memory.total
    assert report.disk.free and report.disk.free > 0  # read at the nearest existing parent
    text = "\n".join(report.summary_lines())
    if not report.gpus:                               # CI and the dev machine: no NVIDIA GPU
        assert report.cpu_only
        assert "CPU only" in report.gpu_status
        hw = report.planner_hardware()
        assert not hw.has_cuda and hw.vram_free == 0 and hw.ram_total == report.memory.total
    assert "RAM:" in text and "GPU:" in text


def test_nvml_readings_are_converted_and_missing_ones_are_named(tmp_path):
    nvml, state = fake_nvml()
    report = probe(tmp_path, nvml=nvml)
    assert state["shutdown"]
    assert not report.cpu_only and report.gpu_status == "2 NVIDIA GPUs"
    first, second = report.gpus
    assert first.name == "NVIDIA GeForce RTX 4070"            # bytes from old bindings are decoded
    assert first.vram_total == 12 * 2 ** 30 and first.vram_free == 11 * 2 ** 30
    assert first.compute_capability == "8.9" and first.cuda_driver == "12.8" and first.driver == "570.86"
    assert first.power_w == pytest.approx(123.456) and first.power_limit_w == 200.0
    assert first.pcie_gbps == pytest.approx(1.6 * 16)         # the link's best (gen 4 x16), not idle gen 1
    assert first.memory_gbps == pytest.approx(192 / 8 * 10501e6 * 2 / 1e9)   # 504 GB/s, an RTX 4070's
    assert second.power_w is None and second.missing == ["power"]
    lines = report.summary_lines()
    assert any("RTX A2000" in line and f"{NA} of 200 W" in line for line in lines)
    hw = report.planner_hardware(cpu_gbps=20.0)
    assert hw.has_cuda and hw.vram_free == 11 * 2 ** 30 and hw.h2d_gbps == pytest.approx(25.6)
    assert hw.cpu_gbps == 20.0 and hw.gpu_name == "NVIDIA GeForce RTX 4070"


def test_no_driver_is_reported_not_raised(tmp_path):
    nvml, _ = fake_nvml(fail_init=True)
    gpus, reason = probe_nvidia(nvml)
    assert gpus == [] and "no NVIDIA driver" in reason and "Driver Not Loaded" in reason
    report = probe(tmp_path, nvml=nvml, sys_root=tmp_path)
    assert report.cpu_only and "CPU only" in report.gpu_status


def test_amd_gpu_is_named_and_cpu_path_offered(tmp_path, monkeypatch):
    monkeypatch.setattr("platform.system", lambda: "Linux")
    for card, vendor in (("card0", "0x1002"), ("card0-DP-1", "0x1002"), ("card1", "0x8086")):
        dev = tmp_path / "sys/class/drm" / card / "device"
        dev.mkdir(parents=True)
        (dev / "vendor").write_text(vendor + "\n")
    nvml, _ = fake_nvml(fail_init=True)
    report = probe(tmp_path, nvml=nvml, sys_root=tmp_path)
    assert report.other_gpus == ["AMD", "Intel"]               # the connector entry is not a second card
    assert report.cpu_only and "AMD, Intel found but not supported" in report.gpu_status
    assert any("also found: AMD" in line for line in report.summary_lines())


def test_cpu_flags_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                       "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    cpu = probe_cpu(cpuinfo=cpuinfo)
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480+" and cpu.avx2 and cpu.avx512 and cpu.amx
    cpuinfo.write_text("model name\t: Old CPU\nflags\t\t: fpu sse2\n")
    cpu = probe_cpu(cpuinfo=cpuinfo)
    assert (cpu.avx2, cpu.avx512, cpu.amx) == (False, False, False)


def test_pinnable_share_follows_the_platform_rule():
    windows = probe_memory("Windows")
    linux = probe_memory("Linux")
    assert windows.pinnable == windows.total // 2 and "half" in windows.pinnable_rule
    assert linux.pinnable == linux.total - 2 * 1024 ** 3


def test_disk_of_a_missing_folder_uses_its_parent(tmp_path):
    disk = probe_disk(tmp_path / "a" / "b" / "c")
    assert disk.path.endswith("c") and disk.free and disk.total and disk.free <= disk.total


def test_probe_report_script_prints_json(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/probe_report.py", "--models-dir", str(tmp_path)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    data = json.loads(out)
    assert {"os", "gpus", "gpu_status", "cpu", "memory", "disk"} <= set(data)
    assert data["disk"]["path"] == str(tmp_path)


def test_an_nvidia_card_without_its_driver_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr("platform.system", lambda: "Linux")
    dev = tmp_path / "sys/class/drm/card0/device"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text("0x10de\n")
    nvml, _ = fake_nvml(fail_init=True)
    report = probe(tmp_path, nvml=nvml, sys_root=tmp_path)
    assert report.cpu_only and report.other_gpus == []
    assert "NVIDIA GPU is installed but not usable" in report.gpu_status and "driver" in report.gpu_status


def test_apple_silicon_is_named_and_has_no_x86_flags(tmp_path, monkeypatch):
    monkeypatch.setattr("platform.system", lambda: "Darwin")
    monkeypatch.setattr("platform.machine", lambda: "arm64")
    nvml, _ = fake_nvml(fail_init=True)
    report = probe(tmp_path, nvml=nvml, cpuinfo=tmp_path / "no-cpuinfo", sys_root=tmp_path)
    assert report.other_gpus == ["Apple GPU (Metal)"] and report.cpu_only
    assert "Apple GPU (Metal) found but not supported" in report.gpu_status
    assert (report.cpu.avx2, report.cpu.avx512, report.cpu.amx) == (False, False, False)
    assert report.memory.pinnable == report.memory.total - 2 * 1024 ** 3
