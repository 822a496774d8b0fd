"""Which experts live in the VRAM slot pool: small policy objects with no torch in them (style item 4).

- `LRUPolicy`: evict the least recently used expert.
- `FrequencyPolicy`: evict the lowest exponentially-decayed use count (recent popularity, not all-time).
- `RoutingStats`: per-model counts of how often each (layer, expert) was routed to, persisted as JSON so the
  next run starts with the hot set already in the pool (`hot_set(n)`).
- `SlotDirectory`: the (layer, expert) -> slot map behind a policy, with a pinned hot set that is never
  evicted and hit/miss counters. It decides; slot_cache.py moves bytes and mirrors the map on the GPU.
- `SplitController`: what share of a layer's misses to fetch over PCIe instead of computing on the CPU,
  from observed rates, re-calibrated online, and never worse than either pure strategy.

Keys are (layer, expert) tuples.
"""
from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol

Key = tuple[int, int]


class Policy(Protocol):
    """Eviction order over the keys currently cached."""

    def on_access(self, key: Key) -> None: ...            # a token was routed to `key` (cached or not)
    def on_insert(self, key: Key) -> None: ...
    def on_evict(self, key: Key) -> None: ...
    def victim(self, cached: Iterable[Key], protected: set[Key]) -> Key | None: ...
    def score(self, key: Key) -> float: ...               # higher = more worth caching


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()
        self._clock = 0
        self._seen: dict[Key, int] = {}

    def on_access(self, key: Key) -> None:
        self._clock += 1
        self._seen[key] = self._clock
        if key in self._order:
            self._order.move_to_end(key)

    def on_insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_evict(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, cached: Iterable[Key], protected: set[Key]) -> Key | None:
        for key in self._order:                 # oldest first
            if key not in protected:
                return key
        return None

    def score(self, key: Key) -> float:
        return float(self._seen.get(key, 0))


class FrequencyPolicy:
    """Use counts that halve every `half_life` accesses (kept lazily: a global scale grows instead)."""

    def __init__(self, *, half_life: float = 2048.0):
        if half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self._growth = math.log(2.0) / half_life
        self._t = 0
        self._raw: dict[Key, float] = {}        # count * exp(growth * t_added): no decay pass ever needed
        self._cached: set[Key] = set()

    def _renormalise(self) -> None:
        # keep exp() finite: fold the clock into the stored values every so often
        factor = math.exp(-self._growth * self._t)
        self._raw = {k: v * factor for k, v in self._raw.items() if v * factor > 1e-6}
        self._t = 0

    def on_access(self, key: Key) -> None:
        self._t += 1
        if self._growth * self._t > 50:
            self._renormalise()
        self._raw[key] = self._raw.get(key, 0.0) + math.exp(self._growth * self._t)

    def on_insert(self, key: Key) -> None:
        self._cached.add(key)

    def on_evict(self, key: Key) -> None:
        self._cached.discard(key)

    def score(self, key: Key) -> float:
        return self._raw.get(key, 0.0) * math.exp(-self._growth * self._t)

    def victim(self, cached: Iterable[Key], protected: set[Key]) -> Key | None:
        best, best_score = None, math.inf
        for key in self._cached:
            if key in protected:
                continue
            s = self._raw.get(key, 0.0)
            if s < best_score:
                best, best_score = key, s
        return best


def make_policy(name: str) -> Policy:
    if name == "lru":
        return LRUPolicy()
    if name in ("freq", "frequency"):
        return FrequencyPolicy()
    raise ValueError(f"unknown cache policy {name!r} (expected 'lru' or 'frequency')")


