"""A finished conversation's KV buffers handed to the next one, so that its decode steps replay a recorded graph.

Why: a decode graph is keyed by the addresses of every KV buffer it reads (runtime/decode_graph.py), and torch's
allocator gives a new conversation other addresses than the last one had: measured on qwen3.6's 40 layers at 8 GiB
(s37d, docs/benchmarks.md), every new short conversation recorded a graph of its own at its second token - 0.150 s
where a replayed step takes 0.013 s. Given the last conversation's buffers (zeroed), the next one's key repeats.

What it keeps, and when: only buffers nobody else holds (the engine gives a cache back when the prefix cache took a
copy of it, not the cache itself), and only across idle time - the engine clears the pool at any step with
sequences running, whose growth may need that memory, as torch's allocator would have had it before. A set goes
only to a sequence it fits without waste (room for its prompt, at most twice that or one graph bucket: what its own
growth would have reached), so a short chat never sits on a long conversation's buffers while another one grows;
never more token rows in all than one sequence at the context holds (the KV the memory plan counted).
Sliding-window caches (gpt-oss) move their rows around and stay out.
"""
from __future__ import annotations

from runtime.decode_graph import BUCKET
from runtime.kv_cache import KVCache, SequenceCache


def _plain_kv_layers(cache: SequenceCache) -> list[tuple[int, KVCache]]:
    """(layer index, cache) of every KV layer without a sliding window."""
    return [(i, layer) for i, layer in enumerate(cache.layers) if isinstance(layer, KVCache) and layer.window is None]


class KVBufferPool:
    """Spare KV buffers of finished sequences, layer by layer, for the next sequence's cache."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens      # token rows of all kept sets together (the context the plan counted)
        self._sets: list[tuple[int, dict[int, KVCache]]] = []   # (capacity, layer index -> emptied cache), oldest first
        self.reused = 0

    @property
    def tokens(self) -> int:
        return sum(capacity for capacity, _ in self._sets)

    def give(self, cache: SequenceCache) -> None:
        """Keep the KV buffers of a finished sequence's cache (which its owner no longer uses)."""
        layers = [(i, layer) for i, layer in _plain_kv_layers(cache) if layer.capacity > 0]
        if not layers:
            return
        capacity = max(layer.capacity for _, layer in layers)
        if capacity > self.max_tokens:
            return
        while self._sets and self.tokens + capacity > self.max_tokens:
            self._sets.pop(0)                        # the oldest goes back to torch's allocator
        self._sets.append((capacity, dict(layers)))

    def take(self, cache: SequenceCache, tokens: int) -> bool:
        """Give a fresh cache a kept set of buffers, zeroed: the most recent one with room for `tokens` and no more
        than twice that (or one decode-graph bucket). Returns whether it did. Zeroed, not as left: the static decode
        path attends over a masked tail, and only zeros are sure to stay harmless there (see KVCache._reserve)."""
        mine = [(i, layer) for i, layer in _plain_kv_layers(cache) if layer.offset == 0]
        fits = [i for i, (capacity, _) in enumerate(self._sets) if tokens <= capacity <= max(2 * tokens, BUCKET)]
        if not fits or not mine:
            return False
        _, kept = self._sets.pop(fits[-1])
        for i, layer in mine:                        # (one engine's pool: every set has its model's layers)
            layer.keys, layer.values = kept[i].keys.zero_(), kept[i].values.zero_()
        self.reused += 1
        return True

    def clear(self) -> None:
        """Drop every kept buffer: torch's allocator has the memory again (a step with sequences running, which may
        grow; an out-of-memory step, before the allocator gives memory back)."""
        self._sets.clear()

    def stats(self) -> dict:
        return {"reused": self.reused, "sets": len(self._sets), "tokens": self.tokens}
