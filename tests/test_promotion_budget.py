"""The zero-copy promotion budget (runtime/experts/promotion_budget.py): it falls while promoted experts are used
no more than the ones they evicted, holds while they are used more, and in the tier follows the routing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.experts.promotion_budget import PromotionBudget


def _steps(budget, steps, *, promoted_rate, evicted_rate, rng, per_step=4):
    """Steps where each step promotes `per_step` new experts of layer 0 (evicting as many of layer 1), and each
    recent promoted / evicted expert is used with the given probability a step."""
    nxt = [0]
    promoted, evicted = [], []
    for _ in range(steps):
        used = [k for k in promoted[-budget.window * per_step:] if rng.random() < promoted_rate]
        used += [k for k in evicted[-budget.window * per_step:] if rng.random() < evicted_rate]
        budget.observe([(li, np.array([e for layer, e in used if layer == li], dtype=np.int64)) for li in (0, 1)])
        new = [(0, nxt[0] + j) for j in range(min(per_step, budget.blocks))]
        gone = [(1, nxt[0] + j) for j in range(len(new))]
        nxt[0] += per_step
        promoted += new
        evicted += gone
        budget.promoted(new, gone)


def test_promotions_that_buy_nothing_shrink_the_budget_to_its_floor_and_come_back_when_they_pay():
    rng = np.random.default_rng(0)
    b = PromotionBudget(8, layers=2, experts=1024, floor=1, window=16)
    _steps(b, 16 * 6, promoted_rate=0.06, evicted_rate=0.06, rng=rng)      # uniform routing: a swap is a wash
    assert b.blocks == 1 and b.yield_ratio == pytest.approx(1.0, abs=0.3)
    _steps(b, 16 * 6, promoted_rate=0.3, evicted_rate=0.05, rng=rng)       # locality: promoted experts come back
    assert b.blocks == 8 and b.yield_ratio > 3


def test_promotions_that_pay_keep_the_whole_budget():
    b = PromotionBudget(7, layers=2, experts=1024, window=8)
    _steps(b, 8 * 5, promoted_rate=0.2, evicted_rate=0.05, rng=np.random.default_rng(1))
    assert b.blocks == 7 and b.yield_ratio > 2


def test_nothing_evicted_or_a_fixed_budget_leaves_it_alone():
    b = PromotionBudget(5, layers=1, experts=64, window=4)
    for step in range(20):                         # free slots: promotions evict nothing, nothing to weigh
        b.observe([(0, np.array([step - 1]))] if step else [])   # the expert promoted a step before
        b.promoted([(0, step)], [])
    assert b.blocks == 5 and b.yield_ratio is None
    fixed = PromotionBudget(5, layers=2, experts=1024, floor=5, window=4)  # adaptive_promotions=False
    _steps(fixed, 40, promoted_rate=0.0, evicted_rate=0.5, rng=np.random.default_rng(2))
    assert fixed.blocks == 5 and fixed.yield_ratio == 0.0


def test_bad_budgets_are_refused():
    for kwargs in ({"most": -1}, {"most": 4, "window": 0}, {"most": 4, "gain": 0}):
        with pytest.raises(ValueError, match="bad promotion budget"):
            PromotionBudget(**kwargs, layers=1, experts=1)


@pytest.mark.parametrize("routing,adaptive", [("uniform", True), ("uniform", False), ("skewed", True)])
def test_the_tier_promotes_less_under_uniform_routing_and_as_much_under_locality(routing, adaptive):
    """Zero-copy decode on the CPU device (the GPU's books, policy and admission): uniform routing brings the
    step's budget down to one block without losing hits; skewed routing with temporal locality keeps it."""
    from runtime.experts.bench import Router
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.hybrid import HybridExperts, HybridOptions
    from runtime.experts.interface import ExpertSpec

    layers, experts, k = 8, 32, 4
    store = HostExpertStore.synthetic(layers=layers, num_experts=experts, hidden=32, intermediate=32, codec="int4",
                                      group=32, seed=1)
    tier = HybridExperts(store, ExpertSpec(), device=torch.device("cpu"), dtype=torch.float32, options=HybridOptions(
        slots=80, top_k=k, zero_copy=True, cpu_share=0.0, fill_pool=True,
        promote_bytes_per_step=6 * store.block_nbytes, adaptive_promotions=adaptive))
    router = Router(routing, layers=layers, experts=experts, k=k, seed=3)
    x, w = torch.randn(1, 32), torch.full((1, k), 1.0 / k)
    for _ in range(200):
        for layer in store.layers:
            tier._zero_copy_decode(layer, x, torch.from_numpy(router.route(layer, 1)), w)
    budget = tier._promotion_budget
    if routing == "skewed" or not adaptive:
        assert budget.blocks == 6
        if adaptive:
            assert budget.yield_ratio > budget.gain
    else:
        assert budget.blocks <= 2 and budget.yield_ratio < 1.6
    assert tier.stats_dict()["zero_copy"]["promote_blocks_per_step"] == budget.blocks     # the stats show it
    c = tier.counters.total
    assert c.promoted_experts > 0
    if routing == "uniform":                       # any resident set hits the slots' share: nothing lost
        assert abs(c.hits / (c.hits + c.misses) - 80 / (layers * experts)) < 0.04
