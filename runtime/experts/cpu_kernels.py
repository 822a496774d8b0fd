"""Quantized expert compute on the CPU: all of a layer's missed experts in one parallel call.

Why our own kernel: stock torch runs one expert per call (`_weight_int4pack_mm_for_cpu`, bf16 matmul) and at
batch 1 the time is per-call overhead, not bandwidth (issue 10 and docs/hybrid.md have the numbers). These
kernels are compiled by numba (parallel loops, wheels on every platform, no compiler at install) and read
the packed weights straight from the memory-mapped FTW expert file, so nothing is dequantized or copied.

Work is laid out as *assignments*: (token, expert) pairs sorted by expert, so each weight row is read once and
applied to every token that chose its expert. One parallel loop runs over (expert, block of rows).

Codecs (runtime/ftw/codecs.py): int4 `W = q·scale + min` per group (fp16 scale and min), fp4 e2m1
`W = LUT[q]·scale·global` per block (scale bytes decoded through a 256-entry table: e8m0 or e4m3).
For int4 the dot product of a group is `scale·Σ q·x + min·Σ x`, so the per-group sums of x are computed
once per token and the inner loop is pure integer-times-float multiply-adds.

Shapes: A assignments, U distinct experts, T tokens, D hidden, I expert width, G groups per row.
"""
from __future__ import annotations

import math

import numpy as np

try:
    import numba
    from numba import njit, prange
    HAVE_NUMBA = True
except ImportError:          # the plain-torch path (cpu_executor) still runs everything, only slower
    numba = None
    HAVE_NUMBA = False

