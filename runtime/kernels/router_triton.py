"""Triton kernel: MoE routing, logits -> (expert ids, weights), in ONE launch (torch takes 3-5 per layer).

The plain-torch references are `runtime/models/blocks.py::route_softmax_topk` (Qwen, Mixtral: softmax in
fp32 over all E, top-k, optionally renormalised over the k) and `route_topk_softmax` (gpt-oss: top-k of the
raw logits, softmax over those k). One program per row holds the row's E logits in registers (fp32):

  repeat K times: the row's max, then the lowest index holding it -> the next id; that one taken out
  weights: softmax_topk  exp(v_i - max) / sum_E exp(v - max)   (renormalised: / sum over the k instead)
           topk_softmax  exp(v_i - max) / sum_k exp(v_j - max)    (max = v_0, the first pick)

Ranking is on the fp32 logits, which orders experts as the softmax probabilities do (exp is monotone); it
differs from ranking the rounded probabilities only where two distinct logits round to one probability.
Ties: the lowest index first, always (the order of a stable descending sort). torch.topk leaves the order of
tied elements unspecified, and CUDA's differs from the CPU's (pytorch/pytorch#127196, #88227): where logits
tie, torch's ids may be a permutation of ours among the tied ones (or another tied expert at the k-th
place), with the same values and weights. NaN ranks above everything (as in torch's topk) and makes the
weights NaN; ids always lie in [0, E) and are distinct within a row.

Shapes: N rows (tokens), E experts (BLOCK_E: E rounded up to a power of two), K picked (BLOCK_K likewise).
Nothing on the host depends on the data: the launch can be recorded in a CUDA graph.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

MODES = ("softmax_topk", "topk_softmax")
MAX_EXPERTS = 4096          # a row lives in one program's registers


if HAVE_TRITON:
    @triton.jit
    def _route_kernel(logits_ptr, row_stride, ids_ptr, w_ptr, E, K: tl.constexpr, MODE: tl.constexpr,
                      RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        inb = e < E
        v = tl.load(logits_ptr + row * row_stride + e, mask=inb, other=float("-inf")).to(tl.float32)   # [BE]
        key = tl.where(v != v, float("inf"), v)                              # NaN ranks first
        # rank index: the expert's own for candidates, pushed past every candidate once taken (or padding),
        # so a candidate of -inf still beats a taken one on the tie-break
        rank = tl.where(inb, e, e + BLOCK_E)
        key = tl.where(inb, key, float("-inf"))
        # the row's max: the softmax's shift and the first pick (a NaN row gives +inf here and NaN weights)
        mx = tl.max(key, axis=0)
        j = tl.arange(0, BLOCK_K)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
        top = tl.full((BLOCK_K,), float("-inf"), dtype=tl.float32)          # [BK] picked logits
        for i in tl.static_range(K):
            best = tl.max(key, axis=0)
            pick = tl.min(tl.where(key == best, rank, 2 * BLOCK_E), axis=0)   # ties: the lowest rank
            ids = tl.where(j == i, pick, ids)
            top = tl.where(j == i, best, top)
            key = tl.where(e == pick, float("-inf"), key)
            rank = tl.where(e == pick, e + BLOCK_E, rank)
        kin = j < K
        z = tl.where(kin, tl.exp(top - mx), 0.0)                             # [BK]
        if MODE == 0 and not RENORM:
            w = z / tl.sum(tl.where(inb, tl.exp(v - mx), 0.0), axis=0)       # softmax over all E
        else:
            w = z / tl.sum(z, axis=0)                                        # over the k picked
        tl.store(ids_ptr + row * K + j, ids.to(tl.int64), mask=kin)
        tl.store(w_ptr + row * K + j, w.to(w_ptr.dtype.element_ty), mask=kin)


def route(logits: torch.Tensor, k: int, *, mode: str = "softmax_topk", renormalize: bool = False,
          out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., E] (bf16/fp16/fp32) -> ids [..., k] int64, weights [..., k] in `out_dtype`; one launch.

    mode "softmax_topk": softmax over all E in fp32, the k largest, renormalised over the k when
    `renormalize` (route_softmax_topk). mode "topk_softmax": the k largest logits, softmax over them
    (route_topk_softmax; `renormalize` changes nothing, the weights already sum to 1)."""
    if mode not in MODES:
        raise ValueError(f"route: mode {mode!r} is not one of {MODES}")
    if logits.ndim < 1 or not logits.dtype.is_floating_point:
        raise ValueError(f"route: logits must be a floating tensor [..., E], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    e = logits.shape[-1]
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"route: {e} experts in the logits' last dimension; 1..{MAX_EXPERTS} supported")
    if not 1 <= k <= e:
        raise ValueError(f"route: top-k of {k} out of {e} experts")
    lead = logits.shape[:-1]
    rows = logits.reshape(-1, e)                                             # [N, E] (a view when it can be)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = rows.shape[0]
    ids = torch.empty((n, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((n, k), dtype=out_dtype, device=logits.device)
    if n:
        block_e = triton.next_power_of_2(e)
        _route_kernel[(n,)](rows, rows.stride(0), ids, weights, e, K=k, MODE=MODES.index(mode),
                            RENORM=bool(renormalize), BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k),
                            num_warps=1 if block_e <= 512 else 4)
    return ids.view(*lead, k), weights.view(*lead, k)
