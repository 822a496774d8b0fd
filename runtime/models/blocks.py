"""Shared building blocks of the model families: norms, rotary, attention over a KV cache, MLPs, routing.

Shape legend: N new tokens of the batch (all sequences end to end), T new tokens of one sequence,
S cached keys of that sequence (including the new ones), D hidden, H query heads, Hkv key/value
heads, hd head dim, rd rotary dims, E experts, K experts per token, V vocabulary.

Parameter names mirror the Hugging Face checkpoints (q_proj, input_layernorm, ...) so that a family's
weight map is mostly the identity.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.experts.interface import Experts
from runtime.kernels import decode_attention_triton, fallback, norm_rope_triton, router_triton
from runtime.models.base import Batch

# ---------------------------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, normalised in fp32. Three flavours that differ in where the cast sits:

    "llama"     w * x̂.to(dtype)              Qwen3-MoE, Mixtral (and q/k norms)
    "fp32"      (w * x̂).to(dtype)            gpt-oss (its norms are kept in fp32)
    "offset"    (x̂ * (1 + w)).to(dtype)      Qwen3-Next / Qwen3.5 (weights initialised at zero)
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, flavour: str = "llama"):
        super().__init__()
        if flavour not in ("llama", "fp32", "offset"):
            raise ValueError(f"unknown RMSNorm flavour {flavour!r}")
        self.eps, self.flavour = eps, flavour
        self.weight = nn.Parameter(torch.zeros(dim) if flavour == "offset" else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if norm_rope_triton.available(x) and (self.flavour != "llama" or self.weight.dtype == x.dtype):
            return fallback.run("norm", lambda: norm_rope_triton.rms_norm(x, self.weight, eps=self.eps,  # one launch
                                                                        flavour=self.flavour),
                                lambda: self.reference(x))
        return self.reference(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, norm(x + residual)): on a GPU one launch instead of two kernels' round trips."""
        if norm_rope_triton.available(x) and x.dtype == residual.dtype and (
                self.flavour != "llama" or self.weight.dtype == x.dtype):
            return fallback.run("norm", lambda: norm_rope_triton.add_rms_norm(x, residual, self.weight, eps=self.eps,
                                                                            flavour=self.flavour),
                                lambda: self._add_and_norm_reference(x, residual))
        return self._add_and_norm_reference(x, residual)

    def _add_and_norm_reference(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + residual
        return x, self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.flavour == "llama":
            return self.weight * xhat.to(dtype)
        if self.flavour == "fp32":
            return (self.weight.float() * xhat).to(dtype)
        return (xhat * (1.0 + self.weight.float())).to(dtype)


# --------------------------------------------------------------------------------------------- rotary


class Rotary(nn.Module):
    """Rotary position embedding, NeoX half-split layout, over the first `rd` dims of each head.

    Plain RoPE and YaRN (the scaled inverse frequencies and the attention factor that multiplies
    cos/sin). `partial_rotary_factor < 1` rotates only the first rd = head_dim * factor dims.
    """

    def __init__(self, *, head_dim: int, theta: float, partial_rotary_factor: float = 1.0,
                 scaling: dict | None = None, max_position_embeddings: int = 4096):
        super().__init__()
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        self._settings = (theta, scaling, max_position_embeddings)
        inv_freq, self.attention_factor = rope_frequencies(self.rotary_dim, theta, scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)   # [rd/2] fp32

    def init_buffers(self, *, device: torch.device | str) -> None:
        """Recompute the frequencies in fp32 (after the model was built on meta and cast)."""
        inv_freq, self.attention_factor = rope_frequencies(self.rotary_dim, *self._settings)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, 1, rd/2] in `dtype` (broadcast over heads)."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]   # [N, rd/2]
        cos = (freqs.cos() * self.attention_factor).to(dtype)
        sin = (freqs.sin() * self.attention_factor).to(dtype)
        return cos[:, None, :], sin[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, heads, hd] -> rotated x; dims past rd pass through."""
        rd = self.rotary_dim
        rot, rest = x[..., :rd], x[..., rd:]
        first, second = rot[..., :rd // 2], rot[..., rd // 2:]
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def rope_frequencies(dim: int, theta: float, scaling: dict | None,
                     max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the attention factor, for plain RoPE, linear scaling or YaRN."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)   # [dim/2]
    inv_freq = 1.0 / pos_freqs
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind != "yarn":
        raise ValueError(f"config.json: unsupported rope scaling type {kind!r} (supported: default, linear, yarn)")
    factor = scaling.get("factor")
    original = scaling["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength makes `rotations` turns over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp      # 1 where frequencies are kept (high frequency), 0 where interpolated
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


# ------------------------------------------------------------------------------------------ attention


# The sinks path materialises scores [H, T, S] in fp32; longer prefill chunks are split to stay under this.
SCORE_BUDGET_BYTES = 256 << 20
# A later prefill chunk on a GPU attends through torch's lower-right flash call, which takes one kv head per query
# head: K and V are copied to the query heads a group at a time, at most this many bytes (a copy of all of them at
# a 30K-token prefix was 2 x 240 MB a layer for qwen3-30b - VRAM the planner never reserved, s32c)
KV_EXPAND_BUDGET_BYTES = 64 << 20


# A single query's attention (a prompt's lone last token, a step beside a prefill: run eagerly) is host-bound: the
# GPU works microseconds. torch's cuDNN backend builds a plan at the first call of each shape, 33-42 ms of host
# time on an H100, and such a query's KV length makes every call a new shape (s34j: 3 calls 34 ms of qwen3.6's 84
# ms lone-token step), so such calls leave it out; flash takes them in 0.05-0.09 ms (s36a; qwen3.6's resent 30K
# conversation to first token 0.68 -> 0.50 s, s37b). Longer chunks keep torch's choice (the GPU's work hides most
# of the host's). FREETOKEN_SDPA_CUDNN=1 keeps it everywhere (A/B runs: benchmarks/device_final.sh s36a, s37b).
SINGLE_QUERY_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SINGLE_QUERY_WITHOUT_CUDNN = os.environ.get("FREETOKEN_SDPA_CUDNN") != "1"
SINGLE_QUERY_DEVICES = ("cuda",)             # where SDPA has a cuDNN backend to leave out


def _min_queries(text: str | None, default: int = 2) -> int:
    """FREETOKEN_SDPA_CUDNN_MIN_QUERIES as a count; a value that is not one is said and ignored (an A/B switch must
    not stop the engine from importing)."""
    try:
        return default if text is None else max(1, int(text))
    except ValueError:
        logging.getLogger(__name__).warning("FREETOKEN_SDPA_CUDNN_MIN_QUERIES=%r is not a number of queries; "
                                            "using %d", text, default)
        return default


# Chunks of fewer queries than this leave cuDNN out too. 2: only a single query does. A prompt's first chunk pays
# cuDNN's first-call cost once per new length (~40 ms, in a short prompt's time to first token) and may run faster
# on the GPU than flash at 16K; the env var is for the A/B that decides it (device_final.sh s37d).
CUDNN_MIN_QUERIES = _min_queries(os.environ.get("FREETOKEN_SDPA_CUDNN_MIN_QUERIES"))


def _without_cudnn(q: torch.Tensor, t: int):
    """The SDPA backend context for a call of `t` queries: cuDNN left out below CUDNN_MIN_QUERIES (on CUDA)."""
    if t < CUDNN_MIN_QUERIES and SINGLE_QUERY_WITHOUT_CUDNN and q.device.type in SINGLE_QUERY_DEVICES:
        return sdpa_kernel(SINGLE_QUERY_BACKENDS)
    return contextlib.nullcontext()


def causal_window_mask(first_pos: int, t: int, s: int, sliding_window: int | None, *,
                       device: torch.device) -> torch.Tensor:
    """[T, S] bool: query i (at position first_pos + i) may see key j."""
    qpos = torch.arange(first_pos, first_pos + t, device=device)[:, None]       # [T, 1]
    kpos = torch.arange(s, device=device)[None, :]                                # [1, S]
    allowed = kpos <= qpos
    if sliding_window is not None:
        allowed = allowed & (qpos - kpos < sliding_window)
    return allowed


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float,
           sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence's T new queries over its S cached keys (the new ones last).

    q [H, T, hd], keys/values [Hkv, S, hd] -> [H, T, hd]. A query at position p sees keys j <= p, and
    with a sliding window W only p - j < W (the window includes the query itself). `sinks` [H] adds
    gpt-oss's per-head learned logit to the softmax denominator.
    """
    h, t, hd = q.shape
    hkv, s, _ = keys.shape
    first_pos = s - t
    if sliding_window is not None:
        # keys older than the first query's window are never seen: drop them before the matmul
        lo = max(0, first_pos - sliding_window + 1)
        keys, values, first_pos, s = keys[:, lo:], values[:, lo:], first_pos - lo, s - lo
    if sinks is None and first_pos == 0 and t > 1 and (sliding_window is None or t <= sliding_window):
        # a chunk that starts the sequence (S == T): plain causal, which the flash kernels take (an explicit
        # [T, S] mask would rule them out: at 8K tokens that was half of a prefill layer's time)
        with _without_cudnn(q, t):
            return F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True, scale=scale,
                                                  enable_gqa=h != hkv)[0]
    if sinks is None and t > 1 and (sliding_window is None or s <= sliding_window):
        # a later chunk of a long prompt (S > T): causal aligned to the bottom right. On a GPU the flash kernel
        # takes it (torch's CausalBias) where an explicit [T, S] mask would force the slow masked kernel: at
        # 16K tokens the second 8K chunk took twice the first
        return _attend_lower_right(q, keys, values, scale=scale)
    # one query sees every key left after the window cut: no mask to build (decode's common case)
    allowed = None if t == 1 else causal_window_mask(first_pos, t, s, sliding_window, device=q.device)  # [T, S]
    if sinks is None:
        with _without_cudnn(q, t):
            return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=allowed,
                                                  scale=scale, enable_gqa=h != hkv)[0]
    if h * t * s * 4 > SCORE_BUDGET_BYTES and t > 1:
        # the explicit scores of a long prefill chunk would not fit: attend in query blocks, each over
        # the keys up to its last query (the recursion re-derives positions and the window cut)
        step = max(1, SCORE_BUDGET_BYTES // (h * s * 4))
        return torch.cat([attend(q[:, i:i + step], keys[:, :first_pos + min(i + step, t)],
                                 values[:, :first_pos + min(i + step, t)], scale=scale,
                                 sliding_window=sliding_window, sinks=sinks) for i in range(0, t, step)], dim=1)
    # sinks: softmax over [scores, sink] then drop the sink column, so a head may attend to nothing
    g = h // hkv
    qg = q.reshape(hkv, g, t, hd)                                                 # [Hkv, G, T, hd]
    scores = torch.matmul(qg, keys[:, None].transpose(-1, -2)) * scale            # [Hkv, G, T, S]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.reshape(hkv, g, 1, 1).to(scores.dtype).expand(hkv, g, t, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(values.dtype)             # [Hkv, G, T, S]
    return torch.matmul(probs, values[:, None]).reshape(h, t, hd)


def _attend_lower_right(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float) -> torch.Tensor:
    """q [H, T, hd] over keys/values [Hkv, S, hd], S >= T, query i at position S - T + i: [H, T, hd]."""
    from torch.nn.attention.bias import causal_lower_right    # here: importing it pulls in torch._dynamo (~1.5 s)

    h, t, _ = q.shape
    hkv, s, _ = keys.shape
    bias = causal_lower_right(t, s)
    if not (q.is_cuda and h != hkv):
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=bias, scale=scale,
                                              enable_gqa=h != hkv)[0]
    return _attend_expanded(q, keys, values, bias, scale=scale)


