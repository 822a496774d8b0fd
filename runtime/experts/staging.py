"""Pageable expert bytes on their way to the GPU: the page-locked ring they pass through (style item 5).

A store that could not be page-locked (the experts outgrow the pinnable share: Windows pins about half the RAM),
or the layers of one pinned in part that did not fit, is read from its memory-mapped file, and a GPU's copy engine
reads only page-locked memory, so every byte is first copied by the CPU into this ring. That host copy is the slow
half of the trip (one thread copies 10-16 GB/s, PCIe 4.0 x16 takes ~25 and the H200's link ~54), so for prefill
streaming, a layer at a time:

- a layer's blocks are copied into one slot by several threads at once, in chunks (`COPY_CHUNK_BYTES`);
- the copy runs on the ring's own thread, not the caller's: `stage_layer` returns a `Staged` at once, so the
  decoding thread goes on launching this layer's compute while the next layer's bytes come in (double
  buffering, as with a pinned store); `Staged.event()` waits until the layer's DMA is enqueued;
- a slot is written only after the DMA that last read it has finished (its event), so the GPU never reads bytes
  the CPU is overwriting.

Decode's few blocks at a time (fetches, promotions) go through the ring's entries too, on the same thread
(`stage_blocks`), so every write into the ring happens in call order on one thread and none can overtake another.
A promotion's host copy (~200 µs a qwen3-30b block at one thread's ~12 GB/s) then stays off the decoding thread,
as the design wants of promotions (s25d: with them copied on the decoding thread, decode from a mapped store ran
at 6.8 tok/s, 2.3 ms a layer call outside the CPU's and the link's work); a fetch, which the call waits for anyway,
pays one thread hop. Those blocks are copied by the ring's thread alone, not its copy threads: they overlap the
host-driven call's CPU kernel, which wants the cores (s26b: eight copying threads measured no faster). The ring
holds `planner.STAGING_RING_LAYERS` layers of blocks: what the planner counts as pinned host memory.

On a CPU device (tests) the "DMA" is a synchronous copy and every event is None.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

log = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 4 << 20      # a copy thread's unit: large enough that handing it over costs ~1 % of copying it
MAX_COPY_THREADS = 8            # a desktop's DRAM is saturated by a few copying cores; the rest stay the app's


def default_copy_threads() -> int:
    return max(1, min(MAX_COPY_THREADS, os.cpu_count() or 1))


@contextlib.contextmanager
def on_stream(stream, after):
    """Work queued inside goes on `stream` (a CUDA stream; None: a CPU device, nothing to do), after the event
    `after` (the compute that last read the destination)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        yield


class StagingError(RuntimeError):
    """The staging buffer could not be allocated at all (a message for the user)."""


class Staged:
    """A layer's staging in flight. `event()` waits until its bytes are in the ring and their copy to the device
    is enqueued, and returns the CUDA event the compute stream must wait on (None on a CPU device, where the
    copy has then finished). A failed copy raises here, in the caller's thread."""

    def __init__(self, future: Future):
        self._future = future

    def event(self):
        return self._future.result()

    def query(self) -> bool:
        """True once the bytes are on the device (never blocks; a failed staging raises here)."""
        if not self._future.done():
            return False
        event = self._future.result()
        return event is None or event.query()


