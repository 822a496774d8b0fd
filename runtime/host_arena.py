"""Page-locked host memory for the prefix cache's copies of GPU caches, page-locked once and reused.

Why not torch's pinned allocator for each copy: it rounds every block up to a power of two (a 16,385-token K
tensor of 16 MiB + 1 KiB takes 32 MiB, so an entry's host RAM is up to twice its size) and page-locks fresh memory
for each new block at ~2 GB/s - storing a 16K-token qwen3-30b conversation took 0.76 s of its step (s32e). The
arena page-locks slabs as entries need them, never more than `max_bytes` in all (the plan's prefix-cache RAM),
and carves exact-size tensors out of them; when an entry's tensors die (the prefix cache dropped it) their bytes
come back for the next entry, so an agent's resent, slightly longer conversation lands where the last one was.

Each carved tensor has its own storage (torch.frombuffer over a ctypes view of the slab), so the range comes
back only when the last tensor or view sharing it is gone. A request the arena cannot serve - larger than a
slab, or the arena full - gets None and the caller falls back to torch's allocator.

Locking is the slow part (cudaHostAlloc ~2.8 GB/s, s33a: a 30K-token conversation's first store spent ~0.5 s of
its step on it), so `prepare(nbytes)` asks a background thread to lock slabs ahead - the engine calls it when a
prompt that will be stored starts prefilling, and the store then finds its memory locked. The slabs are registered
with the driver rather than allocated by it, since cudaHostAlloc stalls every other thread's CUDA calls while it
runs (s34a).
"""
from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from typing import Callable

import torch

log = logging.getLogger(__name__)

SLAB_BYTES = 256 << 20     # page-locked at a time; a power of two, as torch's pinned allocator would round it
ALIGN = 512                # every carved tensor starts on 512 bytes (what DMA wants; CUDA aligns its own to 256)


def registered_slab(nbytes: int) -> torch.Tensor:
    """Ordinary memory, touched, then page-locked in place (cudaHostRegister): what a GPU engine's arena uses.
    Measured beside a decode-like loop on another thread (s34a): 8.2 GB/s, and the loop's steps held 12-15 ms a
    slab at worst (p50 unchanged), where cudaHostAlloc held them for its whole ~85 ms. The memory is the expert
    store's kind (`HostBuffer`): a private mapping kept out of forked children (page-locked private pages would be
    copied into one), in huge pages where the OS offers them, unregistered before it goes back to the OS."""
    from runtime.experts.host_store import HostBuffer

    buf = HostBuffer(nbytes)
    buf.touch()                        # faulted in here: plain CPU work, off the driver's lock
    if not buf.pin(quiet=True):        # (never inside a decode graph's capture: cuda_capture.py)
        raise RuntimeError(f"cudaHostRegister of {nbytes >> 20} MiB was refused")
    return buf.tensor()                # (it keeps the buffer's array, and so its registration, alive)


