"""The fused Triton kernels against their torch references: RMSNorm and q/k-norm+rotary
(runtime/kernels/norm_rope_triton.py, reference runtime/models/blocks.py) and the prefill dequantizer with the
grouped-GEMM path (runtime/kernels/dequant_triton.py, reference runtime/kernels/expert_pool.py), the Gated
DeltaNet decode step (runtime/kernels/gdn_decode_triton.py, reference runtime/models/gated_deltanet.py), and the
int8 weight-only linear layer at decode sizes with its K split (runtime/kernels/int8_linear_triton.py, reference
its int8_linear_reference).

Without a GPU the kernels run under Triton's interpreter in a child process (TRITON_INTERPRET must be set
before triton is imported); with `--device cuda` they run compiled, in this process. The checks themselves
live in tests/kernel_checks.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("check", ["norm_rope", "dequant", "gdn_decode", "int8_linear"])
def test_kernels_match_the_torch_path(check, device):
    if device == "cuda":
        from tests.kernel_checks import CHECKS
        assert CHECKS[check]("cuda") == []
        return
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-m", "tests.kernel_checks", check], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all passed" in run.stdout


def test_static_attention_stores_rotated_kv_and_builds_the_mask_once(device):
    """blocks.attend_static with the raw k (normed, rotated and stored by store_rotated_kv: one launch on a GPU)
    gives the bits of the path that rotates k first and index_copies it; both caches hold the same rows; and
    the additive key mask is made once per step and shared by the layers (SDPA converted a bool mask in each)."""
    import torch

    from runtime.decode_graph import StaticKV
    from runtime.kv_cache import KVCache
    from runtime.models.blocks import RMSNorm, Rotary, attend_static, norm_and_rotate

    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    h, hkv, hd, bucket = 8, 2, 64, 16
    rope = Rotary(head_dim=hd, theta=10000.0)
    rope.init_buffers(device=device)
    norm = RMSNorm(hd, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hd, generator=gen) * 0.1 + 1.0)
    norm = norm.to(device, dtype)
    pos = 9
    write_at = torch.tensor([pos], device=device)
    key_pos = torch.arange(bucket, device=device)
    static = StaticKV(write_at=write_at, key_pos=key_pos, bucket=bucket, mask=(key_pos <= write_at)[None, :])
    cos_sin = rope.cos_sin(write_at, dtype)
    fused, plain = (KVCache(hkv, hd, device=device, dtype=dtype) for _ in range(2))
    for cache in (fused, plain):
        cache.reserve(bucket)
        cache.keys[:, :pos] = torch.randn(hkv, pos, hd, generator=gen).to(device, dtype)
        cache.values[:, :pos] = torch.randn(hkv, pos, hd, generator=gen).to(device, dtype)
    plain.keys.copy_(fused.keys)
    plain.values.copy_(fused.values)
    qkv = torch.randn(1, (h + 2 * hkv) * hd, generator=gen).to(device, dtype)
    q, k, v = qkv.split([h * hd, hkv * hd, hkv * hd], dim=-1)
    q, k, v = q.view(1, h, hd), k.view(1, hkv, hd), v.view(1, hkv, hd)    # strided views, as the projection's
    q = norm_and_rotate(q, norm, rope, cos_sin)
    got = attend_static(q, k, v, fused, static, scale=hd ** -0.5, k_norm=norm, rope=rope, cos_sin=cos_sin)
    mask = static.__dict__["_additive_mask"]
    want = attend_static(q, norm_and_rotate(k, norm, rope, cos_sin), v, plain, static, scale=hd ** -0.5)
    assert static.__dict__["_additive_mask"] is mask                       # built once, shared by the layers
    assert mask.shape == (1, h, 1, bucket) and torch.equal(torch.isinf(mask[0, 0, 0]), key_pos > pos)
    assert torch.equal(fused.keys[:, :bucket], plain.keys[:, :bucket])
    assert torch.equal(fused.values[:, :bucket], plain.values[:, :bucket])
    assert torch.equal(fused.values[:, pos], v[0])
    assert got.shape == (1, h, hd) and torch.equal(got, want)


def test_static_attention_falls_back_to_the_torch_path_when_its_kernels_fail(monkeypatch):
    """As on a GPU whose Triton cannot compile: the fused k/v store and the decode attention kernel fail once,
    their families switch off (runtime/kernels/fallback.py), and attend_static answers with the torch path's
    values, the cache written as that path writes it."""
    import torch

    from runtime.decode_graph import StaticKV
    from runtime.kernels import decode_attention_triton, fallback, norm_rope_triton
    from runtime.kv_cache import KVCache
    from runtime.models.blocks import Rotary, attend_static, norm_and_rotate

    monkeypatch.setattr(fallback, "disabled", {})

    def no_toolchain(*args, **kwargs):
        raise RuntimeError("triton: no C compiler")

    gen = torch.Generator().manual_seed(8)
    rope = Rotary(head_dim=32, theta=10000.0)
    rope.init_buffers(device="cpu")
    write_at, key_pos = torch.tensor([3]), torch.arange(8)
    static = StaticKV(write_at=write_at, key_pos=key_pos, bucket=8, mask=(key_pos <= write_at)[None, :])
    cos_sin = rope.cos_sin(write_at, torch.float32)
    q, k, v = (torch.randn(1, h, 32, generator=gen) for h in (4, 2, 2))
    want_cache = KVCache(2, 32, device="cpu", dtype=torch.float32)
    want_cache.reserve(8)
    want = attend_static(q, norm_and_rotate(k, None, rope, cos_sin), v, want_cache, static, scale=0.2)
    monkeypatch.setattr(norm_rope_triton, "available", lambda x: True)
    monkeypatch.setattr(decode_attention_triton, "available", lambda x: True)
    monkeypatch.setattr(norm_rope_triton, "norm_rope_store", no_toolchain)
    monkeypatch.setattr(norm_rope_triton, "norm_rope", no_toolchain)
    monkeypatch.setattr(decode_attention_triton, "decode_attention", no_toolchain)
    cache = KVCache(2, 32, device="cpu", dtype=torch.float32)
    cache.reserve(8)
    got = attend_static(q, k, v, cache, static, scale=0.2, rope=rope, cos_sin=cos_sin)
    assert torch.equal(got, want) and torch.equal(cache.keys, want_cache.keys)
    assert torch.equal(cache.values, want_cache.values)
    assert set(fallback.disabled) == {"norm_rope", "decode_attention"}
    # and from then on a GPU's decode steps are not its: the decode graphs' buckets stop doubling (SDPA reads them
    # whole)
    monkeypatch.setattr(decode_attention_triton, "HAVE_TRITON", True)
    monkeypatch.setattr(decode_attention_triton, "ENABLED", True)
    assert not decode_attention_triton.runs_on(torch.device("cuda"))
    fallback.disabled.clear()
    assert decode_attention_triton.runs_on(torch.device("cuda"))
