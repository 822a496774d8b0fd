"""What this machine has: GPUs (NVML), CPU, RAM, free disk at the models folder.

`probe()` never raises for a missing piece: every reading this machine cannot give is None (shown as
"not available") and the reason is kept in words. An AMD, Intel or Apple GPU, an NVIDIA card
without a driver, or no GPU at all are each reported as such, with the CPU-only path offered.

The pinnable share of RAM (host memory CUDA may page-lock) is the planner's rule,
`runtime.experts.planner.Hardware.pinnable_for`: about half the RAM on Windows (WDDM caps locked
pages near 50% of physical memory), all but a 2 GiB reserve on Linux and macOS.
"""
from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NA = "not available"
PCI_VENDORS = {"0x10de": "NVIDIA", "0x1002": "AMD", "0x8086": "Intel"}
# Usable host->device copy rate per PCIe lane by generation, GB/s (about 80% of the raw link rate).
PCIE_GBPS_PER_LANE = {1: 0.2, 2: 0.4, 3: 0.8, 4: 1.6, 5: 3.2, 6: 6.4}


@dataclass
class GpuInfo:
    index: int
    name: str
    vendor: str = "NVIDIA"
    vram_total: int | None = None          # bytes
    vram_free: int | None = None
    driver: str | None = None
    cuda_driver: str | None = None         # highest CUDA version the driver supports, e.g. "12.8"
    compute_capability: str | None = None  # "8.9"
    pcie_gen: int | None = None            # current link
    pcie_width: int | None = None
    pcie_gen_max: int | None = None        # what card and slot support
    pcie_width_max: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    memory_bus_bits: int | None = None
    memory_clock_mhz: int | None = None    # the highest memory clock NVML reports
    missing: list[str] = field(default_factory=list)   # readings this GPU could not give

    @property
    def memory_gbps(self) -> float | None:
        """Peak VRAM bandwidth (the planner's formula over NVML's readings); None when one is missing."""
        from runtime.experts.planner import memory_bus_gbps

        return memory_bus_gbps(self.memory_bus_bits, self.memory_clock_mhz) or None

    @property
    def pcie_gbps(self) -> float | None:
        """Estimated pinned host->device rate of the link at its best generation and width."""
        gen, width = self.pcie_gen_max or self.pcie_gen, self.pcie_width_max or self.pcie_width
        if not gen or not width:
            return None
        return PCIE_GBPS_PER_LANE.get(gen, PCIE_GBPS_PER_LANE[6]) * width


@dataclass
class CpuInfo:
    model: str | None = None
    physical_cores: int | None = None
    logical_cores: int | None = None
    avx2: bool | None = None
    avx512: bool | None = None
    amx: bool | None = None
    arch: str = ""


@dataclass
class MemoryInfo:
    total: int | None = None
    available: int | None = None
    pinnable: int | None = None
    pinnable_rule: str = ""


@dataclass
class DiskInfo:
    path: str
    free: int | None = None
    total: int | None = None


