"""The test fixtures are deterministic and load in transformers: the ground every engine test stands on."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.checkpoints import FAMILIES, build_checkpoint, load_reference


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_builds_and_runs(tiny_checkpoints, family):
    path = tiny_checkpoints(family)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2          # sharded: the loaders must follow the index
    model = load_reference(path)
    logits = model(torch.arange(1, 20).unsqueeze(0)).logits
    assert logits.shape == (1, 19, 384) and torch.isfinite(logits).all()
    gen = json.loads((path / "generation_config.json").read_text())
    assert isinstance(gen["eos_token_id"], list) and gen["eos_token_id"]


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a = build_checkpoint("mixtral", tmp_path / "a", seed=3, max_shard_size="10GB")
    b = build_checkpoint("mixtral", tmp_path / "b", seed=3, max_shard_size="10GB")
    c = build_checkpoint("mixtral", tmp_path / "c", seed=4, max_shard_size="10GB")
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.norm.weight"], wc["model.norm.weight"])
    assert not torch.allclose(wa["model.norm.weight"], torch.ones_like(wa["model.norm.weight"]))  # perturbed


def test_tokenizer_round_trips_any_text(tiny_checkpoints):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_checkpoints("qwen3_moe") / "tokenizer.json"))
    text = "Grüße 🦊 東京 <|im_start|>user\nhi<|im_end|>"
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert tok.token_to_id("<|im_start|>") in enc.ids        # specials are single tokens
