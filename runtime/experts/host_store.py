"""Experts in host memory: one contiguous, 4 KiB-aligned block per (layer, expert), zero-copy views over it.

The store is what the CPU executor reads (packed, stacked per layer, no copy) and what transport copies to
GPU slots (one block, one copy). It wraps either the memory-mapped FTW expert file (`from_ftw`) or an
in-memory buffer with exactly the FTW block layout (`from_weights` quantizes float weights with the FTW
codecs; `synthetic` draws random codes at full size for the benchmark; `pin=True` page-locks it).

Block parts (runtime/ftw/writer.py `expert_block_parts`): `gate`, `gate_scales`, `gate_mins` (int4),
`gate_global` (NVFP4), the same for `up` and `down`, then `gate_bias`, `up_bias`, `down_bias` (fp32).

Shapes: L layers with experts, E experts, D hidden, I expert width, G groups per row.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from runtime.cuda_capture import RECORDING
from runtime.experts.interface import ExpertWeights

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE, HOST_REGISTER_MAPPED = 1, 2      # cudaHostRegister flags

_NUMPY_OF = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "uint8": np.uint8,
             "float8_e4m3fn": np.uint8}


class ExpertStoreError(ValueError):
    """A store or its layout does not match what the hybrid tier needs; the message names what."""


class HostBuffer:
    """Host memory for a store: a private anonymous mapping of exactly `nbytes` (transparent huge pages where the
    OS offers them: 512x fewer page faults while it fills, and the CPU kernel's reads, scattered over the whole
    store, walk 512x fewer page-table entries), page-locked in place on request.

    Private, not Python's default: `mmap.mmap(-1, n)` maps MAP_SHARED, which Linux backs with shmem, whose huge
    pages follow `shmem_enabled` (default "never") rather than MADV_HUGEPAGE - every store measured on the GPU
    machine until session 20 sat in 4 KiB pages ("0.00 GiB in transparent huge pages"). The mapping is only ever
    shared with the GPU (cudaHostRegister), which private pages serve as well; a forked child is not given it.
    `huge_pages=False` asks for 4 KiB pages (MADV_NOHUGEPAGE): benchmarks/bench_store_pages.py's other side.

    Why not `torch.empty(..., pin_memory=True)`: torch's caching host allocator rounds every allocation up
    to a power of two (pytorch/pytorch#150517), so a 14.3 GiB store locked 16 GiB and a 20 GB one would
    lock 32 GiB. `pin()` registers our own pages with the driver instead (cudaHostRegister, what SGLang
    does for the same reason) and unregisters them when the last view is gone."""

    def __init__(self, nbytes: int, *, huge_pages: bool = True):
        self.nbytes = nbytes
        private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)    # (Unix; 0 on Windows)
        self._map = mmap.mmap(-1, max(1, nbytes), flags=private) if private else mmap.mmap(-1, max(1, nbytes))
        # before the first touch: the faults then take 2 MiB (for a store; small buffers stay as the OS likes)
        advice = ["MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE"] if nbytes >= (64 << 20) else []
        if private:
            # a forked child does not get the buffer: private pages that are page-locked for DMA are copied into
            # the child at fork (Linux keeps the parent's DMA target in place), 14-20 GB for a store - a
            # subprocess started with fork() (a preexec_fn, a multiprocessing "fork" pool) would stall and could
            # run the host out of RAM. What the shared mapping gave for free; RDMA stacks do the same
            advice.append("MADV_DONTFORK")
        for name in advice:
            if hasattr(mmap, name):
                try:
                    self._map.madvise(getattr(mmap, name))
                except OSError:
                    pass
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes)     # [nbytes]
        self.pinned = False

    def touch(self) -> None:
        """Fault in every page (fresh anonymous memory: the OS hands out zeroed pages) with one byte written a page,
        on this thread alone - before `pin`, so the driver's lock is not held over the faults. Not torch's zero_
        or a bulk fill: on a thread beside the CPU expert worker a multi-threaded CPU op would start its own pool of
        threads on every core (openmp.py), and a page needs only one write."""
        self.array[::mmap.PAGESIZE] = 0

    def pin(self, nbytes: int | None = None, *, quiet: bool = False) -> bool:
        """Page-lock the buffer (or its first `nbytes`) for direct DMA. False (and a warning, unless `quiet`)
        without CUDA or when the driver refuses (e.g. the pinnable limit): the store still works, staged through
        transport's pinned ring. Never while a decode graph is being captured on another thread: the driver
        refuses a registration inside a capture (runtime/cuda_capture.py), so this waits for one to end."""
        with RECORDING:
            if not torch.cuda.is_available():
                log.warning("cannot page-lock %.2f GiB of experts: CUDA is not available", self.nbytes / 2**30)
                return False
            ptr = self.array.ctypes.data
            size = self.nbytes if nbytes is None else min(int(nbytes), self.nbytes)
            # portable (every device) and mapped: the GPU may read experts in place (hybrid.py's zero-copy misses).
            # A driver that refuses the mapping may still lock the pages (DMA copies work, zero-copy then does not)
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(ptr, size, HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED)
            if int(err) != 0:
                err = cudart.cudaHostRegister(ptr, size, 0)
            if int(err) != 0:
                if not quiet:
                    log.warning("cudaHostRegister of %.2f GiB failed (error %s): experts stay pageable",
                                size / 2**30, int(err))
                return False
            # unregister before the pages go back to the OS: the finaliser keeps the mapping alive until then
            done = weakref.finalize(self.array, _unregister, ptr, self._map)
            done.atexit = False          # at exit the process's pages go back anyway: no 20 GB unregister walk
            self.pinned = True
            return True

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.array)

    def discard(self, start: int, length: int) -> bool:
        """Give bytes [start, start + length) back to the OS (madvise DONTNEED: RSS falls; they read as zeros
        after). Only for a range nothing reads again - the benchmark's synthetic store once its first layers were
        copied elsewhere. False where the OS has no madvise (Windows) or refuses."""
        if not hasattr(self._map, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or start % mmap.PAGESIZE:
            return False
        try:
            self._map.madvise(mmap.MADV_DONTNEED, start, length)
        except (OSError, ValueError):
            return False
        return True

    def huge_page_bytes(self) -> int | None:
        """Bytes of the buffer the OS backs with transparent huge pages now (Linux's /proc/self/smaps); None
        where that is not readable. The CPU kernel reads rows all over the store, so 4 KiB pages cost it a TLB
        miss every few rows: the benchmark reports this beside its rows."""
        try:
            with open("/proc/self/smaps") as f:
                text = f.read()
        except OSError:
            return None
        start = self.array.ctypes.data
        return huge_bytes_in(text, start, start + self.nbytes)


def _pin_layers(buf: HostBuffer, layers: int, layer_bytes: int) -> int:
    """Page-lock `buf`, a copy of `layers` whole layers: all of them, or - where the OS refuses (its page-locked
    memory is shorter than the planner thought: other programs hold some) - as many of the first ones as it will
    take, halving the count (a few refused calls). Returns the layers locked (0: none, with a warning)."""
    if buf.pin(quiet=True):
        return layers
    n = layers // 2
    while n >= 1 and not buf.pin(n * layer_bytes, quiet=True):
        n //= 2
    if n >= 1:
        log.warning("the OS page-locked only %d of %d layers of experts (%.2f of %.2f GiB): the GPU reads the other "
                    "layers' misses through the CPU (slower); close other GPU programs to free page-locked memory",
                    n, layers, n * layer_bytes / 2**30, layers * layer_bytes / 2**30)
        return n
    log.warning("the OS refused to page-lock %.2f GiB of experts: they stay pageable (slower decode); close other "
                "GPU programs to free page-locked memory", layers * layer_bytes / 2**30)
    return 0


def huge_bytes_in(smaps: str, start: int, end: int) -> int:
    """AnonHugePages of the mappings of a /proc/<pid>/smaps text that overlap [start, end), in bytes, at most
    end - start. Overlap, not containment: a mapping ends on a page boundary past an unaligned `end`, and the
    kernel may merge a private anonymous buffer with a neighbour into one mapping (smaps cannot split that)."""
    total, inside = 0, False
    for line in smaps.splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and ":" not in head:                  # a mapping's header: lo-hi perms offset ...
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < end and hi > start
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return min(total, max(0, end - start))


def _unregister(ptr: int, _mapping) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except RuntimeError:         # the CUDA context is already gone at interpreter exit
        pass


def _default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _dtype_shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def _read_exactly(f, offset: int, out: memoryview, path: str) -> None:
    """Fill `out` from file offset `offset` (short reads continue; the end of the file is an error)."""
    f.seek(offset)
    done = 0
    while done < len(out):
        n = f.readinto(out[done:])
        if not n:
            raise ExpertStoreError(f"{path}: the expert file ends at byte {offset + done}, but the package's "
                                   f"layout needs {len(out) - done} more bytes there (truncated download?)")
        done += n


@dataclass(frozen=True)
class Part:
    offset: int
    shape: tuple[int, ...]
    dtype: str                # FTW dtype name (runtime/ftw/writer.py TORCH_DTYPES)
    nbytes: int


@dataclass(frozen=True)
class BlockLayout:
    codec: str                # "f32" | "bf16" | "int4" | "fp4"
    hidden: int               # D
    intermediate: int         # I
    group: int                # int4 group size / fp4 block size (0 for f32/bf16)
    scale_format: str         # "fp16" (int4) | "e8m0" | "e4m3" (fp4) | "" (f32/bf16)
    global_op: str            # fp4 per-matrix scale: "mul" (ModelOpt) | "div" (compressed-tensors)
    nbytes: int               # block size, a multiple of 4096
    parts: dict[str, Part]

    @property
    def has_bias(self) -> bool:
        return "gate_bias" in self.parts

    @property
    def quantized(self) -> bool:
        return self.codec in ("int4", "fp4")

    @classmethod
    def build(cls, codec: str, hidden: int, intermediate: int, *, group: int = 64, fp4_format: str = "mxfp4",
              has_bias: bool = False) -> "BlockLayout":
        """The FTW writer's own layout for one expert (so synthetic stores are byte-compatible with packages)."""
        from runtime.ftw.codecs import FP4_FORMATS
        from runtime.ftw.writer import expert_block_parts

        if codec == "fp4":
            group, scale_format, _ = FP4_FORMATS[fp4_format]
        parts, nbytes = expert_block_parts(codec=codec, hidden=hidden, intermediate=intermediate, group_size=group,
                                           fp4_format=fp4_format if codec == "fp4" else "", has_bias=has_bias)
        return cls(codec=codec, hidden=hidden, intermediate=intermediate,
                   group=group if codec in ("int4", "fp4") else 0,
                   scale_format={"int4": "fp16", "fp4": scale_format if codec == "fp4" else ""}.get(codec, ""),
                   global_op="mul", nbytes=nbytes,
                   parts={p.name: Part(p.offset, tuple(p.shape), p.dtype, p.nbytes) for p in parts})


def _np_view(block: np.ndarray, part: Part) -> np.ndarray:
    """A part of one block [nbytes] (or of a layer's blocks [E, nbytes]) as a typed array, zero-copy."""
    raw = block[..., part.offset:part.offset + part.nbytes]
    return raw.view(_NUMPY_OF[part.dtype]).reshape(block.shape[:-1] + part.shape)


def _torch_view(block: np.ndarray, part: Part) -> torch.Tensor:
    from runtime.ftw.writer import TORCH_DTYPES

    raw = torch.from_numpy(block[part.offset:part.offset + part.nbytes])
    return raw.view(TORCH_DTYPES[part.dtype]).reshape(part.shape)


class HostExpertStore:
    """Every expert of a model in host memory, addressed by (layer, expert)."""

    def __init__(self, layer_buffers: dict[int, np.ndarray], layout: BlockLayout, *, num_experts: int,
                 owner: object = None):
        for layer, buf in layer_buffers.items():
            if buf.ndim != 2 or buf.shape != (num_experts, layout.nbytes) or buf.dtype != np.uint8:
                raise ExpertStoreError(f"layer {layer}: expert buffer of shape {buf.shape} is not {num_experts} "
                                       f"blocks of {layout.nbytes} bytes")
        self._bufs = dict(layer_buffers)
        self.layout = layout
        self.layers = sorted(layer_buffers)
        self.num_experts = num_experts
        self._owner = owner          # keeps a pinned tensor or a mapped file alive as long as the views
        self._layer_parts: dict[int, dict[str, np.ndarray]] = {}
        # a store pinned in part (`pinned_copy(layers=...)`): the page-locked copy of those layers, and which
        self._part: HostBuffer | None = None
        self._part_layers: frozenset[int] = frozenset()

    # ------------------------------------------------------------------ addressing
    codec = property(lambda self: self.layout.codec)
    hidden_size = property(lambda self: self.layout.hidden)
    intermediate_size = property(lambda self: self.layout.intermediate)
    block_nbytes = property(lambda self: self.layout.nbytes)

    @property
    def n_blocks(self) -> int:
        """Experts over all layers: a slot pool this large holds every one (no miss ever runs on the CPU)."""
        return len(self.layers) * self.num_experts

    @property
    def nbytes(self) -> int:
        return self.n_blocks * self.layout.nbytes

    @property
    def pinned_layers(self) -> frozenset[int]:
        """The layers whose blocks are page-locked (and device-mapped): a GPU DMAs them directly and reads them
        in place; the others it reaches only through a page-locked staging ring, and only the CPU reads them."""
        if self._part is not None:
            return self._part_layers if self._part.pinned else frozenset()
        owner = self._owner
        pinned = getattr(owner, "pinned", False) if isinstance(owner, HostBuffer) else \
            isinstance(owner, torch.Tensor) and owner.is_pinned()
        return frozenset(self.layers) if pinned else frozenset()

    def huge_page_bytes(self) -> int | None:
        """Bytes of an in-memory store in transparent huge pages now (`HostBuffer.huge_page_bytes`); None for a
        mapped file or where the OS does not say."""
        return self._owner.huge_page_bytes() if isinstance(self._owner, HostBuffer) else None

    def layer_buffer(self, layer: int) -> np.ndarray:
        """The layer's blocks, [E, nbytes] uint8, zero-copy (C-contiguous: what the CPU kernels index)."""
        try:
            return self._bufs[layer]
        except KeyError:
            raise ExpertStoreError(f"layer {layer} has no routed experts (expert layers: {self.layers})") from None

    def block(self, layer: int, expert: int) -> np.ndarray:
        """One expert's contiguous bytes [nbytes] (zero-copy)."""
        if not 0 <= expert < self.num_experts:
            raise ExpertStoreError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        return self.layer_buffer(layer)[expert]

    def layer_parts(self, layer: int) -> dict[str, np.ndarray]:
        """Every part stacked over the layer's experts, [E, ...] strided views (zero-copy), cached."""
        parts = self._layer_parts.get(layer)
        if parts is None:
            buf = self.layer_buffer(layer)
            parts = {name: _np_view(buf, part) for name, part in self.layout.parts.items()}
            self._layer_parts[layer] = parts
        return parts

    # ------------------------------------------------------------------ reference dequantization
    def dequantize_block(self, block: np.ndarray, dtype: torch.dtype = torch.float32) -> ExpertWeights:
        """One block's bytes -> float weights, with the FTW codecs' reference formulas."""
        from runtime.ftw.reader import dequantize_expert

        lay = self.layout
        t = {name: _torch_view(block, part) for name, part in lay.parts.items()}
        return dequantize_expert(t, codec=lay.codec, group=lay.group, scale_format=lay.scale_format,
                                 global_op=lay.global_op, dtype=dtype)

    def dequantize(self, layer: int, expert: int, dtype: torch.dtype = torch.float32) -> ExpertWeights:
        return self.dequantize_block(self.block(layer, expert), dtype)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_ftw(cls, experts) -> "HostExpertStore":
        """Zero-copy over an FTW package's ExpertStore (runtime/ftw/reader.py): the mapped file, per layer."""
        fp4_format = experts.fp4_format or ""
        layout = BlockLayout(
            codec=experts.codec, hidden=experts.hidden_size, intermediate=experts.intermediate_size,
            group=int(experts.group_size or experts.block_size or 0) if experts.codec in ("int4", "fp4") else 0,
            scale_format="fp16" if experts.codec == "int4" else (experts.scale_format or ""),
            global_op=experts.global_scale_op or "mul", nbytes=int(experts.block_nbytes),
            parts={name: Part(p.offset, tuple(p.shape), p.dtype, p.nbytes) for name, p in experts.parts.items()})
        if experts.codec == "fp4" and fp4_format and layout.scale_format not in ("e8m0", "e4m3"):
            raise ExpertStoreError(f"fp4 experts with scale format {layout.scale_format!r} are not supported")
        mm = experts.mm.view(np.ndarray)          # a plain ndarray over the same mapping (numba wants no subclass)
        bufs = {}
        for layer in experts.layers:
            off = experts.layer_offset(layer)
            bufs[layer] = mm[off:off + experts.num_experts * layout.nbytes].reshape(experts.num_experts, layout.nbytes)
        return cls(bufs, layout, num_experts=experts.num_experts, owner=experts)

    def pinned_copy(self, *, pin: bool = True, method: str = "auto", threads: int | None = None,
                    chunk_bytes: int = 64 << 20, layers: list[int] | None = None) -> "HostExpertStore":
        """The same experts copied once into host memory of our own, page-locked when `pin` (the GPU then
        DMAs blocks directly); `pin=False` is the same path in ordinary memory (tests, machines without CUDA).
        `layers`: copy (and pin) only these; the others stay views of this store (a mapped file: the OS's page
        cache, never a second copy) - the planner's answer when only part of the experts fits the pinnable share.

        The process must never hold the file's pages and the copy at once (issue 10: RSS <= package +
        2 GiB), and the copy is the cold load, so it is done in large chunks by several threads:
          - "read": `readinto` from the FTW file straight into the destination (no mapping is touched, so
            no file page ever counts in this process's RSS); the default for a store over a file;
          - "map": copy out of the mapped file, handing each chunk's mapped pages back right after
            (`madvise(MADV_DONTNEED)`: the data stays in the OS page cache); also any in-memory store.
        The destination is exactly the store's size (torch's own pinned allocator rounds up to the next
        power of two: 32 GiB of locked RAM for a 20 GB package) and is page-locked in place
        (`HostBuffer.pin`). Timings of each phase land in `load_seconds` (benchmarks/bench_load.py)."""
        source = self._file_source()
        if method == "auto":
            method = "read" if source is not None else "map"
        if method not in ("read", "map"):
            raise ExpertStoreError(f"unknown copy method {method!r} (expected 'read', 'map' or 'auto')")
        if method == "read" and source is None:
            raise ExpertStoreError("copy method 'read' needs a store over an FTW file (this one is in memory)")
        copied = self.layers if layers is None else sorted(set(layers))
        if not set(copied) <= set(self.layers):
            raise ExpertStoreError(f"layers {sorted(set(copied) - set(self.layers))} have no routed experts")
        t0 = time.perf_counter()
        layer_bytes = self.num_experts * self.layout.nbytes
        buf = HostBuffer(len(copied) * layer_bytes)
        dst = buf.array.reshape(len(copied), layer_bytes)                      # [L', E * nbytes]
        chunks = [(i, layer, start, min(start + chunk_bytes, layer_bytes))
                  for i, layer in enumerate(copied) for start in range(0, layer_bytes, chunk_bytes)]
        t1 = time.perf_counter()
        if method == "read":
            path, offsets = source
            files = threading.local()

            def work(chunk):
                i, layer, a, b = chunk
                f = getattr(files, "f", None)
                if f is None:
                    f = files.f = open(path, "rb", buffering=0)          # noqa: SIM115  (one per thread)
                    opened.append(f)
                _read_exactly(f, offsets[layer] + a, memoryview(dst[i, a:b]), path)
                self.release_pages(layer, a, b - a)      # pages someone mapped earlier go too (no-op if none)
            opened: list = []
        else:
            def work(chunk):
                i, layer, a, b = chunk
                np.copyto(dst[i, a:b], self.layer_buffer(layer).reshape(-1)[a:b])
                self.release_pages(layer, a, b - a)
        n_threads = max(1, min(threads or _default_threads(), len(chunks)))
        try:
            if n_threads == 1:
                for chunk in chunks:
                    work(chunk)
            else:
                with ThreadPoolExecutor(n_threads, thread_name_prefix="ftw-load") as pool:
                    for _ in pool.map(work, chunks):      # re-raises the first worker error here
                        pass
        finally:
            if method == "read":
                for f in opened:
                    f.close()
        t2 = time.perf_counter()
        locked = _pin_layers(buf, len(copied), layer_bytes) if pin and len(copied) else 0
        pinned = locked == len(copied) > 0
        t3 = time.perf_counter()
        bufs = {layer: dst[i].reshape(self.num_experts, self.layout.nbytes) for i, layer in enumerate(copied)}
        if layers is None:
            store = HostExpertStore(bufs, self.layout, num_experts=self.num_experts, owner=buf)
        else:       # the rest stay this store's views; its owner (the mapped file) stays alive with them
            store = HostExpertStore({**self._bufs, **bufs}, self.layout, num_experts=self.num_experts,
                                    owner=self._owner)
        if layers is not None or 0 < locked < len(copied):
            store._part, store._part_layers = buf, frozenset(copied[:locked])
        store.load_seconds = {"allocate": t1 - t0, "copy": t2 - t1, "pin": t3 - t2, "threads": n_threads,
                              "method": method, "pinned": pinned, "pinned_layers": locked}
        return store

    def copy_to_device(self, dst: torch.Tensor, *, threads: int | None = None, chunk_bytes: int = 32 << 20,
                       stream=None) -> dict:
        """Every block, in store order (layer-major, expert-minor), into `dst` [L * E, nbytes] uint8 (a GPU slot
        pool that holds them all, or any tensor): the load of a model whose experts all fit in VRAM.

        From an FTW file, reader threads `readinto` chunks straight from the file into a few page-locked staging
        buffers while the copies of earlier chunks run on `stream` (no mapped page is touched, so the expert
        file never counts in this process's RSS, and the reads run in parallel). Copying block by block out of
        the mapping through a 16-block ring took one thread and left the whole file mapped. An in-memory store
        is copied layer by layer. Returns {"seconds", "threads", "pinned"}; raises ExpertStoreError for a
        truncated file, naming it."""
        t0 = time.perf_counter()
        layer_bytes = self.num_experts * self.layout.nbytes
        if tuple(dst.shape) != (len(self.layers) * self.num_experts, self.layout.nbytes) or dst.dtype != torch.uint8:
            raise ExpertStoreError(f"copy_to_device needs a uint8 [{len(self.layers) * self.num_experts}, "
                                   f"{self.layout.nbytes}] destination, got {_dtype_shape(dst)}")
        flat = dst.view(len(self.layers), layer_bytes)                    # [L, E * nbytes]
        cuda = dst.is_cuda
        source = self._file_source()
        if source is None:
            for i, layer in enumerate(self.layers):
                flat[i].copy_(torch.from_numpy(self.layer_buffer(layer).reshape(-1)), non_blocking=cuda)
            if cuda:
                torch.cuda.current_stream(dst.device).synchronize()
            return {"seconds": time.perf_counter() - t0, "threads": 1, "pinned": False}
        path, offsets = source
        chunks = [(i, layer, a, min(a + chunk_bytes, layer_bytes))
                  for i, layer in enumerate(self.layers) for a in range(0, layer_bytes, chunk_bytes)]
        n_threads = max(1, min(threads or _default_threads(), len(chunks)))
        staging = [HostBuffer(min(chunk_bytes, layer_bytes)) for _ in range(n_threads + 2)]   # a read per thread
        pinned = cuda and all(buf.pin() for buf in staging)              # + the copies in flight
        done = [None] * len(staging)          # the event after which each staging buffer may be refilled
        files = threading.local()
        opened: list = []

        def read(chunk, buf: HostBuffer) -> None:
            _, layer, a, b = chunk
            f = getattr(files, "f", None)
            if f is None:
                f = files.f = open(path, "rb", buffering=0)          # noqa: SIM115  (one per thread)
                opened.append(f)
            _read_exactly(f, offsets[layer] + a, memoryview(buf.array[:b - a]), path)

        def ship(chunk, k: int, future) -> None:
            i, _, a, b = chunk
            future.result()                                          # re-raises the reader's error here
            src = staging[k].tensor()[:b - a]
            if cuda:
                with torch.cuda.stream(stream) if stream is not None else _nullcontext():
                    flat[i, a:b].copy_(src, non_blocking=pinned)
                    done[k] = torch.cuda.current_stream(dst.device).record_event()
            else:
                flat[i, a:b].copy_(src)

        try:
            with ThreadPoolExecutor(n_threads, thread_name_prefix="ftw-to-device") as pool:
                in_flight: list = []                                 # (chunk, staging index, future), oldest first
                for j, chunk in enumerate(chunks):
                    k = j % len(staging)
                    if len(in_flight) == len(staging):               # every buffer busy: ship the oldest (it is k)
                        ship(*in_flight.pop(0))
                    if done[k] is not None:
                        done[k].synchronize()                        # its last copy to the device has finished
                    in_flight.append((chunk, k, pool.submit(read, chunk, staging[k])))
                while in_flight:
                    ship(*in_flight.pop(0))
        finally:
            if cuda:        # also on an error: no copy may still read a staging buffer when it is unregistered
                (stream or torch.cuda.current_stream(dst.device)).synchronize()
            for f in opened:
                f.close()
        return {"seconds": time.perf_counter() - t0, "threads": n_threads, "pinned": pinned}

    def _file_source(self) -> tuple[str, dict[int, int]] | None:
        """(path, file offset of each layer's first block) when this store reads an FTW file, else None."""
        mm = getattr(self._owner, "mm", None)
        path = getattr(mm, "filename", None)
        if path is None or not hasattr(self._owner, "layer_offset"):
            return None
        base = int(getattr(mm, "offset", 0) or 0)
        return str(path), {layer: base + int(self._owner.layer_offset(layer)) for layer in self.layers}

    def release_pages(self, layer: int, start: int = 0, length: int | None = None) -> bool:
        """Drop this process's mapping of `layer`'s blocks (or of bytes [start, start + length) of them):
        madvise DONTNEED on the FTW file's private mapping; the data stays in the OS page cache and is read
        again if touched. False when the store is not a mapped file or the OS has no madvise (Windows)."""
        mm = getattr(getattr(self._owner, "mm", None), "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return False
        layer_bytes = self.num_experts * self.layout.nbytes
        length = layer_bytes - start if length is None else length
        try:
            begin = self._owner.layer_offset(layer) + start
            # madvise wants a page-aligned start: widen to the page below (those bytes were copied already
            # or are re-read on demand: DONTNEED on a clean private page loses nothing)
            aligned = begin - begin % mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, aligned, length + begin - aligned)
        except (OSError, ValueError, KeyError):
            return False
        return True

    @classmethod
    def allocate(cls, layout: BlockLayout, layers: list[int], num_experts: int, *, pin: bool = False,
                 huge_pages: bool = True) -> "HostExpertStore":
        """An empty in-memory store (page-locked when `pin`, so the GPU can DMA from it directly)."""
        buf = HostBuffer(len(layers) * num_experts * layout.nbytes, huge_pages=huge_pages)
        if pin:
            buf.pin()
        arr = buf.array.reshape(len(layers), num_experts, layout.nbytes)
        return cls({layer: arr[i] for i, layer in enumerate(layers)}, layout, num_experts=num_experts, owner=buf)

    @classmethod
    def from_weights(cls, weights: dict[tuple[int, int], ExpertWeights], *, codec: str, group: int = 64,
                     fp4_format: str = "mxfp4") -> "HostExpertStore":
        """Quantize float experts {(layer, expert): weights} with the FTW codecs into a packed store."""
        from runtime.ftw.codecs import int4_quantize

        layers = sorted({layer for layer, _ in weights})
        num_experts = 1 + max(e for _, e in weights)
        first = next(iter(weights.values()))
        i, d = first.gate.shape
        layout = BlockLayout.build(codec, d, i, group=group, fp4_format=fp4_format,
                                   has_bias=first.gate_bias is not None)
        store = cls.allocate(layout, layers, num_experts)
        for layer in layers:
            store.layer_buffer(layer)[:] = 0
        for (layer, e), w in weights.items():
            p = {name: _np_view(store.block(layer, e), part) for name, part in layout.parts.items()}
            for proj in ("gate", "up", "down"):
                mat = getattr(w, proj).detach().to(torch.float32)
                if codec == "f32":
                    p[proj][:] = mat.numpy()
                elif codec == "bf16":
                    p[proj][:] = mat.to(torch.bfloat16).view(torch.uint16).numpy()
                elif codec == "int4":
                    packed = int4_quantize(mat, group, name=f"layer {layer} expert {e} {proj}")
                    p[proj][:] = packed["q"].numpy()
                    p[f"{proj}_scales"][:] = packed["scales"].numpy()
                    p[f"{proj}_mins"][:] = packed["mins"].numpy()
                else:
                    q, sc = _fp4_quantize(mat, layout.group, layout.scale_format)
                    p[proj][:], p[f"{proj}_scales"][:] = q, sc
                    if f"{proj}_global" in p:
                        p[f"{proj}_global"][:] = 1.0
                bias = getattr(w, f"{proj}_bias")
                if layout.has_bias:
                    p[f"{proj}_bias"][:] = bias.detach().to(torch.float32).numpy()
        return store

    @classmethod
    def synthetic(cls, *, layers: int, num_experts: int, hidden: int, intermediate: int, codec: str,
                  group: int = 64, fp4_format: str = "mxfp4", seed: int = 0, pin: bool = False,
                  weight_std: float = 0.02, huge_pages: bool = True) -> "HostExpertStore":
        """Random experts at any size, fast: random codes, scales chosen so weights have about `weight_std`.

        Codes are drawn once for a 256 MiB pool and tiled with a per-copy rotation, so even a 20 GB store is
        built in seconds while no two blocks are byte-identical."""
        layout = BlockLayout.build(codec, hidden, intermediate, group=group, fp4_format=fp4_format)
        # filled, then page-locked, as a package's load does (`load`): the writes fault the pages in (huge ones
        # where the OS gives them). Run s13a locked the untouched buffer first and found 0.4 of 14 GB in huge pages
        store = cls.allocate(layout, list(range(layers)), num_experts, huge_pages=huge_pages)
        rng = np.random.default_rng(seed)
        pool_blocks = max(1, min(layers * num_experts, (256 << 20) // layout.nbytes))
        pool = rng.integers(0, 256, size=(pool_blocks, layout.nbytes), dtype=np.uint8)
        done = 0
        for layer in store.layers:
            buf = store.layer_buffer(layer)
            for start in range(0, num_experts, pool_blocks):
                n = min(pool_blocks, num_experts - start)
                buf[start:start + n] = np.roll(pool[:n], (done * 4099) % layout.nbytes, axis=1)
                done += 1
            # Scales get sane values: random bytes would make NaN/inf fp16 scales and absurd fp4 blocks.
            parts = store.layer_parts(layer)
            for proj in ("gate", "up", "down"):
                if codec == "int4":
                    scale = np.float16(weight_std / 4.6)         # uniform codes 0..15 have a std of 4.6 steps
                    parts[f"{proj}_scales"][:] = scale
                    parts[f"{proj}_mins"][:] = np.float16(-7.5 * float(scale))
                elif codec == "fp4":
                    if layout.scale_format == "e8m0":         # uniform e2m1 codes have an rms of 2.9
                        parts[f"{proj}_scales"][:] = 127 + int(np.round(np.log2(weight_std / 2.9)))
                    else:
                        parts[f"{proj}_scales"][:] = torch.tensor([weight_std / 2.9]).to(
                            torch.float8_e4m3fn).view(torch.uint8).item()
                        parts[f"{proj}_global"][:] = 1.0
                else:
                    gen = torch.Generator().manual_seed(seed * 1000 + layer)
                    w = torch.randn(parts[proj].shape, generator=gen) * weight_std
                    parts[proj][:] = (w.to(torch.bfloat16).view(torch.uint16) if codec == "bf16" else w).numpy()
        if pin:
            store._owner.pin()
        return store


def _fp4_quantize(w: torch.Tensor, block: int, scale_format: str) -> tuple[np.ndarray, np.ndarray]:
    """Round W [O, N] to e2m1 codes with per-block power-of-two (e8m0) or e4m3 scales (test stores)."""
    from runtime.ftw.codecs import E2M1_VALUES, pack_nibbles

    o, n = w.shape
    g = -(-n // block)
    wp = torch.nn.functional.pad(w, (0, g * block - n)).reshape(o, g, block)
    amax = wp.abs().amax(dim=2).clamp(min=1e-12)                       # [O, G]
    if scale_format == "e8m0":
        exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
        codes = (exp + 127).to(torch.uint8)
        scale = torch.ldexp(torch.ones_like(exp), exp)
    else:
        e4 = (amax / 6.0).to(torch.float8_e4m3fn)
        scale = e4.to(torch.float32)
        codes = e4.view(torch.uint8)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    vals = (wp / scale.unsqueeze(2)).reshape(o, g * block)[:, :n]
    q = (vals.unsqueeze(-1) - lut).abs().argmin(dim=-1)               # nearest code
    return pack_nibbles(q).numpy(), codes.numpy()


def write_synthetic_ftw_experts(folder, *, layers: int, num_experts: int, hidden: int, intermediate: int,
                                codec: str = "int4", group: int = 64, seed: int = 0, chunk_bytes: int = 64 << 20,
                                reuse: bool = False):
    """An FTW expert file of random blocks (`experts.bin` in `folder`) and the reader's `ExpertStore` over it:
    the package side of a load benchmark or test at any size, written in large chunks (a 64 MiB random
    pool, rotated per chunk, so no two chunks are identical and nothing compresses or dedups). `reuse`
    keeps a file of the right size written by an earlier run."""
    from pathlib import Path

    from runtime.ftw.reader import ExpertStore

    layout = BlockLayout.build(codec, hidden, intermediate, group=group)
    layer_bytes = num_experts * layout.nbytes
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "experts.bin"
    total = layers * layer_bytes
    pool = np.random.default_rng(seed).integers(0, 256, size=min(chunk_bytes, total), dtype=np.uint8)
    if not (reuse and path.exists() and path.stat().st_size == total):
        tmp = path.with_name(path.name + ".partial")
        with open(tmp, "wb") as f:
            for n, start in enumerate(range(0, total, len(pool))):
                f.write(np.roll(pool, n * 4099)[:min(len(pool), total - start)].tobytes())
        os.replace(tmp, path)            # never a half-written file under the real name
    meta = {"file": path.name, "nbytes": total, "layers": list(range(layers)), "num_experts": num_experts,
            "hidden_size": hidden, "intermediate_size": intermediate, "codec": codec,
            "group_size": group if codec == "int4" else None, "block_size": layout.group if codec == "fp4" else None,
            "fp4_format": "mxfp4" if codec == "fp4" else None, "scale_format": layout.scale_format or None,
            "global_scale_op": None, "has_bias": False, "block_nbytes": layout.nbytes,
            "parts": [{"name": n, "dtype": p.dtype, "shape": list(p.shape), "offset": p.offset, "nbytes": p.nbytes}
                      for n, p in layout.parts.items()],
            "layer_offsets": {str(i): i * layer_bytes for i in range(layers)}}
    return ExpertStore(folder, meta)