def _attend_expanded(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias, *, scale: float,
                     budget: int = KV_EXPAND_BUDGET_BYTES) -> torch.Tensor:
    """Grouped-query attention through a call that takes one kv head per query head (torch's lower-right flash):
    the query heads in groups of m sharing a kv head (m the largest divisor of the group size whose copy of K and
    V fits `budget`), each group's kv head copied m times. q [H, T, hd], keys/values [Hkv, S, hd] -> [H, T, hd]."""
    h, _, hd = q.shape
    hkv, s, _ = keys.shape
    g = h // hkv
    per_head = 2 * s * hd * keys.element_size()
    m = max([d for d in range(1, g + 1) if g % d == 0 and d * per_head <= budget], default=1)
    out = q.new_empty(q.shape)
    for first in range(0, h, m):
        kv = first // g
        k = keys[kv:kv + 1].expand(m, s, hd).contiguous()
        v = values[kv:kv + 1].expand(m, s, hd).contiguous()
        out[first:first + m] = F.scaled_dot_product_attention(q[None, first:first + m], k[None], v[None],
                                                              attn_mask=bias, scale=scale)[0]
    return out


def attend_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, layer: int, *,
                 scale: float, sliding_window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Store k, v in each sequence's cache and attend: q [N, H, hd], k/v [N, Hkv, hd] -> [N, H, hd]."""
    if batch.static_kv is not None:
        return attend_static_batch(q, k, v, batch, layer, scale=scale)
    outs = []
    for rows, cache in batch.segments(layer):
        keys, values = cache.update_and_fetch(k[rows].transpose(0, 1), v[rows].transpose(0, 1))  # [Hkv, S, hd]
        o = attend(q[rows].transpose(0, 1), keys, values, scale=scale, sliding_window=sliding_window, sinks=sinks)
        outs.append(o.transpose(0, 1))                                                         # [T, H, hd]
    # sequences' rows are laid end to end in order: one cat, not a copy into a preallocated output per sequence
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def attend_static_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, layer: int, *,
                        scale: float, k_norm: RMSNorm | None = None, rope: Rotary | None = None,
                        cos_sin=None) -> torch.Tensor:
    """The static decode step of B sequences, one new token each (row i is sequence i): `attend_static` per
    sequence over its own KV buffers, at its own row and bucket (`batch.static_kv[i]`). q [B, H, hd],
    k/v [B, Hkv, hd] -> [B, H, hd]; cos_sin [B, 1, rd/2] x2 when k arrives unrotated."""
    statics, caches = batch.static_kv, batch.caches
    if len(caches) == 1:
        return attend_static(q, k, v, caches[0].layers[layer], statics[0], scale=scale, k_norm=k_norm, rope=rope,
                             cos_sin=cos_sin)
    outs = [attend_static(q[i:i + 1], k[i:i + 1], v[i:i + 1], cache.layers[layer], static, scale=scale,
                          k_norm=k_norm, rope=rope,
                          cos_sin=None if cos_sin is None else (cos_sin[0][i:i + 1], cos_sin[1][i:i + 1]))
            for i, (cache, static) in enumerate(zip(caches, statics))]
    return torch.cat(outs)                                                                     # [B, H, hd]


