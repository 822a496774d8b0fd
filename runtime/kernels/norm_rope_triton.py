"""Triton kernels: RMSNorm in one launch, and an attention head's q/k norm + rotary embedding in one launch.

A third kernel, `norm_rope_store`, is k's norm+rotary written straight into the KV cache at a row read on
the device, with v copied alongside (the static decode path of runtime/models/blocks.py: one launch where
there were three, and no temporary).

Why: the torch versions are chains of elementwise kernels (RMSNorm: cast, square, mean, add, rsqrt, multiply,
cast, multiply = 8 launches; rotary: 7 per tensor). A decode step does that ~4 times per layer, so at batch 1
they were ~45 of a layer's ~75 kernels, and inside a CUDA graph a tiny kernel still costs ~2 µs.

Both kernels reproduce the torch path's rounding, not just its math: where torch rounds an intermediate to
the activation dtype (the normalised x before the weight in the "llama" flavour; each product and sum of the
rotary in bf16), the kernel rounds the same value the same way, so results match torch to the last bit except
for the order of the fp32 sum of squares. The torch code in runtime/models/blocks.py stays the reference
(and the path on CPUs); tests compare both (tests/kernel_checks.py via tests/test_kernels_fused.py, interpreted on the CPU and
compiled with `--device cuda`).

Shapes: R rows, D features; N tokens, H heads, hd head dim, rd rotary dims (rd2 = rd / 2).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

FLAVOURS = {"llama": 0, "fp32": 1, "offset": 2}


if HAVE_TRITON:
    @triton.jit
    def _normed(x, w, rstd, FLAVOUR: tl.constexpr, OUT_DTYPE: tl.constexpr):
        """x (fp32) normalised and weighted the way the flavour rounds it, returned in fp32."""
        xhat = x * rstd
        if FLAVOUR == 0:        # llama: w * xhat.to(dtype)  (the product rounds to dtype)
            return (xhat.to(OUT_DTYPE).to(tl.float32) * w).to(OUT_DTYPE).to(tl.float32)
        elif FLAVOUR == 1:      # fp32: (w * xhat).to(dtype)
            return (w * xhat).to(OUT_DTYPE).to(tl.float32)
        else:                   # offset: (xhat * (1 + w)).to(dtype)
            return (xhat * (1.0 + w)).to(OUT_DTYPE).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, FLAVOUR: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        y = _normed(x, w, rstd, FLAVOUR, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, D, eps, FLAVOUR: tl.constexpr,
                             BLOCK: tl.constexpr):
        """sum = x + r (rounded to the dtype, as torch's add), out = RMSNorm(sum): one read of each, two writes."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        dt = sum_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(dt)
        tl.store(sum_ptr + row * D + cols, s, mask=mask)
        s = s.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / D + eps)
        tl.store(out_ptr + row * D + cols, _normed(s, w, rstd, FLAVOUR, dt).to(dt), mask=mask)

    @triton.jit
    def _round(v, DT: tl.constexpr):
        return v.to(DT).to(tl.float32)

    @triton.jit
    def _norm_rope_row(x_ptr, src, w_ptr, cos_ptr, sin_ptr, n, HD, RD2, eps, dt: tl.constexpr,
                       NORM: tl.constexpr, FLAVOUR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_REST: tl.constexpr):
        """One head's row at x_ptr + src, of token n: optional RMSNorm over hd, then the first 2*RD2 dims rotated
        (NeoX halves). -> (first half, second half, the rest), each fp32 holding values rounded to dt."""
        r = tl.arange(0, BLOCK_R)
        rmask = r < RD2
        rest = 2 * RD2 + tl.arange(0, BLOCK_REST)
        restmask = rest < HD
        a = tl.load(x_ptr + src + r, mask=rmask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + src + RD2 + r, mask=rmask, other=0.0).to(tl.float32)
        c = tl.load(x_ptr + src + rest, mask=restmask, other=0.0).to(tl.float32)
        if NORM:
            rstd = 1.0 / tl.sqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0) + tl.sum(c * c, axis=0)) / HD + eps)
            a = _normed(a, tl.load(w_ptr + r, mask=rmask, other=0.0).to(tl.float32), rstd, FLAVOUR, dt)
            b = _normed(b, tl.load(w_ptr + RD2 + r, mask=rmask, other=0.0).to(tl.float32), rstd, FLAVOUR, dt)
            c = _normed(c, tl.load(w_ptr + rest, mask=restmask, other=0.0).to(tl.float32), rstd, FLAVOUR, dt)
        cos = tl.load(cos_ptr + n * RD2 + r, mask=rmask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + n * RD2 + r, mask=rmask, other=0.0).to(tl.float32)
        # torch: cat(first * cos - second * sin, second * cos + first * sin), each op rounded to the dtype
        ra = _round(_round(a * cos, dt) - _round(b * sin, dt), dt)
        rb = _round(_round(b * cos, dt) + _round(a * sin, dt), dt)
        return ra, rb, c

    @triton.jit
    def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, HD, RD2, x_stride, eps,
                          NORM: tl.constexpr, FLAVOUR: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_REST: tl.constexpr):
        """One (token, head) row: optional RMSNorm over hd, then rotate the first 2*RD2 dims (NeoX halves).
        x rows may be strided (q and k are views of one fused projection's output); out is contiguous."""
        pid = tl.program_id(0).to(tl.int64)
        n = pid // H
        dt = out_ptr.dtype.element_ty
        ra, rb, c = _norm_rope_row(x_ptr, n * x_stride + (pid % H) * HD, w_ptr, cos_ptr, sin_ptr, n, HD, RD2, eps,
                                   dt, NORM, FLAVOUR, BLOCK_R, BLOCK_REST)
        base = pid * HD
        r = tl.arange(0, BLOCK_R)
        rest = 2 * RD2 + tl.arange(0, BLOCK_REST)
        tl.store(out_ptr + base + r, ra.to(dt), mask=r < RD2)
        tl.store(out_ptr + base + RD2 + r, rb.to(dt), mask=r < RD2)
        tl.store(out_ptr + base + rest, c.to(dt), mask=rest < HD)

    @triton.jit
    def _norm_rope_store_kernel(k_ptr, v_ptr, w_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, rows_ptr, H, HD, RD2,
                                k_stride, v_stride, kv_head_stride, kv_row_stride, eps, NORM: tl.constexpr,
                                FLAVOUR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_REST: tl.constexpr,
                                BLOCK_HD: tl.constexpr):
        """One (token, kv head): k's row normed and rotated straight into the key cache at the token's row
        (rows_ptr[n], read on the device), and v's row copied into the value cache at the same row."""
        pid = tl.program_id(0).to(tl.int64)
        n = pid // H
        head = pid % H
        dt = keys_ptr.dtype.element_ty
        ra, rb, c = _norm_rope_row(k_ptr, n * k_stride + head * HD, w_ptr, cos_ptr, sin_ptr, n, HD, RD2, eps, dt,
                                   NORM, FLAVOUR, BLOCK_R, BLOCK_REST)
        dst = head * kv_head_stride + tl.load(rows_ptr + n).to(tl.int64) * kv_row_stride      # [Hkv, S, hd] buffers
        r = tl.arange(0, BLOCK_R)
        rest = 2 * RD2 + tl.arange(0, BLOCK_REST)
        tl.store(keys_ptr + dst + r, ra.to(dt), mask=r < RD2)
        tl.store(keys_ptr + dst + RD2 + r, rb.to(dt), mask=r < RD2)
        tl.store(keys_ptr + dst + rest, c.to(dt), mask=rest < HD)
        cols = tl.arange(0, BLOCK_HD)
        v = tl.load(v_ptr + n * v_stride + head * HD + cols, mask=cols < HD, other=0.0)
        tl.store(values_ptr + dst + cols, v.to(dt), mask=cols < HD)


