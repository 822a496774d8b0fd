"""Which experts live in the VRAM slot pool: small policy objects with no torch in them (style item 4).

- `LRUPolicy`: evict the least recently used expert.
- `FrequencyPolicy`: evict the lowest exponentially-decayed use count (recent popularity, not all-time).
- `RoutingStats`: per-model counts of how often each (layer, expert) was routed to, persisted as JSON so the
  next run starts with the hot set already in the pool (`hot_set(n)`).
- `SlotDirectory`: the (layer, expert) -> slot map behind a policy, with a pinned hot set that is never
  evicted and hit/miss counters. It decides; slot_cache.py moves bytes and mirrors the map on the GPU.
- `SplitController`: what share of a layer's misses to fetch over PCIe instead of computing on the CPU,
  from observed rates, re-calibrated online, and never worse than either pure strategy.
- `ShareController`: zero-copy decode's CPU share of misses, learned from step times; `ShareMemory` keeps
  what it learned beside the routing statistics, per model, VRAM budget, slot count and machine.

Keys are (layer, expert) tuples.
"""
from __future__ import annotations

import heapq
import json
import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Container, Iterable, Protocol

import numpy as np

Key = tuple[int, int]
log = logging.getLogger(__name__)


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

    def weighted_hot_set(self, n: int, *, layers: Iterable[int], num_experts: int,
                         weight: dict[int, float]) -> list[Key]:
        """The n keys most worth a pinned slot when a miss costs more in some layers than in others (`weight`: a
        layer's miss cost against the others' 1): each key's share of its layer's routing in these statistics
        (one use added to every expert, so a layer never seen is uniform) times its layer's weight, highest first;
        ties go to the lower layer, then the lower expert - so under uniform routing the costliest layers' experts
        fill the set a whole layer at a time (a layer all in VRAM never asks the CPU anything)."""
        self._fold()
        keys, values = [], []
        for layer in layers:
            row = np.ones(num_experts)
            seen = self._rows.get(layer)
            if seen is not None:
                m = min(len(seen), num_experts)
                row[:m] += seen[:m]
            keys.append(np.stack([np.full(num_experts, layer), np.arange(num_experts)], axis=1))
            values.append(row / row.sum() * weight.get(layer, 1.0))
        if not keys:
            return []
        keys_, values_ = np.concatenate(keys), np.concatenate(values)
        order = np.lexsort((keys_[:, 1], keys_[:, 0], -values_))[:max(0, n)]
        return [(int(keys_[i, 0]), int(keys_[i, 1])) for i in order]

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


SHARE_SCAN = (0.0, 0.3, 0.5, 0.8, 1.0)   # shares a fresh controller measures before it climbs from the best
TRIALS_KEPT = 256                          # ShareController.trials: the verdicts a controller keeps
SHARE_GRID = tuple(round(0.1 * i, 1) for i in range(11))     # the CPU shares a ShareController chooses among
SPLIT_SHARE_GRID = tuple(round(0.05 * i, 2) for i in range(21))   # ...with the finer split (cpu_share.py): the step
# time then moves with the share between whole experts, and a 0.1 step is ~0.55 of an expert at 8 GiB


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


