"""The curated model catalog: data in resources/catalog.json, numbers computed from real configs.

Each entry names a hub repo and a config file in resources/catalog_configs/ holding the fields of the
repo's published config.json that sizes depend on. Parameter counts and download sizes are computed
from those configs here (never typed in by hand); tests/test_catalog.py recomputes every entry and
checks the counts against transformers' own models built on the meta device.

Shape legend: V vocab, D hidden, L layers, H query heads, KV key/value heads, hd head_dim,
E routed experts, K experts per token, I expert FFN width, Is shared-expert width.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESOURCES = Path(__file__).resolve().parent.parent / "resources"
CATALOG_FILE = RESOURCES / "catalog.json"
CONFIG_DIR = RESOURCES / "catalog_configs"

# Bytes per parameter of the formats checkpoints ship in.
BF16_BYTES = 2.0
MXFP4_BYTES = 0.5 + 1 / 32      # e2m1 nibble + one e8m0 scale byte per 32 weights
NVFP4_BYTES = 0.5 + 1 / 16      # e2m1 nibble + one e4m3 scale byte per 16 weights
NVFP4_PER_TENSOR_BYTES = 8      # weight_scale_2 and input_scale, fp32 each, per quantized Linear

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "gpt_oss", "mixtral")


class CatalogError(ValueError):
    """A catalog entry or config that is missing or inconsistent."""


def text_config(config: dict) -> dict:
    """The language model's config: `text_config` for VLM checkpoints (Qwen3.5/3.6), else the config itself."""
    return config.get("text_config", config)


@dataclass(frozen=True)
class ParamCount:
    total: int            # every parameter in the checkpoint (text, vision tower, MTP head)
    active: int           # weights one text token reads: K of E experts, lm_head, no input embedding table,
                          # no vision tower, no MTP head
    routed_experts: int   # parameters of all routed experts (what the hybrid tier moves around)
    per_expert: int       # parameters of one (layer, expert) block, biases included
    moe_layers: int
    vision: int = 0
    mtp: int = 0

    @property
    def text(self) -> int:
        return self.total - self.vision - self.mtp

    @property
    def dense(self) -> int:
        """Everything that is not a routed expert."""
        return self.total - self.routed_experts


def _num_experts(tc: dict) -> int:
    return int(tc.get("num_experts") or tc.get("num_local_experts") or 0)


def _is_moe_layer(tc: dict, layer: int) -> bool:
    if _num_experts(tc) == 0 or layer in (tc.get("mlp_only_layers") or []):
        return False
    step = int(tc.get("decoder_sparse_step") or 1)
    return (layer + 1) % step == 0


def _layer_types(tc: dict) -> list[str]:
    n = int(tc["num_hidden_layers"])
    types = tc.get("layer_types")
    if types:
        if len(types) != n:
            raise CatalogError(f"layer_types has {len(types)} entries for {n} layers")
        return list(types)
    interval = tc.get("full_attention_interval")
    if interval and tc.get("model_type", "").startswith(("qwen3_next", "qwen3_5")):
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    return ["full_attention"] * n


def _attention_params(tc: dict) -> int:
    d, h, kv = tc["hidden_size"], tc["num_attention_heads"], tc["num_key_value_heads"]
    hd = tc.get("head_dim") or d // h
    mt = tc["model_type"]
    gated = mt in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")   # q_proj yields [q | gate]
    q_out = h * hd * (2 if gated else 1)
    n = d * q_out + 2 * d * kv * hd + h * hd * d
    if tc.get("attention_bias"):
        n += q_out + 2 * kv * hd + d
    if mt != "mixtral" and mt != "gpt_oss":
        n += 2 * hd                                   # q_norm, k_norm over head_dim
    if mt == "gpt_oss":
        n += h                                        # attention sinks
    return n


def _linear_attention_params(tc: dict) -> int:
    """Gated DeltaNet: the same count for Qwen3-Next's packed and Qwen3.5's split projections."""
    d = tc["hidden_size"]
    nk, nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    key_dim, value_dim = nk * tc["linear_key_head_dim"], nv * tc["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    return (d * (2 * key_dim + 2 * value_dim)       # q, k, v, z
            + d * 2 * nv                             # b, a
            + conv_dim * tc["linear_conv_kernel_dim"]  # depthwise conv, no bias
            + 2 * nv                                 # dt_bias, A_log
            + tc["linear_value_head_dim"]            # gated RMSNorm
            + value_dim * d)                         # out_proj


