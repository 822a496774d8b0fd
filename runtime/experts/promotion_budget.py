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

GPU-free: the tier (hybrid.py `end_step`) tells it what it promoted and evicted and what each step used; the
books are two [layers, experts] arrays of the step each expert was last promoted or evicted at.
"""
from __future__ import annotations

import numpy as np

_NEVER = np.iinfo(np.int64).min // 2       # "not noted": older than any window


class PromotionBudget:
    def __init__(self, most: int, *, layers: int, experts: int, floor: int = 1, window: int = 32,
                 gain: float = 1.25):
        if most < 0 or floor < 0 or window < 1 or gain <= 0:
            raise ValueError(f"bad promotion budget: most={most}, floor={floor}, window={window}, gain={gain}")
        self.most, self.floor, self.window, self.gain = most, min(floor, most), window, gain
        self.blocks = most                          # this step's budget
        self.yield_ratio: float | None = None       # the last window's: promoted experts' uses / evicted ones'
        self._step = 0
        # the step each (layer index, expert) was last promoted / evicted at: recent while within the window
        self._promoted_at = np.full((layers, experts), _NEVER, dtype=np.int64)
        self._evicted_at = np.full((layers, experts), _NEVER, dtype=np.int64)
        self._uses = np.zeros(4, dtype=np.int64)    # promoted: uses, expert-steps; evicted: uses, expert-steps

    def promoted(self, keys, evicted) -> None:
        """This step's promotions and the experts they evicted, (layer index, expert) pairs, after `observe` of
        the same step (they count from the next step on). A key back in the pool is no longer a cost, and one
        evicted again no longer a promotion."""
        for li, e in keys:
            self._promoted_at[li, e], self._evicted_at[li, e] = self._step, _NEVER
        for li, e in evicted:
            self._evicted_at[li, e], self._promoted_at[li, e] = self._step, _NEVER

    def observe(self, used) -> None:
        """One step: the experts it used, (layer index, expert ids) per layer (hits and misses alike), before
        that step's promotions are noted; then the next step's budget."""
        self._step += 1
        since = self._step - self.window            # recent: noted at a later step than this
        u = self._uses
        for li, experts in used:
            u[0] += np.count_nonzero(self._promoted_at[li, experts] > since)
            u[2] += np.count_nonzero(self._evicted_at[li, experts] > since)
        u[1] += np.count_nonzero(self._promoted_at > since)
        u[3] += np.count_nonzero(self._evicted_at > since)
        if self._step % self.window:
            return
        promoted, evicted = (u[0] / u[1] if u[1] else 0.0), (u[2] / u[3] if u[3] else 0.0)
        if u[1] and u[3] and (promoted or evicted):      # (with free slots nothing is evicted: nothing to weigh)
            self.yield_ratio = promoted / evicted if evicted else float("inf")
            if self.yield_ratio < self.gain:
                self.blocks = max(self.floor, self.blocks // 2)
            else:
                self.blocks = min(self.most, max(1, self.blocks * 2))
        u[:] = 0
