"""numba's OpenMP layer binds to its own libgomp, not torch's, where the CPU-share worker will run
(runtime/experts/openmp.py, issue 10).

The dynamic linker says where each symbol bound (LD_DEBUG=bindings): after a zero-copy tier is built (the one
that may start a CPU-share worker), numba's omppool must call its own libgomp; after a tier that only runs
misses on the CPU (a CPU engine, whose torch and numba pools take turns every layer and must not both spin), it
calls torch's as before - the control, which also shows the test can tell the two apart."""
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
if sys.argv[1] == "early":                       # the private load before anything imported torch
    from runtime.experts.openmp import load_private_openmp
    load_private_openmp()
import torch
torch.set_num_threads(2)
torch.ones(1 << 22).sum()                        # torch's intra-op pool, as the planner's probe makes one
if sys.argv[1] in ("zero-copy", "cpu-tier"):
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.hybrid import HybridExperts, HybridOptions
    from runtime.experts.interface import ExpertSpec
    store = HostExpertStore.synthetic(layers=1, num_experts=4, hidden=64, intermediate=64, codec="int4")
    HybridExperts(store, ExpertSpec(), device="cpu", dtype=torch.float32, options=HybridOptions(
        slots=1, top_k=2, zero_copy=sys.argv[1] == "zero-copy"))     # its warm-up launches numba's threads
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
    for path in tmp_path.glob(f"ld-{mode}.*"):          # ~100 MB of every binding: keep omppool's, then delete
        with path.open(errors="replace") as lines:
            for line in lines:
                if "omppool" not in line:
                    continue
                m = re.search(r"binding file (\S*omppool\S*) \[\d+\] to (\S+) \[\d+\]: normal symbol `(\w+)'", line)
                if m and ("omp_" in m[3] or "GOMP_" in m[3]):
                    bound[m[3]] = m[2]
        path.unlink()
    return run.stdout.strip(), bound


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RTLD_DEEPBIND and LD_DEBUG are glibc's")
def test_numba_openmp_binds_to_its_own_libgomp_beside_torch(tmp_path):
    torch_dir = str(Path(__import__("torch").__file__).parent)
    out, bound = _bindings(tmp_path, "zero-copy")
    assert out == "omp private"
    assert {"GOMP_parallel", "omp_set_num_threads"} <= set(bound), bound
    assert not any(lib.startswith(torch_dir) for lib in bound.values()), bound
    out, early = _bindings(tmp_path, "early")          # torch is loaded first anyway, so it keeps its own
    assert out == "omp private" and early == bound

    out, plain = _bindings(tmp_path, "cpu-tier")       # the control: loaded the ordinary way
    assert out == "omp already loaded"
    assert {"GOMP_parallel", "omp_set_num_threads"} <= set(plain), plain
    torch_gomp = [lib for lib in plain.values() if lib.startswith(torch_dir)]
    if list(Path(torch_dir, "lib").glob("libgomp*")):  # torch ships its own libgomp (pip wheels): shared before
        assert torch_gomp, plain
        assert set(bound.values()).isdisjoint(torch_gomp)
    else:                                              # torch uses the system's libgomp: nothing to keep apart
        assert set(plain.values()) == set(bound.values())


def test_a_cpu_engine_after_the_private_binding_is_told_to_restart(monkeypatch, caplog):
    """Once numba's OpenMP is private (a zero-copy GPU model loaded it so), a tier whose misses take turns with
    torch's dense layers contends with torch's pool: it must say so; before that, it says nothing."""
    from runtime.experts import openmp

    monkeypatch.setattr(openmp, "_state", {"result": "already loaded"})
    with caplog.at_level("WARNING", logger=openmp.__name__):
        assert openmp.warn_if_private_beside_torch() is False
    assert not caplog.records
    monkeypatch.setattr(openmp, "_state", {"result": "private"})
    with caplog.at_level("WARNING", logger=openmp.__name__):
        assert openmp.warn_if_private_beside_torch() is True
    assert "restart" in caplog.text
