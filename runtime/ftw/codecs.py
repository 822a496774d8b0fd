"""Expert codecs: how one weight matrix is packed into bytes, and the reference dequantization.

Shapes: O output features (rows), N input features (columns), G groups/blocks per row.
Every codec packs a matrix W [O, N] (nn.Linear orientation) into named parts:

- `f32`, `bf16`: the matrix itself.
- `int4`: asymmetric group-wise, `W ≈ q · scale + min` with q in 0..15 per element, one fp16
  scale and one fp16 min per group of `group_size` consecutive elements of a row (the last group
  of a row may be short). Nibbles: byte j of a row holds element 2j in its low nibble, 2j+1 high.
  Error bound (tested): |W − Ŵ| ≤ scale_g / 2 for every element (plus fp32 rounding), where
  scale_g ≤ (max_g − min_g + 2⁻¹⁰·|min_g|) / 15 · (1 + 2⁻¹⁰): min is rounded down and the step up
  to fp16, so the step is the group's range / 15 widened only by fp16 rounding.
- `fp4`: e2m1 nibbles (same nibble order) with per-block scales kept exactly as the source
  stored them: e8m0 per 32 (MXFP4) or e4m3 per 16 plus one fp32 per-matrix scale (NVFP4).
  Dequantization is the published formula, evaluated in fp32 left to right, so it is
  bit-identical to the reference.
"""
from __future__ import annotations

import numpy as np
import torch

from runtime.ftw.errors import FTWError

CODECS = ("f32", "bf16", "int4", "fp4")
INT4_GROUP_SIZES = (32, 64, 128)
FP16_MAX = 65504.0

# e2m1 code -> value; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_lut(device=None) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N/2] -> int64 codes [..., N]; low nibble is the even element."""
    p = packed.to(torch.int64)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes 0..15 [..., N] (N even) -> uint8 [..., N/2]; element 2j low nibble, 2j+1 high."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


# ---------------------------------------------------------------- int4

def int4_num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def _round_fp16(x: np.ndarray, direction: float) -> np.ndarray:
    """Nearest fp16 to x, nudged one ulp towards `direction` (±inf) where rounding went the other way."""
    h = x.astype(np.float16)
    wrong = (h.astype(np.float32) > x) if direction < 0 else (h.astype(np.float32) < x)
    return np.where(wrong, np.nextafter(h, np.float16(direction)), h)


