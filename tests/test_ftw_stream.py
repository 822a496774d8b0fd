"""Streaming: converting a checkpoint several times larger than the memory bound stays under it.

The converter's stated bound (docs/ftw-format.md): peak memory growth ≤ 8 × max(one expert's source
bytes, chunk_bytes) + 16 MiB. Here chunk_bytes = 1 MiB and an expert is 384 KiB, so the bound is
24 MiB, and the checkpoint is ~110 MiB. Peak RSS is measured in a child process with the kernel's
own high-water mark (VmHWM, reset through /proc/self/clear_refs just before converting).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHUNK = 1 << 20
BOUND = 8 * CHUNK + (16 << 20)

CHILD = """
import json, sys, time
from pathlib import Path
import torch
from runtime.ftw.converter import convert
torch.set_num_threads(1)          # a shared CI machine: the thread pool's wake-ups cost more than they save

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
src, out, warm, chunk = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
convert(warm, out.with_name("warm"), codec="int4", chunk_bytes=chunk)      # load every code path once
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")                                                         # reset the peak to now
before = status("VmRSS")
convert(src, out, codec="int4", chunk_bytes=chunk)
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_convert", REPO / "benchmarks" / "bench_convert.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_convert", module)         # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
def test_peak_memory_stays_bounded(tiny_checkpoints, tmp_path):
    bench = load_bench()
    config, specs, extra = bench.qwen3_moe_specs(layers=8, hidden=256, inter=256, experts=32, vocab=8192, heads=4,
                                                 kv_heads=2, head_dim=64)
    src = tmp_path / "src"
    total = bench.write_checkpoint(src, config, specs, extra_files=extra, shard_bytes=32 << 20)
    assert total > 4 * BOUND                                              # several times the bound
    expert_bytes = 3 * 256 * 256 * 2
    assert 8 * expert_bytes < 8 * CHUNK
    r = subprocess.run([sys.executable, "-c", CHILD, str(src), str(tmp_path / "out"),
                        str(tiny_checkpoints("qwen3_moe")), str(CHUNK)],
                       capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       timeout=300)
    assert r.returncode == 0, r.stderr
    mem = json.loads(r.stdout.strip().splitlines()[-1])
    growth = mem["peak"] - mem["before"]
    assert mem["before"] > 0 and growth <= BOUND, f"peak grew {growth / 2**20:.1f} MiB, bound {BOUND / 2**20:.0f} MiB"
    out_bytes = sum(p.stat().st_size for p in (tmp_path / "out").iterdir())
    assert out_bytes > BOUND                                              # nor did the (int4) output
