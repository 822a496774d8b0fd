"""Every expert on the compute device: the simplest expert tier, and the one CI runs.

At load each MoE layer's experts are dequantized once from the FTW ExpertStore and stacked:
gate/up [E, I, D], down [E, D, I] (and biases). A call groups the (token, slot) pairs by expert with
one sort, then runs one matmul chain per expert that any token chose. Only the expert counts cross
to the host (one sync per layer), which is what lets the loop skip idle experts.

Shapes: T tokens, D hidden, K experts per token, E experts, I expert FFN width, A = T*K assignments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from runtime.experts.interface import ExpertSpec, ExpertWeights


@dataclass
class StackedExperts:
    """One layer's experts, stacked on the device."""
    gate: torch.Tensor                    # [E, I, D]
    up: torch.Tensor                      # [E, I, D]
    down: torch.Tensor                    # [E, D, I]
    gate_bias: torch.Tensor | None = None   # [E, I]
    up_bias: torch.Tensor | None = None     # [E, I]
    down_bias: torch.Tensor | None = None   # [E, D]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down, self.gate_bias,
                                                          self.up_bias, self.down_bias) if t is not None)

    def expert(self, e: int) -> ExpertWeights:
        pick = lambda t: None if t is None else t[e]   # noqa: E731
        return ExpertWeights(self.gate[e], self.up[e], self.down[e], pick(self.gate_bias), pick(self.up_bias),
                             pick(self.down_bias))


def stack_experts(weights: list[ExpertWeights], *, device: torch.device | str, dtype: torch.dtype) -> StackedExperts:
    """[ExpertWeights] of one layer -> StackedExperts on `device` in `dtype`."""
    def stack(name: str) -> torch.Tensor | None:
        parts = [getattr(w, name) for w in weights]
        if any(p is None for p in parts):
            return None
        return torch.stack([p.to(dtype) for p in parts]).to(device)
    return StackedExperts(*(stack(n) for n in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")))


class ResidentExperts:
    """experts(layer, hidden, topk_ids, topk_weights) over experts that all live on one device."""

    def __init__(self, layers: dict[int, StackedExperts], spec: ExpertSpec):
        self.layers, self.spec = layers, spec

    @classmethod
    def from_store(cls, store, spec: ExpertSpec, *, device: torch.device | str, dtype: torch.dtype,
                   progress: Callable[[int, int], None] | None = None) -> "ResidentExperts":
        """Dequantize every (layer, expert) of an FTW ExpertStore once and stack it on `device`."""
        layers = {}
        total = len(store.layers)
        for done, layer in enumerate(store.layers):
            weights = [store.dequantize(layer, e, dtype=torch.float32) for e in range(store.num_experts)]
            layers[layer] = stack_experts(weights, device=device, dtype=dtype)
            if progress:
                progress(done + 1, total)
        return cls(layers, spec)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers.values())

    def __call__(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        stacked = self.layers.get(layer)
        if stacked is None:
            raise KeyError(f"layer {layer} has no routed experts in this model")
        t, k = topk_ids.shape
        num_experts = stacked.gate.shape[0]
        flat_ids = topk_ids.reshape(-1)                                      # [A]
        order = torch.argsort(flat_ids, stable=True)                         # [A] assignments grouped by expert
        token_of = order // k                                                # [A] token of each sorted assignment
        counts = torch.bincount(flat_ids, minlength=num_experts).tolist()    # host: one sync per layer
        x = hidden.index_select(0, token_of)                                 # [A, D]
        w = topk_weights.reshape(-1).index_select(0, order).to(hidden.dtype)  # [A]
        out = torch.empty_like(x)                                            # [A, D]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            out[rows] = self._expert(stacked, e, x[rows])
            start += n
        result = torch.zeros_like(hidden)                                    # [T, D]
        result.index_add_(0, token_of, out * w[:, None])
        return result

    def _expert(self, s: StackedExperts, e: int, x: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens x [n, D] -> [n, D]; the same math as interface.expert_forward."""
        g = torch.nn.functional.linear(x, s.gate[e], None if s.gate_bias is None else s.gate_bias[e])
        u = torch.nn.functional.linear(x, s.up[e], None if s.up_bias is None else s.up_bias[e])
        if self.spec.activation == "silu":
            h = torch.nn.functional.silu(g) * u
        elif self.spec.activation == "gpt_oss":
            g = g.clamp(max=self.spec.swiglu_limit)
            u = u.clamp(min=-self.spec.swiglu_limit, max=self.spec.swiglu_limit)
            h = (u + 1) * (g * torch.sigmoid(self.spec.swiglu_alpha * g))
        else:
            raise ValueError(f"unknown expert activation {self.spec.activation!r}")
        return torch.nn.functional.linear(h, s.down[e], None if s.down_bias is None else s.down_bias[e])