def attend_static(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, static, *, scale: float,
                  k_norm: RMSNorm | None = None, rope: Rotary | None = None, cos_sin=None) -> torch.Tensor:
    """One sequence, one new token, no host integers (runtime/decode_graph.py records this in a CUDA graph):
    k, v go to row `static.write_at` of the cache's buffers and the query attends over the first
    `static.bucket` rows, masked past its own position. q [1, H, hd], k/v [1, Hkv, hd] -> [1, H, hd].
    With `rope` (and `cos_sin`, optionally `k_norm`) k arrives as projected and is normed, rotated and written
    by `store_rotated_kv` (one launch on a GPU); without, k is already rotated. On a GPU the attention itself
    is runtime/kernels/decode_attention_triton.py (one launch, only the keys up to the query's row), SDPA over
    the bucket with the step's mask elsewhere. The cache's offset is advanced by the caller."""
    if rope is not None:
        store_rotated_kv(k, v, cache, static.write_at, k_norm, rope, cos_sin)
    else:
        cache.keys.index_copy_(1, static.write_at, k.transpose(0, 1))
        cache.values.index_copy_(1, static.write_at, v.transpose(0, 1))

    def reference() -> torch.Tensor:
        keys, values = cache.keys[:, :static.bucket], cache.values[:, :static.bucket]  # [Hkv, bucket, hd]
        h, hd, hkv = q.shape[1], q.shape[2], keys.shape[0]
        o = F.scaled_dot_product_attention(q.reshape(1, h, 1, hd), keys[None], values[None],
                                           attn_mask=_additive_mask(static, q.dtype, h), scale=scale,
                                           enable_gqa=h != hkv)                          # [1, H, 1, hd]
        return o.reshape(1, h, hd)

    if decode_attention_triton.available(q) and q.dtype == cache.keys.dtype:
        # one launch that reads only the keys up to the query's row (no mask; SDPA took two cuDNN kernels)
        return fallback.run(decode_attention_triton.FAMILY, lambda: decode_attention_triton.decode_attention(
            q, cache.keys, cache.values, static.write_at, scale=scale, bucket=static.bucket), reference)
    return reference()


