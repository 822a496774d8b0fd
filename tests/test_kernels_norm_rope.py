"""The fused RMSNorm and norm+rotary Triton kernels against the torch path of runtime/models/blocks.py.

On a machine without a GPU the kernels run under Triton's interpreter in a child process (TRITON_INTERPRET
must be set before triton is imported); with `--device cuda` they run compiled, in this process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path



def test_kernels_match_the_torch_path(device):
    if device == "cuda":
        from tests.kernel_checks import check_norm_rope
        assert check_norm_rope("cuda") == []
        return
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-m", "tests.kernel_checks", "norm_rope"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all passed" in run.stdout
