"""Triton kernels: RMSNorm in one launch, and an attention head's q/k norm + rotary embedding in one launch.

Why: the torch versions are chains of elementwise kernels (RMSNorm: cast, square, mean, add, rsqrt, multiply,
cast, multiply = 8 launches; rotary: 7 per tensor). A decode step does that ~4 times per layer, so at batch 1
they were ~45 of a layer's ~75 kernels, and inside a CUDA graph a tiny kernel still costs ~2 µs.

Both kernels reproduce the torch path's rounding, not just its math: where torch rounds an intermediate to
the activation dtype (the normalised x before the weight in the "llama" flavour; each product and sum of the
rotary in bf16), the kernel rounds the same value the same way, so results match torch to the last bit except
for the order of the fp32 sum of squares. The torch code in runtime/models/blocks.py stays the reference
(and the path on CPUs); tests compare both (tests/test_kernels_norm_rope.py, interpreted on the CPU and
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
    def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, HD, RD2, x_stride, eps,
                          NORM: tl.constexpr, FLAVOUR: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_REST: tl.constexpr):
        """One (token, head) row: optional RMSNorm over hd, then rotate the first 2*RD2 dims (NeoX halves).
        x rows may be strided (q and k are views of one fused projection's output); out is contiguous."""
        pid = tl.program_id(0).to(tl.int64)
        n = pid // H
        dt = out_ptr.dtype.element_ty
        src = n * x_stride + (pid % H) * HD
        base = pid * HD
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
        tl.store(out_ptr + base + r, ra.to(dt), mask=rmask)
        tl.store(out_ptr + base + RD2 + r, rb.to(dt), mask=rmask)
        tl.store(out_ptr + base + rest, c.to(dt), mask=restmask)


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
                                    BLOCK_REST=triton.next_power_of_2(max(hd - rd, 1)))
    return out