def _warps_for_head(hd: int) -> int:
    """One warp for a head's row up to 256 elements: its sums reduce by shuffles alone, where 4 warps add a
    shared-memory round trip and barriers (static SASS: 3-5 BAR per program) to a latency-bound launch."""
    return 1 if hd <= 256 else 4


def available(x: torch.Tensor) -> bool:
    """Whether these kernels run for this tensor (a CUDA tensor and Triton installed)."""
    return HAVE_TRITON and x.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, flavour: str = "llama") -> torch.Tensor:
    """blocks.RMSNorm's forward in one launch: x [..., D] -> same shape and dtype."""
    d = x.shape[-1]
    rows = x.reshape(-1, d).contiguous()                       # [R, D]
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, d, float(eps), FLAVOUR=FLAVOURS[flavour],
                                           BLOCK=triton.next_power_of_2(d))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, *, eps: float, flavour: str = "llama"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, RMSNorm(x + r)) in one launch: the residual add fused with the norm that follows it."""
    d = x.shape[-1]
    xs, rs = x.reshape(-1, d).contiguous(), r.reshape(-1, d).contiguous()    # [R, D]
    total, out = torch.empty_like(xs), torch.empty_like(xs)
    if xs.shape[0]:
        _add_rms_norm_kernel[(xs.shape[0],)](xs, rs, weight, total, out, d, float(eps), FLAVOUR=FLAVOURS[flavour],
                                             BLOCK=triton.next_power_of_2(d))
    return total.view(x.shape), out.view(x.shape)


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, weight: torch.Tensor | None = None,
              eps: float = 1e-6, flavour: str = "llama", rotary_dim: int | None = None) -> torch.Tensor:
    """RMSNorm over each head (when `weight` is given), then the rotary embedding, in one launch.

    x [N, H, hd]; cos, sin [N, 1, rd/2] (already scaled by the attention factor, as Rotary.cos_sin gives them)."""
    n, h, hd = x.shape
    rd = hd if rotary_dim is None else rotary_dim
    xc = x if x.stride(2) == 1 and x.stride(1) == hd else x.contiguous()     # rows may be strided, heads not
    out = torch.empty((n, h, hd), dtype=x.dtype, device=x.device)
    if n:
        rd2 = rd // 2
        _norm_rope_kernel[(n * h,)](xc, weight if weight is not None else xc, cos.contiguous(), sin.contiguous(), out,
                                    h, hd, rd2, xc.stride(0), float(eps), NORM=weight is not None,
                                    FLAVOUR=FLAVOURS[flavour],
                                    BLOCK_R=triton.next_power_of_2(max(rd2, 1)),
                                    BLOCK_REST=triton.next_power_of_2(max(hd - rd, 1)), num_warps=_warps_for_head(hd))
    return out


def norm_rope_store(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, rows: torch.Tensor, *, weight: torch.Tensor | None = None, eps: float = 1e-6,
                    flavour: str = "llama", rotary_dim: int | None = None) -> None:
    """`norm_rope(k)` written straight into the key cache, and v into the value cache, in ONE launch.

    k, v [N, Hkv, hd] (rows may be strided: views of the fused projection's output); keys, values [Hkv, S, hd]
    (the cache's buffers, rows strided); rows [N] int: each token's row in them, read on the device (so a CUDA
    graph replays it at any position). Replaces norm_rope + two index_copy_ launches and the rotated k's
    temporary on the static decode path."""
    n, h, hd = k.shape
    if v.shape != k.shape or keys.shape[0] != h or keys.shape[2] != hd or values.shape != keys.shape:
        raise ValueError(f"norm_rope_store: k {tuple(k.shape)}, v {tuple(v.shape)}, keys {tuple(keys.shape)} and "
                         f"values {tuple(values.shape)} do not agree with [N, Hkv, hd] and [Hkv, S, hd]")
    if keys.stride() != values.stride() or keys.stride(2) != 1 or keys.dtype != values.dtype:
        raise ValueError(f"norm_rope_store: keys {keys.dtype} strides {keys.stride()} and values {values.dtype} "
                         f"strides {values.stride()} must share one dtype and layout with contiguous rows")
    if rows.shape != (n,):
        raise ValueError(f"norm_rope_store: rows {tuple(rows.shape)} must hold one row per token ({n})")
    rd = hd if rotary_dim is None else rotary_dim
    kc = k if k.stride(2) == 1 and k.stride(1) == hd else k.contiguous()     # rows may be strided, heads not
    vc = v if v.stride(2) == 1 and v.stride(1) == hd else v.contiguous()
    if n:
        rd2 = rd // 2
        _norm_rope_store_kernel[(n * h,)](
            kc, vc, weight if weight is not None else kc, cos.contiguous(), sin.contiguous(), keys, values, rows,
            h, hd, rd2, kc.stride(0), vc.stride(0), keys.stride(0), keys.stride(1), float(eps),
            NORM=weight is not None, FLAVOUR=FLAVOURS[flavour], BLOCK_R=triton.next_power_of_2(max(rd2, 1)),
            BLOCK_REST=triton.next_power_of_2(max(hd - rd, 1)), BLOCK_HD=triton.next_power_of_2(hd),
            num_warps=_warps_for_head(hd))
