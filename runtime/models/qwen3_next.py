"""Qwen3-Next (Qwen3-Next-80B-A3B) and, through a small variant table, Qwen3.5/3.6-MoE.

Hybrid decoder: `layer_types` interleaves Gated DeltaNet linear attention (three of every four layers,
`runtime/models/gated_deltanet.py`) with gated full attention: `q_proj` yields [q | gate] per head,
q/k RMSNorm, partial RoPE (the first quarter of each head), output x sigmoid(gate). MoE layers route
softmax -> top-k -> renormalise and add a shared expert scaled by sigmoid(shared_expert_gate). Every
RMSNorm except the GDN's gated norm is the zero-centred x̂ (1 + w).

Per variant: Qwen3-Next packs the GDN input projection (`in_proj_qkvz`, `in_proj_ba`) and honours
`norm_topk_prob`, `mlp_only_layers` and `decoder_sparse_step`; Qwen3.5 stores the projection in four
tensors, renormalises top-k always, has a MoE block in every layer and uses MRoPE, which for text-only
positions (all three position components equal) is plain RoPE.

Each sequence's linear layers keep their state in the layer's cache `states` dict (base.py protocol):
"conv" [C, W-1] and "recurrent" [Hv, dk, dv] fp32; an empty dict is a fresh sequence.
Shapes: N tokens of the batch, T of one sequence, B sequences, D hidden, H query heads, Hkv kv heads,
hd head dim.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import torch
from torch import nn

from runtime.experts.interface import Experts
from runtime.models.base import Batch, CausalLM, ModelConfig
from runtime.models.blocks import (DenseMLP, RMSNorm, Rotary, SparseMoE, attend_batch, norm_and_rotate,
                                   route_softmax_topk)
from runtime.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from runtime.models.linear_state import CONV, RECURRENT, LinearStateSpec, SlotStateCache, StatePool

LINEAR, FULL = "linear_attention", "full_attention"   # config.json's layer_types


@dataclass(frozen=True)
class Variant:
    """What differs between the Qwen3-Next and Qwen3.5 checkpoints of the same architecture."""
    packed_gdn_projection: bool      # in_proj_qkvz / in_proj_ba (Next) vs in_proj_qkv/z/b/a (3.5)
    always_renormalize: bool         # top-k weights renormalised whatever norm_topk_prob says
    every_layer_moe: bool            # no dense layers (mlp_only_layers / decoder_sparse_step ignored)


QWEN3_NEXT = Variant(packed_gdn_projection=True, always_renormalize=False, every_layer_moe=False)
QWEN3_5 = Variant(packed_gdn_projection=False, always_renormalize=True, every_layer_moe=True)


@dataclass
class Config(ModelConfig):
    intermediate_size: int = 0                 # dense layers (Qwen3-Next's mlp_only_layers)
    moe_intermediate_size: int = 0             # each routed expert
    shared_expert_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)
    full_attention_interval: int = 4           # older configs give this instead of layer_types
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25

    VARIANT: ClassVar[Variant] = QWEN3_NEXT

    @classmethod
    def from_hf(cls, d: dict) -> "Config":
        if d.get("text_config"):                  # a VLM config.json keeps the text model's keys nested
            outer = {k: v for k, v in d.items() if k not in ("text_config", "vision_config", "model_type")}
            d = {**outer, **d["text_config"]}     # the text keys win; top-level ones (tie_word_embeddings) fill in
        d = dict(d)
        rope = d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type")) in ("mrope", "default"):
            d["rope_scaling"] = None                # MRoPE on text positions is plain RoPE
        return super().from_hf(d)

    def validate(self) -> None:
        super().validate()
        if not self.layer_types:
            self.layer_types = [FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR
                                for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"config.json: layer_types lists {len(self.layer_types)} layers but "
                             f"num_hidden_layers is {self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            raise ValueError(f"config.json: unknown layer_types {unknown} (expected {LINEAR!r} or {FULL!r})")
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "num_experts", "num_experts_per_tok"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {getattr(self, name)!r}")

    def is_moe_layer(self, layer: int) -> bool:
        if self.VARIANT.every_layer_moe:
            return True
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def gdn(self) -> GatedDeltaNetConfig:
        return GatedDeltaNetConfig.from_config(dict(
            hidden_size=self.hidden_size, linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads, linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim, linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            rms_norm_eps=self.rms_norm_eps))


# ------------------------------------------------------------------------------------------- mixers


class GatedAttention(nn.Module):
    """Full attention whose output is gated per channel: o_proj(attn(q, k, v) * sigmoid(gate))."""

    def __init__(self, c: Config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = c.head_dim ** -0.5
        self.q_proj = nn.Linear(c.hidden_size, 2 * c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps, flavour="offset")
        self.k_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps, flavour="offset")

    def forward(self, x: torch.Tensor, batch: Batch, layer: int, rope: Rotary, cos_sin) -> torch.Tensor:
        n, H, hd = x.shape[0], self.num_heads, self.head_dim
        q, gate = torch.chunk(self.q_proj(x).view(n, H, 2 * hd), 2, dim=-1)         # [N, H, hd] each
        k = self.k_proj(x).view(n, self.num_kv_heads, hd)                           # [N, Hkv, hd]
        v = self.v_proj(x).view(n, self.num_kv_heads, hd)                            # [N, Hkv, hd]
        q, k = norm_and_rotate(q, self.q_norm, rope, cos_sin), norm_and_rotate(k, self.k_norm, rope, cos_sin)
        o = attend_batch(q, k, v, batch, layer, scale=self.scale)                    # [N, H, hd]
        return self.o_proj(o.reshape(n, H * hd) * torch.sigmoid(gate.reshape(n, H * hd)))


def _slot_states(gdn: GatedDeltaNet, cache, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv [C, W-1], recurrent [Hv, dk, dv]) of one sequence's layer cache; zeros for a fresh sequence."""
    states = cache.states
    if CONV not in states or RECURRENT not in states:
        conv, rec = gdn.new_states(1, device=device, dtype=dtype)
        return conv[0], rec[0]
    return states[CONV], states[RECURRENT]


