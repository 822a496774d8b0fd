"""Recurrent-state slots for linear-attention layers (the "state slots" of the console).

A linear-attention sequence carries, for every Gated DeltaNet layer, a recurrent state
[Hv, dk, dv] in fp32 and a conv state [C, W-1] (the last W-1 projected inputs). Unlike a KV cache this
does not grow with the sequence, so the memory plan can reserve a fixed number of slots up front.

`StatePool` is that reservation: one tensor per kind over [S slots, G linear layers, ...], handed out
slot by slot (alloc/free), with snapshot/restore for the prefix cache. `SlotStateCache` is one
(slot, layer) view that satisfies the per-layer cache protocol of `runtime/models/base.py`
(`states` dict, offset, advance, trim, copy, nbytes): writing `cache.states["recurrent"] = t` copies
into the pool, and `copy()` returns a compact `runtime.kv_cache.StateCache` (what the prefix cache
stores) so a snapshot never pins a slot.

Shapes: S slots, G linear-attention layers, C conv channels, W conv width, Hv value heads,
dk / dv key / value head dims.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Iterator

import torch

from runtime.kv_cache import StateCache
from runtime.models.gated_deltanet import GatedDeltaNetConfig

CONV, RECURRENT = "conv", "recurrent"     # the two entries of a linear layer's `states`


class StatePoolFull(RuntimeError):
    """Every slot is taken: the caller should wait for a sequence to finish (or plan more slots)."""


@dataclass(frozen=True)
class LinearStateSpec:
    """What one sequence needs across a model's linear-attention layers."""
    num_layers: int                       # G
    conv_shape: tuple[int, int]           # [C, W-1]
    recurrent_shape: tuple[int, int, int]  # [Hv, dk, dv]
    conv_dtype: torch.dtype = torch.float32   # the activation dtype (the conv state holds projections)

    @classmethod
    def for_layers(cls, cfg: GatedDeltaNetConfig, num_layers: int, *, dtype: torch.dtype = torch.float32
                   ) -> "LinearStateSpec":
        return cls(num_layers, cfg.conv_state_shape(), cfg.recurrent_state_shape(), dtype)

    @property
    def bytes_per_sequence(self) -> int:
        conv = self.conv_shape[0] * self.conv_shape[1] * torch.tensor([], dtype=self.conv_dtype).element_size()
        rec = self.recurrent_shape[0] * self.recurrent_shape[1] * self.recurrent_shape[2] * 4   # fp32
        return self.num_layers * (conv + rec)


@dataclass
class StateSnapshot:
    """Every linear layer's state of one sequence at `offset` tokens, detached from any slot."""
    conv: torch.Tensor                    # [G, C, W-1]
    recurrent: torch.Tensor               # [G, Hv, dk, dv] fp32
    offset: int

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * 4


