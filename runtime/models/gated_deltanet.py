"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5/3.6-MoE.

Per value head the layer keeps a matrix state S [dk, dv] and, for each token t,
    S <- exp(g_t) * S                      (gated decay, g_t <= 0)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T (delta rule: write only what S does not already predict)
    o_t = S^T q_t
with q, k L2-normalised and q scaled by dk^-1/2. Inputs reach the rule through a depthwise causal
conv1d (kernel W = 4, SiLU) over the packed [q | k | v] channels; the output goes through a gated
RMSNorm w * rmsnorm(o) * silu(z) and out_proj.

Two forms of the rule, identical in exact arithmetic: `recurrent_gated_delta_rule` (one token at a
time; decode and the reference) and `chunked_gated_delta_rule` (blocks of 64 tokens solved with a
triangular system; prefill). On CUDA, `fla-core`'s Triton kernels replace both when importable and
the activations are 16-bit; fp32 runs the exact torch path (fla releases before 0.6 refuse fp32 in the
chunked kernel, and fp32 is what the parity tests compare). Checked against fla-core 0.6.0's API.

Checkpoint spellings: Qwen3-Next packs `in_proj_qkvz` [Hk * (2dk + 2r dv), D] and `in_proj_ba`
[Hk * 2r, D] grouped per key head (r = Hv / Hk value heads per key head); Qwen3.5 stores
`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` separately, already in [q | k | v] order. The
layer keeps the checkpoint's own parameters (the strict loader maps names 1:1, no copy at load) and
regroups the packed projection's output per token instead.

Shapes: B sequences, T tokens, D hidden, Hk key heads, Hv value heads, r = Hv // Hk, dk key head dim,
dv value head dim, C = 2 Hk dk + Hv dv conv channels, W conv kernel width, L chunk length, N chunks.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from runtime.experts.planner import LINEAR_PREFILL_PIECE_TOKENS
from runtime.kernels import gdn_decode_triton

log = logging.getLogger(__name__)

CHUNK_SIZE = 64           # tokens per block of the chunked form (what fla and transformers use)
L2NORM_EPS = 1e-6         # inside the kernel's q/k normalisation (fla's constant)
# A prefill chunk longer than LINEAR_PREFILL_PIECE_TOKENS runs through the layer in pieces (the planner's constant:
# it reserves their transients), the states carried from piece to piece exactly as between the engine's chunks
PREFILL_PIECE_TOKENS = LINEAR_PREFILL_PIECE_TOKENS
# the fused decode step (runtime/kernels/gdn_decode_triton.py) on GPUs; FREETOKEN_GDN_DECODE=0 keeps the torch form
FUSED_DECODE = os.environ.get("FREETOKEN_GDN_DECODE", "1") != "0"
FUSED_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}   # relative, first use
_fused_checked: dict[tuple, bool] = {}   # (layer sizes, dtype, device) -> the fused step agreed with the torch form


class GatedDeltaNetError(ValueError):
    """A checkpoint or state that does not fit the layer; the message names the tensor."""


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """The layer's sizes; field names follow config.json's `linear_*` keys."""
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6

    @classmethod
    def from_config(cls, config: dict) -> "GatedDeltaNetConfig":
        cfg = cls(hidden_size=config["hidden_size"], num_k_heads=config["linear_num_key_heads"],
                  num_v_heads=config["linear_num_value_heads"], head_k_dim=config["linear_key_head_dim"],
                  head_v_dim=config["linear_value_head_dim"],
                  conv_kernel=config.get("linear_conv_kernel_dim", 4), norm_eps=config.get("rms_norm_eps", 1e-6))
        if cfg.num_v_heads % cfg.num_k_heads:
            raise GatedDeltaNetError(f"linear_num_value_heads ({cfg.num_v_heads}) must be a multiple of "
                                     f"linear_num_key_heads ({cfg.num_k_heads})")
        return cfg

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def heads_per_key(self) -> int:
        return self.num_v_heads // self.num_k_heads

    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