def _store_states(cache, conv: torch.Tensor, rec: torch.Tensor, tokens: int) -> None:
    # replace, never modify in place: a prefix-cache copy may share the old tensors
    cache.states[CONV] = conv
    cache.states[RECURRENT] = rec
    cache.advance(tokens)


def _common_pool(caches) -> StatePool | None:
    """The pool when every cache is a slot of the same pool (same linear layer), else None."""
    first = caches[0]
    if not isinstance(first, SlotStateCache):
        return None
    if all(isinstance(c, SlotStateCache) and c.pool is first.pool and c.layer == first.layer for c in caches):
        return first.pool
    return None


def linear_attention(gdn: GatedDeltaNet, x: torch.Tensor, batch: Batch, layer: int) -> torch.Tensor:
    """Run a GatedDeltaNet over a ragged batch, each sequence from and back into its own state.

    x [N, D] -> [N, D]. Sequences decoding one token run together as one [B, 1, D] call (the decode hot
    path); prefill chunks run one sequence at a time, in the chunked form.
    """
    if batch.static_kv is not None:
        return _linear_attention_static(gdn, x, batch, layer)
    out = torch.empty_like(x)
    decoding = []
    for rows, cache in batch.segments(layer):
        tokens = rows.stop - rows.start
        if tokens == 1:
            decoding.append((rows.start, cache))
            continue
        conv, rec = _slot_states(gdn, cache, x.device, x.dtype)
        y, conv, rec = gdn(x[rows][None], conv[None], rec[None])                     # [1, T, D]
        out[rows] = y[0]
        _store_states(cache, conv[0], rec[0], tokens)
    if decoding:
        caches = [cache for _, cache in decoding]
        pool = _common_pool(caches)
        if pool is not None:     # every sequence in one slot pool: one gather and one scatter per layer
            slots = _slot_index(batch, caches, pool)
            conv, rec = pool.gather(caches[0].layer, slots)                          # [B, C, W-1], [B, Hv, dk, dv]
        else:
            states = [_slot_states(gdn, cache, x.device, x.dtype) for cache in caches]
            conv = torch.stack([s[0] for s in states])                               # [B, C, W-1]
            rec = torch.stack([s[1] for s in states])                                # [B, Hv, dk, dv]
        if len(decoding) == x.shape[0]:          # a pure decode step: row i is sequence i, no gather
            y, conv, rec = gdn(x[:, None], conv, rec)                               # [B, 1, D]
            out = y[:, 0]
        else:
            idx = torch.tensor([row for row, _ in decoding], device=x.device)
            y, conv, rec = gdn(x.index_select(0, idx)[:, None], conv, rec)          # [B, 1, D]
            out.index_copy_(0, idx, y[:, 0])
        if pool is not None:
            pool.scatter(caches[0].layer, slots, conv, rec)
            for cache in caches:
                cache.advance(1)
        else:
            # each sequence gets its own compact tensors: a row view would keep the whole batch's states
            # alive behind it (and a finished sequence's states go to the prefix cache as they are)
            for i, cache in enumerate(caches):
                own = len(caches) > 1
                _store_states(cache, conv[i].clone() if own else conv[i], rec[i].clone() if own else rec[i], 1)
    return out