def plain_slab(nbytes: int) -> torch.Tensor:
    """Ordinary memory: an engine without a GPU (or a test) that still keeps its prefix cache apart."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _grow_ahead(arena_ref: "weakref.ref[HostArena]", cond: threading.Condition) -> None:
    """The lock-ahead thread: locks slabs while the arena is short of what prepare() asked; ends with the arena."""
    while True:
        with cond:
            arena = arena_ref()
            if arena is None:
                return
            if not arena._short_of_wanted():
                arena._wanted = 0
                del arena                  # no strong hold while waiting
                if arena_ref() is None:    # that was the last one (its end's wake-up came before this wait)
                    return
                cond.wait()
                continue
        added = arena._add_slab() is not None
        with cond:
            if added:
                arena.locked_ahead += 1
            else:
                arena._wanted = 0
        del arena


def _wake(cond: threading.Condition) -> None:
    with cond:
        cond.notify_all()


class HostArena:
    def __init__(self, max_bytes: int, *, slab_bytes: int = SLAB_BYTES,
                 allocate: Callable[[int], torch.Tensor] = registered_slab):
        # a small budget (tests, a tight plan) gets smaller slabs rather than none
        self.slab_bytes = min(int(slab_bytes), 1 << max(12, int(max_bytes).bit_length() - 1))
        self.max_slabs = max(0, int(max_bytes) // self.slab_bytes)
        self._allocate = allocate
        self._slabs: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []    # per slab: sorted, coalesced (start, length) runs
        # ranges come back from whichever thread drops the last view; slabs are locked outside it (~0.1 s each)
        self._cond = threading.Condition()
        self._locking = 0                              # slabs being locked right now (by any thread)
        self._wanted = 0                               # prepare()'s target for the background thread
        self._grower: threading.Thread | None = None
        self.used_bytes = 0
        self.fallbacks = 0                             # requests it could not serve (the caller's allocator did)
        self.locked_ahead = 0                          # slabs the background thread locked

    @property
    def nbytes(self) -> int:
        """Host RAM the arena holds page-locked (used or free)."""
        return len(self._slabs) * self.slab_bytes

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised tensor in page-locked memory, or None when the arena cannot serve it."""
        numel = 1
        for n in shape:
            numel *= int(n)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        size = -(-numel * dtype.itemsize // ALIGN) * ALIGN
        place = self._take(size)
        if place is None:
            with self._cond:
                self.fallbacks += 1
            return None
        slab, start = place
        base = self._slabs[slab].data_ptr() + start
        view = (ctypes.c_char * size).from_address(base)
        # the ctypes view is the storage's owner: it dies with the last tensor sharing that storage
        weakref.finalize(view, self._give_back, slab, start, size)
        return torch.frombuffer(view, dtype=dtype, count=numel).view(*shape)

    def slabs_nbytes(self, sizes: list[int]) -> int:
        """The slab bytes these tensors take carved in fresh slabs, in order, first fit: more than their sum where
        they do not tile a slab (96 K/V tensors of 30.7 MB fit 8 to a 256 MiB slab: 12 slabs, not the 11 their
        bytes fill - s34c). Tensors larger than a slab are left out (torch's allocator takes them)."""
        room: list[int] = []
        for n in sizes:
            size = -(-int(n) // ALIGN) * ALIGN
            if size > self.slab_bytes:
                continue
            for i, free in enumerate(room):
                if free >= size:
                    room[i] -= size
                    break
            else:
                room.append(self.slab_bytes - size)
        return len(room) * self.slab_bytes

    def prepare(self, nbytes: int) -> None:
        """Hold at least `nbytes` page-locked in all (up to the budget) soon: a background thread locks the slabs."""
        with self._cond:
            if self.max_slabs <= len(self._slabs):
                return
            self._wanted = max(self._wanted, int(nbytes))
            if self._grower is None:
                # the thread holds the arena weakly: an engine dropped on a model switch takes its arena and its
                # page-locked slabs with it (a strong hold kept up to the whole budget locked for good), and the
                # arena's end wakes the thread to exit
                self._grower = threading.Thread(target=_grow_ahead, args=(weakref.ref(self), self._cond),
                                                name="host-arena-lock-ahead", daemon=True)
                self._grower.start()
                weakref.finalize(self, _wake, self._cond)
            self._cond.notify_all()

    def _short_of_wanted(self) -> bool:
        held = len(self._slabs) + self._locking
        return held * self.slab_bytes < self._wanted and held < self.max_slabs

    def _take(self, size: int) -> tuple[int, int] | None:
        if size > self.slab_bytes:
            return None
        while True:
            with self._cond:
                place = self._fit(size)
                if place is not None:
                    self.used_bytes += size
                    return place
                if self._locking and len(self._slabs) + self._locking >= self.max_slabs:
                    self._cond.wait()        # the last slabs are being locked ahead: wait for them, not a fallback
                    continue
            if self._add_slab() is None:
                return None

    def _fit(self, size: int) -> tuple[int, int] | None:
        for slab, runs in enumerate(self._free):       # first fit keeps an entry's tensors together
            for i, (start, length) in enumerate(runs):
                if length >= size:
                    runs[i:i + 1] = [(start + size, length - size)] if length > size else []
                    return slab, start
        return None

    def _add_slab(self) -> int | None:
        """Lock one more slab (outside the lock: ~0.1 s); None when the budget or the OS says no."""
        with self._cond:
            if len(self._slabs) + self._locking >= self.max_slabs:
                return None
            self._locking += 1
        try:
            slab = self._allocate(self.slab_bytes)
        except Exception as exc:        # noqa: BLE001 - the OS's page-lock limit (Windows: about half the RAM), no
            # memory left to map: stop growing. Anything escaping would leave `_locking` counted and a store waiting
            log.warning("the prefix cache's page-locked host memory stops at %d MiB: the OS refused to lock more (%s); "
                        "further conversations are kept in memory that is slower to bring back to the GPU",
                        self.nbytes >> 20, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            with self._cond:
                self._locking -= 1
                self.max_slabs = len(self._slabs) + self._locking
                self._cond.notify_all()
            return None
        with self._cond:
            self._locking -= 1
            self._slabs.append(slab)
            self._free.append([(0, self.slab_bytes)])
            self._cond.notify_all()
            return len(self._slabs) - 1

    def _give_back(self, slab: int, start: int, size: int) -> None:
        with self._cond:
            self.used_bytes -= size
            runs = self._free[slab]
            runs.append((start, size))
            runs.sort()
            merged: list[tuple[int, int]] = []
            for s, n in runs:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((s, n))
            self._free[slab] = merged
            self._cond.notify_all()

    def stats(self) -> dict:
        return {"pinned_bytes": self.nbytes, "used_bytes": self.used_bytes, "slabs": len(self._slabs),
                "fallbacks": self.fallbacks, "locked_ahead": self.locked_ahead}
