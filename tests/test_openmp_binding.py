"""numba's OpenMP layer binds to its own libgomp, not torch's (runtime/experts/openmp.py, issue 10).

The dynamic linker says where each symbol bound (LD_DEBUG=bindings): with the expert kernels imported first,
numba's omppool must call its own libgomp; imported plainly after torch, it calls torch's (the control, which
shows the test can tell the two apart)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
if sys.argv[1] == "early":                       # the kernels' module imported before anything imported torch
    import runtime.experts.cpu_kernels_int8      # noqa: F401
import torch
torch.set_num_threads(2)
torch.ones(1 << 22).sum()                        # torch's intra-op pool, as the planner's probe makes one
if sys.argv[1] == "kernels":
    import runtime.experts.cpu_kernels_int8      # noqa: F401  (loads numba's OpenMP layer privately)
import numba
import numpy as np

@numba.njit(parallel=True)
def total(a):
    s = 0.0
    for i in numba.prange(a.shape[0]):
        s += a[i]
    return s

assert total(np.ones(100_000)) == 100_000.0
from runtime.experts.openmp import load_private_openmp
print(numba.threading_layer(), load_private_openmp())
"""


def _bindings(tmp_path: Path, mode: str) -> tuple[str, dict[str, str]]:
    """Run SCRIPT under LD_DEBUG=bindings; (its output, {omppool symbol: the library it bound to})."""
    log = tmp_path / f"ld-{mode}"
    env = dict(os.environ, LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(log), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    bound = {}
    for path in tmp_path.glob(f"ld-{mode}.*"):
        for line in path.read_text(errors="replace").splitlines():
            m = re.search(r"binding file (\S*omppool\S*) \[\d+\] to (\S+) \[\d+\]: normal symbol `(\w+)'", line)
            if m and ("omp_" in m[3] or "GOMP_" in m[3]):
                bound[m[3]] = m[2]
    return run.stdout.strip(), bound


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RTLD_DEEPBIND and LD_DEBUG are glibc's")
def test_numba_openmp_binds_to_its_own_libgomp_beside_torch(tmp_path):
    torch_dir = str(Path(__import__("torch").__file__).parent)
    out, bound = _bindings(tmp_path, "kernels")
    assert out == "omp private"
    assert {"GOMP_parallel", "omp_set_num_threads"} <= set(bound), bound
    assert not any(lib.startswith(torch_dir) for lib in bound.values()), bound
    out, early = _bindings(tmp_path, "early")          # torch is loaded first anyway, so it keeps its own
    assert out == "omp private" and early == bound

    out, plain = _bindings(tmp_path, "plain")          # the control: loaded the ordinary way
    assert out == "omp already loaded"
    assert {"GOMP_parallel", "omp_set_num_threads"} <= set(plain), plain
    torch_gomp = [lib for lib in plain.values() if lib.startswith(torch_dir)]
    if list(Path(torch_dir, "lib").glob("libgomp*")):  # torch ships its own libgomp (pip wheels): shared before
        assert torch_gomp, plain
        assert set(bound.values()).isdisjoint(torch_gomp)
    else:                                              # torch uses the system's libgomp: nothing to keep apart
        assert set(plain.values()) == set(bound.values())
