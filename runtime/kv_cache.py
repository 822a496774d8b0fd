"""Per-sequence caches: a KV cache for each attention layer, a state slot for each linear-attention layer.

The protocol (see runtime/models/base.py): offset, nbytes, trimmable, trim(n), copy(). A KVCache keeps
keys and values in one growing buffer per layer so that update-and-fetch is a copy into the tail and a
view of the head, never a concatenation of the whole history.

Shapes: Hkv key/value heads, S cached tokens, T new tokens, hd head dim.
"""
from __future__ import annotations

import logging

import torch

from runtime.host_arena import HostArena

log = logging.getLogger(__name__)

# Buffers grow in steps of this many tokens (then by doubling), so decode reallocates rarely.
GROWTH_STEP = 256


class KVCache:
    """Keys and values of one attention layer for one sequence.

    With a sliding `window` W (gpt-oss's alternate layers) only the last W-1 tokens are ever needed
    again, so the buffer drops older ones once W of them pile up (an occasional copy of W-1 tokens to
    the front): memory stays ~2W tokens however long the sequence. Such a cache cannot be rewound past
    what it dropped, so it is not trimmable, and it loads only whole.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, *, device: torch.device | str, dtype: torch.dtype,
                 capacity: int = 0, window: int | None = None):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device, self.dtype = torch.device(device), dtype
        self.window = window
        self.max_tokens: int | None = None   # growth stops doubling here (the engine's context: what the plan holds)
        self.offset = 0          # tokens seen
        self.start = 0           # absolute position of buffer row 0 (> 0 once a windowed cache dropped tokens)
        self.keys = torch.zeros(num_kv_heads, capacity, head_dim, device=self.device, dtype=dtype)    # [Hkv, cap, hd]
        self.values = torch.zeros(num_kv_heads, capacity, head_dim, device=self.device, dtype=dtype)  # [Hkv, cap, hd]

    @property
    def trimmable(self) -> bool:
        return self.window is None

    @property
    def stored(self) -> int:
        """Tokens held in the buffer (the last `stored` of the `offset` seen)."""
        return self.offset - self.start

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[1])

    def reserve(self, needed: int) -> None:
        """Room for `needed` stored tokens without moving later (the static decode path writes in place)."""
        self._reserve(needed)

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity, GROWTH_STEP)
        new_cap = -(-new_cap // GROWTH_STEP) * GROWTH_STEP
        if self.max_tokens is not None:
            # doubling past the context would hold VRAM no plan counted (a resent 30K conversation grew to 60K)
            new_cap = max(needed, min(new_cap, self.max_tokens))
        for name in ("keys", "values"):
            old = getattr(self, name)
            # zeros, not empty: the static decode path attends over a masked tail of the buffer, and a NaN
            # left there by the allocator would survive the mask (0 x NaN = NaN)
            grown = torch.zeros(self.num_kv_heads, new_cap, self.head_dim, device=self.device, dtype=self.dtype)
            grown[:, :self.stored] = old[:, :self.stored]
            setattr(self, name, grown)

    def _drop_outside_window(self) -> None:
        """Keep only the W-1 tokens a next query can still see, once at least W are droppable."""
        keep = self.window - 1
        droppable = self.stored - keep
        if droppable < self.window:
            return
        for buf in (self.keys, self.values):
            buf[:, :keep] = buf[:, droppable:self.stored].clone()
        self.start += droppable

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [Hkv, T, hd]; return the cached keys and values [Hkv, S, hd] (views) ending with the
        new ones: all of them, or with a window at least the W-1 before the first new token."""
        if self.window is not None:
            self._drop_outside_window()
        t = int(k.shape[1])
        at = self.stored
        self._reserve(at + t)
        self.keys[:, at:at + t] = k
        self.values[:, at:at + t] = v
        self.offset += t
        return self.keys[:, :self.stored], self.values[:, :self.stored]

    def trim(self, n: int) -> int:
        if not self.trimmable:
            return 0
        n = max(0, min(n, self.offset))
        self.offset -= n
        return n

    def load(self, other: "KVCache", length: int | None = None, *, wait: bool = True) -> None:
        """Take the first `length` tokens (default all) of another KV cache (a prefix-cache hit); `wait`: False
        leaves copies from host memory in flight (the caller waits once: `SequenceCache.load`)."""
        n = other.offset if length is None else length
        if not 0 <= n <= other.offset:
            raise ValueError(f"cannot take {n} tokens from a KV cache holding {other.offset}")
        if not other.trimmable and n != other.offset:
            raise ValueError(f"a sliding-window KV cache of {other.offset} tokens cannot be cut to {n}")
        keep = n - other.start
        self.start, self.offset = other.start, other.start
        self._reserve(keep)
        # head by head: each piece is contiguous on both sides, so a host copy goes to the GPU in one DMA (a cut
        # [Hkv, keep, hd] view of host memory would first be gathered into ordinary memory)
        for h in range(self.num_kv_heads):
            self.keys[h, :keep].copy_(other.keys[h, :keep], non_blocking=not wait)
            self.values[h, :keep].copy_(other.values[h, :keep], non_blocking=not wait)
        self.offset = n

    def copy(self) -> "KVCache":
        """A compact independent copy holding exactly what is stored."""
        return self.to(self.device)

    def to(self, device: torch.device | str, *, arena: HostArena | None = None, wait: bool = True) -> "KVCache":
        """A compact copy on `device` (the prefix cache may keep GPU caches in host RAM, from `arena`); `wait`:
        False leaves a copy to host memory in flight (the caller waits for the GPU once: `SequenceCache.to`)."""
        out = KVCache(self.num_kv_heads, self.head_dim, device=device, dtype=self.dtype, capacity=0,
                      window=self.window)
        out.keys = _moved(self.keys[:, :self.stored], out.device, arena, wait=wait)
        out.values = _moved(self.values[:, :self.stored], out.device, arena, wait=wait)
        out.offset, out.start = self.offset, self.start
        return out

    @property
    def nbytes(self) -> int:
        return (self.keys.numel() + self.values.numel()) * self.keys.element_size()

    @property
    def stored_nbytes(self) -> int:
        """Bytes of what is stored: a compact copy's size (nbytes also counts the buffers' spare room)."""
        return 2 * self._tensor_nbytes(self.stored)

    def stored_tensors_at(self, tokens: int) -> list[int]:
        """The bytes of each tensor a compact copy will hold once `tokens` have been seen (K, then V; a windowed
        layer keeps at most ~2W)."""
        return [self._tensor_nbytes(tokens if self.window is None else min(tokens, 2 * self.window))] * 2

    def _tensor_nbytes(self, tokens: int) -> int:
        """One compact K or V tensor of `tokens` tokens: [Hkv, tokens, hd]."""
        return self.num_kv_heads * tokens * self.head_dim * self.keys.element_size()