class StatePool:
    """A fixed number of state slots on one device; alloc/free are O(1) and never allocate tensors."""

    def __init__(self, spec: LinearStateSpec, capacity: int, *, device: torch.device | str = "cpu"):
        if capacity <= 0:
            raise ValueError(f"a state pool needs at least one slot, got capacity={capacity}")
        self.spec, self.capacity, self.device = spec, capacity, torch.device(device)
        G = spec.num_layers
        # normal tensors even when reserved inside inference mode: slots are reset and restored in place,
        # possibly outside it, which inference tensors refuse
        with torch.inference_mode(False):
            self.conv = torch.zeros(capacity, G, *spec.conv_shape, dtype=spec.conv_dtype, device=self.device)
            self.recurrent = torch.zeros(capacity, G, *spec.recurrent_shape, dtype=torch.float32, device=self.device)
        self._free = list(range(capacity - 1, -1, -1))      # stack: lowest slot handed out first
        self._offsets = [0] * capacity

    # -- slots -------------------------------------------------------------------------------------

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * 4

    def alloc(self) -> int:
        """A zeroed slot (a fresh sequence); StatePoolFull when none is left."""
        if not self._free:
            raise StatePoolFull(f"all {self.capacity} linear-attention state slots are in use")
        slot = self._free.pop()
        self.reset(slot)
        return slot

    def free(self, slot: int) -> None:
        self._check(slot)
        if slot in self._free:
            raise ValueError(f"state slot {slot} is already free")
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        self._check(slot)
        self.conv[slot].zero_()
        self.recurrent[slot].zero_()
        self._offsets[slot] = 0

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise IndexError(f"state slot {slot} is outside the pool (0..{self.capacity - 1})")

    # -- prefix cache ------------------------------------------------------------------------------

    def snapshot(self, slot: int) -> StateSnapshot:
        """An independent copy of the slot (for the prefix cache); later writes to the slot do not touch it."""
        self._check(slot)
        return StateSnapshot(self.conv[slot].clone(), self.recurrent[slot].clone(), self._offsets[slot])

    def restore(self, slot: int, snap: StateSnapshot) -> None:
        """Put a snapshot back into a slot, exactly (bit for bit)."""
        self._check(slot)
        if tuple(snap.conv.shape) != tuple(self.conv.shape[1:]) or \
                tuple(snap.recurrent.shape) != tuple(self.recurrent.shape[1:]):
            raise ValueError(f"state snapshot shapes conv {tuple(snap.conv.shape)}, recurrent "
                             f"{tuple(snap.recurrent.shape)} do not fit this pool's slots "
                             f"{tuple(self.conv.shape[1:])}, {tuple(self.recurrent.shape[1:])}")
        self.conv[slot].copy_(snap.conv)
        self.recurrent[slot].copy_(snap.recurrent)
        self._offsets[slot] = snap.offset

    # -- per-layer views for the cache protocol ----------------------------------------------------

    def layer_caches(self, slot: int) -> list["SlotStateCache"]:
        """One protocol-conforming cache per linear layer of the slot, in layer order. They share one
        lease: `release()` on any of them frees the slot once."""
        self._check(slot)
        lease = SlotLease(self, slot)
        return [SlotStateCache(lease, g) for g in range(self.spec.num_layers)]

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """States of several slots for one linear layer: conv [B, C, W-1], recurrent [B, Hv, dk, dv]."""
        return self.conv[slots, layer], self.recurrent[slots, layer]

    def scatter(self, layer: int, slots: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Write back what `gather` read, after the layer ran."""
        self.conv[slots, layer] = conv.to(self.conv.dtype)
        self.recurrent[slots, layer] = recurrent.float()


class _SlotStates(MutableMapping):
    """`states` of one (slot, layer): reads are views into the pool, writes copy into it."""

    def __init__(self, pool: StatePool, slot: int, layer: int):
        self._pool, self._slot, self._layer = pool, slot, layer

    def _tensor(self, key: str) -> torch.Tensor:
        if key == CONV:
            return self._pool.conv[self._slot, self._layer]
        if key == RECURRENT:
            return self._pool.recurrent[self._slot, self._layer]
        raise KeyError(key)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._tensor(key)

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.put(key, value)

    def put(self, key: str, value: torch.Tensor, *, wait: bool = True) -> None:
        """Copy `value` into the slot; `wait=False` leaves a copy from host memory in flight."""
        target = self._tensor(key)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"state {key!r} has shape {tuple(value.shape)}, the slot holds {tuple(target.shape)}")
        target.copy_(value, non_blocking=not wait)

    def __delitem__(self, key: str) -> None:
        self._tensor(key).zero_()

    def __iter__(self) -> Iterator[str]:
        return iter((CONV, RECURRENT))

    def __len__(self) -> int:
        return 2


class SlotLease:
    """One sequence's hold on a slot, shared by its G layer caches; frees the slot exactly once."""

    def __init__(self, pool: StatePool, slot: int):
        self.pool, self.slot, self.released = pool, slot, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool.free(self.slot)


class SlotStateCache:
    """One linear layer's state of one sequence, living in a `StatePool` slot (base.py's cache protocol)."""
    trimmable = False

    def __init__(self, lease: SlotLease, layer: int):
        self.lease, self.pool, self.slot, self.layer = lease, lease.pool, lease.slot, layer
        self.states = _SlotStates(lease.pool, lease.slot, layer)
        self.offset = lease.pool._offsets[lease.slot]

    def advance(self, n: int) -> None:
        self.offset += n
        self.pool._offsets[self.slot] = self.offset

    def trim(self, n: int) -> int:
        return 0          # a recurrent state cannot be rewound

    def copy(self) -> StateCache:
        """A compact, slot-free copy: what the prefix cache keeps."""
        return StateCache({k: v.clone() for k, v in self.states.items()}, self.offset)

    def load(self, other, length: int | None = None, *, wait: bool = True) -> None:
        """Take over a stored copy's states (a prefix-cache hit entering this slot); only whole. `wait`: False
        leaves a copy from host memory in flight (the caller waits once: `SequenceCache.load`)."""
        if length is not None and length != other.offset:
            raise ValueError(f"a recurrent state of {other.offset} tokens cannot be cut to {length}")
        if not other.states:                  # a stored fresh sequence: nothing seen yet
            del self.states[CONV], self.states[RECURRENT]
        for key, value in other.states.items():
            self.states.put(key, value, wait=wait)
        self.offset = other.offset
        self.pool._offsets[self.slot] = other.offset

    def release(self) -> None:
        """Give the slot back (the engine calls this when the sequence ends)."""
        self.lease.release()

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.states.values())
