"""Triton kernel: one new query token attending over a sequence's KV cache, in ONE launch (split-KV decode).

The torch reference is SDPA over the cache's first `bucket` rows with a key mask (runtime/models/blocks.py
`attend_static`, what a CUDA graph records): it reads the whole bucket, converts or expands the mask, and on
the H200 ran as two cuDNN kernels (attention + a reduction) per layer. This kernel reads only the keys up to
the query's own row — their count comes from a device tensor, so a recorded graph replays at any position —
and splits them over programs like flash-decoding:

  program (kv head h, split s): the G query heads of h (GQA) against keys [s*C, (s+1)*C) ∩ [0, L):
      scores = q_g . k_j * scale, an online softmax over the split's blocks of BLOCK_S keys
      -> the split's running max m, sum l and weighted values o [G, hd] (fp32) in a scratch buffer
  the last program of head h to finish (an acq_rel count per head) combines the splits:
      out_g = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s,  M = max_s m_s
      and sets the count back to 0 (the next layer, or the next replay, counts again)

Products q.k and p.v run as tl.dot (tensor cores) with the G heads padded to 16 rows; p is rounded to the
values' dtype before p.v, as flash kernels do; an fp32 cache multiplies in full fp32 (not tf32). Shapes: H query heads, Hkv key/value heads, G = H / Hkv,
hd head dim, S cache rows (the bucket), L = the query's row + 1 (keys it sees), C keys per split.
"""
from __future__ import annotations

import os

import torch

from runtime.kernels import fallback

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

MAX_SPLITS = 16             # programs per kv head at most: the combining program reads all their partials
BLOCK_S = 64                # keys per inner step
MIN_HEADS = 16              # tl.dot wants 16 rows: G query heads are padded up to this
_counters: dict[torch.device, torch.Tensor] = {}     # per device: one int32 count per kv head, left at zero