@dataclass
class HardwareReport:
    os: str
    gpus: list[GpuInfo]
    gpu_status: str                 # one line: what the GPU situation is
    other_gpus: list[str]           # non-NVIDIA adapters seen (name or vendor)
    cpu: CpuInfo
    memory: MemoryInfo
    disk: DiskInfo
    cpu_only: bool                  # no usable NVIDIA GPU: the CPU path is the one offered
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for gpu, raw in zip(self.gpus, data["gpus"]):
            raw["pcie_gbps_estimate"] = gpu.pcie_gbps
            raw["memory_gbps_peak"] = gpu.memory_gbps
        return data

    def summary_lines(self) -> list[str]:
        lines = [f"OS: {self.os}"]
        c = self.cpu
        flags = ", ".join(f"{name} {_yes_no(value)}" for name, value in
                          (("AVX2", c.avx2), ("AVX-512", c.avx512), ("AMX", c.amx)))
        lines.append(f"CPU: {c.model or NA} — {_or_na(c.physical_cores)} cores / {_or_na(c.logical_cores)} threads; {flags}")
        m = self.memory
        lines.append(f"RAM: {_gib(m.total)} total, {_gib(m.available)} available, "
                     f"{_gib(m.pinnable)} pinnable ({m.pinnable_rule})")
        lines.append(f"Disk at {self.disk.path}: {_gib(self.disk.free)} free of {_gib(self.disk.total)}")
        lines.append(f"GPU: {self.gpu_status}")
        for g in self.gpus:
            link = (f"PCIe gen {_or_na(g.pcie_gen)} x{_or_na(g.pcie_width)} (max gen {_or_na(g.pcie_gen_max)} "
                    f"x{_or_na(g.pcie_width_max)})")
            lines.append(f"  [{g.index}] {g.name}: {_gib(g.vram_free)} free of {_gib(g.vram_total)} VRAM; "
                         f"compute {g.compute_capability or NA}; driver {g.driver or NA} (CUDA {g.cuda_driver or NA}); "
                         f"{link}; {_or_na(g.temperature_c, '{:.0f} °C')}; {_or_na(g.power_w, '{:.0f} W')}"
                         f" of {_or_na(g.power_limit_w, '{:.0f} W')}")
        for other in self.other_gpus:
            lines.append(f"  also found: {other} (not used: FreeToken's GPU path needs NVIDIA CUDA)")
        lines.extend(self.notes)
        return lines

    def planner_hardware(self, *, cpu_gbps: float = 0.0):
        """The planner's view of this machine (`runtime.experts.planner.Hardware`), for fit estimates.

        VRAM of the first NVIDIA GPU; the host->device rate estimated from its PCIe link; the CPU
        bandwidth given by the caller (the fit's calibrated cost model), since probing does not
        run benchmarks."""
        from runtime.experts.planner import Hardware

        gpu = self.gpus[0] if self.gpus and not self.cpu_only else None
        return Hardware(vram_free=(gpu.vram_free or 0) if gpu else 0, vram_total=(gpu.vram_total or 0) if gpu else 0,
                        ram_total=self.memory.total or 0, ram_available=self.memory.available or 0,
                        pinnable=self.memory.pinnable or 0, h2d_gbps=(gpu.pcie_gbps or 0.0) if gpu else 0.0,
                        cpu_gbps=cpu_gbps, vram_gbps=(gpu.memory_gbps or 0.0) if gpu else 0.0,
                        has_cuda=gpu is not None, gpu_name=gpu.name if gpu else "",
                        os_name=self.os.split()[0] if self.os else "")


def _gib(n: int | None) -> str:
    return NA if n is None else f"{n / 1024 ** 3:.1f} GiB"


def _or_na(value: Any, fmt: str = "{}") -> str:
    return NA if value is None else fmt.format(value)


def _yes_no(value: bool | None) -> str:
    return NA if value is None else ("yes" if value else "no")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------------------------------------- GPUs


def probe_nvidia(nvml: Any = None) -> tuple[list[GpuInfo], str]:
    """NVIDIA GPUs through NVML; (gpus, reason when there are none). Each reading fails on its own."""
    try:
        if nvml is None:
            import pynvml as nvml   # nvidia-ml-py
        nvml.nvmlInit()
    except ImportError as exc:
        return [], f"NVML bindings not installed ({exc})"
    except Exception as exc:        # NVMLError_LibraryNotFound / _DriverNotLoaded ...: no driver
        return [], f"no NVIDIA driver ({type(exc).__name__}: {exc})"
    gpus: list[GpuInfo] = []
    try:
        driver = _call(nvml, "nvmlSystemGetDriverVersion", missing=None)
        cuda = _call(nvml, "nvmlSystemGetCudaDriverVersion", missing=None)
        cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as exc:
            return [], f"NVIDIA driver loaded but GPUs cannot be listed ({exc})"
        for i in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:
                log.warning("NVML cannot open GPU %d: %s", i, exc)
                continue
            missing: list[str] = []

            def read(fn: str, *args: Any, what: str) -> Any:
                value = _call(nvml, fn, handle, *args, missing=None)
                if value is None:
                    missing.append(what)
                return value

            mem = read("nvmlDeviceGetMemoryInfo", what="memory")
            cc = read("nvmlDeviceGetCudaComputeCapability", what="compute capability")
            temp_sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
            temp = read("nvmlDeviceGetTemperature", temp_sensor, what="temperature")
            power = read("nvmlDeviceGetPowerUsage", what="power")
            limit = read("nvmlDeviceGetEnforcedPowerLimit", what="power limit")
            mem_clock_kind = getattr(nvml, "NVML_CLOCK_MEM", 2)
            gpus.append(GpuInfo(
                index=i, name=_text(read("nvmlDeviceGetName", what="name") or f"NVIDIA GPU {i}"),
                vram_total=int(mem.total) if mem is not None else None,
                vram_free=int(mem.free) if mem is not None else None,
                driver=_text(driver) if driver is not None else None, cuda_driver=cuda_text,
                compute_capability=f"{cc[0]}.{cc[1]}" if cc is not None else None,
                pcie_gen=read("nvmlDeviceGetCurrPcieLinkGeneration", what="PCIe generation"),
                pcie_width=read("nvmlDeviceGetCurrPcieLinkWidth", what="PCIe width"),
                pcie_gen_max=read("nvmlDeviceGetMaxPcieLinkGeneration", what="PCIe max generation"),
                pcie_width_max=read("nvmlDeviceGetMaxPcieLinkWidth", what="PCIe max width"),
                temperature_c=float(temp) if temp is not None else None,
                power_w=power / 1000.0 if power is not None else None,        # NVML reports milliwatts
                power_limit_w=limit / 1000.0 if limit is not None else None,
                memory_bus_bits=read("nvmlDeviceGetMemoryBusWidth", what="memory bus width"),
                memory_clock_mhz=read("nvmlDeviceGetMaxClockInfo", mem_clock_kind, what="memory clock"),
                missing=missing))
    finally:
        _call(nvml, "nvmlShutdown", missing=None)
    return gpus, "" if gpus else "NVIDIA driver present but no GPU found"


