"""Triton kernels: decode-time expert compute straight from the packed int4 / fp4 slot pool.

The plain-torch reference is `runtime/kernels/expert_pool.py::pool_forward` (it gathers blocks, dequantizes
them whole and runs batched matmuls: ~40 launches and 3x the weight bytes in temporaries). These kernels
read each packed byte once, dequantize in registers and fuse gate, up and the activation:

  gate_up kernel, grid (A, I / BLOCK_N):  h[a, n] = act(sum_k Wg[s_a, n, k] x[t_a, k], sum_k Wu[s_a, n, k] x[t_a, k])
  down kernel,    grid (A, D / BLOCK_N):  y[a, n] = sum_k Wd[s_a, n, k] h[a, k]

where s_a is the assignment's slot (-1: computed elsewhere, skipped). Block layout and codecs as in FTW:
int4 `W = q * scale + min` (fp16 per group), fp4 e2m1 with e8m0 scales per 32 (MXFP4). Weights are read
as bytes: byte j of a row holds element 2j (low nibble) and 2j + 1 (high nibble).

Shapes: T tokens, K per token, A = T*K assignments, D hidden, I expert width, G groups per row.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


if HAVE_TRITON:
    @triton.jit
    def _dot_rows(pool_ptr, base, q_off, s_off, m_off, rows, n_rows, n_in, x_ptr, CODEC: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc[BLOCK_N] = sum_k W[rows, k] x[k] over one packed matrix of a block at byte `base`."""
        half = n_in // 2
        n_groups = tl.cdiv(n_in, GROUP)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        rmask = rows < n_rows
        for k0 in range(0, half, BLOCK_K):
            kb = k0 + tl.arange(0, BLOCK_K)                                   # byte index in the row
            kmask = kb < half
            mask = rmask[:, None] & kmask[None, :]
            q = tl.load(pool_ptr + base + q_off + rows[:, None].to(tl.int64) * half + kb[None, :], mask=mask,
                        other=0).to(tl.int32)
            lo = (q & 15).to(tl.float32)
            hi = (q >> 4).to(tl.float32)
            xe = tl.load(x_ptr + 2 * kb, mask=kmask, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + 2 * kb + 1, mask=kmask, other=0.0).to(tl.float32)
            g = (2 * kb) // GROUP                                              # group of both nibbles
            sidx = rows[:, None] * n_groups + g[None, :]
            if CODEC == 0:
                sp = (pool_ptr + base + s_off).to(tl.pointer_type(tl.float16))
                mp = (pool_ptr + base + m_off).to(tl.pointer_type(tl.float16))
                s = tl.load(sp + sidx, mask=mask, other=0.0).to(tl.float32)
                m = tl.load(mp + sidx, mask=mask, other=0.0).to(tl.float32)
                acc += tl.sum((lo * s + m) * xe[None, :] + (hi * s + m) * xo[None, :], axis=1)
            else:
                e8 = tl.load(pool_ptr + base + s_off + sidx, mask=mask, other=127).to(tl.float32)
                s = tl.exp2(e8 - 127.0)
                # e2m1 from the code: magnitude m/2 + relu(m-4)/2 + relu(m-6), bit 3 the sign
                lm = tl.where(lo >= 8.0, lo - 8.0, lo)
                hm = tl.where(hi >= 8.0, hi - 8.0, hi)
                lv = 0.5 * lm + 0.5 * tl.maximum(lm - 4.0, 0.0) + tl.maximum(lm - 6.0, 0.0)
                hv = 0.5 * hm + 0.5 * tl.maximum(hm - 4.0, 0.0) + tl.maximum(hm - 6.0, 0.0)
                lv = tl.where(lo >= 8.0, -lv, lv)
                hv = tl.where(hi >= 8.0, -hv, hv)
                acc += tl.sum(s * (lv * xe[None, :] + hv * xo[None, :]), axis=1)
        return acc

    @triton.jit
    def _gate_up_kernel(pool_ptr, nbytes, slots_ptr, tok_ptr, x_ptr, h_ptr, D, I,
                        gq, gs, gm, uq, us, um, alpha, limit,
                        CODEC: tl.constexpr, GROUP: tl.constexpr, ACT: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        a = tl.program_id(0)
        slot = tl.load(slots_ptr + a)
        if slot < 0:
            return
        t = tl.load(tok_ptr + a)
        base = slot.to(tl.int64) * nbytes
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        xp = x_ptr + t.to(tl.int64) * D
        g = _dot_rows(pool_ptr, base, gq, gs, gm, rows, I, D, xp, CODEC, GROUP, BLOCK_N, BLOCK_K)
        u = _dot_rows(pool_ptr, base, uq, us, um, rows, I, D, xp, CODEC, GROUP, BLOCK_N, BLOCK_K)
        if ACT == 0:
            h = g / (1.0 + tl.exp(-g)) * u
        else:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        tl.store(h_ptr + a.to(tl.int64) * I + rows, h, mask=rows < I)

    @triton.jit
    def _down_kernel(pool_ptr, nbytes, slots_ptr, h_ptr, y_ptr, D, I, dq, ds, dm,
                     CODEC: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        a = tl.program_id(0)
        slot = tl.load(slots_ptr + a)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        if slot < 0:
            tl.store(y_ptr + a.to(tl.int64) * D + rows, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=rows < D)
            return
        base = slot.to(tl.int64) * nbytes
        y = _dot_rows(pool_ptr, base, dq, ds, dm, rows, D, I, h_ptr + a.to(tl.int64) * I, CODEC, GROUP,
                      BLOCK_N, BLOCK_K)
        tl.store(y_ptr + a.to(tl.int64) * D + rows, y, mask=rows < D)


def supports(layout, spec) -> bool:
    """Whether these kernels cover a pool: int4, or MXFP4 (e8m0 per 32); no biases (gpt-oss takes torch)."""
    return HAVE_TRITON and not layout.has_bias and (
        layout.codec == "int4" or (layout.codec == "fp4" and layout.scale_format == "e8m0"
                                   and f"gate_global" not in layout.parts))


def pool_forward_triton(pool: torch.Tensor, layout, spec, x: torch.Tensor, slots: torch.Tensor,
                        weights: torch.Tensor, *, block_n: int = 32, block_k: int = 64) -> torch.Tensor:
    """The same function as `expert_pool.pool_forward`: x [T, D], slots [T, K] (-1 skip), weights [T, K]."""
    t, k = slots.shape
    d, i = layout.hidden, layout.intermediate
    a = t * k
    flat = slots.reshape(-1).contiguous()
    tok = torch.arange(t, device=x.device).repeat_interleave(k)
    xc = x.contiguous()
    h = torch.empty((a, i), dtype=torch.float32, device=x.device)
    y = torch.empty((a, d), dtype=torch.float32, device=x.device)
    p = layout.parts
    off = lambda name: p[name].offset if name in p else 0                      # noqa: E731
    codec = 0 if layout.codec == "int4" else 1
    act = 0 if spec.activation == "silu" else 1
    _gate_up_kernel[(a, triton.cdiv(i, block_n))](
        pool, layout.nbytes, flat, tok, xc, h, d, i, off("gate"), off("gate_scales"), off("gate_mins"), off("up"),
        off("up_scales"), off("up_mins"), float(spec.swiglu_alpha), float(spec.swiglu_limit),
        CODEC=codec, GROUP=layout.group, ACT=act, BLOCK_N=block_n, BLOCK_K=block_k)
    _down_kernel[(a, triton.cdiv(d, block_n))](
        pool, layout.nbytes, flat, h, y, d, i, off("down"), off("down_scales"), off("down_mins"),
        CODEC=codec, GROUP=layout.group, BLOCK_N=block_n, BLOCK_K=block_k)
    w = torch.where(flat >= 0, weights.reshape(-1).float(), torch.zeros((), device=x.device))
    return (y * w[:, None]).view(t, k, d).sum(dim=1).to(x.dtype)