def _per_expert(tc: dict) -> int:
    d, i = tc["hidden_size"], tc.get("moe_intermediate_size") or tc["intermediate_size"]
    n = 3 * d * i
    if tc["model_type"] == "gpt_oss":
        n += 2 * i + d                               # gate_up and down biases
    return n


def _moe_block_params(tc: dict) -> tuple[int, int]:
    """(routed expert params, everything else in the block: router, shared expert)."""
    d, e = tc["hidden_size"], _num_experts(tc)
    other = d * e + (e if tc["model_type"] == "gpt_oss" else 0)
    shared = tc.get("shared_expert_intermediate_size") or 0
    if shared:
        other += 3 * d * shared + d                  # shared expert and its sigmoid gate
    return e * _per_expert(tc), other


def _decoder_layer_params(tc: dict, layer_type: str, moe: bool) -> tuple[int, int]:
    """(routed expert params, other params) of one decoder layer."""
    d = tc["hidden_size"]
    other = 2 * d                                    # input and post-attention norms
    other += _linear_attention_params(tc) if layer_type == "linear_attention" else _attention_params(tc)
    if moe:
        experts, block = _moe_block_params(tc)
        return experts, other + block
    return 0, other + 3 * d * tc["intermediate_size"]


def _vision_params(vc: dict) -> int:
    """Qwen3.5/3.6 vision tower (patch embedding, ViT blocks, patch merger), as transformers builds it."""
    h, inter = vc["hidden_size"], vc["intermediate_size"]
    patch = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2 * h + h
    pos = vc["num_position_embeddings"] * h
    block = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * inter + inter) + (inter * h + h)
    merged = h * vc["spatial_merge_size"] ** 2
    merger = 2 * h + (merged * merged + merged) + (merged * vc["out_hidden_size"] + vc["out_hidden_size"])
    return patch + pos + vc["depth"] * block + merger


def count_parameters(config: dict) -> ParamCount:
    """Parameter counts of a checkpoint from its config.json alone."""
    tc = text_config(config)
    if tc.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise CatalogError(f"model_type {tc.get('model_type')!r} is not one FreeToken runs "
                           f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    d, v = tc["hidden_size"], tc["vocab_size"]
    tied = config.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))
    total = v * d * (1 if tied else 2) + d           # embeddings, lm_head, final norm
    experts_total = moe_layers = 0
    for layer, kind in enumerate(_layer_types(tc)):
        moe = _is_moe_layer(tc, layer)
        experts, other = _decoder_layer_params(tc, kind, moe)
        experts_total += experts
        total += experts + other
        moe_layers += int(moe)
    per_expert = _per_expert(tc) if moe_layers else 0
    inactive = moe_layers * (_num_experts(tc) - int(tc.get("num_experts_per_tok") or 0)) * per_expert
    # A token reads one row of the input embedding, so the table is not "active" (OpenAI's convention
    # for gpt-oss: 3.61B / 5.13B); with tied embeddings the lm_head reads all of it anyway.
    active = total - inactive - (0 if tied else v * d)

    mtp = 0
    for _ in range(int(tc.get("mtp_num_hidden_layers") or 0)):
        # Qwen3-Next/3.5 MTP head: fc over [embedding; hidden], two pre-fc norms, one full-attention
        # MoE decoder layer, a final norm.
        experts, other = _decoder_layer_params(tc, "full_attention", _num_experts(tc) > 0)
        mtp += 2 * d * d + 3 * d + experts + other
        experts_total += experts
    vision = _vision_params(config["vision_config"]) if "vision_config" in config else 0
    return ParamCount(total=total + mtp + vision, active=active, routed_experts=experts_total,
                      per_expert=per_expert, moe_layers=moe_layers, vision=vision, mtp=mtp)


