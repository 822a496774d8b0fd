"""Next-layer expert prediction: which experts the next MoE layer will probably want, from this layer's input.

The residual stream changes little from one layer to the next, so the next layer's router applied to the
current hidden state predicts its choice well enough to start copying those experts early (on the copy
stream, as promotions: never on the critical path). `NextLayerPrefetcher` holds the routers (taken from the
package's dense weights at load), predicts, and keeps its own precision/recall so the benchmark and the
stats can say whether prefetching pays.

Shapes: T tokens, D hidden, E experts, K experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# where each family keeps a MoE layer's router (checkpoint names, after the FTW reader's normalisation)
ROUTER_NAMES = ("model.layers.{layer}.mlp.gate.weight",                 # Qwen3-MoE, Qwen3-Next, Qwen3.5/3.6
                "model.layers.{layer}.block_sparse_moe.gate.weight",    # Mixtral
                "model.layers.{layer}.mlp.router.weight")               # gpt-oss


@dataclass
class PrefetchCounters:
    predicted: int = 0        # experts predicted (summed over calls)
    correct: int = 0          # of which the next layer did use
    used: int = 0             # experts the next layer used

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.correct / self.used if self.used else 0.0


class NextLayerPrefetcher:
    def __init__(self, routers: dict[int, torch.Tensor], *, top_k: int, extra: int = 0):
        """routers: MoE layer -> router weight [E, D]; `extra` more experts per token than K are predicted
        (a wider net catches more of the next layer's choice at the cost of more copies)."""
        self.layers = sorted(routers)
        self.routers = routers
        self.k = top_k + extra
        self.counters = PrefetchCounters()
        self._pending: dict[int, set[int]] = {}

    @classmethod
    def from_package(cls, package, layers: list[int], *, top_k: int, device, extra: int = 0) -> "NextLayerPrefetcher | None":
        """Routers from an FTW package's dense weights; None when a layer's router cannot be found."""
        names = set(package.dense_names())
        routers = {}
        for layer in layers:
            name = next((n.format(layer=layer) for n in ROUTER_NAMES if n.format(layer=layer) in names), None)
            if name is None:
                return None
            routers[layer] = package.dense(name).to(device=device, dtype=torch.float32)
        return cls(routers, top_k=top_k, extra=extra)

    def next_layer(self, layer: int) -> int | None:
        i = self.layers.index(layer) + 1
        return self.layers[i] if i < len(self.layers) else None

    def predict(self, layer: int, hidden: torch.Tensor) -> tuple[int | None, list[int]]:
        """(next MoE layer, experts it will probably use) from `layer`'s input hidden [T, D]."""
        nxt = self.next_layer(layer)
        if nxt is None:
            return None, []
        router = self.routers[nxt]
        logits = hidden.to(router.dtype) @ router.T                                   # [T, E]
        ids = torch.topk(logits, min(self.k, router.shape[0]), dim=-1).indices        # [T, k]
        experts = sorted(set(ids.flatten().tolist()))
        self._pending[nxt] = set(experts)
        self.counters.predicted += len(experts)
        return nxt, experts

    def observe(self, layer: int, used: list[int]) -> None:
        """The experts `layer` actually used: scores the prediction made for it, if any."""
        predicted = self._pending.pop(layer, None)
        if predicted is None:
            return
        used_set = set(used)
        self.counters.used += len(used_set)
        self.counters.correct += len(predicted & used_set)
