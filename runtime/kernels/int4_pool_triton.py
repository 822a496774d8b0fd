"""Triton kernels: decode-time expert compute straight from the packed int4 / fp4 slot pool, in TWO launches.

The plain-torch reference is `runtime/kernels/expert_pool.py::pool_forward` (it gathers blocks, dequantizes
them whole and runs batched matmuls: ~40 launches and 3x the weight bytes in temporaries). These kernels
read each packed byte once, dequantize in registers and fuse everything around the two matmuls:

  gate_up kernel, grid (A, I / BLOCK_N):  t = a // K, s = slots[t, a % K] (s < 0: nothing to do)
      h[a, n] = act(sum_j Wg[s, n, j] x[t, j], sum_j Wu[s, n, j] x[t, j])
      (stored split: even n first, then odd n, so the down kernel reads both halves contiguously)
  down kernel,    grid (T, D / BLOCK_N):
      y[t, n] = sum_{k: slots[t, k] >= 0} weights[t, k] * sum_j Wd[slots[t, k], n, j] h[t*K + k, j]

A slot of -1 is an expert computed elsewhere: skipped (its h row is never written nor read, its weight never
applied), so whatever bytes or NaNs sit anywhere cannot leak. Accumulation is fp32; y is written once, in
x's dtype; no atomics, so results are deterministic. Nothing on the host depends on the data (no syncs,
allocations sized by shapes only): the two launches can be recorded in a CUDA graph.

Both kernels work on a tile of "virtual rows": rows of several matrices processed side by side, so their
loads are in flight together instead of one after another (at batch 1 the kernels are bound by the latency
of each round trip to memory, not by bandwidth). The gate_up tile interleaves gate row n and up row n;
the down tile holds row n of each of the token's K experts, and the weighted sum over K is a reduction
inside the tile. `_dot_tile` is the shared inner product: any packed rows of the pool against an input.

Block layout and codecs as in FTW: int4 `W = q * scale + min` (fp16 per group), fp4 e2m1 with e8m0 scales
per 32 (MXFP4). Weights are read as bytes: byte j of a row holds element 2j (low nibble) and 2j + 1 (high).

Shapes: T tokens, K per token, A = T*K assignments, D hidden, I expert width, G groups per row,
R rows in a tile (BLOCK_N outputs x the matrices side by side), KB = K rounded up to a power of two.
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

TILE_ELEMENTS = 2048        # packed bytes per tile and loop step (R x BLOCK_K): 16 per thread at 4 warps
PROGRAMS_PER_SM = 4         # aim: one wave; at 56-74 registers a thread 7-9 programs fit on an SM
DEFAULT_SMS = 132           # an H200's count, used when not on a CUDA device (the interpreter)
MIN_BLOCK_N, MAX_BLOCK_N = 2, 32


if HAVE_TRITON:
    @triton.jit
    def _dot_tile(pool_ptr, q_row, s_row, m_row, rmask, x_ptr, x_rows, half, n_groups, CODEC: tl.constexpr,
                  GROUP: tl.constexpr, SHARED_X: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc[R] = sum_j W_r[j] x_r[j] for R packed rows of `half` bytes (2 * half inputs, n_groups groups)
        anywhere in the pool.

        q_row [R] int64: byte offset of row r's codes; s_row, m_row [R]: offset of its first scale / min
        (fp16 elements for int4, bytes for e8m0); rmask [R]: rows that exist (the others load nothing and
        give 0). The input is x_ptr [2 * half] (natural order) for every row when SHARED_X, else row r's own
        x_rows[r] stored split: its even elements, then its odd ones (how the gate_up kernel writes h), so
        both halves load contiguously in the codes' own layout.
        A step covers BLOCK_K bytes of each row as NG whole groups of GB bytes: scales and mins are loaded
        once per group and broadcast over it. Products accumulate elementwise in a [R, NG, GB] tile, reduced
        once after the loop: a reduction per step would cost shuffles and barriers on every round trip."""
        GB: tl.constexpr = GROUP // 2                                         # bytes per group
        NG: tl.constexpr = BLOCK_K // GB                                      # groups per step
        gi = tl.arange(0, NG)
        acc = tl.zeros((ROWS, NG, GB), dtype=tl.float32)
        for k0 in range(0, half, BLOCK_K):
            kb = k0 + gi[:, None] * GB + tl.arange(0, GB)[None, :]           # [NG, GB] byte index in a row
            kmask = kb < half
            mask = rmask[:, None, None] & kmask[None, :, :]                   # [R, NG, GB]
            q = tl.load(pool_ptr + q_row[:, None, None] + kb[None, :, :], mask=mask, other=0).to(tl.int32)
            lo = (q & 15).to(tl.float32)
            hi = (q >> 4).to(tl.float32)
            if SHARED_X:                                                      # [R, NG, GB]
                # the shared input loaded in the tile's own layout, repeated per row from L1 (loaded once and
                # broadcast, it would be converted through shared memory, with barriers, on every step);
                # 16-bit x as one 32-bit word per (x[2j], x[2j + 1]) pair: contiguous, 16 bytes per load
                rows0 = (q_row * 0)[:, None, None]
                if x_ptr.dtype.element_ty == tl.bfloat16:
                    w = tl.load(x_ptr.to(tl.pointer_type(tl.uint32)) + rows0 + kb[None, :, :], mask=mask, other=0)
                    xe = (w << 16).to(tl.float32, bitcast=True)                # bf16 is fp32's top half
                    xo = (w & 0xFFFF0000).to(tl.float32, bitcast=True)
                elif x_ptr.dtype.element_ty == tl.float16:
                    w = tl.load(x_ptr.to(tl.pointer_type(tl.uint32)) + rows0 + kb[None, :, :], mask=mask, other=0)
                    xe = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
                    xo = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
                else:
                    xp = x_ptr + rows0 + 2 * kb[None, :, :]
                    xe = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
                    xo = tl.load(xp + 1, mask=mask, other=0.0).to(tl.float32)
            else:                                                             # [R, NG, GB]
                xp = x_rows[:, None, None] + kb[None, :, :]
                xe = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
                xo = tl.load(xp + half, mask=mask, other=0.0).to(tl.float32)
            # [R, NG, 1]: one scale (and min) per row and group, loaded straight in the tile's own layout
            g = (k0 // GB + gi)[None, :, None]                                # group of each chunk
            gmask = rmask[:, None, None] & (g < n_groups)
            if CODEC == 0:
                p16 = pool_ptr.to(tl.pointer_type(tl.float16))
                s = tl.load(p16 + s_row[:, None, None] + g, mask=gmask, other=0.0).to(tl.float32)
                m = tl.load(p16 + m_row[:, None, None] + g, mask=gmask, other=0.0).to(tl.float32)
                acc += (lo * xe + hi * xo) * s + (xe + xo) * m
            else:
                e8 = tl.load(pool_ptr + s_row[:, None, None] + g, mask=gmask, other=127).to(tl.float32)
                # e2m1 from the code: magnitude m/2 + relu(m-4)/2 + relu(m-6), bit 3 the sign
                lm = tl.where(lo >= 8.0, lo - 8.0, lo)
                hm = tl.where(hi >= 8.0, hi - 8.0, hi)
                lv = 0.5 * lm + 0.5 * tl.maximum(lm - 4.0, 0.0) + tl.maximum(lm - 6.0, 0.0)
                hv = 0.5 * hm + 0.5 * tl.maximum(hm - 4.0, 0.0) + tl.maximum(hm - 6.0, 0.0)
                lv = tl.where(lo >= 8.0, -lv, lv)
                hv = tl.where(hi >= 8.0, -hv, hv)
                acc += (lv * xe + hv * xo) * tl.exp2(e8 - 127.0)
        return tl.sum(tl.sum(acc, axis=2), axis=1)

    @triton.jit
    def _gate_up_kernel(pool_ptr, nbytes, slots_ptr, slot_st, slot_sk, x_ptr, x_st, h_ptr, K, D2, DG, I,
                        gq, gs, gm, uq, us, um, alpha, limit,
                        CODEC: tl.constexpr, GROUP: tl.constexpr, ACT: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        a = tl.program_id(0)                                                  # assignment: token t, k-th expert
        t = a // K
        slot = tl.load(slots_ptr + t * slot_st + (a - t * K) * slot_sk)
        if slot < 0:
            return
        base = slot.to(tl.int64) * nbytes
        r = tl.arange(0, 2 * BLOCK_N)                                         # [R]: (n, gate|up) interleaved
        n = tl.program_id(1) * BLOCK_N + r // 2
        # up rows: gate's offsets + (up - gate). Arithmetic, not tl.where: a select hides from Triton that the
        # offsets are multiples of 16, and the codes would be read a byte at a time instead of 16 at once
        up = r % 2
        q_row = base + gq + up * (uq - gq) + n * D2
        if CODEC == 0:                                                        # fp16 scales: element offsets
            s_row = (base + gs + up * (us - gs)) // 2 + n * DG
            m_row = (base + gm + up * (um - gm)) // 2 + n * DG
        else:
            s_row = base + gs + up * (us - gs) + n * DG
            m_row = s_row
        acc = _dot_tile(pool_ptr, q_row, s_row, m_row, n < I, x_ptr + t.to(tl.int64) * x_st, x_ptr, D2, DG,
                        CODEC, GROUP, True, 2 * BLOCK_N, BLOCK_K)
        g, u = tl.split(tl.reshape(acc, (BLOCK_N, 2)))                        # [BN], [BN]
        if ACT == 0:
            h = g / (1.0 + tl.exp(-g)) * u
        else:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = (rows % 2) * (I // 2) + rows // 2                             # even elements first, then odd
        tl.store(h_ptr + a.to(tl.int64) * I + split, h, mask=rows < I)

    @triton.jit
    def _down_kernel(pool_ptr, nbytes, slots_ptr, slot_st, slot_sk, w_ptr, w_st, w_sk, h_ptr, y_ptr, K, D, I,
                     I2, IG,
                     dq, ds, dm, CODEC: tl.constexpr, GROUP: tl.constexpr, KB: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        r = tl.arange(0, BLOCK_N * KB)                                        # [R]: (n, k) with k fastest
        k = r % KB
        n = tl.program_id(1) * BLOCK_N + r // KB
        kin = k < K
        slot = tl.load(slots_ptr + t * slot_st + k * slot_sk, mask=kin, other=-1)
        valid = kin & (slot >= 0)                                             # [R] assignment computed here
        wt = tl.load(w_ptr + t * w_st + k * w_sk, mask=valid, other=0.0).to(tl.float32)
        base = tl.maximum(slot, 0).to(tl.int64) * nbytes
        rmask = valid & (n < D)
        q_row = base + dq + n * I2
        if CODEC == 0:
            s_row = (base + ds) // 2 + n * IG
            m_row = (base + dm) // 2 + n * IG
        else:
            s_row = base + ds + n * IG
            m_row = s_row
        x_rows = h_ptr + (t * K + k).to(tl.int64) * I                         # [R] each row's own h (split)
        acc = _dot_tile(pool_ptr, q_row, s_row, m_row, rmask, h_ptr, x_rows, I2, IG,
                        CODEC, GROUP, False, BLOCK_N * KB, BLOCK_K)
        acc = tl.where(rmask, acc * wt, 0.0)
        y = tl.sum(tl.reshape(acc, (BLOCK_N, KB)), axis=1)                    # [BN] weighted sum over K
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + t.to(tl.int64) * D + rows, y.to(y_ptr.dtype.element_ty), mask=rows < D)


def supports(layout, spec) -> bool:
    """Whether these kernels cover a pool: int4, or MXFP4 (e8m0 per 32); no biases (gpt-oss takes torch);
    groups a power of two (a step of the inner loop holds whole groups)."""
    group = layout.group
    return HAVE_TRITON and not layout.has_bias and group >= 2 and group & (group - 1) == 0 and (
        layout.codec == "int4" or (layout.codec == "fp4" and layout.scale_format == "e8m0"
                                   and "gate_global" not in layout.parts))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def tile_sizes(jobs: int, n_out: int, fan: int, n_in: int, group: int, *, sms: int,
               block_n: int | None = None) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for a grid of `jobs` x cdiv(n_out, BLOCK_N) programs whose tiles hold `fan` rows
    per output (2: gate and up; KB: the experts of a token). BLOCK_N: the largest power of two that keeps
    a step of whole groups within ~TILE_ELEMENTS and still gives PROGRAMS_PER_SM programs per SM (a batch-1
    step has few outputs, so narrow tiles keep every SM busy; prefill-sized T takes the widest); BLOCK_K:
    bytes per row and step so that the tile is ~TILE_ELEMENTS (fewer sequential round trips when the tile
    is narrow), never much past the row's length, and at least one group (group / 2 bytes). A given
    `block_n` is taken as it is and BLOCK_K fitted to it."""
    gb = group // 2
    bn = max(MIN_BLOCK_N, min(MAX_BLOCK_N, _pow2_floor(TILE_ELEMENTS // (fan * gb))))
    while block_n is None and bn > MIN_BLOCK_N and jobs * triton.cdiv(n_out, bn) < PROGRAMS_PER_SM * sms:
        bn //= 2
    bn = block_n or bn
    row_bytes = triton.next_power_of_2(max(1, n_in // 2))
    bk = max(gb, min(row_bytes, _pow2_floor(TILE_ELEMENTS // (bn * fan))))
    return bn, bk


def pool_forward_triton(pool: torch.Tensor, layout, spec, x: torch.Tensor, slots: torch.Tensor,
                        weights: torch.Tensor, *, block_n: int | None = None,
                        block_k: int | None = None) -> torch.Tensor:
    """The same function as `expert_pool.pool_forward`: x [T, D], slots [T, K] (-1 skip), weights [T, K] ->
    y [T, D] in x's dtype. Two launches; `block_n` / `block_k` override the tile sizes of both kernels
    (powers of two; for tuning sweeps), by default chosen per shape by `tile_sizes`."""
    t, k = slots.shape
    d, i = layout.hidden, layout.intermediate
    if x.shape != (t, d) or weights.shape != (t, k):
        raise ValueError(f"pool_forward_triton: x {tuple(x.shape)}, slots {tuple(slots.shape)} and weights "
                         f"{tuple(weights.shape)} do not agree with [T, {d}], [T, K], [T, K]")
    y = torch.empty((t, d), dtype=x.dtype, device=x.device)
    if t == 0 or k == 0:
        return y.zero_()
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.contiguous()                              # rows of x read as 32-bit words of element pairs
    p = layout.parts
    off = lambda name: p[name].offset if name in p else 0                      # noqa: E731
    codec = 0 if layout.codec == "int4" else 1
    if codec == 0 and (layout.nbytes % 2 or any(off(f"{m}_{q}") % 2 for m in ("gate", "up", "down")
                                                for q in ("scales", "mins"))):
        raise ValueError("pool_forward_triton: fp16 scales/mins at odd byte offsets in the block layout")
    act = 0 if spec.activation == "silu" else 1
    sms = _sm_count(x.device)
    kb = triton.next_power_of_2(k)
    group = layout.group
    bn1, bk1 = tile_sizes(t * k, i, 2, d, group, sms=sms, block_n=block_n)
    bn2, bk2 = tile_sizes(t, d, kb, i, group, sms=sms, block_n=block_n)
    bk1, bk2 = max(block_k or bk1, group // 2), max(block_k or bk2, group // 2)    # whole groups per step
    h = torch.empty((t * k, i), dtype=torch.float32, device=x.device)          # [A, I] activations
    _gate_up_kernel[(t * k, triton.cdiv(i, bn1))](
        pool, layout.nbytes, slots, slots.stride(0), slots.stride(1), x, x.stride(0), h, k, d // 2, -(-d // group), i,
        off("gate"), off("gate_scales"), off("gate_mins"), off("up"), off("up_scales"), off("up_mins"),
        float(spec.swiglu_alpha), float(spec.swiglu_limit),
        CODEC=codec, GROUP=group, ACT=act, BLOCK_N=bn1, BLOCK_K=bk1)
    _down_kernel[(t, triton.cdiv(d, bn2))](
        pool, layout.nbytes, slots, slots.stride(0), slots.stride(1), weights, weights.stride(0),
        weights.stride(1), h, y, k, d, i, i // 2, -(-i // group), off("down"), off("down_scales"), off("down_mins"),
        CODEC=codec, GROUP=group, KB=kb, BLOCK_N=bn2, BLOCK_K=bk2)
    return y
