"""The contract every model family implements, and the registry model_type -> family module.

A family is one module in `runtime/models/` that defines two names:

    Config  a dataclass subclass of `ModelConfig` whose fields mirror the checkpoint's config.json;
            `Config.from_hf(config_dict)` builds it (tolerating both the hub's and transformers 5's
            spellings, e.g. `rope_theta` vs `rope_parameters`).
    Model   an `nn.Module` subclass of `CausalLM`:
              Model(config, *, experts)             experts: runtime.experts.interface.Experts; the model
                                                    routes and calls experts(layer, hidden, ids, weights),
                                                    never knowing where the experts live.
              model.layer_kinds -> list[str]        per decoder layer: "attention" (needs a KV cache) or
                                                    "linear_attention" (needs a recurrent-state slot).
              model.forward(batch, all_logits=False) -> logits
                                                    over a `Batch` (below): [B, V] for each sequence's
                                                    last new token, or [N, V] for every new token.
              model.expert_spec() -> ExpertSpec     how an expert of this model computes.
              Model.weight_renames                  the weight-mapping hook: ordered (regex, replacement)
                                                    pairs turning a checkpoint's dense tensor name into
                                                    our parameter name (first match wins; a name no
                                                    pattern matches is used as is).
              Model.ignored_weights                 regexes of checkpoint tensors we deliberately skip.
            The module's parameter names are what `runtime/loading.py` loads strictly: every parameter
            must be filled, every checkpoint tensor must land somewhere, shapes must agree.

Register a family by adding its model_type to `FAMILY_MODULES` below.

The batch. N new tokens of B sequences are laid end to end (ragged, no padding): dense projections,
norms, routers and experts run over all N rows at once; attention and linear attention run per
sequence over that sequence's own cache (`Batch.segments()`). Prefill chunks and single decode tokens
mix freely in one batch, which is what continuous batching needs.

The cache protocol (implementations in `runtime/kv_cache.py`). A sequence owns a `SequenceCache`,
one `LayerCache` per decoder layer, made by `model.new_cache(device=..., dtype=...)` (a family with
pooled state slots overrides it; the engine calls `SequenceCache.release()` when the sequence ends
and `detach()` to keep a finished sequence's cache in the prefix cache):
    offset          tokens seen by this layer
    nbytes          bytes held
    trimmable       True when trim() can drop tokens (full-attention KV); False for recurrent state
                    and sliding-window KV (they cannot be rewound)
    trim(n) -> int  drop the last n tokens, return how many were dropped
    copy()          an independent, compact copy (what the prefix cache stores); `to(device)` the same
                    on another device (plain KVCache / StateCache, for a prefix cache in host RAM)
    load(other, length=None)   fill a fresh cache from a stored copy, keeping `length` tokens
                    (a recurrent state only whole); how a prefix-cache hit enters a new sequence
    release()       optional: give pooled resources (state slots) back when the sequence ends
  KVCache (attention):   update_and_fetch(k, v) with k, v [Hkv, T, hd] -> keys/values [Hkv, S, hd] that
                         end with the new ones (S = offset after the update, or fewer for a layer
                         with a sliding window, `model.kv_window(layer)`); offset advances by T.
  StateCache (linear attention): `states: dict[str, Tensor]` the layer reads and replaces as it likes
                         (e.g. "conv" [C, K-1], "recurrent" [Hv, dk, dv] fp32), `advance(T)` after a
                         chunk; copy() clones the tensors (the snapshot the prefix cache keeps).
"""
from __future__ import annotations

import abc
import dataclasses
import importlib
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Protocol

import torch
from torch import nn