class ShareController:
    """The CPU's share of zero-copy decode misses, learned from decode step times (hybrid.py, cpu_share.py).

    Zero-copy decode records the whole step in one graph, so the only signal is the step itself: the host times
    each step (begin to begin) and this controller climbs over a grid of shares. It holds a share and keeps the
    median of its last `window` steps; an exploration cycle puts a neighbour on trial for a window, and moves when
    the trial's median is lower by more than the margin (`margin`, or more when the step times are noisy: a
    noisy pair of medians must not make it wander). A neighbour within the margin either way is a plateau: the
    next share in that direction is tried too, so a gentle slope (the H200: ~2 % per grid step) is still climbed.
    Cycles also probe both pure modes (0: the GPU reads every miss; 1: the CPU computes every miss) -- first
    soon after start, then every `probe_every` cycles -- and jump to one that is faster: a curve with a local
    minimum cannot hold the controller at a share slower than either pure mode. A trial much slower than the
    held share (`abort`) ends after `abort_after` steps. After a cycle that found nothing the wait to the next
    doubles, up to `explore_max` windows, so a settled controller explores rarely but never stops.

    Steps much longer than the held share's median (a pause between requests, a new CUDA graph) are not
    samples of the held share; on trial they are kept (the median shrugs off one), because a trial share that
    is itself that slow must end rather than wait forever for a "normal" sample. The first `cold_steps` (a
    window) after construction are not samples either: right after a load, steps run cold, and a cold first
    window at the start share would make any share on trial look faster than it is.

    `rescan_after` (steps; None: never): once, that many steps after construction, forget every median but the
    held share's and measure the scan's shares and both neighbours again. The CPU side runs slow for its first
    ~100 decode steps after a load (measured on the H200: share 0.5 at 29 ms a step in a tier's first 80 steps,
    15.7 ms later; docs/hybrid.md, "Sixth session"), so a first scan taken then can hold share 0 for good; a
    remembered median may be as stale.

    `to_state` / `from_state`: what ShareMemory persists (the held share and the medians it trusts), so the
    next load of the same model on the same machine starts at the share it ended at."""

    def __init__(self, *, start: float = 0.0, grid: tuple[float, ...] = SHARE_GRID, window: int = 12,
                 explore_every: int = 16, explore_max: int = 128, probe_every: int = 4, margin: float = 0.03,
                 outlier: float = 3.0, abort: float = 0.25, abort_after: int = 4, cold_steps: int | None = None,
                 remembered: dict[float, float] | None = None, scan: tuple[float, ...] = SHARE_SCAN,
                 rescan_after: int | None = None):
        if not grid or window < 1 or not 1 <= abort_after <= window:
            raise ValueError(f"ShareController needs a grid, window >= 1 and 1 <= abort_after <= window "
                             f"(got {len(grid)} shares, window {window}, abort_after {abort_after})")
        self.grid = tuple(sorted(grid))
        self.index = self._nearest(start)
        # measured once when the first look moves nowhere: the pure modes and a few shares between (the curve
        # need not be convex: on the H200 one expert handed to the CPU cost more than none while two paid off,
        # so 0.1-0.2 were slower than both 0 and 0.3 and a climb from 0 stopped at 0)
        last = len(self.grid) - 1
        self._scan = sorted({0, last} | {self._nearest(v) for v in scan})
        self.window, self.explore_every, self.explore_max = window, explore_every, explore_max
        self.probe_every, self.margin, self.outlier = probe_every, margin, outlier
        self.abort, self.abort_after = abort, abort_after
        self.samples: dict[int, list[float]] = {}   # grid index -> its last `window` step times (this run)
        self.medians: dict[int, float] = {}         # grid index -> the median it trusts (measured or remembered)
        self.measured: set[int] = set()             # grid indices measured in this run
        self.steps = self.moves = 0
        # the first steps after a load run cold (allocator, caches, the worker's first requests): not samples
        self._cold = window if cold_steps is None else cold_steps
        self._trial: int | None = None              # grid index on trial
        self._count = 0                             # samples since the last decision (held or on trial)
        self._queue: list[int] = []                 # neighbours to try next (the climb)
        self._probes: list[int] = []                # pure modes to try once the climb is done
        self._rejected: set[int] = set()            # tried since the last move and not faster
        self._cycles = 0
        self._slower_windows = 0                    # windows in a row the held share ran slower than a neighbour had
        # the last TRIALS_KEPT trials' verdicts, in order (bench model prints them: why a learned share holds
        # where it holds; bounded: a server's controller explores for as long as it decodes)
        self.trials: deque[dict] = deque(maxlen=TRIALS_KEPT)
        self._scanned = bool(remembered)            # the scan's shares measured once (see _next_trial); a
                                                    # remembered controller had its scan in an earlier run
        self._up = True
        self._rescan_at = rescan_after                # the step of the one rescan (None: done or never)
        for share, seconds in (remembered or {}).items():
            i = self._nearest(share)
            if abs(self.grid[i] - share) < 1e-6:
                self.medians[i] = float(seconds)
        # a fresh controller explores after its first window; a remembered one holds a while first (rarely)
        self._wait = explore_every if self.medians else 0
        self._interval = 2 * explore_every if self.medians else explore_every

    # ------------------------------------------------------------------------------------------ reading
    @property
    def share(self) -> float:
        """The share for the next step (the trial's while one runs)."""
        return self.grid[self.index if self._trial is None else self._trial]

    @property
    def held_share(self) -> float:
        """The best share found (what is persisted): the one held between trials."""
        return self.grid[self.index]

    @property
    def rescan_pending(self) -> bool:
        """The one rescan (`rescan_after`) is still to come."""
        return self._rescan_at is not None

    @property
    def settled(self) -> bool:
        """Nothing left to try in this cycle, both neighbours of the held share were tried since the last move
        and were not faster, and both pure modes have a median: what a benchmark waits for before it times the
        converged controller."""
        last = len(self.grid) - 1
        neighbours = {i for i in (self.index - 1, self.index + 1) if 0 <= i <= last}
        return (self._trial is None and not self._queue and not self._probes and neighbours <= self._rejected
                and all(i in self.medians for i in ((0, last) if self.moves or not self._scanned else self._scan)
                        if i != self.index))

    # ------------------------------------------------------------------------------------------ learning
    def observe(self, step_seconds: float) -> float:
        """One decode step's wall time at the current share; returns the share for the next step."""
        step_seconds = float(step_seconds)
        if not (math.isfinite(step_seconds) and step_seconds > 0):
            return self.share                                    # a clock that went wrong is no sample
        self.steps += 1
        if self._cold > 0:
            self._cold -= 1
            return self.share
        ref = self._fresh(self.index)
        if self._trial is None and ref is not None and step_seconds > self.outlier * ref:
            return self.share                                    # not a decode step's time
        on = self.index if self._trial is None else self._trial
        bucket = self.samples.setdefault(on, [])
        bucket.append(step_seconds)
        del bucket[:-self.window]
        self._count += 1
        if self._trial is not None:
            aborted = self.abort_after <= self._count < self.window and _median(bucket) > (1 + self.abort) * ref
            if aborted or self._count >= self.window:
                self._end_trial(aborted)
            return self.share
        if self._count < self.window:
            return self.share
        self._count = 0                                          # a decision once per window
        self.medians[self.index] = _median(bucket)
        self.measured.add(self.index)
        # the held share now runs clearly slower than a neighbour did when it was tried, two windows running (the
        # host changed, or the move here was judged in a disturbed window: run s15e held 0.7 at 16.2 ms a step beside
        # 0.6's 13.1): look again now rather than after up to `explore_max` windows
        self._slower_windows = self._slower_windows + 1 if self._wait > 0 and self._neighbour_was_faster() else 0
        if self._slower_windows >= 2:
            self._wait, self._interval, self._slower_windows = 0, self.explore_every, 0
        if self._rescan_at is not None and self.steps >= self._rescan_at:
            self._rescan()
        elif self._queue or self._probes:
            self._next_trial()
        elif self._wait > 0:
            self._wait -= 1
        else:
            self._start_cycle()
        return self.share

    def _neighbour_was_faster(self) -> bool:
        """A neighbour's median (measured or remembered) beats the held share's fresh one by twice the margin (a
        stored median against a fresh one: the noise of both, and no trial of its own behind the verdict yet)."""
        held = self.medians[self.index]
        return any(self.medians[i] < (1.0 - 2.0 * self.noise_margin()) * held
                   for i in (self.index - 1, self.index + 1) if i in self.medians)

    def noise_margin(self) -> float:
        """The relative gap two window medians must show to count: `margin`, or 2.5 standard errors of their
        difference estimated from the held share's spread (interquartile range), whichever is larger."""
        s = sorted(self.samples.get(self.index, ()))
        n = len(s)
        if n < 4:
            return self.margin
        sigma = (s[(3 * n) // 4] - s[n // 4]) / 1.349 / max(s[n // 2], 1e-12)
        return max(self.margin, min(0.5, 2.5 * 1.2533 * sigma * math.sqrt(2.0 / n)))

    def _fresh(self, i: int) -> float | None:
        s = self.samples.get(i)
        return _median(s) if s and len(s) >= self.window else None

    def _nearest(self, share: float) -> int:
        return min(range(len(self.grid)), key=lambda i: abs(self.grid[i] - share))

    def _start_cycle(self) -> None:
        self._cycles += 1
        last = len(self.grid) - 1
        sides = [i for i in ((self.index + 1, self.index - 1) if self._up else (self.index - 1, self.index + 1))
                 if 0 <= i <= last]
        if all(i in self.medians for i in sides):            # the side remembered faster first
            sides.sort(key=self.medians.__getitem__)
        self._up = not self._up
        probes = [i for i in (0, last) if i != self.index and i not in sides]
        if any(i not in self.medians for i in (0, last)):
            self._queue = probes + sides        # the first look: the pure modes first (a jump saves a long climb)
        else:
            self._queue = sides
            self._probes = probes if self._cycles % self.probe_every == 0 else []
        self._next_trial()

    def _rescan(self) -> None:
        """Measure again what was measured cold: the scan's shares and both neighbours, the held share's fresh
        median the reference (`rescan_after`)."""
        self._rescan_at = None
        held = self.index
        for i in [i for i in self.medians if i != held]:
            del self.medians[i]
            self.samples.pop(i, None)
        self._rejected = set()
        sides = [i for i in (held + 1, held - 1) if 0 <= i < len(self.grid)]
        self._queue = sides
        self._probes = [i for i in self._scan if i != held and i not in sides]
        self._interval = self.explore_every
        self._next_trial()

    def _next_trial(self) -> None:
        if not (self._queue or self._probes) and not self._scanned and self.moves == 0:
            # the first look moved nowhere: measure the scan's shares between once, since a curve that rises
            # next to the held share may still fall further on (a local minimum, as measured on the H200)
            self._scanned = True
            self._probes = [i for i in self._scan if i not in self.medians and i != self.index]
        while self._queue or self._probes:
            i = (self._queue or self._probes).pop(0)
            if i != self.index:
                self._trial, self._count = i, 0
                self.samples.pop(i, None)                         # measured afresh
                return
        # the cycle is over: wait longer before the next one unless it moved
        self._wait, self._interval = self._interval, min(2 * self._interval, self.explore_max)

    def _end_trial(self, aborted: bool) -> None:
        trial, held = self._trial, self.index
        self._trial, self._count = None, 0
        med, ref = _median(self.samples[trial]), self._fresh(held)
        self.medians[trial] = med
        self.measured.add(trial)
        margin = self.noise_margin()
        verdict = ("aborted" if aborted else "moved" if med < (1.0 - margin) * ref
                   else "plateau" if abs(trial - held) == 1 and med < (1.0 + margin) * ref else "slower")
        self.trials.append({"step": self.steps, "trial": self.grid[trial], "held": self.grid[held],
                            "trial_s": med, "held_s": ref, "margin": margin, "verdict": verdict})
        if verdict == "moved":
            # faster: hold it, and carry on in that direction (and check the near side of a jump)
            step = 1 if trial > held else -1
            self.index, self._up = trial, step > 0
            self.moves += 1
            self._rejected = {held}
            self._queue = [i for i in (trial + step, trial - step) if 0 <= i < len(self.grid) and i != held]
            self._interval = self.explore_every
        else:
            self._rejected.add(trial)
            if verdict == "plateau":
                # a plateau says little about the slope: look one share further that way
                further = 2 * trial - held
                if 0 <= further < len(self.grid) and further not in self._queue:
                    self._queue.insert(0, further)
        self._next_trial()

    # ------------------------------------------------------------------------------------------ persisting
    def to_state(self) -> dict:
        """The held share and the medians it trusts (seconds per step, keyed by share)."""
        return {"share": self.held_share, "grid": list(self.grid),
                "medians": {f"{self.grid[i]:g}": t for i, t in sorted(self.medians.items())}}

    @classmethod
    def from_state(cls, state: dict, **options) -> "ShareController":
        """A controller that starts at a persisted share and remembers its medians. Raises ValueError on a state
        that is not one (ShareMemory reports it and starts afresh)."""
        share = state.get("share") if isinstance(state, dict) else None
        medians = state.get("medians") if isinstance(state, dict) else None
        if not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(f"share {share!r} is not a number in [0, 1]")
        if not isinstance(medians, dict):
            raise ValueError("medians is not a mapping")
        remembered = {}
        for key, seconds in medians.items():
            s = float(key)
            if not (0.0 <= s <= 1.0 and isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"median {key!r}: {seconds!r} is not a step time")
            remembered[s] = float(seconds)
        return cls(start=float(share), remembered=remembered, **options)


SHARE_STATE_VERSION = 1
SHARE_STATE_KEEP = 8        # entries kept per file (budgets and slot counts a user switches between)


def share_state_path(routing_stats_path: Path) -> Path:
    """Where the learned CPU share is remembered: beside the routing statistics (`x.json` -> `x.cpu_share.json`)."""
    return routing_stats_path.with_name(routing_stats_path.stem + ".cpu_share.json")


def cpu_model_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo; elsewhere what the platform module says)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown CPU"


def model_fingerprint(model_type: str, config: dict, experts: dict) -> str:
    """A short id of a model's computation: its type, config and expert layout (not where its folder is)."""
    import hashlib
    blob = json.dumps({"model_type": model_type, "config": config, "experts": experts}, sort_keys=True, default=str)
    return f"{model_type}:{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


class ShareMemory:
    """The learned CPU share of one model on one machine at one VRAM budget and slot count, kept in a small JSON
    file beside the model's routing statistics, so the next load starts where the last one ended.

    The file holds up to SHARE_STATE_KEEP entries, each under its key (model, VRAM budget, slots, CPU model, GPU
    name): another budget, slot count, machine or model never reuses an entry. Writes are atomic (a temporary
    file, then a rename); a damaged or foreign file is ignored with a log line and replaced at the next save."""

    def __init__(self, path: Path, *, model: str, vram_budget: int | None, machine: str, slots: int = 0):
        self.path = Path(path)
        self.key = {"model": model, "vram_budget": vram_budget, "slots": int(slots), "machine": machine}
        self._saved_share: float | None = None

    def for_slots(self, slots: int) -> "ShareMemory":
        """The same memory for the slot count the tier was really built with (an OOM retry shrinks it)."""
        return ShareMemory(self.path, slots=slots, **{k: self.key[k] for k in ("model", "vram_budget", "machine")})

    def _entries(self) -> list[dict]:
        """The file's entries; [] (logged) when it is missing, damaged or not one of ours."""
        if not self.path.exists():
            return []
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("version") != SHARE_STATE_VERSION:
                raise ValueError(f"not a version-{SHARE_STATE_VERSION} CPU-share file")
            entries = data["entries"]
            if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("key"), dict)
                                                        for e in entries):
                raise ValueError("entries are not keyed records")
            return entries
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            log.warning("learned CPU share %s ignored (%s): learning it afresh", self.path, exc)
            return []

    def controller(self, *, start: float = 0.0, **options) -> ShareController:
        """A controller that starts at the remembered share for this key, or a fresh one starting at `start`."""
        for entry in self._entries():
            if entry["key"] == self.key:
                try:
                    ctl = ShareController.from_state(entry.get("state"), **options)
                except (ValueError, TypeError) as exc:
                    log.warning("learned CPU share in %s ignored (%s): learning it afresh", self.path, exc)
                    break
                self._saved_share = ctl.held_share
                log.info("CPU share %.2f remembered from %s", ctl.held_share, self.path)
                return ctl
        else:
            if self.path.exists():
                log.info("no CPU share learned for this model, VRAM budget, slot count and machine in %s: "
                         "learning it from %.2f", self.path, start)
        return ShareController(start=start, **options)

    def save(self, controller: ShareController) -> None:
        """Write the controller's state under this key (other keys kept). Nothing when it measured nothing."""
        if not controller.measured:
            return
        entries = [e for e in self._entries() if e["key"] != self.key]
        entries = ([{"key": self.key, "state": controller.to_state(), "saved": round(time.time())}]
                   + entries)[:SHARE_STATE_KEEP]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"version": SHARE_STATE_VERSION, "entries": entries}, indent=1),
                           encoding="utf-8")
            os.replace(tmp, self.path)
        finally:
            if tmp.exists():
                tmp.unlink()
        self._saved_share = controller.held_share

    def try_save(self, controller: ShareController) -> bool:
        """`save`, logging instead of raising when the disk refuses (decoding and unloading must go on)."""
        try:
            self.save(controller)
            return True
        except OSError as exc:
            log.warning("could not save the learned CPU share to %s (%s)", self.path, exc)
            self._saved_share = controller.held_share          # not again at every step
            return False

    def save_if_moved(self, controller: ShareController) -> None:
        """Save when the held share differs from the one last saved or loaded (cheap to call every step)."""
        if controller.held_share != self._saved_share and controller.measured:
            self.try_save(controller)
