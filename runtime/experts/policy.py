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

import heapq
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Container, Iterable, Protocol

import numpy as np

Key = tuple[int, int]


def _layer_row(rows: dict[int, np.ndarray], layer: int, size: int, dtype) -> np.ndarray:
    """rows[layer], grown (zero-filled, by doubling) to hold at least `size` entries: per-expert counters."""
    row = rows.get(layer)
    if row is None or len(row) < size:
        grown = np.zeros(max(size, 64 if row is None else 2 * len(row)), dtype=dtype)
        if row is not None:
            grown[:len(row)] = row
        row = rows[layer] = grown
    return row

class Policy(Protocol):
    """Eviction order over the keys currently cached (and evictable: a directory never inserts pinned keys).

    Scores only grow between evictions (a use raises a key's score; nothing lowers it), which is what lets
    both policies find a victim with a lazy heap in O(log S) instead of scanning every cached key."""

    def on_access(self, key: Key) -> None: ...            # a token was routed to `key` (cached or not)
    def on_access_many(self, layer: int, experts: np.ndarray) -> None: ...   # sorted distinct, one call
    def on_insert(self, key: Key) -> None: ...
    def on_evict(self, key: Key) -> None: ...
    def victim(self, cached: Iterable[Key], protected: Container[Key]) -> Key | None: ...
    def score(self, key: Key) -> float: ...               # higher = more worth caching
    def scores(self, layer: int, experts: np.ndarray) -> np.ndarray: ...     # vectorised `score`


_RAMP = np.arange(1, 1025, dtype=np.float64)     # 1, 2, ... : a call's clock offsets without an arange


class _LayerTable:
    """A float64 value per (layer, expert), one growable numpy row per layer (0 where never set)."""

    def __init__(self) -> None:
        self.rows: dict[int, np.ndarray] = {}

    def row(self, layer: int, size: int) -> np.ndarray:
        return _layer_row(self.rows, layer, size, np.float64)

    def get(self, key: Key) -> float:
        row = self.rows.get(key[0])
        return float(row[key[1]]) if row is not None and key[1] < len(row) else 0.0

    def get_many(self, layer: int, experts: np.ndarray) -> np.ndarray:
        row = self.rows.get(layer)
        if row is None:
            return np.zeros(len(experts))
        if len(experts) and int(experts.max()) >= len(row):
            row = self.row(layer, int(experts.max()) + 1)
        return row[experts]


class _LazyHeap:
    """Min-heap of (score when pushed, key) over the cached keys. Scores only grow, so an entry whose stored
    score is below the key's current one is re-pushed when it reaches the top, and the first entry that is
    current, cached and not protected is the true minimum."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, Key]] = []
        self.cached: set[Key] = set()

    def push(self, key: Key, score: float) -> None:
        self.cached.add(key)
        heapq.heappush(self.heap, (score, key))

    def discard(self, key: Key) -> None:
        self.cached.discard(key)          # its entries die when they reach the top

    def rebuild(self, score) -> None:
        self.heap = [(score(k), k) for k in self.cached]
        heapq.heapify(self.heap)

    def minimum(self, score, protected: Container[Key]) -> Key | None:
        heap, aside, found = self.heap, [], None
        while heap:
            stored, key = heap[0]
            if key not in self.cached:
                heapq.heappop(heap)
                continue
            now = score(key)
            if now != stored:
                heapq.heapreplace(heap, (now, key))
                continue
            if key in protected:
                aside.append(heapq.heappop(heap))
                continue
            found = key
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        if len(heap) > 2 * len(self.cached) + 64:           # dead entries of evicted keys pile up: compact
            self.rebuild(score)
        return found


class LRUPolicy:
    """Evict the least recently used: a key's score is the clock of its last access."""

    def __init__(self) -> None:
        self._clock = 0
        self._seen = _LayerTable()
        self._heap = _LazyHeap()

    def on_access(self, key: Key) -> None:
        self._clock += 1
        self._seen.row(key[0], key[1] + 1)[key[1]] = self._clock

    def on_access_many(self, layer: int, experts: np.ndarray) -> None:
        """Distinct, sorted experts [U] (np.unique / flatnonzero order): each one access, in that order."""
        n = len(experts)
        if n:
            self._seen.row(layer, int(experts[-1]) + 1)[experts] = _RAMP[:n] + self._clock if n <= len(_RAMP) else \
                np.arange(self._clock + 1, self._clock + n + 1, dtype=np.float64)
            self._clock += n

    def on_insert(self, key: Key) -> None:
        self._heap.push(key, self.score(key))

    def on_evict(self, key: Key) -> None:
        self._heap.discard(key)

    def victim(self, cached: Iterable[Key], protected: Container[Key]) -> Key | None:
        return self._heap.minimum(self.score, protected)

    def score(self, key: Key) -> float:
        return self._seen.get(key)

    def scores(self, layer: int, experts: np.ndarray) -> np.ndarray:
        return self._seen.get_many(layer, experts)