def _call(nvml: Any, fn: str, *args: Any, missing: Any) -> Any:
    """One NVML reading; `missing` when the function is absent or the GPU does not support it."""
    func = getattr(nvml, fn, None)
    if func is None:
        return missing
    try:
        return func(*args)
    except Exception as exc:        # NVMLError_NotSupported, _NoPermission, _GpuIsLost ...
        log.debug("NVML %s failed: %s", fn, exc)
        return missing


def _pci_display_vendors(sys_root: Path) -> list[str]:
    """PCI vendor ids of the display adapters Linux lists (connectors like card0-DP-1 skipped)."""
    vendors = []
    for vendor_file in sorted((sys_root / "sys/class/drm").glob("card*/device/vendor")):
        if "-" in vendor_file.parent.parent.name:
            continue
        try:
            vendors.append(vendor_file.read_text().strip().lower())
        except OSError:
            continue
    return vendors


def other_gpus(*, sys_root: Path = Path("/")) -> list[str]:
    """Display adapters that are not NVIDIA, by platform: PCI vendor ids on Linux, the Apple GPU on macOS,
    the adapter names Windows lists. Best effort, never raises."""
    found: list[str] = []
    system = platform.system()
    if system == "Linux":
        for vendor in _pci_display_vendors(sys_root):
            if vendor != "0x10de":
                name = PCI_VENDORS.get(vendor, f"GPU vendor {vendor}")
                if name not in found:
                    found.append(name)
    elif system == "Darwin" and platform.machine() == "arm64":
        found.append("Apple GPU (Metal)")
    elif system == "Windows":
        try:
            out = subprocess.run(["powershell", "-NoProfile", "-Command",
                                  "(Get-CimInstance Win32_VideoController).Name"],
                                 capture_output=True, text=True, timeout=10, check=False).stdout
            found.extend(line.strip() for line in out.splitlines()
                         if line.strip() and "nvidia" not in line.lower())
        except (OSError, subprocess.SubprocessError) as exc:
            log.debug("cannot list Windows display adapters: %s", exc)
    return found


# ----------------------------------------------------------------------------------------------- CPU


def probe_cpu(*, cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    import psutil

    info = CpuInfo(arch=platform.machine())
    info.physical_cores = psutil.cpu_count(logical=False)
    info.logical_cores = psutil.cpu_count(logical=True)
    flags: set[str] | None = None
    if cpuinfo.exists():
        try:
            text = cpuinfo.read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
        model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        info.model = model.group(1).strip() if model else None
        flag_line = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.M)
        flags = set(flag_line.group(1).split()) if flag_line else None
    if info.model is None:
        info.model = _cpu_model_elsewhere()
    if flags is not None:
        info.avx2 = "avx2" in flags
        info.avx512 = "avx512f" in flags
        info.amx = bool({"amx_tile", "amx_bf16", "amx_int8"} & flags)
    else:
        info.avx2, info.avx512, info.amx = _flags_from_torch()
    return info