from runtime.experts.interface import Experts, ExpertSpec


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one we implement (message names it and what we support)."""


# model_type (config.json) -> module defining Config and Model.
FAMILY_MODULES: dict[str, str] = {
    "qwen3_moe": "runtime.models.qwen3_moe",
    "mixtral": "runtime.models.mixtral",
    "gpt_oss": "runtime.models.gpt_oss",
    "qwen3_next": "runtime.models.qwen3_next",
    "qwen3_5_moe": "runtime.models.qwen3_5_moe",
    "qwen3_5_moe_text": "runtime.models.qwen3_5_moe",
}


def family_module(model_type: str):
    """The family module for a model_type; a clear error for anything we do not run."""
    name = FAMILY_MODULES.get(model_type)
    if name is None:
        raise UnsupportedModelError(
            f"unsupported model architecture {model_type!r}; FreeToken runs: {', '.join(sorted(FAMILY_MODULES))}")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            raise UnsupportedModelError(f"model architecture {model_type!r} is not available in this build") from exc
        raise


def build_model(config_dict: dict, *, experts: Experts) -> CausalLM:
    """Config + model (on the meta-free default device, uninitialised weights) for a config.json dict."""
    model_type = config_dict.get("model_type", "")
    module = family_module(model_type)
    config = module.Config.from_hf(config_dict)
    return module.Model(config, experts=experts)


# ---------------------------------------------------------------------------------------------- config

@dataclass
class ModelConfig:
    """Fields every family shares; a family subclasses it and adds its own."""
    model_type: str = ""
    vocab_size: int = 0
    hidden_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None     # {"rope_type": "yarn", "factor": ..., ...} or None for plain RoPE
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    # config.json keys whose names differ from our fields: ours -> alternatives, first present wins
    ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Mirror config.json, accepting the hub's and transformers 5's spellings of rope settings."""
        d = dict(d)
        rope = d.get("rope_parameters") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        if d.get("rope_scaling") is None and rope.get("rope_type", "default") not in ("default", None):
            d["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if "partial_rotary_factor" not in d and "partial_rotary_factor" in rope:
            d["partial_rotary_factor"] = rope["partial_rotary_factor"]
        if isinstance(d.get("rope_scaling"), dict) and d["rope_scaling"].get("rope_type", d["rope_scaling"].get("type")) in ("default", None):
            d["rope_scaling"] = None
        if not d.get("head_dim") and d.get("hidden_size") and d.get("num_attention_heads"):
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if not d.get("num_key_value_heads"):
            d["num_key_value_heads"] = d.get("num_attention_heads", 0)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            for key in (f.name, *cls.ALIASES.get(f.name, ())):
                if key in d and d[key] is not None:
                    values[f.name] = d[key]
                    break
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Refuse configs that cannot describe a model, naming the field."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            raise ValueError(f"config.json: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")


# ------------------------------------------------------------------------------------------- caches

class LayerCache(Protocol):
    offset: int

    @property
    def nbytes(self) -> int: ...

    @property
    def trimmable(self) -> bool: ...

    def trim(self, n: int) -> int: ...

    def copy(self) -> "LayerCache": ...

    def load(self, other: "LayerCache", length: int | None = None, *, wait: bool = True) -> None: ...
    # (wait=False: a copy from host memory may still be in flight on return; SequenceCache.load waits once)


# -------------------------------------------------------------------------------------------- batch

@dataclass
class Batch:
    """N new tokens of B sequences laid end to end; sequence i owns rows starts[i]:starts[i]+lengths[i]."""
    input_ids: torch.Tensor              # [N] int64
    positions: torch.Tensor              # [N] int64, absolute position of each new token
    lengths: list[int]                   # [B] new tokens per sequence
    caches: list[Any]                    # [B] SequenceCache (runtime.kv_cache), updated in place
    starts: list[int] = field(default_factory=list)
    # set by runtime/decode_graph.py: a list of B `StaticKV` (one per sequence, each decoding one token): attention
    # writes and reads the KV buffers at device-side positions (a fixed-length view, masked) instead of host
    # integers, so the step can be recorded as a CUDA graph
    static_kv: Any = None
    # set by runtime/decode_graph.py for a static step: the sequences' state-slot indices [B] on the device
    # (linear-attention layers gather and scatter their states with it), or None
    static_slots: Any = None

    @classmethod
    def build(cls, chunks: list[tuple[list[int], Any]], *, device: torch.device | str) -> "Batch":
        """chunks: (new token ids, that sequence's cache); positions continue from each cache's offset."""
        ids, pos, lengths, caches = [], [], [], []
        for tokens, cache in chunks:
            if not tokens:
                raise ValueError("a sequence in a batch has no new tokens")
            ids.extend(tokens)
            pos.extend(range(cache.offset, cache.offset + len(tokens)))
            lengths.append(len(tokens))
            caches.append(cache)
        both = torch.tensor([ids, pos], dtype=torch.long, device=device)      # [2, N]: one upload, not two
        return cls(both[0], both[1], lengths, caches)

    def __post_init__(self):
        if not self.starts:
            acc, self.starts = 0, []
            for n in self.lengths:
                self.starts.append(acc)
                acc += n

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def segments(self, layer: int) -> Iterator[tuple[slice, Any]]:
        """(rows of sequence i, sequence i's cache for `layer`) for every sequence."""
        for start, n, cache in zip(self.starts, self.lengths, self.caches):
            yield slice(start, start + n), cache.layers[layer]

    def last_rows(self) -> torch.Tensor:
        """Index of each sequence's last new token: [B]."""
        return torch.tensor([s + n - 1 for s, n in zip(self.starts, self.lengths)], dtype=torch.long,
                            device=self.input_ids.device)


# -------------------------------------------------------------------------------------------- model

class CausalLM(nn.Module, abc.ABC):
    """Base of every family's model. Subclasses set `layer_kinds` and implement `forward_hidden`."""
    weight_renames: ClassVar[list[tuple[str, str]]] = []
    ignored_weights: ClassVar[list[str]] = []

    def __init__(self, config: ModelConfig, *, experts: Experts):
        super().__init__()
        self.config = config
        self.set_experts(experts)
        self.layer_kinds: list[str] = ["attention"] * config.num_hidden_layers

    def set_experts(self, experts: Experts) -> None:
        """Swap the expert tier (kept out of the module tree so it never shows up among the parameters)."""
        self.__dict__["experts"] = experts

    def expert_spec(self) -> ExpertSpec:
        return ExpertSpec()

    def fuse_projections(self) -> None:
        """After loading: let modules that can merge their projections do so (attention's q/k/v into one GEMM)."""
        for module in self.modules():
            fuse = getattr(module, "fuse_projections", None)
            if module is not self and callable(fuse):
                fuse()

    def new_cache(self, *, device: torch.device | str, dtype: torch.dtype):
        """A fresh SequenceCache with one slot per layer of the kind that layer needs."""
        from runtime.kv_cache import KVCache, SequenceCache, StateCache

        layers = []
        for i, kind in enumerate(self.layer_kinds):
            if kind == "attention":
                layers.append(KVCache(self.config.num_key_value_heads, self.config.head_dim,
                                      device=device, dtype=dtype, window=self.kv_window(i)))
            elif kind == "linear_attention":
                layers.append(StateCache(device=device))
            else:
                raise ValueError(f"unknown layer kind {kind!r}")
        return SequenceCache(layers)

    def kv_window(self, layer: int) -> int | None:
        """The sliding window of an attention layer (its KV cache then keeps only what the window sees)."""
        return None

    def checkpoint_to_param(self, name: str) -> str | None:
        """Our parameter name for a checkpoint dense tensor, or None when it is deliberately ignored."""
        for pattern in self.ignored_weights:
            if re.fullmatch(pattern, name):
                return None
        for pattern, replacement in self.weight_renames:
            if re.fullmatch(pattern, name):
                return re.sub(pattern, replacement, name)
        return name

    @abc.abstractmethod
    def forward_hidden(self, batch: Batch) -> torch.Tensor:
        """Final hidden states (after the last norm) for every new token: [N, D]."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, batch: Batch, *, all_logits: bool = False) -> torch.Tensor:
        hidden = self.forward_hidden(batch)                           # [N, D]
        if not all_logits and batch.num_tokens != len(batch.lengths):
            # (a step of single tokens, N == B, needs no select: every row is a last one, and no index upload)
            hidden = hidden.index_select(0, batch.last_rows())       # [B, D]
        return self.logits(hidden).float()