if HAVE_TRITON:
    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, out_ptr, part_o, part_ml, count_ptr,
                                 k_head_stride, k_row_stride, scale_log2, G, HD, chunk,
                                 SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                                 BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
        h = tl.program_id(0)
        s = tl.program_id(1)
        length = tl.load(rows_ptr).to(tl.int32) + 1                       # keys 0 .. the query's own row
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        gmask = g < G
        dmask = d < HD
        # q [BG, BD]: the G query heads of kv head h (heads h*G .. h*G + G - 1), zero rows past G
        q = tl.load(q_ptr + (h * G + g)[:, None] * HD + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        lsum = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        kv = h.to(tl.int64) * k_head_stride
        # the split's keys: `chunk` is a runtime value, not a constexpr - a graph bucket of another size must not
        # compile another variant inside a decode step (a long answer crosses one every 1,024 tokens)
        start = s * chunk
        for j0 in range(start, tl.minimum(start + chunk, length), BLOCK_S):
            j = j0 + tl.arange(0, BLOCK_S)
            jmask = j < length
            tile = kv + j[:, None].to(tl.int64) * k_row_stride + d[None, :]   # [BS, BD]
            kt = tl.load(k_ptr + tile, mask=jmask[:, None] & dmask[None, :], other=0.0)
            vt = tl.load(v_ptr + tile, mask=jmask[:, None] & dmask[None, :], other=0.0)
            if DOT_FP32:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            scores = tl.dot(q, tl.trans(kt), input_precision="ieee" if DOT_FP32 else None) * scale_log2   # [BG, BS]
            scores = tl.where(jmask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp2(m - m_new)                                        # 0 on the first block (m = -inf)
            p = tl.exp2(scores - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, axis=1)
            # p rounded to the values' dtype first (as flash kernels do; kept in fp32 under DOT_FP32 only when
            # the cache itself is fp32)
            p_v = p.to(v_ptr.dtype.element_ty).to(vt.dtype)
            acc = acc * alpha[:, None] + tl.dot(p_v, vt, input_precision="ieee" if DOT_FP32 else None)
            m = m_new
        # this split's partials (a split past the query's row leaves m = -inf, l = 0, o = 0)
        base = (h * SPLITS + s).to(tl.int64) * BLOCK_G
        tl.store(part_o + (base + g)[:, None] * BLOCK_D + d[None, :], acc)
        tl.store(part_ml + (base + g) * 2, m)
        tl.store(part_ml + (base + g) * 2 + 1, lsum)
        done = tl.atomic_add(count_ptr + h, 1, sem="acq_rel")
        if done == SPLITS - 1:
            # the last split of head h: combine every split's partials (read past L1: other SMs wrote them)
            top = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
            for i in tl.static_range(SPLITS):                                 # unrolled: the loads overlap
                top = tl.maximum(top, tl.load(part_ml + ((h * SPLITS + i).to(tl.int64) * BLOCK_G + g) * 2,
                                              cache_modifier=".cg"))
            denom = tl.zeros((BLOCK_G,), dtype=tl.float32)
            out = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
            for i in tl.static_range(SPLITS):
                row_i = (h * SPLITS + i).to(tl.int64) * BLOCK_G + g                     # [BG]
                m_i = tl.load(part_ml + row_i * 2, cache_modifier=".cg")
                w_i = tl.where(m_i == float("-inf"), 0.0, tl.exp2(m_i - top))          # a split with no keys: 0
                denom += w_i * tl.load(part_ml + row_i * 2 + 1, cache_modifier=".cg")
                out += w_i[:, None] * tl.load(part_o + row_i[:, None] * BLOCK_D + d[None, :], cache_modifier=".cg")
            out = out / denom[:, None]
            tl.store(out_ptr + (h * G + g)[:, None] * HD + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=gmask[:, None] & dmask[None, :])
            tl.store(count_ptr + h, 0)


def _interpreted() -> bool:
    """Triton's CPU interpreter multiplies 16-bit tiles in tl.dot as raw integers (seen with bf16): there the
    tiles go to fp32 first (p is still rounded to the cache's dtype), so the tests check the same algorithm."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# On by default since session 39: compiled on the GPU machine it matches SDPA at both shapes' heads (tests:
# test_decode_attention_on_cuda, qwen3-30b's 128-wide and qwen3.6's 256-wide), and because it reads the keys only
# up to the query's row the decode graphs' buckets can double (decode_graph.bucket_of): a long answer records a
# graph 6 times in 32K tokens, not 32 (each 0.5-0.65 s at qwen3.6's 40 layers, s39b).
# FREETOKEN_DECODE_ATTENTION=0 turns it off (SDPA over 1,024-row buckets, as before).
ENABLED = os.environ.get("FREETOKEN_DECODE_ATTENTION", "1") != "0"


FAMILY = "decode_attention"     # its name in runtime/kernels/fallback.py (switched off there after a failure)


def runs_on(device: torch.device) -> bool:
    """Whether the kernel takes this device's decode steps: enabled, Triton installed, a CUDA device, and not
    switched off by a failure in this process (then SDPA over the whole bucket takes them; the decode graphs'
    buckets stop doubling with it)."""
    return ENABLED and HAVE_TRITON and device.type == "cuda" and FAMILY not in fallback.disabled


def available(q: torch.Tensor) -> bool:
    """Whether the kernel runs for this query."""
    return runs_on(q.device)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row: torch.Tensor, *,
                     scale: float, bucket: int) -> torch.Tensor:
    """One token's attention over its cache, in one launch: q [1, H, hd]; keys, values [Hkv, S, hd] (the cache's
    buffers, rows strided, S >= bucket); row [1] (device): the query's own row, so it sees keys 0 .. row
    (row < bucket). -> [1, H, hd] in q's dtype. `bucket` (a host integer, the recorded graph's) sizes the split;
    the keys actually read are the first row + 1."""
    if q.ndim != 3 or q.shape[0] != 1:
        raise ValueError(f"decode_attention: q must be [1, H, hd] (one token), got {tuple(q.shape)}")
    _, h, hd = q.shape
    hkv = keys.shape[0]
    if keys.shape != values.shape or keys.shape[2] != hd or keys.stride() != values.stride() or h % hkv:
        raise ValueError(f"decode_attention: keys {tuple(keys.shape)} / values {tuple(values.shape)} (strides "
                         f"{keys.stride()}, {values.stride()}) do not fit q {tuple(q.shape)}: [Hkv, S, hd] each, "
                         f"one layout, H a multiple of Hkv")
    if keys.stride(2) != 1 or not 1 <= bucket <= keys.shape[1] or row.numel() != 1:
        raise ValueError(f"decode_attention: rows must be contiguous, bucket {bucket} within the cache's "
                         f"{keys.shape[1]} rows, and row one element (got {tuple(row.shape)})")
    counts = _counters.get(q.device)
    if counts is None or counts.numel() < hkv:
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode_attention: first call during a CUDA graph capture (its counter buffer must "
                               "exist before); run the step once eagerly first")
        counts = _counters[q.device] = torch.zeros(max(hkv, 64), dtype=torch.int32, device=q.device)
    g = h // hkv
    splits = min(MAX_SPLITS, triton.cdiv(bucket, BLOCK_S))
    splits = triton.next_power_of_2(splits) if splits > 1 else 1
    chunk = triton.cdiv(triton.cdiv(bucket, splits), BLOCK_S) * BLOCK_S
    block_g, block_d = max(MIN_HEADS, triton.next_power_of_2(g)), triton.next_power_of_2(hd)
    qc = q.contiguous()
    out = torch.empty_like(qc)
    part_o = torch.empty((hkv, splits, block_g, block_d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((hkv, splits, block_g, 2), dtype=torch.float32, device=q.device)
    _decode_attention_kernel[(hkv, splits)](
        qc, keys, values, row, out, part_o, part_ml, counts, keys.stride(0), keys.stride(1),
        float(scale) * 1.4426950408889634, g, hd, chunk, SPLITS=splits, BLOCK_S=BLOCK_S,
        BLOCK_G=block_g, BLOCK_D=block_d, DOT_FP32=q.dtype == torch.float32 or _interpreted())
    return out