class FrequencyPolicy:
    """Use counts that halve every `half_life` accesses (kept lazily: a global scale grows instead)."""

    def __init__(self, *, half_life: float = 2048.0):
        if half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self._growth = math.log(2.0) / half_life
        self._t = 0
        self._raw = _LayerTable()               # count * exp(growth * t_added): no decay pass ever needed
        self._heap = _LazyHeap()

    def _renormalise(self) -> None:
        # keep exp() finite: fold the clock into the stored values every so often (order is unchanged)
        factor = math.exp(-self._growth * self._t)
        for row in self._raw.rows.values():
            row *= factor
        self._t = 0
        self._heap.rebuild(self._raw.get)

    def on_access(self, key: Key) -> None:
        self._t += 1
        if self._growth * self._t > 50:
            self._renormalise()
        self._raw.row(key[0], key[1] + 1)[key[1]] += math.exp(self._growth * self._t)

    def on_access_many(self, layer: int, experts: np.ndarray) -> None:
        n = len(experts)
        if not n:
            return
        if self._growth * (self._t + n) > 50:
            self._renormalise()
        # the same values as n single accesses at clocks t+1 .. t+n (experts are distinct)
        self._raw.row(layer, int(experts[-1]) + 1)[experts] += np.exp(self._growth * np.arange(self._t + 1, self._t + n + 1))
        self._t += n

    def on_insert(self, key: Key) -> None:
        self._heap.push(key, self._raw.get(key))

    def on_evict(self, key: Key) -> None:
        self._heap.discard(key)

    def score(self, key: Key) -> float:
        return self._raw.get(key) * math.exp(-self._growth * self._t)

    def scores(self, layer: int, experts: np.ndarray) -> np.ndarray:
        return self._raw.get_many(layer, experts) * math.exp(-self._growth * self._t)

    def victim(self, cached: Iterable[Key], protected: Container[Key]) -> Key | None:
        return self._heap.minimum(self._raw.get, protected)


def make_policy(name: str) -> Policy:
    if name == "lru":
        return LRUPolicy()
    if name in ("freq", "frequency"):
        return FrequencyPolicy()
    raise ValueError(f"unknown cache policy {name!r} (expected 'lru' or 'frequency')")