# ---------------------------------------------------------------------------------------------
# The pieces, as plain functions (each is the reference for a fused kernel)
# ---------------------------------------------------------------------------------------------

def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, the way fla normalises q and k."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU, continuing from `conv_state` (the previous W-1 inputs).

    x [B, T, C], conv_state [B, C, W-1], weight [C, W] -> (y [B, T, C], new conv_state [B, C, W-1]).
    A fresh sequence starts from zeros, which is exactly the left zero padding of a plain causal conv.
    Written as W shifted multiply-adds rather than F.conv1d: exact fp32 on every device (cuDNN may use
    TF32 for convolutions) and no convolution-library overhead for a 4-tap filter.
    """
    W = weight.shape[-1]
    T = x.shape[1]
    history = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)     # [B, C, W-1+T]
    w = weight.float()                        # accumulate in fp32 whatever the activation dtype
    y = history[..., 0:T] * w[:, 0:1]
    for i in range(1, W):
        y = y + history[..., i:i + T] * w[:, i:i + 1]                            # [B, C, T] fp32
    # a compact copy: a view would keep the whole [C, W-1+T] history of a prefill chunk alive
    return F.silu(y).to(x.dtype).transpose(1, 2), history[..., history.shape[-1] - (W - 1):].contiguous()


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * rmsnorm(x) * silu(gate) over the last dim (dv); x, gate [..., dv], weight [dv]."""
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)


def _heads_first(q, k, v, g, beta):
    """Shared prologue of both forms: expand key heads to value heads, fp32, [B, H, T, ...], normalise.

    q, k [B, T, Hk, dk], v [B, T, Hv, dv], g, beta [B, T, Hv] -> q, k [B, Hv, T, dk], v [B, Hv, T, dv],
    g, beta [B, Hv, T]; q and k L2-normalised, q scaled by dk^-1/2.
    """
    ratio = v.shape[2] // k.shape[2]
    if ratio > 1:   # each key head serves `ratio` consecutive value heads
        q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, g, beta))
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    return q, l2_normalize(k), v, g, beta