def _slot_index(batch: Batch, caches, pool: StatePool) -> torch.Tensor:
    """The decoding sequences' slot indices on the device [B], uploaded once per step, not once per linear layer
    (on a GPU each upload from a Python list waits for the stream: a host sync in every layer). A sequence holds
    the same slot in every linear layer, so the index is the same for all of them."""
    slots = [c.slot for c in caches]
    memo = batch.__dict__.setdefault("_slot_index", {})
    index = memo.get(tuple(slots))
    if index is None:
        index = memo[tuple(slots)] = torch.tensor(slots, device=pool.device)
    return index


def _linear_attention_static(gdn: GatedDeltaNet, x: torch.Tensor, batch: Batch, layer: int) -> torch.Tensor:
    """B sequences, one token each (row i is sequence i), states read and written in place in the sequences'
    state slots (the decode path runtime/decode_graph.py records as a CUDA graph: fixed addresses, no host work;
    the caller advances the caches). x [B, D] -> [B, D]. Several sequences gather their states from the pool
    with the step's device slot index (`batch.static_slots`) and scatter them back: four launches per layer
    whatever B."""
    caches = [c.layers[layer] for c in batch.caches]
    if len(caches) == 1:
        conv_view, rec_view = caches[0].states[CONV], caches[0].states[RECURRENT]   # [C, W-1], [Hv, dk, dv]
        if gdn.fused_decode_ok(x, conv_view[None], rec_view[None]):                 # two launches, in place
            return gdn.decode_in_place(x, conv_view[None], rec_view[None])
        y, conv, rec = gdn(x[:, None], conv_view[None], rec_view[None])            # [1, 1, D]
        conv_view.copy_(conv[0])
        rec_view.copy_(rec[0])
        return y[:, 0]
    pool = _common_pool(caches)
    if pool is None or batch.static_slots is None:
        raise ValueError("a static decode step of several sequences needs their linear-attention states in one "
                         "slot pool and the step's slot index (runtime/decode_graph.py sets both)")
    g = caches[0].layer
    conv_all, rec_all = pool.conv[:, g], pool.recurrent[:, g]                     # [S, C, W-1], [S, Hv, dk, dv]
    if gdn.fused_decode_ok(x, conv_all, rec_all, batch.static_slots):             # in the slots: no gather/scatter
        return gdn.decode_in_place(x, conv_all, rec_all, batch.static_slots)
    conv_in = conv_all.index_select(0, batch.static_slots)                          # [B, C, W-1]
    rec_in = rec_all.index_select(0, batch.static_slots)                            # [B, Hv, dk, dv]
    y, conv, rec = gdn(x[:, None], conv_in, rec_in)                                 # [B, 1, D]
    conv_all.index_copy_(0, batch.static_slots, conv.to(conv_all.dtype))
    rec_all.index_copy_(0, batch.static_slots, rec.float())
    return y[:, 0]