class RoutingStats:
    """How often each (layer, expert) was chosen, summed over runs and saved per model.

    Counted in one growable numpy row per layer; a decode call's distinct experts are only queued
    (`add_distinct`: one list append on the critical path) and folded in with one bincount per layer every
    `FOLD_EVERY` calls or whenever the counts are read. `counts` is the {(layer, expert): count} view of the
    non-zero entries."""

    FOLD_EVERY = 1024

    def __init__(self, counts: dict[Key, int] | None = None):
        self._rows: dict[int, np.ndarray] = {}
        self._queued: list[tuple[int, np.ndarray]] = []
        for (layer, e), c in (counts or {}).items():
            self._row(layer, e + 1)[e] += int(c)

    def _row(self, layer: int, size: int) -> np.ndarray:
        return _layer_row(self._rows, layer, size, np.int64)

    def _fold(self) -> None:
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        by_layer: dict[int, list[np.ndarray]] = {}
        for layer, experts in queued:
            by_layer.setdefault(layer, []).append(experts)
        for layer, parts in by_layer.items():
            ids = np.concatenate(parts)
            row = self._row(layer, int(ids.max()) + 1)
            row += np.bincount(ids, minlength=len(row))

    @property
    def counts(self) -> dict[Key, int]:
        self._fold()
        return {(layer, int(e)): int(row[e]) for layer, row in sorted(self._rows.items()) for e in np.flatnonzero(row)}

    def add(self, layer: int, experts: Iterable[int]) -> None:
        """One use of each listed expert (repeats count again)."""
        ids = np.asarray(list(experts) if not isinstance(experts, np.ndarray) else experts, dtype=np.int64)
        if len(ids):
            np.add.at(self._row(layer, int(ids.max()) + 1), ids, 1)

    def add_distinct(self, layer: int, experts: np.ndarray) -> None:
        """`add` for distinct ids [U] int64 that the caller will not modify afterwards (kept until folded)."""
        if len(experts):
            self._queued.append((layer, experts))
            if len(self._queued) >= self.FOLD_EVERY:
                self._fold()

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

    def record(self, layer: int, experts: np.ndarray, hits: int) -> None:
        """The vectorised `lookup`, for a caller that split hits from misses itself (hybrid.py reads its host
        mirror of the slot table): one access per distinct expert [U] of `layer`, `hits` of them hits."""
        self.policy.on_access_many(layer, experts)
        self.counters.hits += hits
        self.counters.misses += len(experts) - hits

    def lookup(self, keys: Iterable[Key]) -> tuple[list[Key], list[Key]]:
        """Count and split routed keys into (hits, misses); every key counts as one access."""
        hits, misses = [], []
        for key in keys:
            self.policy.on_access(key)
            (hits if key in self.slot_of else misses).append(key)
        self.counters.hits += len(hits)
        self.counters.misses += len(misses)
        return hits, misses

    def allocate(self, key: Key, *, protected: Container[Key] = frozenset()) -> tuple[int, Key | None] | None:
        """A slot for `key`: (slot, evicted key or None), or None when every slot is pinned or protected.
        Pinned keys never enter the policy's eviction order, so `protected` is only what the caller adds (any
        container: hybrid.py passes a view over the current call's experts instead of building a set)."""
        if key in self.slot_of:
            return self.slot_of[key], None
        evicted = None
        if self.free:
            slot = self.free.pop()
        else:
            evicted = self.policy.victim(self.slot_of.keys(), protected)
            if evicted is None:
                return None
            slot = self.slot_of.pop(evicted)
            self.policy.on_evict(evicted)
            self.counters.evictions += 1
        self.slot_of[key] = slot
        if key not in self.pinned:
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


WARM_UP_FACTOR, WARM_UP_SECONDS = 20.0, 0.1   # a first call this much slower than predicted is a warm-up


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
        self._exploring = False
        # a path's first use pays one-off costs (numba's compile or cache load, thread-pool start, cuBLAS
        # init: seconds on the GPU machine's first CPU call): that sample must not judge the path
        self._warmed = {"cpu": False, "pcie": False}

    def balanced_share(self) -> float:
        return self.pcie_gbps / (self.pcie_gbps + self.cpu_gbps) if self.pcie_gbps > 0 else 0.0

    def split(self, n_misses: int) -> int:
        """How many of `n_misses` (equal-sized) experts to fetch this step."""
        if self.mode == "cpu" or self.pcie_gbps <= 0:
            return 0
        if self.mode == "fetch":
            return n_misses
        # the whole number that finishes both paths soonest: never worse than 0 or n_misses at these rates.
        # max(k / pcie, (n - k) / cpu) falls then rises in k, so the best whole k is a neighbour of the real
        # crossing point n * pcie / (pcie + cpu); ties go to the smaller k (fewer copies on the critical path)
        if n_misses <= 0:
            return 0
        cost = lambda k: max(k / self.pcie_gbps, (n_misses - k) / self.cpu_gbps)     # noqa: E731
        lo = min(n_misses, int(n_misses * self.pcie_gbps / (self.pcie_gbps + self.cpu_gbps)))
        return lo if lo == n_misses or cost(lo) <= cost(lo + 1) else lo + 1

    def choose(self) -> str:
        """Pick the mode for the next step: an untried or stale mode first, else the fastest seen."""
        self._steps += 1
        if not self._explore_queue and self._steps % self.explore_every == 1:
            self._explore_queue = [m for m in self.MODES if m != "fetch" or self.pcie_gbps > 0]
        self._exploring = bool(self._explore_queue)
        if self._explore_queue:
            self.mode = self._explore_queue.pop(0)
        else:
            seen = {m: t for m, t in self.step_time.items() if t is not None}
            self.mode = min(seen, key=seen.get) if seen else "balanced"
        return self.mode

    def observe(self, *, step_seconds: float, cpu_bytes: int = 0, cpu_seconds: float = 0.0,
                pcie_bytes: int = 0, pcie_seconds: float = 0.0) -> None:
        """Feed one step's measured cost (and each path's bytes and busy time, when it ran). A path's first
        use may carry one-off costs: when it took far longer than the rates predict (seconds: a compile),
        the sample is dropped and the mode measured again at the next step. A re-try (an exploration step)
        replaces the mode's time instead of blending into it: the re-try exists because the old figure may
        be stale, and blending would let one slow outlier decide for thousands of steps."""
        warm_up = False
        for path, nbytes, busy, gbps in (("cpu", cpu_bytes, cpu_seconds, self.cpu_gbps),
                                         ("pcie", pcie_bytes, pcie_seconds, self.pcie_gbps)):
            if nbytes and not self._warmed[path]:
                self._warmed[path] = True
                expected = nbytes / (max(gbps, 1e-3) * 1e9)
                warm_up |= busy > max(WARM_UP_FACTOR * expected, WARM_UP_SECONDS)
        if warm_up:
            self._explore_queue.insert(0, self.mode)
            return
        a = self.alpha
        if cpu_bytes and cpu_seconds > 0:
            self.cpu_gbps = (1 - a) * self.cpu_gbps + a * cpu_bytes / cpu_seconds / 1e9
        if pcie_bytes and pcie_seconds > 0:
            self.pcie_gbps = (1 - a) * self.pcie_gbps + a * pcie_bytes / pcie_seconds / 1e9
        prev = self.step_time[self.mode]
        fresh = prev is None or self._exploring
        self.step_time[self.mode] = step_seconds if fresh else (1 - a) * prev + a * step_seconds


