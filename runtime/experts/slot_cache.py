"""The VRAM expert slot pool and its (layer, expert) -> slot table, mirrored on the device.

The pool is one uint8 tensor [S, nbytes] holding FTW blocks as they are on disk (so one copy moves one
expert). `SlotDirectory` (policy.py) decides which key holds which slot; this object owns the device memory
and keeps a device copy of the map, `table [L, E]` (-1 = not resident), so the GPU turns router output into
slots with one gather and no host sync. Table writes are issued on the compute stream in the order the
host decides them, so the device table always equals the host's view at that point of the stream: a key is
published only once its bytes have landed, and withdrawn before its slot is overwritten.

On a CPU device the same code runs with a CPU tensor as the "pool" (what CI exercises).
"""
from __future__ import annotations

import torch

from runtime.experts.policy import Key, SlotDirectory


class SlotCache:
    def __init__(self, *, directory: SlotDirectory, layers: list[int], num_experts: int, block_nbytes: int,
                 device: torch.device):
        self.directory = directory
        self.device = device
        self.layer_index = {layer: i for i, layer in enumerate(layers)}
        self.block_nbytes = block_nbytes
        self.pool = torch.empty((directory.capacity, block_nbytes), dtype=torch.uint8, device=device)
        self.table = torch.full((len(layers), num_experts), -1, dtype=torch.int64, device=device)
        self.pending: set[Key] = set()            # allocated, bytes still in flight: not a hit yet
        self.published: set[Key] = set()          # what the device table says is resident
        self._per_layer = {layer: 0 for layer in layers}
        self.num_experts = num_experts

    @property
    def nbytes(self) -> int:
        return self.pool.numel() + self.table.numel() * 8

    def is_ready(self, key: Key) -> bool:
        return key in self.directory.slot_of and key not in self.pending

    def device_slots(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, K] expert ids -> [T, K] slots (-1 where not resident), on the device, without a host sync."""
        return self.table[self.layer_index[layer]][topk_ids]

    def publish(self, key: Key, slot: int) -> None:
        self.pending.discard(key)
        if key not in self.published:
            self.published.add(key)
            self._per_layer[key[0]] += 1
        self.table[self.layer_index[key[0]], key[1]] = slot

    def withdraw(self, key: Key) -> None:
        if key in self.published:
            self.published.discard(key)
            self._per_layer[key[0]] -= 1
        self.table[self.layer_index[key[0]], key[1]] = -1

    def layer_resident(self, layer: int) -> bool:
        """Every expert of `layer` is in the pool and published: its calls need no host involvement."""
        return self._per_layer[layer] == self.num_experts

    def slot_view(self, slot: int) -> torch.Tensor:
        return self.pool[slot]