def int4_quantize(w: torch.Tensor, group_size: int, *, name: str = "") -> dict[str, torch.Tensor]:
    """W [O, N] float -> {q: uint8 [O, N/2], scales: fp16 [O, G], mins: fp16 [O, G]} (fresh tensors)."""
    out_f, in_f = w.shape
    groups = int4_num_groups(in_f, group_size)
    q = torch.empty(out_f, in_f // 2, dtype=torch.uint8)
    scales = torch.empty(out_f, groups, dtype=torch.float16)
    mins = torch.empty(out_f, groups, dtype=torch.float16)
    int4_quantize_into(w, group_size, q=q, scales=scales, mins=mins, name=name)
    return {"q": q, "scales": scales, "mins": mins}


def _work(scratch, key: str, shape, dtype: torch.dtype) -> torch.Tensor:
    n = dtype.itemsize
    for s in shape:
        n *= s
    if scratch is None:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(scratch.get(key, n)).view(dtype).reshape(shape)


def int4_quantize_into(w: torch.Tensor, group_size: int, *, q: torch.Tensor, scales: torch.Tensor,
                       mins: torch.Tensor, scratch=None, name: str = "") -> None:
    """Quantize W [O, N] into the given outputs (views into an expert block, say).

    min is rounded down and the step up in fp16, so every group's range [min, min + 15·step] covers
    its values and each element lands within half a step of its code. The work happens in place in
    one fp32 buffer (from `scratch`, reused between calls: fresh memory costs page faults).
    """
    if group_size not in INT4_GROUP_SIZES:
        raise FTWError(f"int4 group size must be one of {INT4_GROUP_SIZES}, not {group_size}")
    out_f, in_f = w.shape
    if in_f % 2:
        raise FTWError(f"{name}: int4 needs an even number of input features, the tensor has {in_f}")
    groups = int4_num_groups(in_f, group_size)
    wf = _work(scratch, "int4.f32", (out_f, groups * group_size), torch.float32)
    wf[:, :in_f].copy_(w)
    if groups * group_size > in_f:
        # Pad a short last group with copies of its last element: it changes neither min nor max.
        wf[:, in_f:].copy_(wf[:, in_f - 1:in_f].expand(out_f, groups * group_size - in_f))
    wg = wf.view(out_f, groups, group_size)                            # [O, G, gs]
    lo_t, hi_t = torch.aminmax(wg, dim=2)
    lo, hi = lo_t.numpy(), hi_t.numpy()
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()) or max(-lo.min(), hi.max()) > FP16_MAX / 2:
        raise FTWError(f"{name}: values up to {max(abs(lo.min()), abs(hi.max())):g} (or non-finite) do not fit "
                       "int4's fp16 scales; use --codec bf16")
    mins16 = _round_fp16(lo, -np.inf)
    step = (hi - mins16.astype(np.float32)) / np.float32(15.0)
    scales16 = _round_fp16(step.astype(np.float32), np.inf)
    # A zero step means an fp16-exact constant group: every code is 0 and min is the value.
    inv = np.float32(1.0) / np.where(scales16 == 0, np.float16(1.0), scales16).astype(np.float32)
    # x = (w − min)/step lies in [0, 15] up to rounding; code = trunc(x + 0.5) rounds it (ties up) in
    # the float -> uint8 conversion, so one fused pass w·inv + (0.5 − min·inv) does sub, mul and round.
    offset = np.float32(0.5) - mins16.astype(np.float32) * inv
    torch.addcmul(torch.from_numpy(offset).unsqueeze(2), wg, torch.from_numpy(inv).unsqueeze(2), out=wg)
    wf.clamp_(0.0, 15.5)                                                # belt and braces: never a 16
    codes = _work(scratch, "int4.u8", (out_f, groups * group_size), torch.uint8)
    codes.copy_(wf)
    codes = codes[:, :in_f]
    # byte j = code 2j | code 2j+1 << 4, written straight into q
    hi_nib = _work(scratch, "int4.hi", (out_f, in_f // 2), torch.uint8)
    torch.bitwise_left_shift(codes[:, 1::2], 4, out=hi_nib)
    torch.bitwise_or(codes[:, 0::2], hi_nib, out=q)
    scales.copy_(torch.from_numpy(scales16))
    mins.copy_(torch.from_numpy(mins16))


def int4_dequantize(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """{q [O, N/2], scales [O, G], mins [O, G]} -> W [O, N] fp32: q · scale + min."""
    codes = unpack_nibbles(q).to(torch.float32)                        # [O, N]
    n = codes.shape[-1]
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=-1)[..., :n]
    m = mins.to(torch.float32).repeat_interleave(group_size, dim=-1)[..., :n]
    return codes * s + m


# ---------------------------------------------------------------- fp4

FP4_FORMATS = {
    # name: (block size, scale dtype as stored, has a per-matrix fp32 scale)
    "mxfp4": (32, "e8m0", False),
    "nvfp4": (16, "e4m3", True),
}


def fp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, *, block_size: int, scale_format: str,
                   global_scale: torch.Tensor | None = None, global_op: str = "mul") -> torch.Tensor:
    """Reference dequantization, fp32, bit-identical to the published formulas.

    MXFP4: W = LUT[nib] · 2^(scale − 127)                       (scales uint8 e8m0 [O, N/32])
    NVFP4: W = LUT[nib] · float(scale) · global   (ModelOpt: global = weight_scale_2, op "mul")
           W = LUT[nib] · float(scale) / global   (compressed-tensors: weight_global_scale, op "div")
    """
    vals = e2m1_lut(packed.device)[unpack_nibbles(packed)]             # [O, N] fp32, exact
    if scale_format == "e8m0":
        exp = scales.to(torch.int32) - 127
        exp = exp.repeat_interleave(block_size, dim=-1)[..., : vals.shape[-1]]
        return torch.ldexp(vals, exp.to(torch.float32))
    if scale_format == "e4m3":
        s = scales.view(torch.float8_e4m3fn).to(torch.float32)
        s = s.repeat_interleave(block_size, dim=-1)[..., : vals.shape[-1]]
        w = vals * s                                                   # exact: 2 + 4 significant bits
        if global_scale is None:
            return w
        g = global_scale.to(torch.float32).reshape(())
        if global_op == "mul":
            return w * g
        if global_op == "div":
            return w / g
        raise FTWError(f"unknown fp4 global scale op {global_op!r}")
    raise FTWError(f"unknown fp4 scale format {scale_format!r}")
