"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B).

GQA attention with per-head q/k RMSNorm and NeoX RoPE; MoE layers route with softmax -> top-k ->
renormalise (when `norm_topk_prob`); `mlp_only_layers` and `decoder_sparse_step` make some layers dense.
Shapes: N tokens, D hidden, E experts, K experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

from torch import nn

from runtime.models.base import Batch, CausalLM, ModelConfig
from runtime.models.blocks import (Attention, DecoderLayer, DecoderStack, DenseMLP, Rotary, SparseMoE,
                                   route_softmax_topk)


@dataclass
class Config(ModelConfig):
    intermediate_size: int = 0            # dense layers
    moe_intermediate_size: int = 0        # each expert
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None

    ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {"num_experts": ("num_local_experts",)}

    def is_moe_layer(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


class Model(CausalLM):
    def __init__(self, config: Config, *, experts):
        super().__init__(config, experts=experts)
        c = config
        window = c.sliding_window if c.use_sliding_window else None
        routing = partial(route_softmax_topk, renormalize=c.norm_topk_prob)
        layers = []
        for i in range(c.num_hidden_layers):
            attn = Attention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                             num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, qkv_bias=c.attention_bias,
                             qk_norm_eps=c.rms_norm_eps, sliding_window=window)
            mlp = (SparseMoE(hidden_size=c.hidden_size, num_experts=c.num_experts, top_k=c.num_experts_per_tok,
                             routing=routing) if c.is_moe_layer(i) else DenseMLP(c.hidden_size, c.intermediate_size))
            layers.append(DecoderLayer(attn=attn, mlp=mlp, hidden_size=c.hidden_size, eps=c.rms_norm_eps,
                                       norm_flavour="llama"))
        self.model = DecoderStack(vocab_size=c.vocab_size, hidden_size=c.hidden_size, layers=layers,
                                  eps=c.rms_norm_eps, norm_flavour="llama")
        self.rope = Rotary(head_dim=c.head_dim, theta=c.rope_theta, scaling=c.rope_scaling,
                           max_position_embeddings=c.max_position_embeddings)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def kv_window(self, layer: int) -> int | None:
        return self.config.sliding_window if self.config.use_sliding_window else None

    def forward_hidden(self, batch: Batch):
        return self.model(batch, self.rope, self.experts)