def _additive_mask(static, dtype: torch.dtype, heads: int) -> torch.Tensor:
    """The step's key mask (`static.mask`, [1, bucket] bool) as the additive bias SDPA uses, materialised at
    its full shape [1, H, 1, bucket] of 0 / -inf, made once per step (on the step's StaticKV, new each step)
    and shared by every layer: given the bool mask, SDPA converts it on every call (zeros_like, logical_not,
    masked_fill, and an expansion where the backend wants one: launches in each layer of the recorded graph)."""
    made = static.__dict__.get("_additive_mask")
    if made is None or made.dtype != dtype or made.shape[1] != heads:
        mask = static.mask
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        made = bias[None, None].expand(1, heads, *mask.shape).contiguous()             # [1, H, 1, bucket]
        static.__dict__["_additive_mask"] = made
    return made


def store_rotated_kv(k: torch.Tensor, v: torch.Tensor, cache, rows: torch.Tensor, norm: RMSNorm | None,
                     rope: Rotary, cos_sin) -> None:
    """k normed (when the model has a k norm) and rotated into the cache's keys at `rows` [N] (a device tensor),
    v into its values at the same rows: k, v [N, Hkv, hd]. On a GPU one launch (norm_rope_triton.norm_rope_store)
    instead of the norm+rope kernel, the rotated k's temporary and two index_copy_ kernels."""
    def reference() -> None:
        cache.keys.index_copy_(1, rows, norm_and_rotate(k, norm, rope, cos_sin).transpose(0, 1))
        cache.values.index_copy_(1, rows, v.transpose(0, 1))

    if norm_rope_triton.available(k) and k.dtype == cache.keys.dtype and (
            norm is None or norm.flavour != "llama" or norm.weight.dtype == k.dtype):
        return fallback.run("norm_rope", lambda: norm_rope_triton.norm_rope_store(
            k, v, *cos_sin, cache.keys, cache.values, rows, weight=None if norm is None else norm.weight,
            eps=1e-6 if norm is None else norm.eps, flavour="llama" if norm is None else norm.flavour,
            rotary_dim=rope.rotary_dim), reference)
    return reference()


