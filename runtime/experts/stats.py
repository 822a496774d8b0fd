"""What the expert tier counts, per step and in total: what the worker's stats event and the benchmark show."""
from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass, field


@dataclass
class ExpertCounters:
    decode_calls: int = 0            # layer calls on the few-token (decode) path
    stream_calls: int = 0            # layer calls on the streaming (prefill) path
    tokens: int = 0                  # tokens through the MoE layers (summed over layers)
    hits: int = 0                    # distinct experts per layer call found in the VRAM pool
    misses: int = 0                  # ... not found
    cpu_experts: int = 0             # misses computed on the CPU
    fetched_experts: int = 0         # misses fetched over PCIe on the critical path
    promoted_experts: int = 0        # background promotions into the pool
    bytes_h2d: int = 0               # host -> device, all paths
    bytes_streamed: int = 0          # of which prefill streaming
    bytes_cpu_read: int = 0          # expert bytes the CPU kernel read
    cpu_seconds: float = 0.0         # wall time inside the CPU kernel
    gpu_experts: int = 0             # distinct experts per layer call computed on the device
    host_only_misses: int = 0        # of the misses, those of layers the GPU cannot read (a store pinned in part)
    # where a decode call's host time goes (wall seconds, summed over calls): waiting for the ids to arrive,
    # classifying and splitting, submitting fetches, uploading the CPU's result, starting promotions, the whole call
    host_wait_seconds: float = 0.0
    host_book_seconds: float = 0.0
    host_fetch_seconds: float = 0.0
    host_upload_seconds: float = 0.0
    host_promote_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    @property
    def cpu_share(self) -> float:
        n = self.cpu_experts + self.gpu_experts
        return self.cpu_experts / n if n else 0.0


@dataclass
class ExpertStats:
    total: ExpertCounters = field(default_factory=ExpertCounters)
    step: ExpertCounters = field(default_factory=ExpertCounters)     # since the last `end_step()`

    def add(self, **deltas) -> None:
        for name, value in deltas.items():
            setattr(self.total, name, getattr(self.total, name) + value)
            setattr(self.step, name, getattr(self.step, name) + value)

    def add_decode(self, tokens: int, hits: int, misses: int, cpu_experts: int, fetched: int, block_nbytes: int,
                   cpu_seconds: float) -> None:
        """One decode-layer call's counts: `add` with the names spelled out (this runs once per MoE layer per
        token, so it skips `add`'s keyword dict and getattr/setattr round trips)."""
        for c in (self.total, self.step):
            c.decode_calls += 1
            c.tokens += tokens
            c.hits += hits
            c.misses += misses
            c.cpu_experts += cpu_experts
            c.fetched_experts += fetched
            c.gpu_experts += hits + fetched
            c.bytes_h2d += fetched * block_nbytes
            c.bytes_cpu_read += cpu_experts * block_nbytes
            c.cpu_seconds += cpu_seconds

    def add_decode_times(self, wait: float, book: float, fetch: float, upload: float, call: float,
                         promote: float = 0.0) -> None:
        """One decode call's host phases (see ExpertCounters)."""
        for c in (self.total, self.step):
            c.host_wait_seconds += wait
            c.host_book_seconds += book
            c.host_fetch_seconds += fetch
            c.host_upload_seconds += upload
            c.host_promote_seconds += promote
            c.decode_seconds += call

    def end_step(self) -> dict:
        """The step's counters as a dict, and a fresh step."""
        out = _with_rates(self.step)
        self.step = ExpertCounters()
        return out

    def to_dict(self, *, pools: dict[str, int] | None = None) -> dict:
        out = {"total": _with_rates(self.total), "step": _with_rates(self.step), "host_rss_bytes": host_rss()}
        if pools:
            out["vram_bytes"] = dict(pools)
        return out


def _with_rates(c: ExpertCounters) -> dict:
    d = asdict(c)
    d["hit_rate"] = round(c.hit_rate, 4)
    d["cpu_share"] = round(c.cpu_share, 4)
    return d


_process = None                 # psutil's handle on this process, made once (per pid: a forked child makes its own)


def host_rss() -> int:
    """This process's resident memory in bytes (0 when psutil cannot tell).

    The handle is kept: making one reads the process's start time from /proc each call (~0.65 ms of the ~1.7 ms a
    call took in s39b's profile), and PeakRSS samples every 2 ms on a thread that then held the GIL beside a
    benchmark's decode loop."""
    global _process
    try:
        import psutil
        if _process is None or _process.pid != os.getpid():
            _process = psutil.Process(os.getpid())
        return int(_process.memory_info().rss)
    except (ImportError, OSError):
        return 0


class PeakRSS:
    """The process's largest RSS while a `with` block runs, sampled every `every_s` by a thread (the
    kernel's own high-water mark, ru_maxrss, covers the whole process lifetime, not one phase)."""

    def __init__(self, every_s: float = 0.002):
        self.every_s = every_s
        self.start = self.peak = self.end = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = host_rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, host_rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end = host_rss()
        self.peak = max(self.peak, self.end)
