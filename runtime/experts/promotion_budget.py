"""How many expert blocks a zero-copy decode step may promote into the VRAM pool, learned from what promotions buy.

Why: a promotion copies a 2.4 MB block over the same PCIe link the step's missed experts are read across
(run s13b's trace of the 8 GiB row: 11.5 host-to-device copies a step beside the misses' ~310 MB). A promotion
pays when the expert it brings in is used more often than the one it evicts: with routing locality (real
models) it is, many times over the residence; with none (uniform routing: any set of residents is as good as
another) it is not, and each copy only takes the link from the misses. So the budget follows the swap's yield:
every `window` steps, the uses a step of the experts promoted in the last `window` steps against the uses a step
of the experts they evicted over the same steps (an evicted expert's uses are the misses the promotion cost).
A yield under `gain` halves the budget, down to `floor` (kept above zero, so the yield is still measured and a
change of routing is seen); a higher one doubles it, up to `most` (the configured byte budget's blocks).

GPU-free: the tier (hybrid.py `end_step`) tells it what it promoted and evicted and what each step used.
"""
from __future__ import annotations

from collections import deque

Key = tuple[int, int]          # (layer, expert)


class _Recent:
    """Keys noted in the last `window` steps: how many of a step's used keys are among them, and how many there are."""

    def __init__(self, window: int):
        self.window = window
        self._since: dict[Key, int] = {}
        self._order: deque = deque()

    def add(self, key: Key, step: int) -> None:
        self._since[key] = step
        self._order.append((step, key))

    def expire(self, step: int) -> None:
        while self._order and self._order[0][0] <= step - self.window:
            then, key = self._order.popleft()
            if self._since.get(key) == then:
                del self._since[key]

    def discard(self, key: Key) -> None:
        self._since.pop(key, None)

    def uses(self, used) -> int:
        return sum(1 for key in used if key in self._since) if self._since else 0

    def __len__(self) -> int:
        return len(self._since)


class PromotionBudget:
    def __init__(self, most: int, *, floor: int = 1, window: int = 32, gain: float = 1.25):
        if most < 0 or floor < 0 or window < 1 or gain <= 0:
            raise ValueError(f"bad promotion budget: most={most}, floor={floor}, window={window}, gain={gain}")
        self.most, self.floor, self.gain = most, min(floor, most), gain
        self.window = window
        self.blocks = most                          # this step's budget
        self.yield_ratio: float | None = None       # the last window's: promoted experts' uses / evicted ones'
        self._step = 0
        self._promoted, self._evicted = _Recent(window), _Recent(window)
        self._uses = [0, 0, 0, 0]                   # promoted: uses, expert-steps; evicted: uses, expert-steps

    def promoted(self, keys, evicted) -> None:
        """This step's promotions and the experts they evicted, after `observe` of the same step (they count from
        the next step on)."""
        for key in keys:
            self._promoted.add(key, self._step)
            self._evicted.discard(key)              # back in the pool: no longer a cost
        for key in evicted:
            self._evicted.add(key, self._step)
            self._promoted.discard(key)

    def observe(self, used) -> None:
        """One step: the (layer, expert) keys it used (a list: hits and misses alike), before that step's
        promotions are noted; then the next step's budget."""
        self._step += 1
        for recent in (self._promoted, self._evicted):
            recent.expire(self._step)
        u = self._uses
        u[0] += self._promoted.uses(used)
        u[1] += len(self._promoted)
        u[2] += self._evicted.uses(used)
        u[3] += len(self._evicted)
        if self._step % self.window:
            return
        promoted, evicted = (u[0] / u[1] if u[1] else 0.0), (u[2] / u[3] if u[3] else 0.0)
        if u[1] and u[3] and (promoted or evicted):      # (with free slots nothing is evicted: nothing to weigh)
            self.yield_ratio = promoted / evicted if evicted else float("inf")
            if self.yield_ratio < self.gain:
                self.blocks = max(self.floor, self.blocks // 2)
            else:
                self.blocks = min(self.most, max(1, self.blocks * 2))
        self._uses = [0, 0, 0, 0]
