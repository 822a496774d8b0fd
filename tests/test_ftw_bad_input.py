"""Bad input: each case stops with an FTWError naming the file and the tensor, and leaves nothing that
looks like a complete package (FTWPackage.open refuses whatever is left)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.ftw.converter import convert
from runtime.ftw.errors import FTWError
from runtime.ftw.reader import FTWPackage
from runtime.ftw.verify import verify

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def ckpt(tiny_checkpoints, tmp_path) -> Path:
    """A private copy of the tiny Mixtral checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_checkpoints("mixtral"), tmp_path / "src"))


def index(src: Path) -> dict:
    return json.loads((src / "model.safetensors.index.json").read_text())


def shard_of(src: Path, tensor: str) -> Path:
    return src / index(src)["weight_map"][tensor]


def assert_fails_cleanly(src: Path, out: Path, *patterns: str, **kwargs) -> FTWError:
    with pytest.raises(FTWError) as info:
        convert(src, out, **kwargs)
    message = str(info.value)
    for pattern in patterns:
        assert pattern in message, message
    assert not out.exists()
    with pytest.raises(FTWError):
        FTWPackage.open(out)
    return info.value


EXPERT = "model.layers.1.block_sparse_moe.experts.5.w3.weight"


def test_truncated_shard(ckpt, tmp_path):
    shard = shard_of(ckpt, EXPERT)
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 100)
    assert_fails_cleanly(ckpt, tmp_path / "out", shard.name, "truncated", "tensor model.")


def test_corrupt_header(ckpt, tmp_path):
    shard = shard_of(ckpt, EXPERT)
    with open(shard, "r+b") as fh:
        fh.seek(8)
        fh.write(b"\x00garbage{{{")
    first_in_shard = sorted(n for n, f in index(ckpt)["weight_map"].items() if f == shard.name)
    err = assert_fails_cleanly(ckpt, tmp_path / "out", shard.name, "corrupt safetensors header")
    assert any(name in str(err) for name in first_in_shard)


def test_header_length_beyond_the_file(ckpt, tmp_path):
    shard = shard_of(ckpt, EXPERT)
    with open(shard, "r+b") as fh:
        fh.write((10 ** 9).to_bytes(8, "little"))
    assert_fails_cleanly(ckpt, tmp_path / "out", shard.name, "corrupt safetensors header")


def _rewrite_shard_without(src: Path, tensor: str, *, keep_in_index: bool) -> None:
    from safetensors.torch import load_file, save_file

    shard = shard_of(src, tensor)
    tensors = load_file(shard)
    del tensors[tensor]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    if not keep_in_index:
        idx = index(src)
        del idx["weight_map"][tensor]
        (src / "model.safetensors.index.json").write_text(json.dumps(idx))


def test_missing_tensor(ckpt, tmp_path):
    _rewrite_shard_without(ckpt, EXPERT, keep_in_index=False)
    assert_fails_cleanly(ckpt, tmp_path / "out", "missing tensor", EXPERT, "model.safetensors.index.json")


def test_tensor_listed_in_index_but_absent_from_its_shard(ckpt, tmp_path):
    shard = shard_of(ckpt, EXPERT)
    _rewrite_shard_without(ckpt, EXPERT, keep_in_index=True)
    assert_fails_cleanly(ckpt, tmp_path / "out", shard.name, "missing tensor", EXPERT)


def test_missing_dense_tensor(ckpt, tmp_path):
    _rewrite_shard_without(ckpt, "model.layers.0.post_attention_layernorm.weight", keep_in_index=False)
    assert_fails_cleanly(ckpt, tmp_path / "out", "missing tensor model.layers.0.post_attention_layernorm.weight")


def test_shape_disagrees_with_config(ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (ckpt / "config.json").write_text(json.dumps(cfg))
    err = assert_fails_cleanly(ckpt, tmp_path / "out", "config.json", "model.layers.0.block_sparse_moe.experts.0.")
    assert ".safetensors" in str(err) and "48" in str(err)


def test_vocab_disagrees_with_config(ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["vocab_size"] = 512
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_fails_cleanly(ckpt, tmp_path / "out", "model.embed_tokens.weight", "vocab_size", ".safetensors")


def test_unsupported_architecture(ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "deepseek_v3"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_fails_cleanly(ckpt, tmp_path / "out", "config.json", "unsupported architecture 'deepseek_v3'", "mixtral")


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "gptq", "bits": 4}, "unsupported quantization 'gptq'"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "quant_algo W4A8_AWQ"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "int-quantized"),
])
def test_unsupported_quantization(ckpt, tmp_path, qc, words):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = qc
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_fails_cleanly(ckpt, tmp_path / "out", "config.json", words)


