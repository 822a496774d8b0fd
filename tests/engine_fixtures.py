"""Shared helpers for the engine and model tests: packages built once per session, sources, prompts."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.experts.interface import ExpertWeights
from runtime.ftw.architectures import lookup, normalise_name


class SafetensorsSource:
    """A Hugging Face checkpoint folder read directly (dense tensors + canonical experts), FTWPackage-shaped.

    Lets the model tests compare against transformers without going through the converter, so a
    converter bug and a model bug show up in different tests.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.config = json.loads((self.path / "config.json").read_text())
        self.model_type = self.config["model_type"]
        self.tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(self.path.glob("*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                for key in f.keys():
                    name = normalise_name(key)
                    if name is not None:
                        self.tensors[name] = f.get_tensor(key)
        self.arch = lookup(self.model_type)
        self.experts = _Experts(self)
        self._expert_re = re.compile(r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.experts\.")

    def dense_names(self) -> list[str]:
        return [n for n in self.tensors if not self._expert_re.match(n)]

    def dense(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class _Experts:
    def __init__(self, src: SafetensorsSource):
        from runtime.ftw.architectures import expert_layers

        self.src = src
        config = dict(src.config)
        # transformers 5 writes qwen3_moe's expert count as num_local_experts
        config.setdefault(src.arch.num_experts_key, config.get("num_local_experts") or config.get("num_experts"))
        self.layers = expert_layers(src.arch, config)
        self.num_experts = int(config[src.arch.num_experts_key])

    def dequantize(self, layer: int, expert: int, dtype=torch.float32) -> ExpertWeights:
        t = self.src.tensors
        layout = self.src.arch.layouts[0]
        names = {role: tpl.format(layer=layer, expert=expert) for role, tpl in layout.names.items()}
        if layout.kind == "per_expert":
            return ExpertWeights(t[names["gate"]].to(dtype), t[names["up"]].to(dtype), t[names["down"]].to(dtype))
        # gpt-oss: gate_up [E, D, 2I] interleaved columns, down [E, I, D]
        gate_up = t[names["gate_up"]][expert].to(dtype)
        bias = t[names["gate_up_bias"]][expert].to(dtype)
        return ExpertWeights(gate_up[:, 0::2].T.contiguous(), gate_up[:, 1::2].T.contiguous(),
                             t[names["down"]][expert].to(dtype).T.contiguous(), bias[0::2], bias[1::2],
                             t[names["down_bias"]][expert].to(dtype))
