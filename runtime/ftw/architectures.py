"""Per-family checkpoint mapping, as data: adding a family is adding an entry to ARCHITECTURES.

Each entry says where a family keeps its routed experts, how many there are and how wide, which
decoder layers have them, and how they compute. The converter reads nothing family-specific
anywhere else.

Expert layouts (E experts, D hidden, I expert width; names are templates over {layer}/{expert}):
- "per_expert":   one tensor per (expert, projection), nn.Linear (out, in): gate/up [I, D], down [D, I].
- "fused_halves": `gate_up` [E, 2I, D] whose first I rows are gate, `down` [E, D, I] (Qwen3.5 hub).
- "fused_interleaved_transposed": `gate_up` [E, D, 2I] with column 2j = gate, 2j+1 = up, `down`
  [E, I, D], biases `gate_up_bias` [E, 2I] and `down_bias` [E, D] (gpt-oss); MXFP4 sources hold
  the same tensors as `<name>_blocks` / `<name>_scales` in (out, in) orientation.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExpertLayout:
    kind: str                          # "per_expert" | "fused_halves" | "fused_interleaved_transposed"
    names: dict[str, str]              # role -> tensor name template (roles: gate, up, down, gate_up, biases)


@dataclass(frozen=True)
class Architecture:
    model_type: str                    # the model_type the package records (the text model's)
    num_experts_keys: tuple[str, ...]  # config keys of the routed-expert count, first present wins
    intermediate_key: str              # config key of one expert's FFN width
    layouts: tuple[ExpertLayout, ...]  # every on-disk spelling this family ships in, tried in order
    sparse_rule: str = "all"           # "all" | "qwen_sparse_step" (decoder_sparse_step, mlp_only_layers)
    activation: str = "silu"           # runtime.experts.interface.ExpertSpec.activation
    has_bias: bool = False
    # Dense tensors every decoder layer must have (templates over {layer}); checked before converting.
    required_per_layer: tuple[str, ...] = ("model.layers.{layer}.input_layernorm.weight",
                                           "model.layers.{layer}.post_attention_layernorm.weight")
    router: str = "model.layers.{layer}.mlp.gate.weight"
    aliases: tuple[str, ...] = field(default=())   # other model_type spellings mapped to this entry


# Hub configs say num_experts; transformers 5 saves it as num_local_experts.
_QWEN_EXPERTS = ("num_experts", "num_local_experts")
_QWEN_PER_EXPERT = ExpertLayout("per_expert", {
    "gate": "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
    "up": "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
    "down": "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
})
_QWEN_FUSED = ExpertLayout("fused_halves", {
    "gate_up": "model.layers.{layer}.mlp.experts.gate_up_proj",
    "down": "model.layers.{layer}.mlp.experts.down_proj",
})

ARCHITECTURES: dict[str, Architecture] = {
    "qwen3_moe": Architecture(
        "qwen3_moe", _QWEN_EXPERTS, "moe_intermediate_size", (_QWEN_PER_EXPERT, _QWEN_FUSED),
        sparse_rule="qwen_sparse_step"),
    "qwen3_next": Architecture(
        "qwen3_next", _QWEN_EXPERTS, "moe_intermediate_size", (_QWEN_PER_EXPERT, _QWEN_FUSED),
        sparse_rule="qwen_sparse_step"),
    "qwen3_5_moe_text": Architecture(
        "qwen3_5_moe_text", _QWEN_EXPERTS, "moe_intermediate_size", (_QWEN_FUSED, _QWEN_PER_EXPERT),
        aliases=("qwen3_5_moe",)),
    "gpt_oss": Architecture(
        "gpt_oss", ("num_local_experts", "num_experts"), "intermediate_size",
        (ExpertLayout("fused_interleaved_transposed", {
            "gate_up": "model.layers.{layer}.mlp.experts.gate_up_proj",
            "down": "model.layers.{layer}.mlp.experts.down_proj",
            "gate_up_bias": "model.layers.{layer}.mlp.experts.gate_up_proj_bias",
            "down_bias": "model.layers.{layer}.mlp.experts.down_proj_bias",
        }),),
        activation="gpt_oss", has_bias=True, router="model.layers.{layer}.mlp.router.weight"),
    "mixtral": Architecture(
        "mixtral", ("num_local_experts", "num_experts"), "intermediate_size",
        (ExpertLayout("per_expert", {
            "gate": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
            "up": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
            "down": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
        }),),
        router="model.layers.{layer}.block_sparse_moe.gate.weight"),
}

# Checkpoint-name rewriting shared by all families: VLM wrappers keep the text model under
# `model.language_model.`; multi-token-prediction heads and vision towers are not ours to run.
NAME_PREFIX_REWRITES = (("model.language_model.", "model."),)
DROPPED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.vision_tower.")
# Activation/KV calibration scales of quantized checkpoints: a weight-only runtime has no use for them.
DROPPED_SUFFIXES = (".input_scale", ".input_global_scale", ".k_scale", ".v_scale", ".output_scale",
                    ".weight_shape")


def lookup(model_type: str) -> Architecture | None:
    for arch in ARCHITECTURES.values():
        if model_type == arch.model_type or model_type in arch.aliases:
            return arch
    return None


def normalise_name(name: str) -> str | None:
    """The checkpoint name as the package records it, or None for tensors we drop."""
    for old, new in NAME_PREFIX_REWRITES:
        if name.startswith(old):
            name = new + name[len(old):]
    if name.startswith(DROPPED_PREFIXES) or name.endswith(DROPPED_SUFFIXES):
        return None
    return name


def num_experts(arch: Architecture, config: dict) -> int:
    for key in arch.num_experts_keys:
        if config.get(key) is not None:
            return int(config[key])
    return 0


def expert_layers(arch: Architecture, config: dict) -> list[int]:
    """The decoder layers that have routed experts, from the config alone."""
    n_layers = int(config["num_hidden_layers"])
    if num_experts(arch, config) <= 0:
        return []
    if arch.sparse_rule == "all":
        return list(range(n_layers))
    if arch.sparse_rule == "qwen_sparse_step":
        step = int(config.get("decoder_sparse_step", 1) or 1)
        dense_only = set(config.get("mlp_only_layers") or [])
        return [i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0]
    raise ValueError(f"unknown sparse rule {arch.sparse_rule!r}")