class SharedExpertMoE(SparseMoE):
    """Routed experts plus one always-on shared expert scaled by sigmoid(shared_expert_gate x)."""

    def __init__(self, c: Config, *, renormalize: bool):
        super().__init__(hidden_size=c.hidden_size, num_experts=c.num_experts, top_k=c.num_experts_per_tok,
                         routing=partial(route_softmax_topk, renormalize=renormalize))
        self.shared_expert = DenseMLP(c.hidden_size, c.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, layer: int, experts: Experts) -> torch.Tensor:
        routed = super().forward(x, layer, experts)                                  # [N, D]
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridDecoderLayer(nn.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x)); the mixer is `linear_attn` or `self_attn`."""

    def __init__(self, c: Config, layer: int):
        super().__init__()
        self.kind = c.layer_types[layer]
        if self.kind == LINEAR:
            self.linear_attn = GatedDeltaNet(c.gdn(), packed=c.VARIANT.packed_gdn_projection)
        else:
            self.self_attn = GatedAttention(c)
        if c.is_moe_layer(layer):
            self.mlp = SharedExpertMoE(c, renormalize=c.VARIANT.always_renormalize or c.norm_topk_prob)
        else:
            self.mlp = DenseMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, flavour="offset")
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, flavour="offset")

    def forward(self, x: torch.Tensor, batch: Batch, layer: int, rope: Rotary, cos_sin,
                experts: Experts, pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As blocks.DecoderLayer: `pending` is the previous layer's MLP output, added by this layer's first
        norm (one fused launch on a GPU); returns (the residual stream, this layer's MLP output)."""
        x, h = (x, self.input_layernorm(x)) if pending is None else self.input_layernorm.add_and_norm(x, pending)
        if self.kind == LINEAR:
            mixed = linear_attention(self.linear_attn, h, batch, layer)
        else:
            mixed = self.self_attn(h, batch, layer, rope, cos_sin)
        x, h = self.post_attention_layernorm.add_and_norm(x, mixed)
        return x, (self.mlp(h, layer, experts) if isinstance(self.mlp, SparseMoE) else self.mlp(h))


class HybridStack(nn.Module):
    """Embeddings, decoder layers and the final norm: the checkpoint's `model.*` tensors."""

    def __init__(self, c: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, flavour="offset")

    def forward(self, batch: Batch, rope: Rotary, experts: Experts) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)                                       # [N, D]
        cos_sin = rope.cos_sin(batch.positions, x.dtype)                             # [N, 1, rd/2] x2
        pending = None
        for i, layer in enumerate(self.layers):
            x, pending = layer(x, batch, i, rope, cos_sin, experts, pending)
        return self.norm(x) if pending is None else self.norm.add_and_norm(x, pending)[1]


class Model(CausalLM):
    ignored_weights: ClassVar[list[str]] = [r"mtp\..*", r"model\.visual\..*"]

    def __init__(self, config: Config, *, experts: Experts):
        super().__init__(config, experts=experts)
        c = config
        self.layer_kinds = ["linear_attention" if kind == LINEAR else "attention" for kind in c.layer_types]
        self.model = HybridStack(c)
        self.rope = Rotary(head_dim=c.head_dim, theta=c.rope_theta, partial_rotary_factor=c.partial_rotary_factor,
                           scaling=c.rope_scaling, max_position_embeddings=c.max_position_embeddings)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.state_pool: StatePool | None = None

    def linear_layers(self) -> list[int]:
        """Decoder layers that carry a recurrent state (what the state-slot pool is sized from)."""
        return [i for i, kind in enumerate(self.layer_kinds) if kind == "linear_attention"]

    def state_spec(self, *, dtype: torch.dtype) -> LinearStateSpec:
        """What one sequence's recurrent state takes (for the memory plan)."""
        return LinearStateSpec.for_layers(self.config.gdn(), len(self.linear_layers()), dtype=dtype)

    def attach_state_pool(self, capacity: int, *, device: torch.device | str, dtype: torch.dtype) -> StatePool:
        """Reserve `capacity` state slots up front (the plan's "N state slots"); `new_cache` then takes one
        slot per sequence (StatePoolFull when none is left) and `SequenceCache.release()` gives it back."""
        self.state_pool = StatePool(self.state_spec(dtype=dtype), capacity, device=device)
        return self.state_pool

    def new_cache(self, *, device: torch.device | str, dtype: torch.dtype):
        cache = super().new_cache(device=device, dtype=dtype)
        if self.state_pool is None:          # no reservation: each sequence's states are its own tensors
            return cache
        slot_caches = iter(self.state_pool.layer_caches(self.state_pool.alloc()))
        cache.layers = [next(slot_caches) if kind == "linear_attention" else layer
                        for kind, layer in zip(self.layer_kinds, cache.layers)]
        return cache

    def forward_hidden(self, batch: Batch) -> torch.Tensor:
        return self.model(batch, self.rope, self.experts)
