"""Mixtral (8x7B, 8x22B): GQA attention with RoPE, every layer MoE, softmax -> top-k -> renormalise.

The checkpoint calls the MoE block `block_sparse_moe` and its experts w1 (gate), w3 (up), w2 (down);
the converter canonicalises the experts, and the weight map renames the router.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from torch import nn

from runtime.models.base import Batch, CausalLM, ModelConfig
from runtime.models.blocks import Attention, DecoderLayer, DecoderStack, Rotary, SparseMoE, route_softmax_topk


@dataclass
class Config(ModelConfig):
    intermediate_size: int = 0            # each expert
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    sliding_window: int | None = None
    rope_theta: float = 1e6


class Model(CausalLM):
    weight_renames: ClassVar[list[tuple[str, str]]] = [
        (r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight", r"model.layers.\1.mlp.gate.weight"),
    ]

    def __init__(self, config: Config, *, experts):
        super().__init__(config, experts=experts)
        c = config
        routing = partial(route_softmax_topk, renormalize=True)
        layers = [
            DecoderLayer(attn=Attention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                                        num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                                        sliding_window=c.sliding_window),
                         mlp=SparseMoE(hidden_size=c.hidden_size, num_experts=c.num_local_experts,
                                       top_k=c.num_experts_per_tok, routing=routing),
                         hidden_size=c.hidden_size, eps=c.rms_norm_eps, norm_flavour="llama")
            for _ in range(c.num_hidden_layers)]
        self.model = DecoderStack(vocab_size=c.vocab_size, hidden_size=c.hidden_size, layers=layers,
                                  eps=c.rms_norm_eps, norm_flavour="llama")
        self.rope = Rotary(head_dim=c.head_dim, theta=c.rope_theta, scaling=c.rope_scaling,
                           max_position_embeddings=c.max_position_embeddings)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def kv_window(self, layer: int) -> int | None:
        return self.config.sliding_window

    def forward_hidden(self, batch: Batch):
        return self.model(batch, self.rope, self.experts)