def _initial_state(state: torch.Tensor | None, v: torch.Tensor, dk: int) -> torch.Tensor:
    if state is None:
        return v.new_zeros(v.shape[0], v.shape[1], dk, v.shape[-1])
    return state.to(device=v.device, dtype=torch.float32)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, *, initial_state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule one token at a time. Shapes as `_heads_first` takes them; state [B, Hv, dk, dv] fp32.

    Returns (o [B, T, Hv, dv] in v's dtype, final state [B, Hv, dk, dv] fp32).
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    state = _initial_state(initial_state, v, dk).reshape(B * H, dk, dv)              # [BH, dk, dv]
    decay = g.exp().reshape(B * H, T, 1, 1)
    q, k = q.reshape(B * H, T, 1, dk), k.reshape(B * H, T, 1, dk)
    v, beta = v.reshape(B * H, T, 1, dv), beta.reshape(B * H, T, 1, 1)
    outs = []
    for t in range(T):
        # the first decay makes our own copy (the caller's state may be a prefix-cache snapshot);
        # after that the state is updated in place, one pass over it per operation
        state = state * decay[:, 0] if t == 0 else state.mul_(decay[:, t])
        predicted = torch.bmm(k[:, t], state)                                         # [BH, 1, dv]
        written = (v[:, t] - predicted) * beta[:, t]                                   # [BH, 1, dv]
        state.baddbmm_(k[:, t].transpose(1, 2), written)                               # += k written^T
        outs.append(torch.bmm(q[:, t], state))                                        # [BH, 1, dv]
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(B * H, 0, dv)                 # [BH, T, dv]
    o = o.view(B, H, T, dv).transpose(1, 2)                                           # [B, T, Hv, dv]
    return o.to(out_dtype), state.view(B, H, dk, dv)


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, *, initial_state: torch.Tensor | None = None,
                             chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over blocks of `chunk_size` tokens: same inputs and outputs as the recurrent form.

    Inside a block, with c_t the cumulative log decay since the block start and S0 the incoming state,
    the written values u_t = beta_t (v_t - S_t'^T k_t) depend on each other only through earlier tokens
    of the block, so they solve one unit lower-triangular system (I + A) U = beta V - beta e^c K S0,
    A[t, j] = beta_t e^(c_t - c_j) k_t.k_j for j < t. Then o_t = e^(c_t) S0^T q_t + sum_{j<=t} e^(c_t - c_j)
    (q_t.k_j) u_j and the state leaves as e^(c_L) S0 + sum_j e^(c_L - c_j) k_j u_j^T. Only the hop from
    block to block is sequential.
    """
    out_dtype, seq_len = v.dtype, q.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    state = _initial_state(initial_state, v, q.shape[-1])
    chunk_size = max(1, min(chunk_size, seq_len))     # a short input is one block of its own length, unpadded
    pad = (-seq_len) % chunk_size
    if pad:  # padded tokens have k = v = 0, beta = 0, g = 0: they neither decay nor write the state
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    B, H, Tp, dk = k.shape
    n, L = Tp // chunk_size, chunk_size
    q, k, v = (t.view(B, H, n, L, t.shape[-1]) for t in (q, k, v))                  # [B, H, N, L, d]
    g, beta = g.view(B, H, n, L), beta.view(B, H, n, L)

    c = g.cumsum(-1)                                                                 # [B, H, N, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()              # j <= t
    rel = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B,H,N,L,L] e^(c_t-c_j)
    kb = k * beta[..., None]
    strict = torch.tril(kb @ k.transpose(-1, -2) * rel, diagonal=-1)                 # A, j < t
    system = strict + torch.eye(L, dtype=q.dtype, device=q.device)
    u_from_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    u_from_s = torch.linalg.solve_triangular(system, kb * c.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * rel                                          # [B, H, N, L, L]
    q_decayed = q * c.exp()[..., None]                                                # reads S0 at time t
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]                                 # decays to block end
    block_decay = c[..., -1].exp()[..., None, None]                                   # [B, H, N, 1, 1]

    out = torch.empty_like(v)                                                         # [B, H, N, L, dv]
    for i in range(n):
        u = u_from_v[:, :, i] - u_from_s[:, :, i] @ state                             # [B, H, L, dv]
        out[:, :, i] = q_decayed[:, :, i] @ state + scores[:, :, i] @ u
        state = state * block_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    o = out.view(B, H, Tp, -1)[:, :, :seq_len].transpose(1, 2)                        # [B, T, Hv, dv]
    return o.to(out_dtype), state


# ---------------------------------------------------------------------------------------------
# fla-core on CUDA
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def fla_kernels() -> tuple[Callable, Callable] | None:
    """(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule) from fla-core, or None if absent."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:   # not installed (CPU machines, CI): the torch path runs
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def fla_usable(x: torch.Tensor) -> bool:
    """fla for 16-bit activations on CUDA; fp32 keeps the exact torch path."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and fla_kernels() is not None


def fla_gated_delta_rule(q, k, v, g, beta, *, initial_state: torch.Tensor | None, recurrent: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule through fla-core's kernels; same contract as the torch forms (final state fp32).

    Key heads are expanded to value heads here, because fla versions differ in whether they accept
    grouped value heads; every version accepts equal counts. Keywords only: argument order moved between
    fla releases (gk/gv were inserted before beta).
    """
    chunk, fused_recurrent = fla_kernels()
    if not recurrent:
        # q and k normalised here (fp32, as fla does) rather than in fla's chunked kernel: fla-core 0.6's l2norm
        # compiles and autotunes a variant for each 65,536-row bucket a call fills (rows: tokens x heads), ~10 s each
        # at a machine's first prompts - one for an 8K chunk, others for shorter last chunks, none of which a short
        # warm-up prompt meets (s28b/s29a). These few elementwise ops cost nothing measurable (s29d: a warm 16K
        # prompt 0.23 s, against 0.32 s with fla's l2norm)
        q, k = (l2_normalize(t.float()).to(t.dtype) for t in (q, k))
    ratio = v.shape[2] // k.shape[2]
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
    state = None if initial_state is None else initial_state.float().contiguous()
    kernel = fused_recurrent if recurrent else chunk
    o, final = kernel(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.float().contiguous(),
                      beta=beta.contiguous(), scale=q.shape[-1] ** -0.5, initial_state=state,
                      output_final_state=True, use_qk_l2norm_in_kernel=recurrent)
    return o, final.float()


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------

class GatedDeltaNet(torch.nn.Module):
    """One Gated DeltaNet token mixer. Stateless itself: the caller passes and receives the states.

    Parameter names and shapes are the checkpoint's own (so the strict loader maps them 1:1): with
    `packed=True` (Qwen3-Next) `in_proj_qkvz` and `in_proj_ba`, else (Qwen3.5) `in_proj_qkv`, `in_proj_z`,
    `in_proj_b`, `in_proj_a`; then `conv1d.weight` [C, 1, W], `A_log`, `dt_bias`, `norm.weight`,
    `out_proj.weight`.

    `forward(x [B, T, D], conv_state [B, C, W-1], recurrent_state [B, Hv, dk, dv])` returns
    (y [B, T, D], new conv_state, new recurrent_state fp32). Every row of the batch is one sequence
    continuing from its own state; a new sequence passes zeros (`new_states`). T == 1 takes the
    recurrent form, longer inputs the chunked form (which the recurrent form reproduces; see the tests).
    """

    def __init__(self, cfg: GatedDeltaNetConfig, *, packed: bool, backend: str = "auto"):
        super().__init__()
        if backend not in ("auto", "torch", "fla"):
            raise ValueError(f"unknown Gated DeltaNet backend {backend!r} (auto, torch or fla)")
        self.cfg, self.packed, self.backend = cfg, packed, backend
        D, C, Hv = cfg.hidden_size, cfg.conv_dim, cfg.num_v_heads
        if packed:
            self.in_proj_qkvz = torch.nn.Linear(D, C + cfg.value_dim, bias=False)
            self.in_proj_ba = torch.nn.Linear(D, 2 * Hv, bias=False)
        else:
            self.in_proj_qkv = torch.nn.Linear(D, C, bias=False)
            self.in_proj_z = torch.nn.Linear(D, cfg.value_dim, bias=False)
            self.in_proj_b = torch.nn.Linear(D, Hv, bias=False)
            self.in_proj_a = torch.nn.Linear(D, Hv, bias=False)
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = torch.nn.Parameter(torch.empty(C, 1, cfg.conv_kernel))      # depthwise, no bias
        self.A_log = torch.nn.Parameter(torch.empty(Hv))
        self.dt_bias = torch.nn.Parameter(torch.empty(Hv))
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.empty(cfg.head_v_dim))
        self.out_proj = torch.nn.Linear(cfg.value_dim, D, bias=False)
        self.requires_grad_(False)

    def new_states(self, batch: int, *, device=None, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero states for `batch` fresh sequences: conv [B, C, W-1] (activation dtype), recurrent fp32."""
        cfg = self.cfg
        like = self.conv1d.weight                 # never quantized (models/quantized.py): the layer's device, dtype
        device = device or like.device
        conv = torch.zeros(batch, *cfg.conv_state_shape(), device=device, dtype=dtype or like.dtype)
        rec = torch.zeros(batch, *cfg.recurrent_state_shape(), device=device, dtype=torch.float32)
        return conv, rec

    def _use_fla(self, x: torch.Tensor) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "fla":
            if not fla_usable(x):
                raise GatedDeltaNetError("backend 'fla' needs fla-core installed, a CUDA device and 16-bit activations")
            return True
        return fla_usable(x)

    def project(self, x: torch.Tensor):
        """x [B, T, D] -> mixed [B, T, C] ([q | k | v], the conv's channel order), z [B, T, Hv, dv],
        b and a [B, T, Hv]."""
        cfg = self.cfg
        B, T, D = x.shape
        Hk, Hv, dk, dv, r = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.heads_per_key
        x2 = x.reshape(B * T, D)     # 2-D matmuls: a strided 3-D input would take a slow batched path
        if self.packed:
            # rows are grouped per key head: [q (dk) | k (dk) | v (r dv) | z (r dv)] and [b (r) | a (r)]
            qkvz = self.in_proj_qkvz(x2).view(B, T, Hk, 2 * dk + 2 * r * dv)
            q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
            b, a = torch.split(self.in_proj_ba(x2).view(B, T, Hk, 2 * r), [r, r], dim=-1)
            mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
            return mixed, z.reshape(B, T, Hv, dv), b.reshape(B, T, Hv), a.reshape(B, T, Hv)
        return (self.in_proj_qkv(x2).view(B, T, -1), self.in_proj_z(x2).view(B, T, Hv, dv),
                self.in_proj_b(x2).view(B, T, Hv), self.in_proj_a(x2).view(B, T, Hv))

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T, piece = x.shape[1], PREFILL_PIECE_TOKENS
        if not piece or T <= piece:
            return self._forward(x, conv_state, recurrent_state)
        y = x.new_empty(x.shape)
        for start in range(0, T, piece):
            y[:, start:start + piece], conv_state, recurrent_state = self._forward(
                x[:, start:start + piece], conv_state, recurrent_state)
        return y, conv_state, recurrent_state

    def _forward(self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One pass over all of x (forward's contract)."""
        cfg = self.cfg
        B, T, _ = x.shape
        mixed, z, b, a = self.project(x)
        mixed, conv_state = causal_conv1d(mixed, conv_state, self.conv1d.weight.squeeze(1))   # [B, T, C]
        q, k, v = torch.split(mixed, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        q = q.reshape(B, T, cfg.num_k_heads, cfg.head_k_dim)
        k = k.reshape(B, T, cfg.num_k_heads, cfg.head_k_dim)
        v = v.reshape(B, T, cfg.num_v_heads, cfg.head_v_dim)
        beta = b.sigmoid()                                                            # [B, T, Hv]
        # fp32: exp(A_log) in 16 bits loses the decay
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [B, T, Hv] log decay <= 0
        if self._use_fla(x):
            o, recurrent_state = fla_gated_delta_rule(q, k, v, g, beta, initial_state=recurrent_state,
                                                      recurrent=T == 1)
        elif T == 1:
            o, recurrent_state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=recurrent_state)
        else:
            o, recurrent_state = chunked_gated_delta_rule(q, k, v, g, beta, initial_state=recurrent_state)
        o = gated_rms_norm(o, z, self.norm.weight, cfg.norm_eps)                      # [B, T, Hv, dv]
        y = self.out_proj(o.reshape(B * T, cfg.value_dim)).view(B, T, -1)             # [B, T, D]
        return y, conv_state, recurrent_state

    # -- decode, states in place --------------------------------------------------------------------

    def decode_in_place(self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
                        slots: torch.Tensor | None = None) -> torch.Tensor:
        """One token per sequence through the fused kernels: x [B, D] -> y [B, D]; the states at rows `slots`
        [B] of conv [S, C, W-1] and recurrent [S, Hv, dk, dv] (rows 0..B-1 without) are updated in place.
        forward's result up to fp32 rounding (the kernels' file says where it differs)."""
        cfg = self.cfg
        mixed, z, b, a = self.project(x[:, None])                                     # [B, 1, ...]
        o = gdn_decode_triton.gdn_decode(
            mixed[:, 0], z[:, 0], b[:, 0], a[:, 0], conv_state, recurrent_state, conv_weight=self.conv1d.weight,
            A_log=self.A_log, dt_bias=self.dt_bias, norm_weight=self.norm.weight, num_k_heads=cfg.num_k_heads,
            head_k_dim=cfg.head_k_dim, head_v_dim=cfg.head_v_dim, eps=cfg.norm_eps, qk_eps=L2NORM_EPS, slots=slots)
        return self.out_proj(o)                                                       # [B, D]

    def fused_decode_ok(self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
                        slots: torch.Tensor | None = None) -> bool:
        """Whether a decode step with these states should take `decode_in_place`: on a GPU with Triton, once the
        fused step has matched the torch form on copies of these very states (checked at the first use of each
        layer size and dtype; a mismatch logs an error and keeps the torch form for good). Never checked while a
        CUDA graph is being recorded: a first use inside a capture records the torch form."""
        if not (FUSED_DECODE and gdn_decode_triton.available(x)):
            return False
        key = (self.cfg, x.dtype, x.device)
        ok = _fused_checked.get(key)
        if ok is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return False
            ok = _fused_checked[key] = self.check_fused_decode(x, conv_state, recurrent_state, slots)
        return ok

    def check_fused_decode(self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
                           slots: torch.Tensor | None = None) -> bool:
        """The fused step against the torch form on copies of the states (nothing the caller holds changes):
        output and both new states within FUSED_CHECK_TOLERANCE, relative."""
        rows = slots if slots is not None else torch.arange(x.shape[0], device=x.device)
        conv, rec = conv_state.index_select(0, rows), recurrent_state.index_select(0, rows)
        want, want_conv, want_rec = self(x[:, None], conv.clone(), rec.clone())
        got = self.decode_in_place(x, conv, rec)
        tol = FUSED_CHECK_TOLERANCE.get(x.dtype, 2e-2)

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))

        errors = (rel(got, want[:, 0]), rel(conv, want_conv), rel(rec, want_rec))
        if not all(e <= tol for e in errors):       # NaN compares false too
            log.error("the fused Gated DeltaNet decode step disagrees with the torch form (relative errors: output "
                      "%.3g, conv state %.3g, recurrent state %.3g; tolerance %.3g): keeping the torch form",
                      *errors, tol)
            return False
        return True


# ---------------------------------------------------------------------------------------------
# A machine's first prompt
# ---------------------------------------------------------------------------------------------

# Prompt lengths the warm-up runs: a whole number of chunks and one token more. Triton specialises a kernel's integer
# arguments on divisibility by 16, so a prompt of either kind compiles its own variant; the autotuned configs of the
# fla-core kernels we call are keyed on the head sizes, not the length (its l2norm's were: fla_gated_delta_rule), so
# these short prompts choose what every later prompt uses
WARM_UP_TOKENS = (CHUNK_SIZE, CHUNK_SIZE + 1)


def warm_up_prefill_kernels(model: torch.nn.Module, *, fla_only: bool = True) -> int:
    """Run each distinct Gated DeltaNet layer of `model` once on short throwaway prompts, so fla-core's prefill
    kernels compile (and autotune) while the model loads rather than inside the first prompt: a fresh machine's
    first 16K prompt of qwen3.6 took 58 s without it (s28b); with it the load spends 29 s and that prompt 2.5 s
    (s29d). Triton keeps what it compiled (and fla what it autotuned) on disk, so later loads pay ~4 s. The layers
    are stateless: nothing the engine holds changes. Only layers fla would run (CUDA, 16-bit) are warmed, unless
    `fla_only` is off (tests: the torch path); returns how many."""
    seen = set()
    for layer in model.modules():
        if not isinstance(layer, GatedDeltaNet):
            continue
        like = layer.conv1d.weight
        key = (layer.cfg, layer.packed, like.dtype, like.device)
        if key in seen or (fla_only and not layer._use_fla(like)):
            continue
        seen.add(key)
        gen = torch.Generator(device=like.device).manual_seed(0)
        for tokens in WARM_UP_TOKENS:
            x = torch.randn(1, tokens, layer.cfg.hidden_size, generator=gen, device=like.device, dtype=like.dtype)
            layer(x, *layer.new_states(1))
    return len(seen)