def _cpu_model_elsewhere() -> str | None:
    system = platform.system()
    try:
        if system == "Darwin":
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5, check=False).stdout.strip()
            return out or None
        if system == "Windows":
            import winreg   # type: ignore[import-not-found]

            key = winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, r"HARDWARE\DESCRIPTION\System\CentralProcessor\0")
            return str(winreg.QueryValueEx(key, "ProcessorNameString")[0]).strip()
    except (OSError, subprocess.SubprocessError, ImportError) as exc:
        log.debug("cannot read the CPU model: %s", exc)
    return platform.processor() or None


def _flags_from_torch() -> tuple[bool | None, bool | None, bool | None]:
    """Where /proc/cpuinfo does not exist (Windows, macOS): the vector ISA torch's dispatcher detected."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return False, False, False        # x86 extensions do not exist on ARM
    try:
        import torch

        capability = str(torch.backends.cpu.get_cpu_capability()).upper()
    except (ImportError, AttributeError, RuntimeError):
        return None, None, None
    # torch reports the best level it dispatches to ("DEFAULT", "AVX2", "AVX512"); AMX is not reported
    return capability in ("AVX2", "AVX512"), capability == "AVX512", None


# ------------------------------------------------------------------------------------ memory, disk


def probe_memory(os_name: str | None = None) -> MemoryInfo:
    import psutil

    from runtime.experts.planner import Hardware

    os_name = os_name or platform.system()
    try:
        vm = psutil.virtual_memory()
    except (OSError, RuntimeError) as exc:
        log.warning("cannot read RAM: %s", exc)
        return MemoryInfo(pinnable_rule=NA)
    rule = ("Windows: about half of physical RAM can be page-locked" if os_name == "Windows"
            else "all RAM but a 2 GiB reserve for the OS and the app")
    return MemoryInfo(total=int(vm.total), available=int(vm.available),
                      pinnable=Hardware.pinnable_for(os_name, int(vm.total)), pinnable_rule=rule)


def probe_disk(path: Path) -> DiskInfo:
    """Free space where models go; the nearest existing parent when the folder is not made yet."""
    target = Path(path)
    while not target.exists() and target.parent != target:
        target = target.parent
    try:
        usage = shutil.disk_usage(target)
    except OSError as exc:
        log.warning("cannot read free disk at %s: %s", target, exc)
        return DiskInfo(path=str(path))
    return DiskInfo(path=str(path), free=int(usage.free), total=int(usage.total))


# --------------------------------------------------------------------------------------------- probe


def probe(models_dir: Path, *, nvml: Any = None, cpuinfo: Path = Path("/proc/cpuinfo"),
          sys_root: Path = Path("/")) -> HardwareReport:
    """The whole machine. `nvml`, `cpuinfo` and `sys_root` let tests stand in for hardware this machine lacks."""
    os_name = platform.system()
    os_text = f"{os_name} {platform.release()} ({platform.machine()}), Python {sys.version.split()[0]}"
    gpus, reason = probe_nvidia(nvml)
    others = other_gpus(sys_root=sys_root)
    notes: list[str] = []
    if gpus:
        status = f"{len(gpus)} NVIDIA GPU{'s' if len(gpus) > 1 else ''}"
        if len(gpus) > 1:
            notes.append("FreeToken uses the first GPU (index 0)")
    elif platform.system() == "Linux" and "0x10de" in _pci_display_vendors(sys_root):
        status = (f"an NVIDIA GPU is installed but not usable ({reason}); install or repair the NVIDIA "
                  f"driver — until then FreeToken will run on the CPU only")
    elif others:
        status = (f"{', '.join(others)} found but not supported ({reason}); "
                  f"FreeToken will run on the CPU only")
    else:
        status = f"not available: {reason}; FreeToken will run on the CPU only"
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        notes.append("CUDA_VISIBLE_DEVICES is empty: the engine will not see any GPU")
    return HardwareReport(os=os_text, gpus=gpus, gpu_status=status, other_gpus=others, cpu=probe_cpu(cpuinfo=cpuinfo),
                          memory=probe_memory(os_name), disk=probe_disk(models_dir), cpu_only=not gpus, notes=notes)
