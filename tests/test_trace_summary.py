"""benchmarks/trace_summary.py on a small made-up trace: counts, idle time and one layer's timeline."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from trace_summary import kernels, summarize   # noqa: E402


def test_a_layer_timeline_and_the_idle_time(tmp_path):
    events, t = [], 0.0
    for layer in range(4):                    # attention 10 µs, handoff 2, gather 30, a 5 µs gap, collect 3
        for name, dur, gap in (("attn_kernel", 200 if layer == 1 else 10, 1), ("_handoff_kernel", 2, 0),
                               ("_gather_kernel", 30, 0), ("_collect_kernel", 3, 5)):
            t += gap
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur})
            t += dur
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 500})   # not a kernel
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    ks = kernels(str(path))
    assert len(ks) == 16 and ks[0][2] == "attn_kernel"
    text = summarize(ks, 2, "handoff")
    assert "idle between kernels 0.02 ms" in text              # 4 x 6 µs of gaps, less the first one's 1
    row = next(line.split() for line in text.splitlines() if line.startswith("_gather_kernel"))
    assert text.index("attn_kernel") < text.index("_gather_kernel")     # by time a step: 115 µs before 60
    assert row[1:] == ["2.0", "30.0", "60.0"]                  # a step, median µs, µs a step
    # periods 241 (layer 1's attention: 200 µs), 51, 51: the median's layer is shown, not the first
    assert "51.0 µs from its handoff to the next" in text        # 2 + 30 + 5 + 3 + 1 + 10
    layer = text.split("a typical layer")[1].splitlines()[1:]
    assert [line.split()[-1] for line in layer] == ["_handoff_kernel", "_gather_kernel", "_collect_kernel",
                                                    "attn_kernel"]
    assert [line.split()[1] for line in layer] == ["0.0", "0.0", "5.0", "1.0"]     # the gap before each
    assert [line.split()[2] for line in layer][-1] == "10.0"
