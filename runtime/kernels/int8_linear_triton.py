"""Triton kernel: a linear layer with int8 weights (one fp32 scale per output row) at decode sizes (M <= 16 rows).

Why: the dense weights of a decode step (attention projections, lm_head, linear-attention projections) are read
whole for every token; kept in int8 they are half the bytes of bf16, so the step reads half as much and the
freed VRAM holds more expert slots. The reference is `int8_linear_reference` below (plain torch):

  y = (x.float() @ q.float().T) * scale + bias.float(),  in x's dtype

The kernel computes exactly that function, differing only in the order of the fp32 sums:

  program (column block j, split s), grid (cdiv(N, BLOCK_N), SPLIT_K):
      acc [16, BLOCK_N] = sum over the split's K range, BLOCK_K at a time, of
                          x tile [16, BLOCK_K] (rows >= M are 0) . int8 tile [BLOCK_N, BLOCK_K]^T
      the int8 tile is converted to x's 16-bit dtype (exact: |q| <= 127) and multiplied on the tensor cores
      with fp32 accumulation (fp32 x: in full fp32, not tf32)
      SPLIT_K = 1: y = acc * scale + bias, stored for rows < M
      SPLIT_K > 1: acc stored to an fp32 workspace [SPLIT_K, M, N]; a second launch sums the SPLIT_K partials
                   in a fixed order and applies scale and bias (no atomics: reruns are bit-identical)

The split exists to fill the GPU: N = 2,048 outputs in blocks of 32 are 64 programs on a 132-SM H200; split 8
over K they are 512. `plan` picks the tile and the split, from a first sweep on the H200 (its docstring has
the numbers). Nothing on the host depends on the data (the workspace is sized by shapes only), so the launches
can be recorded in a CUDA graph.

`quantize_int8` makes (q, scale) from float weights: symmetric per output row, scale = absmax / 127.

Shapes: M rows of x (decode sequences, at most MAX_M), K inputs, N outputs.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

MAX_M = 16                  # rows one launch takes (decode steps of up to 16 sequences); more: a GEMM
BLOCK_M = 16                # tl.dot's smallest tile height: x's M rows are padded to it
QMAX = 127                  # symmetric int8: -128 is never used, so negating a row stays exact
MAX_SPLIT_K = 8             # the reduce launch reads this many partials per output at most
DEFAULT_SMS = 132           # an H200's count, used when not on a CUDA device (the interpreter)
PROGRAMS_PER_SM = 4         # the grid's aim (swept: half as many programs was ~1.5x slower on the H200)
MIN_STEPS_PER_SPLIT = 2     # a split shorter than this many BLOCK_K steps is mostly launch overhead
PLAN_BLOCK_K = 128          # swept: the fastest, or within 5% of it, at every shape tried
REDUCE_BLOCK_N = 512        # outputs per program of the reduce launch
NUM_WARPS = 4
NUM_STAGES = 3              # Triton's default software pipelining depth on CUDA
QUANTIZE_BLOCK_BYTES = 64 << 20   # quantize_int8's fp32 temporaries: rows a block


if HAVE_TRITON:
    @triton.jit
    def _scale_bias_store(acc, rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, out_stride, HAS_BIAS: tl.constexpr):
        """y = acc * scale + bias for a [R, C] fp32 tile, cast to out's dtype, stored where rows < M and cols < N."""
        col_in = cols < N
        y = acc * tl.load(scale_ptr + cols, mask=col_in, other=0.0)[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=(rows < M)[:, None] & col_in[None, :])

    @triton.jit
    def _int8_linear_kernel(x_ptr, x_stride, q_ptr, scale_ptr, bias_ptr, out_ptr, out_stride, part_ptr, M, N, K,
                            k_chunk, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                            DOT_FP32: tl.constexpr):
        """Program (column block, split): the [BLOCK_M, BLOCK_N] sums over K range [split * k_chunk, + k_chunk)
        (k_chunk a multiple of BLOCK_K), finished into out (SPLIT_K = 1) or stored as fp32 partials."""
        split = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        row_in = rows < M
        # columns past N read the last row again instead of masking (whole-row loads stay unpredicated and
        # 16 bytes wide); their sums are dropped at the store
        w_rows = q_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K                  # [BN, 1]
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride                              # [BM, 1]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = split * k_chunk
        for k0 in range(k_start, tl.minimum(k_start + k_chunk, K), BLOCK_K):
            k = k0 + kk
            if EVEN_K:
                xt = tl.load(x_rows + k[None, :], mask=row_in[:, None], other=0.0)          # [BM, BK]
                wt = tl.load(w_rows + k[None, :])                                            # [BN, BK] int8
            else:
                k_in = k < K
                xt = tl.load(x_rows + k[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0)
                wt = tl.load(w_rows + k[None, :], mask=k_in[None, :], other=0)
            if DOT_FP32:
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
            else:
                wt = wt.to(xt.dtype)                                                         # exact: |q| <= 127
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee" if DOT_FP32 else None)
        if SPLIT_K == 1:
            _scale_bias_store(acc, rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, out_stride, HAS_BIAS)
        else:
            part = part_ptr + (split * M + rows).to(tl.int64)[:, None] * N + cols[None, :]
            tl.store(part, acc, mask=row_in[:, None] & (cols < N)[None, :])

    @triton.jit
    def _int8_reduce_kernel(part_ptr, scale_ptr, bias_ptr, out_ptr, out_stride, M, N, HAS_BIAS: tl.constexpr,
                            SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (column block, row): the SPLIT_K partials of BLOCK_N outputs summed in split order (the same
        bits on every run), then scale, bias and the store."""
        row = tl.program_id(1)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_in = cols < N
        acc = tl.zeros((1, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):                                   # unrolled: the loads overlap
            acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + cols, mask=col_in, other=0.0)[None, :]
        rows = row + tl.arange(0, 1)
        _scale_bias_store(acc, rows, cols, M, N, scale_ptr, bias_ptr, out_ptr, out_stride, HAS_BIAS)


@dataclass(frozen=True)
class Int8Plan:
    """How `int8_linear` launches: a program's tile (BLOCK_N outputs x BLOCK_K inputs a step), SPLIT_K programs
    per column block over K (1: no workspace, no reduce launch), warps per program, pipelining stages."""
    block_n: int
    block_k: int
    split_k: int = 1
    warps: int = NUM_WARPS
    stages: int = NUM_STAGES

    def validate(self) -> None:
        pow2 = lambda v: v > 0 and v & (v - 1) == 0                           # noqa: E731
        if not (pow2(self.block_n) and self.block_n >= 16 and pow2(self.block_k) and self.block_k >= 16):
            raise ValueError(f"Int8Plan: block_n {self.block_n} and block_k {self.block_k} must be powers of two "
                             f">= 16 (tl.dot's smallest tile)")
        if not 1 <= self.split_k <= MAX_SPLIT_K or not pow2(self.warps) or self.warps > 16 or self.stages < 1:
            raise ValueError(f"Int8Plan: split_k {self.split_k} (1..{MAX_SPLIT_K}), warps {self.warps} (a power of "
                             f"two up to 16) or stages {self.stages} (>= 1) out of range")


def plan(m: int, n: int, k: int, sms: int = DEFAULT_SMS) -> Int8Plan:
    """The launch for x [m, k] times q [n, k]^T on a GPU of `sms` SMs, from a first sweep on the H200:

    - block_n 32, or 64 once 64-row blocks alone give PROGRAMS_PER_SM programs per SM (lm_head's 151,936
      rows: 2,374 programs; each finishes more outputs per x tile it loads)
    - block_k PLAN_BLOCK_K
    - split_k doubled while the grid has fewer than PROGRAMS_PER_SM programs per SM and each split keeps
      MIN_STEPS_PER_SPLIT steps (N 5,120, K 2,048: 160 blocks -> split 4; N 2,048, K 4,096: 64 -> split 8)

    m does not enter: the tile is padded to 16 rows whatever m is, and the sweep found the same plans best at
    M 1, 4 and 16.

    Swept (do_bench_cudagraph, bf16 x, triton 3.6; bn/bk/split):
      M1  N5,120   K2,048   first guess 16/256/1  9.7 us   this 32/128/4  6.5 us   best 64/128/8  6.1   torch bf16 6.7
      M4  N2,048   K4,096   first guess 16/256/4  8.6      this 32/128/8  6.0      best 32/128/4  5.7   torch bf16 7.7
      M1  N151,936 K2,048   first guess 32/128/1 91.5      this 64/128/1 81.8 (3.8 TB/s)                torch bf16 151
      M1  N512     K2,048   first guess 16/256/4  4.0      this 32/128/8  3.7      best 32/256/8  3.6   torch bf16 5.2
    """
    target = PROGRAMS_PER_SM * sms
    block_n = 64 if triton.cdiv(n, 64) >= target else 32
    blocks, steps = triton.cdiv(n, block_n), triton.cdiv(k, PLAN_BLOCK_K)
    split = 1
    while split < MAX_SPLIT_K and blocks * split < target and steps // (2 * split) >= MIN_STEPS_PER_SPLIT:
        split *= 2
    return Int8Plan(block_n, PLAN_BLOCK_K, split)


_default_plan = plan            # int8_linear's `plan=` argument hides the name there


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype, any device) -> (q int8 [N, K] contiguous, scale fp32 [N]), symmetric per output
    row: scale = absmax(row) / 127 in fp32 (1.0 for a row of zeros: nothing divides by 0), q = round(w / scale)
    clamped to [-127, 127], so q * scale is within scale / 2 of w. Rows go QUANTIZE_BLOCK_BYTES of fp32 at a
    time: whole, the LM head's fp32 copies alone took 2.5 GB of VRAM beside the model at load."""
    if w.ndim != 2 or not w.dtype.is_floating_point or w.shape[1] == 0:
        raise ValueError(f"quantize_int8: w must be a float [N, K] with K >= 1, got {w.dtype} {tuple(w.shape)}")
    w = w.detach()
    n = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    rows = max(1, QUANTIZE_BLOCK_BYTES // (4 * w.shape[1]))
    for start in range(0, n, rows):
        w32 = w[start:start + rows].float()
        absmax = w32.abs().amax(dim=1)                                       # [rows]
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError("quantize_int8: w holds inf or NaN; a row's scale would be meaningless")
        s = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
        scale[start:start + rows] = s
        q[start:start + rows] = torch.round(w32 / s[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition (and the path for M > MAX_M or without a GPU): x [M, K] @ dequantized q [N, K]^T in fp32,
    times the row scales, plus bias, in x's dtype."""
    y = (x.float() @ q.float().T) * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _interpreted() -> bool:
    """Triton's CPU interpreter multiplies 16-bit tiles in tl.dot as raw integers (seen with bf16, triton 3.9):
    there both tiles go to fp32 first, which is the same arithmetic (bf16 x int8 products are exact in fp32)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _validate(x, q, scale, bias, out) -> None:
    if x.ndim != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"int8_linear: x must be [M, K] bf16/fp16/fp32, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    if m > MAX_M:
        raise ValueError(f"int8_linear: {m} rows; the kernel takes at most {MAX_M} (decode), use "
                         f"int8_linear_reference (the torch path) for more")
    if q.ndim != 2 or q.dtype != torch.int8 or q.shape[1] != k or not q.is_contiguous():
        raise ValueError(f"int8_linear: q must be a contiguous int8 [N, {k}] (quantize_int8), got {q.dtype} "
                         f"{tuple(q.shape)} strides {q.stride()}")
    n = q.shape[0]
    if scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"int8_linear: scale must be fp32 [{n}], got {scale.dtype} {tuple(scale.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.dtype.is_floating_point):
        raise ValueError(f"int8_linear: bias must be a float [{n}] or None, got {bias.dtype} {tuple(bias.shape)}")
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"int8_linear: out must be {x.dtype} [{m}, {n}] with unit column stride, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    tensors = [t for t in (x, q, scale, bias, out) if t is not None]
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"int8_linear: tensors on several devices: {[str(t.device) for t in tensors]}")


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None, plan: Int8Plan | None = None) -> torch.Tensor:
    """`int8_linear_reference` in one launch (two when the plan splits K): x [M, K] (M <= MAX_M; bf16, fp16 or
    fp32; rows may be strided), q int8 [N, K] contiguous, scale fp32 [N], bias [N] or None -> y [M, N] in x's
    dtype, written into `out` when given. `plan` overrides the default `plan(M, N, K)` (sweeps and tests)."""
    if not HAVE_TRITON:
        raise RuntimeError("int8_linear: Triton is not installed; use int8_linear_reference")
    _validate(x, q, scale, bias, out)
    m, k = x.shape
    n = q.shape[0]
    p = plan or _default_plan(m, n, k, sms=_sm_count(x.device))
    p.validate()
    if x.stride(1) != 1:
        x = x.contiguous()                     # rows are read as contiguous runs of K
    scale = scale.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    has_bias = bias is not None
    bias_arg = bias if has_bias else scale       # never read without a bias
    k_chunk = triton.cdiv(triton.cdiv(k, p.block_k), p.split_k) * p.block_k     # a split's K range, whole steps
    part = scale if p.split_k == 1 else torch.empty((p.split_k, m, n), dtype=torch.float32, device=x.device)
    _int8_linear_kernel[(triton.cdiv(n, p.block_n), p.split_k)](
        x, x.stride(0), q, scale, bias_arg, y, y.stride(0), part, m, n, k, k_chunk,
        HAS_BIAS=has_bias, SPLIT_K=p.split_k, BLOCK_M=BLOCK_M, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
        EVEN_K=k % p.block_k == 0, DOT_FP32=x.dtype == torch.float32 or _interpreted(),
        num_warps=p.warps, num_stages=p.stages)
    if p.split_k > 1:
        _int8_reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK_N), m)](
            part, scale, bias_arg, y, y.stride(0), m, n, HAS_BIAS=has_bias, SPLIT_K=p.split_k,
            BLOCK_N=REDUCE_BLOCK_N, num_warps=NUM_WARPS)
    return y
