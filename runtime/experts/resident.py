"""Every expert on the compute device: the simplest expert tier, and the one CI runs.

At load each MoE layer's experts are dequantized once from the FTW ExpertStore and stacked on the
device: gate_up [E, 2I, D] (gate rows first), down [E, D, I], and biases. A call groups the (token,
slot) assignments by expert with one sort, then computes either
- grouped: one grouped GEMM per projection over all experts (`torch.nn.functional.grouped_mm`, the
  CUDA kernel for bf16 on SM80+); nothing crosses to the host, so a decode step never syncs here; or
- looped: one matmul chain per expert that any token chose (the plain-torch path; only the expert
  counts cross to the host, one sync per layer). This is the CPU default: there grouped_mm is a
  fallback loop itself and measured slower.

Shapes: T tokens, D hidden, K experts per token, E experts, I expert FFN width, A = T*K assignments.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from runtime.experts.interface import ExpertSpec, ExpertWeights, activate

log = logging.getLogger(__name__)


@dataclass
class StackedExperts:
    """One layer's experts, stacked on the device."""
    gate_up: torch.Tensor                 # [E, 2I, D], rows [gate; up]
    down: torch.Tensor                    # [E, D, I]
    gate_up_bias: torch.Tensor | None = None   # [E, 2I]
    down_bias: torch.Tensor | None = None      # [E, D]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down, self.gate_up_bias,
                                                          self.down_bias) if t is not None)

    @property
    def intermediate(self) -> int:
        return self.gate_up.shape[1] // 2

    def expert(self, e: int) -> ExpertWeights:
        i = self.intermediate
        gb = self.gate_up_bias
        return ExpertWeights(self.gate_up[e, :i], self.gate_up[e, i:], self.down[e],
                             None if gb is None else gb[e, :i], None if gb is None else gb[e, i:],
                             None if self.down_bias is None else self.down_bias[e])


def stack_experts(weights: list[ExpertWeights], *, device: torch.device | str, dtype: torch.dtype) -> StackedExperts:
    """[ExpertWeights] of one layer -> StackedExperts on `device` in `dtype`."""
    gate_up = torch.stack([torch.cat([w.gate, w.up]).to(dtype) for w in weights]).to(device)
    down = torch.stack([w.down.to(dtype) for w in weights]).to(device)
    gate_up_bias = down_bias = None
    if weights[0].gate_bias is not None:
        gate_up_bias = torch.stack([torch.cat([w.gate_bias, w.up_bias]).to(dtype) for w in weights]).to(device)
        down_bias = torch.stack([w.down_bias.to(dtype) for w in weights]).to(device)
    return StackedExperts(gate_up, down, gate_up_bias, down_bias)


class ResidentExperts:
    """experts(layer, hidden, topk_ids, topk_weights) over experts that all live on one device."""

    def __init__(self, layers: dict[int, StackedExperts], spec: ExpertSpec, *, grouped: bool | None = None):
        self.layers, self.spec = layers, spec
        if grouped is None:
            first = next(iter(layers.values()), None)
            grouped = (first is not None and first.gate_up.is_cuda and first.gate_up.dtype == torch.bfloat16
                       and hasattr(F, "grouped_mm"))
        self.grouped = grouped

    @classmethod
    def from_store(cls, store, spec: ExpertSpec, *, device: torch.device | str, dtype: torch.dtype,
                   progress: Callable[[int, int], None] | None = None, grouped: bool | None = None
                   ) -> "ResidentExperts":
        """Dequantize every (layer, expert) of an FTW ExpertStore once and stack it on `device`."""
        layers = {}
        total = len(store.layers)
        for done, layer in enumerate(store.layers):
            weights = [store.dequantize(layer, e, dtype=torch.float32) for e in range(store.num_experts)]
            layers[layer] = stack_experts(weights, device=device, dtype=dtype)
            if progress:
                progress(done + 1, total)
        return cls(layers, spec, grouped=grouped)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers.values())

    def stats(self) -> dict:
        return {"backend": "resident", "grouped_gemm": self.grouped, "bytes": self.nbytes}

    def graph_safe(self, layer: int) -> bool:
        """The grouped path never needs the host, so a CUDA graph may record it (the looped one reads counts)."""
        return self.grouped

    def graph_tokens(self, layer: int) -> int | None:
        """Any number of tokens per call on the grouped path (a decode step of B sequences may be recorded whole),
        none on the looped one."""
        return None if self.grouped else 0

    def __call__(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        stacked = self.layers.get(layer)
        if stacked is None:
            raise KeyError(f"layer {layer} has no routed experts in this model")
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)                                      # [A]
        order = torch.argsort(flat_ids, stable=True)                         # [A] assignments grouped by expert
        token_of = order // k                                                # [A] token of each sorted assignment
        w = topk_weights.reshape(-1).index_select(0, order).to(hidden.dtype)  # [A]
        # counts by scatter, not bincount: bincount reads the max id back to the host, which a CUDA graph forbids
        counts = torch.zeros(stacked.gate_up.shape[0], dtype=torch.long, device=flat_ids.device).index_add_(
            0, flat_ids, torch.ones_like(flat_ids))                          # [E]
        out = None
        if self.grouped:
            try:
                out = self._grouped(stacked, hidden, token_of, flat_ids.index_select(0, order), counts)
            except RuntimeError as exc:   # a device or shape the grouped kernel does not take: loop instead
                log.warning("grouped expert GEMM unavailable (%s); computing experts one by one", exc)
                self.grouped = False
        if out is None:
            out = self._looped(stacked, hidden.index_select(0, token_of), counts.tolist())
        result = torch.zeros_like(hidden)                                    # [T, D]
        result.index_add_(0, token_of, out.mul_(w[:, None]))                 # in place: no second [A, D]
        return result

    def _grouped(self, s: StackedExperts, hidden: torch.Tensor, token_of: torch.Tensor, sorted_ids: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        """Each [A, *] intermediate is dropped as soon as the next exists: a prefill chunk's peak is about two of
        them (A = 16K tokens x 8 experts: ~0.9 GB at qwen3-30b's widths, where holding them all took ~1.9)."""
        offs = counts.cumsum(0).to(torch.int32)                              # [E] end of each expert's rows
        x = hidden.index_select(0, token_of)                                 # [A, D]
        gate_up = F.grouped_mm(x, s.gate_up.transpose(1, 2), offs=offs)      # [A, 2I]
        del x
        if s.gate_up_bias is not None:
            gate_up = gate_up + s.gate_up_bias.index_select(0, sorted_ids)
        i = s.intermediate
        h = activate(self.spec, gate_up[:, :i], gate_up[:, i:])             # [A, I]
        del gate_up
        out = F.grouped_mm(h, s.down.transpose(1, 2), offs=offs)            # [A, D]
        del h
        if s.down_bias is not None:
            out = out + s.down_bias.index_select(0, sorted_ids)
        return out

    def _looped(self, s: StackedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out = torch.empty_like(x)                                            # [A, D]
        i = s.intermediate
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            gb = None if s.gate_up_bias is None else s.gate_up_bias[e]
            gate_up = F.linear(x[rows], s.gate_up[e], gb)                    # [n, 2I]
            h = activate(self.spec, gate_up[:, :i], gate_up[:, i:])         # [n, I]
            out[rows] = F.linear(h, s.down[e], None if s.down_bias is None else s.down_bias[e])
            start += n
        return out