class ShareController:
    """The CPU's share of zero-copy decode misses, learned from decode step times (hybrid.py, cpu_share.py).

    Zero-copy decode records the whole step in one graph, so the only signal is the step itself: the host times
    each step (begin to begin) and this controller hill-climbs over a grid of shares. It holds the current share
    for `window` steps, then tries a neighbour (one grid step up or down, alternately) for a window, and moves
    when the neighbour's median step time is lower by more than `margin`. Steps much longer than the current
    median (a pause between requests, a new CUDA graph) are not samples. Starting at 0 costs nothing where the
    CPU cannot help (the H200's PCIe 5 link: measured slower with any share); where the link is slow next to RAM
    (a laptop's PCIe 4.0 x8 beside DDR5) it climbs to the share that finishes both sides together."""

    def __init__(self, *, start: float = 0.0, grid: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0),
                 window: int = 12, explore_every: int = 16, margin: float = 0.03, outlier: float = 3.0):
        self.grid = tuple(sorted(grid))
        self.index = min(range(len(self.grid)), key=lambda i: abs(self.grid[i] - start))
        self.window, self.explore_every, self.margin, self.outlier = window, explore_every, margin, outlier
        self.samples: dict[int, list[float]] = {}
        self._trial: int | None = None          # grid index on trial, or None
        self._held = 0                          # windows held since the last trial
        self._count = 0                         # steps since the last decision
        self._explored = False
        self._up = True

    @property
    def share(self) -> float:
        return self.grid[self.index if self._trial is None else self._trial]

    def _median(self, i: int) -> float | None:
        s = self.samples.get(i)
        return sorted(s)[len(s) // 2] if s and len(s) >= self.window else None

    def observe(self, step_seconds: float) -> float:
        """One decode step's wall time at the current share; returns the share for the next step."""
        ref = self._median(self.index)
        if ref is not None and step_seconds > self.outlier * ref:
            return self.share                                   # not a decode step's time
        bucket = self.samples.setdefault(self.index if self._trial is None else self._trial, [])
        bucket.append(step_seconds)
        del bucket[:-self.window]
        self._count += 1
        if self._count < self.window:
            return self.share
        self._count = 0                                         # a decision once per window
        if self._trial is not None:
            if self._median(self._trial) < (1.0 - self.margin) * self._median(self.index):
                # the neighbour is faster: move there, and try the next one in that direction straight away
                self._up = self._trial > self.index
                self.index = self._trial
                self._held = self.explore_every
            self._trial = None
            return self.share
        self._held += 1
        if self._held > self.explore_every or not self._explored:
            step = 1 if self._up else -1
            if not 0 <= self.index + step < len(self.grid):
                step = -step
            self._up = not self._up
            if 0 <= self.index + step < len(self.grid):
                self._trial = self.index + step
                self.samples.pop(self._trial, None)             # measured afresh
            self._held, self._explored = 0, True
        return self.share