def test_unknown_codec_and_group_size(ckpt, tmp_path):
    assert_fails_cleanly(ckpt, tmp_path / "out", "unknown codec 'int3'", codec="int3")
    assert_fails_cleanly(ckpt, tmp_path / "out", "group-size", "48", group_size=48)


def test_existing_package_is_not_overwritten_without_force(ckpt, tmp_path):
    out = convert(ckpt, tmp_path / "out", codec="bf16")
    before = (out / "manifest.json").read_bytes()
    with pytest.raises(FTWError, match="already exists"):
        convert(ckpt, out, codec="f32")
    assert (out / "manifest.json").read_bytes() == before
    assert FTWPackage.open(convert(ckpt, out, codec="f32", overwrite=True)).experts.codec == "f32"


# ---- the file system refuses: run the converter in a child so limits and dropped privileges stay there

CHILD = textwrap.dedent("""
    import ctypes, os, resource, signal, sys
    limit, drop_caps = int(sys.argv[1]), sys.argv[2] == "1"
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # get EFBIG from write() instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    if drop_caps:                                         # root ignores permission bits unless it drops these
        libc = ctypes.CDLL(None, use_errno=True)
        class Hdr(ctypes.Structure): _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class Data(ctypes.Structure): _fields_ = [("eff", ctypes.c_uint32), ("perm", ctypes.c_uint32), ("inh", ctypes.c_uint32)]
        hdr, data = Hdr(0x20080522, 0), (Data * 2)()
        libc.capget(ctypes.byref(hdr), data)
        data[0].eff &= ~0b1110                            # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
        assert libc.capset(ctypes.byref(hdr), data) == 0
    from app.cli import main
    sys.exit(main(sys.argv[3:]))
""")


def run_child(*args: str, limit: int = 0, drop_caps: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", CHILD, str(limit), "1" if drop_caps else "0", *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def test_full_disk_then_resume(ckpt, tmp_path):
    out = tmp_path / "out"
    r = run_child("convert", str(ckpt), "--out", str(out), "--codec", "f32", limit=120_000)
    assert r.returncode == 1, r.stderr
    assert "disk is full" in r.stderr and "dense.bin" in r.stderr and "cannot write tensor model." in r.stderr
    assert not out.exists() and (tmp_path / "out.partial").is_dir()
    assert not (tmp_path / "out.partial" / "manifest.json").exists()
    with pytest.raises(FTWError, match="did not finish"):
        FTWPackage.open(out)
    # With space again, the same command finishes the job and the package verifies.
    convert(ckpt, out, codec="f32")
    assert verify(out).ok and not (tmp_path / "out.partial").exists()


def test_read_only_destination(ckpt, tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        r = run_child("convert", str(ckpt), "--out", str(parent / "pkg"), drop_caps=os.geteuid() == 0)
    finally:
        parent.chmod(0o755)
    assert r.returncode == 1, r.stderr
    assert "read-only" in r.stderr and str(parent / "pkg.partial") in r.stderr
    assert list(parent.iterdir()) == []


def test_quantized_tensor_without_known_scales(ckpt, tmp_path):
    """An FP8 expert with no weight_scale_inv must not be read as if it were a float weight."""
    import torch
    from safetensors.torch import load_file, save_file

    shard = shard_of(ckpt, EXPERT)
    tensors = load_file(shard)
    tensors[EXPERT] = tensors[EXPERT].to(torch.float8_e4m3fn)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert_fails_cleanly(ckpt, tmp_path / "out", shard.name, EXPERT, "F8_E4M3", "unsupported quantization")


def test_missing_tokenizer_fails_before_converting(ckpt, tmp_path):
    (ckpt / "tokenizer.json").unlink()
    assert_fails_cleanly(ckpt, tmp_path / "out", "tokenizer.json missing")
    assert not (tmp_path / "out.partial").exists()


def test_nvfp4_scale_that_does_not_fit_its_weight(tiny_checkpoints, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from tests.fixtures.quantized import build_nvfp4

    src = build_nvfp4(tiny_checkpoints("qwen3_moe"), tmp_path / "nv")
    name = "model.layers.2.mlp.experts.4.down_proj.weight_scale"
    shard = src / index(src)["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name][:, :1].contiguous()                  # one block of scales per row instead of two
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert_fails_cleanly(src, tmp_path / "out", shard.name, name, "does not fit weight")
    tensors[name] = torch.zeros(64, 2, dtype=torch.float32)             # right shape, wrong dtype
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert_fails_cleanly(src, tmp_path / "out", shard.name, name, "F32", "F8_E4M3")
