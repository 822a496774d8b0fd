"""The VRAM expert slot pool and its (layer, expert) -> slot table, mirrored on the device.

The pool is one uint8 tensor [S, nbytes] holding FTW blocks as they are on disk (so one copy moves one
expert). `SlotDirectory` (policy.py) decides which key holds which slot; this object owns the device memory
and keeps a device copy of the map, `table [L, E]` (-1 = not resident), so the GPU turns router output into
slots with one gather and no host sync. Table writes are issued on the compute stream in the order the
host decides them, so the device table always equals the host's view at that point of the stream: a key is
published only once its bytes have landed, and withdrawn before its slot is overwritten.

`host_table [L, E]` is the host's numpy copy of what has been published (the same values the device table
will hold once the stream reaches the writes): the hybrid tier splits a call's experts into hits and misses
with one fancy index over it, and `resident [L]` counts each layer's published experts.

A batch of table writes costs a constant number of launches however many entries it has: the (flat index,
slot) pairs go into page-locked host memory from torch's caching host allocator (which keeps a buffer until
the copy that reads it has run, so no write races a copy still in flight), one non-blocking copy moves them
into a preallocated device buffer, and one `index_copy_` applies them.

On a CPU device the same code runs with a CPU tensor as the "pool" (what CI exercises); table writes are
numpy stores into the tensor's own memory.
"""
from __future__ import annotations

import numpy as np
import torch

from runtime.experts.policy import Key, SlotDirectory


class SlotCache:
    def __init__(self, *, directory: SlotDirectory, layers: list[int], num_experts: int, block_nbytes: int,
                 device: torch.device, miss_table: bool = False):
        self.directory = directory
        self.device = device
        self.cuda = device.type == "cuda"
        self.layer_index = {layer: i for i, layer in enumerate(layers)}
        self.block_nbytes = block_nbytes
        self.num_experts = num_experts
        self.pool = torch.empty((directory.capacity, block_nbytes), dtype=torch.uint8, device=device)
        self.table = torch.full((len(layers), num_experts), -1, dtype=torch.int64, device=device)
        self.table_rows = [self.table[i] for i in range(len(layers))]     # views: one gather per lookup
        self.host_table = np.full((len(layers), num_experts), -1, dtype=np.int64)   # published, on the host
        self.resident = np.zeros(len(layers), dtype=np.int64)            # published experts per layer
        self.pending: set[Key] = set()            # allocated, bytes still in flight: not a hit yet
        self._flat_table = self.table.view(-1)
        self._table_np = None if self.cuda else self.table.numpy()
        # with `miss_table`, the complement: `miss_table [L, E]` = e where expert e is NOT published, else -1
        # (what the zero-copy pass over host memory computes; hybrid.py), written with the table
        self.miss_table = (torch.arange(num_experts, device=device).repeat(len(layers), 1)
                           if miss_table else None)                     # [L, E] int64
        self.miss_rows = [] if self.miss_table is None else [self.miss_table[i] for i in range(len(layers))]
        self._miss_np = None if self.cuda or self.miss_table is None else self.miss_table.numpy()
        # device side of batched table writes: [3, L*E] (flat index, slot, miss entry), written by
        # stream-ordered copies
        self._updates = torch.empty((3, self.table.numel()), dtype=torch.int64, device=device) if self.cuda else None

    @property
    def nbytes(self) -> int:
        return self.pool.numel() + self.table.numel() * 8 * (1 if self.miss_table is None else 2)

    @property
    def published(self) -> set[Key]:
        """What the device table says is resident (built from the host mirror; for tests and reports)."""
        layers = list(self.layer_index)
        li, e = np.nonzero(self.host_table >= 0)
        return {(layers[i], int(x)) for i, x in zip(li, e)}

    def is_ready(self, key: Key) -> bool:
        return key in self.directory.slot_of and key not in self.pending

    def device_slots(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, K] expert ids -> [T, K] slots (-1 where not resident), on the device, without a host sync."""
        row = self.table_rows[self.layer_index[layer]]
        # take: one gather like row[ids], with less host-side dispatch (indexing parses a general index)
        return row.take(topk_ids) if topk_ids.dtype == torch.int64 else row[topk_ids]

    def publish(self, key: Key, slot: int) -> None:
        self.publish_many([key], [slot])

    def withdraw(self, key: Key) -> None:
        self.withdraw_many([key])

    def publish_many(self, keys: list[Key], slots: list[int]) -> None:
        """The keys' bytes have landed in their slots: the table (host mirror, then device) points at them."""
        for key in keys:
            self.pending.discard(key)
        self._write(keys, slots)

    def withdraw_many(self, keys: list[Key]) -> None:
        """The keys are leaving the pool (their slots are about to be overwritten): the table says -1."""
        self._write(keys, [-1] * len(keys))

    def _write(self, keys: list[Key], slots: list[int]) -> None:
        if not keys:
            return
        li = np.fromiter((self.layer_index[k[0]] for k in keys), dtype=np.int64, count=len(keys))
        e = np.fromiter((k[1] for k in keys), dtype=np.int64, count=len(keys))
        new = np.asarray(slots, dtype=np.int64)
        was = self.host_table[li, e] >= 0
        self.host_table[li, e] = new
        np.add.at(self.resident, li, (new >= 0).astype(np.int64) - was)
        if self._table_np is not None:
            self._table_np[li, e] = new
            if self._miss_np is not None:
                self._miss_np[li, e] = np.where(new >= 0, -1, e)
            return
        n = len(keys)
        rows = 3 if self.miss_table is not None else 2
        staged = torch.empty((rows, n), dtype=torch.int64, pin_memory=True)     # caching host allocator
        staged_np = staged.numpy()
        np.multiply(li, self.num_experts, out=staged_np[0])
        staged_np[0] += e
        staged_np[1] = new
        if rows == 3:
            staged_np[2] = np.where(new >= 0, -1, e)
        upd = self._updates[:rows, :n]
        upd.copy_(staged, non_blocking=True)
        self._flat_table.index_copy_(0, upd[0], upd[1])
        if rows == 3:
            self.miss_table.view(-1).index_copy_(0, upd[0], upd[2])

    def layer_resident(self, layer: int) -> bool:
        """Every expert of `layer` is in the pool and published: its calls need no host involvement."""
        return self.resident[self.layer_index[layer]] == self.num_experts

    def slot_view(self, slot: int) -> torch.Tensor:
        return self.pool[slot]
