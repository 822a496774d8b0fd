"""The lead's fused Triton kernels against their torch references: RMSNorm and q/k-norm+rotary
(runtime/kernels/norm_rope_triton.py, reference runtime/models/blocks.py) and the prefill dequantizer with the
grouped-GEMM path (runtime/kernels/dequant_triton.py, reference runtime/kernels/expert_pool.py).

Without a GPU the kernels run under Triton's interpreter in a child process (TRITON_INTERPRET must be set
before triton is imported); with `--device cuda` they run compiled, in this process. The checks themselves
live in tests/kernel_checks.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("check", ["norm_rope", "dequant"])
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
