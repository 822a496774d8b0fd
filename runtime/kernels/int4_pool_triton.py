"""Triton kernels: decode-time expert compute straight from the packed int4 / fp4 slot pool, in TWO launches.

The plain-torch reference is `runtime/kernels/expert_pool.py::pool_forward` (it gathers blocks, dequantizes
them whole and runs batched matmuls: ~40 launches and 3x the weight bytes in temporaries). These kernels
read each packed byte once, dequantize in registers and fuse everything around the two matmuls:

  gate_up kernel, grid (A, I / BLOCK_N):  t = a // K, s = slots[t, a % K] (s < 0: nothing to do)
      h[a, n] = act(sum_j Wg[s, n, j] x[t, j], sum_j Wu[s, n, j] x[t, j])
      (stored in x's dtype when it is 16-bit, as the torch path rounds it, else fp32; with `slot_table` the
      slots are looked up here, from expert ids, and handed to the down kernel)
  down kernel,    grid (T, D / BLOCK_N):
      y[t, n] = sum_{k: slots[t, k] >= 0} weights[t, k] * sum_j Wd[slots[t, k], n, j] h[t*K + k, j]

A slot of -1 is an expert computed elsewhere: skipped (its h row is never written, its pool bytes never read,
its sums dropped by a select and its weight never applied), so whatever bytes or NaNs sit anywhere cannot
leak. Accumulation is fp32; y is written once, in x's dtype; no atomics, so results are deterministic.
Nothing on the host depends on the data (no syncs, allocations sized by shapes only): the two launches can be
recorded in a CUDA graph.

Both kernels work on a tile of "virtual rows": rows of several matrices processed side by side, so their
loads are in flight together instead of one after another. At batch 1 the kernels are bound by the number
of instructions they issue and by round trips to memory, not by bandwidth: the inner step costs ~4 integer
ops and 4 FFMAs per code byte (see `_dot_step`), a row's steps are unrolled and the next step's codes
prefetched (`KernelPlan`; benchmarks/sweep_pool_kernels.py times the plans on the GPU). The gate_up tile
interleaves gate row n and up row n; the down tile holds row n of each of the token's K experts, and the
weighted sum over K is a reduction inside the tile. `_dot_tile` is the shared inner product: any packed rows
of the pool against an input.

Block layout and codecs as in FTW: int4 `W = q * scale + min` (fp16 per group), fp4 e2m1 with e8m0 scales
per 32 (MXFP4). Weights are read as bytes: byte j of a row holds element 2j (low nibble) and 2j + 1 (high).

Shapes: T tokens, K per token, A = T*K assignments, D hidden, I expert width, G groups per row,
R rows in a tile (BLOCK_N outputs x the matrices side by side), KB = K rounded up to a power of two.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

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
MAX_UNROLL = 8              # steps per row unrolled into straight-line code (their loads may all be in flight)
NUM_WARPS = 4
PREFETCH = True             # request step i + 1's codes before step i's arithmetic


if HAVE_TRITON:
    @triton.jit
    def _load(ptrs, mask, other, UNMASKED: tl.constexpr):
        """tl.load, without its mask when every address is valid: a masked load zeroes its registers first and
        needs its predicate computed, ~10 instructions per 16 code bytes of the batch-1 loop."""
        if UNMASKED:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=mask, other=other)

    @triton.jit
    def _pool_mask(rmask, inside, EVEN: tl.constexpr, ROWS_ALL: tl.constexpr):
        """Which pool bytes of a [R, NG, GB] (or [R, NG, 1]) tile to read: rows that count (unless ROWS_ALL) and
        positions inside the row (unless EVEN). A row that does not count reads nothing from the pool, which
        may be host memory read over PCIe (the zero-copy tier's misses)."""
        if ROWS_ALL:
            return inside
        elif EVEN:
            return rmask[:, None, None]
        else:
            return rmask[:, None, None] & inside

    @triton.jit
    def _pairs(rows, j, mask, UNMASKED: tl.constexpr):
        """(x[2j], x[2j + 1]) as two fp32 tensors, x being each row's input at `rows` (element pointers) and j a
        pair index: one 32-bit word per pair of a 16-bit input, one 64-bit word per fp32 pair, so a thread's
        pairs load contiguously, 16 bytes at once, in the packed codes' own layout (byte j holds elements 2j
        and 2j + 1)."""
        ty = rows.dtype.element_ty
        if ty == tl.bfloat16:
            w = _load(rows.to(tl.pointer_type(tl.uint32)) + j, mask, 0, UNMASKED)
            # bf16 is fp32's top half
            return (w << 16).to(tl.float32, bitcast=True), (w & 0xFFFF0000).to(tl.float32, bitcast=True)
        elif ty == tl.float16:
            w = _load(rows.to(tl.pointer_type(tl.uint32)) + j, mask, 0, UNMASKED)
            return ((w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32),
                    (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32))
        else:
            w = _load(rows.to(tl.pointer_type(tl.uint64)) + j, mask, 0, UNMASKED)
            return ((w & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True),
                    (w >> 32).to(tl.uint32).to(tl.float32, bitcast=True))

    @triton.jit
    def _codes(pool_ptr, q_row, rmask, k0, half, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
               ROWS_ALL: tl.constexpr):
        """Bytes k0 .. k0 + BLOCK_K of each row's codes as a [R, NG, GB] int32 tile (nothing loaded past a row,
        nor for a row that does not count)."""
        GB: tl.constexpr = GROUP // 2                                         # bytes per group
        NG: tl.constexpr = BLOCK_K // GB                                      # groups per step
        kb = k0 + tl.arange(0, NG)[:, None] * GB + tl.arange(0, GB)[None, :]  # [NG, GB] byte index in a row
        mask = _pool_mask(rmask, (kb < half)[None, :, :], EVEN, ROWS_ALL)
        return _load(pool_ptr + q_row[:, None, None] + kb[None, :, :], mask, 0, EVEN and ROWS_ALL).to(tl.int32)

    @triton.jit
    def _dot_step(acc, q, k0, pool_ptr, s_row, m_row, rmask, x_rows, half, n_groups, CODEC: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, ROWS_ALL: tl.constexpr):
        """acc [R, NG, GB] += the products of codes q (bytes k0 .. k0 + BLOCK_K of each row) with the inputs."""
        GB: tl.constexpr = GROUP // 2
        NG: tl.constexpr = BLOCK_K // GB
        gi = tl.arange(0, NG)
        kb = k0 + gi[:, None] * GB + tl.arange(0, GB)[None, :]               # [NG, GB] byte index in a row
        # each row's input in the tile's own layout: byte j of a row meets pair j of its input (repeated per row
        # from L1 where rows share one input: loaded once and broadcast, it would be converted through shared
        # memory, with barriers, on every step)
        # (every row points at a real input, so only positions past the row's end are masked)
        xe, xo = _pairs(x_rows[:, None, None], kb[None, :, :], (kb < half)[None, :, :], EVEN)   # [R, NG, GB] x2
        # [R, NG, 1]: one scale (and min) per row and group, loaded straight in the tile's own layout
        g = (k0 // GB + gi)[None, :, None]                                    # group of each chunk
        gmask = _pool_mask(rmask, g < n_groups, EVEN, ROWS_ALL)
        if CODEC == 0:
            p16 = pool_ptr.to(tl.pointer_type(tl.float16))
            s = _load(p16 + s_row[:, None, None] + g, gmask, 0.0, EVEN and ROWS_ALL).to(tl.float32)
            m = _load(p16 + m_row[:, None, None] + g, gmask, 0.0, EVEN and ROWS_ALL).to(tl.float32)
            # A nibble c becomes the float f = 1 + c/16 by placing it in the top mantissa bits of 1.0 (a shift and
            # one LOP3), so w = c*s + m = f*(16 s) + (m - 16 s): ONE FFMA per weight, no int->float conversion
            # (I2F) nor byte extraction per nibble. m - 16 s is exact (two fp16 values of like size), so w
            # rounds once, as c*s + m would. Per byte: 4 integer ops and 4 FFMAs, where the plain form took ~11
            # ops: at batch 1 these kernels issue more instructions than their memory needs (measured ~300
            # instructions a thread per 16 code bytes before)
            s16 = s * 16.0                                                    # [R, NG, 1]
            m16 = m - s16
            fl = (((q << 19) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
            fh = (((q << 15) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
            acc += (fl * s16 + m16) * xe
            acc += (fh * s16 + m16) * xo
        else:
            lo = (q & 15).to(tl.float32)
            hi = (q >> 4).to(tl.float32)
            e8 = _load(pool_ptr + s_row[:, None, None] + g, gmask, 127, EVEN and ROWS_ALL).to(tl.float32)
            # e2m1 from the code: magnitude m/2 + relu(m-4)/2 + relu(m-6), bit 3 the sign
            lm = tl.where(lo >= 8.0, lo - 8.0, lo)
            hm = tl.where(hi >= 8.0, hi - 8.0, hi)
            lv = 0.5 * lm + 0.5 * tl.maximum(lm - 4.0, 0.0) + tl.maximum(lm - 6.0, 0.0)
            hv = 0.5 * hm + 0.5 * tl.maximum(hm - 4.0, 0.0) + tl.maximum(hm - 6.0, 0.0)
            lv = tl.where(lo >= 8.0, -lv, lv)
            hv = tl.where(hi >= 8.0, -hv, hv)
            acc += (lv * xe + hv * xo) * tl.exp2(e8 - 127.0)
        return acc

    @triton.jit
    def _dot_tile(pool_ptr, q_row, s_row, m_row, rmask, x_rows, half, n_groups, CODEC: tl.constexpr,
                  GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr,
                  PREFETCH: tl.constexpr, EVEN: tl.constexpr, ROWS_ALL: tl.constexpr):
        """acc[R] = sum_j W_r[j] x_r[j] for R packed rows of `half` bytes (2 * half inputs, n_groups groups)
        anywhere in the pool.

        q_row [R] int64: byte offset of row r's codes; s_row, m_row [R]: offset of its first scale / min
        (fp16 elements for int4, bytes for e8m0); rmask [R]: rows that count (the others read nothing from
        the pool); x_rows [R]: pointer to row r's input (natural order, 16-bit or fp32; rows may share one).
        A step covers BLOCK_K bytes of each row as NG whole groups of GB bytes: scales and mins are loaded
        once per group and broadcast over it. Products accumulate elementwise in a [R, NG, GB] tile, reduced
        once after the loop: a reduction per step would cost shuffles and barriers on every round trip.

        A batch-1 step is bound by round trips to memory, and a plain loop waits for each step's codes before
        the next step asks for its own. Two ways to keep more in flight (tuned by benchmarks/sweep_pool_kernels.py):
        STEPS > 0, the row is exactly that many steps, unrolled into straight-line code whose loads ptxas may
        issue early (as far as registers allow; STEPS == 0: a loop); PREFETCH, the codes of step i + 1 are
        requested before step i's arithmetic (a software pipeline one step deep, in either form).
        EVEN: every row holds whole steps (no mask past a row's end); ROWS_ALL: every row counts (no row mask
        on the pool's bytes). Inputs are never masked by row: every x_rows entry points at a real input, and
        the caller drops the sums of rows that do not count."""
        GB: tl.constexpr = GROUP // 2
        NG: tl.constexpr = BLOCK_K // GB
        acc = tl.zeros((ROWS, NG, GB), dtype=tl.float32)
        q_next = _codes(pool_ptr, q_row, rmask, 0, half, GROUP, BLOCK_K, EVEN, ROWS_ALL)
        if STEPS > 0:
            for step in tl.static_range(STEPS):
                if PREFETCH:
                    q = q_next
                    if step + 1 < STEPS:
                        q_next = _codes(pool_ptr, q_row, rmask, (step + 1) * BLOCK_K, half, GROUP, BLOCK_K, EVEN,
                                        ROWS_ALL)
                else:
                    q = _codes(pool_ptr, q_row, rmask, step * BLOCK_K, half, GROUP, BLOCK_K, EVEN, ROWS_ALL)
                acc = _dot_step(acc, q, step * BLOCK_K, pool_ptr, s_row, m_row, rmask, x_rows, half, n_groups,
                                CODEC, GROUP, BLOCK_K, EVEN, ROWS_ALL)
        else:
            for k0 in range(0, half, BLOCK_K):
                if PREFETCH:
                    q = q_next
                    # past the row's end the last step is fetched again (in bounds, unused): no mask needed
                    nxt = tl.maximum(tl.minimum(k0 + BLOCK_K, half - BLOCK_K), 0)
                    q_next = _codes(pool_ptr, q_row, rmask, nxt, half, GROUP, BLOCK_K, EVEN, ROWS_ALL)
                else:
                    q = _codes(pool_ptr, q_row, rmask, k0, half, GROUP, BLOCK_K, EVEN, ROWS_ALL)
                acc = _dot_step(acc, q, k0, pool_ptr, s_row, m_row, rmask, x_rows, half, n_groups,
                                CODEC, GROUP, BLOCK_K, EVEN, ROWS_ALL)
        return tl.sum(tl.sum(acc, axis=2), axis=1)

    @triton.jit
    def _gate_up_kernel(pool_ptr, nbytes, slots_ptr, slot_st, slot_sk, table_ptr, E, slots_out, x_ptr, x_st, h_ptr,
                        K, D2, DG, I, gq, gs, gm, uq, us, um, alpha, limit,
                        CODEC: tl.constexpr, GROUP: tl.constexpr, ACT: tl.constexpr, LOOKUP: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr,
                        PREFETCH: tl.constexpr, EVEN: tl.constexpr, ROWS_ALL: tl.constexpr):
        a = tl.program_id(0)                                                  # assignment: token t, k-th expert
        t = a // K
        slot = tl.load(slots_ptr + t * slot_st + (a - t * K) * slot_sk)
        if LOOKUP:
            # slots_ptr holds expert ids: the layer's table row maps them to slots (-1: not resident), and the
            # first program of each assignment hands its slot to the down kernel (the lookup was a launch)
            expert = slot
            slot = tl.load(table_ptr + expert, mask=(expert >= 0) & (expert < E), other=-1)
            if tl.program_id(1) == 0:
                tl.store(slots_out + a, slot.to(slots_out.dtype.element_ty))
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
        x_rows = x_ptr + t.to(tl.int64) * x_st + (q_row * 0)                  # [R] every row reads token t's x
        acc = _dot_tile(pool_ptr, q_row, s_row, m_row, n < I, x_rows, D2, DG, CODEC, GROUP, 2 * BLOCK_N, BLOCK_K,
                        STEPS, PREFETCH, EVEN, ROWS_ALL)
        g, u = tl.split(tl.reshape(acc, (BLOCK_N, 2)))                        # [BN], [BN]
        if ACT == 0:
            h = g / (1.0 + tl.exp(-g)) * u
        else:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        # rounded to h's dtype: x's when 16-bit, as the torch path's activations are
        tl.store(h_ptr + a.to(tl.int64) * I + rows, h.to(h_ptr.dtype.element_ty), mask=rows < I)

    @triton.jit
    def _down_kernel(pool_ptr, nbytes, slots_ptr, slot_st, slot_sk, w_ptr, w_st, w_sk, h_ptr, y_ptr, K, D, I,
                     I2, IG,
                     dq, ds, dm, CODEC: tl.constexpr, GROUP: tl.constexpr, KB: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr,
                     PREFETCH: tl.constexpr, EVEN: tl.constexpr):
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
        # [R] each row's own h (padding rows past K point at the last real one: read, never counted)
        x_rows = h_ptr + (t * K + tl.minimum(k, K - 1)).to(tl.int64) * I
        acc = _dot_tile(pool_ptr, q_row, s_row, m_row, rmask, x_rows, I2, IG, CODEC, GROUP, BLOCK_N * KB, BLOCK_K,
                        STEPS, PREFETCH, EVEN, False)     # rows count only where their slot is real
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


@dataclass(frozen=True)
class KernelPlan:
    """How one of the two kernels is launched: tile (BLOCK_N outputs x BLOCK_K bytes per step), warps per
    program, STEPS (> 0: a row is that many steps, unrolled; 0: a loop) and whether the next step's codes are
    requested before this step's arithmetic."""
    block_n: int
    block_k: int
    warps: int = NUM_WARPS
    steps: int = 0
    prefetch: bool = False


def default_plans(t: int, k: int, layout, *, sms: int, block_n: int | None = None,
                  block_k: int | None = None) -> tuple[KernelPlan, KernelPlan]:
    """The (gate_up, down) plans for T tokens with K experts each: tiles from `tile_sizes` (or the overrides,
    BLOCK_K widened to one group), rows of at most MAX_UNROLL steps unrolled, PREFETCH as measured best."""
    d, i, group = layout.hidden, layout.intermediate, layout.group
    plans = []
    for jobs, n_out, fan, n_in in ((t * k, i, 2, d), (t, d, triton.next_power_of_2(k), i)):
        bn, bk = tile_sizes(jobs, n_out, fan, n_in, group, sms=sms, block_n=block_n)
        bk = max(block_k or bk, group // 2)                                  # whole groups per step
        plans.append(KernelPlan(bn, bk, NUM_WARPS, unrolled_steps(n_in // 2, bk), PREFETCH))
    return plans[0], plans[1]


def unrolled_steps(half: int, block_k: int, *, max_unroll: int = MAX_UNROLL) -> int:
    """STEPS for `_dot_tile`: a row of `half` bytes in BLOCK_K steps, unrolled when there are at most
    `max_unroll` of them (0: a loop)."""
    steps = triton.cdiv(half, block_k)
    return steps if steps <= max_unroll else 0


def pool_forward_triton(pool: torch.Tensor, layout, spec, x: torch.Tensor, slots: torch.Tensor,
                        weights: torch.Tensor, *, slot_table: torch.Tensor | None = None,
                        block_n: int | None = None, block_k: int | None = None,
                        plans: tuple[KernelPlan | None, KernelPlan | None] = (None, None)) -> torch.Tensor:
    """The same function as `expert_pool.pool_forward`: x [T, D], slots [T, K] (-1 skip), weights [T, K] ->
    y [T, D] in x's dtype. Two launches: `pool_gate_up_triton`, then `pool_down_triton`.

    `slot_table` [E] (int32/int64; -1: not resident): `slots` are then expert ids, looked up in the table by
    the first kernel (the layer's row of the slot table: no separate gather launch before the kernels).
    Tuning overrides (for tests and sweeps): `block_n` / `block_k` the tile sizes of both kernels (powers of
    two), `plans` = (gate_up, down) whole launch plans (None: `default_plans`)."""
    t, k = slots.shape
    if weights.shape != (t, k):
        raise ValueError(f"pool_forward_triton: weights {tuple(weights.shape)} do not agree with slots "
                         f"{tuple(slots.shape)} ([T, K])")
    # the two plans worked out once for both launches (the host-driven decode path calls this eagerly)
    if t and k and not all(plans):
        default = default_plans(t, k, layout, sms=_sm_count(x.device), block_n=block_n, block_k=block_k)
        plans = tuple(given or plan for given, plan in zip(plans, default))
    h, looked_up = pool_gate_up_triton(pool, layout, spec, x, slots, slot_table=slot_table, plan=plans[0])
    return pool_down_triton(pool, layout, h, looked_up, weights, out_dtype=x.dtype, plan=plans[1])


def _codec(layout) -> int:
    """The kernels' CODEC (0 int4, 1 fp4), after checking that int4's fp16 scales/mins sit at even offsets."""
    if layout.codec != "int4":
        return 1
    p = layout.parts
    if layout.nbytes % 2 or any(p[f"{m}_{q}"].offset % 2 for m in ("gate", "up", "down") for q in ("scales", "mins")
                                if f"{m}_{q}" in p):
        raise ValueError("pool_forward_triton: fp16 scales/mins at odd byte offsets in the block layout")
    return 0


def _offset(layout, name: str) -> int:
    return layout.parts[name].offset if name in layout.parts else 0


def pool_gate_up_triton(pool: torch.Tensor, layout, spec, x: torch.Tensor, slots: torch.Tensor, *,
                        slot_table: torch.Tensor | None = None, block_n: int | None = None,
                        block_k: int | None = None,
                        plan: KernelPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first of pool_forward_triton's two launches: x [T, D], slots [T, K] -> (h [T*K, I] the activations, in
    x's dtype when 16-bit else fp32; the slots [T, K] the down kernel reads: `slots`, or the table's answers with
    `slot_table`). It reads only the gate and up parts of each block (what lies below the down part in the FTW
    layout), so it may run while a block's down part is still being copied (hybrid.py `split_gather`)."""
    t, k = slots.shape
    d, i = layout.hidden, layout.intermediate
    if x.shape != (t, d):
        raise ValueError(f"pool_forward_triton: x {tuple(x.shape)} and slots {tuple(slots.shape)} do not agree "
                         f"with [T, {d}], [T, K]")
    if slot_table is not None and (slot_table.ndim != 1 or slot_table.dtype not in (torch.int32, torch.int64)
                                   or slot_table.stride(0) != 1):
        raise ValueError(f"pool_forward_triton: slot_table must be a contiguous [E] int32/int64 row, got "
                         f"{slot_table.dtype} {tuple(slot_table.shape)} strides {slot_table.stride()}")
    if d % 2 or i % 2:
        raise ValueError(f"pool_forward_triton: hidden {d} and expert width {i} must be even (packed pairs)")
    # [A, I] activations, rounded to x's dtype when it is 16-bit as the torch path rounds them (and half the
    # bytes for the down kernel to read); fp32 otherwise
    h = torch.empty((t * k, i), dtype=x.dtype if x.element_size() == 2 else torch.float32, device=x.device)
    lookup = slot_table is not None
    looked_up = torch.empty((t, k), dtype=slot_table.dtype, device=x.device) if lookup else slots   # [T, K] slots
    if t == 0 or k == 0:
        return h, looked_up
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % (2 * x.element_size()):
        x = x.contiguous()                              # rows of x read as whole words of element pairs
    codec, group, off = _codec(layout), layout.group, functools.partial(_offset, layout)
    gu = plan or default_plans(t, k, layout, sms=_sm_count(x.device), block_n=block_n, block_k=block_k)[0]
    _gate_up_kernel[(t * k, triton.cdiv(i, gu.block_n))](
        pool, layout.nbytes, slots, slots.stride(0), slots.stride(1), slot_table if lookup else slots,
        slot_table.shape[0] if lookup else 0, looked_up, x, x.stride(0), h, k, d // 2, -(-d // group), i,
        off("gate"), off("gate_scales"), off("gate_mins"), off("up"), off("up_scales"), off("up_mins"),
        float(spec.swiglu_alpha), float(spec.swiglu_limit),
        CODEC=codec, GROUP=group, ACT=0 if spec.activation == "silu" else 1, LOOKUP=lookup, BLOCK_N=gu.block_n,
        BLOCK_K=gu.block_k, STEPS=gu.steps, PREFETCH=gu.prefetch, EVEN=(d // 2) % gu.block_k == 0,
        ROWS_ALL=i % gu.block_n == 0, num_warps=gu.warps)
    return h, looked_up


def pool_down_triton(pool: torch.Tensor, layout, h: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, *,
                     out_dtype: torch.dtype, block_n: int | None = None, block_k: int | None = None,
                     plan: KernelPlan | None = None) -> torch.Tensor:
    """The second launch: h [T*K, I] and slots [T, K] from `pool_gate_up_triton`, weights [T, K] -> y [T, D] in
    `out_dtype`: the weighted sum over each token's K experts of their down rows (slots < 0 skipped)."""
    t, k = slots.shape
    d, i = layout.hidden, layout.intermediate
    if weights.shape != (t, k) or h.shape != (t * k, i):
        raise ValueError(f"pool_down_triton: h {tuple(h.shape)} and weights {tuple(weights.shape)} do not agree "
                         f"with slots {tuple(slots.shape)}: [T*K, {i}], [T, K]")
    y = torch.empty((t, d), dtype=out_dtype, device=h.device)
    if t == 0 or k == 0:
        return y.zero_()
    codec, group, off = _codec(layout), layout.group, functools.partial(_offset, layout)
    dn = plan or default_plans(t, k, layout, sms=_sm_count(h.device), block_n=block_n, block_k=block_k)[1]
    _down_kernel[(t, triton.cdiv(d, dn.block_n))](
        pool, layout.nbytes, slots, slots.stride(0), slots.stride(1), weights, weights.stride(0),
        weights.stride(1), h, y, k, d, i, i // 2, -(-i // group), off("down"), off("down_scales"), off("down_mins"),
        CODEC=codec, GROUP=group, KB=triton.next_power_of_2(k), BLOCK_N=dn.block_n, BLOCK_K=dn.block_k,
        STEPS=dn.steps, PREFETCH=dn.prefetch, EVEN=(i // 2) % dn.block_k == 0,
        num_warps=dn.warps)
    return y


def down_offset(layout) -> int:
    """Where a block's down part begins: every byte the gate_up kernel reads lies below it, every byte the down
    kernel reads at or above it (checked; 0 when the layout is not split so, and a block cannot be gathered in two
    parts)."""
    p = layout.parts
    down = [name for name in p if name.startswith("down")]
    if not down or "down" not in p:
        return 0
    lo = min(p[name].offset for name in down)
    below = all(part.offset + part.nbytes <= lo for name, part in p.items() if name not in down)
    return lo if below else 0