ROWS_PER_TASK = 32           # rows of one expert matrix per parallel task: enough work to beat scheduling cost

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def fp16_table() -> np.ndarray:
    """uint16 bit pattern -> float32 for every fp16 value: decoding scales by lookup avoids numba's fp16 gaps."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def e8m0_table() -> np.ndarray:
    """e8m0 byte -> 2^(byte - 127); 255 (NaN in the format) reads as inf."""
    with np.errstate(over="ignore"):
        return np.ldexp(1.0, np.arange(256) - 127).astype(np.float32)


def e4m3_table() -> np.ndarray:
    import torch
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()


if HAVE_NUMBA:
    # Every kernel reads a layer's blocks as one uint8 array buf [E, nbytes] plus the byte offset of each part
    # inside a block. Inputs arrive de-interleaved (xe = x[0::2], xo = x[1::2], viewed [T, G, group/2]) to
    # match the nibble order: byte j holds element 2j (low nibble) and 2j+1 (high nibble).
    # Two rules keep the inner loops vectorized and the threads independent: indices are unsigned (numba then
    # emits no negative-index wraparound checks), and no array view is made inside a parallel loop (each view
    # is an atomic reference-count update on the shared buffer: 16 threads would serialise on it).

    @njit(cache=True, fastmath=True, inline="always")
    def _u16(buf, e, off):
        return np.int64(buf[e, off]) | (np.int64(buf[e, off + np.uint64(1)]) << 8)

    @njit(cache=True, fastmath=True, inline="always")
    def _int4_chunk(buf, e, start, xe, xo, t, gu, j0):
        """32 packed bytes (64 weights) dotted with x. The trip count is a constant, so LLVM turns the loop
        into full-width vector code even though a group is short (a runtime bound under 64 iterations would
        fall back to scalar code); int32 lanes (not numba's default int64) keep 16 weights per register."""
        acc = np.float32(0.0)
        for j in range(32):
            ju = np.uint64(j) + j0
            # nibbles split in float lanes: numba widens integer math to int64 (8 lanes), floats stay at 16
            b = np.float32(buf[e, start + ju])
            hi = np.floor(b * np.float32(0.0625))
            lo = b - np.float32(16.0) * hi
            acc += lo * xe[t, gu, ju] + hi * xo[t, gu, ju]
        return acc

    @njit(cache=True, fastmath=True, inline="always")
    def _int4_row(buf, e, q_off, s_off, m_off, r, n_groups, hg, table, xe, xo, xsum, t):
        """sum_k W[r, k] x_t[k] for W = q * scale + min (fp16 scale and min per group of the row)."""
        two = np.uint64(2)
        row = q_off + r * np.uint64(n_groups * hg)
        gi = r * np.uint64(n_groups)
        total = np.float32(0.0)
        for g in range(n_groups):
            gu = np.uint64(g)
            start = row + gu * np.uint64(hg)
            acc = np.float32(0.0)
            if hg % 32 == 0:
                for c in range(hg // 32):
                    acc += _int4_chunk(buf, e, start, xe, xo, t, gu, np.uint64(32 * c))
            else:
                for j in range(hg):
                    ju = np.uint64(j)
                    b = np.int32(buf[e, start + ju])
                    acc += np.float32(b & np.int32(15)) * xe[t, gu, ju] + np.float32(b >> np.int32(4)) * xo[t, gu, ju]
            sg = table[_u16(buf, e, s_off + (gi + gu) * two)]
            mg = table[_u16(buf, e, m_off + (gi + gu) * two)]
            total += sg * acc + mg * xsum[t, gu]
        return total

    @njit(cache=True, fastmath=True, inline="always")
    def _e2m1_twice(c):
        """2 * e2m1(c) as a float, computed in int32 lanes (no table lookup, so the loop vectorizes)."""
        one, two = np.int32(1), np.int32(2)
        e = (c >> one) & np.int32(3)
        m = c & one
        k = (((two + m) << e) >> one) if e else m
        return np.float32(k if c < np.int32(8) else -k)

    @njit(cache=True, fastmath=True, inline="always")
    def _e2m1_float(c):
        """e2m1(c) for a code held in a float (0..15), in float arithmetic only (16 lanes per register):
        magnitudes 0..7 -> 0, .5, 1, 1.5, 2, 3, 4, 6 = m/2 + relu(m-4)/2 + relu(m-6); bit 3 is the sign."""
        neg = c >= np.float32(8.0)
        m = c - np.float32(8.0) if neg else c
        v = np.float32(0.5) * m + np.float32(0.5) * max(m - np.float32(4.0), np.float32(0.0)) + \
            max(m - np.float32(6.0), np.float32(0.0))
        return -v if neg else v

    @njit(cache=True, fastmath=True, inline="always")
    def _fp4_chunk(buf, e, start, xe, xo, t, gu, j0):
        acc = np.float32(0.0)
        for j in range(16):
            ju = np.uint64(j) + j0
            b = np.float32(buf[e, start + ju])
            hi = np.floor(b * np.float32(0.0625))
            lo = b - np.float32(16.0) * hi
            acc += _e2m1_float(lo) * xe[t, gu, ju] + _e2m1_float(hi) * xo[t, gu, ju]
        return acc

    @njit(cache=True, fastmath=True, inline="always")
    def _fp4_row(buf, e, q_off, s_off, r, n_groups, hg, scale_table, xe, xo, t):
        """sum_k W[r, k] x_t[k] for W = e2m1(q) * scale (one scale byte per block of the row)."""
        row = q_off + r * np.uint64(n_groups * hg)
        gi = s_off + r * np.uint64(n_groups)
        total = np.float32(0.0)
        for g in range(n_groups):
            gu = np.uint64(g)
            start = row + gu * np.uint64(hg)
            acc = np.float32(0.0)
            if hg % 16 == 0:
                for c in range(hg // 16):
                    acc += _fp4_chunk(buf, e, start, xe, xo, t, gu, np.uint64(16 * c)) * np.float32(2.0)
            else:
                for j in range(hg):
                    ju = np.uint64(j)
                    b = np.int32(buf[e, start + ju])
                    acc += _e2m1_twice(b & np.int32(15)) * xe[t, gu, ju] + _e2m1_twice(b >> np.int32(4)) * xo[t, gu, ju]
            total += scale_table[buf[e, gi + gu]] * acc
        return total * np.float32(0.5)

    @njit(cache=True, fastmath=True, inline="always")
    def _act(g, u, activation, alpha, limit):
        if activation == 0:                      # silu(g) * u
            return g / (np.float32(1.0) + math.exp(-g)) * u
        g = min(g, limit)                        # gpt-oss clamped SwiGLU
        u = max(min(u, limit), -limit)
        return (u + np.float32(1.0)) * (g / (np.float32(1.0) + math.exp(-alpha * g)))

    @njit(parallel=True, cache=True, fastmath=True)
    def gate_up(codec, buf, offs, n_out, table, xe, xo, xsum, tokens, experts, starts,
                gate_scale, up_scale, gate_bias, up_bias, activation, alpha, limit, h):
        """h[a, :] = act(gate_e x_t, up_e x_t) for every assignment a = (t, e), sorted by expert.

        codec 0: int4 (offs = gate, gate_scales, gate_mins, up, up_scales, up_mins); codec 1: fp4 (mins unused;
        gate_scale/up_scale [E] the per-matrix scales). One task per (expert, block of rows)."""
        blocks = (n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK
        has_bias = gate_bias.shape[0] > 0
        n_groups, hg = xe.shape[1], xe.shape[2]
        o = offs.astype(np.uint64)
        for task in prange(experts.shape[0] * blocks):
            u_idx = task // blocks
            e = np.uint64(experts[u_idx])
            r0 = (task % blocks) * ROWS_PER_TASK
            for r in range(r0, min(r0 + ROWS_PER_TASK, n_out)):
                ru = np.uint64(r)
                for a in range(starts[u_idx], starts[u_idx + 1]):
                    t = np.uint64(tokens[a])
                    if codec == 0:
                        g = _int4_row(buf, e, o[0], o[1], o[2], ru, n_groups, hg, table, xe, xo, xsum, t)
                        u = _int4_row(buf, e, o[3], o[4], o[5], ru, n_groups, hg, table, xe, xo, xsum, t)
                    else:
                        g = _fp4_row(buf, e, o[0], o[1], ru, n_groups, hg, table, xe, xo, t) * gate_scale[e]
                        u = _fp4_row(buf, e, o[3], o[4], ru, n_groups, hg, table, xe, xo, t) * up_scale[e]
                    if has_bias:
                        g += gate_bias[e, ru]
                        u += up_bias[e, ru]
                    h[a, r] = _act(g, u, activation, alpha, limit)

    @njit(parallel=True, cache=True, fastmath=True)
    def down(codec, buf, offs, n_out, table, he, ho, hsum, experts, starts, down_scale, down_bias, y):
        """y[a, :] = down_e h[a] for every assignment (offs = down, down_scales, down_mins)."""
        blocks = (n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK
        has_bias = down_bias.shape[0] > 0
        n_groups, hg = he.shape[1], he.shape[2]
        o = offs.astype(np.uint64)
        for task in prange(experts.shape[0] * blocks):
            u_idx = task // blocks
            e = np.uint64(experts[u_idx])
            r0 = (task % blocks) * ROWS_PER_TASK
            for r in range(r0, min(r0 + ROWS_PER_TASK, n_out)):
                ru = np.uint64(r)
                for a in range(starts[u_idx], starts[u_idx + 1]):
                    au = np.uint64(a)
                    if codec == 0:
                        v = _int4_row(buf, e, o[0], o[1], o[2], ru, n_groups, hg, table, he, ho, hsum, au)
                    else:
                        v = _fp4_row(buf, e, o[0], o[1], ru, n_groups, hg, table, he, ho, au) * down_scale[e]
                    if has_bias:
                        v += down_bias[e, ru]
                    y[a, r] = v


def split_even_odd(v: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """v [N, K] float32 -> (v[:, 0::2], v[:, 1::2]) each viewed [N, G, group/2], and per-group sums [N, G]."""
    n, k = v.shape
    if k % group:
        raise ValueError(f"the fast CPU kernels need the input width {k} to be a multiple of the group {group}")
    g = k // group
    return (np.ascontiguousarray(v[:, 0::2]).reshape(n, g, group // 2),
            np.ascontiguousarray(v[:, 1::2]).reshape(n, g, group // 2),
            v.reshape(n, g, group).sum(axis=2, dtype=np.float32))