def _moved(t: torch.Tensor, device: torch.device, arena: HostArena | None = None, *,
           wait: bool = True) -> torch.Tensor:
    """A copy on `device`. GPU -> host copies land in page-locked memory: the prefix cache keeps a GPU engine's
    caches in host RAM, and bringing a 20K-token conversation back (~2 GB) then runs at the pinned rate
    (~50 GB/s on the H200's link) instead of the pageable one (~8 GB/s), which is most of a warm agent turn.
    `wait=False`: such a copy is only enqueued on the current stream (its host memory is not to be read before
    the caller waits for that stream; the GPU's later kernels on it cannot overwrite the source first)."""
    if device.type == "cpu" and (t.is_cuda or arena is not None):
        out = host_buffer(t.shape, t.dtype, arena, pinned=t.is_cuda)
        out.copy_(t, non_blocking=t.is_cuda and not wait)
        return out
    return t.to(device, copy=True)


def _wait_for_gpu(tensors: list[torch.Tensor]) -> None:
    """Wait once for the current stream of every GPU the tensors live on (the copies enqueued there are done)."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


_pin_refused = False


def host_buffer(shape, dtype: torch.dtype, arena: HostArena | None = None, *, pinned: bool = True) -> torch.Tensor:
    """Host memory for a GPU cache's copy: from `arena` when it has room, else page-locked by torch's allocator, or -
    where the OS's page-locked memory is used up (Windows locks about half the RAM, and the planner may have given
    all of it to the experts) - ordinary memory, slower to bring back but no failed request; said once."""
    global _pin_refused
    out = arena.empty(shape, dtype) if arena is not None else None
    if out is not None:
        return out
    if pinned and not _pin_refused:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:
            _pin_refused = True
            log.warning("could not page-lock host memory for the prefix cache (%s): it keeps conversations in "
                        "ordinary memory from now on (a resent conversation comes back to the GPU slower)", exc)
    return torch.empty(shape, dtype=dtype)


class StateCache:
    """The recurrent-state slot of one linear-attention layer for one sequence.

    The layer owns the meaning of `states` (e.g. "conv" and "recurrent" tensors); an empty dict means
    the sequence has not started. Recurrent state cannot be rewound, so `trim` drops nothing.
    """
    trimmable = False

    def __init__(self, states: dict[str, torch.Tensor] | None = None, offset: int = 0, *,
                 device: torch.device | str | None = None):
        self.states: dict[str, torch.Tensor] = dict(states or {})
        self.offset = offset
        self.device = torch.device(device) if device is not None else None   # where load() puts a stored state

    def advance(self, n: int) -> None:
        self.offset += n

    def trim(self, n: int) -> int:
        return 0

    def copy(self) -> "StateCache":
        return StateCache({k: v.clone() for k, v in self.states.items()}, self.offset, device=self.device)

    def to(self, device: torch.device | str, *, arena: HostArena | None = None, wait: bool = True) -> "StateCache":
        return StateCache({k: _moved(v, torch.device(device), arena, wait=wait) for k, v in self.states.items()},
                          self.offset, device=device)

    def load(self, other: "StateCache", length: int | None = None, *, wait: bool = True) -> None:
        """Take another state's tensors (a prefix-cache hit); a recurrent state restores only whole."""
        if length is not None and length != other.offset:
            raise ValueError(f"a recurrent state of {other.offset} tokens cannot be cut to {length}")
        self.states = {k: v.clone() if self.device is None else v.to(self.device, copy=True, non_blocking=not wait)
                       for k, v in other.states.items()}
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

    def limit_growth(self, tokens: int) -> None:
        """KV buffers grow by doubling, but never past `tokens` (the engine's context) unless asked for more."""
        for layer in self.layers:
            if isinstance(layer, KVCache):
                layer.max_tokens = tokens

    @property
    def stored_nbytes(self) -> int:
        """What a compact copy of this cache (the prefix cache's) takes."""
        return sum(getattr(layer, "stored_nbytes", layer.nbytes) for layer in self.layers)

    def stored_tensors_at(self, tokens: int) -> list[int]:
        """The bytes of each tensor a compact copy will hold once the cache holds `tokens` (recurrent state: its
        fixed-size tensors) - what the prefix cache's arena locks ahead for it."""
        sizes: list[int] = []
        for layer in self.layers:
            if isinstance(layer, KVCache):
                sizes += layer.stored_tensors_at(tokens)
            else:
                sizes += [v.numel() * v.element_size() for v in layer.states.values()]
        return sizes

    def to(self, device: torch.device | str, *, arena: HostArena | None = None) -> "SequenceCache":
        """A copy on `device` of a detached cache (plain KV and state layers); host copies from `arena` if given.

        A GPU cache's copy to host memory waits for the GPU once, after every tensor's copy is enqueued: a wait per
        tensor held the host 84 times in qwen3.6's step that stored a 30K conversation (13.5 ms of 67.7, s37c)."""
        moved = SequenceCache([layer.to(device, arena=arena, wait=False) for layer in self.layers])
        if torch.device(device).type == "cpu":
            _wait_for_gpu(self._tensors())
        return moved

    def load(self, other: "SequenceCache", length: int | None = None) -> None:
        """Fill this (fresh) cache from a stored one, keeping its first `length` tokens (default all).

        Copies from host memory to the GPU are all enqueued, then waited for once (a wait per copy: 384 for a
        resent qwen3-30b conversation, each piece of K and V head by head); the stored entry's host memory is not
        free for reuse before they land, so the wait stays - inside this call."""
        if len(other.layers) != len(self.layers):
            raise ValueError(f"stored cache has {len(other.layers)} layers, this model {len(self.layers)}")
        for mine, theirs in zip(self.layers, other.layers):
            mine.load(theirs, length, wait=False)
        if any(not t.is_cuda for t in other._tensors()):
            _wait_for_gpu(self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor of a detached cache's layers (KV buffers, recurrent states)."""
        out: list[torch.Tensor] = []
        for layer in self.layers:
            out += [layer.keys, layer.values] if isinstance(layer, KVCache) else list(layer.states.values())
        return out

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
