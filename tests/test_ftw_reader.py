"""The reader contract (docs/contracts.md) on lossless packages of every fixture family."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from runtime.ftw.converter import convert
from runtime.ftw.reader import FTWError, FTWPackage
from tests.fixtures.quantized import FAMILY_MODEL_TYPE, load_state_dict, reference_experts

FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "gpt_oss", "mixtral")


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_package_is_lossless_and_matches_the_contract(tiny_checkpoints, tmp_path, family):
    src = tiny_checkpoints(family)
    pkg = FTWPackage.open(convert(src, tmp_path / "pkg", codec="f32"))
    sd = load_state_dict(src)
    config = json.loads((src / "config.json").read_text())

    assert pkg.model_type == FAMILY_MODEL_TYPE[family]
    assert pkg.config["hidden_size"] == config["hidden_size"]
    assert pkg.generation_config["eos_token_id"] == json.loads((src / "generation_config.json").read_text())[
        "eos_token_id"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (pkg.tokenizer_dir / name).read_bytes() == (src / name).read_bytes()

    # Dense: every non-expert tensor, bit-exact, source dtype, and nothing expert-like.
    ref_experts = reference_experts(src, family)
    expert_sources = {n for n in sd if ".experts." in n}
    assert set(pkg.dense_names()) == set(sd) - expert_sources
    for name in pkg.dense_names():
        t = pkg.dense(name)
        assert t.dtype == sd[name].dtype and torch.equal(t, sd[name]), name

    ex = pkg.experts
    assert ex.codec == "f32" and ex.block_nbytes % 4096 == 0
    assert ex.layers == sorted({layer for layer, _ in ref_experts})
    assert ex.has_bias == (family == "gpt_oss")
    for (layer, e), ref in ref_experts.items():
        block = ex.block(layer, e)
        assert isinstance(block, np.ndarray) and block.dtype == np.uint8 and block.nbytes == ex.block_nbytes
        assert block.ctypes.data % 4096 == 0                                   # 4 KiB aligned in memory
        w = ex.dequantize(layer, e)
        for key, value in ref.items():
            assert torch.equal(getattr(w, key), value.float()), (layer, e, key)
        parts, stacked = ex.tensors(layer, e), ex.layer_tensors(layer)
        assert parts["gate"].shape == (ex.intermediate_size, ex.hidden_size)
        assert parts["down"].shape == (ex.hidden_size, ex.intermediate_size)
        for key, t in parts.items():
            assert stacked[key].shape[0] == ex.num_experts and torch.equal(stacked[key][e], t)
    # Zero-copy: a view over the block shares its memory.
    layer = ex.layers[-1]
    gate = ex.tensors(layer, 1)["gate"]
    assert gate.data_ptr() == ex.block(layer, 1).ctypes.data


def test_open_parses_only_the_manifest(tiny_checkpoints, tmp_path):
    path = convert(tiny_checkpoints("mixtral"), tmp_path / "pkg", codec="bf16")
    (path / "experts.bin").write_bytes(b"\xff" * (path / "experts.bin").stat().st_size)   # data never read at open
    t0 = time.perf_counter()
    pkg = FTWPackage.open(path)
    assert time.perf_counter() - t0 < 0.5
    assert pkg.experts._mm is None and pkg._dense_mm is None


def test_refuses_newer_partial_and_damaged_packages(tiny_checkpoints, tmp_path):
    path = convert(tiny_checkpoints("mixtral"), tmp_path / "pkg", codec="bf16")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FTWError, match=r"this model was converted by a newer FreeToken \(format 99\); "
                                       r"update FreeToken or convert it again"):
        FTWPackage.open(path)

    partial = tmp_path / "other.partial"
    partial.mkdir()
    with pytest.raises(FTWError, match="did not finish"):
        FTWPackage.open(partial)
    with pytest.raises(FTWError, match="did not finish"):
        FTWPackage.open(tmp_path / "other")

    path2 = convert(tiny_checkpoints("mixtral"), tmp_path / "pkg2", codec="bf16")
    with open(path2 / "experts.bin", "r+b") as fh:
        fh.truncate(4096)
    with pytest.raises(FTWError, match="experts.bin.*damaged"):
        FTWPackage.open(path2)
