"""Dense weights in int8: one scale per output row, weights only (activations stay in the model's dtype).

Why: a decode step reads every dense weight once per token. Qwen3-30B-A3B's are 3.1 GB in bf16 (attention
1.8 GB, lm_head 0.6 GB, embeddings 0.6 GB); in int8 the projections and the LM head take half, which a GPU pays
for twice over: half the bytes a step reads, and ~1.2 GB more VRAM for expert slots under a budget (more hits,
fewer misses over PCIe). Per-row symmetric int8 is near lossless for these matrices (the rounding error of a
weight is at most half its row's step, 1/254 of the row's largest weight); llama.cpp's Q4_K_M, what users
compare us with, keeps them in 4 to 6 bits.

What stays in the model's dtype: embeddings (a lookup reads one row a token), norms, biases, routers (their
logits choose experts: a rounding there moves tokens between experts) and matrices under a million weights.

`Int8Linear.forward`: on a GPU, up to `int8_linear_triton.MAX_M` rows (decode steps) go through the Triton
kernel, which reads the int8 codes directly; anything else (prefill, a CPU) dequantizes a block of rows at a
time into the activation dtype and calls F.linear (bounded extra memory: `DEQUANT_BLOCK_BYTES`).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from runtime.kernels import int8_linear_triton as int8_k

MIN_WEIGHTS = 1 << 20                 # smaller matrices stay as they are: little to gain, and routers are small
KEEP_NAMES = ("gate", "router", "shared_expert_gate")    # routing logits: never rounded further
DEQUANT_BLOCK_BYTES = 64 << 20        # the torch path's temporary (a block of dequantized rows)


class Int8Linear(nn.Module):
    """y = x Wᵀ + b with W held as int8 codes [N, K] and fp32 scales [N] (W ≈ codes · scale per row)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.dtype = dtype                                  # what the layer was: activations and outputs
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        codes, scale = int8_k.quantize_int8(weight.detach())
        return cls(codes, scale, None if bias is None else bias.detach(), weight.dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        return cls.from_weight(linear.weight, linear.bias)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.bias) if t is not None)

    def dequantized(self) -> torch.Tensor:
        """W in the layer's dtype (tests and debugging: the whole matrix at once)."""
        return (self.codes.float() * self.scale[:, None]).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if (x2.is_cuda and int8_k.HAVE_TRITON and x2.shape[0] <= int8_k.MAX_M
                and x2.dtype in (torch.bfloat16, torch.float16, torch.float32)):
            y = int8_k.int8_linear(x2, self.codes, self.scale, self.bias)
        else:
            y = self._forward_torch(x2)
        return y.reshape(*lead, self.out_features)

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        rows = max(1, DEQUANT_BLOCK_BYTES // (self.in_features * x.element_size()))
        if rows >= self.out_features:
            w = (self.codes.to(x.dtype) * self.scale[:, None].to(x.dtype))
            return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
        out = torch.empty(x.shape[0], self.out_features, device=x.device, dtype=x.dtype)
        for start in range(0, self.out_features, rows):
            end = min(start + rows, self.out_features)
            w = self.codes[start:end].to(x.dtype) * self.scale[start:end, None].to(x.dtype)
            b = None if self.bias is None else self.bias[start:end].to(x.dtype)
            out[:, start:end] = F.linear(x, w, b)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


def _quantizable(name: str, module: nn.Module, tied: set[int], min_weights: int) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    if name.rsplit(".", 1)[-1] in KEEP_NAMES or module.weight.numel() < min_weights:
        return False
    return module.weight.data_ptr() not in tied      # a weight shared with the embeddings would then exist twice


def quantize_dense_(model: nn.Module, *, min_weights: int | None = None) -> dict:
    """Swap the model's large dense projections (and a fused q/k/v, `Attention.fuse_projections`) for
    Int8Linear, in place, one matrix at a time. Returns what changed: {"matrices": n, "bytes_before": b,
    "bytes_after": a, "dense_bytes": the model's bytes now (`dense_nbytes`)}; on a GPU the freed copies go back to
    the driver (the planner measures free VRAM next). Call after the weights are loaded (and fused).
    `min_weights` (default MIN_WEIGHTS): matrices smaller than this stay (tests' tiny models pass 0).
    ValueError naming the matrix when one holds inf or NaN."""
    min_weights = MIN_WEIGHTS if min_weights is None else min_weights
    tied = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    done = {"matrices": 0, "bytes_before": 0, "bytes_after": 0}

    def swap(parent: nn.Module, attr: str, old_bytes: int, make, *args) -> None:
        try:
            new = make(*args)
        except ValueError as exc:
            name = next((n for n, m in model.named_modules() if m is parent), "")
            raise ValueError(f"{name + '.' if name else ''}{attr}: {exc}") from exc
        setattr(parent, attr, new)
        done["matrices"] += 1
        done["bytes_before"] += old_bytes
        done["bytes_after"] += new.nbytes

    with torch.no_grad():
        for module in list(model.modules()):
            fused = getattr(module, "qkv", None)
            if isinstance(fused, tuple) and fused[0].numel() >= min_weights:
                weight, bias = fused
                old = weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())
                swap(module, "qkv", old, Int8Linear.from_weight, weight, bias)
                for attr in ("q_proj", "k_proj", "v_proj"):     # views of the fused weight: gone with it
                    setattr(module, attr, None)
                del weight, bias, fused
            for attr, child in list(module.named_children()):
                if _quantizable(attr, child, tied, min_weights):
                    old = sum(p.numel() * p.element_size() for p in child.parameters())
                    swap(module, attr, old, Int8Linear.from_linear, child)
    if any(t.is_cuda for t in model.buffers()):
        torch.cuda.empty_cache()
    done["dense_bytes"] = dense_nbytes(model)
    return done


def dense_nbytes(model: nn.Module) -> int:
    """Bytes of the model's own tensors (parameters and buffers, shared ones once), experts excluded: what the
    dense part holds on its device."""
    experts = getattr(model, "experts", None)
    skip = set()
    if isinstance(experts, nn.Module):
        skip = {t.data_ptr() for t in list(experts.parameters()) + list(experts.buffers())}
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        ptr = t.data_ptr()
        if ptr in seen or ptr in skip or t.numel() == 0:
            continue
        seen.add(ptr)
        total += t.numel() * t.element_size()
    return total
