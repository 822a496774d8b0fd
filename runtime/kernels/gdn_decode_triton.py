"""Triton kernels for a Gated DeltaNet layer's decode step (one token per sequence), states updated in place.

Why: the torch form of a decode step (runtime/models/gated_deltanet.py) is ~40 small kernels between the input
and output projections - the conv's concatenation, four multiply-adds, SiLU and casts; the gates' casts, exp and
softplus; the heads' expansion and copies; the recurrent kernel; the gated RMSNorm's eight elementwise steps; and,
in a recorded step, the copies of the new states back into their slots. In a CUDA graph each still costs ~2.5 µs,
so a qwen3.6 decode step spent ~4 ms of its 6.6 ms dense time in the 30 linear-attention layers (session 5, H200).
Here they are two launches:

- `_conv_kernel` (grid: sequences x channel blocks): the depthwise causal conv over the state's W-1 inputs and the
  new one in fp32, SiLU, rounded to the activation dtype as the torch form rounds it (the W products are summed
  as a tree, not left to right: fp32 rounding differs); the state shifted in place (each channel belongs to one
  program, whose loads all happen before its stores).
- `_recurrent_kernel` (grid: sequences x value heads): q and k L2-normalised (q scaled by dk^-1/2), the gates
  (beta = sigmoid(b) rounded to the activation dtype; g = -exp(A_log) softplus(a + dt_bias) in fp32), the delta
  rule on the head's [dk, dv] fp32 state in place (S <- exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q), then
  the gated RMSNorm w * rmsnorm(o) * silu(z), rounded where the torch form rounds.

States live where the caller keeps them: row `slots[b]` of conv [S, C, W-1] and recurrent [S, Hv, dk, dv] (a
layer's view of the state pool, so several sequences need no gather and no scatter), or row b without slots.
The torch form stays the reference and the path on CPUs; tests/kernel_checks.py compares them (interpreted on
CI, compiled with `--device cuda`).

Shapes: B sequences, C = 2 Hk dk + Hv dv conv channels ([q | k | v]), W conv width, Hk / Hv key / value heads,
r = Hv / Hk, dk / dv head dims.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

CONV_BLOCK = 1024          # channels per conv program: C = 8,192 for qwen3.6 -> 8 programs a sequence


def available(x: torch.Tensor) -> bool:
    """The fused decode step runs for CUDA activations when Triton is importable."""
    return HAVE_TRITON and x.is_cuda


if HAVE_TRITON:
    @triton.jit
    def _conv_kernel(mixed_ptr, mixed_st, conv_ptr, conv_ss, conv_sc, slots_ptr, w_ptr, y_ptr, C,
                     W: tl.constexpr, WB: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        ch = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, WB)                                                # the state's W-1 inputs, padded
        m = ch < C
        slot = tl.load(slots_ptr + b).to(tl.int64) if HAS_SLOTS else b
        state = conv_ptr + slot * conv_ss + ch.to(tl.int64)[:, None] * conv_sc + cols[None, :]   # [BLOCK, WB]
        sm = m[:, None] & (cols[None, :] < W - 1)
        old = tl.load(state, mask=sm, other=0.0)                               # every load before any store
        x = tl.load(mixed_ptr + b * mixed_st + ch, mask=m, other=0.0)
        w_old = tl.load(w_ptr + ch[:, None] * W + cols[None, :], mask=sm, other=0.0).to(tl.float32)
        acc = tl.sum(old.to(tl.float32) * w_old, axis=1) + \
            x.to(tl.float32) * tl.load(w_ptr + ch * W + (W - 1), mask=m, other=0.0).to(tl.float32)
        y = acc / (1.0 + tl.exp(-acc))                                        # SiLU, fp32, then the dtype
        tl.store(y_ptr + b * C + ch, y.to(y_ptr.dtype.element_ty), mask=m)
        tl.debug_barrier()
        # the state moves one input along (each channel is this program's alone): old[1:] then x
        tl.store(state - 1, old, mask=sm & (cols[None, :] >= 1))
        tl.store(conv_ptr + slot * conv_ss + ch.to(tl.int64) * conv_sc + (W - 2), x.to(conv_ptr.dtype.element_ty),
                 mask=m)

    @triton.jit
    def _recurrent_kernel(y_ptr, C, key_dim, z_ptr, z_st, b_ptr, b_st, a_ptr, a_st, rec_ptr, rec_ss, slots_ptr,
                          alog_ptr, dtb_ptr, nw_ptr, out_ptr, out_st, Hv, scale, eps, qk_eps,
                          R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, HAS_SLOTS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        hk = h // R
        slot = tl.load(slots_ptr + b).to(tl.int64) if HAS_SLOTS else b
        kk = tl.arange(0, BK)
        vv = tl.arange(0, BV)
        mk, mv = kk < DK, vv < DV
        row = y_ptr + b * C
        q = tl.load(row + hk * DK + kk, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(row + key_dim + hk * DK + kk, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * key_dim + h * DV + vv, mask=mv, other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + qk_eps)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + qk_eps))
        # gates: beta = sigmoid(b) in the activation dtype (torch rounds it there); the log decay in fp32
        bb = tl.load(b_ptr + b * b_st + h).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-bb))).to(b_ptr.dtype.element_ty).to(tl.float32)
        sp = tl.load(a_ptr + b * a_st + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
        sp = tl.where(sp > 20.0, sp, tl.log(1.0 + tl.exp(tl.minimum(sp, 20.0))))        # softplus, torch's threshold
        decay = tl.exp(-tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * sp)
        # the head's state [dk, dv], in place
        s_ptrs = rec_ptr + slot * rec_ss + h.to(tl.int64) * (DK * DV) + kk[:, None] * DV + vv[None, :]
        smask = mk[:, None] & mv[None, :]
        s = tl.load(s_ptrs, mask=smask, other=0.0) * decay
        written = (v - tl.sum(k[:, None] * s, axis=0)) * beta                  # [dv]
        s = s + k[:, None] * written[None, :]
        tl.store(s_ptrs, s, mask=smask)
        o = tl.sum(q[:, None] * s, axis=0)                                      # [dv] fp32
        # gated RMSNorm as the torch form rounds it: o to the dtype; normed to the dtype; w * normed in the dtype;
        # times silu(z) in fp32; to the dtype
        odt = out_ptr.dtype.element_ty
        o = o.to(odt).to(tl.float32)
        normed = (o * (1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps))).to(odt).to(tl.float32)
        wn = (tl.load(nw_ptr + vv, mask=mv, other=0.0).to(tl.float32) * normed).to(odt).to(tl.float32)
        z = tl.load(z_ptr + b * z_st + h * DV + vv, mask=mv, other=0.0).to(tl.float32)
        tl.store(out_ptr + b * out_st + h * DV + vv, (wn * (z / (1.0 + tl.exp(-z)))).to(odt), mask=mv)


def gdn_decode(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_state: torch.Tensor,
               recurrent_state: torch.Tensor, *, conv_weight: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor, norm_weight: torch.Tensor, num_k_heads: int, head_k_dim: int,
               head_v_dim: int, eps: float, qk_eps: float, slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of B sequences: mixed [B, C] (the input projection, before the conv), z [B, Hv, dv] or
    [B, Hv dv], b and a [B, Hv] -> the gated-normed output [B, Hv dv] (before out_proj), in mixed's dtype;
    eps is the gated norm's, qk_eps the q/k L2 normalisation's.
    conv_state [S, C, W-1] (unit inner stride) and recurrent_state [S, Hv, dk, dv] (fp32, each slot contiguous)
    are updated in place at rows `slots` [B] (int64 on the device), or rows 0..B-1 without. Two launches."""
    B, C = mixed.shape
    Hv = b.shape[-1]
    W = conv_state.shape[-1] + 1
    dk, dv = head_k_dim, head_v_dim
    if conv_state.stride(-1) != 1 or recurrent_state.dtype != torch.float32 or \
            recurrent_state[0].stride() != (dk * dv, dv, 1) or recurrent_state.shape[1:] != (Hv, dk, dv):
        raise ValueError("gdn_decode: conv state needs a unit inner stride, recurrent state fp32 slots "
                         f"[Hv, dk, dv] contiguous; got {tuple(conv_state.stride())}, "
                         f"{recurrent_state.dtype} {tuple(recurrent_state.shape)} {tuple(recurrent_state.stride())}")
    mixed = mixed if mixed.stride(-1) == 1 else mixed.contiguous()
    z = z.reshape(B, Hv * dv)
    z = z if z.stride(-1) == 1 else z.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    has_slots = slots is not None
    slot_arg = slots if has_slots else mixed          # never read without slots
    y = torch.empty(B, C, device=mixed.device, dtype=mixed.dtype)
    _conv_kernel[(B, triton.cdiv(C, CONV_BLOCK))](
        mixed, mixed.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1), slot_arg,
        conv_weight.reshape(C, W), y, C, W=W, WB=triton.next_power_of_2(W - 1), HAS_SLOTS=has_slots,
        BLOCK=CONV_BLOCK, num_warps=4)
    out = torch.empty(B, Hv * dv, device=mixed.device, dtype=mixed.dtype)
    bk, bv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    _recurrent_kernel[(B, Hv)](
        y, C, num_k_heads * dk, z, z.stride(0), b, b.stride(0), a, a.stride(0), recurrent_state,
        recurrent_state.stride(0), slot_arg, A_log, dt_bias, norm_weight, out, out.stride(0), Hv, dk ** -0.5, eps,
        qk_eps,
        R=Hv // num_k_heads, DK=dk, DV=dv, BK=bk, BV=bv, HAS_SLOTS=has_slots, num_warps=8 if bk * bv >= 8192 else 4)
    return out
