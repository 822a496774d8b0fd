"""benchmarks/bench_sdpa_shapes.py on this machine's CPU: the table has a row per backend and case, a backend that
cannot take a case says so instead of a number, and each timed case was met at five new lengths and once again -
lengths no other backend met (a cached cuDNN plan would otherwise pass for a first call)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_sdpa_shapes.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_sdpa_shapes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_sdpa_shapes_times_new_shapes_and_a_repeat_per_backend(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "sdpa.json"
    assert bench.main(["--device", "cpu", "--heads", "4", "1", "16", "--prompt", "32", "--keys", "64",
                       "--backends", "default", "math", "cudnn", "--out", str(out)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4/1x16")]
    assert len(table) == 2 * 3                                       # two cases x three backends
    rows = json.loads(out.read_text())["rows"]
    cudnn = [r for r in rows if r["backend"] == "cudnn"]
    assert cudnn and all("error" in r for r in cudnn)                # no cuDNN on a CPU: said, not timed
    assert all(line.split("|")[5].strip().startswith("- (") for line in table if "| cudnn |" in line)
    timed = [r for r in rows if r["backend"] != "cudnn"]
    assert {(r["case"], r["backend"]) for r in timed} == {(c, b) for c in ("prompt", "lone token")
                                                          for b in ("default", "math")}
    for r in timed:
        assert len(r["first_ms_each"]) == bench.NEW_SHAPES and r["repeat_ms"] > 0
        assert r["first_ms"] == sorted(r["first_ms_each"])[bench.NEW_SHAPES // 2]    # the median of the five
    for case in ("prompt", "lone token"):
        met = [r["lengths"] for r in timed if r["case"] == case]
        assert all(len(set(each)) == bench.NEW_SHAPES for each in met)
        assert not set(met[0]) & set(met[1])                         # the two backends never share a length
