"""The expert codecs on their own: nibble order, the stated int4 error bound, exact fp4 formulas."""
from __future__ import annotations

import struct

import pytest
import torch

from runtime.ftw.codecs import (E2M1_VALUES, fp4_dequantize, int4_dequantize, int4_quantize, pack_nibbles,
                                unpack_nibbles)
from runtime.ftw.errors import FTWError

# The bound docs/ftw-format.md states: every element within half a step of its group (plus fp32
# arithmetic slack); the step is the group's range / 15, widened only by fp16 rounding:
# step ≤ (max − min + 2⁻¹⁰·|min|) / 15 · (1 + 2⁻¹⁰).


def assert_int4_bound(w: torch.Tensor, q: dict, group_size: int) -> None:
    w_hat = int4_dequantize(q["q"], q["scales"], q["mins"], group_size)
    n = w.shape[1]
    scale = q["scales"].float().repeat_interleave(group_size, dim=1)[:, :n]
    slack = 8 * torch.finfo(torch.float32).eps * (w.abs() + 15 * scale)
    assert ((w - w_hat).abs() <= scale / 2 + slack).all()
    groups = -(-n // group_size)
    pad = groups * group_size - n
    wp = torch.cat((w, w[:, -1:].expand(-1, pad)), 1) if pad else w
    wg = wp.reshape(w.shape[0], groups, group_size)
    lo, hi = wg.amin(2), wg.amax(2)
    step_bound = (hi - lo + 2 ** -10 * lo.abs()) / 15 * (1 + 2 ** -10) + 2 ** -24
    assert (q["scales"].float() <= step_bound).all()                              # the step is not inflated


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("in_features", [64, 96, 200])           # 96 and 200: a short last group
def test_int4_within_stated_bound(group_size, in_features):
    gen = torch.Generator().manual_seed(group_size + in_features)
    w = torch.randn(24, in_features, generator=gen) * 0.05
    w[3] *= 40                                                    # rows of very different scale
    w[5, 7] = 3.0                                                 # an outlier in one group
    w[7] = 0.125                                                  # a constant row
    w[9] = w[9].abs() + 1.0                                       # all positive: min far from 0
    q = int4_quantize(w, group_size)
    assert q["q"].dtype == torch.uint8 and q["q"].shape == (24, in_features // 2)
    assert q["scales"].dtype == torch.float16 and q["scales"].shape == (24, -(-in_features // group_size))
    assert_int4_bound(w, q, group_size)
    assert torch.equal(int4_dequantize(q["q"], q["scales"], q["mins"], group_size)[7], w[7])   # exact constant


def test_int4_uses_all_sixteen_levels_and_rejects_bad_input():
    w = torch.linspace(-1, 1, 64).reshape(1, 64)
    q = int4_quantize(w, 64)
    assert set(unpack_nibbles(q["q"]).flatten().tolist()) == set(range(16))
    with pytest.raises(FTWError, match="group size"):
        int4_quantize(w, 48)
    with pytest.raises(FTWError, match="bf16"):
        int4_quantize(torch.full((2, 64), 1e6), 64, name="layer 0 expert 1 gate")
    with pytest.raises(FTWError, match="even"):
        int4_quantize(torch.zeros(2, 63), 32)


def test_nibble_order_low_is_even_element():
    codes = torch.tensor([[1, 2, 15, 0]])
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_nibbles(packed), codes)


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_fp4_dequantize_is_the_published_formula_bit_for_bit():
    """Element by element in Python: MXFP4 LUT·2^(s−127); NVFP4 (LUT·s)·g and (LUT·s)/g rounded once to fp32."""
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (4, 32), generator=gen, dtype=torch.uint8)          # 4 x 64 elements
    e8m0 = torch.randint(100, 140, (4, 2), generator=gen, dtype=torch.uint8)
    mx = fp4_dequantize(packed, e8m0, block_size=32, scale_format="e8m0")
    e4m3 = (torch.rand(4, 4, generator=gen) * 400 + 0.01).to(torch.float8_e4m3fn)
    g = torch.tensor(0.0001234567, dtype=torch.float32)
    nv_mul = fp4_dequantize(packed, e4m3.view(torch.uint8), block_size=16, scale_format="e4m3", global_scale=g)
    nv_div = fp4_dequantize(packed, e4m3.view(torch.uint8), block_size=16, scale_format="e4m3",
                            global_scale=1 / g, global_op="div")
    g_val, inv_val = float(g), float((1 / g).float())
    for o in range(4):
        for i in range(64):
            byte = int(packed[o, i // 2])
            lut = E2M1_VALUES[(byte >> (4 * (i % 2))) & 0xF]
            assert float(mx[o, i]) == lut * 2.0 ** (int(e8m0[o, i // 32]) - 127)
            s = float(e4m3[o, i // 16].float())
            assert float(nv_mul[o, i]) == _f32(_f32(lut * s) * g_val)
            assert float(nv_div[o, i]) == _f32(_f32(lut * s) / inv_val)