class RoutingStats:
    """How often each (layer, expert) was chosen, summed over runs and saved per model."""

    def __init__(self, counts: dict[Key, int] | None = None):
        self.counts: dict[Key, int] = dict(counts or {})

    def add(self, layer: int, experts: Iterable[int]) -> None:
        for e in experts:
            key = (layer, int(e))
            self.counts[key] = self.counts.get(key, 0) + 1

    def hot_set(self, n: int) -> list[Key]:
        """The n most used keys, most used first (ties: lower layer, lower expert)."""
        return [k for k, _ in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:max(0, n)]]

    def save(self, path: Path) -> None:
        """Atomic write: a crash never leaves a half-written file that would read as good."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        data = {"version": 1, "counts": [[l, e, c] for (l, e), c in sorted(self.counts.items())]}
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "RoutingStats":
        """Missing file: empty stats. A damaged file raises ValueError naming it."""
        if not path.exists():
            return cls()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("version") != 1:
                raise ValueError(f"version {data.get('version')!r}")
            return cls({(int(l), int(e)): int(c) for l, e, c in data["counts"]})
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"routing statistics {path} are damaged ({exc}); delete the file to start afresh") from None


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    insertions: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class SlotDirectory:
    """(layer, expert) -> slot over `capacity` slots, under a policy, with a pinned set never evicted."""

    def __init__(self, capacity: int, policy: Policy, *, pinned: Iterable[Key] = ()):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.slot_of: dict[Key, int] = {}
        self.free: list[int] = list(range(capacity - 1, -1, -1))
        self.pinned: set[Key] = set()
        self.counters = CacheCounters()
        for key in pinned:
            if len(self.pinned) >= capacity:
                break
            self.pinned.add(key)

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def lookup(self, keys: Iterable[Key]) -> tuple[list[Key], list[Key]]:
        """Count and split routed keys into (hits, misses); every key counts as one access."""
        hits, misses = [], []
        for key in keys:
            self.policy.on_access(key)
            (hits if key in self.slot_of else misses).append(key)
        self.counters.hits += len(hits)
        self.counters.misses += len(misses)
        return hits, misses

    def allocate(self, key: Key, *, protected: set[Key] = frozenset()) -> tuple[int, Key | None] | None:
        """A slot for `key`: (slot, evicted key or None), or None when every slot is pinned or protected."""
        if key in self.slot_of:
            return self.slot_of[key], None
        evicted = None
        if self.free:
            slot = self.free.pop()
        else:
            evicted = self.policy.victim(self.slot_of.keys(), self.pinned | set(protected))
            if evicted is None:
                return None
            slot = self.slot_of.pop(evicted)
            self.policy.on_evict(evicted)
            self.counters.evictions += 1
        self.slot_of[key] = slot
        self.policy.on_insert(key)
        self.counters.insertions += 1
        return slot, evicted

    def release(self, key: Key) -> int | None:
        """Forget `key` (a promotion that failed, or a reset); its slot becomes free."""
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.policy.on_evict(key)
            self.free.append(slot)
        return slot


class SplitController:
    """Share of misses to fetch over PCIe (the rest run on the CPU), learned from what each step costs.

    The estimate `f = pcie / (pcie + cpu)` balances the two paths when both run at their measured rates. A
    startup benchmark misleads (caches, turbo, other load), so the rates are re-estimated from every step,
    and the controller also keeps the observed step time of the pure strategies (f = 0, f = 1) and of the
    balanced split, re-trying each now and then: it uses whichever is fastest, so it is never slower than
    either pure strategy for long."""

    MODES = ("balanced", "cpu", "fetch")

    def __init__(self, *, cpu_gbps: float, pcie_gbps: float, alpha: float = 0.2, explore_every: int = 256):
        self.cpu_gbps = max(cpu_gbps, 1e-3)
        self.pcie_gbps = max(pcie_gbps, 0.0)
        self.alpha = alpha
        self.explore_every = explore_every
        self.step_time: dict[str, float | None] = {m: None for m in self.MODES}
        self.mode = "balanced"
        self._steps = 0
        self._explore_queue: list[str] = []

    def balanced_share(self) -> float:
        return self.pcie_gbps / (self.pcie_gbps + self.cpu_gbps) if self.pcie_gbps > 0 else 0.0

    def split(self, n_misses: int) -> int:
        """How many of `n_misses` (equal-sized) experts to fetch this step."""
        if self.mode == "cpu" or self.pcie_gbps <= 0:
            return 0
        if self.mode == "fetch":
            return n_misses
        # the whole number that finishes both paths soonest: never worse than 0 or n_misses at these rates
        return min(range(n_misses + 1), key=lambda k: (max(k / self.pcie_gbps, (n_misses - k) / self.cpu_gbps), k))

    def choose(self) -> str:
        """Pick the mode for the next step: an untried or stale mode first, else the fastest seen."""
        self._steps += 1
        if not self._explore_queue and self._steps % self.explore_every == 1:
            self._explore_queue = [m for m in self.MODES if m != "fetch" or self.pcie_gbps > 0]
        if self._explore_queue:
            self.mode = self._explore_queue.pop(0)
        else:
            seen = {m: t for m, t in self.step_time.items() if t is not None}
            self.mode = min(seen, key=seen.get) if seen else "balanced"
        return self.mode

    def observe(self, *, step_seconds: float, cpu_bytes: int = 0, cpu_seconds: float = 0.0,
                pcie_bytes: int = 0, pcie_seconds: float = 0.0) -> None:
        """Feed one step's measured cost (and each path's bytes and busy time, when it ran)."""
        a = self.alpha
        if cpu_bytes and cpu_seconds > 0:
            self.cpu_gbps = (1 - a) * self.cpu_gbps + a * cpu_bytes / cpu_seconds / 1e9
        if pcie_bytes and pcie_seconds > 0:
            self.pcie_gbps = (1 - a) * self.pcie_gbps + a * pcie_bytes / pcie_seconds / 1e9
        prev = self.step_time[self.mode]
        self.step_time[self.mode] = step_seconds if prev is None else (1 - a) * prev + a * step_seconds
