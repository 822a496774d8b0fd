"""Next-layer prefetch: the predictor on its own (no GPU), its routers from a package, and inside the tier."""
from __future__ import annotations

import pytest
import torch

from runtime.experts.host_store import HostExpertStore
from runtime.experts.hybrid import HybridExperts, HybridOptions
from runtime.experts.interface import ExpertSpec, expert_forward
from runtime.experts.prefetch import NextLayerPrefetcher


def test_predicts_the_next_layers_topk_and_scores_itself():
    d, e = 8, 6
    router = torch.zeros(e, d)
    router[torch.arange(e), torch.arange(e)] = 1.0           # expert j fires on feature j
    pf = NextLayerPrefetcher({0: torch.randn(e, d), 4: router}, top_k=2)
    hidden = torch.zeros(2, d)
    hidden[0, [1, 3]] = torch.tensor([2.0, 1.0])
    hidden[1, [5, 1]] = torch.tensor([3.0, 0.5])
    nxt, experts = pf.predict(0, hidden)
    assert nxt == 4 and experts == [1, 3, 5]                  # union of each token's top 2
    assert pf.predict(4, hidden) == (None, [])                # the last MoE layer has no next
    pf.observe(4, [1, 5, 2, 0])
    assert (pf.counters.predicted, pf.counters.correct, pf.counters.used) == (3, 2, 4)
    assert pf.counters.precision == pytest.approx(2 / 3) and pf.counters.recall == pytest.approx(0.5)
    pf.observe(4, [1])                                        # no prediction pending: nothing counted
    assert pf.counters.used == 4


class _Package:
    def __init__(self, names: dict[str, torch.Tensor]):
        self._t = names

    def dense_names(self):
        return list(self._t)

    def dense(self, name):
        return self._t[name]


def test_routers_found_by_each_family_naming():
    e, d = 4, 8
    qwen = _Package({f"model.layers.{i}.mlp.gate.weight": torch.randn(e, d) for i in (0, 2)})
    mixtral = _Package({f"model.layers.{i}.block_sparse_moe.gate.weight": torch.randn(e, d) for i in (0, 1)})
    oss = _Package({f"model.layers.{i}.mlp.router.weight": torch.randn(e, d) for i in (0, 1)})
    assert NextLayerPrefetcher.from_package(qwen, [0, 2], top_k=2, device="cpu").layers == [0, 2]
    assert NextLayerPrefetcher.from_package(mixtral, [0, 1], top_k=2, device="cpu").next_layer(0) == 1
    assert NextLayerPrefetcher.from_package(oss, [0, 1], top_k=2, device="cpu") is not None
    assert NextLayerPrefetcher.from_package(qwen, [0, 1], top_k=2, device="cpu") is None   # layer 1 has none


def test_prefetch_inside_the_tier_promotes_predictions_and_keeps_results_exact():
    gen = torch.Generator().manual_seed(6)
    store = HostExpertStore.synthetic(layers=2, num_experts=6, hidden=64, intermediate=32, codec="int4", group=32,
                                      weight_std=0.2)
    routers = {layer: torch.randn(6, 64, generator=gen) for layer in (0, 1)}
    pf = NextLayerPrefetcher(routers, top_k=2)
    hybrid = HybridExperts(store, ExpertSpec(), device=torch.device("cpu"), dtype=torch.float32,
                           options=HybridOptions(slots=4, top_k=2, split="cpu", promote_bytes_per_call=0),
                           prefetcher=pf)
    x = torch.randn(1, 64, generator=gen)
    ids = torch.tensor([[0, 1]])
    w = torch.tensor([[0.6, 0.4]])
    out = hybrid(0, x, ids, w)
    want = sum(w[0, k] * expert_forward(ExpertSpec(), store.dequantize(0, int(ids[0, k])), x)[0] for k in range(2))
    torch.testing.assert_close(out[0], want, rtol=1e-4, atol=1e-5)
    predicted = pf._pending[1]
    assert hybrid.counters.total.promoted_experts == len(predicted) > 0      # only prefetch promotes here
    # in flight until the next call publishes them (never counted as hits before their bytes land)
    assert {(1, e) for e in predicted} <= hybrid.cache.pending
    used = sorted(predicted)[:2]
    hybrid(1, x, torch.tensor([used]), w)
    assert hybrid.counters.total.hits == len(used)                          # the prediction turned into hits
    assert hybrid.stats()["prefetch"]["precision"] == pytest.approx(len(used) / len(predicted), abs=1e-3)
