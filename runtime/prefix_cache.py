"""Prefix cache: reuse the KV cache and recurrent state of earlier requests that share a prompt prefix.

Coding agents resend the whole conversation every turn, so the next prompt usually starts with the
previous prompt and its answer. Entries map the exact token ids a cache holds to that cache
(detached from any sequence). A lookup finds the entry sharing the longest prefix with the new
prompt:
- a trimmable entry (only KV caches) serves any common prefix: its cache is cut to it;
- an entry with recurrent state serves only when its whole key is a prefix of the prompt (a state
  cannot be rewound), so the engine also stores a snapshot at the end of each prompt for those models.
At least one prompt token is always left to compute, since the engine needs its logits.

Byte-bounded LRU: inserting evicts the least recently used entries until the total fits. Exact by
construction: a hit restores bit-identical cache contents.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (vectorised: agents' conversations run to 100K tokens)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n


@dataclass
class PrefixHit:
    cache: Any            # the stored SequenceCache: load() from it, never modify it
    length: int           # tokens of the prompt it covers


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self.entries: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, prompt: list[int]) -> PrefixHit | None:
        """The entry covering the longest prefix of `prompt` (leaving one token to compute), or None."""
        best_key, best_len = None, 0
        limit = len(prompt) - 1
        for key, cache in self.entries.items():
            if cache.trimmable:
                n = min(common_prefix_len(key, prompt), limit)
            else:
                n = len(key) if len(key) <= limit and common_prefix_len(key, prompt) == len(key) else 0
            if n > best_len:
                best_key, best_len = key, n
        if best_key is None:
            self.misses += 1
            return None
        self.entries.move_to_end(best_key)
        self.hits += 1
        self.tokens_reused += best_len
        return PrefixHit(self.entries[best_key], best_len)

    def insert(self, tokens: list[int], cache: Any) -> bool:
        """Keep `cache` (holding exactly `tokens`); False when it alone is larger than the budget."""
        key = tuple(tokens)
        size = cache.nbytes
        if not key or size > self.max_bytes:
            return False
        if key in self.entries:
            self._drop(key)
        if cache.trimmable:
            self.drop_covered(tokens)
        self.make_room(size)
        self.entries[key] = cache
        self.nbytes += size
        return True

    def make_room(self, size: int) -> None:
        """Evict the least recently used entries until `size` more bytes fit. The engine calls it before copying
        a cache here, so that the copy can take the evicted entries' host memory; insert() evicts the same ones."""
        keep = self.kept_after_room(size)                # one rule for doing it and for predicting it
        while self.entries and self.nbytes > keep:
            self._drop(next(iter(self.entries)))
            self.evictions += 1

    def kept_after_room(self, size: int, *, dropping: Any = None) -> int:
        """The bytes entries would still hold once `size` more fit - the entry `dropping` (a cache the new one
        covers) dropped first, then the least recently used: what make_room would leave, without doing it."""
        others = [cache for cache in self.entries.values() if cache is not dropping]   # oldest first
        kept = sum(cache.nbytes for cache in others)
        for cache in others:
            if kept + size <= self.max_bytes:
                break
            kept -= cache.nbytes
        return max(kept, 0)

    def drop_covered(self, tokens: list[int]) -> None:
        """Drop the trimmable entries holding a shorter prefix of `tokens`: a trimmable cache of `tokens` serves
        every prefix of itself. (The engine calls it before copying such a cache, so the copy can take their host
        memory - an agent's resent conversation, a little longer each turn.)"""
        key = tuple(tokens)
        for other in [k for k, c in self.entries.items() if c.trimmable and len(k) < len(key)
                      and key[:len(k)] == k]:
            self._drop(other)

    def _drop(self, key: tuple[int, ...]) -> None:
        cache = self.entries.pop(key)
        self.nbytes -= cache.nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def stats(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "tokens_reused": self.tokens_reused}
