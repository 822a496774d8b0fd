"""Host -> device copies of whole experts on a copy stream, with events (style item 5).

`submit(copies, after=event)` enqueues one non-blocking copy per (host block, device destination) on the
copy stream, after `after` (the compute work that last read the destination), and returns an event the
compute stream waits on. Page-locked stores are copied straight from the host buffer; a mapped (pageable)
store is staged through a ring of pinned buffers first, each reused only after its last copy finished, so
the GPU never reads a staging buffer the CPU is refilling.

On a CPU device copies are plain synchronous `copy_` and events are None.
"""
from __future__ import annotations

import numpy as np
import torch

from runtime.experts.host_store import HostExpertStore


class Transport:
    def __init__(self, store: HostExpertStore, device: torch.device, *, ring_blocks: int = 16):
        self.store = store
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.pinned = self.cuda and _is_pinned(store)
        self.ring = None
        if self.cuda and not self.pinned:
            self.ring = torch.empty((ring_blocks, store.block_nbytes), dtype=torch.uint8, pin_memory=True)
            self.ring_events: list[torch.cuda.Event | None] = [None] * ring_blocks
            self.ring_next = 0
        self.bytes_copied = 0

    def submit(self, copies: list[tuple[np.ndarray, torch.Tensor]], *, after=None):
        """copies: (host block [nbytes] uint8, device destination [nbytes] uint8). Returns an event (or None)."""
        if not copies:
            return None
        self.bytes_copied += sum(src.nbytes for src, _ in copies)
        if not self.cuda:
            for src, dst in copies:
                dst.copy_(torch.from_numpy(src))
            return None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for src, dst in copies:
                if self.pinned:
                    dst.copy_(torch.from_numpy(src), non_blocking=True)
                else:
                    i, buf = self._stage(src)
                    dst.copy_(buf, non_blocking=True)
                    self.ring_events[i] = self.stream.record_event()
            return self.stream.record_event()

    def submit_range(self, src: np.ndarray, dst: torch.Tensor, *, after=None):
        """One large contiguous copy (a whole layer's blocks for prefill streaming)."""
        self.bytes_copied += src.nbytes
        if not self.cuda:
            dst.copy_(torch.from_numpy(src))
            return None
        if not self.pinned:       # a layer at a time through the ring would serialise: copy block by block
            return self.submit(list(zip(src, dst)), after=after)
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            dst.copy_(torch.from_numpy(src), non_blocking=True)
            return self.stream.record_event()

    def _stage(self, src: np.ndarray) -> tuple[int, torch.Tensor]:
        i = self.ring_next
        self.ring_next = (i + 1) % len(self.ring_events)
        ev = self.ring_events[i]
        if ev is not None:
            ev.synchronize()                       # the last copy out of this buffer has finished
        buf = self.ring[i]
        np.copyto(buf.numpy(), src)
        return i, buf


def _is_pinned(store: HostExpertStore) -> bool:
    owner = getattr(store, "_owner", None)
    if getattr(owner, "pinned", False):               # a HostBuffer registered with the driver
        return True
    return isinstance(owner, torch.Tensor) and owner.is_pinned()