class StagingRing:
    def __init__(self, *, slots: int, entries_per_slot: int, entry_nbytes: int, device: torch.device,
                 copy_threads: int | None = None):
        if slots < 1 or entries_per_slot < 1:
            raise ValueError(f"a staging ring needs at least one slot of one entry (got {slots} x {entries_per_slot})")
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = self.cuda             # page-locked slots (False once the OS refused them: pageable, slower)
        self.slots, self.entries_per_slot = slots, entries_per_slot
        self.entry_nbytes = entry_nbytes
        self._buf: torch.Tensor | None = None               # page-locked on first use (a tier that never misses
        self._events: list = [None] * (slots * entries_per_slot)     # or streams pins nothing); per entry: the DMA
                                                                     # that last read it
        self._next_entry = self._next_slot = 0
        self.copy_threads = copy_threads or default_copy_threads()
        self._copier = ThreadPoolExecutor(self.copy_threads, thread_name_prefix="ft-stage-copy") \
            if self.copy_threads > 1 else None
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="ft-stage")    # one: DMAs enqueue in call order
        self._pending: list[Future] = []
        # where the ring's thread spends its time (written by that thread alone; read for stats): a layer's host
        # copy is the slow half of the trip, and a wait for a slot's last DMA says the link or the GPU is behind
        self.timing = {"layers": 0, "blocks": 0, "bytes": 0, "wait_s": 0.0, "copy_s": 0.0, "ship_s": 0.0}

    @property
    def buf(self) -> torch.Tensor:
        """[slots * entries_per_slot, entry_nbytes]: slot s is entries [s * per_slot, (s + 1) * per_slot)."""
        if self._buf is None:
            shape = (len(self._events), self.entry_nbytes)
            if self.pin:
                try:
                    self._buf = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
                except RuntimeError as exc:  # the OS's page-locked limit (Windows: about half the RAM) is used up
                    # a pageable ring still works - each DMA then waits for the driver's own staging - so the
                    # prompt goes on, slower, and the user learns why and what frees page-locked memory
                    log.warning("could not page-lock %s MiB for the experts' staging buffer (%s): copies to the GPU "
                                "go through pageable memory, slower; close other GPU programs or lower the context "
                                "or VRAM budget so more host memory stays free", f"{self.nbytes / 2**20:,.0f}", exc)
                    self.pin = False
            if self._buf is None:
                try:
                    self._buf = torch.empty(shape, dtype=torch.uint8)
                except RuntimeError as exc:
                    raise StagingError(f"could not allocate {self.nbytes / 2**20:,.0f} MiB for the experts' staging "
                                       f"buffer ({exc}); close other programs or lower the context or VRAM budget "
                                       "so more host memory stays free") from exc
        return self._buf

    @property
    def nbytes(self) -> int:
        return len(self._events) * self.entry_nbytes

    # ------------------------------------------------------------------ a layer at a time (prefill)
    def stage_layer(self, src: np.ndarray, dst: torch.Tensor, *, stream=None, after=None) -> Staged:
        """Copy src ([n, entry_nbytes] uint8, n <= entries_per_slot) into the next slot and from there into dst
        (a device tensor of the same bytes) on `stream`, after the event `after` (the compute that last read
        dst). Returns at once."""
        if src.shape[0] > self.entries_per_slot or src.shape[1:] != (self.entry_nbytes,):
            raise ValueError(f"{tuple(src.shape)} does not fit a slot of {self.entries_per_slot} entries "
                             f"of {self.entry_nbytes} bytes")
        return self._submit(self._stage_layer, src, dst, stream, after)

    def _stage_layer(self, src: np.ndarray, dst: torch.Tensor, stream, after, inference: bool):
        slot = self._next_slot           # (only the ring's thread moves _next_slot and _next_entry: no lock)
        self._next_slot = (slot + 1) % self.slots
        entries = range(slot * self.entries_per_slot, slot * self.entries_per_slot + src.shape[0])
        t0 = time.perf_counter()
        self._wait_entries(entries)
        t1 = time.perf_counter()
        staging = self.buf[entries.start:entries.stop]
        self.parallel_copy(staging.numpy(), src)
        t2 = time.perf_counter()
        event = self._ship(entries, [(staging, dst)], stream, after, inference)
        self._count(layers=1, nbytes=src.nbytes, wait=t1 - t0, copy=t2 - t1, ship=time.perf_counter() - t2)
        return event

    def parallel_copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """dst[...] = src (same bytes, both C-contiguous) by the ring's copy threads, in chunks."""
        d, s = dst.reshape(-1), np.ascontiguousarray(src).reshape(-1)      # views: both are C-contiguous
        if self._copier is None or s.nbytes < 2 * COPY_CHUNK_BYTES:
            np.copyto(d, s)
            return
        # numpy lets go of the GIL while it copies plain bytes, so the chunks copy in parallel
        starts = range(0, s.nbytes, COPY_CHUNK_BYTES)
        list(self._copier.map(lambda a: np.copyto(d[a:a + COPY_CHUNK_BYTES], s[a:a + COPY_CHUNK_BYTES]), starts))

    # ------------------------------------------------------------------ blocks (decode: fetches, promotions)
    def stage_blocks(self, copies: list[tuple[np.ndarray, torch.Tensor]], *, stream=None, after=None) -> Staged:
        """Each (host block [entry_nbytes] uint8, device destination of its bytes) through the ring's next
        entries, on the ring's thread after everything staged before; returns at once."""
        return self._submit(self._stage_blocks, copies, stream, after)

    def _stage_blocks(self, copies, stream, after, inference: bool):
        event = None
        for lo in range(0, len(copies), len(self._events)):      # more blocks than entries: a ring's worth a time
            part = copies[lo:lo + len(self._events)]
            entries = []
            for _ in part:
                entries.append(self._next_entry)
                self._next_entry = (self._next_entry + 1) % len(self._events)
            t0 = time.perf_counter()
            self._wait_entries(entries)
            t1 = time.perf_counter()
            for i, (src, _) in zip(entries, part):          # (this thread alone: see the module's docstring)
                np.copyto(self.buf[i].numpy(), src)
            t2 = time.perf_counter()
            event = self._ship(entries, [(self.buf[i], dst) for i, (_, dst) in zip(entries, part)], stream, after,
                               inference)
            self._count(blocks=len(part), nbytes=len(part) * self.entry_nbytes, wait=t1 - t0, copy=t2 - t1,
                        ship=time.perf_counter() - t2)
        return event

    def _count(self, *, layers: int = 0, blocks: int = 0, nbytes: int, wait: float, copy: float, ship: float):
        t = self.timing
        t["layers"] += layers
        t["blocks"] += blocks
        t["bytes"] += nbytes
        t["wait_s"] += wait
        t["copy_s"] += copy
        t["ship_s"] += ship

    # ------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for everything staged so far, layers and blocks (raising the first failure)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        with contextlib.suppress(Exception):      # a failed staging was already raised to the caller that waited
            self.drain()
        self._stager.shutdown(wait=True)
        if self._copier is not None:
            self._copier.shutdown(wait=True)

    def _submit(self, stage, *args) -> Staged:
        """`stage(*args, inference)` on the ring's one thread (so every write into the ring keeps call order)."""
        _ = self.buf                     # page-locked here, on the caller's thread, if this is the first use
        # inference mode is per thread: the engine's dst was made under it, and outside it torch refuses to write
        # into such a tensor, so the ring's thread copies in the caller's mode
        future = self._stager.submit(stage, *args, torch.is_inference_mode_enabled())
        self._pending = [f for f in self._pending if not f.done()] + [future]
        return Staged(future)

    def _wait_entries(self, entries) -> None:
        """Until the DMAs that last read these entries have finished (each distinct event once)."""
        seen = set()
        for i in entries:
            event = self._events[i]
            if event is not None and id(event) not in seen:
                seen.add(id(event))
                event.synchronize()

    def _ship(self, entries, copies, stream, after, inference: bool):
        """Each (staging view, device dst) copied on `stream` after `after`, in the caller's inference mode; the
        entries remember the event (None on a CPU device, where the copies are done)."""
        with torch.inference_mode(inference), on_stream(stream if self.cuda else None, after):
            for staging, dst in copies:
                dst.copy_(staging, non_blocking=self.cuda)
            event = stream.record_event() if self.cuda else None
        for i in entries:
            self._events[i] = event
        return event
