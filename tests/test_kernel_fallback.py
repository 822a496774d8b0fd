"""A Triton kernel that cannot compile or launch here (no toolchain, unsupported GPU) is switched off once,
with the cause in the log, and the torch reference answers instead — the model keeps working."""
from __future__ import annotations

import logging

import torch

from runtime.kernels import fallback, norm_rope_triton
from runtime.models.blocks import RMSNorm, route_softmax_topk


def test_first_failure_switches_the_family_off_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(fallback, "disabled", {})
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("failed to compile the launcher: no C compiler found")

    with caplog.at_level(logging.WARNING):
        assert fallback.run("norm", broken, lambda: "torch") == "torch"
        assert fallback.run("norm", broken, lambda: "torch") == "torch"
    assert len(calls) == 1                                      # not retried on every call
    assert "no C compiler" in fallback.disabled["norm"] and caplog.text.count("torch path from now on") == 1
    assert fallback.run("router", lambda: "kernel", lambda: "torch") == "kernel"    # other families unaffected


def test_out_of_memory_is_not_a_broken_kernel(monkeypatch):
    """A full GPU fails the step (the engine ends that request and serves on); it must not switch the fast
    kernel off for the rest of the process."""
    import pytest
    monkeypatch.setattr(fallback, "disabled", {})

    def full():
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        fallback.run("dequant", full, lambda: "torch")
    assert fallback.disabled == {}


def test_a_model_norm_falls_back_to_the_reference_values(monkeypatch):
    monkeypatch.setattr(fallback, "disabled", {})
    monkeypatch.setattr(norm_rope_triton, "available", lambda x: True)       # as on a GPU

    def no_toolchain(*args, **kwargs):
        raise RuntimeError("triton: no C compiler")

    monkeypatch.setattr(norm_rope_triton, "rms_norm", no_toolchain)
    monkeypatch.setattr(norm_rope_triton, "add_rms_norm", no_toolchain)
    norm = RMSNorm(64, eps=1e-6)
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    torch.testing.assert_close(norm(x), norm.reference(x), rtol=0, atol=0)
    total, normed = norm.add_and_norm(x, r)
    torch.testing.assert_close(total, x + r, rtol=0, atol=0)
    torch.testing.assert_close(normed, norm.reference(x + r), rtol=0, atol=0)
    assert set(fallback.disabled) == {"norm"}
    # routing on a CPU tensor never tries the kernel
    ids, w = route_softmax_topk(torch.randn(2, 8), 2, renormalize=True)
    assert ids.shape == (2, 2) and torch.allclose(w.sum(-1), torch.ones(2))
