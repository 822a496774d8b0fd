"""gpt-oss (20b, 120b).

Attention with q/k/v/o biases, per-head sinks, a sliding window (128) on alternate layers and YaRN
RoPE; RMSNorm computed in fp32; router Linear with bias -> top-k on logits -> softmax over the k;
experts are clamped SwiGLU with biases (`ExpertSpec(activation="gpt_oss")`). The checkpoint names the
router `mlp.router`, which we keep.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from runtime.experts.interface import ExpertSpec
from runtime.models.base import Batch, CausalLM, ModelConfig
from runtime.models.blocks import Attention, DecoderLayer, DecoderStack, Rotary, SparseMoE, route_topk_softmax


@dataclass
class Config(ModelConfig):
    intermediate_size: int = 0            # each expert
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    sliding_window: int = 128
    layer_types: list[str] = field(default_factory=list)
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rope_theta: float = 150000.0

    def validate(self) -> None:
        super().validate()
        if not self.layer_types:
            # the published configs alternate sliding and full attention, sliding first
            self.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"config.json: layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")


class Model(CausalLM):
    def __init__(self, config: Config, *, experts):
        super().__init__(config, experts=experts)
        c = config
        layers = []
        for kind in c.layer_types:
            attn = Attention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                             num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, qkv_bias=c.attention_bias,
                             o_bias=c.attention_bias, sinks=True,
                             sliding_window=c.sliding_window if kind == "sliding_attention" else None)
            mlp = SparseMoE(hidden_size=c.hidden_size, num_experts=c.num_local_experts, top_k=c.num_experts_per_tok,
                            routing=route_topk_softmax, router_bias=True, router_name="router")
            layers.append(DecoderLayer(attn=attn, mlp=mlp, hidden_size=c.hidden_size, eps=c.rms_norm_eps,
                                       norm_flavour="fp32"))
        self.model = DecoderStack(vocab_size=c.vocab_size, hidden_size=c.hidden_size, layers=layers,
                                  eps=c.rms_norm_eps, norm_flavour="fp32")
        self.rope = Rotary(head_dim=c.head_dim, theta=c.rope_theta, scaling=c.rope_scaling,
                           max_position_embeddings=c.max_position_embeddings)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def kv_window(self, layer: int) -> int | None:
        return self.config.sliding_window if self.config.layer_types[layer] == "sliding_attention" else None

    def expert_spec(self) -> ExpertSpec:
        return ExpertSpec(activation="gpt_oss", swiglu_alpha=self.config.swiglu_alpha,
                          swiglu_limit=self.config.swiglu_limit, has_bias=True)

    def forward_hidden(self, batch: Batch):
        return self.model(batch, self.rope, self.experts)
