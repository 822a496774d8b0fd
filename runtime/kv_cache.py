"""Per-sequence caches: a KV cache for each attention layer, a state slot for each linear-attention layer.

The protocol (see runtime/models/base.py): offset, nbytes, trimmable, trim(n), copy(). A KVCache keeps
keys and values in one growing buffer per layer so that update-and-fetch is a copy into the tail and a
view of the head, never a concatenation of the whole history.

Shapes: Hkv key/value heads, S cached tokens, T new tokens, hd head dim.
"""
from __future__ import annotations

import torch

# Buffers grow in steps of this many tokens (then by doubling), so decode reallocates rarely.
GROWTH_STEP = 256


class KVCache:
    """Keys and values of one attention layer for one sequence."""
    trimmable = True

    def __init__(self, num_kv_heads: int, head_dim: int, *, device: torch.device | str, dtype: torch.dtype,
                 capacity: int = 0):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device, self.dtype = torch.device(device), dtype
        self.offset = 0
        self.keys = torch.empty(num_kv_heads, capacity, head_dim, device=self.device, dtype=dtype)    # [Hkv, cap, hd]
        self.values = torch.empty(num_kv_heads, capacity, head_dim, device=self.device, dtype=dtype)  # [Hkv, cap, hd]

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[1])

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity, GROWTH_STEP)
        new_cap = -(-new_cap // GROWTH_STEP) * GROWTH_STEP
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = torch.empty(self.num_kv_heads, new_cap, self.head_dim, device=self.device, dtype=self.dtype)
            grown[:, :self.offset] = old[:, :self.offset]
            setattr(self, name, grown)

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [Hkv, T, hd]; return every cached key and value [Hkv, S, hd] (views, S = new offset)."""
        t = int(k.shape[1])
        self._reserve(self.offset + t)
        self.keys[:, self.offset:self.offset + t] = k
        self.values[:, self.offset:self.offset + t] = v
        self.offset += t
        return self.keys[:, :self.offset], self.values[:, :self.offset]

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.offset))
        self.offset -= n
        return n

    def load(self, other: "KVCache", length: int | None = None) -> None:
        """Take the first `length` tokens (default all) of another KV cache (a prefix-cache hit)."""
        n = other.offset if length is None else length
        if not 0 <= n <= other.offset:
            raise ValueError(f"cannot take {n} tokens from a KV cache holding {other.offset}")
        self.offset = 0
        self._reserve(n)
        self.keys[:, :n] = other.keys[:, :n]
        self.values[:, :n] = other.values[:, :n]
        self.offset = n

    def copy(self) -> "KVCache":
        """A compact independent copy holding exactly `offset` tokens."""
        out = KVCache(self.num_kv_heads, self.head_dim, device=self.device, dtype=self.dtype, capacity=0)
        out.keys = self.keys[:, :self.offset].clone()
        out.values = self.values[:, :self.offset].clone()
        out.offset = self.offset
        return out

    def to(self, device: torch.device | str) -> "KVCache":
        """A compact copy on `device` (the prefix cache may keep GPU caches in host RAM)."""
        device = torch.device(device)
        out = KVCache(self.num_kv_heads, self.head_dim, device=device, dtype=self.dtype, capacity=0)
        out.keys = self.keys[:, :self.offset].to(device, copy=True)
        out.values = self.values[:, :self.offset].to(device, copy=True)
        out.offset = self.offset
        return out

    @property
    def nbytes(self) -> int:
        return (self.keys.numel() + self.values.numel()) * self.keys.element_size()


class StateCache:
    """The recurrent-state slot of one linear-attention layer for one sequence.

    The layer owns the meaning of `states` (e.g. "conv" and "recurrent" tensors); an empty dict means
    the sequence has not started. Recurrent state cannot be rewound, so `trim` drops nothing.
    """
    trimmable = False

    def __init__(self, states: dict[str, torch.Tensor] | None = None, offset: int = 0):
        self.states: dict[str, torch.Tensor] = dict(states or {})
        self.offset = offset

    def advance(self, n: int) -> None:
        self.offset += n

    def trim(self, n: int) -> int:
        return 0

    def copy(self) -> "StateCache":
        return StateCache({k: v.clone() for k, v in self.states.items()}, self.offset)

    def to(self, device: torch.device | str) -> "StateCache":
        return StateCache({k: v.to(device, copy=True) for k, v in self.states.items()}, self.offset)

    def load(self, other: "StateCache", length: int | None = None) -> None:
        """Take another state's tensors (a prefix-cache hit); a recurrent state restores only whole."""
        if length is not None and length != other.offset:
            raise ValueError(f"a recurrent state of {other.offset} tokens cannot be cut to {length}")
        self.states = {k: v.clone() for k, v in other.states.items()}
        self.offset = other.offset

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.states.values())


class SequenceCache:
    """Every layer's cache for one sequence."""

    def __init__(self, layers: list):
        self.layers = layers

    @property
    def offset(self) -> int:
        return self.layers[0].offset if self.layers else 0

    @property
    def trimmable(self) -> bool:
        return all(layer.trimmable for layer in self.layers)

    def trim(self, n: int) -> int:
        """Drop the last n tokens from every layer; refuses (drops nothing) when a layer is recurrent."""
        if n <= 0 or not self.trimmable:
            return 0
        dropped = {layer.trim(n) for layer in self.layers}
        return dropped.pop()

    def copy(self) -> "SequenceCache":
        return SequenceCache([layer.copy() for layer in self.layers])

    def to(self, device: torch.device | str) -> "SequenceCache":
        """A copy on `device` of a detached cache (plain KV and state layers)."""
        return SequenceCache([layer.to(device) for layer in self.layers])

    def load(self, other: "SequenceCache", length: int | None = None) -> None:
        """Fill this (fresh) cache from a stored one, keeping its first `length` tokens (default all)."""
        if len(other.layers) != len(self.layers):
            raise ValueError(f"stored cache has {len(other.layers)} layers, this model {len(self.layers)}")
        for mine, theirs in zip(self.layers, other.layers):
            mine.load(theirs, length)

    def detach(self) -> "SequenceCache":
        """A cache that holds no pooled resources, for the prefix cache once the sequence is done.

        Plain KV caches are handed over as they are (no copy); a layer living in a pool (a state
        slot) is copied out. Call `release()` afterwards to give the pooled resources back.
        """
        return SequenceCache([layer if isinstance(layer, (KVCache, StateCache)) else layer.copy()
                              for layer in self.layers])

    def release(self) -> None:
        """Give back pooled resources (state slots); a no-op for plain caches."""
        for layer in self.layers:
            release = getattr(layer, "release", None)
            if callable(release):
                release()

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)
