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
    def _rank(v, inb, e, row, ids_ptr, w_ptr, K: tl.constexpr, MODE: tl.constexpr, RENORM: tl.constexpr,
              BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        """One row's logits v [BE] (fp32; inb: the real experts) -> its K ids and weights, stored at row."""
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

    @triton.jit
    def _route_kernel(logits_ptr, row_stride, ids_ptr, w_ptr, E, K: tl.constexpr, MODE: tl.constexpr,
                      RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        inb = e < E
        v = tl.load(logits_ptr + row * row_stride + e, mask=inb, other=float("-inf")).to(tl.float32)   # [BE]
        _rank(v, inb, e, row, ids_ptr, w_ptr, K, MODE, RENORM, BLOCK_E, BLOCK_K)

    @triton.jit
    def _route_linear_kernel(x_ptr, x_stride, gate_ptr, gate_stride, bias_ptr, logits_ptr, count_ptr, ids_ptr,
                             w_ptr, D, E, K: tl.constexpr, MODE: tl.constexpr, RENORM: tl.constexpr,
                             HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (token, p): logits of experts p*ROWS .. (p+1)*ROWS (a GEMV slice of the gate weights), rounded to
        x's dtype as the torch Linear rounds them, into the fp32 scratch row; then a count per token: the
        program that finishes last (an acq_rel atomic orders every program's logits before its count) ranks
        the whole row as `_route_kernel` does and sets the count back to 0 for the next call (a CUDA graph
        replays the same counter)."""
        row = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1)
        r = p * ROWS + tl.arange(0, ROWS)                                    # [ROWS] experts of this program
        rmask = r < E
        acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            dmask = d < D
            xv = tl.load(x_ptr + row * x_stride + d, mask=dmask, other=0.0).to(tl.float32)
            wv = tl.load(gate_ptr + r[:, None].to(tl.int64) * gate_stride + d[None, :],
                         mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            acc += wv * xv[None, :]
        logit = tl.sum(acc, axis=1)                                          # [ROWS]
        if HAS_BIAS:
            logit += tl.load(bias_ptr + r, mask=rmask, other=0.0).to(tl.float32)
        logit = logit.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(logits_ptr + row * E + r, logit, mask=rmask)
        done = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
        if done == tl.num_programs(1) - 1:
            e = tl.arange(0, BLOCK_E)
            inb = e < E
            # past L1 (not coherent across SMs): the other programs' logits are in L2 after their release
            v = tl.load(logits_ptr + row * E + e, mask=inb, other=float("-inf"), cache_modifier=".cg")
            _rank(v, inb, e, row, ids_ptr, w_ptr, K, MODE, RENORM, BLOCK_E, BLOCK_K)
            tl.store(count_ptr + row, 0)


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


LINEAR_MAX_ROWS = 64        # tokens one fused call takes (decode); more go through a GEMM and `route`
_LINEAR_TILE = 4096         # weights per program and step (ROWS x BLOCK_D): 32 fp32 products a thread at 4 warps
_counters: dict[torch.device, torch.Tensor] = {}     # per device: one int32 count per token, left at zero


def route_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, *,
                 mode: str = "softmax_topk", renormalize: bool = False,
                 out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The router Linear and `route` in ONE launch: x [N, D] (N <= LINEAR_MAX_ROWS), weight [E, D], bias [E] or
    None -> ids [N, k] int64, weights [N, k] in `out_dtype`.

    The logits are computed in fp32 and rounded to x's dtype (what `F.linear` returns), spread over E / ROWS
    programs per token, and ranked by the program that finishes last. The count it uses is a per-device
    buffer made by the first call, which must not be during a CUDA graph capture (the engine's decode step
    runs eagerly once before it records)."""
    if mode not in MODES:
        raise ValueError(f"route_linear: mode {mode!r} is not one of {MODES}")
    n, d = x.shape
    e = weight.shape[0]
    if weight.shape != (e, d) or (bias is not None and bias.shape != (e,)):
        raise ValueError(f"route_linear: weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not agree with x [N, {d}] -> [N, E]")
    if not 1 <= e <= MAX_EXPERTS or not 1 <= k <= e or n > LINEAR_MAX_ROWS:
        raise ValueError(f"route_linear: {n} tokens (at most {LINEAR_MAX_ROWS}), top-{k} of {e} experts "
                         f"(at most {MAX_EXPERTS})")
    counts = _counters.get(x.device)
    if counts is None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("route_linear: first call during a CUDA graph capture (its counter buffer must "
                               "exist before); run the step once eagerly first")
        counts = _counters[x.device] = torch.zeros(LINEAR_MAX_ROWS, dtype=torch.int32, device=x.device)
    xs = x if x.stride(1) == 1 else x.contiguous()
    ws = weight if weight.stride(1) == 1 else weight.contiguous()
    ids = torch.empty((n, k), dtype=torch.int64, device=x.device)
    weights = torch.empty((n, k), dtype=out_dtype, device=x.device)
    if n:
        logits = torch.empty((n, e), dtype=torch.float32, device=x.device)          # [N, E] scratch
        block_e = triton.next_power_of_2(e)
        rows = max(1, block_e // 64)                                                  # 64+ programs a token
        block_d = min(triton.next_power_of_2(d), max(16, _LINEAR_TILE // rows))
        _route_linear_kernel[(n, triton.cdiv(e, rows))](
            xs, xs.stride(0), ws, ws.stride(0), bias if bias is not None else ws, logits, counts, ids, weights,
            d, e, K=k, MODE=MODES.index(mode), RENORM=bool(renormalize), HAS_BIAS=bias is not None, ROWS=rows,
            BLOCK_D=block_d, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k))
    return ids, weights
