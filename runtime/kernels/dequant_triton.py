"""Triton kernel: packed expert blocks -> bf16 weight matrices in one pass (the prefill path's dequantization).

Why: prefill runs each expert over thousands of tokens, so the fast way is to dequantize a layer's used
experts once and hand them to a grouped GEMM (torch's `F.grouped_mm`). The torch reference
(`expert_pool.dequantize_blocks`) does it in ~10 ops with fp32 temporaries 8x the packed size; this kernel
reads each packed byte once and writes the bf16 weights once.

Codecs as in FTW (runtime/ftw/codecs.py): int4 `W = q * scale + min` (fp16 scale and min per group) and MXFP4
(e2m1 codes, e8m0 scale per 32). Byte j of a row holds element 2j (low nibble) and 2j + 1 (high nibble).

Shapes: B blocks, O rows of a projection, N its input width (elements), G = N / group.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

BLOCK_BYTES = 256          # packed bytes of one row handled by a program (512 weights)


if HAVE_TRITON:
    @triton.jit
    def _dequant_kernel(pool_ptr, nbytes, slots_ptr, out_ptr, out_stride_b, row0, O, N, q_off, s_off, m_off,
                        CODEC: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        r = tl.program_id(1)
        j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)                    # byte index in the row
        half = N // 2
        mask = j < half
        base = tl.load(slots_ptr + b).to(tl.int64) * nbytes
        q = tl.load(pool_ptr + base + q_off + r.to(tl.int64) * half + j, mask=mask, other=0).to(tl.int32)
        lo = (q & 15).to(tl.float32)
        hi = (q >> 4).to(tl.float32)
        g = (2 * j) // GROUP
        sidx = r.to(tl.int64) * (N // GROUP) + g
        if CODEC == 0:
            s = tl.load((pool_ptr + base + s_off).to(tl.pointer_type(tl.float16)) + sidx, mask=mask, other=0.0)
            m = tl.load((pool_ptr + base + m_off).to(tl.pointer_type(tl.float16)) + sidx, mask=mask, other=0.0)
            s = s.to(tl.float32)
            m = m.to(tl.float32)
            wlo = lo * s + m
            whi = hi * s + m
        else:
            e8 = tl.load(pool_ptr + base + s_off + sidx, mask=mask, other=127).to(tl.float32)
            s = tl.exp2(e8 - 127.0)
            # e2m1 magnitude from the 3 low bits: m/2 for m < 4, then 2, 3, 4, 6; bit 3 the sign
            lm = tl.where(lo >= 8.0, lo - 8.0, lo)
            hm = tl.where(hi >= 8.0, hi - 8.0, hi)
            lv = tl.where(lm < 4.0, lm * 0.5, tl.where(lm < 6.0, lm - 2.0, 2.0 * lm - 8.0))
            hv = tl.where(hm < 4.0, hm * 0.5, tl.where(hm < 6.0, hm - 2.0, 2.0 * hm - 8.0))
            wlo = tl.where(lo >= 8.0, -lv, lv) * s
            whi = tl.where(hi >= 8.0, -hv, hv) * s
        dst = out_ptr + b.to(tl.int64) * out_stride_b + (row0 + r).to(tl.int64) * N + 2 * j
        tl.store(dst, wlo.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + 1, whi.to(out_ptr.dtype.element_ty), mask=mask)


def supports(layout) -> bool:
    """int4, or MXFP4 (e8m0 scales, no global); no biases (those take the torch path)."""
    return HAVE_TRITON and not layout.has_bias and (
        layout.codec == "int4" or (layout.codec == "fp4" and layout.scale_format == "e8m0"
                                   and "gate_global" not in layout.parts))


def dequantize_experts(pool: torch.Tensor, layout, slots: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks at `slots` [B] of `pool` [S, nbytes] -> gate_up [B, 2I, D] (gate rows, then up) and
    down [B, D, I], in `dtype`: the layout `F.grouped_mm` takes (transposed views)."""
    d, i = layout.hidden, layout.intermediate
    b = int(slots.numel())
    gate_up = torch.empty((b, 2 * i, d), dtype=dtype, device=pool.device)
    down = torch.empty((b, d, i), dtype=dtype, device=pool.device)
    if b == 0:
        return gate_up, down
    p = layout.parts
    off = lambda name: p[name].offset if name in p else 0                      # noqa: E731
    codec = 0 if layout.codec == "int4" else 1
    slots = slots.to(device=pool.device, dtype=torch.int64).contiguous()
    for out, row0, rows, width, proj in ((gate_up, 0, i, d, "gate"), (gate_up, i, i, d, "up"),
                                         (down, 0, d, i, "down")):
        grid = (b, rows, triton.cdiv(width // 2, BLOCK_BYTES))
        _dequant_kernel[grid](pool, layout.nbytes, slots, out, out.stride(0), row0, rows, width, off(proj),
                              off(f"{proj}_scales"), off(f"{proj}_mins"), CODEC=codec, GROUP=layout.group,
                              BLOCK=BLOCK_BYTES)
    return gate_up, down
