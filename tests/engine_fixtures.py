"""Shared helpers for the engine and model tests: packages built once per session, sources, prompts."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from runtime.experts.interface import ExpertWeights


class SafetensorsSource:
    """A Hugging Face checkpoint folder read directly (dense tensors + canonical experts), FTWPackage-shaped.

    Lets the model tests compare against transformers without going through the converter, so a
    converter bug and a model bug show up in different tests.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.config = json.loads((self.path / "config.json").read_text())
        self.model_type = self.config["model_type"]
        gen = self.path / "generation_config.json"
        self.generation_config = json.loads(gen.read_text()) if gen.is_file() else {}
        self.tokenizer_dir = self.path
        self.tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(self.path.glob("*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                for key in f.keys():
                    self.tensors[key] = f.get_tensor(key)
        self.experts = _Experts(self)
        self._expert_re = re.compile(r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.experts\.")

    def dense_names(self) -> list[str]:
        return [n for n in self.tensors if not self._expert_re.match(n)]

    def dense(self, name: str) -> torch.Tensor:
        return self.tensors[name]


# family -> (expert tensor name templates, routed-expert count keys); gpt-oss is fused and interleaved
_EXPERT_NAMES = {
    "qwen3_moe": "model.layers.{layer}.mlp.experts.{expert}.{{}}_proj.weight",
    "mixtral": "model.layers.{layer}.block_sparse_moe.experts.{expert}.{{}}.weight",
}
_MIXTRAL_ROLES = {"gate": "w1", "up": "w3", "down": "w2"}


class _Experts:
    def __init__(self, src: SafetensorsSource):
        self.src = src
        c = src.config
        self.num_experts = int(c.get("num_experts") or c.get("num_local_experts"))
        dense_only = set(c.get("mlp_only_layers") or [])
        step = int(c.get("decoder_sparse_step") or 1)
        self.layers = [i for i in range(c["num_hidden_layers"]) if i not in dense_only and (i + 1) % step == 0]

    def dequantize(self, layer: int, expert: int, dtype=torch.float32) -> ExpertWeights:
        t, mt = self.src.tensors, self.src.model_type
        if mt in _EXPERT_NAMES:
            tpl = _EXPERT_NAMES[mt].format(layer=layer, expert=expert)
            role = (lambda r: _MIXTRAL_ROLES[r]) if mt == "mixtral" else (lambda r: r)
            return ExpertWeights(*(t[tpl.format(role(r))].to(dtype) for r in ("gate", "up", "down")))
        # gpt-oss: gate_up [E, D, 2I] with interleaved columns (even gate, odd up), down [E, I, D]
        pre = f"model.layers.{layer}.mlp.experts."
        gate_up = t[pre + "gate_up_proj"][expert].to(dtype)
        bias = t[pre + "gate_up_proj_bias"][expert].to(dtype)
        return ExpertWeights(gate_up[:, 0::2].T.contiguous(), gate_up[:, 1::2].T.contiguous(),
                             t[pre + "down_proj"][expert].to(dtype).T.contiguous(), bias[0::2], bias[1::2],
                             t[pre + "down_proj_bias"][expert].to(dtype))


# ------------------------------------------------------------------------------------------- fixtures

OWN_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")


@pytest.fixture(scope="session")
def ftw_packages(tiny_checkpoints, tmp_path_factory):
    """(family, codec) -> folder of the tiny checkpoint converted to FTW; each built once per session."""
    from runtime.ftw.converter import convert

    root = tmp_path_factory.mktemp("tiny-ftw")
    built: dict[tuple[str, str], Path] = {}

    def get(family: str, codec: str = "f32") -> Path:
        if (family, codec) not in built:
            built[family, codec] = convert(tiny_checkpoints(family), root / f"{family}-{codec}", codec=codec)
        return built[family, codec]

    return get


@pytest.fixture(scope="session")
def references(tiny_checkpoints):
    """family -> the transformers model on the tiny checkpoint (fp32, eager), loaded once per session."""
    from tests.fixtures.checkpoints import load_reference

    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = load_reference(tiny_checkpoints(family))
        return loaded[family]

    return get


def random_prompt(length: int, *, seed: int, vocab: int = 370) -> list[int]:
    """Token ids below the fixture tokenizers' special tokens, deterministic by seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def reference_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate for exactly n tokens (EOS masked off, explicit attention mask so a
    prompt token that happens to equal pad_token_id is not taken for padding)."""
    ids = torch.tensor([prompt])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                       min_new_tokens=n, pad_token_id=ref.generation_config.pad_token_id)
    return out[0, len(prompt):].tolist()


def teacher_forced_sampling(monkeypatch) -> tuple[list, list]:
    """Record every engine sampling call's logits and chosen tokens in `steps` ([(rows fp32 on the CPU, chosen)]);
    once `forced` holds a first run's chosen tensors, a second run takes those instead of sampling (teacher
    forcing), so two runs that place or round things differently can be compared logit by logit, step by step -
    a greedy token near a tie may flip between them where the logits still agree. Returns (steps, forced)."""
    import runtime.engine as engine_mod

    sample, steps, forced = engine_mod.sample_batch, [], []

    def recording(rows, samplers, **kw):
        chosen = forced[len(steps)].clone() if forced else sample(rows, samplers, **kw)
        steps.append((rows.float().cpu().clone(), chosen.clone()))
        return chosen

    monkeypatch.setattr(engine_mod, "sample_batch", recording)
    return steps, forced
