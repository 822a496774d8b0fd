"""A checkpoint shipped as one model.safetensors with no index converts like a sharded one."""
from __future__ import annotations

import torch

from runtime.ftw.converter import convert
from runtime.ftw.reader import FTWPackage
from tests.fixtures.checkpoints import build_checkpoint


def test_single_file_checkpoint_without_index_converts(tmp_path):
    src = build_checkpoint("mixtral", tmp_path / "src", seed=5, max_shard_size="10GB")
    assert not (src / "model.safetensors.index.json").exists() and (src / "model.safetensors").is_file()
    out = tmp_path / "pkg"
    convert(src, out, codec="f32")
    pkg = FTWPackage.open(out)
    sharded = build_checkpoint("mixtral", tmp_path / "sharded", seed=5)     # same weights, several shards
    out2 = tmp_path / "pkg2"
    convert(sharded, out2, codec="f32")
    other = FTWPackage.open(out2)
    assert pkg.dense_names() == other.dense_names()
    for name in pkg.dense_names():
        assert torch.equal(pkg.dense(name), other.dense(name)), name
    w, w2 = pkg.experts.dequantize(1, 3), other.experts.dequantize(1, 3)
    assert torch.equal(w.gate, w2.gate) and torch.equal(w.down, w2.down)
