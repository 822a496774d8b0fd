"""Host -> device copies of whole experts on a copy stream, with events (style item 5).

`submit(copies, after=event)` enqueues one non-blocking copy per (host block, device destination) on the
copy stream, after `after` (the compute work that last read the destination), and returns an event the
compute stream waits on. `submit_range` moves a whole layer's blocks (prefill streaming). Page-locked layers
are copied straight from the host buffer; a mapped (pageable) store's - or the unpinned layers of a store pinned
in part (`HostExpertStore.pinned_copy(layers=...)`) - are staged through the page-locked ring of
staging.py, whose copies run on its own threads: `submit` and `submit_range` then return a `Staged` (its
`event()` waits for the staging and gives the copy's event, its `query()` says whether the bytes have landed).

On a CPU device copies are plain synchronous `copy_` and events are None.
"""
from __future__ import annotations

import numpy as np
import torch

from runtime.experts.host_store import HostExpertStore
from runtime.experts.planner import STAGING_RING_LAYERS
from runtime.experts.staging import Staged, StagingRing, on_stream


class Transport:
    def __init__(self, store: HostExpertStore, device: torch.device, *, staged: bool | None = None,
                 copy_threads: int | None = None):
        """`staged`: copy through the ring (None: when a GPU would read a store that is not page-locked; True on a
        CPU device runs the ring's code path in tests). `copy_threads`: the ring's host copy threads."""
        self.store = store
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        # the layers a GPU DMAs from directly (page-locked); the rest go through the ring. A store pinned in part
        # (`HostExpertStore.pinned_copy(layers=...)`) keeps its pinned layers in one buffer: a block is copied
        # directly when its address lies in that span
        self.pinned_layers = store.pinned_layers if self.cuda else frozenset()
        self.pinned = self.cuda and self.pinned_layers == frozenset(store.layers)     # every layer
        self._direct_span = layers_span(store, self.pinned_layers)
        if staged is None:
            staged = self.cuda and not self.pinned
        self.ring = StagingRing(slots=STAGING_RING_LAYERS, entries_per_slot=store.num_experts,
                                entry_nbytes=store.block_nbytes, device=device, copy_threads=copy_threads) \
            if staged else None
        self.bytes_copied = 0

    def submit(self, copies: list[tuple[np.ndarray, torch.Tensor]], *, after=None):
        """copies: (host block [nbytes] uint8, device destination [nbytes] uint8). Returns an event, None, or (from
        a pageable store, staged on the ring's thread) a `Staged`."""
        if not copies:
            return None
        self.bytes_copied += sum(src.nbytes for src, _ in copies)
        direct, staged = [], []
        for c in copies:
            (direct if self._direct(c[0]) else staged).append(c)
        event = None
        if direct:
            with on_stream(self.stream, after):
                for src, dst in direct:
                    dst.copy_(torch.from_numpy(src), non_blocking=self.cuda)
                event = self._record()
        # (the ring's DMAs go on the same stream, after these: its event covers both)
        return self.ring.stage_blocks(staged, stream=self.stream, after=after) if staged else event

    def submit_range(self, src: np.ndarray, dst: torch.Tensor, *, after=None):
        """One large contiguous copy (a whole layer's blocks for prefill streaming): an event, None, or (from a
        pageable store) a `Staged`."""
        self.bytes_copied += src.nbytes
        if self.ring is not None and not self._direct(src):
            return self.ring.stage_layer(src, dst, stream=self.stream, after=after)
        with on_stream(self.stream, after):
            dst.copy_(torch.from_numpy(src), non_blocking=self.cuda)
            return self._record()

    def _direct(self, src: np.ndarray) -> bool:
        """Whether the GPU DMAs this host block directly (it lies in the page-locked span)."""
        lo, hi = self._direct_span
        return self.ring is None or lo <= src.ctypes.data < hi

    def close(self) -> None:
        """Let the ring's threads go (the tier is being dropped)."""
        if self.ring is not None:
            self.ring.close()

    def _record(self):
        return self.stream.record_event() if self.cuda else None


def ready_event(handle):
    """The CUDA event (or None) behind what `submit`/`submit_range` returned, waiting for a staging first."""
    return handle.event() if isinstance(handle, Staged) else handle


def layers_span(store: HostExpertStore, layers) -> tuple[int, int]:
    """[lowest, highest) address of these layers' blocks ((0, 0) for none): a store's pinned layers lie in one
    buffer, so a block inside the span is one of theirs."""
    spans = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in map(store.layer_buffer, layers)]
    return (min(a for a, _ in spans), max(b for _, b in spans)) if spans else (0, 0)