def checkpoint_format(config: dict) -> str:
    """'bf16', 'mxfp4' or 'nvfp4': how the routed experts are stored in the repo."""
    q = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "mxfp4":
        return "mxfp4"
    if method == "modelopt" and str(q.get("quant_algo", "")).upper() == "NVFP4":
        return "nvfp4"
    if method == "compressed-tensors" and "nvfp4" in str(q.get("format", "")).lower():
        return "nvfp4"
    if method:
        raise CatalogError(f"quantization {method!r} is not one the catalog can size")
    return "bf16"


def checkpoint_bytes(config: dict) -> int:
    """Bytes of the safetensors weights in the repo (headers excluded), from the config alone.

    Only routed experts are quantized in the formats we list (gpt-oss leaves attention, router and
    embeddings in bf16; the NVFP4 exports keep everything but the routed experts in bf16).
    """
    counts = count_parameters(config)
    fmt = checkpoint_format(config)
    dense_bytes = counts.dense * BF16_BYTES
    if fmt == "bf16":
        return int(counts.total * BF16_BYTES)
    tc = text_config(config)
    n_blocks = counts.routed_experts // counts.per_expert     # (layer, expert) blocks incl. MTP
    weights = n_blocks * 3 * tc["hidden_size"] * (tc.get("moe_intermediate_size") or tc["intermediate_size"])
    biases = counts.routed_experts - weights
    if fmt == "mxfp4":
        expert_bytes = weights * MXFP4_BYTES + biases * BF16_BYTES
    else:
        expert_bytes = weights * NVFP4_BYTES + n_blocks * 3 * NVFP4_PER_TENSOR_BYTES + biases * BF16_BYTES
    return int(dense_bytes + expert_bytes)


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    name: str
    repo: str
    family: str                  # model_type of the text model
    format: str                  # "bf16" | "mxfp4" | "nvfp4": how the repo stores the experts
    codec: str                   # FTW codec the converter picks by default: "int4" | "fp4"
    total_params: int
    active_params: int
    context_length: int
    licence: str
    download_bytes: int
    description: str
    sources: tuple[str, ...] = ()
    allow_patterns: tuple[str, ...] = ("*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt")
    published_size_bytes: int | None = None   # the repo's own figure, where we have read one
    tags: tuple[str, ...] = field(default=())

    @property
    def config_path(self) -> Path:
        return CONFIG_DIR / f"{self.id}.json"

    def config(self) -> dict[str, Any]:
        try:
            return json.loads(self.config_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CatalogError(f"catalog entry {self.id}: cannot read {self.config_path} ({exc})") from exc

    @property
    def folder_name(self) -> str:
        """The models-folder name of this repo (org--name), the same rule the library uses."""
        return self.repo.replace("/", "--")


def load_catalog(path: Path | None = None) -> list[CatalogEntry]:
    path = path or CATALOG_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CatalogError(f"cannot read the catalog {path} ({exc})") from exc
    entries = []
    for i, item in enumerate(raw.get("models", [])):
        try:
            for key in ("sources", "allow_patterns", "tags"):
                if key in item:
                    item[key] = tuple(item[key])
            entries.append(CatalogEntry(**item))
        except TypeError as exc:
            raise CatalogError(f"{path}: entry {i} ({item.get('id', '?')}): {exc}") from exc
    ids = [e.id for e in entries]
    if len(set(ids)) != len(ids):
        raise CatalogError(f"{path}: duplicate ids in {ids}")
    return entries


def find_entry(key: str, entries: list[CatalogEntry] | None = None) -> CatalogEntry | None:
    """An entry by catalog id or hub repo id (case-insensitive)."""
    key = key.lower()
    for entry in entries if entries is not None else load_catalog():
        if entry.id.lower() == key or entry.repo.lower() == key:
            return entry
    return None


def computed_fields(config: dict) -> dict[str, Any]:
    """The numbers a catalog entry must carry for `config` (what the catalog test compares)."""
    counts = count_parameters(config)
    tc = text_config(config)
    return {
        "family": tc["model_type"],
        "format": checkpoint_format(config),
        "total_params": counts.total,
        "active_params": counts.active,
        "context_length": int(tc["max_position_embeddings"]),
        "download_bytes": checkpoint_bytes(config),
    }
