"""Hybrid expert tier benchmarks; the code lives in runtime/experts/bench.py (also `freetoken bench`).

    python benchmarks/bench_hybrid.py probe  [--out DIR]     # bandwidths and CPU expert-kernel rates
    python benchmarks/bench_hybrid.py hybrid [--out DIR]     # decode/prefill over synthetic full-shape models
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.experts.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
