"""Kernel-vs-reference checks run in a child process with TRITON_INTERPRET=1 (Triton's CPU interpreter), so
that GPU-less machines test the Triton kernels' logic. Also importable with `--device cuda` (compiled kernels).

    python -m tests.kernel_checks norm_rope        # exits 0 when every check passed, prints the worst errors
"""
from __future__ import annotations

import sys

import torch


def check_norm_rope(device: str = "cpu") -> list[str]:
    from runtime.kernels import norm_rope_triton as k
    from runtime.models.blocks import RMSNorm, Rotary

    failures = []
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for flavour in ("llama", "fp32", "offset"):
            for rows, d in ((1, 64), (5, 96), (3, 2048)):
                norm = RMSNorm(d, eps=1e-6, flavour=flavour)
                with torch.no_grad():
                    norm.weight.copy_(torch.randn(d, generator=gen) * 0.1 + (0.0 if flavour == "offset" else 1.0))
                norm = norm.to(device, dtype if flavour == "llama" else torch.float32)
                x = (torch.randn(rows, d, generator=gen) * 3).to(device, dtype)
                got, want = k.rms_norm(x, norm.weight, eps=norm.eps, flavour=flavour), norm.reference(x)
                err = (got.float() - want.float()).abs().max().item()
                # bf16: the fp32 sum of squares adds up in another order, which may flip the rounding of the
                # normalised value by one unit in the last place, and the weight multiply rounds again: 2 ulps
                tol = 0.0 if dtype == torch.float32 else 2 ** -6 * want.float().abs().max().item()
                if got.dtype != want.dtype or err > max(tol, 1e-5):
                    failures.append(f"rms_norm {dtype} {flavour} {rows}x{d}: max error {err:.3g}")
        for hd, factor, with_norm in ((128, 1.0, True), (64, 1.0, False), (256, 0.25, True)):
            n, h = 3, 4
            rope = Rotary(head_dim=hd, theta=10000.0, partial_rotary_factor=factor)
            rope.init_buffers(device=device)
            pos = torch.tensor([0, 7, 1000], device=device)
            cos, sin = rope.cos_sin(pos, dtype)
            norm = RMSNorm(hd, eps=1e-6, flavour="llama") if with_norm else None
            if norm is not None:
                with torch.no_grad():
                    norm.weight.copy_(torch.randn(hd, generator=gen) * 0.1 + 1.0)
                norm = norm.to(device, dtype)
            # q as a view of a fused q/k/v projection's output: rows strided past the heads
            x = torch.randn(n, h * hd + 3 * hd, generator=gen).to(device, dtype)[:, :h * hd].view(n, h, hd)
            want = rope.apply(norm.reference(x) if norm is not None else x, cos, sin)
            got = k.norm_rope(x, cos, sin, weight=None if norm is None else norm.weight, eps=1e-6,
                              rotary_dim=rope.rotary_dim)
            err = (got.float() - want.float()).abs().max().item()
            tol = 1e-5 if dtype == torch.float32 else 2e-2 * want.float().abs().max().item()
            if err > tol:
                failures.append(f"norm_rope {dtype} hd {hd} rd {rope.rotary_dim} norm {with_norm}: max error {err:.3g}")
    return failures


CHECKS = {"norm_rope": check_norm_rope}

if __name__ == "__main__":
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    bad = CHECKS[sys.argv[1]](device)
    print("\n".join(bad) or "all passed")
    sys.exit(1 if bad else 0)
