"""The one interface between a model's MoE block and wherever the experts live.

A model file routes (router logits -> top-k ids and weights) and then calls
`experts(layer, hidden, topk_ids, topk_weights)`; it never knows whether an expert is resident on
the GPU, cached in a VRAM slot, computed on the CPU or streamed for prefill. Implementations:
`runtime/experts/resident.py` (every expert on the compute device) and the hybrid tier.

Shapes: T tokens, D hidden, K experts per token, I expert FFN width.
Canonical expert weights are nn.Linear-oriented (out, in): gate [I, D], up [I, D], down [D, I].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ExpertSpec:
    """How one expert computes, from the model config; identical for every expert of a model."""
    activation: str = "silu"          # "silu": down(silu(gate x) * up x); "gpt_oss": clamped SwiGLU
    swiglu_alpha: float = 1.702       # gpt-oss only
    swiglu_limit: float = 7.0         # gpt-oss only
    has_bias: bool = False            # gpt-oss experts carry gate/up/down biases


@dataclass
class ExpertWeights:
    """One expert, dequantized: what the reference compute consumes."""
    gate: torch.Tensor                # [I, D]
    up: torch.Tensor                  # [I, D]
    down: torch.Tensor                # [D, I]
    gate_bias: torch.Tensor | None = None   # [I]
    up_bias: torch.Tensor | None = None     # [I]
    down_bias: torch.Tensor | None = None   # [D]


class Experts(Protocol):
    """What a MoE block calls. Returns sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])."""

    def __call__(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:  # [T, D], [T, K] int64, [T, K] -> [T, D]
        ...


class GraphSafeExperts(Experts, Protocol):
    """Optional: `graph_safe(layer)` is True when a call for that layer never needs the host (no sync, no
    host decision, no allocation that depends on the routing), so runtime/decode_graph.py may record it inside
    a CUDA graph. Otherwise the recorded decode step is cut around the call and the call runs eagerly."""

    def graph_safe(self, layer: int) -> bool: ...


class StreamingExperts(Experts, Protocol):
    """Optional: a tier that streams experts for prefill (the hybrid tier) has a `prefill_continues` attribute,
    which the engine sets before each forward: whether a later step will prefill at least `stream_threshold`
    tokens, the fewest a streamed layer serves. The tier stages the next chunk's first layer ahead only then (after
    a prompt's last chunk, or before its lone last token, that copy would serve nobody)."""

    prefill_continues: bool
    stream_threshold: int


def activate(spec: ExpertSpec, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The expert's gated activation on its gate and up projections (any shape, same for both)."""
    if spec.activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if spec.activation == "gpt_oss":
        # gpt-oss: gate clamped above, up clamped both ways, glu = g * sigmoid(alpha g), out = (u + 1) * glu
        gate = gate.clamp(max=spec.swiglu_limit)
        up = up.clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(spec.swiglu_alpha * gate))
    raise ValueError(f"unknown expert activation {spec.activation!r}")


def expert_forward(spec: ExpertSpec, w: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference for one expert on x [T, D] -> [T, D]; every fast path is tested against it."""
    g = torch.nn.functional.linear(x, w.gate, w.gate_bias)
    u = torch.nn.functional.linear(x, w.up, w.up_bias)
    return torch.nn.functional.linear(activate(spec, g, u), w.down, w.down_bias)