def norm_and_rotate(x: torch.Tensor, norm: RMSNorm | None, rope: Rotary, cos_sin) -> torch.Tensor:
    """Per-head RMSNorm (when the model has one) then the rotary embedding: x [N, heads, hd]. On a GPU one
    fused launch (runtime/kernels/norm_rope_triton.py) instead of ~15, with the same rounding."""
    def reference() -> torch.Tensor:
        return rope.apply(x if norm is None else norm.reference(x), *cos_sin)

    if norm_rope_triton.available(x) and (norm is None or norm.flavour != "llama" or norm.weight.dtype == x.dtype):
        return fallback.run("norm_rope", lambda: norm_rope_triton.norm_rope(
            x, *cos_sin, weight=None if norm is None else norm.weight, eps=1e-6 if norm is None else norm.eps,
            flavour="llama" if norm is None else norm.flavour, rotary_dim=rope.rotary_dim), reference)
    return reference()


class Attention(nn.Module):
    """Multi-head attention with GQA over the KV cache; options cover Qwen3 (q/k norm), gpt-oss (biases,
    sinks, sliding window) and Mixtral (plain)."""

    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm_eps: float | None = None,
                 sinks: bool = False, sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None    # set by fuse_projections()

    def fuse_projections(self) -> None:
        """Lay the q, k and v weights end to end in one tensor (the three parameters become views of it, so no
        memory is added): one GEMM per step instead of three. Called once after the weights are loaded."""
        if self.qkv is not None:
            return
        linears = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([lin.weight.data for lin in linears])                 # [(H + 2 Hkv) hd, D]
        bias = torch.cat([lin.bias.data for lin in linears]) if self.q_proj.bias is not None else None
        start = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight.data = weight[start:start + rows]
            if bias is not None:
                lin.bias.data = bias[start:start + rows]
            start += rows
        self.qkv = (weight, bias)

    def forward(self, x: torch.Tensor, batch: Batch, layer: int, rope: Rotary,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n = x.shape[0]
        hq, hkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv is not None:
            # views of one [N, hq + 2 hkv]; an nn.Module once the dense weights went int8 (models/quantized.py)
            fused = self.qkv(x) if isinstance(self.qkv, nn.Module) else F.linear(x, *self.qkv)
            q, k, v = fused.split([hq, hkv, hkv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(n, self.num_heads, self.head_dim)                         # [N, H, hd]
        k = k.view(n, self.num_kv_heads, self.head_dim)                      # [N, Hkv, hd]
        v = v.view(n, self.num_kv_heads, self.head_dim)                      # [N, Hkv, hd]
        q = norm_and_rotate(q, self.q_norm, rope, cos_sin)
        if batch.static_kv is not None:
            # the static decode step: k's norm+rope and both cache writes in one launch (on a GPU)
            o = attend_static_batch(q, k, v, batch, layer, scale=self.scale, k_norm=self.k_norm, rope=rope,
                                    cos_sin=cos_sin)
        else:
            k = norm_and_rotate(k, self.k_norm, rope, cos_sin)
            o = attend_batch(q, k, v, batch, layer, scale=self.scale, sliding_window=self.sliding_window,
                             sinks=self.sinks)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


# ---------------------------------------------------------------------------------------------- MLPs


class DenseMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate x) * up x), for dense layers and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route_softmax_topk(logits: torch.Tensor, k: int, *, renormalize: bool,
                       out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen/Mixtral routing: softmax in fp32 over all E experts, top-k, optionally renormalised over the k.

    logits [N, E] -> ids [N, K] int64, weights [N, K] (computed in fp32, returned in `out_dtype`). On a GPU
    one Triton launch (runtime/kernels/router_triton.py) instead of five.
    """
    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(out_dtype)

    if router_triton.HAVE_TRITON and logits.is_cuda:
        return fallback.run("router", lambda: router_triton.route(logits, k, mode="softmax_topk",
                                                                  renormalize=renormalize, out_dtype=out_dtype),
                            reference)
    return reference()


def route_topk_softmax(logits: torch.Tensor, k: int, *,
                       out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: top-k on the raw logits, then softmax over those k. [N, E] -> ids, weights [N, K]."""
    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(logits, k, dim=-1)
        return ids, torch.softmax(top, dim=-1).to(out_dtype)

    if router_triton.HAVE_TRITON and logits.is_cuda:
        return fallback.run("router", lambda: router_triton.route(logits, k, mode="topk_softmax", out_dtype=out_dtype),
                            reference)
    return reference()


class SparseMoE(nn.Module):
    """Router + a call into the expert tier. The router is `gate` (Linear to E logits, optional bias);
    `routing` turns logits into (ids, weights); experts live wherever `experts` keeps them."""

    def __init__(self, *, hidden_size: int, num_experts: int, top_k: int,
                 routing: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
                 router_bias: bool = False, router_name: str = "gate"):
        super().__init__()
        self.top_k, self.routing, self.router_name = top_k, routing, router_name
        setattr(self, router_name, nn.Linear(hidden_size, num_experts, bias=router_bias))

    def forward(self, x: torch.Tensor, layer: int, experts: Experts) -> torch.Tensor:
        fused = _fused_routing(self.routing)
        if fused is not None and x.is_cuda and router_triton.HAVE_TRITON and x.shape[0] <= router_triton.LINEAR_MAX_ROWS:
            # decode: the router's GEMV and the routing in one launch (2 fewer per MoE layer, ~2 µs on an H200)
            gate = getattr(self, self.router_name)
            mode, renormalize = fused
            ids, weights = fallback.run("router_linear", lambda: router_triton.route_linear(
                x, gate.weight, gate.bias, self.top_k, mode=mode, renormalize=renormalize, out_dtype=x.dtype),
                lambda: self.routing(gate(x), self.top_k, out_dtype=x.dtype))
            return experts(layer, x, ids, weights)
        logits = getattr(self, self.router_name)(x)                         # [N, E]
        ids, weights = self.routing(logits, self.top_k, out_dtype=x.dtype)  # [N, K], [N, K]
        return experts(layer, x, ids, weights)                              # [N, D]


def _fused_routing(routing) -> tuple[str, bool] | None:
    """(mode, renormalize) of router_triton.route_linear for the routings it covers, else None."""
    func = getattr(routing, "func", routing)
    keywords = getattr(routing, "keywords", {}) or {}
    if func is route_softmax_topk and set(keywords) <= {"renormalize"}:
        return "softmax_topk", bool(keywords.get("renormalize", False))
    if func is route_topk_softmax and not keywords:
        return "topk_softmax", False
    return None


# -------------------------------------------------------------------------------- decoder (pre-norm)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); `mlp` is a DenseMLP or a SparseMoE."""

    def __init__(self, *, attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, norm_flavour: str,
                 mlp_name: str = "mlp"):
        super().__init__()
        self.self_attn = attn
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)
        self.input_layernorm = RMSNorm(hidden_size, eps=eps, flavour=norm_flavour)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=eps, flavour=norm_flavour)

    def forward(self, x: torch.Tensor, batch: Batch, layer: int, rope: Rotary, cos_sin, experts: Experts,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; `pending`: the previous layer's MLP output, not yet added (so that the add
        fuses with this layer's first norm). Returns (the stream, this layer's MLP output, not yet added)."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, pending)
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, batch, layer, rope, cos_sin))
        mlp = getattr(self, self.mlp_name)
        return x, (mlp(h, layer, experts) if isinstance(mlp, SparseMoE) else mlp(h))


class DecoderStack(nn.Module):
    """Embeddings, decoder layers and the final norm: the checkpoint's `model.*` tensors."""

    def __init__(self, *, vocab_size: int, hidden_size: int, layers: list[nn.Module], eps: float,
                 norm_flavour: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps=eps, flavour=norm_flavour)

    def forward(self, batch: Batch, rope: Rotary, experts: Experts) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)                              # [N, D]
        cos_sin = rope.cos_sin(batch.positions, x.dtype)                    # [N, 1, rd/2] x2
        pending = None
        for i, layer in enumerate(self.layers):
            x, pending = layer(x, batch, i, rope, cos_sin, experts, pending)
        return self.norm(x) if pending is None else self.norm.add_and_norm(x, pending)[1]
